"""Emit every consumer's config from one `PrecisionPlan`, and prove it by re-reading.

Each emitter builds the consumer's config, then re-reads it with the consumer's own matching semantics
(`miles_lp.policy.consumers`) and checks that the consumer would quantize exactly the tensors the plan
quantizes. When the consumer cannot say what the plan says (q_proj quantized but k_proj not while the engine
fuses qkv; a per-layer pattern Megatron's first/last flags cannot express), it raises `ConfigError` naming
the tensors and the reason.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Any

from miles_lp.errors import ConfigError
from miles_lp.formats.schemes import scheme_for
from miles_lp.formats.spec import BackwardMode, Format
from miles_lp.policy import consumers as C
from miles_lp.policy.plan import PlanEntry, PrecisionPlan
from miles_lp.policy.roles import QUANTIZABLE_ROLES


@dataclasses.dataclass
class EngineModule:
    """One module SGLang/vLLM builds: a (fused) linear or a FusedMoE holding many checkpoint tensors."""

    name: str  # e.g. model.layers.3.self_attn.qkv_proj | model.layers.3.mlp.experts
    moe: bool
    layer: int | None
    shards: list[str] = dataclasses.field(default_factory=list)  # HF module names (no .weight)
    entries: list[PlanEntry] = dataclasses.field(default_factory=list)

    @property
    def format(self) -> Format:
        return self.entries[0].format


def engine_modules(plan: PrecisionPlan, engine: str = "SGLang/vLLM") -> dict[str, EngineModule]:
    """Group the plan's linear weights into the engine's modules; refuse a plan that splits a fused module."""
    layout = plan.layout
    if layout is None:
        raise ConfigError("emitters need the plan's layout (compile_plan attaches it; pass layout= to from_json)")
    mods: dict[str, EngineModule] = {}
    for name, e in plan.entries.items():
        info = layout.describe(name)
        if info.engine_module is None:
            if e.format.quantized:
                raise ConfigError(f"{engine} cannot serve '{name}' ({e.role.value}) quantized: it builds it as an "
                                  f"unquantized module (plan rule {e.rule})")
            continue
        m = mods.get(info.engine_module)
        if m is None:
            m = mods[info.engine_module] = EngineModule(info.engine_module, info.role.value == "routed_experts",
                                                        info.layer)
        m.shards.append(name.rsplit(".", 1)[0])
        m.entries.append(e)
    for m in mods.values():
        fmts = {(e.format, e.activation_scale) for e in m.entries}
        if len(fmts) > 1:
            by = {}
            for e in m.entries:
                by.setdefault((e.format.value, e.activation_scale), e)
            detail = "; ".join(f"'{e.name}' is {f}{'/' + a if a else ''} ({e.rule})" for (f, a), e in by.items())
            raise ConfigError(f"{engine} runs '{m.name}' as one {'FusedMoE' if m.moe else 'fused GEMM'} but the "
                              f"plan splits it: {detail}. Give all of its tensors one format.")
    return mods


def _single_format(plan: PrecisionPlan, allowed: tuple[Format, ...], who: str) -> Format:
    fmts = {e.format for e in plan.entries.values() if e.format.quantized}
    bad = fmts - set(allowed)
    if bad or len(fmts) != 1:
        raise ConfigError(f"{who} holds one format ({'/'.join(f.value for f in allowed)}); the plan has "
                          f"{sorted(f.value for f in fmts) or 'none'}: use modelopt_mixed_config or "
                          "compressed_tensors_config for mixed plans")
    return fmts.pop()


def _check(expected: dict[str, bool], got: dict[str, bool], who: str) -> None:
    wrong = [n for n in expected if expected[n] != got[n]]
    if wrong:
        raise ConfigError(f"{who} would read the emitted config differently from the plan for {len(wrong)} "
                          f"module(s), e.g. " + ", ".join(f"{n} (plan: {'quantized' if expected[n] else 'bf16'})"
                                                          for n in wrong[:5]))


def _not_converted(plan: PrecisionPlan, mods: dict[str, EngineModule], whole_layers: bool) -> list[str]:
    """BF16 engine modules as checkpoint-shard paths (plus lm_head, embeddings, routers)."""
    out = ["lm_head", "model.embed_tokens"]
    by_layer: dict[int | None, list[EngineModule]] = {}
    for m in mods.values():
        by_layer.setdefault(m.layer, []).append(m)
    for layer in sorted(by_layer, key=lambda x: -1 if x is None else x):
        ms = by_layer[layer]
        if whole_layers and layer is not None and all(not m.format.quantized for m in ms):
            out.append(f"model.layers.{layer}.")
            continue
        for m in sorted(ms, key=lambda m: m.name):
            if not m.format.quantized:
                out += [m.name] if m.moe else sorted(set(m.shards))
    layout = plan.layout
    for name, e in plan.entries.items():  # routers/gates: engines never quantize them; list them as exports do
        if e.role.value in ("router", "shared_expert_gate") and not (
                whole_layers and e.layer is not None and f"model.layers.{e.layer}." in out):
            out.append(layout.describe(name).canonical.rsplit(".", 1)[0])
    return list(dict.fromkeys(out))


# ---- SGLang mxfp8 / fp8 ---------------------------------------------------------------------------------------
def sglang_config(plan: PrecisionPlan) -> dict[str, Any]:
    """SGLang native ``quantization_config`` for a one-format plan, re-read with SGLang ``is_layer_skipped``.

    - MXFP8 (CONTRACT 4): ``quant_method: mxfp8``, ``weight_block_size: [1, 32]``, ``modules_to_not_convert``;
    - FP8_BLOCK (DeepSeek-V3 style): ``quant_method: fp8``, ``weight_block_size: [128, 128]``, ``ignored_layers``;
    - FP8_TENSOR: ``quant_method: fp8`` without ``weight_block_size`` (per-tensor weight scale), ``ignored_layers``.
    All use ``activation_scheme: dynamic``. SGLang ``Fp8Config.from_config`` (layers/quantization/fp8.py) reads
    ``ignored_layers`` or ``modules_to_not_convert`` and strips ``"model."`` from each entry; the skip list is
    checked to mean the same with and without that rewrite.
    """
    fmt = _single_format(plan, (Format.MXFP8, Format.FP8_BLOCK, Format.FP8_TENSOR), "SGLang 'mxfp8'/'fp8'")
    mods = engine_modules(plan, "SGLang")
    skip = _not_converted(plan, mods, whole_layers=True)
    if fmt is Format.MXFP8:
        cfg = {"quant_method": "mxfp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [1, 32],
               "scale_fmt": "ue8m0", "modules_to_not_convert": skip}
    else:
        cfg = {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": skip}
        if fmt is Format.FP8_BLOCK:
            cfg["weight_block_size"] = [128, 128]
    expected = {m.name: m.format.quantized for m in mods.values()}
    for who, lst in (("SGLang " + cfg["quant_method"], skip),
                     ("SGLang Fp8Config (after its 'model.' strip)", C.sglang_fp8_ignored_layers(skip))):
        try:
            got = {m.name: not C.sglang_is_layer_skipped(m.name, lst) for m in mods.values()}
        except C.FusedShardMismatch as exc:
            raise ConfigError(f"{who}: {exc}") from None
        _check(expected, got, who)
    return cfg


# ---- ModelOpt NVFP4 (and vLLM modelopt MXFP8) ------------------------------------------------------------------
def _modelopt_exclude(plan: PrecisionPlan, mods: dict[str, EngineModule], algo: str) -> list[str]:
    exclude = _not_converted(plan, mods, whole_layers=False)
    expected = {m.name: m.format.quantized for m in mods.values()}
    for who, fn in (("vLLM modelopt", C.vllm_modelopt_is_layer_excluded),
                    ("SGLang modelopt", C.sglang_modelopt_is_layer_excluded)):
        try:
            got = {m.name: not fn(m.name, exclude) for m in mods.values()}
        except C.FusedShardMismatch as exc:
            raise ConfigError(f"{who} ({algo}): {exc}") from None
        _check(expected, got, f"{who} ({algo})")
    return exclude


def modelopt_config(plan: PrecisionPlan) -> dict[str, Any]:
    """ModelOpt NVFP4 ``quantization_config`` (``quant_method: modelopt``, ``ignore``)."""
    _single_format(plan, (Format.NVFP4,), "ModelOpt NVFP4")
    mods = engine_modules(plan, "ModelOpt consumers")
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
            "ignore": _modelopt_exclude(plan, mods, "NVFP4"), "kv_cache_scheme": None}


def hf_quant_config(plan: PrecisionPlan) -> dict[str, Any]:
    """The older ModelOpt ``hf_quant_config.json`` form (``quantization.exclude_modules``)."""
    cfg = modelopt_config(plan)
    return {"producer": {"name": "miles-lp"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                             "exclude_modules": cfg["ignore"]}}


def vllm_config(plan: PrecisionPlan) -> dict[str, Any]:
    """vLLM ModelOpt config: ``modelopt_mxfp8`` for MXFP8 plans, ``modelopt_fp4`` for NVFP4 plans, and
    ``quant_algo: MIXED_PRECISION`` (`vllm_mixed_config`) for plans holding both; vLLM ``fp8``
    with 128x128 blocks for FP8 blockwise plans (`vllm_fp8_block_config`)."""
    fmts = {e.format for e in plan.entries.values() if e.format.quantized}
    if fmts == {Format.MXFP8, Format.NVFP4}:
        return vllm_mixed_config(plan)
    if fmts == {Format.FP8_BLOCK}:
        return vllm_fp8_block_config(plan)
    fmt = _single_format(plan, tuple(_MIXED_ALGO), "vLLM modelopt")
    algo, group_size = _MIXED_ALGO[fmt]
    mods = engine_modules(plan, "vLLM")
    return {"quant_method": "modelopt", "quant_algo": algo, "group_size": group_size,
            "ignore": _modelopt_exclude(plan, mods, algo)}


def vllm_fp8_is_layer_skipped(prefix: str, ignored: list[str]) -> bool:
    """vLLM 0.32 ``Fp8Config`` skip rule (``is_layer_skipped``, match mode ``exact``; quant_utils.py): a fused module
    by its shards (which must agree), an experts module when an ignored name holding ``experts`` contains its
    prefix, anything else by its exact name."""
    if prefix.rsplit(".", 1)[-1] not in C.PACKED_MODULES and "experts" in prefix:
        return any(prefix in name for name in ignored if "experts" in name)
    return C.vllm_exact_is_layer_skipped(prefix, ignored, C.PACKED_MODULES)


def vllm_fp8_block_config(plan: PrecisionPlan) -> dict[str, Any]:
    """vLLM ``fp8`` for an FP8 blockwise plan: ``quant_method: fp8``, ``activation_scheme: dynamic``,
    ``weight_block_size: [128, 128]`` and ``ignored_layers`` (vLLM 0.32 ``Fp8Config.from_config``,
    layers/quantization/fp8.py), the BF16 modules by their exact checkpoint paths, re-read with vLLM's skip rule
    (`vllm_fp8_is_layer_skipped`). Tensors: ``weight`` E4M3 and ``weight_scale_inv`` fp32 per 128x128 block (the
    names vLLM's block-FP8 linear creates)."""
    _single_format(plan, (Format.FP8_BLOCK,), "vLLM fp8")
    mods = engine_modules(plan, "vLLM fp8")
    ignored = _not_converted(plan, mods, whole_layers=False)
    expected = {m.name: m.format.quantized for m in mods.values()}
    try:
        got = {m.name: not vllm_fp8_is_layer_skipped(m.name, ignored) for m in mods.values()}
    except C.FusedShardMismatch as exc:
        raise ConfigError(f"vLLM fp8: {exc}") from None
    _check(expected, got, "vLLM fp8")
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "ignored_layers": ignored}


