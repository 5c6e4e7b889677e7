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
sglang                 fp8_block only      ``sglang_config`` -> config.json (``quant_method: fp8``,
                                           ``weight_block_size: [128, 128]``, DeepSeek-V3 style)
vllm                   any                 ``vllm_config`` -> config.json (modelopt_mxfp8 / modelopt; ``fp8`` with
                                           128x128 blocks for an fp8_block plan)
compressed-tensors     any                 ``compressed_tensors_config`` -> config.json (config_groups)
=====================  ==================  =====================================================
"""

from __future__ import annotations

from miles_lp.errors import ConfigError
from miles_lp.export import schemes as S
from miles_lp.export.schemes import Scheme
from miles_lp.formats.schemes import scheme_for
from miles_lp.formats.spec import Format

HF_QUANT_CONFIG = "hf_quant_config.json"


def plan_formats(plan) -> frozenset[Format]:
    return frozenset(f for f in (Format(plan.format_for(n)) for n in plan.entries) if f.quantized)


_MXFP8, _NVFP4, _FP8_BLOCK = frozenset({Format.MXFP8}), frozenset({Format.NVFP4}), frozenset({Format.FP8_BLOCK})
_ANY = None  # a registry key matching any formats of the target

#: ``(target, formats or _ANY) -> (config.json emitter name, {extra file: emitter name})``. The names are the
#: functions of ``miles_lp.policy.emit`` (resolved through ``_EMIT_FUNCTIONS``, an explicit table, not getattr).
CONFIG_EMITTERS: dict[tuple[str, frozenset[Format] | None], tuple[str, dict[str, str]]] = {
    ("sglang", _MXFP8): ("sglang_config", {}),
    ("sglang", _NVFP4): ("modelopt_config", {HF_QUANT_CONFIG: "hf_quant_config"}),
    ("sglang", _FP8_BLOCK): ("sglang_config", {}),
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
    unsupported = {f for f in formats if not scheme_for(f).in_checkpoints}
    if unsupported:
        raise ConfigError(f"formats {sorted(f.value for f in unsupported)} cannot be written to a checkpoint "
                          "for any target; use mxfp8 and/or nvfp4, or fp8_block alone")
    if Format.FP8_BLOCK in formats and len(formats) > 1:  # fp8 configs hold one format; no mixed form serves it
        raise ConfigError(f"fp8_block cannot share a checkpoint with {sorted(f.value for f in formats - _FP8_BLOCK)}"
                          " (SGLang and vLLM read block FP8 from 'quant_method: fp8', one format per checkpoint); "
                          "make every quantized layer fp8_block or none")
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


_ALGO_FORMAT = {scheme_for(f).modelopt_algo: f for f in Format if scheme_for(f).modelopt_algo}  # ModelOpt quant_algo
_CT_FORMAT = {"mxfp8-quantized": Format.MXFP8, "nvfp4-pack-quantized": Format.NVFP4,
              "float-quantized": Format.FP8_TENSOR}  # refined by the weights' strategy (block -> FP8_BLOCK)


def engine_formats_for(target: str, quant_config, files: dict[str, dict], plan) -> dict[str, Format]:
    """Read an on-disk config as the engine does (``miles_lp.policy.consumers``): ``{weight name: format}``
    for every weight of the plan's engine modules (fused qkv / gate_up, FusedMoE); others are BF16.

    ``ConfigError`` when the engine itself would refuse the config (fused shards that disagree, unknown algo).
    """
    return {n: s.format for n, s in engine_schemes_for(target, quant_config, files, plan).items()}


def engine_schemes_for(target: str, quant_config, files: dict[str, dict], plan) -> dict[str, Scheme]:
    """`engine_formats_for` with the scheme fields the engine's reader then uses for each weight
    (`miles_lp.export.schemes`: group sizes, bits, strategy, block size, ...), so a config that selects the
    right format with the wrong parameters can be told from the plan's."""
    from miles_lp.policy import consumers as C
    from miles_lp.policy.emit import engine_modules, vllm_fp8_is_layer_skipped

    if not isinstance(quant_config, dict):
        raise ConfigError("config.json has no quantization_config: the engine would load everything BF16")
    method, algo = quant_config.get("quant_method"), str(quant_config.get("quant_algo", "")).upper()
    mods = engine_modules(plan)
    out: dict[str, Scheme] = {}

    def scheme_of(m) -> Scheme:
        if method == "fp8" and target in ("sglang", "vllm"):
            if not quant_config.get("weight_block_size"):
                raise ConfigError("quant_method 'fp8' without weight_block_size is per-tensor FP8, which no "
                                  "checkpoint of ours holds; block FP8 needs weight_block_size: [128, 128]")
            if target == "sglang":  # SGLang's Fp8Config strips "model." from the list it reads
                ignored = quant_config.get("ignored_layers") or quant_config.get("modules_to_not_convert") or []
                skipped = C.sglang_is_layer_skipped(m.name, C.sglang_fp8_ignored_layers(ignored))
            else:
                skipped = vllm_fp8_is_layer_skipped(m.name, quant_config.get("ignored_layers") or [])
            return S.BF16 if skipped else S.Scheme(Format.FP8_BLOCK, S.fp8_block_params(quant_config))
        if target == "sglang" and method == "mxfp8":
            if C.sglang_is_layer_skipped(m.name, quant_config.get("modules_to_not_convert") or []):
                return S.BF16
            return S.Scheme(Format.MXFP8, S.sglang_mxfp8_params(quant_config))
        if method == "modelopt" and algo == "MIXED_PRECISION":
            a = C.modelopt_mixed_layer_algo(m.shards, quant_config.get("quantized_layers") or {})
            if a is None:
                return S.BF16
            return S.Scheme(_algo(a))  # the fields: per shard, below
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
            return S.BF16 if not f.quantized else S.Scheme(f, S.modelopt_params(f, quant_config, hf, sglang=True))
        if method == "modelopt" and target == "vllm":
            excl = quant_config.get("ignore") or []
            if C.vllm_modelopt_is_layer_excluded(m.name, excl):
                return S.BF16
            f = _algo(algo)
            return S.Scheme(f, S.modelopt_params(f, quant_config, None, sglang=False))
        if method == "compressed-tensors" and target == "compressed-tensors":
            groups, ignore = quant_config.get("config_groups") or {}, quant_config.get("ignore") or []
            top = quant_config.get("format")
            found = {}
            for shard in m.shards:
                hits = [g for g, spec in groups.items() if C.ct_is_match(shard, False, spec.get("targets", []), ignore)]
                if len(hits) > 1:
                    raise ConfigError(f"'{shard}' matches several config groups {hits}")
                if not hits:
                    found[None] = S.BF16
                    continue
                group = groups[hits[0]]
                # vLLM: the group's format, else the config's (a 'mixed-precision' config needs one per group)
                f = _CT_FORMAT.get(group.get("format") or (top if top != "mixed-precision" else None))
                if f is Format.FP8_TENSOR and (S.ct_args(group.get("weights")) or {}).get("strategy") == "block":
                    f = Format.FP8_BLOCK  # float-quantized with block weights: vLLM's W8A8 block FP8 scheme
                if f is None or f is Format.FP8_TENSOR:
                    raise ConfigError(f"'{m.name}': config group '{hits[0]}' format {group.get('format')!r} is not "
                                      "mxfp8-quantized / nvfp4-pack-quantized / float-quantized with block weights")
                found[hits[0]] = S.Scheme(f, S.ct_params(hits[0], group, quant_config))
            fmts = {s.format for s in found.values()}
            if len(fmts) > 1:
                raise ConfigError(f"shards of '{m.name}' resolve to different formats {sorted(f.value for f in fmts)}")
            if len({tuple((p.key, p.value) for p in s.params if p.key != "format") for s in found.values()}) > 1:
                # vLLM reads a fused module with the FIRST shard's group (find_matched_target): the others' differ
                raise ConfigError(f"shards of '{m.name}' resolve to config groups {sorted(found)} with different "
                                  "schemes: the engine fuses them into one module and reads it with one scheme")
            return next(iter(found.values()))
        raise ConfigError(f"quant_method {method!r} (quant_algo {algo!r}) is not what target '{target}' loads")

    for m in mods.values():
        try:
            s = scheme_of(m)
        except C.FusedShardMismatch as exc:
            raise ConfigError(f"the engine refuses this config: {exc}") from None
        for shard in m.shards:
            if method == "modelopt" and algo == "MIXED_PRECISION" and s.format.quantized:
                # each shard's own quantized_layers entry (the engine module's format is already agreed)
                out[shard + ".weight"] = S.Scheme(s.format, S.modelopt_mixed_params(
                    s.format, [shard], quant_config, vllm=target == "vllm"))
            else:
                out[shard + ".weight"] = s
    return out


def _algo(algo: str) -> Format:
    try:
        return _ALGO_FORMAT[algo.upper()]
    except KeyError:
        raise ConfigError(f"quant_algo {algo!r} is not MXFP8 or NVFP4") from None
