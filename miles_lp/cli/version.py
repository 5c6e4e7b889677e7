"""``miles-lp version``: versions of miles-lp and of the backends it can use."""

from __future__ import annotations

import importlib.metadata
import platform

HELP = "print miles-lp's version and which optional backends are importable"
DESCRIPTION = HELP + """

Backends that are missing are not errors: every format has an exact PyTorch emulation, so miles-lp runs
on CPU. Being installed does not make a backend used; the recipe chooses: Transformer Engine with
`train.backend: megatron` + `train.megatron.impl: transformer_engine` (its MXFP8/NVFP4 GEMMs need Blackwell),
SGLang with `rollout.backend: sglang` (an SGLang server), vLLM with `rollout.backend: vllm` (its own
interpreter: the `vllm engine` line), Ray with `ray.enabled: true`; Triton runs the GPU kernels on CUDA.
FlashInfer is listed only to show what is installed: no code path imports it.

  miles-lp version
  miles-lp --version          # the version line only
"""

_PACKAGES = ["torch", "transformers", "safetensors", "ray", "triton", "transformer_engine", "megatron-core",
             "sglang", "flashinfer-python", "torchao", "compressed-tensors"]


def add_arguments(p) -> None:
    pass


def run(args) -> int:
    from miles_lp import __version__

    print(f"miles-lp {__version__}")
    print(f"  {'python':20s} {platform.python_version()}")
    for pkg in _PACKAGES:
        try:
            version = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        print(f"  {pkg:20s} {version}")
    from miles_lp.rollout.vllm import vllm_missing, vllm_python

    py = vllm_python()  # the vLLM CPU engine runs in its own venv (its torch pin differs from this one's)
    print(f"  {'vllm (engine venv)':20s} {py if py else vllm_missing()}")
    return 0
