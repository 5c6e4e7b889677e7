"""C6 sentinel: output sanity of the rollouts, fed by the RL loop once per step (seed 000).

Trips on: any non-finite rollout log-prob (an lm_head quantized on the sampler gave NaN logits with exit
code 0); ``rollout_corr/kl`` above ``kl_threshold`` (default 1: gross failures only; a stale expert layout
raised KL to just 0.047, inside the healthy range, which is why the mechanism checks C1-C5 exist); a clip
ratio at or above ``clip_ratio_threshold``, or every response ending at the length cap (unless the config says
the task's answers fill the cap: ``at_length_cap: expected``), for ``consecutive_steps`` steps in a row.

    sentinel = Sentinel(config.sentinel)
    verdict = sentinel.update(rollout_logprobs=lps, kl=metrics["rollout_corr/kl"], clip_ratio=...,
                              finish_reasons=[g.finish_reason for g in gens])
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from miles_lp.sync.config import SentinelConfig
from miles_lp.sync.verdict import Verdict, failed, ok, skipped


def rollout_kl(rollout_logprobs: Sequence[torch.Tensor], train_logprobs: Sequence[torch.Tensor]) -> float:
    """``rollout_corr/kl`` (CONTRACT 6): mean over sampled tokens of lp_rollout - lp_train (k1)."""
    num, den = 0.0, 0
    for r, t in zip(rollout_logprobs, train_logprobs, strict=True):
        r, t = r.double().reshape(-1), t.double().reshape(-1)
        num += float((r - t).sum())
        den += r.numel()
    return num / den if den else float("nan")


class Sentinel:
    """Stateful: remembers the last steps' clip ratio and length-cap verdicts."""

    def __init__(self, config: SentinelConfig | None = None):
        self.config = config or SentinelConfig()
        self._clip_streak = 0
        self._cap_streak = 0
        self.last: Verdict = skipped("sentinel", "no rollout step observed yet")
        self.steps = 0

    def state_dict(self) -> dict[str, int]:
        """The streaks and step count, so a resumed run trips exactly when an uninterrupted one would."""
        return {"clip_streak": self._clip_streak, "cap_streak": self._cap_streak, "steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._clip_streak = int(state.get("clip_streak", 0))
        self._cap_streak = int(state.get("cap_streak", 0))
        self.steps = int(state.get("steps", 0))

    def update(self, *, rollout_logprobs: Iterable[torch.Tensor] | None = None, kl: float | None = None,
               clip_ratio: float | None = None, finish_reasons: Sequence[str] | None = None) -> Verdict:
        cfg = self.config
        self.steps += 1
        nonfinite = 0
        seen = 0
        if rollout_logprobs is not None:
            for lp in rollout_logprobs:
                lp = torch.as_tensor(lp)
                seen += lp.numel()
                nonfinite += int((~torch.isfinite(lp)).sum())
        if clip_ratio is not None and math.isfinite(clip_ratio):
            self._clip_streak = self._clip_streak + 1 if clip_ratio >= cfg.clip_ratio_threshold else 0
        if finish_reasons:
            self._cap_streak = self._cap_streak + 1 if all(r == "length" for r in finish_reasons) else 0
        n = cfg.consecutive_steps
        if nonfinite:
            v = failed("sentinel", float(nonfinite), f"{nonfinite} of {seen} rollout log-probs are not finite "
                       "(NaN/inf logits: an lm_head or norm quantized on the sampler?)")
        elif kl is not None and not math.isfinite(kl):
            v = failed("sentinel", kl, "rollout_corr/kl is not finite")
        elif kl is not None and abs(kl) > cfg.kl_threshold:
            # two-sided: k1 = mean(lp_rollout - lp_train) is signed, and a sampler whose log-probs sit far BELOW
            # the learner's (another temperature, a shifted position) gives a large negative k1
            v = failed("sentinel", kl, f"|rollout_corr/kl| = {abs(kl):.4g} > {cfg.kl_threshold} (kl {kl:.4g})")
        elif self._clip_streak >= n:
            v = failed("sentinel", clip_ratio, f"clip ratio >= {cfg.clip_ratio_threshold} for {self._clip_streak} "
                       "steps in a row")
        elif self._cap_streak >= n and cfg.at_length_cap == "trip":
            v = failed("sentinel", float(self._cap_streak), f"every response hit the length cap for "
                       f"{self._cap_streak} steps in a row")
        elif rollout_logprobs is None and kl is None and clip_ratio is None and not finish_reasons:
            v = skipped("sentinel", "the step reported no rollout log-probs, kl, clip ratio or finish reasons")
        else:
            at_cap = f", all at the length cap {self._cap_streak} steps (expected)" if self._cap_streak else ""
            v = ok("sentinel", kl, f"{seen} log-probs finite" + (f", kl {kl:.3g}" if kl is not None else "") + at_cap)
        self.last = v
        return v
