"""Emitters: each consumer config re-read with the consumer's own matching semantics gives the plan's layer set."""

import pytest

from miles_lp.checkpoint.tiny import ARCHS, tiny_config
from miles_lp.config import Where
from miles_lp.errors import ConfigError
from miles_lp.formats.spec import Format
from miles_lp.policy import compile_plan, emit, get_layout, parse_policy, policy_from_flags
from miles_lp.policy import consumers as C

MOE = [a for a in ARCHS if a in ("qwen3_moe", "qwen2_moe", "deepseek_v3", "mixtral")]


def _plan(arch, mapping):
    return compile_plan(parse_policy(mapping, Where("t.yaml", "precision"), comparison_formats=True),
                        get_layout(tiny_config(arch).to_dict()))


def _quantized_modules(plan):
    return {m.name for m in emit.engine_modules(plan).values() if m.format.quantized}


@pytest.mark.parametrize("arch", ARCHS)
def test_sglang_mxfp8_roundtrip(arch):
    plan = compile_plan(policy_from_flags("mxfp8", 1, 1), get_layout(tiny_config(arch).to_dict()))
    cfg = emit.sglang_config(plan)
    mods = emit.engine_modules(plan)
    got = {n for n in mods if not C.sglang_is_layer_skipped(n, cfg["modules_to_not_convert"])}
    assert got == _quantized_modules(plan) and got
    assert "model.layers.0." in cfg["modules_to_not_convert"] and "lm_head" in cfg["modules_to_not_convert"]
    # vLLM modelopt_mxfp8 and compressed-tensors agree too
    v = emit.vllm_config(plan)
    assert {n for n in mods if not C.vllm_modelopt_is_layer_excluded(n, v["ignore"])} == got
    emit.compressed_tensors_config(plan)
    mixed = emit.modelopt_mixed_config(plan)  # one-format plans can also be written as MIXED_PRECISION
    assert {n for n in mods if C.sglang_modelopt_mixed_algo(n, mixed["quantized_layers"],
                                                            mixed["packed_modules_mapping"])} == got


@pytest.mark.parametrize("arch", MOE)
def test_nvfp4_experts_roundtrip(arch):
    plan = _plan(arch, {"default": "bf16", "rules": [{"role": "routed_experts", "format": "nvfp4"}]})
    mods = emit.engine_modules(plan)
    cfg = emit.modelopt_config(plan)
    for fn in (C.vllm_modelopt_is_layer_excluded, C.sglang_modelopt_is_layer_excluded):
        assert {n for n in mods if not fn(n, cfg["ignore"])} == _quantized_modules(plan)
    assert emit.hf_quant_config(plan)["quantization"]["exclude_modules"] == cfg["ignore"]
    assert all(n.endswith(".experts") for n in _quantized_modules(plan))


@pytest.mark.parametrize("arch", MOE)
def test_mixed_roundtrip(arch):
    plan = _plan(arch, {"default": "mxfp8", "rules": [{"layers": "last 1", "format": "bf16"},
                                                      {"role": "routed_experts", "format": "nvfp4"}]})
    mods = emit.engine_modules(plan)
    mixed = emit.modelopt_mixed_config(plan)
    algos = {n: C.sglang_modelopt_mixed_algo(n, mixed["quantized_layers"], mixed["packed_modules_mapping"])
             for n in mods}
    want = {m.name: {"mxfp8": "MXFP8", "nvfp4": "NVFP4"}.get(m.format.value) for m in mods.values()}
    assert algos == want and {"MXFP8", "NVFP4"} <= set(algos.values())
    # an SGLang without MXFP8 dispatch would read the MXFP8 modules as BF16: only the live audit can tell
    old = {n for n in mods if C.sglang_modelopt_mixed_resolve(n, mixed["quantized_layers"],
                                                             mixed["packed_modules_mapping"])
           not in C.SGLANG_MIXED_DISPATCH_WITHOUT_MXFP8 and algos[n]}
    assert old == {n for n, a in algos.items() if a == "MXFP8"}
    ct = emit.compressed_tensors_config(plan)
    assert ct["format"] == "mixed-precision" and len(ct["config_groups"]) == 2
    for m in mods.values():
        hits = {g for g, spec in ct["config_groups"].items() for s in m.shards
                if C.ct_is_match(s, False, spec["targets"], ct["ignore"])}
        assert bool(hits) == m.format.quantized, m.name
    with pytest.raises(ConfigError, match="one format"):
        emit.sglang_config(plan)
    with pytest.raises(ConfigError, match="cannot express"):
        emit.megatron_kwargs(plan)
    kw = emit.megatron_kwargs(plan, strict=False)  # base = the format holding most parameters (the experts)
    base = Format.NVFP4 if kw.get("fp4_recipe") == "nvfp4" else Format.MXFP8
    assert kw["num_layers_at_end_in_bf16"] == 1
    overrides = emit.megatron_overrides(plan)
    assert overrides and set(overrides.values()) == {Format.MXFP8, Format.NVFP4} - {base}
    assert all(plan.entry(n).format is f for n, f in overrides.items())
    assert emit.te_env(plan) == {"NVTE_BACKWARD_OVERRIDE": "dequantized", "NVTE_NVFP4_ROW_SCALED_ACTIVATION": "1"}


