"""The FP8 blockwise training GEMM (``miles_lp.formats.kernels.fp8_block_mm``) on CPU under Triton's interpreter (in
a subprocess: Triton must be imported with ``TRITON_INTERPRET=1``): its result within ``FP32_REL_TOL`` of the
emulated GEMM on the codec's operands, for 1x128 and 128x128 scales on b, both scale rules, at several launch
plans (masked partial tiles included); the learner's wgrad through it
equal to the emulated wgrad; what the checks must catch; the sm_90 compile; the refusals."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

_SCRIPT = r"""
import json, torch
from miles_lp.config import runtime_override
from miles_lp.formats.fp8 import quantize_fp8_blockwise
from miles_lp.formats.kernels import fp8_block as k8
from miles_lp.formats.kernels import fp8_block_mm as bm
from miles_lp.train import fp8_block_gemm as G
out = {"bad": bm.selfcheck("cpu")}
for name, cfg in (("small_tiles", {"bm": 64, "bn": 64, "group": 2}),
                  ("wide_tiles", {"bm": 128, "bn": 256, "group": 1, "warps": 8})):
    out["bad_" + name] = bm.selfcheck("cpu", shapes=((256, 256, 256), (200, 136, 384)), config=cfg)
# what the check must catch: one row's scale of one K block off by 2x
g = torch.Generator().manual_seed(1)
x = quantize_fp8_blockwise((torch.randn(128, 384, generator=g) * 3).to(torch.bfloat16), (1, 128), False)
y = quantize_fp8_blockwise((torch.randn(128, 384, generator=g) * 3).to(torch.bfloat16), (1, 128), False)
ref = bm.emulated_mm(x.data, x.scale_inv, y.data, y.scale_inv, 1)
sb = y.scale_inv.clone()
sb[7, 1] *= 2
out["scale_err"] = bm.rel_err(bm.block_mm(x.data, x.scale_inv, y.data, sb, 1, out_dtype=torch.float32), ref)
# the learner's wgrad through the Triton GEMM: dw = dy.T @ x on the operand kernels' columnwise storages
dy = (torch.randn(200, 256, generator=g)).to(torch.bfloat16)
xa = (torch.randn(200, 384, generator=g)).to(torch.bfloat16)
_, gc, (_, gcs) = k8.quantize_act(dy, False, rows=False, cols=True)
_, xc, (_, xcs) = k8.quantize_act(xa, False, rows=False, cols=True)
want = gc.dequantize(torch.float32).t() @ xc.dequantize(torch.float32)
with runtime_override(fp8_wgrad_gemm="triton"):
    out["wgrad_choice"] = G.wgrad_gemm()
    got = G.wgrad_mm(gcs, xcs, out_dtype=torch.float32)
