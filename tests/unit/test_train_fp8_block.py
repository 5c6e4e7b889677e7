"""QuantLinear in fp8_block on CPU (the emulated path, the reference): the forward on the codec's grids, the three
backward modes against their definitions written out with the codec, pow2 scales, the per-step weight grid and
what the learner exports (the forward grid, byte for byte)."""

from __future__ import annotations

import pytest
import torch

from miles_lp.formats import quantize_fp8_blockwise
from miles_lp.formats.fp8 import FP8BlockTensor
from miles_lp.formats.spec import BackwardMode, Format
from miles_lp.train.quant_linear import LinearRecipe, QuantLinear, learner_weights


def _deq(x, block, pow2):
    return quantize_fp8_blockwise(x, block, pow2).dequantize(torch.float32)


def _setup(m=200, n=256, k=384, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).to(dtype).requires_grad_(True)
    lin = torch.nn.Linear(k, n, bias=True).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(n, generator=g))
    dy = torch.randn(m, n, generator=g).to(dtype)
    return x, lin, dy


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("mode", list(BackwardMode))
def test_forward_and_backward_follow_their_definitions(mode, pow2):
    x, lin, dy = _setup()
    ql = QuantLinear.from_linear(lin, LinearRecipe(Format.FP8_BLOCK, mode, pow2_scales=pow2), canonical="l.weight")
    y = ql(x)
    y.backward(dy)
    xd = x.detach()
    w = lin.weight.detach()
    x_deq = _deq(xd, (1, 128), pow2)
    w_deq = _deq(w, (128, 128), pow2)
    y_ref = x_deq @ w_deq.t() + lin.bias.detach()
    torch.testing.assert_close(y.detach(), y_ref, rtol=1e-5, atol=1e-5)
    if mode is BackwardMode.HIGH_PRECISION:
        dx_ref, dw_ref = dy @ w, dy.t() @ xd
    elif mode is BackwardMode.DEQUANTIZED:
        dx_ref, dw_ref = dy @ w_deq, dy.t() @ x_deq
    else:  # dgrad: dy in 1x128 tiles along N, w 128x128; wgrad: dy and x in 128x1 tiles (along tokens)
        dx_ref = _deq(dy, (1, 128), pow2) @ w_deq
        dw_ref = _deq(dy, (128, 1), pow2).t() @ _deq(xd, (128, 1), pow2)
    torch.testing.assert_close(x.grad, dx_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(lin.weight.grad, dw_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(lin.bias.grad, dy.sum(0), rtol=1e-5, atol=1e-4)
    assert ql.executed_quantized() == {"l.weight": "fp8_block"}


def test_quantized_mode_differs_from_dequantized():
    """The modes are distinct computations (a wrong mode dispatch would make them equal)."""
    grads = {}
    for mode in (BackwardMode.DEQUANTIZED, BackwardMode.QUANTIZED, BackwardMode.HIGH_PRECISION):
        x, lin, dy = _setup(seed=1)
        QuantLinear.from_linear(lin, LinearRecipe(Format.FP8_BLOCK, mode))(x).backward(dy)
        grads[mode] = (x.grad.clone(), lin.weight.grad.clone())
    a, b, c = grads.values()
    assert not torch.equal(a[0], b[0]) and not torch.equal(a[1], b[1]) and not torch.equal(a[0], c[0])


def test_pow2_scales_are_powers_of_two_and_export_is_the_forward_grid():
    x, lin, _ = _setup()
    for pow2 in (False, True):
        ql = QuantLinear.from_linear(lin, LinearRecipe(Format.FP8_BLOCK, pow2_scales=pow2), canonical="l.weight")
        ql(x)
        (name, q), = list(learner_weights(ql))
        assert name == "l.weight" and isinstance(q, FP8BlockTensor) and q.block == (128, 128)
        ref = quantize_fp8_blockwise(lin.weight.detach(), (128, 128), pow2)
        assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(q.scale_inv, ref.scale_inv)
        mant = q.scale_inv.view(torch.int32) & 0x7FFFFF
        assert bool((mant == 0).all()) == pow2
        assert ql.grid.quantize_calls == 1  # the forward's grid, reused by the export


def test_grid_is_quantized_once_per_step():
    x, lin, dy = _setup()
    ql = QuantLinear.from_linear(lin, LinearRecipe(Format.FP8_BLOCK, BackwardMode.QUANTIZED))
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    for _ in range(2):
        ql(x).backward(dy)
    assert ql.grid.quantize_calls == 1  # forward, dgrad (the same 128x128 tiles) and a second micro-batch
    opt.step()
    ql(x)
    assert ql.grid.quantize_calls == 2


def test_unaligned_shapes_use_partial_tiles():
    x, lin, dy = _setup(m=37, n=100, k=200)
    ql = QuantLinear.from_linear(lin, LinearRecipe(Format.FP8_BLOCK, BackwardMode.QUANTIZED))
    y = ql(x)
    y.backward(dy)
    w_deq = _deq(lin.weight.detach(), (128, 128), False)
    torch.testing.assert_close(y.detach(), _deq(x.detach(), (1, 128), False) @ w_deq.t() + lin.bias.detach(),
                               rtol=1e-5, atol=1e-5)
    assert torch.isfinite(x.grad).all() and torch.isfinite(lin.weight.grad).all()


def test_bf16_activations_on_cpu_decode_in_fp32():
    """Arbitrary fp32 scales: a bf16 decode would round; the emulation decodes to fp32 (pow2: bf16-exact)."""
    x, lin, dy = _setup(dtype=torch.bfloat16)
    ql = QuantLinear.from_linear(lin, LinearRecipe(Format.FP8_BLOCK))
    y = ql(x)
    ref = (_deq(x.detach(), (1, 128), False) @ _deq(lin.weight.detach(), (128, 128), False).t()
           + lin.bias.detach().float())
    torch.testing.assert_close(y.float(), ref.to(torch.bfloat16).float(), rtol=0, atol=0)
