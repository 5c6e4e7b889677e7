"""The embedded learner on an fp8_block plan (CPU, emulated GEMMs): every planned weight runs quantized (C1's
record), training steps stay finite and move the weights, and the export is the codec's 128x128 grid of the new
master, byte for byte, with the plan's scale rule."""

from __future__ import annotations

import pytest
import torch

from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.config import Where
from miles_lp.formats import quantize_fp8_blockwise
from miles_lp.formats.fp8 import FP8BlockTensor
from miles_lp.formats.spec import Format
from miles_lp.policy import parse_policy
from miles_lp.train.config import TrainConfig
from miles_lp.train.embedded import EmbeddedTrainer, plan_for_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"), num_layers=2)


def _samples(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(0, 256, (n,), generator=g)} for n in (40, 33, 50)]


@pytest.mark.parametrize("backward, pow2", [("quantized", True),
                                            pytest.param("dequantized", False, marks=pytest.mark.slow),
                                            pytest.param("high_precision", False, marks=pytest.mark.slow)])
def test_learner_trains_and_exports_the_fp8_block_grid(model_dir, backward, pow2):
    raw = {"default": "fp8_block", "backward": backward, "pow2_scales": pow2,
           "rules": [{"layers": "first 1", "format": "bf16"}]}
    plan = plan_for_model(parse_policy(raw, Where("<test>", "precision"), comparison_formats=True), model_dir)
    tr = EmbeddedTrainer(model_dir, plan, TrainConfig(device="cpu", lr=1e-2))
    want = {n for n, e in plan.entries.items() if e.format is Format.FP8_BLOCK}
    assert want and all(".layers.1." in n for n in want)
    before = {n: q.data.clone() for n, q in tr.export_weights() if n in want}
    for s in range(2):
        assert tr.train_step(_samples(s))["finite"]
    assert set(tr.executed_quantized()) == want and set(tr.executed_quantized().values()) == {"fp8_block"}
    sd = tr.model.state_dict()
    exported = dict(tr.export_weights())
    moved = compared = 0
    for n in want:
        q = exported[n]
        assert isinstance(q, FP8BlockTensor) and q.block == (128, 128)
        master = sd[n] if n in sd else None
        if master is not None:
            ref = quantize_fp8_blockwise(master, (128, 128), pow2)
            assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)), n
            assert torch.equal(q.scale_inv, ref.scale_inv), n
            compared += 1
        assert bool(((q.scale_inv.view(torch.int32) & 0x7FFFFF) == 0).all()) == pow2
        moved += not torch.equal(q.data.view(torch.uint8), before[n].view(torch.uint8))
    assert moved and compared == len(want)  # the steps changed the grid; every export checked against its master
