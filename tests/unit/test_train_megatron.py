"""Megatron-Core backend on CPU: config translation, HF -> Megatron weights (checked through Megatron's own
qkv splitter), the plan attached per module, learner_weights bytes, and the TE configuration (path (b)).

Megatron's attention needs CUDA, so whole-model forward/backward runs in scripts/h200_train_check.py.
"""

from __future__ import annotations

import os
import socket
import warnings

import pytest
import torch

from miles_lp.config import Where
from miles_lp.errors import ConfigError, LayoutError
from miles_lp.policy import compile_plan, get_layout, parse_policy

mc = pytest.importorskip("megatron.core", reason="megatron-core not installed (extra 'megatron')")


def _policy(raw):
    return parse_policy(raw, Where("<test>", "precision"))


@pytest.fixture(scope="module")
def mp():
    import torch.distributed as dist
    from megatron.core import parallel_state

    warnings.filterwarnings("ignore")
    created = False
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=0, world_size=1)
        created = True
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def moe(mp):
    import transformers

    from miles_lp.checkpoint.tiny import tiny_config
    from miles_lp.train.megatron.model import build_gpt_model, load_hf_weights

    cfg = tiny_config("qwen3_moe", num_layers=2)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    meg = build_gpt_model(cfg, quantized=True)
    load_hf_weights(meg, hf.state_dict(), cfg)
    return cfg, hf, meg


def test_transformer_config_kwargs_and_refusals():
    from miles_lp.checkpoint.tiny import tiny_config
    from miles_lp.train.megatron.model import transformer_config_kwargs

    kw = transformer_config_kwargs(tiny_config("qwen3_moe"))
    assert kw["num_query_groups"] == 2 and kw["kv_channels"] == 32 and kw["qk_layernorm"]
    assert kw["num_moe_experts"] == 4 and kw["moe_router_topk"] == 2 and kw["moe_ffn_hidden_size"] == 64
    assert kw["moe_router_pre_softmax"] is True  # tiny qwen3_moe: norm_topk_prob False
    assert transformer_config_kwargs(tiny_config("mixtral"))["moe_router_pre_softmax"] is False
    with pytest.raises(LayoutError, match="deepseek_v3.*embedded backend"):
        transformer_config_kwargs(tiny_config("deepseek_v3"))


def test_qkv_and_weights_through_megatrons_own_splitter(moe):
    cfg, hf, meg = moe
    attn = meg.decoder.layers[0].self_attention
    attn.linear_qkv.set_recipe(None)  # BF16 GEMM: compare the weight layout exactly
    x = torch.randn(8, 1, cfg.hidden_size)
    q, k, v = attn.get_query_key_value_tensors(x, None)[:3]
    sa = hf.model.layers[0].self_attn
    torch.testing.assert_close(q, sa.q_norm(sa.q_proj(x).view(8, 1, 4, 32)), rtol=0, atol=0)
    torch.testing.assert_close(k, sa.k_norm(sa.k_proj(x).view(8, 1, 2, 32)), rtol=0, atol=0)
    torch.testing.assert_close(v, sa.v_proj(x).view(8, 1, 2, 32), rtol=0, atol=0)
    fc1 = meg.decoder.layers[1].mlp.experts.local_experts[3].linear_fc1.weight
    gu = hf.model.layers[1].mlp.experts.gate_up_proj[3]
    assert torch.equal(fc1, gu)  # [gate; up]


def test_attach_plan_and_learner_weights_bytes(moe):
    from miles_lp import formats
    from miles_lp.train.megatron.layers import attach_plan, learner_weights

    cfg, hf, meg = moe
    layout = get_layout(cfg)
    plan = compile_plan(_policy({"default": "mxfp8", "rules": [{"role": "routed_experts", "format": "nvfp4"}]}),
                        layout)
    report = attach_plan(meg, plan, layout)
    assert report["decoder.layers.0.self_attention.linear_qkv.weight"] == "mxfp8/dequantized"
    assert report["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"] == "nvfp4/dequantized"
    lw = dict(learner_weights(meg))
    assert set(lw) == set(plan.quantized())
    sd = hf.state_dict()
    for proj in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.0.self_attn.{proj}.weight"
        ref = formats.quantize_mxfp8(sd[name])
        assert torch.equal(lw[name].data.view(torch.uint8), ref.data.view(torch.uint8)), name
        assert torch.equal(lw[name].scale, ref.scale), name
    gu = sd["model.layers.1.mlp.experts.gate_up_proj"][2]
    rg, ru = formats.quantize_nvfp4_pair(gu[:64], gu[64:])
    got_g, got_u = lw["model.layers.1.mlp.experts.2.gate_proj.weight"], lw["model.layers.1.mlp.experts.2.up_proj.weight"]
    assert torch.equal(got_g.data, rg.data) and torch.equal(got_u.data, ru.data)
    assert torch.equal(got_g.global_scale, rg.global_scale) and torch.equal(got_u.global_scale, ru.global_scale)

    # Megatron's optimizers write model params through .data (no version bump): after invalidate_grids the
    # export holds the new master's bytes, quantized once.
    from miles_lp.train.quant_linear import invalidate_grids

    proj = meg.decoder.layers[0].self_attention.linear_proj
    name = "model.layers.0.self_attn.o_proj.weight"
    calls = proj.grid.quantize_calls
    with torch.no_grad():
        proj.weight.data.mul_(-2.0)
    assert invalidate_grids(meg) >= 1
    lw2 = dict(learner_weights(meg))
    dict(learner_weights(meg))
    assert proj.grid.quantize_calls == calls + 1
    ref = formats.quantize_mxfp8(proj.weight.detach())
    assert torch.equal(lw2[name].data.view(torch.uint8), ref.data.view(torch.uint8))
    assert not torch.equal(lw2[name].data.view(torch.uint8), lw[name].data.view(torch.uint8))
    with torch.no_grad():
        proj.weight.data.div_(-2.0)  # exact; the module-scoped model is shared with later tests
    invalidate_grids(meg)


