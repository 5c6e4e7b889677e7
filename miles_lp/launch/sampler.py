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
from miles_lp.formats.schemes import scheme_for
from miles_lp.formats.spec import Format

ENGINE_FORMATS = {Format.BF16, Format.MXFP8}  # what the engine is loaded with; fp8 arms are served as BF16


def served_format(f: Format) -> Format:
    """The format the engine is loaded with for a sampler rule of format ``f``: ``f`` where the engine has it,
    else BF16 (the weights rounded to ``f``'s grid)."""
    return f if f in ENGINE_FORMATS else Format.BF16


def check_sampler_policy(policy, where: str = "sampler_precision") -> None:
    formats = {policy.default} | {r.format for r in policy.rules}
    for f in sorted(formats, key=lambda f: f.value):
        if scheme_for(f).joint_global_scale:
            raise ConfigError(f"{where}: an {f.value.upper()} sampler grid of its own is not supported (its joint "
                              "gate/up global scale must come from the learner); use the shared grid (drop "
                              "sampler_precision)")


def engine_policy(policy):
    """The policy the sampler's checkpoint is converted with: fp8 rules become bf16 (served as rounded BF16)."""
    from miles_lp.config import Where
    from miles_lp.policy import parse_policy

    d = policy.to_dict()
    d["default"] = served_format(policy.default).value
    rules = []
    for r, raw in zip(policy.rules, d["rules"], strict=True):
        raw = dict(raw, format=served_format(r.format).value)
        if not served_format(r.format).quantized:
            raw.pop("backward", None)
        rules.append(raw)
    d["rules"] = rules
    if not any(served_format(f).quantized for f in (policy.default, *(r.format for r in policy.rules))):
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
            if not fmt.quantized:
                yield name, t
            elif served_format(fmt) is fmt:
                yield name, quantize(t, fmt)
            else:
                yield name, quantize(t, fmt).dequantize(t.dtype)  # rounded to that grid, served as BF16


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
