"""The Gluon wgrad GEMMs of ``scripts/h200_fp8_block_gluon.py`` (device probes; both ran correctly on the H200 and
both were slower than cuBLAS) compile for sm_90 here (Triton's compiler and ptxas, no GPU). The one-partition
kernel: FP8 wgmma at the planned tiles, the wait for one outstanding wgmma, TMA loads, no spills, and ptxas
serializing its wgmmas for that very overlap (C7514). The warp-specialized one: a loader warp and two math
warpgroups with register budgets of their own, no wgmma serialized, nothing spilled."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon")
_PATH = Path(__file__).resolve().parents[2] / "scripts" / "h200_fp8_block_gluon.py"


def _probe():
    spec = importlib.util.spec_from_file_location("h200_fp8_block_gluon", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("index", [0, 1, 2])
def test_gluon_wgrad_compiles_for_sm90(index):
    from miles_lp.formats.kernels.sass import resources

    probe = _probe()
    plan = probe.PLANS[index]
    k = probe.compile_sm90(plan)
    ptx = k.asm["ptx"]
    bm, bn, warps, _ = plan
    assert f"wgmma.mma_async.sync.aligned.m64n{bn}k32.f32.e4m3.e4m3" in ptx
    waits = set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx))
    assert "1" in waits  # one wgmma left in flight while the previous block is scaled
    assert "cp.async.bulk.tensor" in ptx  # TMA
    assert resources(k).get("stack", 0) == 0


def test_gluon_wgrad_compiles_with_weight_scales():
    k = _probe().compile_sm90((128, 128, 8, 3), b_block=128)
    assert "wgmma.wait_group.sync.aligned 1" in k.asm["ptx"]


def test_one_partition_kernel_is_serialized_by_ptxas():
    """Why the one-partition kernel could not overlap: it reads block kb - 1's product while block kb's wgmma
    is in flight, and ptxas answers by serializing the wgmmas (C7514)."""
    from miles_lp.formats.kernels.sass import ptxas_notes

    assert any("C7514" in n for n in ptxas_notes(_probe().compile_sm90((64, 128, 4, 4))))


@pytest.mark.parametrize("config,b_block,out", [({}, 1, "bf16"), ({}, 128, "fp32"), ({"bn": 64, "stages": 8}, 128,
                                                                                       "bf16"),
                                               ({"stages": 4, "prefetch": 1}, 1, "bf16")])
def test_warp_specialized_kernel_keeps_every_wgmma_asynchronous(config, b_block, out):
    from miles_lp.formats.kernels.sass import ptxas_notes, resources

    probe = _probe()
    cfg = {**probe.WS_CONFIG, **config}
    k = probe.compile_ws_sm90(config, b_block, out)
    ptx = k.asm["ptx"]
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg['bn']}k32.f32.e4m3.e4m3" in ptx
    assert "cp.async.bulk.tensor" in ptx
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{cfg['math_regs']}" in ptx  # the worker math warpgroup's budget
    assert "setmaxnreg.dec.sync.aligned.u32 \t24" in ptx  # the loader warp's
    assert "wgmma.wait_group.sync.aligned 0" in ptx
    assert not any("C7514" in n for n in ptxas_notes(k))
    assert resources(k).get("stack", 0) == 0
