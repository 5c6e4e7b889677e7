"""Megatron-Core backend on CPU: config translation, HF -> Megatron weights (checked through Megatron's own
qkv splitter), the plan attached per module, learner_weights bytes, and the TE configuration (path (b)).

Megatron's attention needs CUDA, so whole-model forward/backward runs in scripts/h200_train_check.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from miles_lp.config import Where
from miles_lp.errors import ConfigError, LayoutError
from miles_lp.policy import compile_plan, get_layout, parse_policy

mc = pytest.importorskip("megatron.core", reason="megatron-core not installed (extra 'megatron')")


def _policy(raw):
    return parse_policy(raw, Where("<test>", "precision"))


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
    q2 = transformer_config_kwargs(tiny_config("qwen2_moe"))
    assert q2["add_qkv_bias"] and q2["moe_shared_expert_intermediate_size"] == 64 and q2["moe_shared_expert_gate"]
    assert q2["moe_layer_freq"] == [1, 1, 1, 1] and not q2["qk_layernorm"]
    ds_cfg = tiny_config("deepseek_v3")
    ds = transformer_config_kwargs(ds_cfg)
    assert ds["multi_latent_attention"] and ds["moe_layer_freq"] == [0, 1, 1, 1]  # first_k_dense_replace=1
    assert (ds["q_lora_rank"], ds["kv_lora_rank"], ds["qk_head_dim"], ds["qk_pos_emb_head_dim"], ds["v_head_dim"]) \
        == (64, 64, 32, 32, 32)
    assert ds["moe_router_score_function"] == "sigmoid" and ds["moe_router_enable_expert_bias"]
    assert ds["moe_shared_expert_intermediate_size"] == 64 and "moe_router_num_groups" not in ds  # n_group=1
    ds_cfg.rope_interleave = False
    with pytest.raises(LayoutError, match="rope_interleave=False"):
        transformer_config_kwargs(ds_cfg)
    ds_cfg = tiny_config("deepseek_v3")
    ds_cfg.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                              "original_max_position_embeddings": 64}
    with pytest.raises(LayoutError, match="rope_type 'yarn' is not mapped"):
        transformer_config_kwargs(ds_cfg)
    ds_cfg = tiny_config("deepseek_v3")
    ds_cfg.n_group, ds_cfg.topk_group, ds_cfg.num_experts_per_tok = 2, 2, 2
    with pytest.raises(LayoutError, match="top-2 experts"):
        transformer_config_kwargs(ds_cfg)
    with pytest.raises(LayoutError, match="model_type 'gpt2'.*embedded backend"):
        transformer_config_kwargs({"model_type": "gpt2"})


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
    from miles_lp.train.megatron.layers import attach_plan
    from miles_lp.train.quant_linear import learner_weights

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
    from miles_lp.train.gemm import quantized_linear
    from miles_lp.train.recipe import LinearRecipe

    _, _, meg = moe
    fc2 = meg.decoder.layers[0].mlp.experts.local_experts[0].linear_fc2
    recipe = LinearRecipe(Format.NVFP4, BackwardMode.HIGH_PRECISION, "token", name="fc2")
    fc2.set_recipe(recipe, ("x",))
    fc2.ran_quantized = False  # the module-scoped model may have run before
    assert fc2.executed_quantized() == {}
    x = torch.randn(16, 64, requires_grad=True)
    y, _ = fc2(x)
    assert fc2.executed_quantized() == {"x": "nvfp4"}  # recorded by the forward (the one walker collects it)
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


# ---------------------------------------------------------------------------------------------------------
# Qwen2-MoE (shared expert + sigmoid gate) and DeepSeek-V3 (MLA, dense first layer, sigmoid router + bias)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_forward():
    """Megatron's forward on a CPU-only torch: three CUDA-only call sites redirected, for this module only.

    ``RotaryEmbedding`` / the router's ``expert_bias`` buffer use ``torch.cuda.current_device()``, and
    ``DotProductAttention`` forks the CUDA RNG tracker (dropout is 0 here). A causal mask is passed explicitly
    (the default one is allocated on "cuda").
    """
    if torch.cuda.is_available():
        yield
        return
    import contextlib

    import megatron.core.tensor_parallel as tp

    class _NoFork:
        def fork(self, *a, **k):
            return contextlib.nullcontext()

    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.cuda, "current_device", lambda: "cpu")
        m.setattr(tp, "get_cuda_rng_tracker", lambda *a, **k: _NoFork())
        yield


def _hf_model(arch, num_layers=3, **overrides):
    import transformers

    from miles_lp.checkpoint.tiny import tiny_config

    cfg = tiny_config(arch, num_layers=num_layers)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and router bias, so a swapped tensor shows in the logits
        for k, v in hf.state_dict().items():
            if "e_score_correction_bias" in k:
                v.copy_(torch.randn_like(v) * 0.1)
            elif k.endswith("mlp.gate.weight"):  # routing that differs from token to token
                v.copy_(torch.randn_like(v))
            elif k.endswith("norm.weight") or k.endswith("layernorm.weight"):
                v.copy_(1 + 0.1 * torch.randn_like(v))
    return cfg, hf


def _megatron_logits(meg, ids):
    s = ids.shape[1]
    pos = torch.arange(s)[None].expand(ids.shape[0], -1)
    mask = torch.triu(torch.ones(s, s), 1).bool()[None, None]
    return meg(ids, pos, attention_mask=mask)


NEW_ARCHS = [("qwen2_moe", {}), ("deepseek_v3", {}),
             ("deepseek_v3", {"routed_scaling_factor": 2.5, "n_group": 2, "topk_group": 1, "q_lora_rank": None})]


@pytest.mark.parametrize("arch,overrides", NEW_ARCHS, ids=["qwen2_moe", "deepseek_v3", "deepseek_v3-groups-noqlora"])
def test_new_arch_name_coverage_and_fp32_logits_equal_hf(mp, cpu_forward, arch, overrides):
    """Every HF tensor read once, every Megatron parameter (+ expert_bias) written, and the fp32 logits of the
    quantized-class model with no plan attached equal HF's (same math as on the GPU, CPU kernels)."""
    from miles_lp.train.megatron.model import (
        build_gpt_model,
        hf_to_megatron,
        load_hf_weights,
        megatron_targets,
    )

    cfg, hf = _hf_model(arch, **overrides)
    meg = build_gpt_model(cfg, quantized=True)
    sd = hf.state_dict()
    state = hf_to_megatron(sd, cfg)
    targets = megatron_targets(meg)
    assert set(state) == set(targets)
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in targets.items()}
    if arch == "deepseek_v3":
        assert "decoder.layers.0.mlp.linear_fc1.weight" in state  # first_k_dense_replace
        assert "decoder.layers.1.mlp.router.expert_bias" in state
        assert "decoder.layers.1.mlp.shared_experts.linear_fc1.weight" in state
        from miles_lp.train.megatron.layers import QuantColumnParallelLinear

        down = meg.decoder.layers[0].self_attention.linear_kv_down_proj
        assert isinstance(down, QuantColumnParallelLinear)
    else:
        assert tuple(state["decoder.layers.0.mlp.shared_experts.gate_weight"].shape) == (1, cfg.hidden_size)
    with pytest.raises(LayoutError, match="not consumed.*model.layers.0.extra"):
        hf_to_megatron({**sd, "model.layers.0.extra.weight": torch.zeros(1)}, cfg)
    with pytest.raises(LayoutError, match="has no 'model.layers.1.mlp.gate.weight'"):
        hf_to_megatron({k: v for k, v in sd.items() if k != "model.layers.1.mlp.gate.weight"}, cfg)
    load_hf_weights(meg, sd, cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ml = _megatron_logits(meg, ids)
        hl = hf(input_ids=ids).logits
    assert float((ml - hl).abs().max()) < 2e-6 * max(1.0, float(hl.abs().max()))
    if arch == "deepseek_v3":  # sensitivity: a different router bias changes the routing, hence the logits
        with torch.no_grad():
            meg.decoder.layers[1].mlp.router.expert_bias.add_(torch.tensor([5.0, 0.0, 0.0, 0.0]))
            assert float((_megatron_logits(meg, ids) - hl).abs().max()) > 1e-4


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_new_arch_attach_plan_and_learner_weights_bytes(mp, cpu_forward, arch):
    from miles_lp import formats
    from miles_lp.train.megatron.layers import attach_plan
    from miles_lp.train.megatron.model import build_gpt_model, load_hf_weights
    from miles_lp.train.quant_linear import learner_weights

    cfg, hf = _hf_model(arch)
    meg = build_gpt_model(cfg, quantized=True)
    sd = hf.state_dict()
    load_hf_weights(meg, sd, cfg)
    layout = get_layout(cfg)
    plan = compile_plan(_policy({"default": "mxfp8", "rules": [
        {"role": "routed_experts", "format": "nvfp4"}, {"role": "shared_experts", "format": "nvfp4"}]}), layout)
    report = attach_plan(meg, plan, layout)
    assert report["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"] == "nvfp4/dequantized"
    assert report["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"] == "nvfp4/dequantized"
    lw = dict(learner_weights(meg))
    assert set(lw) == set(plan.quantized())
    sh = "shared_expert" if arch == "qwen2_moe" else "shared_experts"
    assert not any("shared_expert_gate" in n or n.endswith(".gate.weight") for n in lw)  # BF16 by invariant
    for name, q in lw.items():  # every exported tensor: the bytes of quantize_* of the HF weight under the plan
        fmt = plan.entries[name].format.value
        if fmt == "mxfp8":
            ref = formats.quantize_mxfp8(sd[name])
            assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)), name
            assert torch.equal(q.scale, ref.scale), name
    # NVFP4 gate/up pairs share one global scale: shared experts and a routed expert
    pre = f"model.layers.1.mlp.{sh}."
    rg, ru = formats.quantize_nvfp4_pair(sd[pre + "gate_proj.weight"], sd[pre + "up_proj.weight"])
    got_g, got_u = lw[pre + "gate_proj.weight"], lw[pre + "up_proj.weight"]
    assert torch.equal(got_g.data, rg.data) and torch.equal(got_u.data, ru.data)
    assert torch.equal(got_g.scale.view(torch.uint8), rg.scale.view(torch.uint8))
    assert torch.equal(got_g.global_scale, rg.global_scale) and torch.equal(got_u.global_scale, got_g.global_scale)
    down = lw[pre + "down_proj.weight"]
    ref_d = formats.quantize_nvfp4(sd[pre + "down_proj.weight"])
    assert torch.equal(down.data, ref_d.data) and torch.equal(down.global_scale, ref_d.global_scale)
    gu = sd["model.layers.2.mlp.experts.gate_up_proj"][3]
    eg, eu = formats.quantize_nvfp4_pair(gu[:64], gu[64:])
    assert torch.equal(lw["model.layers.2.mlp.experts.3.gate_proj.weight"].data, eg.data)
    assert torch.equal(lw["model.layers.2.mlp.experts.3.up_proj.weight"].global_scale, eu.global_scale)
    if arch == "deepseek_v3":
        for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            name = f"model.layers.0.self_attn.{n}.weight"
            if name in plan.quantized():
                assert name in lw
        assert "model.layers.0.mlp.gate_proj.weight" in lw  # the dense first layer