def _split(arch, names_to_bf16):
    """A plan whose fused shards disagree, as an older plan.json could hold (compile_plan refuses it now)."""
    import dataclasses

    from miles_lp.policy.plan import PrecisionPlan

    plan = _plan(arch, {"default": "mxfp8"})
    entries = {n: (dataclasses.replace(e, format=Format.BF16, rule="rules[0]", backward=None)
                   if any(s in n for s in names_to_bf16) else e) for n, e in plan.entries.items()}
    return PrecisionPlan(entries, model_type=plan.model_type, num_layers=plan.num_layers, layout=plan.layout)


def test_split_fused_qkv_is_rejected_naming_tensors():
    with pytest.raises(ConfigError, match=r"fused shards of 'model.layers.0.self_attn.qkv' must share one format.*"
                                          r"k_proj.weight' is bf16 \(rules\[0\]\).*'k_proj', 'q_proj', 'v_proj'"):
        _plan("qwen3", {"default": "mxfp8", "rules": [{"match": "*.k_proj", "format": "bf16"}]})
    plan = _split("qwen3", (".k_proj",))  # the emitters refuse it on their own too
    for fn in (emit.sglang_config, emit.vllm_config, emit.compressed_tensors_config, emit.modelopt_mixed_config):
        with pytest.raises(ConfigError, match=r"qkv_proj.*k_proj.weight' is bf16 \(rules\[0\]\)"):
            fn(plan)
    with pytest.raises(ConfigError, match="cannot express"):
        emit.megatron_kwargs(plan)


def test_split_mla_fused_qkv_a_is_rejected():
    with pytest.raises(ConfigError, match=r"fused shards of 'model.layers.0.self_attn.fused_qkv_a'.*"
                                          r"'kv_a_proj_with_mqa', 'q_a_proj'"):
        _plan("deepseek_v3", {"default": "mxfp8", "rules": [{"role": "mla_q_a", "format": "bf16"}]})
    with pytest.raises(ConfigError, match="fused_qkv_a_proj_with_mqa"):
        emit.sglang_config(_split("deepseek_v3", (".q_a_proj",)))


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_shards_are_one_joint_scale_group(arch):
    """Every engine module built from several shards of one layer (qkv_proj, gate_up_proj, fused_qkv_a) is one
    plan group per fused parameter, so the converter and the learner give them one NVFP4 global scale (
    item 3). FusedMoE experts are per-expert groups (gate+up of one expert), as the engines keep them."""
    plan = _plan(arch, {"default": "nvfp4"})
    for m in emit.engine_modules(plan).values():
        names = [s + ".weight" for s in m.shards]
        if m.moe:
            for n in names:
                g = plan.entry(n).group
                if n.endswith((".gate_proj.weight", ".up_proj.weight", ".w1.weight", ".w3.weight")):
                    assert g is not None and len(plan.groups[g]) == 2, (n, g)
            continue
        groups = {plan.entry(n).group for n in names}
        assert len(groups) == 1, (m.name, groups)
        g = groups.pop()
        if len(names) == 1:
            assert g is None, (m.name, g)
        else:
            assert g is not None and set(plan.groups[g]) == set(names), (m.name, g)


