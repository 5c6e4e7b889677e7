"""The scheme parameters each engine's config reader uses for a quantized weight, beyond its format (C1).

`configs.engine_schemes_for` resolves which config entry governs each weight (skip lists, ``quantized_layers``,
config groups); the functions here say which of that entry's fields the reader then acts on, with the reader's
default for an absent field, so that ``verify`` can compare a checkpoint's config with the plan's field by field
(a compressed-tensors group with ``group_size: 64`` selected the right format but the package's
decompressor then failed on every module). Read from, per reader:

* SGLang ``quant_method: mxfp8`` (``Fp8Config.from_config``, layers/quantization/fp8.py): ``activation_scheme``
  is required and block quantization asserts ``dynamic``; ``weight_block_size`` must be ``[1, 32]`` (older
  releases raise on another value, newer ones override it with a warning), default ``[1, 32]``; ``scale_fmt``
  ``ue8m0`` selects power-of-two activation scales where SGLang serves MXFP8 as block FP8 (ROCm), absent = None.
  ``fmt`` is not read by that class; a value other than ``e4m3`` contradicts the stored e4m3 weights, so it is
  compared too (absent = e4m3).
* SGLang / vLLM ``quant_method: fp8`` with ``weight_block_size`` (DeepSeek-V3 block FP8, ``Fp8Config``):
  ``activation_scheme`` and ``weight_block_size`` (`fp8_block_params`).
* ModelOpt (vLLM 0.32 ``ModelOptQuantConfigBase.from_config`` / ``ModelOptNvFp4Config``, SGLang
  ``ModelOptFp4Config``): ``quant_algo`` (the format) and ``group_size``, which sizes the NVFP4 block-scale
  parameters (``K // group_size``); vLLM's default 16 for NVFP4, SGLang requires it. SGLang also reads
  ``hf_quant_config.json``'s ``quantization.group_size``. MXFP8's block is fixed at 32 (vLLM does not read the field); a declared other value
  contradicts the data and is compared (absent = 32).
* ModelOpt ``MIXED_PRECISION``: each ``quantized_layers`` entry's ``quant_algo`` and ``group_size`` (absent: 16
  NVFP4, 32 MXFP8); vLLM 0.32 sizes every NVFP4 module with ONE group size, the top-level ``group_size``, else
  the first NVFP4 entry's, else 16 (``ModelOptMixedPrecisionConfig._from_config``), compared for NVFP4 weights.
* compressed-tensors (the package's ``QuantizationArgs``, v0.20, and vLLM 0.32 ``CompressedTensorsConfig.
  _get_scheme_from_parts`` / ``_is_mxfp8`` / ``_is_nvfp4_format``): the group's ``format`` (the top-level one if
  the group has none, as vLLM does), ``quantization_status`` (transformers treats anything but ``compressed`` as
  weights still to be quantized), and of ``weights``, ``input_activations`` and ``output_activations`` (present or
  null: NVFP4 W4A4 vs W4A16) the fields scheme selection and decompression read: ``num_bits``, ``type``,
  ``strategy`` (inferred as ``QuantizationArgs`` does when absent), ``group_size``, ``block_structure``,
  ``symmetric``, ``dynamic``, ``scale_dtype`` (vLLM's MXFP8 test requires ``torch.uint8``). Observer fields,
  ``zp_dtype`` (symmetric schemes have no zero point) and ``actorder`` (GPTQ ordering) are not compared.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from miles_lp.formats.schemes import scheme_for
from miles_lp.formats.spec import Format

ABSENT = "(absent)"  # how a missing field without a reader default is shown and compared


@dataclasses.dataclass(frozen=True)
class Param:
    """One field a reader acts on: ``key`` compares (the same for every producer), ``where`` names it on disk."""

    key: str
    value: Any
    where: str


@dataclasses.dataclass(frozen=True)
class Scheme:
    """How the engine reads one weight: its format and the scheme fields it uses (none for BF16)."""

    format: Format
    params: tuple[Param, ...] = ()


BF16 = Scheme(Format.BF16)
#: the block each ModelOpt format stores (the reader's default if absent): NVFP4 16, MXFP8 32
_MODELOPT_GROUP = {f: scheme_for(f).scale_block for f in Format if scheme_for(f).modelopt_algo}


def _norm(v: Any) -> Any:
    """JSON values as comparable, hashable ones (lists -> tuples)."""
    if isinstance(v, list):
        return tuple(_norm(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _norm(x)) for k, x in v.items()))
    return v


def sglang_mxfp8_params(qc: dict) -> tuple[Param, ...]:
    return (Param("activation_scheme", _norm(qc.get("activation_scheme", ABSENT)), "activation_scheme"),
            Param("weight_block_size", _norm(qc.get("weight_block_size", [1, 32])), "weight_block_size"),
            Param("scale_fmt", _norm(qc.get("scale_fmt", ABSENT)), "scale_fmt"),
            Param("fmt", _norm(qc.get("fmt", "e4m3")), "fmt"))


def fp8_block_params(qc: dict) -> tuple[Param, ...]:
    """SGLang / vLLM ``quant_method: fp8`` with blocks (``Fp8Config.from_config``): ``weight_block_size`` sizes the
    ``weight_scale_inv`` parameter (``ceil(N/bn), ceil(K/bk)``) and selects the block kernel; block quantization
    requires ``activation_scheme: dynamic`` (both readers refuse static with blocks)."""
    return (Param("activation_scheme", _norm(qc.get("activation_scheme", ABSENT)), "activation_scheme"),
            Param("weight_block_size", _norm(qc.get("weight_block_size", ABSENT)), "weight_block_size"))


def modelopt_params(fmt: Format, qc: dict, hf_quant_config: dict | None, *, sglang: bool) -> tuple[Param, ...]:
    """Single-algo ModelOpt: ``group_size`` of config.json and, where SGLang reads it, hf_quant_config.json.
    vLLM defaults an absent NVFP4 ``group_size`` to 16; SGLang's ``ModelOptFp4Config.from_config`` raises
    without one ("NVFP4 quantization requires group size"), so for SGLang NVFP4 absent is a value of its own."""
    default = ABSENT if sglang and fmt is Format.NVFP4 else _MODELOPT_GROUP[fmt]
    out = [Param("group_size", _norm(qc.get("group_size", default)), "group_size")]
    if hf_quant_config is not None:
        q = hf_quant_config.get("quantization") or {}
        out.append(Param("hf_quant_config.group_size", _norm(q.get("group_size", default)),
                         "hf_quant_config.json quantization.group_size"))
    return tuple(out)


def modelopt_mixed_params(fmt: Format, shards: list[str], qc: dict, vllm: bool) -> tuple[Param, ...]:
    """MIXED_PRECISION: every listed shard entry's ``group_size``; for vLLM, the one NVFP4 group size it uses."""
    layers = qc.get("quantized_layers") or {}
    out = []
    for shard in shards:
        entry = layers.get(shard)
        if isinstance(entry, dict):
            out.append(Param("quantized_layers.group_size", _norm(entry.get("group_size", _MODELOPT_GROUP[fmt])),
                             f"quantized_layers['{shard}'].group_size"))
    if vllm and fmt is Format.NVFP4:
        out.append(Param("vllm.nvfp4_group_size", *_vllm_mixed_nvfp4_group_size(qc)))
    return tuple(out)