def test_qwen_moe_mlp_only_layers_mix_dense_and_moe(mp, cpu_forward):
    from miles_lp.train.megatron.model import build_gpt_model, load_hf_weights

    cfg, hf = _hf_model("qwen2_moe", num_layers=3, mlp_only_layers=[1])
    meg = build_gpt_model(cfg, quantized=False)
    load_hf_weights(meg, hf.state_dict(), cfg)
    assert hasattr(meg.decoder.layers[1].mlp, "linear_fc1") and hasattr(meg.decoder.layers[0].mlp, "router")
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = float((_megatron_logits(meg, ids) - hf(input_ids=ids).logits).abs().max())
    assert diff < 2e-6


def test_expert_with_no_tokens_runs_empty(moe):
    """SequentialMLP calls every local expert, also one the router gave no token: no quantization, empty output."""
    from miles_lp.formats.spec import BackwardMode, Format
    from miles_lp.train.quant_linear import LinearRecipe

    _, _, meg = moe
    fc1 = meg.decoder.layers[0].mlp.experts.local_experts[1].linear_fc1
    saved = (fc1.recipe, fc1.members, fc1.grid)
    fc1.set_recipe(LinearRecipe(Format.NVFP4, BackwardMode.DEQUANTIZED, "token", name="fc1"), ("x",))
    x = torch.zeros(0, 64, requires_grad=True)
    y, _ = fc1(x)
    assert tuple(y.shape) == (0, fc1.weight.shape[0])
    y.sum().backward()
    assert fc1.weight.grad is not None and not fc1.weight.grad.any()
    fc1.weight.grad = None
    fc1.recipe, fc1.members, fc1.grid = saved


