"""``miles-lp version``: versions of miles-lp and of the backends it can use."""

from __future__ import annotations

import importlib.metadata

HELP = "print miles-lp's version and which optional backends are importable"
DESCRIPTION = HELP + (
    "\n\nBackends that are missing are not errors: every format has an exact PyTorch emulation, "
    "so miles-lp runs on CPU. Native backends (Transformer Engine, SGLang, FlashInfer) are used when present."
)

_PACKAGES = ["torch", "transformers", "safetensors", "ray", "triton", "transformer_engine", "megatron-core",
             "sglang", "flashinfer-python", "torchao", "compressed-tensors"]


def add_arguments(p) -> None:
    pass


def run(args) -> int:
    from miles_lp import __version__

    print(f"miles-lp {__version__}")
    for pkg in _PACKAGES:
        try:
            version = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        print(f"  {pkg:20s} {version}")
    return 0
