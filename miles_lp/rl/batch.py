"""From generations to learner samples, and the GRPO loss function the learner calls per micro-batch.

A sample is the whole sequence ``prompt + response`` (``tokens``); the learner's log-probs are over positions
``1..L-1``, so the response tokens are entries ``start = len(prompt) - 1`` to ``start + n - 1`` of them. The
``loss_mask`` is 1 exactly there (times the rejection mask), so the learner's token totals are the loss
tokens of the step.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from miles_lp.rl.config import RLConfig
from miles_lp.rl.loss import agg_loss, clipped_policy_loss, kl_penalty
from miles_lp.rl.masked import masked_mean, pad


def make_sample(prompt: Sequence[int], output: Sequence[int], rollout_lp: torch.Tensor, index: int,
                routed_experts: torch.Tensor | None = None) -> dict[str, Any]:
    """``routed_experts`` (routing replay): the engine's ``[len(prompt) + len(output) - 1, MoE layers, top_k]``
    routes, row ``t`` = token ``t`` of ``tokens``; the learner validates and replays them
    (``miles_lp.train.routing_replay``). Absent: the learner routes on its own."""
    tokens = torch.tensor([*prompt, *output], dtype=torch.long)
    start, n = len(prompt) - 1, len(output)
    loss_mask = torch.zeros(tokens.numel() - 1)
    loss_mask[start:start + n] = 1.0
    sample = {"tokens": tokens, "loss_mask": loss_mask, "start": start, "n": n, "index": index,
              "rollout_logprobs": rollout_lp.float().reshape(-1)[:n]}
    if routed_experts is not None:
        sample["routed_experts"] = routed_experts
    return sample


def response_rows(full: Sequence[torch.Tensor], samples: Sequence[Mapping[str, Any]]) -> list[torch.Tensor]:
    """The response slice of each per-position tensor (log-probs, entropies) of the learner."""
    return [f[s["start"]:s["start"] + s["n"]] for f, s in zip(full, samples, strict=True)]


def set_mask(sample: dict[str, Any], response_mask: torch.Tensor) -> None:
    """Apply a rejection mask (over the response tokens) to the sample's loss mask."""
    lm = torch.zeros_like(sample["loss_mask"])
    lm[sample["start"]:sample["start"] + sample["n"]] = response_mask[:sample["n"]]
    sample["loss_mask"] = lm


class GRPOLoss:
    """The learner's ``loss_fn`` (``miles_lp.train.embedded.LossFn``): clipped surrogate with the chosen
    correction, + kl_coef * KL(pi || ref), - entropy_coef * entropy, aggregated with the step's totals.

    Samples carry ``advantage`` (float), ``old_logprobs``, optional ``ref_logprobs`` and ``is_weights`` (over the
    response tokens). ``stats`` accumulates per-mini-batch figures; with ``record=True`` the detached current
    log-probs are kept per sample ``index`` (bypass mode measures the mismatch from them).
    """

    def __init__(self, rl: RLConfig, record: bool = False):
        self.rl = rl
        self.record = record
        self.stats: dict[str, float] = collections.defaultdict(float)
        self.recorded: dict[int, torch.Tensor] = {}

    def __call__(self, logprobs, entropy, samples, totals) -> torch.Tensor:
        rl = self.rl
        lp_rows = response_rows(logprobs, samples)
        lp = pad_sequence(lp_rows, batch_first=True)  # [b, T], keeps the graph
        dev = lp.device
        mask = pad([set_mask_rows(s) for s in samples])[0].to(dev)
        old = pad([s["old_logprobs"] for s in samples])[0].to(dev)
        adv = torch.tensor([float(s["advantage"]) for s in samples], device=dev)[:, None].expand_as(lp)
        isw = None
        if samples[0].get("is_weights") is not None:
            isw = pad([s["is_weights"] for s in samples])[0].to(dev)
        tot = {"total_tokens": totals["tokens"], "total_seqs": totals["sequences"]}
        pg = clipped_policy_loss(lp, old, adv, mask, clip_low=rl.clip_low, clip_high=rl.clip_high,
                                 clip_ratio_c=rl.clip_ratio_c, is_weights=isw, agg=rl.loss_agg, **tot)
        loss = pg.loss
        share = float(mask.sum()) / max(1.0, float(totals["tokens"]))  # this micro-batch's share of the tokens
        st = self.stats
        st["pg_loss"] += float(pg.loss.detach())
        st["pg_clipfrac"] += float(pg.clipfrac) * share
        st["pg_clipfrac_lower"] += float(pg.clipfrac_lower) * share
        st["ppo_kl"] += float(pg.ppo_kl) * share
        if rl.kl_coef > 0:
            ref = pad([s["ref_logprobs"] for s in samples])[0].to(dev)
            kl = agg_loss(kl_penalty(lp, ref, rl.kl_estimator), mask, rl.loss_agg, **tot)
            loss = loss + rl.kl_coef * kl
            st["kl_loss"] += float(kl.detach())
        if rl.entropy_coef > 0:
            ent = pad_sequence(response_rows(entropy, samples), batch_first=True)
            ent_loss = agg_loss(ent, mask, rl.loss_agg, **tot)
            loss = loss - rl.entropy_coef * ent_loss
            st["entropy_loss"] += float(ent_loss.detach())
        st["current_entropy"] += float(masked_mean(pad_sequence(response_rows(entropy, samples),
                                                                 batch_first=True).detach(), mask)) * share
        if self.record:
            for row, s in zip(lp_rows, samples, strict=True):
                self.recorded[int(s["index"])] = row.detach().float().cpu()
        return loss


def set_mask_rows(sample: Mapping[str, Any]) -> torch.Tensor:
    return sample["loss_mask"][sample["start"]:sample["start"] + sample["n"]]