def test_quant_parallel_linear_equals_quantized_linear(moe):
    from miles_lp.formats.spec import BackwardMode, Format
    from miles_lp.train.quant_linear import LinearRecipe, quantized_linear

    _, _, meg = moe
    fc2 = meg.decoder.layers[0].mlp.experts.local_experts[0].linear_fc2
    recipe = LinearRecipe(Format.NVFP4, BackwardMode.HIGH_PRECISION, "token", name="fc2")
    fc2.set_recipe(recipe, ("x",))
    x = torch.randn(16, 64, requires_grad=True)
    y, _ = fc2(x)
    ref = quantized_linear(x.detach(), fc2.weight.detach(), recipe)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    y.sum().backward()
    assert torch.isfinite(fc2.weight.grad).all() and x.grad is not None


def test_te_config_from_plan():
    from miles_lp.checkpoint.tiny import tiny_config
    from miles_lp.train.megatron.te import te_config, te_environment

    layout = get_layout(tiny_config("qwen3_moe", num_layers=4))
    plan = compile_plan(_policy({"default": "mxfp8", "backward": "dequantized",
                                 "rules": [{"layers": "last 1", "format": "bf16"}]}), layout)
    cfg = te_config(plan)
    assert cfg.kwargs["fp8"] == "e4m3" and cfg.kwargs["fp8_recipe"] == "mxfp8"
    assert cfg.kwargs["num_layers_at_end_in_bf16"] == 1 and cfg.kwargs["first_last_layers_bf16"] is True
    assert cfg.kwargs["transformer_impl"] == "transformer_engine"
    assert cfg.env == {"NVTE_BACKWARD_OVERRIDE": "dequantized"}
    nv = compile_plan(_policy({"default": "nvfp4", "backward": "high_precision"}), layout)
    c2 = te_config(nv)
    assert c2.kwargs["fp4"] == "e2m1" and c2.kwargs["fp4_recipe"] == "nvfp4"
    assert c2.env == {"NVTE_BACKWARD_OVERRIDE": "high_precision", "NVTE_NVFP4_ROW_SCALED_ACTIVATION": "1"}
    with te_environment(c2):
        assert os.environ["NVTE_BACKWARD_OVERRIDE"] == "high_precision"
    assert "NVTE_BACKWARD_OVERRIDE" not in os.environ or os.environ["NVTE_BACKWARD_OVERRIDE"] != "high_precision"
    mixed = compile_plan(_policy({"default": "bf16", "rules": [{"role": "routed_experts", "format": "nvfp4"}]}),
                         layout)
    with pytest.raises(ConfigError, match="per-module exception.*megatron.impl: local"):
        te_config(mixed)


def test_te_config_exact_values_env_conflicts_and_restore(monkeypatch):
    """Path (b): the full kwargs for an MXFP8 plan, TE's default backward (no override variable) for
    'quantized', a conflicting variable refused by name, and the environment restored exactly."""
    from miles_lp.checkpoint.tiny import tiny_config
    from miles_lp.train.megatron.te import te_config, te_environment

    layout = get_layout(tiny_config("qwen3_moe", num_layers=4))
    plan = compile_plan(_policy({"default": "mxfp8", "backward": "quantized",
                                 "rules": [{"layers": "first 1", "format": "bf16"}]}), layout)
    cfg = te_config(plan)
    assert {k: cfg.kwargs[k] for k in ("fp8", "fp8_recipe", "num_layers_at_start_in_bf16",
                                       "num_layers_at_end_in_bf16", "transformer_impl")} == {
        "fp8": "e4m3", "fp8_recipe": "mxfp8", "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 0,
        "transformer_impl": "transformer_engine"}
    assert "fp4" not in cfg.kwargs or cfg.kwargs["fp4"] is None
    assert cfg.env == {}  # quantized backward = TE's default recipe: no NVTE_BACKWARD_OVERRIDE
    dq = te_config(compile_plan(_policy({"default": "mxfp8", "backward": "dequantized"}), layout))
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "high_precision")
    with pytest.raises(ConfigError, match=r"NVTE_BACKWARD_OVERRIDE='high_precision' conflicts with the plan's "
                                          r"'dequantized'; unset it"):
        with te_environment(dq):
            pass
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "dequantized")  # same value: accepted, kept afterwards
    with te_environment(dq):
        assert os.environ["NVTE_BACKWARD_OVERRIDE"] == "dequantized"
    assert os.environ["NVTE_BACKWARD_OVERRIDE"] == "dequantized"
    monkeypatch.delenv("NVTE_BACKWARD_OVERRIDE")
    with te_environment(dq):
        assert os.environ["NVTE_BACKWARD_OVERRIDE"] == "dequantized"
    assert "NVTE_BACKWARD_OVERRIDE" not in os.environ


def test_te_quantizer_unavailable_here_says_why():
    from miles_lp.errors import BackendUnavailable
    from miles_lp.train.megatron.te import te_available, te_quantize_mxfp8

    reason = te_available()
    if reason is None:
        pytest.skip("TE on Blackwell is available here")
    with pytest.raises(BackendUnavailable, match="TE quantizer unavailable: " + reason.split("(")[0][:30]):
        te_quantize_mxfp8(torch.zeros(32, 32))