def vllm_mixed_config(plan: PrecisionPlan) -> dict[str, Any]:
    """vLLM ``modelopt_mixed``: ``quant_algo: MIXED_PRECISION``, per-shard ``quantized_layers`` (MXFP8 / NVFP4)
    and ``ignore`` (the BF16 engine modules), read by vLLM 0.32 ``ModelOptMixedPrecisionConfig``
    (layers/quantization/modelopt.py): ``from_config`` takes ``quantized_layers`` and ``ignore`` from this flat
    ``quantization_config``; ``get_quant_method`` checks ``ignore`` first, then resolves the algo
    (`consumers.vllm_modelopt_mixed_resolve`) and builds its ModelOpt MXFP8 / NVFP4 linear or FusedMoE method.
    Tensors are the ``vllm`` target's (ModelOpt names; MXFP8 scale ``weight_scale``). Re-read with
    `consumers.vllm_modelopt_mixed_algo`; the tests also re-read it with vLLM's own class where vLLM is
    installed (tests/readers)."""
    mods = engine_modules(plan, "vLLM modelopt_mixed")
    for m in mods.values():
        if m.format.quantized and m.format not in _MIXED_ALGO:
            raise ConfigError(f"vLLM modelopt_mixed: '{m.name}' is {m.format.value}; checkpoints hold MXFP8 and "
                              "NVFP4 only")
    layers: dict[str, dict[str, Any]] = {}
    for m in mods.values():
        if m.format.quantized:
            algo, gs = _MIXED_ALGO[m.format]
            for shard in m.shards:
                layers[shard] = {"quant_algo": algo, "group_size": gs}
    ignore = _not_converted(plan, mods, whole_layers=False)
    wrong = []
    for m in mods.values():
        want = _MIXED_ALGO[m.format][0] if m.format.quantized else None
        try:
            C.modelopt_mixed_layer_algo(m.shards, layers)  # shards / experts agree (stricter than vLLM)
            got = C.vllm_modelopt_mixed_algo(m.name, layers, ignore, m.moe)
        except C.FusedShardMismatch as exc:
            raise ConfigError(f"vLLM modelopt_mixed: {m.name}: {exc}") from None
        if got != want:
            wrong.append(f"{m.name} (plan: {want or 'bf16'}, vLLM: {got or 'bf16'})")
    if wrong:
        raise ConfigError("vLLM modelopt_mixed would read the emitted config differently from the plan for "
                          + ", ".join(wrong[:5]))
    return {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "kv_cache_scheme": None,
            "ignore": ignore, "quantized_layers": dict(sorted(layers.items()))}


