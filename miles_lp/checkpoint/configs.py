"""Which quantization config a converted checkpoint carries, per (target, formats in the plan).

The configs themselves are written by the policy package's emitters (``miles_lp.policy.emit``), which
re-read what they emit with the consumer's own matching rules; this module only chooses the emitter, from the
registry ``CONFIG_EMITTERS`` (a dict, so a new target is one entry):

=====================  ==================  =====================================================
target                 plan formats        emitter -> files
=====================  ==================  =====================================================
sglang                 mxfp8 only          ``sglang_config`` -> config.json (``quant_method: mxfp8``)
sglang                 nvfp4 only          ``modelopt_config`` -> config.json, ``hf_quant_config``
                                           -> hf_quant_config.json (ModelOpt NVFP4)
sglang                 mxfp8 + nvfp4       ``modelopt_mixed_config`` -> config.json (MIXED_PRECISION)
vllm                   any                 ``vllm_config`` -> config.json (modelopt_mxfp8 / modelopt)
compressed-tensors     any                 ``compressed_tensors_config`` -> config.json (config_groups)
=====================  ==================  =====================================================
"""

from __future__ import annotations

from miles_lp.errors import ConfigError
from miles_lp.formats.spec import Format

HF_QUANT_CONFIG = "hf_quant_config.json"


def plan_formats(plan) -> frozenset[Format]:
    return frozenset(f for f in (Format(plan.format_for(n)) for n in plan.entries) if f.quantized)


_MXFP8, _NVFP4 = frozenset({Format.MXFP8}), frozenset({Format.NVFP4})
_ANY = None  # a registry key matching any formats of the target

#: ``(target, formats or _ANY) -> (config.json emitter name, {extra file: emitter name})``. The names are the
#: functions of ``miles_lp.policy.emit`` (resolved through ``_EMIT_FUNCTIONS``, an explicit table, not getattr).
CONFIG_EMITTERS: dict[tuple[str, frozenset[Format] | None], tuple[str, dict[str, str]]] = {
    ("sglang", _MXFP8): ("sglang_config", {}),
    ("sglang", _NVFP4): ("modelopt_config", {HF_QUANT_CONFIG: "hf_quant_config"}),
    ("sglang", _ANY): ("modelopt_mixed_config", {}),
    ("vllm", _ANY): ("vllm_config", {}),
    ("compressed-tensors", _ANY): ("compressed_tensors_config", {}),
}


def _emit_functions() -> dict:
    """The emitters by name (imported on first use: ``policy.emit`` is only needed when configs are written)."""
    from miles_lp.policy import emit

    return {"sglang_config": emit.sglang_config, "modelopt_config": emit.modelopt_config,
            "hf_quant_config": emit.hf_quant_config, "modelopt_mixed_config": emit.modelopt_mixed_config,
            "vllm_config": emit.vllm_config, "compressed_tensors_config": emit.compressed_tensors_config}


def emitter_names(target: str, formats: frozenset[Format]) -> tuple[str, dict[str, str]]:
    """(emitter for config.json's ``quantization_config``, {extra file: emitter}) from ``CONFIG_EMITTERS``."""
    unsupported = formats - {Format.MXFP8, Format.NVFP4}
    if unsupported:
        raise ConfigError(f"formats {sorted(f.value for f in unsupported)} cannot be written to a checkpoint "
                          "for any target; use mxfp8 and/or nvfp4")
    hit = CONFIG_EMITTERS.get((target, frozenset(formats))) or CONFIG_EMITTERS.get((target, _ANY))
    if hit is None:
        raise ConfigError(f"unknown target '{target}'")
    return hit


def emit_configs(plan, target: str) -> tuple[dict, dict[str, dict]]:
    """``(quantization_config, {filename: content})`` for ``target``; ``ConfigError`` if not expressible."""
    main, extra = emitter_names(target, plan_formats(plan))
    functions = _emit_functions()
    quant_config = functions[main](plan)
    files = {fname: functions[fn](plan) for fname, fn in extra.items()}
    return quant_config, files