def test_split_experts_of_one_layer_is_rejected():
    plan = _plan("qwen3_moe", {"default": "mxfp8", "rules": [{"match": "*.experts.0.*", "format": "bf16"}]})
    with pytest.raises(ConfigError, match="FusedMoE"):
        emit.sglang_config(plan)


def test_megatron_first_last_and_middle():
    layout = get_layout(tiny_config("llama", num_layers=6).to_dict())
    plan = compile_plan(policy_from_flags("mxfp8", 2, 1), layout)
    kw = emit.megatron_kwargs(plan)
    assert kw == {"fp8": "e4m3", "fp8_recipe": "mxfp8", "first_last_layers_bf16": True,
                  "num_layers_at_start_in_bf16": 2, "num_layers_at_end_in_bf16": 1}
    for e in plan.entries.values():
        if e.role.value in ("attention_qkv", "dense_mlp") and e.layer is not None:
            assert C.megatron_is_first_last_bf16_layer(e.layer, 6, True, 2, 1) == (not e.format.quantized)
    mid = compile_plan(parse_policy({"default": "mxfp8", "rules": [{"layers": [3], "format": "bf16"}]}, Where("x")),
                       layout)
    with pytest.raises(ConfigError, match=r"first/last.*layers \[3\]"):
        emit.megatron_kwargs(mid)


def test_deepseek_recipe_needs_overrides_for_kv_b():
    plan = _plan("deepseek_v3", {"default": "mxfp8", "rules": [{"role": "mla_kv_b", "format": "bf16"}]})
    assert emit.sglang_config(plan)["modules_to_not_convert"]
    kw = emit.megatron_kwargs(plan, strict=False)
    assert kw["first_last_layers_bf16"] is False
    assert all("kv_b_proj" in n for n in emit.megatron_overrides(plan))


def test_te_env_high_precision_and_mixed_backward():
    plan = _plan("qwen3", {"default": "mxfp8", "backward": "high_precision"})
    assert emit.te_env(plan) == {"NVTE_BACKWARD_OVERRIDE": "high_precision"}
    assert emit.te_env(_plan("qwen3", {"default": "mxfp8", "backward": "quantized"})) == {}
    mixed = _plan("qwen3", {"default": "mxfp8", "rules": [{"role": "dense_mlp", "format": "mxfp8",
                                                          "backward": "quantized"}]})
    with pytest.raises(ConfigError, match="NVTE_BACKWARD_OVERRIDE is global"):
        emit.te_env(mixed)


def test_consumer_semantics_traps():
    # SGLang dot-boundary: `mlp.gate` does not skip `mlp.gate_up_proj` (it did by substring before PR #23467)
    assert not C.sglang_module_path_match("model.layers.1.mlp.gate", "model.layers.1.mlp.gate_up_proj")
    assert C.sglang_module_path_match("model.layers.1.", "model.layers.1.self_attn.qkv_proj")
    assert not C.sglang_module_path_match("model.layers.1.", "model.layers.10.self_attn.qkv_proj")
    # vLLM modelopt keeps a substring fallback: a short exclude entry over-matches
    assert C.vllm_modelopt_is_layer_excluded("model.layers.1.mlp.gate_up_proj", ["mlp.gate"])
    # compressed-tensors re: is re.match (prefix-anchored), plain targets are exact
    assert C.ct_match_name("model.layers.1.mlp.gate_up_proj", "re:model.layers.1.mlp.gate")
    assert not C.ct_match_name("model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.gate")
    with pytest.raises(C.FusedShardMismatch):
        C.sglang_is_layer_skipped("model.layers.0.self_attn.qkv_proj", ["model.layers.0.self_attn.k_proj"])


def test_compressed_tensors_matches_installed_package():
    """Our re-implementation agrees with the installed compressed-tensors `match_name`."""
    ct = pytest.importorskip("compressed_tensors.utils.match")
    names = ["model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.gate", "model.layers.10.self_attn.q_proj"]
    targets = ["re:model.layers.1.mlp.gate", "model.layers.1.mlp.gate", "re:.*q_proj$", "re:model\\.layers\\.1\\."]
    fused = {"gate_up_proj": ["gate_proj", "up_proj"]}
    for n in names:
        for t in targets:
            assert C.ct_match_name(n, t) == ct.match_name(n, t)
            assert C.ct_match_name(n, t, fused) == ct.match_name(n, t, fused)


