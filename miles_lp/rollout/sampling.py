"""Sampling one token per row from the model's logits, and the log-prob the engine reports for it.

Log-prob convention (one rule, everywhere in miles-lp): ``Generation.logprobs[t]`` is the **raw policy
log-prob** ``log_softmax(logits)[token]`` at temperature 1, before temperature, top-k or top-p: the quantity RL
compares with the learner's (``old_logprobs``; CONTRACT 6's ``log rho = lp_train - lp_rollout``). vLLM's default
``logprobs_mode="raw_logprobs"`` is the same quantity. SGLang and verl report the log-prob of the *processed*
distribution (after temperature scaling) unless told otherwise; when comparing with them at temperature != 1,
ask this engine for ``logprob_mode="processed"`` (``SamplingParams.logprob_mode``), which returns the log-prob
of the distribution the token was actually drawn from (temperature-scaled and truncated by top-k / top-p).

Sampling is inverse-CDF on one uniform per row from a seeded ``torch.Generator``: the same prompts, the same
parameters and the same seed give the same tokens. (A row's uniform depends on its index in the batch.)
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def process_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """fp32 ``[B, V]`` logits after temperature, top-k and top-p (removed entries are ``-inf``)."""
    x = logits.float()
    if temperature > 0 and temperature != 1.0:
        x = x / temperature
    v = x.shape[-1]
    if 0 < top_k < v:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, NEG_INF)
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        p = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(p, dim=-1) - p  # mass strictly before each token
        drop_sorted = before >= top_p  # the smallest prefix whose mass reaches top_p is kept (>= 1 token)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, NEG_INF)
    return x


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None,
           logprob_mode: str = "raw") -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [B] int64, logprobs [B] fp32)`` for ``logits [B, V]``; temperature 0 is greedy (draws nothing)."""
    u = None
    if temperature != 0:
        u = torch.rand(logits.shape[0], 1, generator=generator, device=generator.device if generator is not None
                       else logits.device, dtype=torch.float32).to(logits.device)
    return sample_with_uniform(logits, u, temperature, top_k, top_p, logprob_mode)


def sample_with_uniform(logits: torch.Tensor, u: torch.Tensor | None, temperature: float, top_k: int, top_p: float,
                        logprob_mode: str = "raw") -> tuple[torch.Tensor, torch.Tensor]:
    """``sample`` with its uniforms given (``u [B, 1]`` fp32 on the logits' device; unused at temperature 0): no
    generator and no host copy, so the CUDA decode captures it in a graph."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    if temperature == 0:
        tokens = torch.argmax(raw, dim=-1)
        processed = raw
    else:
        processed = torch.log_softmax(process_logits(logits, temperature, top_k, top_p), dim=-1)
        cdf = torch.cumsum(processed.exp(), dim=-1)  # [B, V]
        # right=True: a zero-probability token owns an empty interval and is never drawn
        tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0].clamp_(max=cdf.shape[-1] - 1)
    table = raw if logprob_mode == "raw" else processed
    return tokens, table.gather(-1, tokens[:, None])[:, 0]
