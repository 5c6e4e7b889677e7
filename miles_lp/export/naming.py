"""Which tensors a quantized module writes, per target engine (CONTRACT 4), and the inverse for ``verify``.

The one owner of engine naming and encoding: ``miles-lp convert``, ``miles-lp export`` and the live weight
sync all write through ``encode``, so an engine started from a converted checkpoint and one updated in place
hold the same tensors under the same names.

The codecs name the parts of a quantized tensor canonically (``data``, ``scale``, ``global_scale``). Each
target names them differently on disk:

=====================  =============================================  ======================================
target                  MXFP8 (weight ``[N, K]``)                      NVFP4 (weight ``[N, K]``)
=====================  =============================================  ======================================
``sglang``              ``weight`` e4m3 ``[N,K]``,                     ModelOpt: ``weight`` u8 ``[N,K/2]``,
                        ``weight_scale_inv`` u8 E8M0 ``[N,K/32]``      ``weight_scale`` e4m3 ``[N,K/16]``,
                                                                       ``weight_scale_2`` f32 ``[]`` (decode
                                                                       scale amax/2688), ``input_scale`` f32 ``[]``
``vllm``                ``weight``, ``weight_scale`` u8 (modelopt_     as sglang (ModelOpt names)
                        mxfp8 names the scale ``weight_scale``)
``compressed-tensors``  ``weight`` e4m3, ``weight_scale`` u8            ``weight_packed`` u8, ``weight_scale``
                        (``mxfp8-quantized``)                          e4m3, ``weight_global_scale`` f32 ``[1]``
                                                                       = 1 / ModelOpt's ``weight_scale_2``,
                                                                       ``input_global_scale`` f32 ``[1]`` (W4A4)
                                                                       = 1 / ``input_scale`` (``nvfp4-pack-
                                                                       quantized``)
=====================  =============================================  ======================================

FP8 blockwise (DeepSeek-V3 style, TE Float8BlockScaling weights; every target): ``weight`` e4m3 ``[N, K]`` and
``weight_scale_inv`` f32 ``[ceil(N/128), ceil(K/128)]``, the *decode* multiplier of each 128x128 block (partial
edge blocks allowed). SGLang's and vLLM's ``Fp8Config`` with ``weight_block_size`` create exactly these two
parameters (``Fp8LinearMethod.create_weights``: ``weight_scale_inv`` when ``block_quant``); compressed-tensors'
``FP8_BLOCK`` scheme names the same tensor ``weight_scale`` (its block-strategy scale is also the decode
multiplier, ``dequantize = q * scale``).

``input_scale`` (ModelOpt NVFP4): the static activation *decode* global scale; SGLang's ModelOpt linear
computes ``input_scale_inv = 1 / input_scale`` as the activation encode scale and
``alpha = input_scale * weight_scale_2`` (sglang ``modelopt_quant.py``, ``ModelOptFp4LinearMethod.
process_weights_after_loading``). Our recipe scales activations per token at run time (CONTRACT 2), so there is
no calibrated value: we write ``1.0``, as Miles' ``tools/convert_hf_to_nvfp4.py`` does for the same recipe.
A per-token kernel ignores it; a static-scale kernel then quantizes activations with ``S_enc = 1`` (correct for
block amax up to 2688). ``verify`` checks that it is exactly 1.0. compressed-tensors W4A4 groups carry the same
static scale as ``input_global_scale`` (stored as the encode scale, so 1 / 1.0): vLLM's NVFP4 linear has no
per-token activation scale, and without the tensor it serves ``torch.empty`` memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from miles_lp.errors import CheckpointError, ConfigError
from miles_lp.formats.spec import FP8_BLOCK_SIZE, MXFP8_BLOCK, NVFP4_BLOCK, Format

TARGETS = ("sglang", "vllm", "compressed-tensors")
INPUT_SCALE_VALUE = 1.0  # see module docstring


@dataclasses.dataclass(frozen=True)
class Part:
    """One on-disk tensor of a quantized module: its suffix (after ``<module>.``), the codec component it
    holds (``None`` = a constant), its safetensors dtype and how its shape derives from the weight's."""

    suffix: str
    component: str | None
    dtype: str
    # "data" [.., N, K], "packed" [.., N, K/2], "mx" [.., N, K/32], "nv" [.., N, K/16], "blk" [.., ceil(N/128),
    # ceil(K/128)], "scalar", "one"
    shape: str
    transform: str = ""  # "reciprocal": stored value = 1 / component


_MXFP8 = {
    "sglang": (Part("weight", "data", "F8_E4M3", "data"), Part("weight_scale_inv", "scale", "U8", "mx")),
    "vllm": (Part("weight", "data", "F8_E4M3", "data"), Part("weight_scale", "scale", "U8", "mx")),
    "compressed-tensors": (Part("weight", "data", "F8_E4M3", "data"), Part("weight_scale", "scale", "U8", "mx")),
}
_MODELOPT_NVFP4 = (
    Part("weight", "data", "U8", "packed"),
    Part("weight_scale", "scale", "F8_E4M3", "nv"),
    Part("weight_scale_2", "global_scale", "F32", "scalar"),
    Part("input_scale", None, "F32", "scalar"),
)
_NVFP4 = {
    "sglang": _MODELOPT_NVFP4,
    "vllm": _MODELOPT_NVFP4,
    "compressed-tensors": (
        Part("weight_packed", "data", "U8", "packed"),
        Part("weight_scale", "scale", "F8_E4M3", "nv"),
        Part("weight_global_scale", "global_scale", "F32", "one", transform="reciprocal"),
        # W4A4 (the config group declares input_activations): vLLM's CompressedTensorsW4A4Fp4 creates this with
        # torch.empty and reads it from the checkpoint; stored as the ENCODE scale, like
        # weight_global_scale: 1 / INPUT_SCALE_VALUE.
        Part("input_global_scale", None, "F32", "one", transform="reciprocal"),
    ),
}


