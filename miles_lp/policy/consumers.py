"""How each consumer reads a precision config: its own matching semantics, re-implemented (not copied).

Every emitter in `miles_lp.policy.emit` is checked by re-reading its output with these functions and
comparing the resulting set of quantized tensors with the plan. Sources read for each rule are cited.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence

#: SGLang / vLLM fused linear modules and their checkpoint shards (``packed_modules_mapping`` of the model
#: classes; SGLang's ``_FALLBACK_FUSED_SHARDS`` in layers/quantization/utils.py for qkv/gate_up; DeepSeek's
#: ``fused_qkv_a_proj_with_mqa`` in SGLang models/deepseek_v2.py).
PACKED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj_with_mqa": ("q_a_proj", "kv_a_proj_with_mqa"),
}


class FusedShardMismatch(ValueError):
    """A consumer found some but not all shards of a fused module skipped (it raises too)."""


# ---- SGLang: modules_to_not_convert (mxfp8 / fp8 configs) ---------------------------------------------
def sglang_module_path_match(ignored: str, prefix: str) -> bool:
    """SGLang ``_module_path_match`` (python/sglang/srt/layers/quantization/utils.py, PR #23467).

    Matches on dotted-path boundaries: equal, a parent path (``model.layers.3.`` skips everything below), or
    a run of whole components inside the path. ``mlp.gate`` never matches ``mlp.gate_up_proj``.
    """
    ignored, prefix = ignored.rstrip("."), prefix.rstrip(".")
    if ignored == prefix or prefix.startswith(ignored + "."):
        return True
    return f".{ignored}." in f".{prefix}."


def sglang_is_layer_skipped(prefix: str, ignored: Sequence[str],
                            fused_mapping: Mapping[str, Sequence[str]] = PACKED_MODULES) -> bool:
    """SGLang ``is_layer_skipped`` (layers/quantization/utils.py): a fused module is skipped iff its shards
    are; shards that disagree raise (``FusedShardMismatch`` here). A FusedMoE prefix (``...mlp.experts``) is
    also skipped when an ignored entry containing ``experts`` contains the prefix as a substring.
    """
    proj = prefix.split(".")[-1]
    if proj in fused_mapping:
        verdicts = {any(sglang_module_path_match(i, prefix[: -len(proj)] + shard) for i in ignored)
                    for shard in fused_mapping[proj]}
        if len(verdicts) > 1:
            raise FusedShardMismatch(f"Detected some but not all shards of {prefix} are quantized")
        return verdicts.pop()
    skipped = any(sglang_module_path_match(i, prefix) for i in ignored)
    if "gate_up_proj" in prefix:
        g, u = prefix.replace("gate_up_proj", "gate_proj"), prefix.replace("gate_up_proj", "up_proj")
        skipped = skipped or (g in ignored and u in ignored)
    elif "experts" in prefix:
        skipped = skipped or any(prefix in i for i in ignored if "experts" in i)
    return skipped


# ---- ModelOpt exclude lists ---------------------------------------------------------------------------
def vllm_exact_is_layer_skipped(prefix: str, ignored: Sequence[str],
                                 fused_mapping: Mapping[str, Sequence[str]]) -> bool:
    """vLLM ``is_layer_skipped`` (model_executor/layers/quantization/utils/quant_utils.py): exact names,
    fused modules expanded to shards, shards must agree."""
    proj = prefix.split(".")[-1]
    if proj in fused_mapping:
        verdicts = {(prefix[: -len(proj)] + shard) in ignored for shard in fused_mapping[proj]}
        if len(verdicts) > 1:
            raise FusedShardMismatch(f"Detected some but not all shards of {prefix} are quantized")
        return verdicts.pop()
    return prefix in ignored


def vllm_modelopt_is_layer_excluded(prefix: str, exclude: Sequence[str],
                                    fused_mapping: Mapping[str, Sequence[str]] = PACKED_MODULES) -> bool:
    """vLLM ``ModelOptQuantConfigBase.is_layer_excluded`` (model_executor/layers/quantization/modelopt.py):
    exact match with fused shards, then SUBSTRING match (legacy ModelOpt < 0.39 exports), then ``fnmatch``
    wildcards. The substring step is why exclude entries must be full module paths that are not a prefix of
    another module's name (``mlp.gate`` would exclude ``mlp.gate_up_proj``).
    """
    if not exclude:
        return False
    if vllm_exact_is_layer_skipped(prefix, exclude, fused_mapping):
        return True
    if any(e != prefix and e in prefix for e in exclude):
        return True
    return any(fnmatch.fnmatch(prefix, e) for e in exclude)


def sglang_modelopt_is_layer_excluded(prefix: str, exclude: Sequence[str],
                                      fused_mapping: Mapping[str, Sequence[str]] = PACKED_MODULES) -> bool:
    """SGLang ModelOpt FP4 ``get_quant_method``: ``is_layer_skipped(prefix, exclude)`` or ``is_layer_excluded``,
    whose patterns are regexes built as ``.`` -> ``\\.`` and ``*`` -> ``.*`` with ``re.fullmatch``."""
    if sglang_is_layer_skipped(prefix, exclude, fused_mapping):
        return True
    for pattern in exclude:
        if re.fullmatch(pattern.replace(".", r"\.").replace("*", ".*"), prefix):
            return True
    return False


def sglang_fp8_ignored_layers(ignored: Sequence[str]) -> list[str]:
    """SGLang ``Fp8Config.from_config`` (layers/quantization/fp8.py) rewrites the skip list it reads from
    ``ignored_layers`` / ``modules_to_not_convert`` with ``layer.replace("model.", "")`` ("hacking ministral")
    before `sglang_is_layer_skipped` sees it; an emitted list must mean the same before and after."""
    return [i.replace("model.", "") for i in ignored]


# ---- SGLang modelopt_mixed: quantized_layers ------------------------------------------------------------
#: Per-module algos that SGLang ``ModelOptMixedPrecisionConfig.get_quant_method``
#: (python/sglang/srt/layers/quantization/modelopt_quant.py) dispatches. CONTRACT 4 lists ``FP8``, ``NVFP4`` and
#: ``MXFP8`` for the mixed-precision checkpoints of the Miles pipeline (SGLang support added with the Miles
#: MXFP8/NVFP4 work, sglang#18742 / #20214), and that is the SGLang this project targets.
SGLANG_MIXED_DISPATCH = frozenset({"FP8", "NVFP4", "MXFP8"})
#: What an older ``ModelOptMixedPrecisionConfig`` dispatches (read from an indexed copy of modelopt_quant.py of
#: unknown commit): ``FP8`` -> ``ModelOptFp8LinearMethod`` (static per-tensor FP8, needs ``input_scale``),
#: ``NVFP4`` -> ``ModelOptFp4LinearMethod`` / ``ModelOptNvFp4FusedMoEMethod``; anything else (``MXFP8`` included)
#: falls through to ``UnquantizedLinearMethod``, so such an engine would load MXFP8 modules' fp8 bytes as BF16,
#: silently. Configs cannot tell the two apart: the live layer audit (C1 against the engine's parameters) must.
SGLANG_MIXED_DISPATCH_WITHOUT_MXFP8 = frozenset({"FP8", "NVFP4"})


def sglang_modelopt_mixed_resolve(prefix: str, quantized_layers: Mapping[str, Mapping],
                                  packed_modules_mapping: Mapping[str, Sequence[str]] | None = None) -> str | None:
    """SGLang ``ModelOptMixedPrecisionConfig._resolve_quant_algo`` (layers/quantization/modelopt_quant.py):

    1. the exact engine prefix is a key -> its ``quant_algo`` (upper-cased);
    2. the prefix's last component is in ``packed_modules_mapping`` (read from the quantization config's
       ``packed_modules_mapping`` key, or set by the model class) -> the algos of the LISTED shards: one
       distinct algo wins (unlisted shards are ignored), several raise ``ValueError`` ("Mixed quant_algo within
       fused layer") -- `FusedShardMismatch` here;
    3. else the FIRST key starting with ``prefix + "."`` (dict order, no agreement check): how a FusedMoE prefix
       (``...mlp.experts``) finds its per-expert entries;
    4. else None (BF16).
    Without a packed mapping, a fused ``qkv_proj`` / ``gate_up_proj`` whose shards are listed resolves to None.
    """
    cfg = quantized_layers.get(prefix)
    if cfg is not None:
        return str(cfg["quant_algo"]).upper()
    proj = prefix.rsplit(".", 1)[-1]
    if packed_modules_mapping and proj in packed_modules_mapping:
        base = prefix.rsplit(".", 1)[0]
        algos = {str(quantized_layers[f"{base}.{s}"]["quant_algo"]).upper()
                 for s in packed_modules_mapping[proj] if f"{base}.{s}" in quantized_layers}
        if len(algos) > 1:
            raise FusedShardMismatch(f"Mixed quant_algo within fused layer {prefix}: {sorted(algos)}")
        if algos:
            return algos.pop()
    prefix_dot = prefix + "."
    for key, info in quantized_layers.items():
        if key.startswith(prefix_dot):
            return str(info["quant_algo"]).upper()
    return None


def sglang_modelopt_mixed_algo(prefix: str, quantized_layers: Mapping[str, Mapping],
                               packed_modules_mapping: Mapping[str, Sequence[str]] | None = None) -> str | None:
    """The algo SGLang ``ModelOptMixedPrecisionConfig.get_quant_method`` actually runs ``prefix`` in: the resolved
    algo if it is dispatched (`SGLANG_MIXED_DISPATCH`), else None (loaded BF16)."""
    algo = sglang_modelopt_mixed_resolve(prefix, quantized_layers, packed_modules_mapping)
    return algo if algo in SGLANG_MIXED_DISPATCH else None


def modelopt_mixed_layer_algo(shard_modules: Iterable[str], quantized_layers: Mapping[str, Mapping]) -> str | None:
    """Strict shard-level reading of ``quantized_layers``: every shard of an engine module (each projection of
    a fused linear, each expert projection of a FusedMoE) must carry the same algo, unlisted = BF16. Stricter
    than SGLang (`sglang_modelopt_mixed_resolve` ignores unlisted shards and takes the first expert's entry),
    so a config that passes it reads the same in SGLang. Returns the listed algo or None; it does not say
    whether SGLang dispatches that algo (`sglang_modelopt_mixed_algo` does)."""
    algos = set()
    for shard in shard_modules:
        cfg = quantized_layers.get(shard)
        algos.add(None if cfg is None else str(cfg.get("quant_algo")).upper())
    if len(algos) > 1:
        raise FusedShardMismatch(f"shards disagree: {sorted(map(str, algos))}")
    return algos.pop() if algos else None


# ---- vLLM modelopt MIXED_PRECISION ---------------------------------------------------------------------------
#: ``LINEAR_ALGOS`` of vLLM 0.32 (model_executor/layers/quantization/modelopt.py): the per-layer algos its
#: ``ModelOptMixedPrecisionConfig.get_quant_method`` builds a linear method for; others load unquantized.
VLLM_MIXED_LINEAR_ALGOS = frozenset({"FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4",
                                     "MXFP8"})
#: what it builds a FusedMoE method for (block FP8 aside)
VLLM_MIXED_MOE_ALGOS = frozenset({"FP8", "NVFP4", "W4A16_NVFP4", "MXFP8"})


def vllm_modelopt_mixed_resolve(prefix: str, quantized_layers: Mapping[str, Mapping],
                                packed_modules_mapping: Mapping[str, Sequence[str]] = PACKED_MODULES) -> str | None:
    """vLLM 0.32 ``ModelOptMixedPrecisionConfig._resolve_quant_algo`` (layers/quantization/modelopt.py):

    1. the exact prefix is a key;
    2. a packed module (``packed_modules_mapping`` of the model class): the algos of its listed shards, one
       distinct algo wins, several raise (`FusedShardMismatch`);
    3. the FIRST key starting with ``prefix + "."`` (a FusedMoE ``...experts`` finds its experts' entries);
    4. a FusedMoE prefix ``....experts``: the first key under its PARENT (``....mlp.``), whatever it is;
    5. ``qkv_proj`` / ``gate_up_proj``: the listed shards under the parent, as in 2.
    Step 4 is why the emitter lists BF16 experts in ``ignore`` (checked first): otherwise a BF16-expert layer
    would take the algo of a quantized shared expert beside it.
    """
    cfg = quantized_layers.get(prefix)
    if cfg is not None:
        return str(cfg["quant_algo"]).upper()
    proj = prefix.rsplit(".", 1)[-1]
    base = prefix.rsplit(".", 1)[0]

    def shard_algos(shards) -> str | None:
        algos = {str(quantized_layers[f"{base}.{s}"]["quant_algo"]).upper() for s in shards
                 if f"{base}.{s}" in quantized_layers}
        if len(algos) > 1:
            raise FusedShardMismatch(f"Mixed quant_algo within fused layer {prefix}: {sorted(algos)}")
        return algos.pop() if algos else None

    if proj in packed_modules_mapping:
        hit = shard_algos(packed_modules_mapping[proj])
        if hit:
            return hit
    for key, info in quantized_layers.items():
        if key.startswith(prefix + "."):
            return str(info["quant_algo"]).upper()
    if prefix.endswith(".experts"):
        parent_dot = prefix.rsplit(".experts", 1)[0] + "."
        for key, info in quantized_layers.items():
            if key.startswith(parent_dot):
                return str(info["quant_algo"]).upper()
    fallback = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    if proj in fallback:
        return shard_algos(fallback[proj])
    return None


def vllm_modelopt_mixed_algo(prefix: str, quantized_layers: Mapping[str, Mapping], exclude: Sequence[str],
                             moe: bool) -> str | None:
    """The algo vLLM 0.32 runs ``prefix`` in under ``quant_algo: MIXED_PRECISION`` (None: unquantized):
    ``is_layer_excluded`` first (`vllm_modelopt_is_layer_excluded`), then `vllm_modelopt_mixed_resolve`, then
    the dispatch tables (`VLLM_MIXED_LINEAR_ALGOS` / `VLLM_MIXED_MOE_ALGOS`)."""
    if vllm_modelopt_is_layer_excluded(prefix, exclude):
        return None
    algo = vllm_modelopt_mixed_resolve(prefix, quantized_layers)
    return algo if algo in (VLLM_MIXED_MOE_ALGOS if moe else VLLM_MIXED_LINEAR_ALGOS) else None


# ---- compressed-tensors ------------------------------------------------------------------------------------
def ct_match_name(name: str, target: str, fused: Mapping[str, Sequence[str]] | None = None) -> bool:
    """compressed-tensors ``match_name`` (compressed_tensors/utils/match.py, v0.20): ``re:`` targets use
    ``re.match`` (anchored at the start only), other targets must equal the name; a fused name matches when
    ANY of its shards matches."""
    if fused is not None:
        for suffix, shards in fused.items():
            if name.endswith(suffix):
                base = name[: -len(suffix)]
                return any(ct_match_name(base + s, target) for s in shards)
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def ct_is_match(name: str, is_linear: bool, targets: Sequence[str], ignore: Sequence[str],
                fused: Mapping[str, Sequence[str]] | None = None) -> bool:
    """compressed-tensors ``is_match``: a target or ignore entry matches the name or the module class name
    (``Linear`` matches every linear layer)."""
    def hit(t: str) -> bool:
        return ct_match_name(name, t, fused) or (is_linear and t == "Linear")
    return any(hit(t) for t in targets) and not any(hit(t) for t in ignore)


# ---- Megatron-Core -------------------------------------------------------------------------------------------
def megatron_is_first_last_bf16_layer(layer_no: int, num_layers: int, first_last_layers_bf16: bool,
                                      num_layers_at_start_in_bf16: int, num_layers_at_end_in_bf16: int) -> bool:
    """Megatron-Core ``is_first_last_bf16_layer`` (megatron/core/fp8_utils.py): ``layer_no`` is the 0-based
    global decoder layer; the whole TransformerLayer (attention, MLP, MoE experts, shared experts) runs
    outside the FP8/FP4 autocast context when it is True. Routers are not TE linears and never quantized."""
    start = num_layers_at_start_in_bf16 if first_last_layers_bf16 else 0
    end = num_layers_at_end_in_bf16 if first_last_layers_bf16 else 0
    return layer_no >= 0 and first_last_layers_bf16 and (layer_no < start or layer_no >= num_layers - end)
