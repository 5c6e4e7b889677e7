"""fp8_block in engine checkpoints and in the reference engine's layers: the on-disk parts per target (names,
dtypes, block-shaped scales), the converter's codec options, the engine configs read back as SGLang / vLLM /
compressed-tensors read them, and ``EngineLinear`` serving the learner's own forward grid (its output equal to
``QuantLinear``'s on the same master, the batched stack path equal to the per-layer one, a stale operand seen)."""

from __future__ import annotations

import pytest
import torch

from miles_lp.checkpoint.convert import codec_options
from miles_lp.checkpoint.tiny import tiny_config
from miles_lp.config import Where
from miles_lp.errors import ConfigError
from miles_lp.export import configs, naming
from miles_lp.formats import quantize, quantize_fp8_blockwise
from miles_lp.formats.spec import BackwardMode, Format
from miles_lp.policy import compile_plan, get_layout, parse_policy
from miles_lp.rollout.layers import EngineLinear, LinearStack, decode_weight
from miles_lp.train.quant_linear import LinearRecipe, QuantLinear


def _plan(mapping, arch="qwen3"):
    return compile_plan(parse_policy(mapping, Where("t.yaml", "precision")), get_layout(tiny_config(arch).to_dict()))


@pytest.mark.parametrize("target, scale", [("sglang", "weight_scale_inv"), ("vllm", "weight_scale_inv"),
                                           ("compressed-tensors", "weight_scale")])
def test_parts_names_dtypes_and_block_shapes(target, scale):
    got = naming.expected(target, Format.FP8_BLOCK, "m.q_proj.weight", (300, 200))
    assert got == {"m.q_proj.weight": ("F8_E4M3", (300, 200)), f"m.q_proj.{scale}": ("F32", (3, 2))}
    assert naming.expected(target, Format.FP8_BLOCK, "m.w.weight", (256, 128))[f"m.w.{scale}"] == ("F32", (2, 1))


