"""What QuantLinear saves for backward, per backward mode (the byte-count test restated its own
formula). Read with torch's own ``saved_tensors_hooks`` (not miles_lp.train.memory): the exact tensors, their
dtypes and shapes, and their bytes compared with the codecs (CONTRACT 7: high_precision keeps the original
operands; dequantized keeps only the rowwise quantized forward operands; quantized keeps columnwise copies
quantized from full precision)."""

from __future__ import annotations

import pytest
import torch

from miles_lp import formats
from miles_lp.formats.spec import BackwardMode, Format
from miles_lp.train.quant_linear import LinearRecipe, QuantLinear

M, K, N = 64, 128, 96
HP, DEQ, QNT = BackwardMode.HIGH_PRECISION, BackwardMode.DEQUANTIZED, BackwardMode.QUANTIZED


def _saved(fmt, mode):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).bfloat16().requires_grad_(True)
    lin = torch.nn.Linear(K, N, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g) * 0.05)
    ql = QuantLinear.from_linear(lin, LinearRecipe(fmt, mode, "token" if fmt is Format.NVFP4 else None), "w",
                                 kernel="reference")
    seen: list[torch.Tensor] = []

    def pack(t):
        seen.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = ql(x)
    y.float().sum().backward()  # what was saved is enough for backward
    assert x.grad is not None and lin.weight.grad is not None
    return x.detach(), lin.weight.detach(), seen


def _sig(ts):
    return [(t.dtype, tuple(t.shape)) for t in ts]


def _u8(t):
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def test_high_precision_saves_the_original_operands():
    x, w, saved = _saved(Format.MXFP8, HP)
    assert _sig(saved) == [(torch.bfloat16, (M, K)), (torch.bfloat16, (N, K))]
    assert torch.equal(saved[0], x) and torch.equal(saved[1], w)


def test_dequantized_saves_only_the_rowwise_forward_operands():
    x, w, saved = _saved(Format.MXFP8, DEQ)
    assert _sig(saved) == [(torch.float8_e4m3fn, (M, K)), (torch.uint8, (M, K // 32)),
                           (torch.float8_e4m3fn, (N, K)), (torch.uint8, (N, K // 32))]
    qx, qw = formats.quantize_mxfp8(x), formats.quantize_mxfp8(w)
    for got, want in zip(saved, (qx.data, qx.scale, qw.data, qw.scale), strict=True):
        assert torch.equal(_u8(got), _u8(want))
    assert sum(t.numel() * t.element_size() for t in saved) == (M * K + N * K) * (1 + 1 / 32)


def test_quantized_saves_columnwise_copies_quantized_from_full_precision():
    x, w, saved = _saved(Format.MXFP8, QNT)
    assert _sig(saved) == [(torch.float8_e4m3fn, (M, K)), (torch.uint8, (M // 32, K)),
                           (torch.float8_e4m3fn, (N, K)), (torch.uint8, (N // 32, K))]
    cx, cw = formats.quantize_mxfp8(x, axis=-2), formats.quantize_mxfp8(w, axis=-2)
    for got, want in zip(saved, (cx.data, cx.scale, cw.data, cw.scale), strict=True):
        assert torch.equal(_u8(got), _u8(want))
    rx = formats.quantize_mxfp8(x)
    assert not torch.equal(_u8(saved[0]), _u8(rx.data))  # not the rowwise grid (the two differ)


@pytest.mark.parametrize("mode", [DEQ])
def test_nvfp4_dequantized_saves_packed_codes_block_and_per_token_scales(mode):
    x, w, saved = _saved(Format.NVFP4, mode)
    assert _sig(saved) == [(torch.uint8, (M, K // 2)), (torch.float8_e4m3fn, (M, K // 16)),
                           (torch.float32, (M, 1)), (torch.float32, (M, 1)),
                           (torch.uint8, (N, K // 2)), (torch.float8_e4m3fn, (N, K // 16)),
                           (torch.float32, ()), (torch.float32, ())]
    qx = formats.quantize_nvfp4(x, scale_scope="row")
    qw = formats.quantize_nvfp4(w)
    assert torch.equal(saved[0], qx.data) and torch.equal(_u8(saved[1]), _u8(qx.scale))
    assert torch.equal(saved[4], qw.data) and torch.equal(_u8(saved[5]), _u8(qw.scale))
    assert {float(saved[6]), float(saved[7])} == {float(qw.global_scale), float(qw.amax)}
    assert not any(t.dtype == torch.bfloat16 for t in saved)  # no high-precision copy kept
