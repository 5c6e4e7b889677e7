"""Data parallelism for the Megatron learner: which micro-batches each data-parallel replica runs (pure).

    rounds = replica_rounds(packs, dp, dp_rank, equal=ep > 1)   # this replica's packs, one per round

Every rank receives the whole mini-batch and packs it exactly as a one-rank learner would
(``PackedLearnerSteps.micro_batches``); the packs, not the sequences, are then dealt to the replicas. So each
micro-batch is the same packed row (the same MXFP8 token blocks, the same filler) as on one rank, and the step's
gradient is the one-rank gradient summed in another order (``parallel.finalize_grads``). Dealing: longest
processing time first (the pack with the most tokens to the replica with the fewest so far, ties to the lower
rank), each replica's packs kept in mini-batch order.

``equal``: under expert parallelism the all-gather token dispatcher gathers the tokens of the tp x ep group, whose
ranks belong to different replicas, with equal-size collectives. Then every replica runs the same number of
rounds with the same row length per round: a pack is padded with filler up to the round's longest (the filler is
its own attention segment and carries no loss, so the real tokens compute what they would unpadded), and a
replica with fewer packs runs a filler-only row (``Pack`` with no sequences) whose loss is zero.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from miles_lp.train.embedded import Pack


def deal(tokens: Sequence[int], dp: int) -> list[list[int]]:
    """Pack indices per replica (longest first to the least-loaded replica), each in ascending order."""
    load = [0] * dp
    out: list[list[int]] = [[] for _ in range(dp)]
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        r = min(range(dp), key=lambda r: (load[r], r))
        out[r].append(i)
        load[r] += tokens[i]
    return [sorted(x) for x in out]


def filler_pack(tokens: int) -> Pack:
    """A row of ``tokens`` filler tokens and no sequence (a replica's empty round)."""
    return Pack(torch.zeros(1, tokens, dtype=torch.long), torch.arange(tokens)[None], [], [], [])


def pad_pack(pack: Pack, tokens: int) -> Pack:
    """``pack`` with its filler grown to ``tokens`` (positions continue the filler's own 0, 1, ...)."""
    if tokens == pack.tokens:
        return pack
    if tokens < pack.tokens:
        raise ValueError(f"pad_pack: {tokens} < the pack's {pack.tokens} tokens")
    used = (pack.offsets[-1] + pack.lengths[-1]) if pack.lengths else 0
    ids = torch.zeros(1, tokens, dtype=pack.input_ids.dtype)
    ids[:, :pack.tokens] = pack.input_ids
    pos = torch.empty(1, tokens, dtype=pack.position_ids.dtype)
    pos[:, :used] = pack.position_ids[:, :used]
    pos[0, used:] = torch.arange(tokens - used)
    return dataclasses.replace(pack, input_ids=ids, position_ids=pos)


def replica_rounds(packs: Sequence[Pack], dp: int, dp_rank: int, *, equal: bool) -> list[Pack]:
    """This replica's packs (``equal``: padded / filled so that every replica runs the same rounds)."""
    if dp == 1:
        return list(packs)
    shares = deal([p.tokens for p in packs], dp)
    mine = [packs[i] for i in shares[dp_rank]]
    if not equal:
        return mine
    rounds = max(len(s) for s in shares)
    out = []
    for r in range(rounds):
        longest = max(packs[s[r]].tokens for s in shares if r < len(s))
        out.append(pad_pack(mine[r], longest) if r < len(mine) else filler_pack(longest))
    return out
