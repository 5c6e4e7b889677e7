"""The format schemes (``miles_lp.formats.schemes``): one per format, the same grids as the codecs, the engine
tensors of ``verify``'s independent table, and no format branches left in the modules that use them."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_lp.checkpoint import disk_layout
from miles_lp.errors import ConfigError, FormatError
from miles_lp.export import naming
from miles_lp.formats import api, swizzle_scales, unswizzle_scales
from miles_lp.formats.scheme import FormatScheme, part_shape
from miles_lp.formats.schemes import find_scheme, has_scheme, scheme_for, trainable_formats
from miles_lp.formats.spec import Format
from miles_lp.rollout.layers import EngineLinear

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT_FORMATS = (Format.MXFP8, Format.NVFP4, Format.FP8_BLOCK)


def test_every_format_has_one_scheme_object():
    for fmt in Format:
        s = scheme_for(fmt)
        assert isinstance(s, FormatScheme) and s.format is fmt
        assert scheme_for(fmt.value) is s and find_scheme(fmt.value) is s and has_scheme(fmt)
    assert trainable_formats() == CHECKPOINT_FORMATS
    assert find_scheme("int4") is None and find_scheme(None) is None
    with pytest.raises(FormatError, match="unknown format 'int4'"):
        scheme_for("int4")


def test_reading_schemes_imports_no_torch():
    """The policy and the CLI read scheme attributes without torch (the scheme modules import codecs lazily)."""
    code = ("import sys; from miles_lp.formats.schemes import scheme_for, trainable_formats; "
            "assert [scheme_for(f).scale_block for f in trainable_formats()] == [32, 16, 128]; "
            "scheme_for('nvfp4').parts('sglang'); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("target", naming.TARGETS)
@pytest.mark.parametrize("fmt", CHECKPOINT_FORMATS)
def test_parts_equal_verify_independent_table(fmt, target):
    """The scheme's engine tensors (what convert, export and the sync write) against ``disk_layout``'s table,
    written separately from the engines' loaders: suffix, dtype and shape of every part."""
    shape = (300, 256)
    ours = naming.expected(target, fmt, "m.weight", shape)
    theirs = {f"m.{p.suffix}": (p.dtype, disk_layout._part_shape(p.shape, shape))
              for p in disk_layout.required_parts(target, fmt, None)}
    if fmt is Format.NVFP4 and target == "compressed-tensors":  # W4A4's input_global_scale: verify adds it per config
        theirs["m.input_global_scale"] = ("F32", (1,))
    assert ours == theirs


def test_parts_refusals_keep_their_messages():
    assert naming.parts("sglang", Format.BF16) == ()
    with pytest.raises(ConfigError, match="format fp8_tensor cannot be written for target 'sglang'"):
        naming.parts("sglang", Format.FP8_TENSOR)
    with pytest.raises(ConfigError, match="unknown --target 'tgi'"):
        naming.parts("tgi", Format.MXFP8)
    assert part_shape("tiles", (2, 300, 200), 128) == (2, 3, 2)


def _components(q) -> dict[str, torch.Tensor]:
    return {k: v for k, v in q.components().items()}


