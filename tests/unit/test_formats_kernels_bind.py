"""The kernels' public binding API (``miles_lp.formats.kernels.bound``): what a ``Binding`` says matches what the
entry point allocates and launches, and every ``bind_*`` refuses (None) where it cannot bind: CPU tensors, no
entry-point call seen, a non-contiguous input, paths with no bound form, a changed kernel signature,
``MILES_LP_KERNELS_FAST_LAUNCH=0``, a launch hook, no compiled launcher. On CPU with the launches stubbed
(no kernel runs here; the bytes of the bound launches: ``tests/unit/test_train_lean.py``, interpreter and
``pytest -m gpu``)."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton")

from miles_lp.formats import kernels  # noqa: E402
from miles_lp.formats.kernels import bound  # noqa: E402


@pytest.fixture
def stubbed(monkeypatch):
    """Entry points that plan and allocate as on CUDA, their launches no-ops, CPU tensors accepted; the plan
    caches this test's own."""
    monkeypatch.setattr(kernels.runtime, "launch", lambda *a, **k: None)
    monkeypatch.setattr(kernels.runtime, "module_for", lambda x: None)
    monkeypatch.setattr(kernels.runtime, "PLANS", {})
    monkeypatch.setattr(kernels.runtime, "SITES", {})


def fake(mod, name, grid, consts):
    def run(*args):
        run.calls.append(args)
    run.calls, run.name, run.grid, run.consts = [], name, grid, consts
    return run


def _check_outputs(b, **tensors):
    """``b.outputs`` names exactly ``tensors`` (param -> the entry point's output), with their shapes / dtypes."""
    assert set(b.outputs) == set(tensors), (b.outputs, tensors)
    for n, t in tensors.items():
        assert b.outputs[n] == (tuple(t.shape), t.dtype), n
    assert b.params == bound.PARAMS[b.kernel] and set(b.ints) <= set(b.params)


def test_params_are_the_kernels_signatures():
    """PARAMS (what a Binding's launch takes) is each kernel's runtime parameters in order, read from
    ``_triton.py`` as Triton sees it (the interpreter's module: nothing compiles)."""
    mod = kernels.runtime.load(True)
    for name, params in bound.PARAMS.items():
        assert tuple(getattr(mod, name).arg_names[:len(params)]) == params, name


@pytest.mark.parametrize("rowwise,colwise,dq,store_q", [(True, False, None, True), (True, True, torch.bfloat16, True),
                                                        (False, True, torch.float32, True),
                                                        (True, True, torch.bfloat16, False)])
def test_mxfp8_binding_matches_the_entry_point(stubbed, rowwise, colwise, dq, store_q):
    x = torch.randn(2, 64, 96).bfloat16()
    kw = dict(rowwise=rowwise, colwise=colwise, dequant_dtype=dq, dequant=("row", "col"), store_q=store_q)
    assert kernels.bind_mxfp8_quantize(x, **kw, fake=fake) is None  # no entry-point call yet
    res = kernels.mxfp8_quantize(x, **kw)
    assert kernels.bind_mxfp8_quantize(x, **kw) is None  # a CPU tensor: no C launcher
    b = kernels.bind_mxfp8_quantize(x, **kw, fake=fake)
    outs = {}
    if res.row is not None:
        outs.update(qr_ptr=res.row.data, sr_ptr=res.row.scale)
    if res.col is not None:
        outs.update(qc_ptr=res.col.data, sc_ptr=res.col.scale)
    outs.update({n: t for n, t in (("dr_ptr", res.row_deq), ("dc_ptr", res.col_deq)) if t is not None})
    _check_outputs(b, **outs)
    assert b.ints == {"R": 128, "K": 96, "M": 64} and b.kernel == "mxfp8_quantize_kernel"
    plan = next(iter(kernels.runtime.PLANS.values()))
    assert (b.launch.grid, b.launch.consts) == (plan["grid"], plan["consts"])
    other = dict(kw, dequant=("row",)) if dq is not None and store_q else dict(kw, rowwise=not rowwise, colwise=True)
    assert kernels.bind_mxfp8_quantize(x, **other, fake=fake) is None  # another call's plan: none seen


def test_mxfp8_refusals(stubbed):
    x = torch.randn(64, 64)
    kernels.mxfp8_quantize(x, swizzle=True)
    assert kernels.bind_mxfp8_quantize(x, rowwise=True, colwise=False, dequant_dtype=None, fake=fake) is None
    xt = torch.randn(64, 64).t()
    kernels.mxfp8_quantize(xt)
    assert kernels.bind_mxfp8_quantize(xt, rowwise=True, colwise=False, dequant_dtype=None, fake=fake) is None
    kernels.mxfp8_quantize(x)
    assert kernels.bind_mxfp8_quantize(x, rowwise=True, colwise=False, dequant_dtype=None, fake=fake) is not None


