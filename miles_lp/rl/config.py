"""The recipe's ``rl:`` section: the GRPO knobs verl and Miles users expect, under their names.

    rl:
      prompts_per_step: 16        # prompts sampled per step
      group_size: 8               # samples per prompt (the GRPO group)
      mini_batches: 2             # optimizer steps per RL step (the old-policy ratio matters from the 2nd)
      clip_low: 0.2               # PPO clip: ratio in [1 - clip_low, 1 + clip_high]
      clip_high: 0.28             # DAPO clip-higher
      clip_ratio_c: null          # dual clip for negative advantages (verl's clip_ratio_c, e.g. 3.0)
      loss_agg: token-mean        # token-mean | seq-mean-token-mean | seq-mean-token-sum
      norm_adv_by_std: true       # false = Dr. GRPO (advantage = reward - group mean)
      kl_coef: 0.0                # KL to the frozen BF16 reference; 0 skips the reference pass
      kl_estimator: k3            # k1 | k2 | k3 (verl's kl / mse / low_var_kl)
      entropy_coef: 0.0
      dynamic_sampling: false     # DAPO: drop groups whose rewards are all equal
      overlong: {enable: false, buffer_len: 4, penalty_factor: 1.0}   # DAPO soft overlong punishment
      routing_replay: false       # Miles R3: the learner replays the engine's routed experts (MoE)
      abort_retries: 1            # a group holding a generation the engine aborted is regenerated up to this
                                  #   many times, then dropped (rollout/aborted*; docs/rl.md)
      rollout_correction:         # verl's algorithm.rollout_correction, same names and semantics
        rollout_is: null          # null | token | sequence
        rollout_is_threshold: 2.0 # a number: TIS (truncate); "0.5_2.0": IcePop-style mask outside [lo, hi]
        rollout_rs: null          # e.g. token_k1, seq_sum_k1, seq_mean_k3; comma-separated = all must pass
        rollout_rs_threshold: null
        bypass_mode: false        # old log-probs := rollout log-probs (skips the old_log_prob pass)
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from miles_lp.config import Where

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]

#: verl's rejection options (``rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS`` minus ``binary_kl``).
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def parse_is_threshold(spec: float | str, where: Where) -> tuple[float, float | None]:
    """verl's ``rollout_is_threshold``: a number = TIS upper bound; ``"lo_hi"`` = IcePop bounds."""
    if isinstance(spec, int | float) and not isinstance(spec, bool):
        upper, lower = float(spec), None
    elif isinstance(spec, str) and spec.strip():
        text = spec.strip()
        try:
            if "_" in text:
                lo, hi = text.split("_", 1)
                lower, upper = float(lo), float(hi)
            else:
                upper, lower = float(text), None
        except ValueError:
            raise where.error(f"expected a number (TIS) or 'lower_upper' (IcePop, e.g. '0.5_2.0'), got {spec!r}") \
                from None
    else:
        raise where.error(f"expected a number (TIS) or 'lower_upper' (IcePop, e.g. '0.5_2.0'), got {spec!r}")
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise where.error(f"bounds must satisfy 0 < lower <= upper, got {spec!r}")
    return upper, lower


