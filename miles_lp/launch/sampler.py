"""Comparison arms: a sampler that does NOT share the learner's grid (recipe section ``sampler_precision:``).

The default (no ``sampler_precision``) is the shared grid: the engine receives the learner's own forward grid.
With ``sampler_precision`` the engine receives the learner's master weights re-quantized by the sampler's
own policy, as a stack without grid sharing does (seed 000's "BF16 sampler" and "different grid" arms):

- ``bf16``: the BF16 master weights (an MXFP8 learner with a BF16 sampler);
- ``mxfp8``: the sampler's own MXFP8 quantization of the BF16 master copy (a partially matched sampler when
  its rules differ from the learner's, e.g. gate_up left BF16);
- ``fp8_tensor`` / ``fp8_block``: the reference engine has no FP8 tensorwise / blockwise kernel, so the weights
  are rounded to that grid (quantize -> dequantize) and served as BF16: the weight grid of a W8A16 sampler,
  without its activation quantization. Say so when reporting these arms.

NVFP4 sampler-only grids are refused (the joint gate/up global scale is the learner's business).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from miles_lp.errors import ConfigError
from miles_lp.formats.spec import Format

ENGINE_FORMATS = {Format.BF16, Format.MXFP8}  # what the engine is loaded with; fp8 arms are served as BF16


def check_sampler_policy(policy, where: str = "sampler_precision") -> None:
    formats = {policy.default} | {r.format for r in policy.rules}
    if Format.NVFP4 in formats:
        raise ConfigError(f"{where}: an NVFP4 sampler grid of its own is not supported (its joint gate/up global "
                          "scale must come from the learner); use the shared grid (drop sampler_precision)")


def engine_policy(policy):
    """The policy the sampler's checkpoint is converted with: fp8 rules become bf16 (served as rounded BF16)."""
    from miles_lp.config import Where
    from miles_lp.policy import parse_policy

    def fmt(f: Format) -> str:
        return "bf16" if f in (Format.FP8_TENSOR, Format.FP8_BLOCK) else f.value
    d = policy.to_dict()
    d["default"] = fmt(policy.default)
    rules = []
    for r, raw in zip(policy.rules, d["rules"], strict=True):
        raw = dict(raw, format=fmt(r.format))
        if raw["format"] == "bf16":
            raw.pop("backward", None)
        rules.append(raw)
    d["rules"] = rules
    if all(x["format"] == "bf16" for x in rules) and d["default"] == "bf16":
        return None
    return parse_policy(d, Where("<sampler_precision>", "sampler_precision"))


class SamplerView:
    """The learner as a sampler on another grid sees it: ``export_weights`` re-quantizes the master weights
    with ``plan`` (the sampler's plan); everything else is the learner's."""

    def __init__(self, learner, plan, engine_plan):
        self.learner, self.plan, self.engine_plan = learner, plan, engine_plan

    def __getattr__(self, name: str) -> Any:
        return getattr(self.learner, name)

    def executed_quantized(self):
        return self.learner.executed_quantized()  # the truth: a layer audit flags the deliberate mismatch

    def export_weights(self) -> Iterator[tuple[str, Any]]:
        from miles_lp.formats import quantize
        from miles_lp.train.hf_export import hf_named_tensors

        lr = self.learner
        src = lr.source
        for name, t in hf_named_tensors(lr.model, lr.layout, {}, dtypes=src.dtypes, default_dtype=src.default_dtype,
                                        names=src.names):
            fmt = self.plan.format_for(name) if self.plan is not None and name in self.plan.entries else Format.BF16
            if fmt is Format.MXFP8:
                yield name, quantize(t, fmt)
            elif fmt in (Format.FP8_TENSOR, Format.FP8_BLOCK):
                yield name, quantize(t, fmt).dequantize(t.dtype)  # rounded to that grid, served as BF16
            else:
                yield name, t


class SyncVia:
    """A ``WeightSync`` whose every sync reads the ``SamplerView`` instead of the learner itself."""

    def __init__(self, sync, view: SamplerView):
        self.inner, self.view = sync, view

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def sync(self, learner, **kw):
        return self.inner.sync(self.view, **kw)

    def initial_sync(self, learner):
        return self.inner.initial_sync(self.view)
