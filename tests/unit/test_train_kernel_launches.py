"""QuantLinear on the Triton kernels: how many launches one forward+backward makes, and the same bytes.

The small-shape cost of a QuantLinear step is host time per launch (docs/results/h200-2026-12-01b/kernels),
so the launch count per mode is pinned here: ``quantized`` mode takes both grids of x, of the weight and of
grad_output from one read each (``fused.mxfp8_qdq_both``), 5 launches instead of 8. The kernels run in
Triton's interpreter on CPU tensors (a subprocess: the interpreter must be on before Triton is imported),
and every output and gradient is compared bit for bit with the reference codecs' path (``kernel="reference"``).
The cached launcher (``kernels.runtime.launch`` after the first launch of a specialization) is CUDA-only; its bytes
are checked on the device by ``selfcheck --repeat 2`` and ``pytest -m gpu``.
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
from miles_lp.formats.spec import BackwardMode, Format
from miles_lp.train.gemm import quantized_linear
from miles_lp.train.grid import WeightGrid
from miles_lp.train.recipe import LinearRecipe

def data(m, k, n):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]
    x[0, :32] = 0.0
    x[1, 3] = float("nan")
    x[2, :] = 3e38
    w = torch.randn(n, k, generator=g) * 0.05
    w[5, :32] = 0.0
    return x, w, torch.randn(m, n, generator=g)

def step(recipe, kernel, m, k, n):
    x, w, dy = data(m, k, n)
    x.requires_grad_(), w.requires_grad_()
    grid = WeightGrid(recipe, kernel=kernel)
    y = quantized_linear(x, w, recipe, grid=grid)
    y.backward(dy)
    return [t.detach() for t in (y, x.grad, w.grad)]

def same(a, b):  # bit-equal, NaN payloads aside (a NaN element decodes to some NaN on either path)
    nan = torch.isnan(a)
    return bool(torch.equal(nan, torch.isnan(b)) and torch.equal(a.masked_fill(nan, 0).view(torch.int32),
                                                                 b.masked_fill(nan, 0).view(torch.int32)))

cases = [("mxfp8", "high_precision", 64), ("mxfp8", "dequantized", 64), ("mxfp8", "quantized", 64),
         ("mxfp8", "quantized", 40), ("nvfp4", "high_precision", 64), ("nvfp4", "dequantized", 64)]
refs = {c: step(LinearRecipe(Format(c[0]), BackwardMode(c[1]), "token" if c[0] == "nvfp4" else None),
                "reference", c[2], 64, 64) for c in cases}
def experts_step(kernel):  # expert 1 of a fused [3, 64, 64] weight: _ExpertView serves its slice of the grid
    from miles_lp.train.quant_linear import _expert_linear
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 64, generator=g).requires_grad_()
    w = (torch.randn(3, 64, 64, generator=g) * 0.05).requires_grad_()
    grid = WeightGrid(LinearRecipe(Format.MXFP8, BackwardMode.QUANTIZED), kernel=kernel)
    y = _expert_linear(x, w, 1, grid)
    y.backward(torch.randn(64, 64, generator=g))
    return [t.detach() for t in (y, x.grad, w.grad)], grid.quantize_calls

refs["experts"] = experts_step("reference")[0]
kernels.enabled = lambda x: True  # hand the CPU tensors to the (interpreted) kernels
launched = []
real = kernels.runtime.launch
def counting(mod, name, *a, **kw):
    launched.append(name)
    return real(mod, name, *a, **kw)
kernels.runtime.launch = counting
for c in cases:
    launched.clear()
    recipe = LinearRecipe(Format(c[0]), BackwardMode(c[1]), "token" if c[0] == "nvfp4" else None)
    got = step(recipe, "compiled", c[2], 64, 64)
    print(json.dumps({"case": "/".join(map(str, c)), "launches": list(launched),
                      "same": [same(a, b) for a, b in zip(refs[c], got)],
                      "nan": [int(torch.isnan(t).sum()) for t in got]}), flush=True)
launched.clear()
got, calls = experts_step("compiled")
print(json.dumps({"case": "experts", "launches": list(launched), "same": [same(a, b) for a, b in
                  zip(refs["experts"], got)], "nan": [0, 0, 0], "quantize_calls": calls}), flush=True)
"""


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=_ROOT, capture_output=True, text=True, env=env, timeout=600)
    out = {r["case"]: r for r in (json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{"))}
    assert proc.returncode == 0 and len(out) == 7, proc.stderr[-3000:]
    return out


def test_every_mode_equals_the_reference_bit_for_bit(rows):
    for case, r in rows.items():
        assert r["same"] == [True, True, True], (case, "y, x.grad, w.grad")
        if case.startswith("mxfp8") and case != "experts":  # the NaN element reached the output (E2M1 has no NaN: NVFP4 maps it)
            assert r["nan"][0] > 0, case


def test_launches_per_forward_backward(rows):
    q, dq = "mxfp8_quantize_kernel", "mxfp8_dequantize_kernel"
    assert rows["mxfp8/high_precision/64"]["launches"] == [q, q]  # weight qdq, x qdq
    assert rows["mxfp8/dequantized/64"]["launches"] == [q, q, dq]  # + x decode for wgrad (w decode cached)
    # quantized: weight row+col, x row+col, dy row+col (one read each), then the two saved columnwise decodes
    assert sorted(rows["mxfp8/quantized/64"]["launches"]) == sorted([q, q, q, dq, dq])
    # 40 tokens: x and dy are zero-padded for their columnwise grids, so each takes two passes (x's padded
    # columnwise grid goes through formats.quantize_mxfp8: a launch on CUDA, torch.compile on a CPU tensor)
    assert sorted(rows["mxfp8/quantized/40"]["launches"]) == sorted([q] * 4 + [dq, dq])
    nv = rows["nvfp4/high_precision/64"]["launches"]
    assert sorted(nv) == ["amax_kernel", "nvfp4_quantize_kernel", "nvfp4_quantize_rows_kernel"]
    assert sorted(rows["nvfp4/dequantized/64"]["launches"]) == sorted([*nv, "nvfp4_dequantize_kernel"])


def test_expert_slice_takes_both_weight_grids_from_the_fused_pass(rows):
    """QuantExperts' per-expert view in quantized mode: the fused [E, N, K] weight's row and column grids come
    from one launch (and its grid counts one quantization); the expert's result equals the reference."""
    r = rows["experts"]
    assert r["same"] == [True, True, True]
    q, dq = "mxfp8_quantize_kernel", "mxfp8_dequantize_kernel"
    assert sorted(r["launches"]) == sorted([q, q, q, dq, dq]) and r["quantize_calls"] == 1
