"""The recipe's ``sync:`` section: buckets, transport, and the mode of each check.

    sync:
      bucket_mb: 512            # Miles' / slime's default (--update-weight-buffer-size)
      transport: inprocess      # inprocess | ray | cuda_ipc | nccl | gloo (nccl / gloo: ray.enabled, own actors)
      full_compare: initial     # C2 full byte compare: off | initial (first sync) | always
      c2_learner_side: export   # the per-sync C2 digest's learner side: export | fused (see SyncConfig)
      self_check_tolerance: 0.25
      probe_tokens: 0           # > 0: a short generation after each sync feeds the sentinel (C6)
      checks:                   # warn | raise | off, per check
        layer_audit: warn       # C1
        grid: warn              # C2
        self_check: warn        # C3
        storage: warn           # C4
        completeness: warn      # C5
        sentinel: warn          # C6
      sentinel: {kl_threshold: 1.0, clip_ratio_threshold: 0.99, consecutive_steps: 2}

Checks warn by default (as verl #8327); ``raise`` stops the sync with ``SyncCheckError``. The environment
overrides the recipe, one check at a time (``MILES_LP_SYNC_CHECK_SELF_CHECK=raise``) or all at once
(``MILES_LP_SYNC_CHECKS=raise``; a per-check variable wins). ``SyncConfig.with_env(os.environ)`` applies them
once, when the sync is built, so nothing reads the environment in the middle of a run. C7 (observability)
is not a switch: every check always reports a verdict, or why it did not run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from miles_lp.config import Where, parse_dataclass
from miles_lp.errors import ConfigError

Mode = Literal["warn", "raise", "off"]
MODES = ("warn", "raise", "off")

#: check name -> the condition of CONTRACT 5 it tests (names are the metric keys ``sync/check/<name>``)
CHECKS: dict[str, str] = {
    "layer_audit": "C1",
    "grid": "C2",
    "self_check": "C3",
    "storage": "C4",
    "completeness": "C5",
    "version": "C5",
    "sentinel": "C6",
}

ENV_ALL = "MILES_LP_SYNC_CHECKS"
ENV_PREFIX = "MILES_LP_SYNC_CHECK_"


def env_name(check: str) -> str:
    return ENV_PREFIX + check.upper()


@dataclasses.dataclass(frozen=True)
class ChecksConfig:
    """One mode per check. YAML 1.1 reads an unquoted ``off`` as ``false``: that is read as ``off``."""

    layer_audit: bool | Mode = "warn"
    grid: bool | Mode = "warn"
    self_check: bool | Mode = "warn"
    storage: bool | Mode = "warn"
    completeness: bool | Mode = "warn"
    version: bool | Mode = "warn"
    sentinel: bool | Mode = "warn"

    def _validate(self, where: Where) -> None:
        for name in CHECKS:
            if getattr(self, name) is True:
                raise where.child(name).error("must be one of 'warn', 'raise', 'off', got true")

    def get(self, name: str) -> Mode:
        v = getattr(self, name)
        return "off" if v is False else v


@dataclasses.dataclass(frozen=True)
class SentinelConfig:
    """C6 thresholds (seed 000): non-finite rollout log-probs always trip; ``|rollout_corr/kl|`` above
    ``kl_threshold`` trips (two-sided: k1 is signed); a clip ratio >= ``clip_ratio_threshold`` or every response at
    the length cap trips after ``consecutive_steps`` steps in a row.

    ``at_length_cap``: ``trip`` (default) treats "every response ended at ``max_response_len``" as a fault (a
    sampler that never emits EOS); ``expected`` is for a task whose answers are meant to fill the cap (the tiny
    ``copy`` recipes: a 2-token answer under a 3-token cap, so an untrained policy that has not learnt EOS yet ends
    every response there). With ``expected`` that rule is reported but never trips; the others still do."""

    kl_threshold: float = 1.0
    clip_ratio_threshold: float = 0.99
    consecutive_steps: int = 2
    at_length_cap: Literal["trip", "expected"] = "trip"

    def _validate(self, where: Where) -> None:
        if not self.kl_threshold > 0:
            raise where.child("kl_threshold").error(f"must be > 0, got {self.kl_threshold}")
        if not 0 < self.clip_ratio_threshold <= 1:
            raise where.child("clip_ratio_threshold").error(f"must be in (0, 1], got {self.clip_ratio_threshold}")
        if self.consecutive_steps < 1:
            raise where.child("consecutive_steps").error(f"must be >= 1, got {self.consecutive_steps}")


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    bucket_mb: float = 512.0
    transport: Literal["inprocess", "ray", "cuda_ipc", "nccl", "gloo"] = "inprocess"
    checks: ChecksConfig = dataclasses.field(default_factory=ChecksConfig)
    full_compare: Literal["off", "initial", "always"] = "initial"
    # The learner side of the per-sync C2 digest. ``export``: computed from the export's own tensors (one more read
    # of the bytes sent, ~0.3 ms per GB on an H200), so a transfer that reads or writes the wrong bytes differs
    # from it. ``fused``: taken by the CUDA bucket fill from the bytes it copies (that read saved), which makes C2
    # blind to a fill that reads the wrong source: both sides then hold the same wrong bytes.
    c2_learner_side: Literal["export", "fused"] = "export"
    self_check_tolerance: float = 0.25
    self_check_seed: int = 0
    probe_tokens: int = 0
    sentinel: SentinelConfig = dataclasses.field(default_factory=SentinelConfig)

    def _validate(self, where: Where) -> None:
        if not self.bucket_mb > 0:
            raise where.child("bucket_mb").error(f"must be > 0 (MiB per bucket), got {self.bucket_mb}")
        if not self.self_check_tolerance > 0:
            raise where.child("self_check_tolerance").error(f"must be > 0, got {self.self_check_tolerance}")
        if self.probe_tokens < 0:
            raise where.child("probe_tokens").error(f"must be >= 0, got {self.probe_tokens}")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * (1 << 20))

    def mode(self, check: str) -> Mode:
        if check not in CHECKS:
            raise ConfigError(f"unknown sync check '{check}'; known: {', '.join(CHECKS)}")
        return self.checks.get(check)

    def with_modes(self, **modes: Mode) -> SyncConfig:
        """A copy with some check modes replaced (``all=`` sets every check)."""
        every = modes.pop("all", None)
        base = {c: every for c in CHECKS} if every is not None else {}
        base.update(modes)
        for check, mode in base.items():
            if check not in CHECKS:
                raise ConfigError(f"unknown sync check '{check}'; known: {', '.join(CHECKS)}")
            if mode not in MODES:
                raise ConfigError(f"sync check '{check}': mode must be one of {', '.join(MODES)}, got {mode!r}")
        return dataclasses.replace(self, checks=dataclasses.replace(self.checks, **base))

    def with_env(self, env: Mapping[str, str]) -> SyncConfig:
        """Apply ``MILES_LP_SYNC_CHECKS`` then each ``MILES_LP_SYNC_CHECK_<NAME>`` (the per-check one wins)."""
        modes: dict[str, str] = {}
        known = {env_name(c): c for c in CHECKS}
        for var in env:
            if var.startswith(ENV_PREFIX) and var not in known:
                raise ConfigError(f"environment variable {var}: no sync check by that name; known: "
                                  f"{', '.join(known)}")
        if ENV_ALL in env:
            modes.update({c: _env_mode(ENV_ALL, env[ENV_ALL]) for c in CHECKS})
        for var, check in known.items():
            if var in env:
                modes[check] = _env_mode(var, env[var])
        return self.with_modes(**modes) if modes else self


def _env_mode(var: str, value: str) -> str:
    v = value.strip().lower()
    if v not in MODES:
        raise ConfigError(f"environment variable {var}={value!r}: must be one of {', '.join(MODES)}")
    return v


def parse_sync_config(mapping: Any, where: Where | None = None) -> SyncConfig:
    """The ``sync:`` section of a recipe (``None``: all defaults). The environment is applied separately
    (``with_env``), by whoever builds the sync."""
    if isinstance(mapping, Mapping) and mapping.get("full_compare") is False:
        # YAML 1.1 reads an unquoted ``full_compare: off`` as false (as for the check modes): that is "off"
        mapping = {**mapping, "full_compare": "off"}
    return parse_dataclass(SyncConfig, mapping, where or Where("<sync>", "sync"))
