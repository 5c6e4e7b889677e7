"""The FP8 blockwise decode GEMM (``miles_lp.formats.kernels.fp8_block_decode``) on CPU under Triton's interpreter
(in a subprocess: Triton must be imported with ``TRITON_INTERPRET=1``): its result within ``REL_TOL`` (bf16) /
``FP32_REL_TOL`` (fp32) of the emulated GEMM on the codec's operands, with and without split-K, and its fused
activation quantization byte-identical to the codec; the launch plan; the refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

_SCRIPT = r"""
import itertools, json, torch
from miles_lp.formats.fp8 import quantize_fp8_blockwise
from miles_lp.formats.kernels import fp8_block_decode as d
out = {"bad": d.selfcheck("cpu", shapes=list(itertools.product((1, 5, 32), (128, 256), (128, 384))))}
# what the checks must catch: one weight-scale block off by 2x, the other scale rule's prologue bytes
g = torch.Generator().manual_seed(1)
x = (torch.randn(5, 384, generator=g) * 3).to(torch.bfloat16)
w = quantize_fp8_blockwise(torch.randn(256, 384, generator=g) * 0.05, (128, 128), False)
ref = d.emulated_mm(x, w.data, w.scale_inv, False)
s = w.scale_inv.clone()
s[1, 2] *= 2
out["scale_err"] = d.rel_err(d.decode_mm(x, w.data, s, False), ref)
y, (aq, asc) = d.decode_mm(x, w.data, w.scale_inv, True, store_act=True)
codec = quantize_fp8_blockwise(x, (1, 128), False)
out["pow2_bytes_equal"] = bool(torch.equal(aq, codec.data.view(torch.uint8)))
out["pow2_scales_equal"] = bool(torch.equal(asc, codec.scale_inv))
out["split_equal"] = bool(torch.equal(d.decode_mm(x, w.data, w.scale_inv, False, split=3),
                                      d.decode_mm(x, w.data, w.scale_inv, False, split=3)))
print("JSON" + json.dumps(out))
"""


def _interpreted() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    p = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("JSON"))[4:])


def test_decode_gemm_matches_the_emulation_interpreted():
    """M in {1, 5, 32}, N in {128, 256}, K in {128, 384}, both scale rules, split 1 and one split per K block: the
    prologue's bytes equal the codec's, the fp32 result is within FP32_REL_TOL of the emulation, the bf16 result is
    it rounded once (within REL_TOL); and what those checks must catch is caught (15-25 s on 2 shared CPU cores)."""
    from miles_lp.formats.kernels import fp8_block_decode as d

    out = _interpreted()
    assert out["bad"] == []
    assert out["scale_err"] > 10 * d.REL_TOL  # a wrong block scale is far outside the tolerance
    assert out["pow2_bytes_equal"] is False and out["pow2_scales_equal"] is False  # the check sees the scale rule
    assert out["split_equal"] is True  # split-K partials are added in a fixed order


def test_plan():
    from miles_lp.formats.kernels.fp8_block_decode import plan

    assert plan(1, 896, 4864, 132) == (16, 64, 13)  # down: 14 N tiles, 38 K blocks -> 13 splits of 3
    assert plan(32, 9728, 896, 132) == (32, 64, 2)  # gate/up: 152 N tiles, 7 K blocks -> 2 splits (4 + 3)
    assert plan(64, 1152, 896, 132) == (64, 64, 3)  # q/k/v
    assert plan(33, 128, 128, 132) == (64, 64, 1)  # one K block: no split
    assert plan(1, 128, 384, 132, block_n=128, split=3) == (16, 128, 3)
    from miles_lp.errors import FormatError

    with pytest.raises(FormatError, match="split 4"):
        plan(1, 128, 384, 132, split=4)


def test_refusals(monkeypatch):
    from miles_lp.errors import FormatError
    from miles_lp.formats.kernels import fp8_block_decode as d

    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    w = torch.zeros(128, 256, dtype=torch.uint8)
    with pytest.raises(FormatError, match=r"scale_inv must be contiguous fp32 \[1, 2\]"):
        d.decode_mm(x, w, torch.ones(2, 1), False)
    with pytest.raises(FormatError, match=r"weight must be contiguous E4M3 \[N, 256\]"):
        d.decode_mm(x, w[:, :128], torch.ones(1, 1), False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(FormatError, match="runs on CUDA tensors"):
        d.decode_mm(x, w, torch.ones(1, 2), False)