def _same_bytes(a, b) -> None:
    ca, cb = _components(a), _components(b)
    assert ca.keys() == cb.keys()
    for k in ca:
        assert ca[k].dtype == cb[k].dtype and ca[k].shape == cb[k].shape
        assert torch.equal(ca[k].reshape(-1).view(torch.uint8), cb[k].reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("fmt", CHECKPOINT_FORMATS)
@pytest.mark.parametrize("pow2", [False, True])
def test_weight_grid_is_the_codec_call(fmt, pow2):
    """``quantize_weight`` is ``formats.quantize(w, fmt, **weight_options)`` and those options are the codecs'
    own arguments for the learner's weight grid (written out here as the codec docs state them)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 384, generator=g) * 3
    s = scheme_for(fmt)
    got = s.quantize_weight(w, pow2_scales=pow2, block_2d=pow2)
    _same_bytes(got, api.quantize(w, fmt, **s.weight_options(pow2_scales=pow2, block_2d=pow2)))
    direct = {Format.MXFP8: lambda: api.quantize(w, fmt, axis=-1),
              Format.NVFP4: lambda: api.quantize(w, fmt, scale_scope="tensor", block_2d=pow2),
              Format.FP8_BLOCK: lambda: api.quantize(w, fmt, block=(128, 128), pow2_scales=pow2)}[fmt]()
    _same_bytes(got, direct)


def test_activation_and_backward_grids():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 256, generator=g)
    _same_bytes(scheme_for("mxfp8").quantize_activation(x), api.quantize(x, "mxfp8", axis=-1))
    _same_bytes(scheme_for("mxfp8").quantize_grad(x, -2), api.quantize(x, "mxfp8", axis=-2))
    _same_bytes(scheme_for("nvfp4").quantize_activation(x, scope="tensor"),
                api.quantize(x, "nvfp4", scale_scope="tensor"))
    _same_bytes(scheme_for("fp8_block").quantize_activation(x, pow2_scales=True),
                api.quantize(x, "fp8_block", block=(1, 128), pow2_scales=True))
    _same_bytes(scheme_for("fp8_block").quantize_grad(x, -2), api.quantize(x, "fp8_block", block=(128, 1)))
    with pytest.raises(FormatError, match="not part of the RL recipe"):
        scheme_for("nvfp4").quantize_grad(x, -2)


@pytest.mark.parametrize("fmt", [Format.MXFP8, Format.NVFP4])
def test_kernel_state_decodes_the_scales_read_back_from_the_swizzled_layout(fmt):
    w = torch.randn(130, 256, generator=torch.Generator().manual_seed(5))
    q = scheme_for(fmt).quantize_weight(w)
    state = scheme_for(fmt).kernel_state(q, 130, 256, torch.float32)
    sw = swizzle_scales(q.scale)
    assert torch.equal(state["scale_swizzled"], sw)
    block = fmt.block_size
    assert torch.equal(state["operand"], q.dequantize(torch.float32))
    assert torch.equal(unswizzle_scales(sw, 130, 256 // block).view(torch.uint8), q.scale.view(torch.uint8))


def test_graph_safe_decode_equals_the_codec():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(6))
    for fmt in CHECKPOINT_FORMATS:
        q = scheme_for(fmt).quantize_weight(w)
        assert torch.equal(scheme_for(fmt).dequantize_graph_safe(q, torch.float32), q.dequantize(torch.float32))


def test_operand_dtype_rule():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert scheme_for("mxfp8").operand_dtype(cuda, torch.bfloat16) == torch.bfloat16
    assert scheme_for("mxfp8").operand_dtype(cpu, torch.bfloat16) == torch.bfloat16  # as the learner (gemm)
    assert scheme_for("mxfp8").operand_dtype(cpu, torch.float32) == torch.float32
    assert scheme_for("bf16").operand_dtype(cpu, torch.bfloat16) == torch.bfloat16
    assert scheme_for("fp8_block").operand_dtype(cuda, torch.bfloat16) == torch.float32  # fp32 scales
    assert scheme_for("fp8_block").operand_dtype(cuda, torch.bfloat16, pow2_scales=True) == torch.bfloat16


def test_engine_layer_options_come_from_the_scheme():
    with pytest.raises(Exception, match="fp8_block has no vLLM emulation mode here"):
        EngineLinear("m.", 128, 128, disk_format=Format.FP8_BLOCK, target="sglang", activation_scale="pow2",
                     activation_mode="vllm")
    with pytest.raises(ValueError, match=r"fp8_block activation_scale must be one of \('pow2', 'fp32'\)"):
        EngineLinear("m.", 128, 128, disk_format=Format.FP8_BLOCK, target="sglang", activation_scale="token")


# --------------------------------------------------------------------------------------------------------
# No format branches in the modules that moved to the schemes (AST: a comparison with a Format member or a
# format's value, an isinstance on a codec tensor class). A module here asks scheme_for(fmt) instead.
# --------------------------------------------------------------------------------------------------------
MIGRATED = ("train/operands.py", "train/grid.py", "train/recipe.py", "export/naming.py", "checkpoint/convert.py",
            "policy/explain.py", "policy/plan.py", "policy/policy.py", "sync/checks.py", "sync/items.py",
            "formats/api.py")
_MEMBERS = {m.name for m in Format}
_VALUES = {m.value for m in Format}
_CLASSES = {"MXFP8Tensor", "NVFP4Tensor", "FP8BlockTensor", "FP8TensorwiseTensor"}


def _mentions(n) -> bool:
    if isinstance(n, ast.Attribute) and n.attr in _MEMBERS and isinstance(n.value, ast.Name) and n.value.id == "Format":
        return True
    if isinstance(n, ast.Constant) and n.value in _VALUES:
        return True
    return isinstance(n, (ast.Tuple, ast.Set, ast.List)) and any(_mentions(e) for e in n.elts)


def format_branches(source: str) -> list[int]:
    """Line numbers of format branches in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(_mentions(x) for x in [node.left, *node.comparators]):
            out.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                and len(node.args) == 2 and any(isinstance(x, ast.Name) and x.id in _CLASSES
                                                for x in ast.walk(node.args[1])):
            out.append(node.lineno)
    return out


def test_the_branch_finder_finds_branches():
    src = ("if fmt is Format.NVFP4: pass\nif f == 'mxfp8': pass\nif isinstance(q, MXFP8Tensor): pass\n"
           "if fmt in (Format.MXFP8, Format.FP8_BLOCK): pass\nif scheme.aligned: pass\n")
    assert format_branches(src) == [1, 2, 3, 4]


@pytest.mark.parametrize("path", MIGRATED)
def test_no_format_branches_left(path):
    lines = format_branches((ROOT / "miles_lp" / path).read_text())
    assert not lines, f"miles_lp/{path}: format branches at lines {lines}; ask scheme_for(fmt) instead"


def test_scheme_modules_are_registered():
    """Every module in miles_lp/formats/schemes (but the shared base) is a registered format's scheme."""
    from miles_lp.formats import schemes

    files = {p.stem for p in (ROOT / "miles_lp/formats/schemes").glob("*.py")} - {"__init__", "base"}
    registered = {m.rsplit(".", 1)[1] for m in schemes._REGISTRY.values()}
    assert files == registered
    for m in schemes._REGISTRY.values():
        assert isinstance(importlib.import_module(m).SCHEME, FormatScheme)
