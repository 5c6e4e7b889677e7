"""The FP8 blockwise operand kernels (``miles_lp.formats.kernels.fp8_block``) against the codec, byte for byte:
on CPU under Triton's interpreter (the default suite; in a subprocess, as Triton must be imported with
``TRITON_INTERPRET=1``) and on the GPU (``-m gpu``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

_SCRIPT = r"""
import json, sys, torch
from miles_lp.formats.kernels import fp8_block
out = {}
if sys.argv[1] == "drift":  # a kernel that drifts from the codec (the wrong scale rule) must be reported
    real = fp8_block.quantize_act
    fp8_block.quantize_act = lambda x, pow2, **kw: real(x, not pow2, **kw)
    real_w = fp8_block.quantize_weight

    def scale_t_off_by_one_tile(w, pow2, **kw):  # the transposed scales read one weight tile too far
        q, t, st = real_w(w, pow2, **kw)
        return q, t, st.roll(1, dims=1)
    fp8_block.quantize_weight = scale_t_off_by_one_tile
if sys.argv[1] == "mutant":  # the slab kernel's prefetch of the columnwise pass one slab off: reported per variant
    import tempfile
    src = open(fp8_block._PATH).read()
    wrong = src.replace("offs_n, inside_n & (j + 1 < NC)", "offs, inside_n & (j + 1 < NC)")
    assert wrong != src
    fp8_block._PATH = tempfile.mkstemp(suffix=".py")[1]
    open(fp8_block._PATH, "w").write(wrong)
    fp8_block.ACT_VARIANTS = {k: v for k, v in fp8_block.ACT_VARIANTS.items() if k in ("r32c32ta_w8", "r32c32tpa_w8")}
    fp8_block.CONFIG.update(act_both="tile", act_cols="tile")  # the configured path: the tile kernel, unmutated
    out["bad"] = fp8_block.selfcheck("cpu", quick_variants=True)
    print("JSON" + json.dumps(out))
    sys.exit(0)
if sys.argv[1] == "unknown":
    fp8_block.CONFIG["act_cols"] = "no-such-variant"
    try:
        fp8_block.quantize_act(torch.randn(128, 128), False, rows=False, cols=True)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    print("JSON" + json.dumps(out))
    sys.exit(0)
out["bad"] = fp8_block.selfcheck("cpu")
out["variants"] = list(fp8_block.ACT_VARIANTS)
x = torch.randn(130, 256).to(torch.bfloat16)
_, _, (rs, cs) = fp8_block.quantize_act(x, False, rows=True, cols=True)
out["pad"] = [list(rs.data.shape), list(cs.data.shape), bool(rs.data[130:].view(torch.uint8).any()),
              bool((rs.scale_inv[130:] == 1).all()), bool(cs.data[:, 130:].view(torch.uint8).any()),
              list(rs.scale_inv.stride())]
print("JSON" + json.dumps(out))
"""


def _interpreted(mode: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    p = subprocess.run([sys.executable, "-c", _SCRIPT, mode], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("JSON"))[4:])


@pytest.mark.slow
def test_kernels_equal_the_codec_interpreted():
    out = _interpreted("ok")
    assert out["bad"] == []
    assert len(out["variants"]) >= 2  # the slab kernel's launch shapes were checked too (selfcheck runs them all)
    # padding rows: zeros with scale 1; the rowwise scale stored M-major (what BlockWise1x128 reads)
    assert out["pad"] == [[256, 256], [256, 256], False, True, False, [1, 256]]


@pytest.mark.slow
def test_selfcheck_can_fail():
    bad = _interpreted("drift")["bad"]
    assert any(b.startswith("act rows") for b in bad) and any(b.startswith("act cols") for b in bad)
    assert any(b.startswith("weight scale_t") for b in bad)  # the dgrad's scale storage is compared too
    # every slab variant is checked too (both grids from one launch, and the columnwise grid alone)
    for v in _interpreted_variants():
        assert any(b.startswith("act rows") and b.endswith(f"[{v}]") for b in bad), v
        assert any(b.startswith("act cols only") and b.endswith(f"[{v}]") for b in bad), v


def _interpreted_variants() -> list[str]:
    from miles_lp.formats.kernels import fp8_block

    return list(fp8_block.ACT_VARIANTS)


@pytest.mark.slow
def test_selfcheck_catches_a_slab_kernel_bug():
    """A kernel bug only in the prefetching variant's columnwise pass: reported for that variant, not the others."""
    bad = _interpreted("mutant")["bad"]
    assert bad and all(b.endswith("[r32c32tpa_w8]") for b in bad), bad
    assert any(b.startswith("act cols only") for b in bad)
    assert any(b.startswith("act cols ") and not b.startswith("act cols only") for b in bad)
    assert not any(b.startswith("act rows") for b in bad)


@pytest.mark.slow
def test_unknown_variant_named():
    err = _interpreted("unknown")["error"]
    assert err.startswith("FormatError") and "'no-such-variant'" in err and "r32c32ta_w8" in err


def test_sass_executed_count_of_loops():
    """The SASS tool's executed count: a loop body counted once per iteration, a branch to itself (the trap) not."""
    from miles_lp.formats.kernels.sass import dynamic_count

    def ln(addr, op):
        return f"        /*{addr:04x}*/                   {op} ;"
    lines = [ln(0x00, "MOV R1, R2"), ln(0x10, "IADD3 R1, R1, 0x1, RZ"), ln(0x20, "FMUL R3, R3, R3"),
             ln(0x30, "@P0 BRA 0x10"), ln(0x40, "EXIT"), ln(0x50, "BRA 0x50")]
    assert dynamic_count(lines, [4]) == 6 + 3 * 3
    with pytest.raises(ValueError, match="1 loops found, 2 iteration counts"):
        dynamic_count(lines, [4, 2])


def test_cpu_without_interpreter_refused(monkeypatch):
    from miles_lp.errors import FormatError
    from miles_lp.formats.kernels import fp8_block

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(FormatError, match="run on CUDA tensors"):
        fp8_block.quantize_act(torch.randn(128, 128), False)


@pytest.mark.gpu
def test_selfcheck_cuda():
    from miles_lp.formats.kernels import fp8_block

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert fp8_block.selfcheck("cuda") == []


@pytest.mark.slow
def test_slab_variants_compile_for_sm90_without_spills():
    """Every ACT_VARIANTS launch shape compiles for sm_90 (Triton's compiler and ptxas, no GPU) with no spill, and
    the one-launch kernel holds fewer registers than the tile kernel writing both grids (183 at 8 warps: what made
    that launch slow on the H200)."""
    import io

    from miles_lp.formats.kernels import fp8_block, sass

    names = ["fp8b_tile_both"] + [f"fp8b_{v}_{t}" for v in fp8_block.ACT_VARIANTS for t in ("both", "cols")]
    try:
        res = sass.report(names, out=io.StringIO())
    except (FileNotFoundError, ImportError, RuntimeError) as exc:  # no CUDA backend / ptxas in this Triton
        pytest.skip(f"offline sm_90 compile unavailable: {exc}")
    assert set(res) == set(names)
    for name, r in res.items():
        assert r["stack"] == 0, (name, r)
        assert r["histogram"].get("F2FP", 0) > 0 and r["histogram"].get("STG", 0) > 0, name  # not an empty kernel
    for v in fp8_block.ACT_VARIANTS:
        assert res[f"fp8b_{v}_both"]["registers"] < res["fp8b_tile_both"]["registers"], v
