"""The Gluon TMA operand kernels of fp8_block (``formats/kernels/_fp8_block_gluon.py``) compile for sm_90 here
(Triton's compiler and ptxas, no GPU) at every ``fp8_block.TMA_VARIANTS`` launch shape: TMA loads and stores, the
exact-rounding divide and the saturating E4M3 conversion the codec's bytes need, nothing spilled. Their bytes are
compared with the codec on the device by ``fp8_block.selfcheck`` (``-m gpu`` in test_fp8_block_kernels.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton.experimental.gluon")


def _compile(kind: str, variant: str, dtype: str = "bf16", rows: bool = True, pow2: bool = False):
    from triton import compiler
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from miles_lp.formats.kernels import _fp8_block_gluon as G
    from miles_lp.formats.kernels.fp8_block import TMA_VARIANTS

    v = TMA_VARIANTS[variant]
    lx = gl.NVMMASharedLayout.get_default_for([128, 64], {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype])
    lr = gl.NVMMASharedLayout.get_default_for([128, 64], gl.float8e4nv)
    lc = gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv)
    descs = [f"tensordesc<{dtype}[128, 64],{lx!r}>", f"tensordesc<fp8e4nv[128, 64],{lr!r}>",
             f"tensordesc<fp8e4nv[64, 128],{lc!r}>"]
    consts = dict(VALUE_FOR_INF=3.0e38, POW2=pow2, STAGES=v["STAGES"], OUT=v["OUT"], LEAN=v["LEAN"],
                  LC16=v["LC16"], num_warps=v["warps"])
    if kind == "weight":
        fn = G.weight_tma_kernel
        sig = dict(zip(("w_desc", "q_desc", "qt_desc"), descs, strict=True), s_ptr="*fp32", st_ptr="*fp32")
        sig.update(dict.fromkeys(("K", "KB", "LT", "tiles_k", "tiles"), "i32"))
    else:
        fn = G.act_tma_kernel
        consts = dict(ROWS=rows, **consts)
        sig = dict(zip(("x_desc", "rq_desc", "cq_desc"), descs, strict=True), rs_ptr="*fp32", cs_ptr="*fp32")
        sig.update(dict.fromkeys(("MP", "K", "tiles_k", "tiles"), "i32"))
    sig.update(dict.fromkeys(consts, "constexpr"))
    opts = {"num_warps": v["warps"], **({"maxnreg": v["maxnreg"]} if v["maxnreg"] else {})}
    return compiler.compile(GluonASTSource(fn, sig, consts, {}), target=GPUTarget("cuda", 90, 32), options=opts)


def _variants():
    from miles_lp.formats.kernels.fp8_block import TMA_VARIANTS

    return list(TMA_VARIANTS)


@pytest.mark.parametrize("variant", _variants())
@pytest.mark.parametrize("kind,rows", [("act", True), ("act", False), ("weight", True)])
def test_tma_kernels_compile_for_sm90(variant, kind, rows):
    from miles_lp.formats.kernels.sass import resources

    ck = _compile(kind, variant, rows=rows)
    ptx = ck.asm["ptx"]
    assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx  # TMA loads
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx  # TMA stores
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # RNE, saturating: the codec's encode
    assert "div.rn.f32" in ptx  # 448 / amax and 1 / scale rounded exactly
    assert resources(ck).get("stack", 0) == 0


def test_tma_kernels_compile_for_fp16_and_pow2():
    ck = _compile("act", "tma_s3o2_w8", dtype="fp16", pow2=True)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ck.asm["ptx"]
