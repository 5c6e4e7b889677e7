"""The policy loss: PPO/GRPO clipped surrogate (DAPO clip-higher, optional dual clip), loss aggregation,
KL to a frozen reference, entropy bonus, rollout importance weights. Formulas follow verl's ``core_algos``.

All functions take padded ``[B, T]`` tensors over response tokens plus a ``mask`` (1 = counts).
"""

from __future__ import annotations

import dataclasses

import torch

from miles_lp.rl.masked import masked_mean, masked_sum

#: verl clamps log-ratios before ``exp`` to keep ratios finite (``SAFETY_BOUND``).
LOG_RATIO_BOUND = 20.0


def agg_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, *, total_tokens: float | None = None,
             total_seqs: float | None = None) -> torch.Tensor:
    """Aggregate a ``[B, T]`` per-token loss (verl ``agg_loss``).

    - ``token-mean``: sum over all tokens / number of tokens;
    - ``seq-mean-token-mean``: per sequence the token mean, then the mean over sequences;
    - ``seq-mean-token-sum``: per sequence the token sum, then the mean over sequences.

    ``total_tokens`` / ``total_seqs`` replace the local counts: with them a mini-batch split into several
    micro-batches gets the gradient of the whole mini-batch as a sum of micro-batch losses.
    """
    m = mask.to(loss.dtype)
    if mode == "token-mean":
        denom = m.sum() if total_tokens is None else torch.as_tensor(float(total_tokens))
        return (loss * m).sum() / denom.clamp_min(1.0)
    if mode == "seq-mean-token-mean":
        per_seq = (loss * m).sum(-1) / m.sum(-1).clamp_min(1.0)
    elif mode == "seq-mean-token-sum":
        per_seq = (loss * m).sum(-1)
    else:
        raise ValueError(f"unknown loss aggregation '{mode}'")
    denom = float(loss.shape[0]) if total_seqs is None else float(total_seqs)
    return per_seq.sum() / max(denom, 1.0)


@dataclasses.dataclass
class PolicyLoss:
    loss: torch.Tensor  # scalar, aggregated pg loss
    clipfrac: torch.Tensor  # fraction of tokens where the clipped branch was taken
    clipfrac_lower: torch.Tensor  # dual clip active (negative advantages)
    ppo_kl: torch.Tensor  # masked mean of old - new log-prob


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, *, clip_low: float, clip_high: float, clip_ratio_c: float | None = None,
                        is_weights: torch.Tensor | None = None, agg: str = "token-mean",
                        total_tokens: float | None = None, total_seqs: float | None = None) -> PolicyLoss:
    """verl ``compute_policy_loss_vanilla``: ``max(-A r, -A clip(r, 1-clip_low, 1+clip_high))``; with
    ``clip_ratio_c`` the dual clip ``min(that, -A c)`` for ``A < 0``; times the rollout IS weights when given."""
    neg_kl = torch.clamp(logprobs - old_logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(neg_kl)
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(l1, l2)
    clipfrac = masked_mean(torch.gt(l2, l1).float(), mask)
    if clip_ratio_c is not None:
        l3 = -advantages * clip_ratio_c
        dual = torch.minimum(l3, clipped)
        clipfrac_lower = masked_mean((torch.gt(clipped, l3) & (advantages < 0)).float(), mask)
        per_token = torch.where(advantages < 0, dual, clipped)
    else:
        clipfrac_lower = torch.zeros(())
        per_token = clipped
    if is_weights is not None:
        per_token = per_token * is_weights  # the weights are data (no gradient), verl detaches them
    loss = agg_loss(per_token, mask, agg, total_tokens=total_tokens, total_seqs=total_seqs)
    return PolicyLoss(loss, clipfrac.detach(), clipfrac_lower.detach(), masked_mean(-neg_kl, mask).detach())


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate on sampled tokens (verl ``kl_penalty``; Schulman's k1/k2/k3).

    k1 = log pi - log ref; k2 = 0.5 (log pi - log ref)^2; k3 = exp(log ref - log pi) - (log ref - log pi) - 1,
    the log-ratio clamped to +-20 and the result to [-10, 10] as verl's ``low_var_kl``.
    """
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        kl = torch.clamp(-d, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return torch.clamp(torch.exp(kl) - kl - 1.0, -10.0, 10.0)
    raise ValueError(f"unknown KL estimator '{estimator}' (k1, k2, k3)")


def masked_stats(x: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(mean, sum) of the masked entries, as Python floats (for metrics)."""
    return float(masked_mean(x, mask)), float(masked_sum(x, mask))