# ---- SGLang modelopt_mixed -----------------------------------------------------------------------------------
#: plan format -> ModelOpt per-module ``quant_algo`` that SGLang's modelopt_mixed can run it as (see
#: `consumers.SGLANG_MIXED_DISPATCH`). ModelOpt ``FP8`` is static per-tensor FP8 (a calibrated ``input_scale``),
#: not our fp8_tensor (dynamic activation scale); block FP8 is not dispatched at all. MXFP8 is (CONTRACT 4); an
#: SGLang older than its MXFP8 support loads those modules BF16 (`consumers.SGLANG_MIXED_DISPATCH_WITHOUT_MXFP8`).
_MIXED_ALGO = {f: (scheme_for(f).modelopt_algo, scheme_for(f).scale_block) for f in Format
               if scheme_for(f).modelopt_algo}  # (quant_algo, group_size): the formats' schemes
_MIXED_REFUSED = {
    Format.FP8_BLOCK: "SGLang ModelOptMixedPrecisionConfig.get_quant_method dispatches FP8, NVFP4 and MXFP8; "
                      "'FP8_BLOCK_SCALES' falls through to UnquantizedLinearMethod",
    Format.FP8_TENSOR: "ModelOpt 'FP8' is static per-tensor FP8 with a calibrated input_scale, which the plan's "
                       "fp8_tensor (dynamic activation scale) does not carry",
}


