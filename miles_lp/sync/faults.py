"""Fault injection from outside the library's code paths, for ``miles-lp selftest sync`` and the tests.

Each fault is a wrapper around one side of a sync (a transport, the learner, the engine), never a branch in
the sync itself. The engine-internal faults (stale derived layout, a re-bound parameter, lm_head quantized)
are the reference engine's own ``EngineFaults`` hooks; the sampler-policy faults (a router rule matching
gate/up by substring, first/last BF16 layers disagreeing) are a checkpoint converted with a modified policy.

* ``DropLastBucket``: a transport that loses the last bucket (a partial sync).
* ``SkipScaleBytes``: a transport that delivers the scales' names but never writes their bytes (what
  ``torch.empty`` staging hid: the 0xFF fill makes them NaN and C5 counts them); ``pattern`` picks which.
* ``RegridEngine``: an engine that re-quantizes what it receives on its own grid: the dequantized weights
  through 128x128 FP32-scale FP8 blocks (``"block128"``) or MXFP8 with floor scales (``"floor"``,
  microxcaling's rule) instead of the learner's (a sampler that quantizes BF16 itself; seed 000: 2x KL).
* ``SplitScalesLearner``: a learner whose NVFP4 gate and up carry separate global scales.
* ``DyingEngine``: an engine whose process dies at the n-th bucket.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from miles_lp.formats import (
    MXFP8Tensor,
    dequantize_fp8_blockwise,
    quantize_fp8_blockwise,
    quantize_mxfp8,
)
from miles_lp.formats.schemes import scheme_for
from miles_lp.formats.spec import MXFP8_BLOCK
from miles_lp.rollout.engine import EngineError
from miles_lp.sync.buckets import Bucket
from miles_lp.sync.transport import Received, Transport


class _Delegate:
    """Forwards everything it does not override to the wrapped object."""

    def __init__(self, inner: Any):
        object.__setattr__(self, "inner", inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class DropLastBucket(_Delegate):
    def __init__(self, inner: Transport):
        super().__init__(inner)
        self.name = f"{inner.name}+drop_last"

    def send(self, bucket: Bucket) -> Received:
        return [] if bucket.last else self.inner.send(bucket)


class SkipScaleBytes(_Delegate):
    """Delivers every name but leaves the bytes of the scales matching ``pattern`` (fnmatch) unwritten: the
    expert-scale staging verl found left as ``torch.empty``."""

    def __init__(self, inner: Transport, pattern: str = "*"):
        super().__init__(inner)
        self.name = f"{inner.name}+skip_scales"
        self.pattern = pattern

    def send(self, bucket: Bucket) -> Received:
        import fnmatch

        scales = {s.name for s in bucket.slots if s.is_scale and fnmatch.fnmatchcase(s.name, self.pattern)}
        stripped = Bucket(bucket.index, bucket.slots, {n: t for n, t in bucket.payload.items() if n not in scales},
                          bucket.nbytes, bucket.groups, bucket.last)
        return self.inner.send(stripped)


def mxfp8_floor(x: torch.Tensor) -> MXFP8Tensor:
    """MXFP8 with microxcaling's scale rule, floor(log2(amax)) - 8 (not TE's round-up; CONTRACT 1)."""
    xf = x.float()
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // MXFP8_BLOCK, MXFP8_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-38))) - 8, torch.full_like(amax, -127))
    e = e.clamp(-127, 127)
    q = (blocks * torch.exp2(-e)).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(xf.shape)
    return MXFP8Tensor(q, (e[..., 0] + 127).to(torch.uint8))


class RegridEngine(_Delegate):
    """Re-quantizes every MXFP8 weight it receives on its own grid (``mode``: ``"block128"`` | ``"floor"``), or
    every FP8 blockwise one with power-of-two block scales (``"pow2"``: a sampler whose quantizer rounds its scales,
    TE's ``force_pow_2_scales``, fed a learner that keeps fp32 ones)."""

    def __init__(self, inner: Any, mode: str = "block128", scale_suffix: str = "weight_scale_inv"):
        if mode not in ("block128", "floor", "pow2"):
            raise ValueError(f"RegridEngine mode must be 'block128', 'floor' or 'pow2', got {mode!r}")
        super().__init__(inner)
        self.mode, self.scale_suffix = mode, scale_suffix

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def _regrid(self, data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mode == "pow2":  # scale: FP8 blockwise fp32 decode multipliers per 128x128 block
            w = dequantize_fp8_blockwise(data, scale, block=(128, 128), dtype=torch.float32)
            b = quantize_fp8_blockwise(w, block=(128, 128), pow2_scales=True)
            return b.data, b.scale_inv
        w = MXFP8Tensor(data, scale).dequantize(torch.float32)
        if self.mode == "block128":
            b = quantize_fp8_blockwise(w, block=(128, 128))
            q = quantize_mxfp8(dequantize_fp8_blockwise(b.data, b.scale_inv, block=(128, 128),
                                                        dtype=torch.bfloat16))
        else:
            q = mxfp8_floor(w)
        return q.data, q.scale

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        bucket = dict(named_tensors)
        for name, t in list(bucket.items()):
            if t.dtype == torch.float8_e4m3fn and name.endswith(".weight"):
                sname = name[: -len("weight")] + self.scale_suffix
                if sname in bucket:
                    bucket[name], bucket[sname] = self._regrid(t, bucket[sname])
        self.inner.update_weights(list(bucket.items()))


class SplitScalesLearner(_Delegate):
    """Exports each NVFP4 member of a joint-scale group (gate + up) with its own global scale."""

    def __init__(self, inner: Any):
        super().__init__(inner)
        plan = inner.plan
        schemes = {m: scheme_for(plan.entries[m].format) for g in plan.groups.values() for m in g}
        self.members = {m: sc for m, sc in schemes.items() if sc.joint_global_scale}

    def export_weights(self) -> Iterator[tuple[str, Any]]:
        for name, obj in self.inner.export_weights():
            scheme = self.members.get(name)
            if scheme is not None:  # the same codec options, the global scale from this member alone
                obj = scheme.quantize(obj.dequantize(torch.float32), scale_scope=obj.scale_scope,
                                      block_2d=obj.block_2d)
            yield name, obj


class DyingEngine(_Delegate):
    """The engine process dies when it receives bucket ``at`` (0-based): every later call fails too."""

    def __init__(self, inner: Any, at: int = 1):
        super().__init__(inner)
        self.at, self.calls, self.dead = at, 0, False

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def update_weights(self, named_tensors) -> None:
        if self.dead or self.calls == self.at:
            self.dead = True
            raise EngineError("engine process exited (connection reset by peer)")
        self.calls += 1
        self.inner.update_weights(named_tensors)

    def finish_weight_update(self, *a, **kw):
        if self.dead:
            raise EngineError("engine process exited")
        return self.inner.finish_weight_update(*a, **kw)
