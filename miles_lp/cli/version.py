"""``miles-lp version``: versions of miles-lp and of the backends it can use."""

from __future__ import annotations

import importlib.metadata
import platform

HELP = "print miles-lp's version and which optional backends are importable"
DESCRIPTION = HELP + """

Backends that are missing are not errors: every format has an exact PyTorch emulation, so miles-lp runs
on CPU. Native backends (Transformer Engine, SGLang, FlashInfer) are used when present.

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
