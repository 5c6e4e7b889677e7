"""QuantLinear's lean kernel path (``miles_lp.train.lean`` + the bound launches of ``miles_lp.train.launch``)
equals the reference codecs' path bit for bit, in every mode, on the bound launches themselves.

On CUDA a bound launch calls the compiled kernel's C launcher with arguments built in ``launch``; here the
same argument tuples go to the kernels in Triton's interpreter (``launch.FAKE_BIND``: only the dtype views the
JIT needs for a pointer are added, and the address-0 placeholders become the entry point's empty tensor), so an
argument out of order, a wrong output shape or dtype, or a missing output shows up as different bytes. Three
steps per mode: the first through the kernels' entry points (and binding), the second with a fresh weight
grid on bound launches only, the third on the step's cached grid. A subprocess: the interpreter must be on
before Triton is imported. The C-launcher call itself is CUDA-only (``pytest -m gpu``, ``bench linear``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

_ROOT = Path(__file__).resolve().parents[2]  # the checkout these tests belong to (its code, not an installed one)

_SCRIPT = r"""
import json, sys
import torch
from miles_lp.formats import kernels
from miles_lp.train import gemm
from miles_lp.formats.spec import BackwardMode, Format
from miles_lp.train import launch
from miles_lp.train.gemm import quantized_linear
from miles_lp.train.grid import WeightGrid
from miles_lp.train.recipe import LinearRecipe

bound_calls = []
entry_calls = []  # the kernels' entry points called (launch.py's first call of a plan, or an unbound path)
for _name in ("mxfp8_quantize", "mxfp8_dequantize", "nvfp4_quantize", "nvfp4_dequantize"):
    def _counted(*a, _real=getattr(kernels, _name), _n=_name, **k):
        entry_calls.append(_n)
        return _real(*a, **k)
    setattr(kernels, _name, _counted)

def fake_bind(mod, name, grid, consts):
    fn = getattr(mod, name)
    names = fn.arg_names
    def run(*args):
        bound_calls.append(name)
        out = []
        for n, a in zip(names, args):
            if isinstance(a, torch.Tensor):
                if a.dtype == torch.bfloat16:
                    a = a.view(torch.int32 if name == "nvfp4_rows_pairs_kernel" else torch.int16)
                elif a.dtype == torch.float8_e4m3fn:
                    a = a.view(torch.uint8)
            elif n.endswith("_ptr"):
                assert a == 0, (name, n, a)
                a = kernels.runtime.none_tensor(torch.device("cpu"))
            out.append(a)
        fn[grid](*out, **consts)
    return run

def data(m, k, n, dtype):
    g = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]
    x[0, :32] = 0.0
    x[2, :] = 3e38
    w = torch.randn(n, k, generator=g) * 0.05
    w[5, :32] = 0.0
    return x.to(dtype), w.to(dtype), torch.randn(m, n, generator=g).to(dtype)

def steps(recipe, kernel, m, k, n, dtype):
    x, w, dy = data(m, k, n, dtype)
    x.requires_grad_(), w.requires_grad_()
    grid = WeightGrid(recipe, kernel=kernel)
    out = []
    for i in range(3):
        if i < 2:
            grid.invalidate()  # steps 1 and 2: a fresh weight grid; step 3: the cached one
        x.grad = w.grad = None
        bound_calls.clear()
        entry_calls.clear()
        y = quantized_linear(x, w, recipe, grid=grid)
        y.backward(dy)
        out.append(([t.detach().clone() for t in (y, x.grad, w.grad)], list(bound_calls), list(entry_calls)))
    return out