_ALGO_FORMAT = {"MXFP8": Format.MXFP8, "NVFP4": Format.NVFP4}
_CT_FORMAT = {"mxfp8-quantized": Format.MXFP8, "nvfp4-pack-quantized": Format.NVFP4}


def engine_formats_for(target: str, quant_config, files: dict[str, dict], plan) -> dict[str, Format]:
    """Read an on-disk config as the engine does (``miles_lp.policy.consumers``): ``{weight name: format}``
    for every weight of the plan's engine modules (fused qkv / gate_up, FusedMoE); others are BF16.

    ``ConfigError`` when the engine itself would refuse the config (fused shards that disagree, unknown algo).
    """
    from miles_lp.policy import consumers as C
    from miles_lp.policy.emit import engine_modules

    if not isinstance(quant_config, dict):
        raise ConfigError("config.json has no quantization_config: the engine would load everything BF16")
    method, algo = quant_config.get("quant_method"), str(quant_config.get("quant_algo", "")).upper()
    mods = engine_modules(plan)
    out: dict[str, Format] = {}

    def fmt_of(m) -> Format:
        if target == "sglang" and method == "mxfp8":
            return Format.BF16 if C.sglang_is_layer_skipped(m.name, quant_config.get("modules_to_not_convert") or []) \
                else Format.MXFP8
        if method == "modelopt" and algo == "MIXED_PRECISION":
            a = C.modelopt_mixed_layer_algo(m.shards, quant_config.get("quantized_layers") or {})
            return Format.BF16 if a is None else _algo(a)
        if method == "modelopt" and target == "sglang":
            excl = quant_config.get("ignore") or []
            f = Format.BF16 if C.sglang_modelopt_is_layer_excluded(m.name, excl) else _algo(algo)
            hf = files.get(HF_QUANT_CONFIG)
            if hf is not None:  # SGLang reads hf_quant_config.json when present: it must say the same
                excl2 = (hf.get("quantization") or {}).get("exclude_modules") or []
                f2 = Format.BF16 if C.sglang_modelopt_is_layer_excluded(m.name, excl2) else _algo(algo)
                if f2 != f:
                    raise ConfigError(f"{HF_QUANT_CONFIG} and config.json disagree on '{m.name}' "
                                      f"({f2.value} vs {f.value})")
            return f
        if method == "modelopt" and target == "vllm":
            excl = quant_config.get("ignore") or []
            return Format.BF16 if C.vllm_modelopt_is_layer_excluded(m.name, excl) else _algo(algo)
        if method == "compressed-tensors" and target == "compressed-tensors":
            groups, ignore = quant_config.get("config_groups") or {}, quant_config.get("ignore") or []
            found = set()
            for shard in m.shards:
                hits = [g for g, spec in groups.items() if C.ct_is_match(shard, False, spec.get("targets", []), ignore)]
                if len(hits) > 1:
                    raise ConfigError(f"'{shard}' matches several config groups {hits}")
                found.add(_CT_FORMAT.get(groups[hits[0]].get("format"), None) if hits else Format.BF16)
            if None in found:
                raise ConfigError(f"'{m.name}': config group format not mxfp8-quantized / nvfp4-pack-quantized")
            if len(found) > 1:
                raise ConfigError(f"shards of '{m.name}' resolve to different formats {sorted(f.value for f in found)}")
            return found.pop()
        raise ConfigError(f"quant_method {method!r} (quant_algo {algo!r}) is not what target '{target}' loads")

    for m in mods.values():
        try:
            f = fmt_of(m)
        except C.FusedShardMismatch as exc:
            raise ConfigError(f"the engine refuses this config: {exc}") from None
        for shard in m.shards:
            out[shard + ".weight"] = f
    return out


def _algo(algo: str) -> Format:
    try:
        return _ALGO_FORMAT[algo.upper()]
    except KeyError:
        raise ConfigError(f"quant_algo {algo!r} is not MXFP8 or NVFP4") from None
