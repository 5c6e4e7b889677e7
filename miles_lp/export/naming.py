"""Which tensors a quantized module writes, per target engine (CONTRACT 4), and the inverse for ``verify``.

The one owner of engine encoding (each format's parts per target are its scheme's, ``FormatScheme.parts`` in
``miles_lp.formats.schemes``): ``miles-lp convert``, ``miles-lp export`` and the live weight
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

from collections.abc import Mapping

from miles_lp.errors import CheckpointError, ConfigError
from miles_lp.formats.scheme import TARGETS as SCHEME_TARGETS
from miles_lp.formats.scheme import Part, part_shape
from miles_lp.formats.scheme import check_target as _check_target
from miles_lp.formats.schemes import has_scheme, scheme_for
from miles_lp.formats.spec import Format

TARGETS = SCHEME_TARGETS
INPUT_SCALE_VALUE = 1.0  # see module docstring


def check_target(target: str) -> str:
    return _check_target(target)


def parts(target: str, fmt: Format) -> tuple[Part, ...]:
    """The on-disk tensors of a module quantized in ``fmt`` for ``target`` (empty for BF16): the format's scheme
    owns them (``FormatScheme.parts``)."""
    check_target(target)
    if not has_scheme(fmt):
        raise ConfigError(f"format {fmt.value} cannot be written for target '{target}' (supported in checkpoints: "
                          "mxfp8, nvfp4, fp8_block)")
    return scheme_for(fmt).parts(target)


def module_prefix(weight_name: str) -> str:
    """``model.layers.0.mlp.down_proj.weight`` -> ``model.layers.0.mlp.down_proj.``"""
    if not weight_name.endswith(".weight"):
        raise CheckpointError(f"only '<module>.weight' tensors can be quantized, got '{weight_name}'")
    return weight_name[: -len("weight")]


def expected(target: str, fmt: Format, weight_name: str, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple]]:
    """``{on-disk name: (safetensors dtype, shape)}`` for one quantized weight of logical ``shape``.

    Scalars per 2-D weight; a stacked ``[E, N, K]`` weight is not written by the converter (HF checkpoints
    store experts one by one).
    """
    if len(shape) != 2:
        raise CheckpointError(f"'{weight_name}': quantized checkpoint weights must be 2-D, got {list(shape)}")
    prefix = module_prefix(weight_name)
    table = parts(target, fmt)
    block = scheme_for(fmt).scale_block
    return {prefix + p.suffix: (p.dtype, part_shape(p.shape, tuple(shape), block)) for p in table}


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


def decode(target: str, fmt: Format, weight_name: str, tensors: Mapping, shape: tuple[int, ...],
           lead: tuple[int, ...] = ()):
    """Inverse of ``encode`` to the codec tensor (``None`` for BF16): ``decode_components`` then the scheme's
    ``from_components`` (a stack's ``lead`` dims: one codec tensor ``[*lead, N, K]``)."""
    scheme = scheme_for(fmt)
    if not scheme.format.quantized:
        return None
    comps = decode_components(target, fmt, weight_name, tensors, lead=lead)
    return scheme.from_components(comps, tuple(shape), tuple(lead))