def _vllm_mixed_nvfp4_group_size(qc: dict) -> tuple[Any, str]:
    if "group_size" in qc and qc["group_size"] is not None:
        return _norm(qc["group_size"]), "group_size (vLLM sizes every NVFP4 module with it)"
    for key, entry in (qc.get("quantized_layers") or {}).items():
        if isinstance(entry, dict) and str(entry.get("quant_algo", "")).upper() in ("NVFP4", "W4A16_NVFP4"):
            return (_norm(entry.get("group_size", 16)),
                    f"quantized_layers['{key}'].group_size (the first NVFP4 entry: vLLM sizes every NVFP4 module "
                    "with it)")
    return 16, "group_size (vLLM's default 16)"


def ct_args(d: Any) -> dict[str, Any] | str | None:
    """A ``QuantizationArgs`` dict normalized as compressed-tensors 0.20 parses it: its defaults for absent fields
    and ``strategy`` inferred from ``group_size`` (``validate_model_after``). None stays None (not quantized)."""
    if d is None:
        return None
    if not isinstance(d, dict):
        return f"not a mapping: {d!r}"
    group_size, strategy = d.get("group_size"), d.get("strategy")
    if strategy is None:
        if group_size is None:
            strategy = "tensor"
        elif isinstance(group_size, int) and group_size > 0:
            strategy = "group"
        elif group_size == -1:
            strategy = "channel"
    dynamic = d.get("dynamic", False)
    scale_dtype = d.get("scale_dtype")
    if isinstance(scale_dtype, str):
        scale_dtype = scale_dtype.removeprefix("torch.")
    return {"num_bits": d.get("num_bits", 8), "type": str(d.get("type", "int")).lower(),
            "strategy": str(strategy).lower() if strategy is not None else None, "group_size": group_size,
            "block_structure": _norm(d.get("block_structure")), "symmetric": d.get("symmetric", True),
            "dynamic": dynamic.lower() if isinstance(dynamic, str) else dynamic, "scale_dtype": scale_dtype}


def ct_params(group_name: str, group: dict, qc: dict) -> tuple[Param, ...]:
    """compressed-tensors: the group's format, the config's status and each argument set's compared fields."""
    top = qc.get("format")
    fmt = group.get("format") or (top if top != "mixed-precision" else None) or ABSENT
    where = f"config_groups.{group_name}"
    out = [Param("format", fmt, f"{where}.format"),
           Param("quantization_status", qc.get("quantization_status", "initialized"), "quantization_status")]
    for kind in ("weights", "input_activations", "output_activations"):
        args = ct_args(group.get(kind))
        # present or null is a field of its own: NVFP4 W4A4 vs W4A16, and the sub-fields exist on one side only
        out.append(Param(kind, "(set)" if isinstance(args, dict) else "(null)" if args is None else args,
                         f"{where}.{kind}"))
        if isinstance(args, dict):
            out += [Param(f"{kind}.{k}", _norm(v), f"{where}.{kind}.{k}") for k, v in args.items()]
    return tuple(out)


def compare(found: Scheme, want: Scheme) -> list[tuple[Param, Any]]:
    """The fields of ``found`` (the config on disk, read as the engine does) whose value differs from the
    plan's (``want``: the plan's own config read the same way), as ``(on-disk param, plan's value)``. Fields
    only one side has (hf_quant_config.json absent on disk: SGLang does not read it) are not compared."""
    plan = {p.key: p.value for p in want.params}
    return [(p, plan[p.key]) for p in found.params if p.key in plan and p.value != plan[p.key]]
