"""The native FP8 blockwise GEMMs (``miles_lp.train.fp8_block_gemm``) on an sm_90 GPU: each GEMM within
``REL_TOL`` of the emulated one on the same (codec-identical) operands, a wrong scale layout caught by the same
check, and QuantLinear's native path against its emulated path in every backward mode."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _need_hopper():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from miles_lp.train import fp8_block_gemm

    x = torch.empty(128, 128, device="cuda", dtype=torch.bfloat16)
    why = fp8_block_gemm.unavailable_reason(x, x)
    if why:
        pytest.skip(why)


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("m, n, k", [(256, 384, 512), (200, 256, 640), (2048, 1024, 2048)])
@pytest.mark.parametrize("pow2", [False, True])
def test_gemms_match_the_emulation(m, n, k, pow2):
    _need_hopper()
    from miles_lp.formats.kernels import fp8_block as k8
    from miles_lp.train import fp8_block_gemm as G

    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    xr, xc, (xs, xcs) = k8.quantize_act(x, pow2, rows=True, cols=True)
    gr, gc, (gs, gcs) = k8.quantize_act(dy, pow2, rows=True, cols=True)
    wq, wt = k8.quantize_weight(w, pow2)
    ops = G.WeightOperands(wq, wt)
    y = G.forward_mm(xs, ops)
    assert y.shape == (m, n) and _rel(y, G.emulated_mm(xr, wq)) < G.REL_TOL
    dx = G.dgrad_mm(gs, ops)
    ref_dx = gr.dequantize(torch.float32) @ wq.dequantize(torch.float32)
    assert dx.shape == (m, k) and _rel(dx, ref_dx) < G.REL_TOL
    dw = G.wgrad_mm(gcs, xcs)
    ref_dw = gc.dequantize(torch.float32).t() @ xc.dequantize(torch.float32)
    assert dw.shape == (n, k) and _rel(dw, ref_dw) < G.REL_TOL


def test_wrong_scale_layout_is_caught():
    """The check above can fail: the weight's block scales stored out-fastest (``[K/128, N/128]`` contiguous, a
    layout some torch versions accept) are the wrong pairing."""
    _need_hopper()
    from miles_lp.formats.kernels import fp8_block as k8
    from miles_lp.train import fp8_block_gemm as G

    torch.manual_seed(1)
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16) * torch.rand(512, 1, device="cuda") * 4
    xr, _, (xs, _) = k8.quantize_act(x, False)
    wq, wt = k8.quantize_weight(w, False)
    good = G.forward_mm(xs, G.WeightOperands(wq, wt))
    try:
        bad = G._mm(xs.data, xs.scale_inv, wq.data.t(), wq.scale_inv.t().contiguous(), "BlockWise128x128")
    except (RuntimeError, ValueError):
        pytest.skip("this torch refuses the K-fastest layout outright")
    ref = G.emulated_mm(xr, wq)
    assert _rel(good, ref) < G.REL_TOL < _rel(bad, ref)


@pytest.mark.parametrize("mode", ["high_precision", "dequantized", "quantized"])
@pytest.mark.parametrize("operands", ["configured", "tma", "triton"])
def test_quant_linear_native_vs_emulated(mode, operands, monkeypatch):
    """``operands``: the operand kernels as configured, the Gluon TMA kernels at any size, the Triton ones."""
    _need_hopper()
    from miles_lp.formats.kernels import fp8_block as k8
    from miles_lp.formats.spec import BackwardMode, Format
    from miles_lp.train.quant_linear import LinearRecipe, QuantLinear

    if operands == "tma":
        monkeypatch.setitem(k8.CONFIG, "tma_min_tiles", 0)
        for key in ("act_both", "act_cols", "weight"):
            if k8.CONFIG[key] not in k8.TMA_VARIANTS:
                monkeypatch.setitem(k8.CONFIG, key, "tma_s2o1_w8_x2")
    elif operands == "triton":
        for key, v in (*k8._TRITON.items(), ("weight", "tile")):
            monkeypatch.setitem(k8.CONFIG, key, v)

    torch.manual_seed(2)
    lin = torch.nn.Linear(1024, 768, bias=True, device="cuda", dtype=torch.bfloat16)
    x0 = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(300, 768, device="cuda", dtype=torch.bfloat16)
    out = {}
    for kernel in ("auto", "reference"):
        ql = QuantLinear.from_linear(lin, LinearRecipe(Format.FP8_BLOCK, BackwardMode(mode)), kernel=kernel)
        x = x0.clone().requires_grad_(True)
        lin.weight.grad = lin.bias.grad = None
        y = ql(x)
        y.backward(dy)
        out[kernel] = (y.detach(), x.grad, lin.weight.grad, ql.grid.rowwise(lin.weight))
    (y_n, dx_n, dw_n, q_n), (y_e, dx_e, dw_e, q_e) = out["auto"], out["reference"]
    # the native path's weight grid is the codec's, byte for byte
    assert torch.equal(q_n.data.view(torch.uint8), q_e.data.view(torch.uint8))
    assert torch.equal(q_n.scale_inv, q_e.scale_inv)
    tol = 1e-2  # bf16 outputs of the two paths (one bf16 rounding each) on top of REL_TOL
    assert _rel(y_n, y_e) < tol and _rel(dx_n, dx_e) < tol and _rel(dw_n, dw_e) < tol


def test_bench_linear_graphs_replay_the_eager_bytes_fresh_and_cached():
    """``bench linear --graph``'s two graphs per mode: the fresh one quantizes the weight in every replay, the cached
    one was captured with the grid built. Each replay's output and gradients are bit-equal to an eager step's."""
    _need_hopper()
    from miles_lp.bench import linear as BL

    rows = BL.bench([(1024, 1024, 2048)], modes=[("fp8_block", "quantized")], kernels=["compiled"], graph=True,
                    warmup=2, iters=5)
    (g,) = [r for r in rows if r["kernel"] == "graphed"]
    assert g["identical"] is True
    assert 0 < g["ms_cached"] and 0 < g["ms_fresh"] and 0 < g["pipelined_cached_ms"]
