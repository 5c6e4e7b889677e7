"""The GRPO step, straight-line on one page, no Ray (the launcher's actors call this same function).

rollout -> reward -> old and reference log-probs on the learner -> mismatch metrics and correction ->
group-normalised advantages -> mini-batches with the clipped loss -> optimizer steps -> shared-grid sync
with checks -> the sentinel. Every stage is timed (``timing_s/<stage>``) and counted (``tokens/<stage>``).

The mismatch metrics (``rollout_corr/*``) compare the engine's log-probs of the sampled tokens with the
learner's log-probs of the same tokens BEFORE the update (the old-log-prob pass; in bypass mode the first
mini-batch's forward, which also runs before any update).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from miles_lp.errors import MilesLPError
from miles_lp.rl.advantages import group_advantages, keep_groups, overlong_penalty
from miles_lp.rl.batch import GRPOLoss, make_sample, response_rows, set_mask
from miles_lp.rl.config import RLConfig
from miles_lp.rl.corrections import offpolicy_metrics, rollout_correction
from miles_lp.rl.masked import masked_mean, pad


class RunError(MilesLPError, RuntimeError):
    """The run cannot continue (non-finite log-probs or loss, a failed check in raise mode, a dead engine)."""


@dataclasses.dataclass
class StepParts:
    """What one step needs. ``learner``/``reference`` follow ``miles_lp.train.learner.Learner``; ``engine``
    ``miles_lp.rollout.engine.Engine``; ``sync`` a ``miles_lp.sync.WeightSync`` (``sync(learner)`` returns a
    report with ``.metrics``; its ``sentinel``, if any, is fed each step's rollouts before the sync)."""

    learner: Any
    engine: Any
    sync: Any
    task: Any
    sampling: Any  # miles_lp.rollout.engine.SamplingParams
    rl: RLConfig
    seed: int = 0
    reference: Any = None  # frozen BF16 learner; None when rl.kl_coef == 0


class StageTimer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0


def _report_sentinel_without_sync(sync: Any, v: Any, step: int, m: dict[str, Any]) -> None:
    """A step without an optimizer step (every group dropped) runs no sync, so its sentinel verdict (C6) is put in
    its metrics and log line here, and fails the step in raise mode, as a sync would have."""
    m.update(v.metrics())
    if not v.failed:
        return
    mode = sync.mode("sentinel") if callable(getattr(sync, "mode", None)) else "warn"
    line = f"step {step} (no optimizer step, no sync): {v.short()} | FAILED: {v.describe()}"
    log = getattr(sync, "log", None)
    if callable(log):
        log(line)
    if mode == "raise":
        raise RunError(f"step {step}: {v.describe()} (sync.checks.sentinel: raise; the step ran no optimizer step, "
                       "so no sync reported it)")


def step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7919 + 1) % (2**31 - 1)


def _finite(rows, what: str, step: int) -> None:
    for i, r in enumerate(rows):
        if not bool(torch.isfinite(r).all()):
            raise RunError(f"step {step}: non-finite {what} in sample {i} ({int((~torch.isfinite(r)).sum())} of "
                           f"{r.numel()} tokens); stopping (the last checkpoint is resumable)")


