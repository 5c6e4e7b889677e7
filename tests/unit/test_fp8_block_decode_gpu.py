"""The FP8 blockwise decode GEMM (``miles_lp.formats.kernels.fp8_block_decode``) on an sm_90 GPU: the selfcheck
(emulation within ``REL_TOL`` / ``FP32_REL_TOL``, prologue bytes equal to the codec), the 0.5B decode shapes
against the emulation and cuBLAS's block-scaled GEMM, and capture in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

#: Qwen2.5-0.5B's decode GEMMs (N, K): q/k/v concatenated, o, gate/up concatenated, down
SHAPES_05B = ((1152, 896), (896, 896), (9728, 896), (896, 4864))


def _need_hopper():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("tl.dot on float8e4nv: sm_90 (Hopper) here")


def _operands(m, n, k, seed=0):
    from miles_lp.formats.fp8 import quantize_fp8_blockwise

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16).cuda()
    w = quantize_fp8_blockwise((torch.randn(n, k, generator=g) * 0.05).cuda(), (128, 128), False)
    return x, w


@pytest.mark.parametrize("dot", ["fp8", "bf16"])
def test_selfcheck_on_the_device(dot):
    _need_hopper()
    from miles_lp.formats.kernels import fp8_block_decode as d

    # (each launch variant compiles, ~0.5 s: few shapes, covering M = 1, a partial M tile and split-K)
    shapes = [(1, 128, 128), (5, 256, 384), (17, 1152, 896)] if dot == "fp8" else [(5, 256, 384)]
    assert d.selfcheck("cuda", shapes=shapes, dot=dot) == []


@pytest.mark.parametrize("m", [1, 8, 32, 64])
@pytest.mark.parametrize("n, k", SHAPES_05B)
def test_decode_shapes_match_the_emulation_and_scaled_mm(m, n, k):
    _need_hopper()
    pow2 = m == 8  # (each variant compiles: both scale rules, not every shape twice)
    from miles_lp.formats.kernels import fp8_block as fk
    from miles_lp.formats.kernels import fp8_block_decode as d
    from miles_lp.train import fp8_block_gemm as G

    x, w = _operands(m, n, k)
    ref = d.emulated_mm(x, w.data, w.scale_inv, pow2)
    y = d.decode_mm(x, w.data, w.scale_inv, pow2)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert d.rel_err(y, ref) <= d.REL_TOL
    assert torch.equal(y, d.decode_mm(x, w.data, w.scale_inv, pow2))  # deterministic (no atomics)
    if m in (32, 64):  # fp32 output (the tighter bound) and the bf16-dot variant (each variant compiles: not all)
        assert d.rel_err(d.decode_mm(x, w.data, w.scale_inv, pow2, out_dtype=torch.float32), ref) <= d.FP32_REL_TOL
        y16 = d.decode_mm(x, w.data, w.scale_inv, pow2, dot="bf16", out_dtype=torch.float32)
        assert d.rel_err(y16, ref) <= d.FP32_REL_TOL
    if G.unavailable_reason(x, w.data) is None:
        _, _, (xs, _) = fk.quantize_act(x, pow2, rows=True, grids=False)
        native = G.forward_mm(xs, G.WeightOperands(w, w.data.t()))
        assert d.rel_err(native, ref) <= d.REL_TOL  # (cuBLAS's bf16 output: the same rounding bound)
        assert d.rel_err(y, native) <= 2 * d.REL_TOL


def test_capture_in_a_cuda_graph():
    _need_hopper()
    from miles_lp.formats.kernels import fp8_block_decode as d

    x, w = _operands(32, 896, 4864)  # split-K: two launches and a partials buffer from the graph's pool
    assert d.plan(32, 896, 4864, torch.cuda.get_device_properties(0).multi_processor_count)[2] > 1
    d.decode_mm(x, w.data, w.scale_inv, False)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = d.decode_mm(x, w.data, w.scale_inv, False)
    x2, _ = _operands(32, 896, 4864, seed=1)
    x.copy_(x2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, d.decode_mm(x2, w.data, w.scale_inv, False))
