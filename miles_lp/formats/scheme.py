"""One scheme object per format: everything the rest of miles-lp needs to know about a format, in one place.

A ``FormatScheme`` owns, for its format: the operand quantizers the learner and the engines call (weight,
activation, backward operands; the codecs hold the bit rules), the decode with its kernel-or-torch choice, the
emulated GEMM's operand dtype, the tensors an engine checkpoint holds for one quantized weight (``parts``: names,
components, dtypes, shapes per target) and how a codec tensor is rebuilt from them, and the options a plan entry
or a recipe may set. ``miles_lp.formats.schemes.scheme_for(fmt)`` is the one registry; callers ask the scheme
instead of branching on ``Format`` members, so a new format is a codec, its scheme module in
``miles_lp.formats.schemes`` and one line in that package's ``_REGISTRY``. This module holds the protocol and
the types the scheme modules share.

``verify`` (``miles_lp.checkpoint``) deliberately keeps its own tables and float64 oracle: it is the independent
check of what the schemes write.

This module imports no torch (the policy and the CLI read scheme attributes without it); the scheme modules
import their codecs when a method runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from miles_lp.errors import ConfigError
from miles_lp.formats.spec import Format

TARGETS = ("sglang", "vllm", "compressed-tensors")


@dataclasses.dataclass(frozen=True)
class Part:
    """One on-disk tensor of a quantized module: its suffix (after ``<module>.``), the codec component it
    holds (``None`` = a constant), its safetensors dtype and how its shape derives from the weight's."""

    suffix: str
    component: str | None
    dtype: str
    # "data" [.., N, K], "packed" [.., N, K/2], "kblock" [.., N, K/scale_block], "tiles" [.., ceil(N/b),
    # ceil(K/b)] (b = scale_block), "scalar" [], "one" [1]
    shape: str
    transform: str = ""  # "reciprocal": stored value = 1 / component