def same(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ib = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return bool(torch.equal(a.view(ib), b.view(ib)))

cases = [("mxfp8", "high_precision", 64), ("mxfp8", "dequantized", 64), ("mxfp8", "quantized", 64),
         ("mxfp8", "quantized", 40), ("nvfp4", "high_precision", 64), ("nvfp4", "dequantized", 64)]
# the interpreter reads each kernel's source when it first runs it: load a snapshot of the file, so an edit of
# _triton.py during the run (another checkout's work) cannot shift the lines it reads
import shutil, tempfile
_snap = tempfile.mkdtemp()
kernels.runtime.PATH = shutil.copy(kernels.runtime.PATH, _snap)
# bf16 GEMM operands for bf16 activations, as on CUDA (both paths: the same GEMMs)
gemm.gemm_operand_dtype = lambda x: torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
for dtype in [getattr(torch, name) for name in sys.argv[1:]]:
    for fmt, bw, m in cases:
        recipe = LinearRecipe(Format(fmt), BackwardMode(bw), "token" if fmt == "nvfp4" else None)
        ref = steps(recipe, "reference", m, 64, 96, dtype)
        kernels.enabled = lambda x: True
        launch.FAKE_BIND = fake_bind
        launch.clear()
        try:
            got = steps(recipe, "compiled", m, 64, 96, dtype)
        finally:
            del kernels.enabled
            launch.FAKE_BIND = None
        print(json.dumps({"case": f"{fmt}/{bw}/{m}/{str(dtype)[6:]}",
                          "same": [[same(a, b) for a, b in zip(r[0], g[0])] for r, g in zip(ref, got)],
                          "bound": [g[1] for g in got], "entry": [g[2] for g in got]}), flush=True)
"""


def _rows(*dtypes: str) -> dict[str, dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, *dtypes], cwd=_ROOT, capture_output=True, text=True, env=env,
                          timeout=600)
    out = {r["case"]: r for r in (json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{"))}
    assert proc.returncode == 0 and len(out) == 6 * len(dtypes), proc.stderr[-3000:]
    for case, r in out.items():
        assert r["same"] == [[True, True, True]] * 3, (case, "steps x (y, x.grad, w.grad)")
    return out


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    return _rows("bfloat16")


def test_bound_launches_equal_the_reference_bit_for_bit(rows):
    assert len(rows) == 6  # (each row's three steps compared in _rows)


def test_repeat_steps_run_on_bound_launches(rows):
    """Step 1 binds (entry points); steps 2 and 3 launch the MXFP8 kernels and the per-token NVFP4 kernel
    bound; the NVFP4 weight (amax pass + tiles, once per step) keeps its entry point."""
    q, d = "mxfp8_quantize_kernel", "mxfp8_dequantize_kernel"
    r = rows
    assert r["mxfp8/high_precision/64/bfloat16"]["bound"][1:] == [[q, q], [q]]
    assert r["mxfp8/dequantized/64/bfloat16"]["bound"][1:] == [[q, q, d], [q, d]]
    assert sorted(r["mxfp8/quantized/64/bfloat16"]["bound"][2]) == sorted([q, q, d, d])
    assert r["mxfp8/dequantized/64/bfloat16"]["bound"][0] == []
    pairs = "nvfp4_rows_pairs_kernel"
    assert r["nvfp4/dequantized/64/bfloat16"]["bound"][2] == [pairs, "nvfp4_dequantize_kernel"]
    assert r["nvfp4/high_precision/64/bfloat16"]["bound"][2] == [pairs]
    for case, row in r.items():  # no entry-point call once bound (step 2: only the NVFP4 weight's, amax + tiles)
        assert row["entry"][0] and row["entry"][2] == [], case
        assert row["entry"][1] == (["nvfp4_quantize"] if case.startswith("nvfp4") else []), case


@pytest.mark.slow
def test_bound_launches_equal_the_reference_fp32():
    """fp32 activations and masters (fp32 decodes: the general per-token NVFP4 kernel's entry point)."""
    r = _rows("float32")
    assert r["nvfp4/dequantized/64/float32"]["bound"][2] == ["nvfp4_dequantize_kernel"]


@pytest.mark.gpu
def test_bound_launches_on_cuda_equal_the_reference(monkeypatch):
    """On the device: three steps per mode (entry points, then bound C launches with a fresh and a cached
    weight grid), each step's output and gradients bit-equal to the reference codecs' path, and the bound
    plans in use: the third step calls no kernel entry point (every launch bound) but the codec hook's for a
    padded columnwise x (H200 12-01e: that one was the only entry call of a third step)."""
    import torch

    from miles_lp.formats import kernels
    from miles_lp.formats.spec import BackwardMode, Format
    from miles_lp.train import launch
    from miles_lp.train.gemm import quantized_linear
    from miles_lp.train.grid import WeightGrid
    from miles_lp.train.recipe import LinearRecipe

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    launch.clear()
    entry = []
    for name in ("mxfp8_quantize", "mxfp8_dequantize", "nvfp4_quantize", "nvfp4_dequantize"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _r=real, _n=name, **k: (entry.append(_n), _r(*a, **k))[1])
    cases = [("mxfp8", "high_precision"), ("mxfp8", "dequantized"), ("mxfp8", "quantized"),
             ("nvfp4", "high_precision"), ("nvfp4", "dequantized")]
    for m, k, n in ((256, 512, 384), (96, 256, 128), (100, 256, 128)):
        g = torch.Generator().manual_seed(m)
        x0 = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]).bfloat16().cuda()
        w0 = (torch.randn(n, k, generator=g) * 0.05).bfloat16().cuda()
        dy = torch.randn(m, n, generator=g).bfloat16().cuda()
        for fmt, bw in cases:
            recipe = LinearRecipe(Format(fmt), BackwardMode(bw), "token" if fmt == "nvfp4" else None)
            outs = {}
            for kernel in ("reference", "compiled"):
                x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
                grid = WeightGrid(recipe, kernel=kernel)
                steps = []
                for i in range(3):
                    if i < 2:
                        grid.invalidate()
                    x.grad = w.grad = None
                    entry.clear()
                    y = quantized_linear(x, w, recipe, grid=grid)
                    y.backward(dy)
                    steps.append([t.detach().clone() for t in (y, x.grad, w.grad)])
                    if kernel == "compiled" and i == 2:  # every launch of the cached step bound, except
                        # quantized mode's columnwise x when the token count is not a multiple of 32: padded and
                        # quantized through the codec hook (lean.py; formats.quantize_mxfp8 on CUDA -> kernels)
                        want = ["mxfp8_quantize"] if bw == "quantized" and m % 32 else []
                        assert entry == want, (m, fmt, bw, entry)
                outs[kernel] = steps
            for i, (a, b) in enumerate(zip(outs["reference"], outs["compiled"], strict=True)):
                for what, u, v in zip(("y", "x.grad", "w.grad"), a, b, strict=True):
                    assert torch.equal(u.view(torch.int16), v.view(torch.int16)), (m, fmt, bw, i, what)
    for cache in (launch._MX, launch._MXDQ, launch._NV, launch._NVDQ):  # bound plans were made (False: unbound)
        assert any(p is not False for p in cache.values()), cache


def test_an_unbindable_launch_is_remembered(monkeypatch):
    """A call whose launch cannot be bound (here fp32 per-token NVFP4: the general kernel, not the pairs one)
    goes to the entry point; the binding is asked for once, not on every call."""
    import torch

    from miles_lp.bench import linear_host
    from miles_lp.formats import kernels
    from miles_lp.train import launch

    seen = []
    real = kernels.bind_nvfp4_quantize
    monkeypatch.setattr(kernels, "bind_nvfp4_quantize", lambda *a, **k: (seen.append(a), real(*a, **k))[1])
    with linear_host._stubbed():
        for dt in (torch.float32, torch.bfloat16):
            x = torch.randn(32, 64).to(dt)
            for _ in range(3):
                launch.nvfp4(x, "row", dt)
        keys = list(launch._NV)
        assert len(seen) == 2  # once per input dtype
        assert launch._NV[keys[0]] is False and launch._NV[keys[1]]  # fp32: not bound; bf16: bound
