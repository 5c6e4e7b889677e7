"""C3's exact companion: the serving kernel vs the same kernel on freshly derived state (``fresh_diff``).

The relative error against a float64 GEMM cannot see derived state left from the previous weights after an
RL-sized step (it stays at the healthy quantization error); ``fresh_diff`` is exactly 0 when healthy and
non-zero as soon as one derived byte is stale.
"""

from __future__ import annotations

import pytest
import torch

from miles_lp.rollout.reference import EngineFaults, ReferenceEngine
from miles_lp.rollout.testing import tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = "policies/qwen3-moe-mxfp8-nvfp4-experts.yaml"


def _nudged(engine: ReferenceEngine) -> list[tuple[str, torch.Tensor]]:
    """An update that moves column 0 of every MXFP8 weight by one E4M3 code (BF16 and NVFP4 tensors are not
    sent): a small, RL-sized change, so the re-derived operand differs in a few elements only."""
    out = []
    for name, t in engine.read_weights([n for n in engine.weight_digests()]).items():
        if t.dtype == torch.float8_e4m3fn and name.endswith(".weight"):
            codes = t.view(torch.uint8).clone()
            flip = (codes & 0x7F) < 0x7E  # away from NaN / max
            codes[..., 0] = torch.where(flip[..., 0], codes[..., 0] + 1, codes[..., 0])  # one column moves
            out.append((name, codes.view(torch.float8_e4m3fn)))
    return out


@pytest.mark.parametrize("skip", [False, True], ids=["healthy", "stale"])
def test_fresh_diff_exact_zero_when_healthy_nonzero_when_stale(skip):
    ckpt = tiny_checkpoint("qwen3_moe", RECIPE)
    faults = EngineFaults(skip_rebuild=("*",)) if skip else EngineFaults()
    eng = ReferenceEngine(ckpt, device="cpu", faults=faults)
    assert eng.self_check()["ok"]  # at load everything is derived afresh, fault or not
    eng.begin_weight_update()
    eng.update_weights(_nudged(eng))
    eng.finish_weight_update()
    report = eng.self_check()
    layers = report["layers"]
    assert layers and all(v["rel_err"] < 0.25 for v in layers.values())  # the tolerance alone sees nothing
    dense = [v for v in layers.values() if v["kind"] == "dense"]
    assert dense
    if skip:
        assert dense[0]["fresh_diff"] > 0 and not report["ok"]
    else:
        assert all(v["fresh_diff"] == 0 for v in layers.values()) and report["ok"]
