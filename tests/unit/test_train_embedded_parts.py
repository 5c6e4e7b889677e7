"""Embedded-trainer parts without a model: log-prob/entropy against a plain softmax, packing, micro-batches."""

from __future__ import annotations

import math

import torch

from miles_lp.train.embedded import pack_sequences, split_by_token_budget, token_logprobs_and_entropy


def test_logprobs_and_entropy_match_plain_softmax():
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 11, (n,), generator=g) for n in (5, 3, 7)]
    pack = pack_sequences(seqs, [0, 1, 2], multiple=32)
    logits = torch.randn(1, pack.tokens, 11, generator=g, dtype=torch.float64).to(torch.bfloat16)
    logits[0, :, 10] = -math.inf  # a masked vocabulary entry: entropy must stay finite
    lps, ents = token_logprobs_and_entropy(logits, pack)
    for seq, o, lp, ent in zip(seqs, pack.offsets, lps, ents, strict=True):
        n = seq.numel()
        assert lp.shape == ent.shape == (n - 1,) and lp.dtype == torch.float32
        for t in range(n - 1):
            z = logits[0, o + t].double()
            p = torch.softmax(z, -1)
            assert abs(float(lp[t]) - math.log(float(p[seq[t + 1]]))) < 1e-5
            h = -sum(float(pi) * math.log(float(pi)) for pi in p if pi > 0)
            assert abs(float(ent[t]) - h) < 1e-5
        assert torch.isfinite(ent).all()


def test_pack_pads_to_multiple_and_restarts_positions():
    seqs = [torch.arange(1, 6), torch.arange(1, 4)]
    pack = pack_sequences(seqs, [0, 1], multiple=32)
    assert pack.tokens == 32 and pack.offsets == [0, 5] and pack.lengths == [5, 3]
    assert pack.position_ids[0, :8].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert pack.position_ids[0, 8:].tolist() == list(range(24))  # the filler is its own segment
    assert pack_sequences(seqs, [0, 1], multiple=1).tokens == 8


def test_split_by_token_budget_is_greedy_order_preserving_and_padded():
    assert split_by_token_budget([10, 10, 10, 40, 5], budget=32, multiple=32) == [[0, 1, 2], [3], [4]]
    assert split_by_token_budget([10, 10, 10], budget=20, multiple=1) == [[0, 1], [2]]
    # padded size counts: 20 + 20 tokens pad to 64 > 32
    assert split_by_token_budget([20, 20], budget=32, multiple=32) == [[0], [1]]
