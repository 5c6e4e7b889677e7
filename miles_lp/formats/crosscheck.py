"""Device cross-check: every codec on two devices (CPU and CUDA) over representative inputs, byte for byte.

Used by ``scripts/check_formats_cuda.py`` and the ``gpu`` test. Needs only torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from miles_lp.formats import bits
from miles_lp.formats.fp8 import quantize_fp8_blockwise, quantize_fp8_tensorwise
from miles_lp.formats.mxfp8 import quantize_mxfp8
from miles_lp.formats.nvfp4 import quantize_nvfp4, quantize_nvfp4_pair
from miles_lp.formats.swizzle import swizzle_scales


@dataclass(frozen=True)
class Row:
    format: str
    case: str
    bytes_compared: int
    mismatches: int


def _boundary(n_rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    p = [448.0 * 2.0**e for e in range(-126, 120, 5)]
    grid = [bits.e4m3_value(c) for c in range(0x7F)]
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:], strict=False)]
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    vals = torch.tensor(p + mids + ties + [torch.finfo(torch.bfloat16).max, 2.0**-133, 1e-40])
    vals = torch.cat([vals, torch.nextafter(vals, vals * 2), torch.nextafter(vals, vals * 0)])
    vals = torch.cat([vals, -vals])
    idx = torch.randint(0, vals.numel(), (n_rows * k,), generator=g)
    return vals[idx].reshape(n_rows, k)


def cases(seed: int = 0) -> dict[str, torch.Tensor]:
    """Named fp32 / bf16 inputs on CPU (random, boundary, zeros, max, NaN/inf, expert stacks)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for shape in [(64, 128), (256, 512), (96, 2048)]:
        out[f"randn{shape}"] = torch.randn(shape, generator=g)
        out[f"randn_bf16{shape}"] = torch.randn(shape, generator=g).bfloat16()
    out["wide_dynamic(128,256)"] = torch.randn(128, 256, generator=g) * torch.logspace(-30, 30, 128).unsqueeze(1)
    out["heavy_tail(128,256)"] = torch.randn(128, 256, generator=g) / torch.rand(128, 256, generator=g).clamp(min=1e-6)
    out["boundary(128,256)"] = _boundary(128, 256, g)
    out["zeros(64,64)"] = torch.zeros(64, 64)
    out["bf16_max(32,64)"] = torch.full((32, 64), torch.finfo(torch.bfloat16).max).bfloat16()
    special = torch.randn(64, 128, generator=g)
    special[0, 3] = math.nan
    special[1, :32] = math.nan
    special[2, 5] = math.inf
    special[3, 40] = -math.inf
    special[4, 7] = -math.nan
    special[5] = -0.0
    out["nan_inf(64,128)"] = special
    out["subnormal(32,64)"] = torch.randn(32, 64, generator=g) * 1e-40
    out["experts(4,64,256)"] = torch.randn(4, 64, 256, generator=g).bfloat16()
    out["experts_fp16(2,32,64)"] = torch.randn(2, 32, 64, generator=g).half()
    return out


def _quantizers() -> list[tuple[str, Callable[[torch.Tensor], dict[str, torch.Tensor]]]]:
    def comp(q):
        return q.components()

    def pair(x):
        gq, uq = quantize_nvfp4_pair(x, x * 0.5)
        return {**{f"gate.{k}": v for k, v in gq.components().items()},
                **{f"up.{k}": v for k, v in uq.components().items()}}

    return [
        ("mxfp8 rowwise", lambda x: comp(quantize_mxfp8(x))),
        ("mxfp8 colwise", lambda x: comp(quantize_mxfp8(x, axis=-2))),
        ("nvfp4 tensor", lambda x: comp(quantize_nvfp4(x))),
        ("nvfp4 row", lambda x: comp(quantize_nvfp4(x, scale_scope="row"))),
        ("nvfp4 2d", lambda x: comp(quantize_nvfp4(x, block_2d=True))),
        ("nvfp4 pair", pair),
        ("fp8 block128", lambda x: comp(quantize_fp8_blockwise(x))),
        ("fp8 block128 pow2", lambda x: comp(quantize_fp8_blockwise(x, pow2_scales=True))),
        ("fp8 tensor", lambda x: comp(quantize_fp8_tensorwise(x))),
        ("mxfp8 swizzled scale", lambda x: {"swizzled": swizzle_scales(quantize_mxfp8(x).scale)}),
        ("mxfp8 dequant", lambda x: {"deq": quantize_mxfp8(x).dequantize(torch.float32)}),
        ("nvfp4 dequant", lambda x: {"deq": quantize_nvfp4(x).dequantize(torch.float32)}),
    ]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().cpu()
    if t.is_floating_point() and t.element_size() > 1:
        # Decoded values: NaN payloads are not part of the contract (CPU and CUDA canonicalise NaN
        # differently after a multiply); the E4M3 / E2M1 / E8M0 codes, compared raw, are.
        t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def compare_devices(device_a: str = "cpu", device_b: str = "cuda", seed: int = 0) -> Iterator[Row]:
    """Yield one Row per (format, case): the bytes of all components compared between two devices."""
    from miles_lp.errors import FormatError

    for case, x in cases(seed).items():
        for fmt, fn in _quantizers():
            try:
                a = fn(x.to(device_a))
            except FormatError:  # e.g. rows not a multiple of 32 / 16 for this layout: not applicable
                continue
            b = fn(x.to(device_b))
            compared = mismatched = 0
            for key in a:
                ba, bb = as_bytes(a[key]), as_bytes(b[key])
                if ba.shape != bb.shape:
                    compared, mismatched = compared + ba.numel(), mismatched + ba.numel()
                    continue
                compared += ba.numel()
                mismatched += int((ba != bb).sum())
            yield Row(fmt, case, compared, mismatched)
