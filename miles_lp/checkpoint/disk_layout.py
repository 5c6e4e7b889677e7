"""Each target's on-disk layout and the engines' fusing rules, as ``verify`` expects them (CONTRACT 4, 2, 10).

Written here from the engines' loaders, not taken from ``miles_lp.export.naming`` (what the converter writes):
``verify`` is an independent oracle, so the two tables are compared, never shared.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

from miles_lp.errors import CheckpointError
from miles_lp.formats.spec import FP8_BLOCK_SIZE, MXFP8_BLOCK, NVFP4_BLOCK, Format

PLAN_FILE = "miles_lp_plan.json"  # the converter's record (name on disk)
TARGETS = ("sglang", "vllm", "compressed-tensors")


# --------------------------------------------------------------------------------------------------------
# The on-disk layout per target (CONTRACT 4), written here on purpose (see the module docstring)
# --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Part:
    """One on-disk tensor of a quantized module ``<m>.``: suffix, what it holds, dtype, shape rule.

    ``role``: ``data``; ``scale`` (block scales); ``global`` (NVFP4 global scale, stored as the decode
    scale S_dec when ``stored == "dec"``, as fp32(1 / S_dec) when ``"enc"``); ``input`` (static activation
    scale). ``shape``: ``same`` [N, K], ``half`` [N, K/2], ``k32`` [N, K/32], ``k16`` [N, K/16],
    ``b128`` [ceil(N/128), ceil(K/128)] (FP8 blockwise, one fp32 decode scale per 128x128 block), ``scalar`` [],
    ``one`` [1].
    """

    suffix: str
    role: str
    dtype: str
    shape: str
    stored: str = ""


_MXFP8_PARTS = {
    "sglang": (Part("weight", "data", "F8_E4M3", "same"), Part("weight_scale_inv", "scale", "U8", "k32")),
    "vllm": (Part("weight", "data", "F8_E4M3", "same"), Part("weight_scale", "scale", "U8", "k32")),
    "compressed-tensors": (Part("weight", "data", "F8_E4M3", "same"), Part("weight_scale", "scale", "U8", "k32")),
}
_MODELOPT_NVFP4 = (Part("weight", "data", "U8", "half"), Part("weight_scale", "scale", "F8_E4M3", "k16"),
                   Part("weight_scale_2", "global", "F32", "scalar", "dec"),
                   Part("input_scale", "input", "F32", "scalar", "dec"))
_NVFP4_PARTS = {
    "sglang": _MODELOPT_NVFP4,
    "vllm": _MODELOPT_NVFP4,
    "compressed-tensors": (Part("weight_packed", "data", "U8", "half"),
                           Part("weight_scale", "scale", "F8_E4M3", "k16"),
                           Part("weight_global_scale", "global", "F32", "one", "enc")),
}
#: FP8 blockwise (DeepSeek-V3 ``weight_scale_inv``; compressed-tensors' block strategy calls it ``weight_scale``)
_FP8_BLOCK_PARTS = {
    "sglang": (Part("weight", "data", "F8_E4M3", "same"), Part("weight_scale_inv", "scale", "F32", "b128")),
    "vllm": (Part("weight", "data", "F8_E4M3", "same"), Part("weight_scale_inv", "scale", "F32", "b128")),
    "compressed-tensors": (Part("weight", "data", "F8_E4M3", "same"), Part("weight_scale", "scale", "F32", "b128")),
}
CT_INPUT_GLOBAL_SCALE = Part("input_global_scale", "input", "F32", "one", "enc")  # W4A4 (see required_parts)


def ct_needs_input_scale(quant_config) -> bool:
    """compressed-tensors: an ``nvfp4-pack-quantized`` config group that declares ``input_activations``
    (W4A4) makes vLLM's ``CompressedTensorsW4A4Fp4`` create ``input_global_scale`` and read it from the
    checkpoint; a W4A16 group (``input_activations`` null) does not."""
    groups = (quant_config or {}).get("config_groups") or {} if isinstance(quant_config, dict) else {}
    return any(isinstance(g, dict) and g.get("format") == "nvfp4-pack-quantized"
               and g.get("input_activations") is not None for g in groups.values())


def required_parts(target: str, fmt: Format, quant_config=None) -> tuple[Part, ...]:
    """The on-disk tensors of a module in ``fmt`` for ``target``, including what the declared scheme in
    ``quant_config`` (config.json's ``quantization_config``) needs."""
    if target not in TARGETS:
        raise CheckpointError(f"unknown target '{target}' in {PLAN_FILE}; verify knows {', '.join(TARGETS)}")
    if fmt is Format.MXFP8:
        return _MXFP8_PARTS[target]
    if fmt is Format.NVFP4:
        parts = _NVFP4_PARTS[target]
        if target == "compressed-tensors" and ct_needs_input_scale(quant_config):
            parts = (*parts, CT_INPUT_GLOBAL_SCALE)
        return parts
    if fmt is Format.FP8_BLOCK:
        return _FP8_BLOCK_PARTS[target]
    raise CheckpointError(f"format {fmt.value} is not a checkpoint format verify knows (mxfp8, nvfp4, fp8_block)")


def _part_shape(rule: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    n, k = shape
    return {"same": (n, k), "half": (n, k // 2), "k32": (n, k // MXFP8_BLOCK), "k16": (n, k // NVFP4_BLOCK),
            "b128": (math.ceil(n / FP8_BLOCK_SIZE), math.ceil(k / FP8_BLOCK_SIZE)), "scalar": (), "one": (1,)}[rule]


def weight_prefix(weight: str) -> str:
    if not weight.endswith(".weight"):
        raise CheckpointError(f"'{weight}' is planned quantized but is not a '<module>.weight' tensor")
    return weight[: -len("weight")]


def expected_tensors(target: str, formats: Mapping[str, Format], shapes: Mapping[str, tuple],
                     dtypes: Mapping[str, str], quant_config=None) -> dict[str, tuple[str, tuple]]:
    """``{on-disk name: (dtype, shape)}`` a checkpoint of this plan, source and config must hold."""
    table: dict[str, tuple[str, tuple]] = {}
    for name, shape in shapes.items():
        fmt = formats.get(name)
        if fmt is None:
            table[name] = ("BF16" if dtypes[name] == "F8_E4M3" else dtypes[name], tuple(shape))
            continue
        if len(shape) != 2:
            raise CheckpointError(f"'{name}' is planned {fmt.value} but has shape {list(shape)}; checkpoint "
                                  "weights must be 2-D")
        for p in required_parts(target, fmt, quant_config):
            table[weight_prefix(name) + p.suffix] = (p.dtype, _part_shape(p.shape, tuple(shape)))
    return table


# --------------------------------------------------------------------------------------------------------
# Fused groups: what SGLang and vLLM load into ONE parameter (one NVFP4 global scale kept; CONTRACT 2, 10)
# --------------------------------------------------------------------------------------------------------
FUSED_SHARDS = (
    ("q_proj", "k_proj", "v_proj"),  # qkv_proj
    ("gate_proj", "up_proj"),  # gate_up_proj: dense MLP, shared experts, each routed expert (w13)
    ("w1", "w3"),  # Mixtral's per-expert gate (w1) and up (w3): w13
    ("q_a_proj", "kv_a_proj_with_mqa"),  # DeepSeek MLA: SGLang fused_qkv_a_proj_with_mqa, vLLM fused_qkv_a_proj
)
_LEAF = re.compile(r"^(?P<parent>.+)\.(?P<leaf>[A-Za-z0-9_]+)\.weight$")


def fused_groups(names) -> dict[str, tuple[str, ...]]:
    """``{group label: member weights}`` for every fused group with at least two members among ``names``."""
    found: dict[str, list[str]] = {}
    for n in names:
        m = _LEAF.match(n)
        if m is None:
            continue
        for shards in FUSED_SHARDS:
            if m["leaf"] in shards:
                found.setdefault(f"{m['parent']}.{{{','.join(shards)}}}", []).append(n)
    return {g: tuple(sorted(v)) for g, v in found.items() if len(v) > 1}
