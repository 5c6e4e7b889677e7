"""C3's probe, shared by every engine (``miles_lp.rollout.self_check``): the inputs, the figures, the rotation and
the pass rule, and that the reference engine, vLLM's and SGLang's introspection take them from there."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import torch

from miles_lp.rollout import self_check as c3

ROOT = Path(__file__).resolve().parents[2] / "miles_lp" / "rollout"
ENGINES = [ROOT / "reference" / "c3.py", ROOT / "vllm_state.py", ROOT / "sglang_cpu" / "introspect.py"]


def test_probes_are_drawn_in_order_from_one_generator_and_the_rotating_one_from_the_next_seed():
    a, b = c3.probe_inputs(5, [8, 16], 4)
    g = torch.Generator().manual_seed(5)
    assert torch.equal(a, torch.randn(4, 8, generator=g)) and torch.equal(b, torch.randn(4, 16, generator=g))
    assert torch.equal(c3.rotating_input(5, 8, 4), c3.probe_inputs(6, [8], 4)[0])
    assert a.dtype == torch.float32 and a.device.type == "cpu"


def test_figures_rel_err_and_fresh_diff():
    ref = torch.ones(2, 2, dtype=torch.float64)
    assert float(c3.rel_err(torch.zeros(2, 2), ref)) == 1.0
    assert float(c3.rel_err(ref.float(), ref)) == 0.0
    assert float(c3.rel_err(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.float64))) > 1e20  # no division by 0
    y = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert float(c3.fresh_diff(y, y.clone())) == 0.0
    assert float(c3.fresh_diff(y, torch.tensor([1.0, 2.5]))) == 0.5


def test_the_pass_rule_needs_a_layer_every_rel_err_within_and_every_fresh_diff_zero():
    assert c3.passes([{"rel_err": 0.03, "fresh_diff": 0.0}, {"rel_err": 0.05}])
    assert not c3.passes([])
    assert not c3.passes([{"rel_err": 0.3}])
    assert not c3.passes([{"rel_err": 0.01, "fresh_diff": 1e-3}])
    assert not c3.passes([{"rel_err": math.nan}]) and not c3.passes([{"rel_err": 0.0, "fresh_diff": math.nan}])
    assert not c3.passes([{"fresh_diff": 0.0}]) and not c3.passes([{"rel_err": math.inf, "reason": "no tensor"}])
    assert c3.passes([{"rel_err": 0.3}], tolerance=0.5)


def test_rotation_interleaves_groups():
    assert c3.interleave([[1, 2, 3], [], [10], [20, 21]]) == [1, 10, 20, 2, 21, 3]
    names = ["m.layers.0.q", "m.layers.0.o", "m.layers.1.q", "m.layers.1.o", "m.layers.2.q"]
    assert c3.rotation_order(names, c3.family) == ["m.layers.0.q", "m.layers.0.o", "m.layers.1.q",
                                                   "m.layers.1.o", "m.layers.2.q"]
    assert c3.family("model.layers.12.mlp.experts.3.down_proj") == "model.layers.*.mlp.experts.*.down_proj"


def test_the_engines_draw_no_probe_and_write_no_figure_of_their_own():
    """Each engine's C3 imports the shared probe and draws no random input itself (no ``torch.randn`` /
    generator), so the probes and the figures cannot drift apart between engines."""
    for path in ENGINES:
        tree = ast.parse(path.read_text())
        imports = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imports |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert "miles_lp.rollout.self_check" in imports, path
        calls = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
        assert not calls & {"randn", "Generator", "manual_seed"}, (path, calls & {"randn", "Generator", "manual_seed"})


def test_the_float64_decodes_equal_the_codecs():
    from miles_lp.formats.mxfp8 import quantize_mxfp8
    from miles_lp.formats.nvfp4 import quantize_nvfp4

    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 3
    mx = quantize_mxfp8(x)
    assert torch.equal(c3.decode_mxfp8_f64(mx.data, mx.scale), mx.dequantize(torch.float64))
    nv = quantize_nvfp4(x)
    assert torch.equal(c3.dequantize_exact(nv, torch.float32), nv.dequantize(torch.float32))
    assert torch.allclose(c3.decode_nvfp4_f64(nv.data, nv.scale, nv.global_scale),
                          nv.dequantize(torch.float64), rtol=1e-6, atol=0)