def modelopt_mixed_config(plan: PrecisionPlan) -> dict[str, Any]:
    """SGLang ``modelopt_mixed``: ``quant_algo: MIXED_PRECISION`` + per-module ``quantized_layers``.

    Read by SGLang ``ModelOptMixedPrecisionConfig`` (python/sglang/srt/layers/quantization/modelopt_quant.py):
    ``from_config`` takes ``quantized_layers`` (non-empty) and ``packed_modules_mapping`` from this flat
    ``quantization_config``; ``_resolve_quant_algo`` looks up the engine prefix (exact key, then the shards of
    a packed module, then the first key under ``prefix.`` for a FusedMoE); ``get_quant_method`` runs only
    ``FP8``, ``NVFP4`` and ``MXFP8`` (CONTRACT 4) and loads anything else unquantized. So keys are checkpoint module names (one per
    shard / expert projection), ``packed_modules_mapping`` is emitted (without it SGLang resolves a fused
    ``qkv_proj`` / ``gate_up_proj`` to BF16 unless the model class sets one), and plans with FP8 block or
    tensor-wise modules are refused: use ``compressed_tensors_config`` for those.
    """
    mods = engine_modules(plan, "SGLang modelopt_mixed")
    for m in mods.values():
        if m.format.quantized and m.format not in _MIXED_ALGO:
            n = sum(1 for x in mods.values() if x.format is m.format)
            raise ConfigError(f"SGLang modelopt_mixed cannot run {m.format.value} modules ({n}, e.g. '{m.name}', "
                              f"{m.entries[0].rule}): {_MIXED_REFUSED[m.format]}. Use compressed_tensors_config, "
                              "or sglang_config / modelopt_config for a one-format plan.")
    layers: dict[str, dict[str, Any]] = {}
    for m in mods.values():
        if m.format.quantized:
            algo, gs = _MIXED_ALGO[m.format]
            for shard in m.shards:
                layers[shard] = {"quant_algo": algo} | ({"group_size": gs} if gs else {})
    if not layers:
        raise ConfigError("SGLang modelopt_mixed needs a non-empty quantized_layers map (from_config raises); "
                          "the plan quantizes no engine module")
    proj_used = {m.name.rsplit(".", 1)[-1] for m in mods.values()}
    packed = {k: list(v) for k, v in C.PACKED_MODULES.items() if k in proj_used}
    expected, got = {}, {}
    for m in mods.values():
        expected[m.name] = _MIXED_ALGO[m.format][0] if m.format.quantized else None
        try:
            C.modelopt_mixed_layer_algo(m.shards, layers)  # shards / experts agree (stricter than SGLang)
            got[m.name] = C.sglang_modelopt_mixed_algo(m.name, layers, packed)
        except C.FusedShardMismatch as exc:
            raise ConfigError(f"SGLang modelopt_mixed: {m.name}: {exc}") from None
    wrong = [n for n in expected if expected[n] != got[n]]
    if wrong:
        raise ConfigError("SGLang modelopt_mixed would read the emitted config differently from the plan for "
                          + ", ".join(f"{n} (plan: {expected[n] or 'bf16'}, SGLang: {got[n] or 'bf16'})"
                                      for n in wrong[:5]))
    return {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
            "packed_modules_mapping": packed, "quantized_layers": dict(sorted(layers.items()))}


