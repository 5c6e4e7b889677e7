"""Train-rollout mismatch: importance weights (TIS / IcePop), rejection masks, and the ``rollout_corr/*``
metrics, with verl's names and semantics (CONTRACT 6 and 10; verl ``trainer/ppo/rollout_corr_helper.py``).

``log_ratio = lp_train - lp_rollout`` on the sampled tokens, where ``lp_train`` is the learner's log-prob of
the very tokens the engine sampled, computed BEFORE the update (the old policy). Inputs are padded
``[B, T]`` plus a response mask.
"""

from __future__ import annotations

import math

import torch

from miles_lp.rl.loss import LOG_RATIO_BOUND
from miles_lp.rl.masked import masked_mean, masked_sum

PREFIX = "rollout_corr/"


def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, upper: float, lower: float | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rollout importance weights (verl ``compute_rollout_correction_weights``).

    ``level`` token: ``w_t = exp(log_ratio_t)``; sequence: ``w = exp(sum_t log_ratio_t)`` on every token of
    the sequence (log-ratios clamped to +-20 before ``exp``). ``lower is None``: TIS, ``min(w, upper)``;
    otherwise IcePop-style: ``w`` kept inside ``[lower, upper]``, 0 outside. Returns (applied, raw), both zero
    on padding.
    """
    if level == "token":
        raw = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    elif level == "sequence":
        s = torch.clamp(masked_sum(log_ratio, mask, dim=-1), -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        raw = torch.exp(s)[:, None].expand_as(log_ratio)
    else:
        raise ValueError(f"rollout_is must be token or sequence, got {level!r}")
    raw = raw * mask
    if lower is None:
        applied = raw.clamp(max=upper)
    else:
        applied = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    return applied.detach(), raw.detach()


def is_metrics(applied: torch.Tensor, raw: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, level: str,
               upper: float, lower: float | None) -> dict[str, float]:
    """verl ``compute_is_metrics``: rollout_is_{mean,std,min,max,eff_sample_size,ratio_fraction_high,low}."""
    lo = 1.0 / upper if lower is None else lower
    out: dict[str, float] = {"rollout_is_mean": float(masked_mean(applied, mask))}
    if level == "sequence":
        seq = masked_sum(log_ratio, mask, dim=-1)  # unclamped, for exact extremes and fractions
        out["rollout_is_max"] = math.exp(min(float(seq.max()), LOG_RATIO_BOUND))
        out["rollout_is_min"] = math.exp(float(seq.min()))
        out["rollout_is_ratio_fraction_high"] = float((seq > math.log(upper)).float().mean())
        out["rollout_is_ratio_fraction_low"] = float((seq < math.log(lo)).float().mean())
    else:
        mb = mask.bool()
        out["rollout_is_max"] = float(applied.masked_fill(~mb, float("-inf")).max())
        out["rollout_is_min"] = float(applied.masked_fill(~mb, float("inf")).min())
        out["rollout_is_ratio_fraction_high"] = float(masked_mean((raw > upper).float(), mask))
        out["rollout_is_ratio_fraction_low"] = float(masked_mean((raw < lo).float(), mask))
    w = applied.clamp(0.0, upper)
    if mask.sum() > 1:
        var = masked_mean(w.square(), mask) - masked_mean(w, mask).square()
        out["rollout_is_std"] = float(torch.sqrt(var.clamp_min(0.0)))
    else:
        out["rollout_is_std"] = 0.0
    normalized = w / (masked_mean(w, mask) + 1e-8)
    out["rollout_is_eff_sample_size"] = 1.0 / float(masked_mean(normalized.square(), mask))
    return out


def _seq_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = x.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, bounds: dict[str, tuple[float | None, float]]
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """verl ``compute_rollout_rejection_mask`` (divergence options; all must pass).

    Per token: ``k1 = -log_ratio``, ``k2 = 0.5 log_ratio^2``, ``k3 = exp(log_ratio) - 1 - log_ratio`` (log-ratio
    clamped to +-20). ``token_*`` tests each token; ``seq_sum_*`` / ``seq_mean_*`` / ``seq_max_*`` the sum / mean /
    max over the sequence and reject the whole sequence. ``*_k1`` keeps ``log(lo) <= stat <= log(hi)``; the
    others keep ``stat <= hi``. Returns (mask with rejected tokens zeroed, metrics).
    """
    lr = torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    token = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.exp(lr) - 1.0 - lr}
    keep = torch.ones_like(mask)
    metrics: dict[str, float] = {}
    for opt, (lo, hi) in bounds.items():
        scope, est = opt.rsplit("_", 1)
        stat = token[est]
        if scope == "seq_sum":
            stat = masked_sum(stat, mask, dim=-1)[:, None].expand_as(mask)
        elif scope == "seq_mean":
            stat = masked_mean(stat, mask, dim=-1)[:, None].expand_as(mask)
        elif scope == "seq_max":
            stat = _seq_max(stat, mask)[:, None].expand_as(mask)
        if est == "k1":
            ok = (stat >= math.log(lo)) & (stat <= math.log(hi))
        else:
            ok = stat <= hi
        ok = ok.to(mask.dtype)
        metrics[f"rollout_rs_{opt}_masked_fraction"] = float(masked_mean(1.0 - ok, mask))
        keep = keep * ok
    metrics["rollout_rs_masked_fraction"] = float(masked_mean(1.0 - keep, mask))
    rejected_seq = ((1.0 - keep) * mask).sum(-1) > 0
    metrics["rollout_rs_seq_masked_fraction"] = float(rejected_seq.float().mean())
    return mask * keep, metrics


def offpolicy_metrics(lp_train: torch.Tensor, lp_rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """verl ``compute_offpolicy_metrics`` (CONTRACT 6) plus the mean / max absolute per-token log-prob gap
    (Miles' and SkyRL's train-rollout logprob diff, TRL's ``sampling_logp_difference``)."""
    out: dict[str, float] = {}
    mean_train = masked_mean(lp_train, mask, dim=-1)  # [B]
    mean_roll = masked_mean(lp_rollout, mask, dim=-1)
    valid = mask.sum(-1) > 0
    mean_train, mean_roll = mean_train[valid], mean_roll[valid]
    out["training_ppl"] = float(torch.exp(-mean_train).mean())
    out["training_log_ppl"] = float((-mean_train).mean())
    out["kl"] = float(masked_mean(lp_rollout - lp_train, mask))
    log_ratio = lp_train - lp_rollout
    out["k3_kl"] = float(masked_mean(torch.exp(log_ratio) - log_ratio - 1.0, mask))
    out["rollout_ppl"] = float(torch.exp(-mean_roll).mean())
    out["rollout_log_ppl"] = float((-mean_roll).mean())
    diff = mean_roll - mean_train
    out["log_ppl_diff"] = float(diff.mean())
    out["log_ppl_abs_diff"] = float(diff.abs().mean())
    out["ppl_ratio"] = float(torch.exp(diff).mean())
    rho = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    out["chi2_token"] = float(masked_mean(rho.square(), mask)) - 1.0
    s = torch.clamp(masked_sum(log_ratio, mask, dim=-1)[valid], -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    out["chi2_seq"] = float(torch.exp(2.0 * s).mean()) - 1.0
    gap = (lp_train - lp_rollout).abs()
    out["logprob_abs_diff_mean"] = float(masked_mean(gap, mask))
    out["logprob_abs_diff_max"] = float(gap.masked_fill(~mask.bool(), 0.0).max()) if mask.any() else 0.0
    return out


def rollout_correction(lp_train: torch.Tensor, lp_rollout: torch.Tensor, mask: torch.Tensor, *,
                       rollout_is: str | None, is_upper: float, is_lower: float | None,
                       rs_bounds: dict[str, tuple[float | None, float]] | None
                       ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """The whole correction for one step (verl ``compute_rollout_correction_and_rejection_mask``).

    Returns (IS weights to apply or None, response mask after rejection, ``rollout_corr/*`` metrics). The IS
    statistics are reported even with ``rollout_is: null`` (token level, the configured threshold) so a run
    can be monitored before the correction is switched on; they are then not applied.
    """
    if not mask.any():
        raise ValueError("rollout correction needs at least one response token")
    log_ratio = lp_train - lp_rollout
    level = rollout_is or "token"
    applied, raw = is_weights(log_ratio, mask, level, is_upper, is_lower)
    metrics = is_metrics(applied, raw, log_ratio, mask, level, is_upper, is_lower)
    new_mask = mask
    if rs_bounds:
        new_mask, rs = rejection_mask(log_ratio, mask, rs_bounds)
        metrics.update(rs)
    metrics.update(offpolicy_metrics(lp_train, lp_rollout, mask))
    return (applied if rollout_is else None), new_mask, {PREFIX + k: v for k, v in metrics.items()}
