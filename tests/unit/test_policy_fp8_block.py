"""fp8_block as a policy format of the learner: parsing, ``pow2_scales`` (policy and rule), the plan's entries, their
JSON (unchanged for every plan without pow2), the joint-group rule and the learner recipe built from it; and the
refusal, naming the key, of a recipe's ``precision:`` section until an engine checkpoint can hold it."""

from __future__ import annotations

import json

import pytest

from miles_lp.checkpoint.tiny import tiny_config
from miles_lp.config import Where
from miles_lp.errors import ConfigError
from miles_lp.formats.spec import BackwardMode, Format
from miles_lp.policy import compile_plan, get_layout, parse_policy
from miles_lp.policy.plan import PrecisionPlan
from miles_lp.train.recipe import LinearRecipe


def _plan(d, arch="qwen3"):
    policy = parse_policy(d, Where("r.yaml", "precision"), comparison_formats=True)
    return compile_plan(policy, get_layout(tiny_config(arch).to_dict()))


def test_precision_accepts_fp8_block_with_all_backward_modes():
    for bw in ("high_precision", "dequantized", "quantized"):
        plan = _plan({"default": "fp8_block", "backward": bw})
        q = plan.quantized()
        assert q and {e.format for e in q.values()} == {Format.FP8_BLOCK}
        assert {e.backward for e in q.values()} == {BackwardMode(bw)}
        assert not any(e.pow2_scales for e in q.values())
        r = LinearRecipe.from_entry(next(iter(q.values())))
        assert r.format is Format.FP8_BLOCK and r.backward is BackwardMode(bw) and not r.pow2_scales


def test_pow2_scales_policy_and_rule():
    plan = _plan({"default": "fp8_block", "pow2_scales": True,
                  "rules": [{"role": "mlp", "format": "fp8_block", "pow2_scales": False},
                            {"layers": "first 1", "format": "bf16"}]})
    entries = plan.quantized()
    mlp = [e for n, e in entries.items() if ".mlp." in n]
    attn = [e for n, e in entries.items() if ".self_attn." in n]
    assert mlp and attn
    assert not any(e.pow2_scales for e in mlp) and all(e.pow2_scales for e in attn)
    assert all(LinearRecipe.from_entry(e).pow2_scales for e in attn)
    # the JSON round trip keeps it, and the policy records it
    back = PrecisionPlan.from_json(plan.to_json())
    assert back == plan and all(back.entries[e.name].pow2_scales for e in attn)
    assert plan.policy["pow2_scales"] is True


def test_plans_without_pow2_keep_their_json():
    plan = _plan({"default": "mxfp8"})
    d = json.loads(plan.to_json())
    assert "pow2_scales" not in d["policy"]
    assert {len(row) for row in d["entries"].values()} == {10}
    plan = _plan({"default": "fp8_block"})
    assert {len(row) for row in json.loads(plan.to_json())["entries"].values()} == {10}


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "bf16"])
def test_pow2_scales_refused_on_other_formats(fmt):
    with pytest.raises(ConfigError, match=r"r.yaml.*'precision.rules.0.pow2_scales': pow2_scales applies to "
                                          r"fp8_block only"):
        _plan({"default": "fp8_block", "rules": [{"role": "mlp", "format": fmt, "pow2_scales": True}]})
    with pytest.raises(ConfigError, match="pow2_scales applies to fp8_block only"):
        LinearRecipe(Format.MXFP8, pow2_scales=True)


def test_joint_group_must_share_pow2():
    with pytest.raises(ConfigError, match="gate and up of .* must share one format and scale"):
        _plan({"default": "fp8_block", "rules": [{"match": "*.gate_proj", "format": "fp8_block",
                                                  "pow2_scales": True}]})


def test_unknown_key_named():
    with pytest.raises(ConfigError, match=r"unknown key 'pow2_scale'"):
        _plan({"default": "fp8_block", "pow2_scale": True})


def test_recipe_precision_section_takes_fp8_block(tmp_path):
    """Engine checkpoints hold fp8_block now: a recipe's precision: section takes it (learner + sampler on one grid),
    and the comparison arm still parses."""
    from miles_lp.policy import load_policy
    from miles_lp.policy.policy import ENGINE_PENDING

    assert ENGINE_PENDING == ()
    r = tmp_path / "r.yaml"
    r.write_text("precision:\n  default: fp8_block\n  pow2_scales: true\n  rules:\n    - {layers: first 1, format: bf16}\n")
    p = load_policy(r)
    assert p.default is Format.FP8_BLOCK and p.pow2_scales
    r.write_text("precision:\n  default: mxfp8\nsampler_precision:\n  default: fp8_block\n")
    assert load_policy(r, "sampler_precision").default is Format.FP8_BLOCK  # the comparison arm still parses