_FP8_BLOCK = {
    "sglang": (Part("weight", "data", "F8_E4M3", "data"), Part("weight_scale_inv", "scale_inv", "F32", "blk")),
    "vllm": (Part("weight", "data", "F8_E4M3", "data"), Part("weight_scale_inv", "scale_inv", "F32", "blk")),
    "compressed-tensors": (Part("weight", "data", "F8_E4M3", "data"), Part("weight_scale", "scale_inv", "F32", "blk")),
}


def check_target(target: str) -> str:
    if target not in TARGETS:
        raise ConfigError(f"unknown --target '{target}'; supported: {', '.join(TARGETS)}")
    return target


def parts(target: str, fmt: Format) -> tuple[Part, ...]:
    """The on-disk tensors of a module quantized in ``fmt`` for ``target`` (empty for BF16)."""
    check_target(target)
    if fmt is Format.MXFP8:
        return _MXFP8[target]
    if fmt is Format.NVFP4:
        return _NVFP4[target]
    if fmt is Format.FP8_BLOCK:
        return _FP8_BLOCK[target]
    if fmt is Format.BF16:
        return ()
    raise ConfigError(f"format {fmt.value} cannot be written for target '{target}' (supported in checkpoints: "
                      "mxfp8, nvfp4, fp8_block)")


def module_prefix(weight_name: str) -> str:
    """``model.layers.0.mlp.down_proj.weight`` -> ``model.layers.0.mlp.down_proj.``"""
    if not weight_name.endswith(".weight"):
        raise CheckpointError(f"only '<module>.weight' tensors can be quantized, got '{weight_name}'")
    return weight_name[: -len("weight")]


def _shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    *lead, k = shape
    if kind == "blk":
        return (*lead[:-1], -(-lead[-1] // FP8_BLOCK_SIZE), -(-k // FP8_BLOCK_SIZE))
    return {
        "data": tuple(shape),
        "packed": (*lead, k // 2),
        "mx": (*lead, k // MXFP8_BLOCK),
        "nv": (*lead, k // NVFP4_BLOCK),
        "scalar": (),
        "one": (1,),
    }[kind]


def expected(target: str, fmt: Format, weight_name: str, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple]]:
    """``{on-disk name: (safetensors dtype, shape)}`` for one quantized weight of logical ``shape``.

    Scalars per 2-D weight; a stacked ``[E, N, K]`` weight is not written by the converter (HF checkpoints
    store experts one by one).
    """
    if len(shape) != 2:
        raise CheckpointError(f"'{weight_name}': quantized checkpoint weights must be 2-D, got {list(shape)}")
    prefix = module_prefix(weight_name)
    return {prefix + p.suffix: (p.dtype, _shape(p.shape, shape)) for p in parts(target, fmt)}


def encode(target: str, fmt: Format, weight_name: str, q, constants: dict | None = None) -> dict:
    """On-disk tensors for quantized tensor ``q`` (an ``MXFP8Tensor``/``NVFP4Tensor`` from the codecs).

    ``constants``: a cache the caller keeps across calls (the live sync): a constant part (``input_scale``) is
    then ONE tensor on ``q``'s device shared by every module, not a new host tensor per module. Leave it out
    where each module needs its own tensor (a checkpoint writer: safetensors refuses shared storage)."""
    import torch

    prefix = module_prefix(weight_name)
    comps = q.components()
    out = {}
    for p in parts(target, fmt):
        if p.component is None:
            if constants is not None:
                key = (p.suffix, p.transform, p.shape, comps["data"].device)
                t = constants.get(key)
                if t is None:
                    t = constants[key] = _constant_tensor(p).to(comps["data"].device)
                out[prefix + p.suffix] = t
                continue
            t = torch.tensor(_constant(p), dtype=torch.float32)
        else:
            t = comps[p.component]
            if p.transform == "reciprocal":
                t = 1.0 / t.to(torch.float32)
        if p.shape == "scalar":
            t = t.reshape(())
        elif p.shape == "one":
            t = t.reshape(1)
        out[prefix + p.suffix] = t.contiguous()
    return out


def _constant_tensor(p: Part):
    import torch

    t = torch.tensor(_constant(p), dtype=torch.float32)
    return t.reshape(()) if p.shape == "scalar" else t.reshape(1) if p.shape == "one" else t


def decode_components(target: str, fmt: Format, weight_name: str, tensors: Mapping,
                      lead: tuple[int, ...] = ()) -> dict:
    """Inverse of ``encode``: canonical components (``data``, ``scale``, ``global_scale``) from disk tensors.

    ``global_scale`` is returned as the codec holds it (fp32 decode scale, 0-d for a 2-D weight). ``lead``: the
    leading dims of tensors stacked over several weights (an engine's ``[E, ...]`` experts): scalar parts are
    then ``[*lead]``.
    """
    import torch

    prefix = module_prefix(weight_name)
    comps = {}
    for p in parts(target, fmt):
        if p.component is None:
            continue
        name = prefix + p.suffix
        if name not in tensors:
            raise CheckpointError(f"missing tensor '{name}' ({fmt.value} {p.component} for target {target})")
        t = tensors[name]
        if p.transform == "reciprocal":
            t = (1.0 / t.to(torch.float32))
        if p.shape in ("scalar", "one"):
            t = t.reshape(lead)
        comps[p.component] = t
    return comps


def _constant(p: Part) -> float:
    """The stored value of a constant part: the static activation decode scale, or its reciprocal."""
    return 1.0 / INPUT_SCALE_VALUE if p.transform == "reciprocal" else INPUT_SCALE_VALUE
