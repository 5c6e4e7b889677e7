"""The start-time guard for the learner/engine dtype gap: FP32 masters computing while the export sends BF16
(``train.rounded_export``). It fires naming ``train.param_dtype`` and goes quiet once the learner computes with
what it sends."""

from __future__ import annotations

import warnings

import pytest

from miles_lp.config import Where, parse_dataclass
from miles_lp.errors import ConfigError
from miles_lp.rollout.testing import policy_for, tiny_hf
from miles_lp.train.config import TrainConfig
from miles_lp.train.embedded import EmbeddedTrainer, plan_for_model


def _trainer(precision=None, **kw):
    path = tiny_hf("qwen3", 0, 2)  # a bf16 checkpoint
    plan = plan_for_model(policy_for(precision), path) if precision else None
    cfg = parse_dataclass(TrainConfig, {"device": "cpu", **kw}, Where("<t>", "train"))
    return EmbeddedTrainer(path, plan, cfg)


@pytest.mark.parametrize("precision", [None, "mxfp8"])
def test_fp32_masters_exporting_bf16_warn_naming_the_key(precision):
    with pytest.warns(UserWarning, match=r"train\.param_dtype: the learner computes with fp32 weights but exports "
                                         r"\d+ tensor\(s\) as bf16.*Set train\.param_dtype: bf16"):
        _trainer(precision)


def test_raise_mode_refuses_at_start():
    with pytest.raises(ConfigError, match=r"train\.param_dtype: .*never reaches the engine"):
        _trainer("mxfp8", rounded_export="raise")


def test_mxfp8_gap_lists_only_the_tensors_sent_unquantized():
    from miles_lp.train.embedded import rounded_exports

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = _trainer("mxfp8")
    gap = {n for n, _, _ in rounded_exports(tr.model, tr.layout, tr.swap.quantized_names, tr.source)}
    assert gap and not gap & tr.swap.quantized_names
    assert any("norm" in n for n in gap) and "model.embed_tokens.weight" in gap


@pytest.mark.parametrize("kw", [{"param_dtype": "bf16"}, {"master_dtype": "bf16"}, {"rounded_export": "allow"}])
def test_quiet_when_computing_with_what_is_sent(kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tr = _trainer("mxfp8", **kw)
    assert tr.model is not None