out["wgrad_err"] = bm.rel_err(got, want)
print("JSON" + json.dumps(out))
"""


def _interpreted(script: str = _SCRIPT) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("JSON"))[4:])


def test_block_mm_matches_the_emulation_interpreted():
    """selfcheck at the default plan and two others passes; a wrong block scale is far outside the tolerance; the
    wgrad of 200 tokens (padded to 256 with zeros) through the Triton GEMM equals the emulated one."""
    from miles_lp.formats.kernels import fp8_block_mm as bm

    out = _interpreted()
    assert out["bad"] == [] and out["bad_small_tiles"] == [] and out["bad_wide_tiles"] == []
    assert out["scale_err"] > 10 * bm.FP32_REL_TOL
    assert out["wgrad_choice"] == "triton"
    assert out["wgrad_err"] <= bm.FP32_REL_TOL


@pytest.mark.parametrize("b_block, bm, warps, stack", [(1, 64, 4, 0), (1, 128, 8, 16), (128, 128, 8, 0)])
def test_compiles_for_sm90(b_block, bm, warps, stack):
    """The CUDA form compiles for sm_90 here (Triton's compiler and ptxas, no GPU): the dot is wgmma on E4M3 read
    straight from shared memory (no register round trip of the tiles), software-pipelined; no register spills at
    the default plan (the 1x128 scale vector of b takes 32 registers per thread at 128-wide tiles: at 128x128 and 8
    warps ptxas spills a few bytes at its 255-register cap)."""
    compiler = pytest.importorskip("triton.compiler")
    from triton.backends.compiler import GPUTarget

    from miles_lp.formats.kernels import fp8_block_mm as bm_mod
    from miles_lp.formats.kernels.sass import resources

    mod = bm_mod.load_module(False)
    sig = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "c_ptr": "*i16"}
    sig.update(dict.fromkeys(("M", "N", "K", "s_am", "s_bn", "s_sam", "s_sak", "s_sbn", "s_sbk", "s_cm"), "i32"))
    consts = dict(B_DIV=b_block, BLOCK_M=bm, BLOCK_N=128, GROUP_M=8, STAGES=4, IMPRECISE=128, EVEN=True,
                  OUT_BF16=True, KB_INTERP=0)
    sig.update(dict.fromkeys(consts, "constexpr"))
    names = mod.block_mm_kernel.arg_names
    aligned = {"a_ptr", "b_ptr", "sa_ptr", "sb_ptr", "c_ptr", "M", "N", "K", "s_am", "s_bn", "s_sak", "s_sbk", "s_cm"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in aligned}
    k = compiler.compile(compiler.ASTSource(fn=mod.block_mm_kernel, signature=sig, constexprs=consts, attrs=attrs),
                         target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in k.asm["ptx"]
    assert k.asm["ttgir"].count("async_copy_global_to_local") >= 2  # the a and b tiles, prefetched
    # the E4M3 tiles never pass through registers (only the scale vectors are loaded from shared memory)
    assert not re.search(r"local_load [^\n]*-> tensor<\d+x\d+x(i8|f8E4M3FN)", k.asm["ttgir"])
    assert resources(k).get("stack", 0) <= stack


def test_refusals():
    from miles_lp.errors import FormatError
    from miles_lp.formats.kernels import fp8_block_mm as bm

    a = torch.zeros(128, 256, dtype=torch.uint8)
    s = torch.ones(128, 2)
    with pytest.raises(FormatError, match="share K, a multiple of 128"):
        bm.block_mm(a[:, :200], torch.ones(128, 2), a[:, :200], s, 1)
    with pytest.raises(FormatError, match=r"sb must be fp32 \[1, 2\]"):
        bm.block_mm(a, s, a, s, 128)
    with pytest.raises(FormatError, match="K contiguous"):
        bm.block_mm(a.t(), s, a, s, 1)
    with pytest.raises(FormatError, match="b_block must be 1 or 128"):
        bm.block_mm(a, s, a, s, 64)


def test_wgrad_choice(monkeypatch):
    from miles_lp.config import runtime_override
    from miles_lp.errors import FormatError
    from miles_lp.formats.kernels import fp8_block_mm as bm
    from miles_lp.train import fp8_block_gemm as G

    monkeypatch.delenv("MILES_LP_FP8_WGRAD_GEMM", raising=False)
    assert G.wgrad_gemm() == bm.WGRAD_AUTO == "scaled_mm"
    with runtime_override(fp8_wgrad_gemm="triton"):
        assert G.wgrad_gemm() == "triton"
    monkeypatch.setenv("MILES_LP_FP8_WGRAD_GEMM", "cublas")
    with pytest.raises(FormatError, match="must be one of auto, triton, scaled_mm, got 'cublas'"):
        G.wgrad_gemm()


@pytest.mark.gpu
def test_selfcheck_cuda():
    """On an sm_90 GPU: the default plan within FP32_REL_TOL of the emulation (masked partial tiles included), the
    bf16 result the fp32 one rounded once."""
    from miles_lp.formats.kernels import fp8_block_mm as bm

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    assert bm.selfcheck("cuda") == []
