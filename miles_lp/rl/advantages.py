"""Rewards -> advantages: GRPO group normalisation, DAPO dynamic sampling and overlong punishment.

Pure functions on CPU tensors; the RL step calls them in this order: ``overlong_penalty`` (added to the task
reward), ``keep_groups`` (dynamic sampling), ``group_advantages``.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, *, norm_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantages, one per sample (verl ``compute_grpo_outcome_advantage``).

    ``rewards`` ``[G * group_size]``, groups contiguous. ``A_i = (r_i - mean_g) / (std_g + eps)`` with the
    unbiased std (``torch.std``, as verl) or, with ``norm_by_std=False`` (Dr. GRPO), ``A_i = r_i - mean_g``.
    """
    r = rewards.to(torch.float32).reshape(-1, group_size)  # [G, n]
    centred = r - r.mean(dim=1, keepdim=True)
    if norm_by_std:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def keep_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: a bool per group, False where every reward of the group is equal (such a group
    has zero advantage everywhere and only dilutes the batch)."""
    r = rewards.reshape(-1, group_size)
    return (r != r[:, :1]).any(dim=1)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, penalty_factor: float) -> torch.Tensor:
    """DAPO soft overlong punishment (verl ``DAPORewardManager``): 0 up to ``max_len - buffer_len`` tokens, then
    linear down to ``-penalty_factor`` at ``max_len``: ``min(-(len - (max_len - buffer_len)) / buffer_len *
    penalty_factor, 0)``."""
    exceed = lengths.to(torch.float32) - (max_len - buffer_len)
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)
