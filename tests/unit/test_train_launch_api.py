"""``miles_lp.train.launch`` (QuantLinear's bound launches) uses only the public API of
``miles_lp.formats.kernels``: no private name (``_PLANS``, ``_SITES``, ``_module``, ...), no import from its
submodules; and its own switches: ``MILES_LP_LINEAR_BIND=0``, a binding whose parameters are not the ones the
call site builds, a launch hook. The bytes of the bound path: ``tests/unit/test_train_lean.py``."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

pytest.importorskip("triton")

from miles_lp.bench import linear_host  # noqa: E402
from miles_lp.formats import kernels  # noqa: E402
from miles_lp.train import launch, lean  # noqa: E402


def kernels_uses(source: str) -> list[str]:
    """Every ``<kernels module>.<name>`` in ``source`` (the module as ``kernels``, ``_kernels()``, or a name
    assigned from either), and every import from ``miles_lp.formats.kernels`` or its submodules, as text."""
    tree = ast.parse(source)
    aliases = {"kernels"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_kernels(node.value, aliases):
            aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_kernels(node.value, aliases):
            uses.append(node.attr)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("miles_lp.formats.kernels"):
            uses.extend(f"{node.module}:{a.name}" for a in node.names)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and node.args and _is_kernels(node.args[0], aliases)):
            uses.append("getattr(kernels, ...)")
    return uses


def _is_kernels(node, aliases: set[str]) -> bool:
    return ((isinstance(node, ast.Name) and node.id in aliases)
            or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_kernels"))


def _private(uses: list[str]) -> list[str]:
    public = set(kernels.__all__)
    return [u for u in uses if u not in public]


@pytest.mark.parametrize("module", [launch, lean])
def test_train_uses_only_the_kernels_public_api(module):
    uses = kernels_uses(inspect.getsource(module))
    assert _private(uses) == [], module.__name__
    if module is launch:
        assert {"bind_mxfp8_quantize", "bind_mxfp8_dequantize", "bind_nvfp4_quantize", "bind_nvfp4_dequantize",
                "launch_hooks_set", "mxfp8_quantize"} <= set(uses)  # (the check sees the real uses)


def test_the_api_check_can_fail():
    """Fault injection: each way of reaching a private name is caught."""
    for src in ("K = _kernels()\nK._SITES.get(1)\n", "_kernels()._PLANS\n", "from miles_lp.formats import kernels\n"
                "kernels._module(x)\n", "from miles_lp.formats.kernels import _spec\n",
                "from miles_lp.formats.kernels.bound import PARAMS\n", "K = _kernels()\ngetattr(K, '_LAUNCHERS')\n"):
        assert _private(kernels_uses(src)), src
    assert _private(kernels_uses("K = _kernels()\nK.bind_nvfp4_quantize(x, 'row')\n")) == []


def test_every_public_name_exists():
    for name in kernels.__all__:
        assert hasattr(kernels, name), name


def _bound_names():
    """(stubbed launches: ``linear_host._stubbed``, bound calls recorded by name)"""
    seen = []
    return seen, (lambda mod, name, grid, consts: lambda *a: seen.append(name))


def test_linear_bind_off_keeps_the_entry_point(monkeypatch):
    """``runtime.linear_bind`` off (here through its variable ``MILES_LP_LINEAR_BIND=0``): the binding is not even
    asked for; every call goes to the entry point."""
    asked = []
    monkeypatch.setenv("MILES_LP_LINEAR_BIND", "0")
    with linear_host._stubbed():
        real = kernels.bind_mxfp8_quantize
        monkeypatch.setattr(kernels, "bind_mxfp8_quantize", lambda *a, **k: (asked.append(1), real(*a, **k))[1])
        seen, fake = _bound_names()
        monkeypatch.setenv("MILES_LP_LINEAR_BIND", "1")
        launch.FAKE_BIND = fake  # (a fake launcher overrides the switch, as before: the host bench binds)
        launch.mxfp8(torch.randn(32, 64).bfloat16(), True, False, torch.bfloat16)
        launch.mxfp8(torch.randn(32, 64).bfloat16(), True, False, torch.bfloat16)
        assert asked == [1] and seen == ["mxfp8_quantize_kernel"]
        launch.FAKE_BIND = None
        monkeypatch.setenv("MILES_LP_LINEAR_BIND", "0")
        launch.clear()
        x = torch.randn(64, 64).bfloat16()
        for _ in range(3):
            row, deq, _, _ = launch.mxfp8(x, True, False, torch.bfloat16)
            assert row.data.dtype == torch.float8_e4m3fn and deq.dtype == torch.bfloat16
        assert asked == [1] and list(launch._MX.values()) == [False]


def test_a_binding_of_other_parameters_is_not_used(monkeypatch):
    """A binding whose ``params`` are not the ones the call site builds its arguments for: entry point."""
    with linear_host._stubbed():
        seen, fake = _bound_names()
        launch.FAKE_BIND = fake
        real = kernels.bind_mxfp8_dequantize

        def shuffled(*a, **k):
            b = real(*a, **k)
            return b and kernels.Binding(b.kernel, b.params[::-1], b.launch, b.ints, b.outputs)

        monkeypatch.setattr(kernels, "bind_mxfp8_dequantize", shuffled)
        res = kernels.mxfp8_quantize(torch.randn(32, 64), dequant_dtype=None)
        for _ in range(3):
            out = launch.mxfp8_decode(res.row.data, res.row.scale, -1, torch.float32)
            assert out.shape == (32, 64) and out.dtype == torch.float32
        assert seen == [] and list(launch._MXDQ.values()) == [False]


def test_a_launch_hook_sends_bound_calls_to_the_entry_point(monkeypatch):
    """While a launch hook is set, a bound plan is not used (profilers see every launch) and a refusal
    for that reason is not remembered."""
    with linear_host._stubbed():
        seen, fake = _bound_names()
        launch.FAKE_BIND = fake
        x = torch.randn(32, 64).bfloat16()
        launch.nvfp4(x, "row", torch.bfloat16)  # entry point, then bound
        launch.nvfp4(x, "row", torch.bfloat16)
        assert seen == ["nvfp4_rows_pairs_kernel"]
        monkeypatch.setattr(kernels, "launch_hooks_set", lambda: True)
        qt, d = launch.nvfp4(x, "row", torch.bfloat16)
        assert seen == ["nvfp4_rows_pairs_kernel"] and qt.data.shape == (32, 32) and d.shape == (32, 64)
        y = torch.randn(64, 64).bfloat16()
        launch.FAKE_BIND = None  # (CPU: the kernels refuse to bind) while a hook is set: not remembered
        launch.nvfp4(y, "row", torch.bfloat16)
        assert len(launch._NV) == 1
        monkeypatch.setattr(kernels, "launch_hooks_set", lambda: False)
        launch.FAKE_BIND = fake
        launch.nvfp4(y, "row", torch.bfloat16)
        launch.nvfp4(y, "row", torch.bfloat16)
        assert seen == ["nvfp4_rows_pairs_kernel"] * 2 and len(launch._NV) == 2