@pytest.mark.parametrize("arch,fmt", [("qwen3_moe", "mixed"), ("qwen2_moe", "mixed"), ("deepseek_v3", "mixed"),
                                      ("qwen3", "dense-nvfp4"), ("deepseek_v3", "dense-nvfp4")])
def test_megatron_export_equals_the_embedded_export_and_convert(mp, cpu_forward, tmp_path, arch, fmt):
    """The Megatron learner's export under HF names: for the same weights, every tensor of
    every target's engine checkpoint equals the embedded learner's export (which equals `miles-lp convert`,
    tests/e2e/test_export.py), byte for byte: MXFP8 grids, NVFP4 with q/k/v, gate/up and DeepSeek's q_a/kv_a
    sharing one global scale (one Megatron GEMM or amax partners), BF16 tensors in the checkpoint's dtype."""
    import transformers

    from miles_lp.checkpoint.tiny import make_tiny_model
    from miles_lp.cli.convert import policy_for_format
    from miles_lp.cli.export import learner_from_hf
    from miles_lp.export import engine_tensors
    from miles_lp.train.embedded import SourceInfo
    from miles_lp.train.megatron.export import megatron_export_weights
    from miles_lp.train.megatron.layers import attach_plan
    from miles_lp.train.megatron.model import build_gpt_model, load_hf_weights

    d = make_tiny_model(arch, tmp_path / arch, num_layers=2)
    policy = policy_for_format("mxfp8+nvfp4-experts") if fmt == "mixed" else _policy(
        {"default": "nvfp4", "backward": "high_precision"})
    learner = learner_from_hf(d, policy)
    plan = learner.plan
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    meg = build_gpt_model(hf.config, quantized=True)
    load_hf_weights(meg, hf.state_dict(), hf.config)
    attach_plan(meg, plan, plan.layout)
    meg_out = list(megatron_export_weights(meg, hf.config, dtypes=SourceInfo.from_checkpoint(d).dtypes))
    assert len({n for n, _ in meg_out}) == len(meg_out) and {n for n, _ in meg_out} == set(plan.entries)
    for target in ("sglang", "compressed-tensors"):
        a = dict(engine_tensors(meg_out, plan, target))
        b = dict(engine_tensors(learner.export_weights(), plan, target))
        assert a.keys() == b.keys()
        bad = [k for k in a if not (a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(
            a[k].contiguous().reshape(-1).view(torch.uint8), b[k].contiguous().reshape(-1).view(torch.uint8)))]
        assert not bad, bad[:5]
        scales = [k for k in a if k.endswith(("weight_scale_inv", "weight_scale_2", "weight_scale"))]
        assert len(scales) >= len(plan.quantized())  # quantized tensors were compared, not only BF16 ones
    if arch == "deepseek_v3" and fmt == "dense-nvfp4":  # fault injection: without the q_a/kv_a amax partners
        from miles_lp.train.quant_linear import invalidate_grids

        attn = meg.decoder.layers[0].self_attention
        for down in (attn.linear_q_down_proj, attn.linear_kv_down_proj):
            assert down.grid.amax_partners  # attach_plan paired the two
            down.grid.amax_partners = []
        invalidate_grids(meg)
        alone = dict(megatron_export_weights(meg, hf.config))
        ref = dict(learner.export_weights())
        names = [f"model.layers.0.self_attn.{p}.weight" for p in ("q_a_proj", "kv_a_proj_with_mqa")]
        assert torch.equal(ref[names[0]].global_scale, ref[names[1]].global_scale)  # one scale in the plan
        assert sum(not torch.equal(alone[n].global_scale, ref[n].global_scale) for n in names) == 1
