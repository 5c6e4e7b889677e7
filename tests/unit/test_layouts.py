"""Layouts: names, roles and shapes for every tiny architecture, Megatron and fused in-memory names."""

import json
from pathlib import Path

import pytest

from miles_lp.checkpoint.tiny import ARCHS, tiny_config
from miles_lp.errors import LayoutError
from miles_lp.policy import Role, get_layout

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "deepseek_v3_config.json"


def _layout(arch):
    return get_layout(tiny_config(arch).to_dict())


@pytest.fixture(scope="module")
def saved_shapes(tmp_path_factory):
    """Names and shapes that save_pretrained writes, for every tiny architecture (built once)."""
    import torch
    import transformers

    out = {}
    for arch in ARCHS:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.bfloat16)
        d = tmp_path_factory.mktemp(arch)
        model.save_pretrained(d)
        from miles_lp.io.validate import read_safetensors_shapes
        out[arch] = (json.loads((d / "config.json").read_text()), read_safetensors_shapes(d),
                     {k: tuple(v.shape) for k, v in model.state_dict().items()})
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_synthesize_matches_save_pretrained(saved_shapes, arch):
    config, on_disk, _ = saved_shapes[arch]
    assert get_layout(config).synthesize() == on_disk


@pytest.mark.parametrize("arch", ARCHS)
def test_every_saved_tensor_has_a_known_role(saved_shapes, arch):
    config, on_disk, in_memory = saved_shapes[arch]
    layout = get_layout(config)
    for name in on_disk:
        assert layout.describe(name).role is not Role.OTHER, name
    # transformers-5 in-memory names (fused experts) map to canonical on-disk names
    for name, shape in in_memory.items():
        info = layout.describe(name)
        assert info.role is not Role.OTHER, name
        assert set(info.members) <= set(on_disk), name
        if name.endswith("experts.gate_up_proj"):
            assert len(info.members) == 2 * shape[0]


def test_router_is_never_a_gate_proj():
    for arch in ("qwen3_moe", "qwen2_moe", "deepseek_v3", "mixtral"):
        layout = _layout(arch)
        for name in layout.synthesize():
            role = layout.describe(name).role
            if role is Role.ROUTER:
                assert name.endswith(".gate.weight") and "gate_proj" not in name and "gate_up" not in name
            if "gate_proj" in name or "shared_expert_gate" in name:
                assert role is not Role.ROUTER, name


def test_qwen2_moe_shared_expert_and_gate():
    layout = _layout("qwen2_moe")
    assert layout.describe("model.layers.1.mlp.shared_expert_gate.weight").role is Role.SHARED_EXPERT_GATE
    info = layout.describe("model.layers.1.mlp.shared_expert.up_proj.weight")
    assert info.role is Role.SHARED_EXPERTS and info.group == "model.layers.1.mlp.shared_expert.gate_up"
    assert layout.describe("model.layers.1.self_attn.q_proj.bias").role is Role.BIAS


def test_megatron_names_map_to_canonical():
    layout = _layout("deepseek_v3")
    cases = {
        "decoder.layers.2.self_attention.linear_q_down_proj.weight": ("model.layers.2.self_attn.q_a_proj.weight",),
        "decoder.layers.2.self_attention.linear_kv_up_proj.weight": ("model.layers.2.self_attn.kv_b_proj.weight",),
        "decoder.layers.2.mlp.router.weight": ("model.layers.2.mlp.gate.weight",),
        "decoder.layers.2.mlp.router.expert_bias": ("model.layers.2.mlp.gate.e_score_correction_bias",),
        "decoder.layers.2.mlp.experts.linear_fc1.weight3": ("model.layers.2.mlp.experts.3.gate_proj.weight",
                                                            "model.layers.2.mlp.experts.3.up_proj.weight"),
        "module.decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight":
            ("model.layers.2.mlp.experts.1.down_proj.weight",),
        "decoder.layers.2.mlp.shared_experts.linear_fc1.weight": ("model.layers.2.mlp.shared_experts.gate_proj.weight",
                                                                  "model.layers.2.mlp.shared_experts.up_proj.weight"),
        "decoder.layers.0.mlp.linear_fc2.weight": ("model.layers.0.mlp.down_proj.weight",),
        "embedding.word_embeddings.weight": ("model.embed_tokens.weight",),
        "output_layer.weight": ("lm_head.weight",),
    }
    for name, members in cases.items():
        info = layout.describe(name)
        assert info.members == members and info.kind == "megatron", name
    qkv = _layout("qwen3").describe("decoder.layers.1.self_attention.linear_qkv.weight")
    assert qkv.members == tuple(f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv")
    mix = _layout("mixtral").describe("decoder.layers.0.mlp.experts.linear_fc1.weight2")
    assert mix.members == ("model.layers.0.block_sparse_moe.experts.2.w1.weight",
                           "model.layers.0.block_sparse_moe.experts.2.w3.weight")


def test_deepseek_v3_fixture_layout():
    layout = get_layout(json.loads(FIXTURE.read_text()))
    names = layout.synthesize(include_mtp=True)
    assert layout.num_layers == 61 and layout.num_mtp_layers == 1
    assert not layout.is_moe_layer(2) and layout.is_moe_layer(3) and layout.is_moe_layer(61)
    assert names["model.layers.5.self_attn.kv_b_proj.weight"] == (32768, 512)
    assert names["model.layers.5.mlp.experts.255.down_proj.weight"] == (7168, 2048)
    assert names["model.layers.61.eh_proj.weight"] == (7168, 14336)
    assert layout.describe("model.layers.61.shared_head.head.weight").role is Role.LM_HEAD
    assert layout.describe("model.layers.61.enorm.weight").role is Role.NORM
    assert sum(1 for n in names if ".experts." in n) == 59 * 256 * 3


def test_unknown_model_type():
    with pytest.raises(LayoutError, match="no layout for model_type 'gpt2'.*supported"):
        get_layout({"model_type": "gpt2", "num_hidden_layers": 2})


@pytest.mark.parametrize("drop", ["num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads"])
def test_missing_config_field_is_a_layout_error_naming_it(drop):
    config = {k: v for k, v in json.loads(FIXTURE.read_text()).items() if k != drop}
    with pytest.raises(LayoutError, match=f"model_type 'deepseek_v3'.* has no '{drop}'.*full config.json"):
        get_layout(config).synthesize()