@pytest.mark.parametrize("target", naming.TARGETS)
def test_encode_decode_round_trip_is_the_codec(target):
    x = torch.randn(300, 200) * 3
    q = quantize_fp8_blockwise(x)
    disk = naming.encode(target, Format.FP8_BLOCK, "m.w.weight", q)
    want = naming.expected(target, Format.FP8_BLOCK, "m.w.weight", (300, 200))
    assert {n: (str(t.dtype), tuple(t.shape)) for n, t in disk.items()} == {
        n: ({"F8_E4M3": "torch.float8_e4m3fn", "F32": "torch.float32"}[d], s) for n, (d, s) in want.items()}
    back = decode_weight(target, Format.FP8_BLOCK, {n.removeprefix("m.w."): t for n, t in disk.items()}, (300, 200))
    assert torch.equal(back.data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(back.scale_inv, q.scale_inv)


@pytest.mark.parametrize("pow2", [False, True])
def test_codec_options_follow_the_plan_entry(pow2):
    plan = _plan({"default": "fp8_block", "pow2_scales": pow2})
    name = next(n for n, e in plan.entries.items() if e.format is Format.FP8_BLOCK)
    opts = codec_options(plan.entry(name), name=name)
    assert opts == {"block": (128, 128), "pow2_scales": pow2, "name": name}
    x = torch.randn(192, 160)
    q = quantize(x, Format.FP8_BLOCK, **opts)
    ref = quantize_fp8_blockwise(x, (128, 128), pow2)
    assert torch.equal(q.scale_inv, ref.scale_inv) and q.scale_inv.shape == (2, 2)
    if pow2:  # every scale a power of two
        assert torch.equal(q.scale_inv, torch.exp2(torch.log2(q.scale_inv).round()))


POLICY = {"default": "fp8_block", "rules": [{"layers": "first 1", "format": "bf16"}]}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("target", naming.TARGETS)
def test_engine_configs_read_back_as_the_plan(arch, target):
    plan = _plan(POLICY, arch)
    qc, files = configs.emit_configs(plan, target)
    if target in ("sglang", "vllm"):
        assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
        assert qc["activation_scheme"] == "dynamic"
    schemes = configs.engine_schemes_for(target, qc, files, plan)
    want = {n for n, e in plan.entries.items() if e.format is Format.FP8_BLOCK}
    assert {n for n, s in schemes.items() if s.format is Format.FP8_BLOCK} == want
    assert not any(".layers.0." in n for n in want) and any(".layers.1." in n for n in want)
    assert {s.format for s in schemes.values()} == {Format.FP8_BLOCK, Format.BF16}


def test_engine_configs_refuse_what_the_engines_would_misread():
    plan = _plan(POLICY)
    qc, files = configs.emit_configs(plan, "sglang")
    with pytest.raises(ConfigError, match="without weight_block_size is per-tensor FP8"):
        configs.engine_schemes_for("sglang", {k: v for k, v in qc.items() if k != "weight_block_size"}, files, plan)
    # the skip list matters: dropping it makes the engine quantize layer 0, which the plan keeps BF16 (C1)
    schemes = configs.engine_schemes_for("vllm", dict(qc, ignored_layers=[]), files, plan)
    assert schemes["model.layers.0.self_attn.q_proj.weight"].format is Format.FP8_BLOCK
    mixed = _plan({"default": "fp8_block", "rules": [{"role": "mlp", "format": "mxfp8"}]})
    for target in naming.TARGETS:
        with pytest.raises(ConfigError, match="fp8_block cannot share a checkpoint with"):
            configs.emit_configs(mixed, target)


def _engine_layer(target, w, pow2, bias=None):
    n, k = w.shape
    layer = EngineLinear("m.w.", k, n, disk_format=Format.FP8_BLOCK, target=target, bias=bias is not None,
                         activation_scale="pow2" if pow2 else "fp32")
    q = quantize_fp8_blockwise(w, (128, 128), pow2)
    with torch.no_grad():
        for name, t in naming.encode(target, Format.FP8_BLOCK, "m.w.weight", q).items():
            getattr(layer, name.removeprefix("m.w.")).copy_(t)
        if bias is not None:
            layer.bias.copy_(bias)
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("target", naming.TARGETS)
def test_engine_layer_serves_the_learners_forward(target, pow2):
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(200, 300, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(300, 200, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(300, generator=g).bfloat16().float())
    x = torch.randn(37, 200, generator=g) * 2
    ql = QuantLinear.from_linear(lin, LinearRecipe(Format.FP8_BLOCK, BackwardMode.DEQUANTIZED, pow2_scales=pow2),
                                 canonical="m.w.weight")
    layer = _engine_layer(target, lin.weight.detach(), pow2, lin.bias.detach().bfloat16())
    assert layer.kernel_format is Format.FP8_BLOCK and layer.op_dtype == torch.float32
    with torch.no_grad():
        want = ql(x)
    got = layer(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the input grid is the learner's: 1x128 tiles, the plan's scale rule (the other rule differs)
    xq = layer.quantize_input(x)
    assert torch.equal(xq, quantize_fp8_blockwise(x, (1, 128), pow2).dequantize(torch.float32))
    assert not torch.equal(xq, quantize_fp8_blockwise(x, (1, 128), not pow2).dequantize(torch.float32))


def test_stale_operand_after_a_canonical_write_and_its_rebuild_in_place():
    w = torch.randn(256, 128) * 0.1
    layer = _engine_layer("sglang", w, False)
    ptr = layer.operand.data_ptr()
    x = torch.randn(4, 128)
    before = layer(x)
    q2 = quantize_fp8_blockwise(w * 2, (128, 128))
    with torch.no_grad():
        layer.weight.copy_(q2.data)
        layer.weight_scale_inv.copy_(q2.scale_inv)
    assert torch.equal(layer(x), before)  # the kernel still serves the old operand (the C3 failure mode)
    layer.process_weights_after_loading()
    assert layer.operand.data_ptr() == ptr  # rebuilt in place (C4)
    assert torch.equal(layer.operand, q2.dequantize(torch.float32))


def test_stack_path_equals_the_per_layer_derivation():
    g = torch.Generator().manual_seed(2)
    ws = [torch.randn(130, 200, generator=g) * 0.1 for _ in range(3)]
    layers = [EngineLinear(f"m.{i}.w.", 200, 130, disk_format=Format.FP8_BLOCK, target="vllm",
                           activation_scale="fp32") for i in range(3)]
    stack = LinearStack(layers)
    for layer, w in zip(layers, ws, strict=True):
        q = quantize_fp8_blockwise(w)
        with torch.no_grad():
            layer.weight.copy_(q.data)
            layer.weight_scale_inv.copy_(q.scale_inv)
    assert stack.process_weights_after_loading() == 3
    assert stack.canonical["weight_scale_inv"].shape == (3, 2, 2)
    for layer, w in zip(layers, ws, strict=True):
        assert layer.kernel_format is Format.FP8_BLOCK
        assert torch.equal(layer.operand, quantize_fp8_blockwise(w).dequantize(torch.float32))
        fresh = layer.detached_copy()
        fresh.process_weights_after_loading()
        assert torch.equal(fresh.operand, layer.operand)


def test_engine_layer_refuses_unknown_scale_rules():
    with pytest.raises(ValueError, match="fp8_block activation_scale"):
        EngineLinear("m.w.", 128, 128, disk_format=Format.FP8_BLOCK, target="sglang", activation_scale="token")