# ---- compressed-tensors ----------------------------------------------------------------------------------------
def _ct_scheme(fmt: Format) -> dict[str, Any]:
    """One config group's scheme, equal (as ``QuantizationArgs``) to compressed-tensors' own preset
    (compressed_tensors/quantization/quant_scheme.py, v0.20: ``MXFP8``, ``NVFP4``, ``FP8_BLOCK``; the weights of
    ``FP8``) and valid under ``QuantizationArgs.validate_model_after``; dtypes written as the package dumps them.

    NVFP4 activations are the preset's (``tensor_group``, ``dynamic: "local"``: a static per-tensor global input
    scale, dynamic block scales): compressed-tensors has no per-token NVFP4 activation strategy (``strategy:
    token`` with a ``group_size`` is rejected) and vLLM's ``CompressedTensorsW4A4Fp4`` has no dynamic global input
    scale, so the scheme declares the static one and the checkpoint carries it as ``input_global_scale`` (the
    recipe's constant, ``miles_lp.export.naming.INPUT_SCALE_VALUE``, stored as its reciprocal).
    Like ModelOpt's ``input_scale``, the serving config does not carry the plan's ``activation_scale``, which is a
    learner (Transformer Engine) option. FP8 tensor-wise activations are
    dynamic per-tensor (the plan's current scaling), not the ``FP8`` preset's static ones.
    """
    return scheme_for(fmt).ct_scheme()


