"""``miles-lp bench rl-step``: the ratios and the table from the arms' figures (pure), and the CLI wiring."""

from __future__ import annotations

import math

from miles_lp.bench.rl_step import render, summarize


def _arm(name, step, gen_tokens=500.0, gen_s=5.0):
    return {"arm": name, "recipe": f"recipes/{name}.yaml", "step_s": step, "steps_s": [step],
            "stages_s": {"generate": gen_s, "reward": 0.0, "old_log_prob": 1.0, "update_actor": step - gen_s - 1.5,
                         "sync": 0.3, "checks": 0.2},
            "rollout_tokens_per_s": gen_tokens / gen_s, "tokens_update": 2800.0, "peak_rss_gb": 2.5,
            "load": [1.0, 2.0]}


def test_ratios_to_the_first_arm_and_to_generate():
    rows = [_arm("smollm2-bf16", 10.0), _arm("smollm2-mxfp8", 14.0, gen_s=10.0), {"arm": "x", "error": "exit 1: boom"}]
    anchor = {"tokens_per_s": 50.0, "tokens": 500, "seconds": 10.0, "rows": 64, "max_new_tokens": 8, "repeats": 3,
              "dtype": "bfloat16", "peak_rss_gb": 1.0, "load": [1.0, 1.5]}
    res = summarize(rows, anchor)
    a, b = res["arms"][0], res["arms"][1]
    assert a["step_vs_first"] == 1.0 and math.isclose(b["step_vs_first"], 1.4)
    assert math.isclose(a["rollout_vs_generate"], 2.0) and math.isclose(b["rollout_vs_generate"], 1.0)
    text = render(res)
    assert "| smollm2-mxfp8 | 14.0 | 1.40x |" in text and "failed: exit 1: boom" in text
    assert "transformers generate (bfloat16, 64 rows, <= 8 new tokens): 500 tokens" in text


def test_without_the_generate_anchor_the_ratio_column_reads_a_dash():
    res = summarize([_arm("smollm2-bf16", 10.0)], None)
    assert "rollout_vs_generate" not in res["arms"][0]
    assert "| 100 | - | 2.50 |" in render(res) and "nan" not in render(res)


def test_cli_lists_the_bench(capsys):
    import pytest

    from miles_lp.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "rl-step", "--help"])
    assert "ratios to BF16" in capsys.readouterr().out
