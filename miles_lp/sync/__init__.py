"""Shared-grid weight sync: the learner's own quantized weights into a live engine, checked.

    from miles_lp.sync import WeightSync, SyncConfig
    sync = WeightSync(engine, plan, "sglang", SyncConfig())
    report = sync.initial_sync(learner)      # then sync.sync(learner) after every optimizer step

Modules: ``config`` (the recipe's ``sync:`` section), ``items`` (export -> engine tensors, atomic groups),
``buckets`` (bucketing, 0xFF staging, the C5 ledger), ``transport`` (in-process, Ray, CUDA IPC, broadcast),
``checks`` (C1-C5), ``sentinel`` (C6), ``digest`` (C2 fingerprints), ``weight_sync`` (the orchestration),
``faults`` (fault injection for ``miles-lp selftest sync``). See docs/sync.md.
"""

from miles_lp.sync.config import CHECKS, SentinelConfig, SyncConfig, parse_sync_config
from miles_lp.sync.sentinel import Sentinel, rollout_kl
from miles_lp.sync.verdict import SyncAbortedError, SyncCheckError, SyncError, Verdict
from miles_lp.sync.weight_sync import SyncReport, WeightSync

__all__ = ["CHECKS", "SentinelConfig", "SyncConfig", "parse_sync_config", "Sentinel", "rollout_kl",
           "SyncAbortedError", "SyncCheckError", "SyncError", "Verdict", "SyncReport", "WeightSync"]