def compressed_tensors_config(plan: PrecisionPlan) -> dict[str, Any]:
    """compressed-tensors ``quantization_config``: one config group per format (schemes: `_ct_scheme`); targets
    are exact module names, one ``re:`` pattern per FusedMoE layer; ``ignore`` lists the BF16 modules."""
    mods = engine_modules(plan, "compressed-tensors consumers (vLLM/SGLang)")
    keys = sorted({m.format.value for m in mods.values() if m.format.quantized})
    groups: dict[str, dict[str, Any]] = {}
    key_of: dict[str, str] = {}
    for i, key in enumerate(keys):
        key_of[key] = f"group_{i}"
        groups[f"group_{i}"] = {"targets": [], **_ct_scheme(Format(key))}
    for m in sorted(mods.values(), key=lambda m: m.name):
        if not m.format.quantized:
            continue
        g = groups[key_of[m.format.value]]
        if m.moe:
            projs = sorted({s.rsplit(".", 1)[1] for s in m.shards})
            g["targets"].append(f"re:{re.escape(m.name)}\\.\\d+\\.({'|'.join(projs)})$")
        else:
            g["targets"] += sorted(set(m.shards))
    ignore = _not_converted(plan, mods, whole_layers=False)
    fmt_names = {g["format"] for g in groups.values()}
    # quantization_status "compressed": the weights on disk are already quantized (what llm-compressor writes).
    # Without it transformers' compressed-tensors integration takes the model as not yet compressed and loads the
    # raw E4M3 / packed codes as weights, silently.
    cfg = {"quant_method": "compressed-tensors", "format": fmt_names.pop() if len(fmt_names) == 1 else
           "mixed-precision", "quantization_status": "compressed", "config_groups": groups, "ignore": ignore,
           "kv_cache_scheme": None}
    # re-read: the group whose targets match every shard (vLLM checks shards of fused modules agree)
    for m in mods.values():
        found = set()
        for shard in m.shards:
            hits = [gname for gname, g in groups.items() if C.ct_is_match(shard, False, g["targets"], ignore)]
            if len(hits) > 1:
                raise ConfigError(f"compressed-tensors: {shard} matches several config groups {hits}")
            found.add(hits[0] if hits else None)
        if len(found) > 1:
            raise ConfigError(f"compressed-tensors: shards of {m.name} resolve to different groups {found}")
        want = key_of.get(m.format.value) if m.format.quantized else None
        if found.pop() != want:
            raise ConfigError(f"compressed-tensors re-read differs from the plan for {m.name}")
    return cfg


# ---- Megatron-Core / TE ---------------------------------------------------------------------------------------


def megatron_overrides(plan: PrecisionPlan) -> dict[str, Format]:
    """Tensors whose format differs from what stock Megatron-Core would run given `megatron_kwargs`:
    the per-module overrides miles-lp's Megatron backend applies (canonical name -> format)."""
    return _megatron(plan)[1]


