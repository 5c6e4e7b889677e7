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


_LONG_K = r"""
import json, torch
from miles_lp.formats.fp8 import quantize_fp8_blockwise
from miles_lp.formats.kernels import fp8_block_decode as d
g = torch.Generator().manual_seed(0)
out = {}
for m, split in ((1, 3), (32, 3)):  # the 8B down GEMM's K (96 blocks) and the split its plan picks on 132 SMs
    x = (torch.randn(m, 12288, generator=g) * 3).to(torch.bfloat16)
    w = quantize_fp8_blockwise((torch.randn(64, 12288, generator=g) * 0.05).to(torch.bfloat16), (128, 128), False)
    ref = d.emulated_mm(x, w.data, w.scale_inv, False)
    out[f"{m}/{split}"] = [d.rel_err(d.decode_mm(x, w.data, w.scale_inv, False, split=split), ref),
                           d.rel_err(d.decode_mm(x, w.data, w.scale_inv, False, split=split, out_dtype=torch.float32),
                                     ref)]
print("JSON" + json.dumps(out))
"""


def _interpreted(script: str = _SCRIPT) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
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


def test_decode_gemm_long_k_interpreted():
    """K = 12288 (the 8B down GEMM: 96 K blocks) split 3 ways as its plan does: within the tolerances of the
    emulated GEMM (the 0.5B shapes above have at most 38 K blocks)."""
    from miles_lp.formats.kernels import fp8_block_decode as d

    out = _interpreted(_LONG_K)
    assert set(out) == {"1/3", "32/3"}
    for err_bf16, err_fp32 in out.values():
        assert err_bf16 <= d.REL_TOL and err_fp32 <= d.FP32_REL_TOL


def test_plan():
    from miles_lp.formats.kernels.fp8_block_decode import plan

    assert plan(1, 896, 4864, 132) == (16, 64, 8)  # down: 14 N tiles, 38 K blocks -> 8 splits of 5
    assert plan(32, 896, 4864, 132) == (32, 64, 8)
    assert plan(32, 9728, 896, 132) == (32, 64, 1)  # gate/up: 152 N tiles fill the GPU
    assert plan(64, 1152, 896, 132) == (64, 64, 1)  # q/k/v: 7 K blocks, too short to split
    assert plan(33, 128, 128, 132) == (64, 64, 1)
    assert plan(1, 128, 384, 132, block_n=128, split=3) == (16, 128, 3)
    assert plan(32, 4096, 12288, 132) == (32, 64, 3)  # 8B down: 64 N tiles, 96 K blocks -> 3 splits of 32
    assert plan(32, 24576, 4096, 132) == (32, 64, 1)  # 8B gate/up: 384 N tiles
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


@pytest.mark.parametrize("bm, bn, split, dot, store", [(16, 64, 1, "fp8", False), (32, 64, 13, "fp8", True),
                                                       (64, 64, 3, "fp8", False), (32, 64, 2, "bf16", False)])
def test_compiles_for_sm90_pipelined(bm, bn, split, dot, store):
    """The CUDA form compiles for sm_90 here (Triton's compiler and ptxas run without a GPU), with the launch's
    specialization (16-byte aligned pointers, N and K multiples of 16): the loads are software-pipelined
    (cp.async), the dot runs on tensor cores (wgmma on E4M3 at 64-row tiles; Triton 3.6 widens E4M3 to fp16 for
    mma.sync at 16 / 32, exactly)."""
    compiler = pytest.importorskip("triton.compiler")
    from triton.backends.compiler import GPUTarget

    from miles_lp.formats.kernels import fp8_block_decode as d

    mod = d.load_module(False)
    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "sw_ptr": "*fp32", "y_ptr": "*i16" if split == 1 else "*fp32",
           "aq_ptr": "*u8", "as_ptr": "*fp32" if store else "*u8", "M": "i32", "N": "i32", "K": "i32", "KB": "i32"}
    consts = dict(VALUE_FOR_INF=float(torch.finfo(torch.bfloat16).max), POW2=False, BF16_BITS=False, BLOCK_M=bm,
                  BLOCK_N=bn, SPLIT=split, ITERS=-(-38 // split), OUT_BF16=True, STORE_ACT=store, DOT_BF16=dot == "bf16",
                  STAGES=d.CONFIG["stages"])
    sig.update(dict.fromkeys(consts, "constexpr"))
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 7, 8)}
    k = compiler.compile(compiler.ASTSource(fn=mod.decode_gemm_kernel, signature=sig, constexprs=consts, attrs=attrs),
                         target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert k.asm["ttgir"].count("async_copy_global_to_local") >= 2  # x and w tiles, prefetched
    assert k.metadata.shared >= (d.CONFIG["stages"] - 1) * bn * 128  # (the w tiles of the stages in flight)
    ptx = k.asm["ptx"]
    want = "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3" if bm == 64 else "mma.sync.aligned.m16n8k16"
    assert want in ptx
