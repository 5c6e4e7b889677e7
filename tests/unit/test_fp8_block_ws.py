"""``formats.kernels.fp8_block_ws``, the warp-specialized Gluon FP8 blockwise GEMM for sm_90: compiled here for
sm_90 without a GPU (Triton's compiler and ptxas) and checked for the structure its speed depends on; its
numerics on the device (``-m gpu``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")


@pytest.mark.parametrize("config,b_block,out", [({}, 1, "bf16"), ({}, 128, "fp32"), ({"bn": 64, "stages": 8}, 128,
                                                                                       "bf16")])
def test_compiles_for_sm90_with_every_wgmma_asynchronous(config, b_block, out):
    """FP8 wgmma at the tile's width, TMA loads, the register budgets moved from the loader warp to the math
    warpgroups, no spill within the 12-warp CTA's 168 registers per thread, and no C7514 note: ptxas kept the
    wgmmas asynchronous (a kernel reading an in-flight accumulator gets them serialized)."""
    from miles_lp.formats.kernels import fp8_block_ws as ws
    from miles_lp.formats.kernels.sass import ptxas_notes, resources

    cfg = {**ws.CONFIG, **config}
    k = ws.compile_sm90(config, b_block, out)
    ptx = k.asm["ptx"]
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg['bn']}k32.f32.e4m3.e4m3" in ptx
    assert "cp.async.bulk.tensor" in ptx
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{cfg['math_regs']}" in ptx
    assert "setmaxnreg.dec.sync.aligned.u32 \t24" in ptx
    assert "wgmma.wait_group.sync.aligned 0" in ptx
    assert not any("C7514" in n for n in ptxas_notes(k))
    assert resources(k).get("stack", 0) == 0


def test_refuses_what_it_cannot_run():
    from miles_lp.errors import FormatError
    from miles_lp.formats.kernels import fp8_block_ws as ws

    a = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    s = torch.ones(128, 2)
    with pytest.raises(FormatError, match="runs on sm_90 GPUs only"):
        ws.block_mm(a, s, a, s, 1)
    with pytest.raises(FormatError, match="must share K"):
        ws.block_mm(a, s, a[:, :128], s[:, :1], 1)
    assert "cpu" in ws.unavailable_reason(torch.device("cpu"))


@pytest.mark.gpu
def test_selfcheck_cuda():
    """On an sm_90 GPU: within FP32_REL_TOL of the emulation (partial tiles, outliers, a zero row, both scale
    layouts on b, both scale rules), the bf16 result the fp32 one rounded once."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    from miles_lp.formats.kernels import fp8_block_ws as ws

    assert ws.selfcheck("cuda") == []
