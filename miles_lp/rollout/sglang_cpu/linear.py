"""The linear layers of SGLang's model as the checks see them: which ones serve in low precision (C1) and what a
high-precision GEMM on their dequantized weights gives (C3's reference)."""

from __future__ import annotations

import torch


def live_format(module: torch.nn.Module) -> str | None:
    """The low-precision format ``module`` serves in, read from its live quant method: None for a module that is
    not a linear layer or that SGLang serves unquantized."""
    qm = getattr(module, "quant_method", None)
    if qm is None or not hasattr(module, "weight") or type(qm).__name__ == "UnquantizedLinearMethod":
        return None
    if not hasattr(qm, "apply") or type(module).__name__.endswith(("Embedding", "ParallelLMHead")):
        return None
    return getattr(qm, "miles_lp_format", None) or type(qm).__name__


def reference_output(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x @ W^T (+ bias)`` in float64 on the module's weights dequantized (``dequantized_weight``)."""
    w = getattr(module.quant_method, "dequantized_weight", None)
    if w is None:
        raise NotImplementedError(f"{type(module.quant_method).__name__} has no dequantized_weight(layer)")
    y = x.double() @ w(module).double().t()
    bias = getattr(module, "bias", None)
    return y + bias.double() if bias is not None else y