def megatron_kwargs(plan: PrecisionPlan, *, strict: bool = True) -> dict[str, Any]:
    """``TransformerConfig`` keyword arguments. ``strict``: stock Megatron semantics must reproduce the plan
    exactly (else `ConfigError` naming the tensors); ``strict=False`` allows per-module overrides
    (`megatron_overrides`) for miles-lp's backend to apply."""
    kwargs, overrides = _megatron(plan)
    if strict and overrides:
        sample = list(overrides.items())[:8]
        raise ConfigError(
            f"Megatron-Core's TransformerConfig cannot express {len(overrides)} tensor(s) of this plan: inside a "
            f"low-precision layer it runs every TE linear in {kwargs.get('fp8_recipe') or kwargs.get('fp4_recipe')}"
            ", e.g. " + ", ".join(f"{n} -> {f.value}" for n, f in sample) +
            ". Use megatron_kwargs(plan, strict=False) with megatron_overrides(plan) (miles-lp backend).")
    return kwargs


def _megatron(plan: PrecisionPlan) -> tuple[dict[str, Any], dict[str, Format]]:
    L = plan.num_layers
    linear = [e for e in plan.entries.values() if e.role in QUANTIZABLE_ROLES and e.layer is not None
              and e.layer < L]
    weight = Counter()
    for e in linear:
        if e.format.quantized:
            n = 1
            for d in e.shape:
                n *= d
            weight[e.format] += n
    if not weight:
        raise ConfigError("the plan quantizes no decoder-layer linear: nothing for Megatron to run in low precision")
    base = weight.most_common(1)[0][0]
    low = sorted({e.layer for e in linear if e.format.quantized})
    bf16_layers = [i for i in range(L) if i not in set(low)]
    start = 0
    while start < L and start in bf16_layers:
        start += 1
    end = 0
    while end < L - start and (L - 1 - end) in bf16_layers:
        end += 1
    middle = [i for i in bf16_layers if start <= i < L - end]
    if middle:
        raise ConfigError(f"Megatron's first/last flags cannot say this plan: decoder layers {middle} are all bf16 "
                          f"but lie between low-precision layers (num_layers_at_start_in_bf16={start}, "
                          f"num_layers_at_end_in_bf16={end} cover only the ends)")
    kwargs: dict[str, Any] = dict(scheme_for(base).megatron_recipe)
    kwargs.update(first_last_layers_bf16=bool(start or end), num_layers_at_start_in_bf16=start,
                  num_layers_at_end_in_bf16=end)
    overrides: dict[str, Format] = {}
    for e in linear:
        in_bf16 = C.megatron_is_first_last_bf16_layer(e.layer, L, kwargs["first_last_layers_bf16"], start, end)
        stock = Format.BF16 if in_bf16 else base
        if stock is not e.format:
            overrides[e.name] = e.format
    return kwargs, overrides


def te_env(plan: PrecisionPlan) -> dict[str, str]:
    """Transformer Engine environment for the learner (CONTRACT 7): ``NVTE_BACKWARD_OVERRIDE`` and row-scaled
    (per-token) NVFP4 activations. Both are process-global, so the plan must use one value for each."""
    q = [e for e in plan.entries.values() if e.format.quantized]
    modes = {e.backward for e in q}
    if len(modes) > 1:
        raise ConfigError(f"TE's NVTE_BACKWARD_OVERRIDE is global; the plan mixes backward modes "
                          f"{sorted(m.value for m in modes)}")
    env: dict[str, str] = {}
    mode = modes.pop() if modes else None
    if mode in (BackwardMode.HIGH_PRECISION, BackwardMode.DEQUANTIZED):
        env["NVTE_BACKWARD_OVERRIDE"] = mode.value
    scopes = {e.activation_scale for e in q if scheme_for(e.format).activation_scopes}  # NVFP4's
    if len(scopes) > 1:
        raise ConfigError("TE's NVTE_NVFP4_ROW_SCALED_ACTIVATION is global; the plan mixes per-token and "
                          "per-tensor NVFP4 activation scales")
    if scopes:
        env["NVTE_NVFP4_ROW_SCALED_ACTIVATION"] = "1" if scopes.pop() == "token" else "0"
    return env