# ---- SGLang modelopt_mixed, as SGLang's ModelOptMixedPrecisionConfig reads it -------------------------------
@pytest.mark.parametrize("arch", MOE)
def test_modelopt_mixed_nvfp4_read_as_sglang_does(arch):
    plan = _plan(arch, {"default": "bf16", "rules": [{"layers": "last 1", "format": "bf16"},
                                                     {"role": "linear", "format": "nvfp4"}]})
    mixed = emit.modelopt_mixed_config(plan)
    assert mixed["quant_algo"] == "MIXED_PRECISION" and mixed["quantized_layers"]
    packed = mixed["packed_modules_mapping"]
    for m in emit.engine_modules(plan).values():
        want = "NVFP4" if m.format.quantized else None
        assert C.sglang_modelopt_mixed_algo(m.name, mixed["quantized_layers"], packed) == want, m.name
        assert C.modelopt_mixed_layer_algo(m.shards, mixed["quantized_layers"]) == want, m.name
    # without the packed mapping SGLang resolves a fused qkv_proj to None (bf16): why the emitter writes it
    qkv = next(m.name for m in emit.engine_modules(plan).values() if m.name.endswith(("qkv_proj", "gate_up_proj",
                                                                                      "_with_mqa")) and m.format.quantized)
    assert C.sglang_modelopt_mixed_resolve(qkv, mixed["quantized_layers"], None) is None


def test_sglang_mixed_resolve_semantics():
    """SGLang ModelOptMixedPrecisionConfig._resolve_quant_algo: exact key, packed shards (listed ones only; several
    algos raise), then the first key under `prefix.`; get_quant_method runs FP8, NVFP4 and MXFP8."""
    ql = {"m.l.0.self_attn.q_proj": {"quant_algo": "nvfp4"}, "m.l.0.self_attn.k_proj": {"quant_algo": "NVFP4"},
          "m.l.0.mlp.experts.0.gate_proj": {"quant_algo": "FP8"}, "m.l.0.mlp.experts.1.gate_proj": {"quant_algo": "NVFP4"},
          "m.l.1.self_attn.o_proj": {"quant_algo": "MXFP8"}, "m.l.2.self_attn.q_proj": {"quant_algo": "FP8"},
          "m.l.2.self_attn.v_proj": {"quant_algo": "NVFP4"}}
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert C.sglang_modelopt_mixed_resolve("m.l.0.self_attn.qkv_proj", ql, packed) == "NVFP4"  # v_proj unlisted
    assert C.sglang_modelopt_mixed_resolve("m.l.0.self_attn.qkv_proj", ql, None) is None
    assert C.sglang_modelopt_mixed_resolve("m.l.0.mlp.experts", ql) == "FP8"  # first key wins, no agreement check
    with pytest.raises(C.FusedShardMismatch):
        C.sglang_modelopt_mixed_resolve("m.l.2.self_attn.qkv_proj", ql, packed)
    assert C.sglang_modelopt_mixed_resolve("m.l.1.self_attn.o_proj", ql) == "MXFP8"
    assert C.sglang_modelopt_mixed_algo("m.l.1.self_attn.o_proj", ql) == "MXFP8"  # dispatched (CONTRACT 4)
    ql_blk = dict(ql, **{"m.l.1.self_attn.o_proj": {"quant_algo": "FP8_BLOCK_SCALES"}})
    assert C.sglang_modelopt_mixed_algo("m.l.1.self_attn.o_proj", ql_blk) is None  # not dispatched: loaded bf16
    with pytest.raises(C.FusedShardMismatch):  # our strict shard reading refuses what SGLang would half-quantize
        C.modelopt_mixed_layer_algo(["m.l.0.self_attn.q_proj", "m.l.0.self_attn.v_proj"], ql)