def part_shape(kind: str, shape: tuple[int, ...], scale_block: int | None) -> tuple[int, ...]:
    """The shape of a part of rule ``kind`` for a weight of logical ``shape`` ``[..., N, K]``."""
    *lead, k = shape
    if kind == "tiles":
        return (*lead[:-1], -(-lead[-1] // scale_block), -(-k // scale_block))
    if kind == "kblock":
        return (*lead, k // scale_block)
    return {"data": tuple(shape), "packed": (*lead, k // 2), "scalar": (), "one": (1,)}[kind]


@runtime_checkable
class FormatScheme(Protocol):
    """What a format is to the learner, the converter, the export, the sync and the engines.

    Attributes: ``format``; ``scale_block`` (elements along K per block scale, None: no block scales);
    ``aligned`` (a quantized operand's K must be a multiple of ``scale_block``; False where partial edge tiles are
    part of the format); ``trainable`` (QuantLinear computes in it); ``quantized_backward_refusal`` (None, or why
    backward ``quantized`` is refused); ``activation_scopes`` (the activation global-scale scopes a recipe may
    choose, ``()`` if none); ``pow2_scales`` (its scales may be rounded to powers of two); ``weight_scale_2d``
    (2-D weight scale tiles are an option); ``joint_global_scale`` (fused siblings, gate and up, share one
    global scale); ``transposable_weight`` (the forward weight grid serves the transposed GEMM too: one tile
    for both); ``native_gemm`` (the learner has native GEMMs for it on some hardware, instead of the emulation);
    ``engine_activation_scales`` (the engine layer's accepted ``activation_scale`` values, ``()``: not
    validated); ``scaled_activations`` (the engine layer's ``activation_scale`` applies);
    ``vllm_emulation`` (the engine can mimic vLLM's CPU emulation kernels for it); ``modelopt_algo`` (ModelOpt's
    ``quant_algo``, None: not a ModelOpt format); ``megatron_recipe`` (Megatron-Core's TransformerConfig recipe
    keywords, None: none).
    """

    format: Format
    scale_block: int | None
    aligned: bool
    trainable: bool
    quantized_backward_refusal: str | None
    activation_scopes: tuple[str, ...]
    pow2_scales: bool
    weight_scale_2d: bool
    joint_global_scale: bool
    transposable_weight: bool
    native_gemm: bool
    engine_activation_scales: tuple[str, ...]
    scaled_activations: bool
    vllm_emulation: bool
    modelopt_algo: str | None
    megatron_recipe: dict[str, str] | None

    @property
    def in_checkpoints(self) -> bool:
        """Engine checkpoints can hold the format (it has on-disk parts for the targets)."""
        ...

    def ct_scheme(self) -> dict[str, Any]:
        """The compressed-tensors config group scheme (``weights``, ``input_activations``, ``format``), equal as
        ``QuantizationArgs`` to the package's own preset."""
        ...

    def stored_bytes(self, n: int, shape: tuple[int, ...]) -> float:
        """Bytes stored for a tensor of ``n`` elements and ``shape``: elements plus scales."""
        ...

    # ---- the codec -----------------------------------------------------------------------------------
    def quantize(self, x: Any, **opts: Any) -> Any:
        """The codec: ``x`` quantized with the codec's own options (``formats.quantize`` dispatches here)."""
        ...

    def weight_options(self, *, amax: Any = None, block_2d: bool = False, pow2_scales: bool = False,
                       compile: bool = False, name: str | None = None) -> dict[str, Any]:
        """``formats.quantize`` options for the forward (rowwise) grid of a weight ``[..., N, K]``: the grid the
        learner computes, the converter writes and the export sends (``amax``: a joint global amax)."""
        ...

    def quantize_weight(self, w: Any, **options: Any) -> Any:
        """``quantize(w, format, **weight_options(**options))`` of the detached ``w``."""
        ...

    def quantize_activation(self, x: Any, *, scope: str = "row", pow2_scales: bool = False) -> Any:
        """The forward grid of an input ``[M, K]`` (``scope``: NVFP4's activation global scale, per ``row``
        (token) or per ``tensor``)."""
        ...

    def quantize_grad(self, t: Any, axis: int, *, pow2_scales: bool = False, compile: bool = False) -> Any:
        """A backward operand of the ``quantized`` mode blocked along ``axis`` (-1 rowwise, -2 columnwise)."""
        ...

    def dequantize(self, q: Any, dtype: Any) -> Any:
        """``q.dequantize(dtype)``, through the CUDA kernels where they run (same bytes): the one place that
        chooses kernel or torch for a decode."""
        ...

    def dequantize_graph_safe(self, q: Any, dtype: Any) -> Any:
        """The codec's torch decode (``q.dequantize(dtype)``, the same ops: the same bytes, never the kernels),
        with nothing a CUDA graph capture refuses (no host->device copy per call)."""
        ...

    def use_compiled(self, kernel: str, x: Any) -> bool:
        """Whether the learner's compiled twins (``kernel``: ``auto`` | ``reference`` | ``compiled``) serve an
        operand like ``x``."""
        ...

    # ---- the emulated GEMM ----------------------------------------------------------------------------
    def bf16_exact(self, pow2_scales: bool = False) -> bool:
        """Whether every decoded value is exact in bf16 (a bf16 GEMM then computes what the format computes)."""
        ...

    def operand_dtype(self, device: Any, act_dtype: Any, *, pow2_scales: bool = False) -> Any:
        """The emulated GEMM's operand dtype: bf16 for bf16 activations (CUDA and CPU; fp32 accumulation either way)
        where the decode is exact in bf16, fp32 otherwise."""
        ...

    # ---- engine tensors ----------------------------------------------------------------------------------
    def parts(self, target: str) -> tuple[Part, ...]:
        """The on-disk tensors of one quantized weight for ``target`` (``()``: the weight as it is)."""
        ...

    def from_components(self, comps: dict[str, Any], shape: tuple[int, ...], lead: tuple[int, ...] = ()) -> Any:
        """The codec tensor of one weight (``lead``: a stack's leading dims) from its canonical components."""
        ...

    def kernel_state(self, q: Any, n: int, k: int, dtype: Any) -> dict[str, Any]:
        """What an engine derives from the canonical tensors at load (the serving kernels' state): the GEMM
        ``operand`` dequantized as the kernel reads the scales, and the kernel's scale copy where it keeps one."""
        ...

    def vllm_input(self, x: Any, dtype: Any, static_amax: Callable[[], Any]) -> Any:
        """The input as vLLM's CPU emulation kernel computes with it (``vllm_emulation`` only; ``static_amax()``:
        the layer's calibrated activation amax, asked only where the kernel uses one)."""
        ...


def check_target(target: str) -> str:
    if target not in TARGETS:
        raise ConfigError(f"unknown --target '{target}'; supported: {', '.join(TARGETS)}")
    return target
