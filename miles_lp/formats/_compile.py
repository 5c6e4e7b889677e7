"""``torch.compile`` with eager's fp32 numerics: the one place that names the Inductor options.

Used by ``quantize_mxfp8(compile=True)`` and by ``miles_lp.train.fused`` (the compiled QuantLinear path),
so that every compiled codec graph is built with the same options.

Triton lowers ``x / y`` to the approximate ``div.full.f32`` (eager: IEEE ``div.rn``) and may flush
subnormals to zero: ``eager_numerics.division_rounding`` / ``disable_ftz`` turn both off. MXFP8 has no
division, but its inverse scale for E8M0 byte 254 is 2^-127, an fp32 subnormal (``bits.e8m0_inverse``),
and its decode of byte 0 is 2^-127 too; NVFP4 divides (``2688 / amax``, ``1 / (sf * S_dec)``), and on the
H200 (torch 2.11, 2026-11-29) its compiled bytes differed from eager without these options.
"""

from __future__ import annotations

_OPTIONS = ("division_rounding", "disable_ftz")


def exact_inductor_options() -> dict[str, bool]:
    """Inductor options that keep eager's fp32 numerics (IEEE division, no flush-to-zero), where this torch
    has them (older builds have no ``eager_numerics``: then ``{}``)."""
    from torch._inductor import config as inductor_config

    numerics = getattr(inductor_config, "eager_numerics", None)
    return {f"eager_numerics.{k}": True for k in _OPTIONS if numerics is not None and hasattr(numerics, k)}


def exact_division_available() -> bool:
    """Whether this torch's Inductor can compile fp32 division with IEEE rounding (NVFP4 on CUDA needs it)."""
    return "eager_numerics.division_rounding" in exact_inductor_options()


def compile_exact(fn):
    """``torch.compile(fn)`` with ``exact_inductor_options()``."""
    import torch

    return torch.compile(fn, options=exact_inductor_options() or None)