@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_tensor"])
def test_modelopt_mixed_refuses_fp8(fmt):
    plan = _plan("qwen3_moe", {"default": "bf16", "rules": [{"role": "attention", "format": fmt},
                                                            {"role": "routed_experts", "format": "nvfp4"}]})
    msg = {"fp8_block": r"cannot run fp8_block .*'FP8_BLOCK_SCALES' falls through to UnquantizedLinearMethod",
           "fp8_tensor": r"cannot run fp8_tensor .*ModelOpt 'FP8' is static per-tensor FP8 with a calibrated "
                         r"input_scale"}[fmt]
    with pytest.raises(ConfigError, match=msg):
        emit.modelopt_mixed_config(plan)


# ---- FP8 block / tensor plans ---------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_tensor"])
def test_fp8_plans_emit(arch, fmt):
    plan = compile_plan(policy_from_flags(fmt, 1, 1, ("re:.*\\.o_proj",)), get_layout(tiny_config(arch).to_dict()))
    mods = emit.engine_modules(plan)
    want = _quantized_modules(plan)
    assert want
    # SGLang `fp8` (Fp8Config): weight_block_size [128, 128] for block, none for tensor-wise; ignored_layers
    cfg = emit.sglang_config(plan)
    assert cfg["quant_method"] == "fp8" and cfg["activation_scheme"] == "dynamic"
    assert cfg.get("weight_block_size") == ([128, 128] if fmt == "fp8_block" else None)
    for skip in (cfg["ignored_layers"], C.sglang_fp8_ignored_layers(cfg["ignored_layers"])):
        assert {n for n in mods if not C.sglang_is_layer_skipped(n, skip)} == want
    assert "model.layers.0." in cfg["ignored_layers"] and "lm_head" in cfg["ignored_layers"]
    # compressed-tensors: block / tensor float-quantized scheme
    ct = emit.compressed_tensors_config(plan)
    assert ct["format"] == "float-quantized" and len(ct["config_groups"]) == 1
    (g,) = ct["config_groups"].values()
    assert g["weights"]["strategy"] == ("block" if fmt == "fp8_block" else "tensor")
    assert {m.name for m in mods.values() if any(C.ct_is_match(s, False, g["targets"], ct["ignore"])
                                                 for s in m.shards)} == want
    # Megatron-Core: TE blockwise / tensorwise recipe
    kw = emit.megatron_kwargs(plan, strict=False)
    assert kw["fp8_recipe"] == ("blockwise" if fmt == "fp8_block" else "tensorwise")
    # consumers that cannot hold FP8 say so (vLLM serves block FP8 through its own fp8 config)
    if fmt == "fp8_block":
        v = emit.vllm_config(plan)
        assert v["quant_method"] == "fp8" and v["weight_block_size"] == [128, 128]
        assert {n for n in mods if not emit.vllm_fp8_is_layer_skipped(n, v["ignored_layers"])} == want
    else:
        with pytest.raises(ConfigError, match=r"vLLM modelopt holds one format \(mxfp8/nvfp4\)"):
            emit.vllm_config(plan)
    with pytest.raises(ConfigError, match=r"ModelOpt NVFP4 holds one format \(nvfp4\)"):
        emit.modelopt_config(plan)
    with pytest.raises(ConfigError, match=f"modelopt_mixed cannot run {fmt}"):
        emit.modelopt_mixed_config(plan)


def test_sglang_config_refuses_mixed_fp8():
    plan = _plan("qwen3", {"default": "fp8_block", "rules": [{"role": "attention", "format": "fp8_tensor"}]})
    with pytest.raises(ConfigError, match=r"SGLang 'mxfp8'/'fp8' holds one format .*'fp8_block', 'fp8_tensor'"):
        emit.sglang_config(plan)
    ct = emit.compressed_tensors_config(plan)  # two float-quantized groups
    assert ct["format"] == "float-quantized" and len(ct["config_groups"]) == 2


# ---- compressed-tensors schemes against the installed package ------------------------------------------------
@pytest.mark.parametrize("fmt, preset", [("mxfp8", "MXFP8"), ("nvfp4", "NVFP4"), ("fp8_block", "FP8_BLOCK"),
                                         ("fp8_tensor", "FP8")])
