"""The public codec cores (``mxfp8_core``, ``nvfp4_core``): what the eager codecs run per slice and what
``miles_lp.train.fused`` compiles. Eager: equal to the public functions. Compiled (slow): ONE graph
(``fullgraph=True``: no data-dependent Python branch, no graph break), dynamic shapes, same bytes."""

from __future__ import annotations

import pytest
import torch

from miles_lp.formats import mxfp8, nvfp4, quantize_mxfp8, quantize_nvfp4
from miles_lp.formats._compile import exact_inductor_options


def _special(rows: int, k: int, dtype=torch.bfloat16, seed: int = 0, lead: tuple[int, ...] = ()) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, rows, k, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    x = x.reshape(-1, k)
    x[0, :32] = 0.0
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3, :32] = 1e-30
    x[4, 7] = -0.0
    x[5, :] = 3e38
    x[6, :16] = float("nan")  # a block of only NaN
    return x.reshape(*lead, rows, k).to(dtype)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _nv_equal(got, q) -> None:
    data, scale, gs, amax = got
    assert torch.equal(data, q.data) and torch.equal(_u8(scale), _u8(q.scale))
    assert gs.shape == q.global_scale.shape and torch.equal(gs.view(torch.int32), q.global_scale.view(torch.int32))
    assert amax.shape == q.amax.shape and torch.equal(amax, q.amax)


_NV_OPTS = [("tensor", False), ("row", False), ("tensor", True)]


@pytest.mark.parametrize("lead", [(), (3,)], ids=["2d", "experts"])
@pytest.mark.parametrize("scope,block_2d", _NV_OPTS, ids=["tensor", "row", "2d"])
def test_nvfp4_core_equals_quantize_nvfp4(lead, scope, block_2d, monkeypatch):
    x = torch.nan_to_num(_special(32, 128, lead=lead), posinf=0.0) if scope == "row" else _special(32, 128, lead=lead)
    for chunk in (1 << 30, 1000):  # one slice / many slices in the eager wrapper
        monkeypatch.setattr(nvfp4, "_CHUNK_ELEMS", chunk)
        _nv_equal(nvfp4.nvfp4_core(x, None, scope, block_2d), quantize_nvfp4(x, scale_scope=scope, block_2d=block_2d))
        amax = nvfp4.broadcast_nvfp4_amax(1.5, x, scope)
        _nv_equal(nvfp4.nvfp4_core(x, amax, scope, block_2d),
                  quantize_nvfp4(x, scale_scope=scope, block_2d=block_2d, amax=1.5))


def test_nvfp4_block_amax_ignores_nan_keeps_inf():
    x = torch.tensor([[float("nan")] * 16 + [1.0, -2.0, float("nan")] + [0.0] * 13 + [float("-inf")] + [0.5] * 15])
    assert nvfp4.nvfp4_block_amax(x).tolist() == [[0.0, 2.0, float("inf")]]


@pytest.mark.parametrize("axis", [-1, -2])
def test_mxfp8_core_equals_quantize_mxfp8(axis):
    x = _special(64, 96, lead=(2,))
    d, s = mxfp8.mxfp8_core(x, axis)
    q = quantize_mxfp8(x, axis=axis)
    assert torch.equal(_u8(d), _u8(q.data)) and torch.equal(s, q.scale)


@pytest.mark.slow
def test_cores_compile_as_one_graph_with_the_same_bytes():
    opts = exact_inductor_options() or None
    for dynamic, lead, rows in ((False, (), 64), (True, (2,), 96)):
        x = _special(rows, 128, lead=lead)
        xf = torch.nan_to_num(x, posinf=0.0)
        torch._dynamo.reset()
        nv = torch.compile(nvfp4.nvfp4_core, fullgraph=True, dynamic=dynamic, options=opts)
        for scope, block_2d in _NV_OPTS:
            for amax in (None, nvfp4.broadcast_nvfp4_amax(0.75, xf, scope)):
                want = quantize_nvfp4(xf, scale_scope=scope, block_2d=block_2d, amax=amax)
                _nv_equal(nv(xf, amax, scope, block_2d), want)
        torch._dynamo.reset()
        mx = torch.compile(mxfp8.mxfp8_core, fullgraph=True, dynamic=dynamic, options=opts)
        for axis in (-1, -2):
            d, s = mx(x, axis)
            q = quantize_mxfp8(x, axis=axis)
            assert torch.equal(_u8(d), _u8(q.data)) and torch.equal(s, q.scale)