def parse_rs_thresholds(options: list[str], spec: float | str | None, where: Where
                        ) -> dict[str, tuple[float | None, float]]:
    """verl's ``rollout_rs_threshold``: one entry per option (or one shared); ``*_k1`` takes ``lo_hi`` ratio
    bounds (a single number u means ``1/u_u``), the others a single upper bound. Returns {option: (lo, hi)}."""
    if spec is None:
        raise where.error(f"rollout_rs {','.join(options)} needs rollout_rs_threshold (e.g. 2.0, or '0.5_1.5' "
                          "for a *_k1 option)")
    raw = [str(spec)] if isinstance(spec, int | float) else [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(raw) not in (1, len(options)):
        raise where.error(f"give one threshold shared by all options or {len(options)} (one per option), "
                          f"got {len(raw)}")
    raw = raw * len(options) if len(raw) == 1 else raw
    out: dict[str, tuple[float | None, float]] = {}
    for opt, text in zip(options, raw, strict=True):
        try:
            if opt.endswith("k1"):
                lo, hi = (text.split("_", 1) if "_" in text else (str(1.0 / float(text)), text))
                lo_f, hi_f = float(lo), float(hi)
                if not (lo_f > 0 and hi_f > 0):
                    raise ValueError
                out[opt] = (lo_f, hi_f)
            else:
                if "_" in text:
                    raise TypeError  # reported below: a k2/k3 option has no lower bound
                hi_f = float(text)
                if not hi_f > 0:
                    raise ValueError
                out[opt] = (None, hi_f)
        except TypeError:
            raise where.error(f"option {opt} takes a single upper bound, got '{text}'") from None
        except ValueError:
            raise where.error(f"bad threshold '{text}' for {opt}: positive numbers, 'lo_hi' for *_k1") from None
    return out


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
    """verl ``algorithm.rollout_correction`` (CONTRACT 10)."""

    rollout_is: Literal["token", "sequence"] | None = None
    rollout_is_threshold: float | str = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None
    bypass_mode: bool = False

    def _validate(self, where: Where) -> None:
        parse_is_threshold(self.rollout_is_threshold, where.child("rollout_is_threshold"))
        if self.rollout_rs is not None:
            parse_rs_thresholds(self.rs_options(where), self.rollout_rs_threshold, where.child("rollout_rs_threshold"))
        if self.bypass_mode and self.rollout_is is not None:
            raise where.child("rollout_is").error(
                "bypass_mode uses the PPO ratio to the rollout policy itself as the importance weight; "
                "set rollout_is: null")
        if self.bypass_mode and self.rollout_rs is not None:
            raise where.child("rollout_rs").error(
                "rollout_rs with bypass_mode is not supported here yet: verl rejects against the CURRENT policy "
                "inside the loss in bypass mode, this loop rejects against the old-log-prob pass, which bypass "
                "skips; set rollout_rs: null or bypass_mode: false")

    def rs_options(self, where: Where | None = None) -> list[str]:
        if self.rollout_rs is None:
            return []
        opts: list[str] = []
        for o in (p.strip() for p in self.rollout_rs.split(",")):
            if not o:
                continue
            if o not in RS_OPTIONS:
                from miles_lp.config import suggest

                msg = f"unknown rollout_rs option '{o}'{suggest(o, RS_OPTIONS)}; options: {', '.join(RS_OPTIONS)}"
                raise (where.child("rollout_rs").error(msg) if where else ValueError(msg))
            if o not in opts:
                opts.append(o)
        if not opts:
            raise (where or Where("<rl>")).child("rollout_rs").error("empty rollout_rs; use null to disable")
        return opts

    @property
    def is_bounds(self) -> tuple[float, float | None]:
        return parse_is_threshold(self.rollout_is_threshold, Where("<rl>", "rollout_is_threshold"))

    @property
    def rs_bounds(self) -> dict[str, tuple[float | None, float]]:
        return parse_rs_thresholds(self.rs_options(), self.rollout_rs_threshold, Where("<rl>", "rollout_rs_threshold"))


@dataclasses.dataclass(frozen=True)
class Overlong:
    """DAPO's soft overlong punishment over the last ``buffer_len`` tokens before the length cap."""

    enable: bool = False
    buffer_len: int = 4
    penalty_factor: float = 1.0

    def _validate(self, where: Where) -> None:
        if self.buffer_len < 1:
            raise where.child("buffer_len").error(f"must be >= 1, got {self.buffer_len}")
        if self.penalty_factor < 0:
            raise where.child("penalty_factor").error(f"must be >= 0, got {self.penalty_factor}")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    prompts_per_step: int = 8
    group_size: int = 8
    mini_batches: int = 1
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float | None = None
    loss_agg: LossAgg = "token-mean"
    norm_adv_by_std: bool = True
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0
    dynamic_sampling: bool = False
    overlong: Overlong = dataclasses.field(default_factory=Overlong)
    routing_replay: bool = False
    abort_retries: int = 1
    rollout_correction: RolloutCorrection = dataclasses.field(default_factory=RolloutCorrection)

    def _validate(self, where: Where) -> None:
        for key in ("prompts_per_step", "group_size", "mini_batches"):
            if getattr(self, key) < 1:
                raise where.child(key).error(f"must be >= 1, got {getattr(self, key)}")
        if self.group_size < 2:
            raise where.child("group_size").error(
                "GRPO normalises rewards within a group: group_size must be >= 2 (a group of 1 has no baseline)")
        n = self.prompts_per_step * self.group_size
        if n % self.mini_batches:
            raise where.child("mini_batches").error(
                f"prompts_per_step * group_size = {n} samples must split evenly into {self.mini_batches} "
                "mini-batches")
        if not 0 <= self.clip_low < 1:
            raise where.child("clip_low").error(f"must be in [0, 1), got {self.clip_low}")
        if not self.clip_high >= 0:
            raise where.child("clip_high").error(f"must be >= 0, got {self.clip_high}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise where.child("clip_ratio_c").error(f"dual-clip constant must be > 1 (verl: 3.0), got "
                                                    f"{self.clip_ratio_c}")
        if self.abort_retries < 0:
            raise where.child("abort_retries").error(f"must be >= 0 (0: drop aborted groups at once), got "
                                                     f"{self.abort_retries}")
        for key in ("kl_coef", "entropy_coef"):
            if getattr(self, key) < 0:
                raise where.child(key).error(f"must be >= 0, got {getattr(self, key)}")