def test_dequantize_bindings(stubbed):
    x = torch.randn(64, 96).bfloat16()
    for axis in (-1, -2):
        res = kernels.mxfp8_quantize(x, rowwise=axis == -1, colwise=axis == -2)
        q = res.row if axis == -1 else res.col
        assert kernels.bind_mxfp8_dequantize(q, torch.bfloat16, fake=fake) is None  # no dequantize call yet
        out = kernels.mxfp8_dequantize(q, torch.bfloat16)
        assert kernels.bind_mxfp8_dequantize(q, torch.bfloat16) is None  # CPU
        b = kernels.bind_mxfp8_dequantize(q, torch.bfloat16, fake=fake)
        _check_outputs(b, out_ptr=out)
        assert b.ints == {"R": 64, "K": 96}
    qt, _ = kernels.nvfp4_quantize(x, "row")
    out = kernels.nvfp4_dequantize(qt, torch.float32)
    assert kernels.bind_nvfp4_dequantize(qt, torch.float32) is None  # CPU
    b = kernels.bind_nvfp4_dequantize(qt, torch.float32, fake=fake)
    _check_outputs(b, out_ptr=out)
    assert b.ints == {"M": 64, "K": 96} and b.launch.consts["GS_PER_ROW"]
    for gs in (qt.global_scale.double(), qt.global_scale.repeat(1, 2)[:, :1]):  # not fp32 / not contiguous
        assert not (gs.dtype == torch.float32 and gs.is_contiguous())
        q2 = type(qt)(qt.data, qt.scale, gs, qt.amax, qt.logical_shape, qt.scale_scope, qt.block_2d)
        assert kernels.bind_nvfp4_dequantize(q2, torch.float32, fake=fake) is None


def test_nvfp4_binds_only_the_pairs_kernel(stubbed):
    x = torch.randn(3, 32, 64).bfloat16()
    qt, d = kernels.nvfp4_quantize(x, "row", dequant_dtype=torch.bfloat16)
    b = kernels.bind_nvfp4_quantize(x, "row", dequant_dtype=torch.bfloat16, fake=fake)
    _check_outputs(b, q_ptr=qt.data, s_ptr=qt.scale, gs_ptr=qt.global_scale, amax_ptr=qt.amax, d_ptr=d)
    assert b.ints == {"M": 32, "K2": 32} and b.kernel == "nvfp4_rows_pairs_kernel"
    assert kernels.bind_nvfp4_quantize(x, "row", dequant_dtype=torch.bfloat16) is None  # CPU
    qt, _ = kernels.nvfp4_quantize(x, "row")
    _check_outputs(kernels.bind_nvfp4_quantize(x, "row", fake=fake), q_ptr=qt.data, s_ptr=qt.scale,
                   gs_ptr=qt.global_scale, amax_ptr=qt.amax)
    for t, scope, dq in ((x, "tensor", None), (x.float(), "row", None), (x, "row", torch.float32)):
        kernels.nvfp4_quantize(t, scope, dequant_dtype=dq)  # the tile kernel, the general per-token kernel
        assert kernels.bind_nvfp4_quantize(t, scope, dequant_dtype=dq, fake=fake) is None, (t.dtype, scope, dq)


def test_a_changed_signature_is_refused(stubbed, monkeypatch):
    x = torch.randn(32, 64).bfloat16()
    kernels.nvfp4_quantize(x, "row")
    names = list(bound.PARAMS["nvfp4_rows_pairs_kernel"]) + ["DQ", "NB"]
    mod = types.SimpleNamespace(nvfp4_rows_pairs_kernel=types.SimpleNamespace(arg_names=names))
    monkeypatch.setattr(kernels.runtime, "module_for", lambda t: mod)
    assert kernels.bind_nvfp4_quantize(x, "row", fake=fake) is not None
    names[1], names[2] = names[2], names[1]
    assert kernels.bind_nvfp4_quantize(x, "row", fake=fake) is None


def test_the_launcher_refusals(monkeypatch):
    """Without a fake launcher: the env switch, a launch hook, no compiled launcher for the plan, a launcher of
    a layout this code does not call: each gives None."""
    name = "mxfp8_dequantize_kernel"
    mod = types.SimpleNamespace(**{name: types.SimpleNamespace(arg_names=bound.PARAMS[name])})
    monkeypatch.setattr(kernels.runtime, "module_for", lambda t: mod)
    monkeypatch.setattr(kernels.runtime, "SITES", {"site": (object(), ())})  # (no .run: not a compiled kernel)
    x = torch.zeros(4)
    calls = []
    monkeypatch.setattr(bound, "BoundLaunch", lambda *a: calls.append(a) or "bound")
    assert bound._launcher(x, name, (1,), {}, "site", None) == "bound" and len(calls) == 1
    assert bound._launcher(x, name, (1,), {}, "other", None) is None  # no launcher compiled for this plan
    monkeypatch.setattr(kernels.runtime, "launch_hooks_set", lambda: True)
    assert bound._launcher(x, name, (1,), {}, "site", None) is None
    monkeypatch.setattr(kernels.runtime, "launch_hooks_set", lambda: False)
    monkeypatch.setenv("MILES_LP_KERNELS_FAST_LAUNCH", "0")
    assert bound._launcher(x, name, (1,), {}, "site", None) is None
    monkeypatch.setenv("MILES_LP_KERNELS_FAST_LAUNCH", "1")
    monkeypatch.undo()
    monkeypatch.setattr(kernels.runtime, "module_for", lambda t: mod)
    monkeypatch.setattr(kernels.runtime, "SITES", {"site": (object(), ())})
    assert bound._launcher(x, name, (1,), {}, "site", None) is None  # BoundLaunch refuses the layout