def grpo_step(p: StepParts, step: int) -> dict[str, float]:
    rl, t, m = p.rl, StageTimer(), {}
    n_group = rl.group_size
    # 1. rollout: group_size samples per prompt, sampling seeded by (seed, step)
    prompts = p.task.prompts(step, rl.prompts_per_step)
    inputs = [list(pr.ids) for pr in prompts for _ in range(n_group)]
    sampling = dataclasses.replace(p.sampling, seed=step_seed(p.seed, step))
    if rl.routing_replay:  # Miles R3: the engine returns each token's routed experts, the learner replays them
        sampling = dataclasses.replace(sampling, return_routed_experts=True)
    with t("generate"):
        gens = p.engine.generate(inputs, sampling)
        # a generation the engine aborted (a pause with mode abort, a server's memory or timeout abort) is cut
        # short: its reward and tokens mean nothing. Its group is regenerated (bounded), then dropped whole
        # (GRPO's baseline is the group's mean), as slime / Miles drop an aborted group from a rollout
        gens, prompts, inputs, ab = _without_aborted(p, gens, prompts, inputs, sampling, step)
    m.update(ab)
    _finite([g.logprobs for g in gens], "rollout log-probs from the engine", step)
    if rl.routing_replay:
        _check_routes_present(gens, inputs, step)
    # 2. reward (+ DAPO overlong punishment), dynamic sampling
    with t("reward"):
        scores = torch.tensor([p.task.reward(prompts[i // n_group], g.output_ids) for i, g in enumerate(gens)])
        lengths = torch.tensor([len(g.output_ids) for g in gens])
        rewards = scores.clone()
        if rl.overlong.enable:
            rewards += overlong_penalty(lengths, p.sampling.max_new_tokens, rl.overlong.buffer_len,
                                        rl.overlong.penalty_factor)
        keep = keep_groups(rewards, n_group) if rl.dynamic_sampling else torch.ones(len(prompts), dtype=torch.bool)
        adv = group_advantages(rewards, n_group, norm_by_std=rl.norm_adv_by_std)
    batch = [make_sample(inputs[i], g.output_ids, g.logprobs, i, g.routed_experts if rl.routing_replay else None)
             for i, g in enumerate(gens)]
    # 3. old log-probs (the learner before the update; routes replayed) and the frozen reference (its own
    # routing, as Miles runs the reference model with replay off: the engine's routes are the policy's)
    routing: dict[str, float] = {}
    if not rl.rollout_correction.bypass_mode:
        with t("old_log_prob"):
            old_full, ent_full = p.learner.logprobs(_learner_inputs(batch, rl.routing_replay))
        routing = dict(getattr(p.learner, "routing_stats", None) or {})
        old = response_rows(old_full, batch)
        _finite(old, "learner log-probs", step)
        m["actor/entropy"] = float(masked_mean(*_padded(response_rows(ent_full, batch))))
        for s, o in zip(batch, old, strict=True):
            s["old_logprobs"] = o
    else:
        for s in batch:
            s["old_logprobs"] = s["rollout_logprobs"]
    if rl.kl_coef > 0:
        with t("ref"):
            ref_full, _ = p.reference.logprobs([s["tokens"] for s in batch])
        for s, r in zip(batch, response_rows(ref_full, batch), strict=True):
            s["ref_logprobs"] = r
    # 4. mismatch metrics and the rollout correction (IS weights, rejection) on the old-policy log-probs
    rc = rl.rollout_correction
    roll, mask = _padded([s["rollout_logprobs"] for s in batch])
    if not rc.bypass_mode:
        upper, lower = rc.is_bounds
        w, new_mask, corr = rollout_correction(pad([s["old_logprobs"] for s in batch])[0], roll, mask,
                                               rollout_is=rc.rollout_is, is_upper=upper, is_lower=lower,
                                               rs_bounds=rc.rs_bounds if rc.rollout_rs else None)
        m.update(corr)
        for i, s in enumerate(batch):
            set_mask(s, new_mask[i])
            s["is_weights"] = None if w is None else w[i, :s["n"]]
    # 5. advantages; drop the groups dynamic sampling rejected
    for s in batch:
        s["advantage"] = float(adv[s["index"]])
    train = [s for s in batch if keep[s["index"] // n_group]]
    # 6. the update: mini-batches, one optimizer step each (the old-policy ratio matters from the second)
    loss_fn = GRPOLoss(rl, record=rc.bypass_mode)
    stats: list[dict[str, Any]] = []
    with t("update_actor"):
        for mb_index, mb in enumerate(_split(train, rl.mini_batches)):
            loss_fn.record = rc.bypass_mode and mb_index == 0
            stats.append(p.learner.train_step(mb, loss_fn))
            if not all(math.isfinite(float(s[k])) for s in stats[-1:] for k in ("loss", "grad_norm")):
                raise RunError(f"step {step}: non-finite loss or gradient (loss {stats[-1]['loss']}, grad norm "
                               f"{stats[-1]['grad_norm']}) in mini-batch {mb_index}; stopping")
    if rl.routing_replay:
        _routing_metrics(m, routing, stats)
    if rc.bypass_mode and loss_fn.recorded:  # mismatch measured on mini-batch 0 (before any update)
        idx = sorted(loss_fn.recorded)
        cur, cmask = _padded([loss_fn.recorded[i] for i in idx])
        rmask = pad([batch[i]["rollout_logprobs"] for i in idx])[0]
        m.update({f"rollout_corr/{k}": v for k, v in offpolicy_metrics(cur, rmask, cmask).items()})
    # 7. the sentinel (C6) sees this step's rollouts, then the shared-grid sync reports it with C1-C5
    sentinel = getattr(p.sync, "sentinel", None)
    if sentinel is not None:
        sentinel.update(rollout_logprobs=[g.logprobs for g in gens], kl=m.get("rollout_corr/kl"),
                        clip_ratio=loss_fn.stats.get("pg_clipfrac", 0.0) / max(1, len(stats)),
                        finish_reasons=[g.finish_reason for g in gens])
    if stats:  # no optimizer step, nothing to send
        with t("sync"):
            report = p.sync.sync(p.learner)
        m.update({k: float(v) for k, v in dict(report.metrics).items() if isinstance(v, int | float)})
        t.seconds["checks"] = min(t.seconds["sync"], m.get("perf/sync_check_seconds", 0.0))
        t.seconds["sync"] -= t.seconds["checks"]  # the stages add up to the step
    elif sentinel is not None:  # no sync reports this step's C6 verdict: the step does
        _report_sentinel_without_sync(p.sync, sentinel.last, step, m)
    # 8. metrics
    capped = [g.finish_reason == "length" for g in gens]
    m.update({"reward/mean": float(scores.mean()), "reward/std": float(scores.std()), "reward/max": float(scores.max()),
              "reward/min": float(scores.min()), "reward/with_penalty_mean": float(rewards.mean()),
              "response_length/mean": float(lengths.float().mean()), "response_length/max": float(lengths.max()),
              "response_length/clip_ratio": sum(capped) / len(capped), "rl/groups_kept": float(keep.sum()),
              "rl/samples_trained": float(len(train)), "rl/optimizer_steps": float(len(stats)),
              "rollout/weight_version": float(gens[0].weight_version), "actor/step": float(getattr(p.learner, "step", 0))})
    if stats:
        n_mb = len(stats)
        # the loss function's figures are per mini-batch (micro-batches weighted by their tokens): average them
        m.update({f"actor/{k}": v / n_mb for k, v in loss_fn.stats.items() if k != "current_entropy"})
        m["actor/grad_norm"] = sum(float(s["grad_norm"]) for s in stats) / n_mb
        if "actor/entropy" not in m:
            m["actor/entropy"] = loss_fn.stats["current_entropy"] / n_mb
    tok_gen = int(lengths.sum())
    tok_all = sum(int(s["tokens"].numel()) for s in batch)
    m.update({"tokens/generate": float(tok_gen), "tokens/update_actor": float(sum(int(s["tokens"]) for s in stats)),
              "tokens/old_log_prob": float(tok_all if "old_log_prob" in t.seconds else 0),
              "tokens/ref": float(tok_all if "ref" in t.seconds else 0)})
    m.update({f"timing_s/{k}": v for k, v in t.seconds.items()})
    m["timing_s/step"] = sum(t.seconds.values())
    return m


def _padded(rows):
    return pad(rows)


def retry_seed(seed: int, step: int, attempt: int) -> int:
    """The sampling seed of the ``attempt``-th regeneration of a step's aborted groups (a pure function, so a run
    that sees the same aborts samples the same tokens)."""
    return (step_seed(seed, step) + attempt * 104_729) % (2**31 - 1)


def _aborted_groups(gens, n_group: int) -> list[int]:
    return sorted({i // n_group for i, g in enumerate(gens) if g.finish_reason == "abort"})


def _without_aborted(p: StepParts, gens: list, prompts: list, inputs: list, sampling, step: int):
    """(generations, prompts, inputs, metrics) with every group holding an ``abort`` regenerated up to
    ``rl.abort_retries`` times (only those groups, seed ``retry_seed``), then dropped. Metrics:
    ``rollout/aborted`` (aborted generations seen, retries included), ``rollout/regenerated`` (generations
    sampled again), ``rollout/aborted_groups_dropped``. Every group dropped: ``RunError`` (nothing to train on;
    an engine that aborts everything is not a step's noise)."""
    n = p.rl.group_size
    gens = list(gens)
    bad = _aborted_groups(gens, n)
    aborted = sum(g.finish_reason == "abort" for g in gens)
    regenerated = 0
    for attempt in range(1, p.rl.abort_retries + 1):
        if not bad:
            break
        idx = [i for grp in bad for i in range(grp * n, (grp + 1) * n)]
        again = p.engine.generate([inputs[i] for i in idx], dataclasses.replace(sampling,
                                                                                seed=retry_seed(p.seed, step, attempt)))
        for i, g in zip(idx, again, strict=True):
            gens[i] = g
        regenerated += len(idx)
        aborted += sum(g.finish_reason == "abort" for g in again)
        bad = _aborted_groups(gens, n)
    m = {"rollout/aborted": float(aborted), "rollout/regenerated": float(regenerated),
         "rollout/aborted_groups_dropped": float(len(bad))}
    if not bad:
        return gens, prompts, inputs, m
    if len(bad) == len(prompts):
        raise RunError(f"step {step}: the engine aborted a generation in every group ({len(prompts)} groups, "
                       f"{aborted} aborted generations, {p.rl.abort_retries} regeneration(s) each): nothing to train "
                       "on. Another client paused the server with mode abort, or the server aborts requests (memory, "
                       "timeouts); stopping (the last checkpoint is resumable)")
    keep = [grp for grp in range(len(prompts)) if grp not in set(bad)]
    rows = [i for grp in keep for i in range(grp * n, (grp + 1) * n)]
    return [gens[i] for i in rows], [prompts[grp] for grp in keep], [inputs[i] for i in rows], m


def _learner_inputs(batch: list[dict[str, Any]], replay: bool) -> list:
    """What the old-log-prob pass sends the learner: the tokens, plus the routes (and sample index, for error
    messages) under routing replay."""
    if not replay:
        return [s["tokens"] for s in batch]
    return [{"tokens": s["tokens"], "routed_experts": s["routed_experts"], "index": s["index"]} for s in batch]


def _check_routes_present(gens, inputs, step: int) -> None:
    missing = [i for i, g in enumerate(gens) if getattr(g, "routed_experts", None) is None]
    if not missing:
        return
    if len(missing) == len(gens):
        raise RunError(f"step {step}: rl.routing_replay is on but the engine returned no routed experts for any "
                       "sample: a dense model (no MoE layers) has nothing to replay, or the engine does not "
                       "support return_routed_experts; set rl.routing_replay: false")
    i = missing[0]
    raise RunError(f"step {step}: rl.routing_replay is on but the engine returned no routed experts for sample {i} "
                   f"(prompt {list(inputs[i])}; {len(missing)} of {len(gens)} samples lack them); stopping")


def _routing_metrics(m: dict[str, float], old_pass: dict[str, float], stats: list[dict[str, Any]]) -> None:
    """``rollout_corr/routing_agreement``: share of (token, MoE layer) pairs where the learner's own top-k set
    equals the engine's replayed set, before any update (the old-log-prob pass; without one, or through a
    learner proxy that does not expose ``routing_stats``, the first mini-batch's forward, also before the
    update). ``_token``: every layer agrees. ``actor/routing_agreement``: mean over the training forwards."""
    first = old_pass or (stats[0] if stats else {})
    for k in ("routing_agreement", "routing_agreement_token"):
        if k in first:
            m[f"rollout_corr/{k}"] = float(first[k])
    per_mb = [float(s["routing_agreement"]) for s in stats if "routing_agreement" in s]
    if per_mb:
        m["actor/routing_agreement"] = sum(per_mb) / len(per_mb)


def _split(samples: list, parts: int) -> list[list]:
    """``parts`` contiguous, nearly equal mini-batches (fewer if there are fewer samples; none if empty)."""
    if not samples:
        return []
    parts = min(parts, len(samples))
    size, extra = divmod(len(samples), parts)
    out, i = [], 0
    for k in range(parts):
        n = size + (1 if k < extra else 0)
        out.append(samples[i:i + n])
        i += n
    return out
