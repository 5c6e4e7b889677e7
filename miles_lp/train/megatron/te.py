"""Path (b): Megatron-Core with Transformer Engine's own MXFP8/NVFP4 layers (Blackwell + TE only).

Kept thin on purpose: it cannot run on this project's machines (no Blackwell, no TE). It builds what TE
needs from the plan, and nothing else:

* ``TransformerConfig`` keyword arguments (``megatron_kwargs(plan)``: ``fp8="e4m3", fp8_recipe="mxfp8"`` or
  ``fp4="e2m1", fp4_recipe="nvfp4"``, first/last layers in BF16) plus ``transformer_impl``;
* the process environment (``te_env(plan)``: ``NVTE_BACKWARD_OVERRIDE``,
  ``NVTE_NVFP4_ROW_SCALED_ACTIVATION``), which TE reads globally, so it is set before the model is built;
* ``te_learner_weights``: the forward grid through TE's own quantizer (``MXFP8Quantizer``), compact scales.

TE applies one recipe to every linear inside a low-precision layer, so a plan with per-module exceptions
(``megatron_overrides(plan)`` non-empty, e.g. NVFP4 experts next to BF16 attention) is refused here; the
local path (``miles_lp.train.megatron.layers``) runs such plans.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

from miles_lp.errors import BackendUnavailable, ConfigError


@dataclasses.dataclass(frozen=True)
class TEConfig:
    kwargs: dict[str, Any]  # TransformerConfig keyword arguments
    env: dict[str, str]  # process environment TE reads


def te_config(plan) -> TEConfig:
    """The TE configuration that runs ``plan`` exactly, or ``ConfigError`` if TE cannot express it."""
    from miles_lp.policy.emit import megatron_kwargs, megatron_overrides, te_env

    overrides = megatron_overrides(plan)
    if overrides:
        sample = ", ".join(f"{n} -> {f.value}" for n, f in list(overrides.items())[:4])
        raise ConfigError(f"the Transformer Engine path runs one recipe per low-precision layer; this plan has "
                          f"{len(overrides)} per-module exception(s) ({sample}). Use megatron.impl: local "
                          "(miles-lp QuantLinear in Megatron) for this plan")
    kwargs = dict(megatron_kwargs(plan, strict=True))
    kwargs["transformer_impl"] = "transformer_engine"
    return TEConfig(kwargs, dict(te_env(plan)))


def te_available() -> str | None:
    """``None`` if TE is importable on a Blackwell GPU, else why not."""
    try:
        import torch
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as exc:
        return f"transformer_engine is not importable ({exc})"
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, _ = torch.cuda.get_device_capability()
    if major < 10:
        return f"TE's MXFP8/NVFP4 recipes need Blackwell (sm_100+); this GPU is sm_{major}x"
    return None


@contextlib.contextmanager
def te_environment(cfg: TEConfig) -> Iterator[None]:
    """Set ``cfg.env`` for the duration (build and run the model inside); refuse conflicting values."""
    for key, value in cfg.env.items():
        if key in os.environ and os.environ[key] != value:
            raise ConfigError(f"environment variable {key}={os.environ[key]!r} conflicts with the plan's {value!r}; "
                              "unset it (the plan decides)")
    saved = {k: os.environ.get(k) for k in cfg.env}
    os.environ.update(cfg.env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def te_quantize_mxfp8(weight):
    """A weight's rowwise MXFP8 grid from TE's ``MXFP8Quantizer``, as a ``miles_lp.formats.MXFP8Tensor``.

    TE pads its rowwise scale to the GEMM tiling (128 x 4); the compact ``[N, K/32]`` part is kept.
    """
    reason = te_available()
    if reason is not None:
        raise BackendUnavailable(f"TE quantizer unavailable: {reason}")
    import torch
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

    from miles_lp.formats import MXFP8Tensor

    q = MXFP8Quantizer(fp8_dtype=tex.DType.kFloat8E4M3, rowwise=True, columnwise=False)(weight.detach())
    n, k = weight.shape
    data = q._rowwise_data.view(torch.float8_e4m3fn).reshape(n, k)
    scale = q._rowwise_scale_inv.view(torch.uint8)[:n, : k // 32].contiguous()
    return MXFP8Tensor(data=data, scale=scale, axis=-1)


def te_learner_weights(model, layout) -> Iterator[tuple[str, Any]]:
    """``(canonical name, MXFP8Tensor)`` for the TE linears of an MXFP8 model (tp=1), via TE's quantizer.

    Fused weights are split into their members as in the local path (q/k/v de-interleaved, fc1 = gate; up).
    """
    from miles_lp.train.megatron.layers import qkv_rows
    from miles_lp.train.operands import select_rows

    for name, p in model.named_parameters():
        if p.dim() != 2 or not ("linear_qkv" in name or "linear_proj" in name or "linear_fc" in name):
            continue
        members = layout.describe(name).members
        q = te_quantize_mxfp8(p)
        if len(members) == 3:
            for m, rows in qkv_rows(model.config, members):
                yield m, select_rows(q, rows)
        elif len(members) == 2:
            half = p.shape[0] // 2
            yield members[0], select_rows(q, slice(0, half))
            yield members[1], select_rows(q, slice(half, 2 * half))
        else:
            yield members[0], q