def test_compressed_tensors_scheme_matches_preset(fmt, preset):
    q = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization import quant_scheme
    scheme = emit._ct_scheme(Format(fmt))
    ref = getattr(quant_scheme, preset)
    assert q.QuantizationArgs.model_validate(scheme["weights"]) == ref["weights"]
    acts = q.QuantizationArgs.model_validate(scheme["input_activations"])
    if fmt == "fp8_tensor":  # dynamic per-tensor (current scaling), not the preset's static activations
        assert (acts.strategy, acts.dynamic) == ("tensor", True)
    else:
        assert acts == ref["input_activations"]


@pytest.mark.parametrize("scope", ["per_token", "per_tensor"])
def test_compressed_tensors_config_validates(scope):
    q = pytest.importorskip("compressed_tensors.quantization")
    plan = _plan("qwen3_moe", {"default": "mxfp8", "rules": [{"layers": "last 1", "format": "bf16"},
                                                             {"role": "routed_experts", "format": "nvfp4",
                                                              "activation_scale": scope}]})
    cfg = emit.compressed_tensors_config(plan)
    parsed = q.QuantizationConfig.model_validate(cfg)
    assert parsed.format == "mixed-precision" and set(parsed.config_groups) == {"group_0", "group_1"}


@pytest.mark.parametrize("default", ["mxfp8", "nvfp4"])
def test_compressed_tensors_config_says_compressed(default):
    """Without ``quantization_status: compressed`` transformers' compressed-tensors integration
    takes the checkpoint as not yet compressed and loads the raw codes as weights (logits off by ~0.85 for MXFP8,
    NaN for NVFP4, exit 0). The package must parse the status as COMPRESSED, the one llm-compressor writes."""
    q = pytest.importorskip("compressed_tensors.quantization")
    cfg = emit.compressed_tensors_config(_plan("qwen3", {"default": default}))
    assert cfg["quantization_status"] == "compressed"
    assert q.QuantizationConfig.model_validate(cfg).quantization_status == q.QuantizationStatus.COMPRESSED


@pytest.mark.parametrize("arch", MOE)
def test_vllm_mixed_plan_emits_modelopt_mixed_precision(arch):
    """`--target vllm` with MXFP8 dense layers and NVFP4 experts used to be refused; vLLM 0.32
    reads it as ModelOpt MIXED_PRECISION. Re-read with vLLM's rules: each engine module gets the plan's algo."""
    plan = _plan(arch, {"default": "mxfp8", "rules": [{"role": "routed_experts", "format": "nvfp4"}]})
    cfg = emit.vllm_config(plan)
    assert cfg["quant_method"] == "modelopt" and cfg["quant_algo"] == "MIXED_PRECISION"
    for m in emit.engine_modules(plan).values():
        want = {Format.MXFP8: "MXFP8", Format.NVFP4: "NVFP4"}.get(m.format)
        assert C.vllm_modelopt_mixed_algo(m.name, cfg["quantized_layers"], cfg["ignore"], m.moe) == want, m.name
    assert {v["quant_algo"] for v in cfg["quantized_layers"].values()} == {"MXFP8", "NVFP4"}


def test_vllm_mixed_ignores_bf16_experts_beside_a_quantized_shared_expert():
    """vLLM resolves a FusedMoE prefix with no entries of its own to the first key under its parent (the shared
    expert's): the emitted ``ignore`` must list the BF16 experts, and without it vLLM would quantize them."""
    plan = _plan("qwen2_moe", {"default": "mxfp8", "rules": [{"layers": "last 1", "role": "routed_experts",
                                                              "format": "bf16"},
                                                             {"role": "routed_experts", "format": "nvfp4"}]})
    cfg = emit.vllm_config(plan)
    experts = "model.layers.3.mlp.experts"
    assert experts in cfg["ignore"]
    assert C.vllm_modelopt_mixed_algo(experts, cfg["quantized_layers"], cfg["ignore"], True) is None
    assert C.vllm_modelopt_mixed_algo(experts, cfg["quantized_layers"], [], True) == "MXFP8"  # the trap


def test_vllm_single_format_plans_keep_their_configs():
    assert emit.vllm_config(_plan("qwen3", {"default": "mxfp8"}))["quant_algo"] == "MXFP8"
    assert emit.vllm_config(_plan("qwen3", {"default": "nvfp4"}))["quant_algo"] == "NVFP4"
