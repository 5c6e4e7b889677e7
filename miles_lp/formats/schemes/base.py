"""What most schemes share: the generic emulated-GEMM operand dtype, the decode without a kernel, ``parts``
looked up in a per-target table, and the refusals of operations a format does not have."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from miles_lp.errors import ConfigError, FormatError
from miles_lp.formats.scheme import Part, check_target
from miles_lp.formats.spec import Format


class BaseScheme:
    """Defaults of a ``FormatScheme`` (``miles_lp.formats.scheme``); each format's module overrides what it has."""

    format: Format
    scale_block: int | None = None
    aligned: bool = False
    trainable: bool = False
    quantized_backward_refusal: str | None = None
    activation_scopes: tuple[str, ...] = ()
    pow2_scales: bool = False
    weight_scale_2d: bool = False
    joint_global_scale: bool = False
    transposable_weight: bool = False
    native_gemm: bool = False
    engine_activation_scales: tuple[str, ...] = ()
    scaled_activations: bool = False
    vllm_emulation: bool = False
    #: target -> the on-disk tensors of one weight
    _parts: dict[str, tuple[Part, ...]] = {}
    #: engine configs: ModelOpt's ``quant_algo`` (None: not a ModelOpt format), Megatron-Core's TransformerConfig
    #: recipe keywords (None: not a TE recipe)
    modelopt_algo: str | None = None
    megatron_recipe: dict[str, str] | None = None

    @property
    def in_checkpoints(self) -> bool:
        """Engine checkpoints can hold the format (it has on-disk parts for the targets)."""
        return bool(self._parts)

    def ct_scheme(self) -> dict[str, Any]:
        """The compressed-tensors config group scheme (``weights``, ``input_activations``, ``format``)."""
        raise FormatError(f"format {self.format.value} has no compressed-tensors scheme")

    def __repr__(self) -> str:
        return f"<scheme {self.format.value}>"

    def stored_bytes(self, n: int, shape: tuple[int, ...]) -> float:
        """Bytes stored for a tensor of ``n`` elements and ``shape``: elements plus scales. Every format's scheme
        defines it (``schemes/*.py``); a new scheme without it fails here, naming itself."""
        raise NotImplementedError(f"{type(self).__name__} ({self.format.value}) does not define stored_bytes")

    def weight_options(self, *, amax: Any = None, block_2d: bool = False, pow2_scales: bool = False,
                       compile: bool = False, name: str | None = None) -> dict[str, Any]:
        raise FormatError(f"'{name}': format {self.format.value} cannot be written to a checkpoint (mxfp8, nvfp4, "
                          "fp8_block)")

    def quantize(self, x: Any, **opts: Any) -> Any:
        """The codec: ``x`` quantized with the codec's own options (``formats.quantize`` dispatches here)."""
        raise FormatError(f"quantize: {self.format.value} has no codec")

    def quantize_weight(self, w: Any, **options: Any) -> Any:
        return self.quantize(w.detach(), **self.weight_options(**options))

    def quantize_activation(self, x: Any, *, scope: str = "row", pow2_scales: bool = False) -> Any:
        raise FormatError(f"format {self.format.value} has no activation grid")

    def quantize_grad(self, t: Any, axis: int, *, pow2_scales: bool = False, compile: bool = False) -> Any:
        raise FormatError(f"format {self.format.value} has no quantized backward operands "
                          f"({self.quantized_backward_refusal or 'not a trainable format'})")

    def dequantize(self, q: Any, dtype: Any) -> Any:
        return q.dequantize(dtype)

    def dequantize_graph_safe(self, q: Any, dtype: Any) -> Any:
        return q.dequantize(dtype)

    def use_compiled(self, kernel: str, x: Any) -> bool:
        return False

    def bf16_exact(self, pow2_scales: bool = False) -> bool:
        """Whether every decoded value is exact in bf16 (then a bf16 GEMM computes what the format computes)."""
        return True

    def operand_dtype(self, device: Any, act_dtype: Any, *, pow2_scales: bool = False) -> Any:
        import torch

        # the learner's rule (``train.gemm.gemm_operand_dtype``), on CPU as on CUDA: oneDNN / ATen's CPU BLAS multiply bf16
        # operands with fp32 accumulation (AVX512-BF16 / AMX), ~7x an fp32 GEMM on this model's shapes
        if not self.bf16_exact(pow2_scales):
            return torch.float32
        return torch.bfloat16 if act_dtype == torch.bfloat16 else torch.float32

    def parts(self, target: str) -> tuple[Part, ...]:
        check_target(target)
        got = self._parts.get(target)
        if got is None:
            raise ConfigError(f"format {self.format.value} cannot be written for target '{target}' (supported in "
                              "checkpoints: mxfp8, nvfp4, fp8_block)")
        return got

    def from_components(self, comps: dict[str, Any], shape: tuple[int, ...], lead: tuple[int, ...] = ()) -> Any:
        raise FormatError(f"format {self.format.value} has no codec tensor")

    def kernel_state(self, q: Any, n: int, k: int, dtype: Any) -> dict[str, Any]:
        return {"operand": self.dequantize(q, dtype)}

    def vllm_input(self, x: Any, dtype: Any, static_amax: Callable[[], Any]) -> Any:
        raise FormatError(f"format {self.format.value} has no vLLM emulation mode here")


def swizzled_kernel_state(scheme: BaseScheme, q: Any, n: int, k: int, dtype: Any) -> dict[str, Any]:
    """Block scales in the cuBLAS 128x4 layout (CONTRACT 3) and the operand dequantized from the data and the
    scales *read back from that layout* (what the kernel reads), for ``[..., N, K]`` (a stack: ``[L, N, K]``)."""
    import dataclasses

    from miles_lp.formats.swizzle import swizzle_scales, unswizzle_scales

    swizzled = swizzle_scales(q.scale)  # [..., ru(N,128), ru(K/block,4)]
    kernel_scale = unswizzle_scales(swizzled, n, k // scheme.scale_block)
    return {"scale_swizzled": swizzled, "operand": scheme.dequantize(dataclasses.replace(q, scale=kernel_scale), dtype)}
