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
out["bad"] = fp8_block.selfcheck("cpu")
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
    # padding rows: zeros with scale 1; the rowwise scale stored M-major (what BlockWise1x128 reads)
    assert out["pad"] == [[256, 256], [256, 256], False, True, False, [1, 256]]


@pytest.mark.slow
def test_selfcheck_can_fail():
    bad = _interpreted("drift")["bad"]
    assert any(b.startswith("act rows") for b in bad) and any(b.startswith("act cols") for b in bad)


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
