"""The embedded learner's packed forward: per-sequence causal attention over the packed row (``miles_lp_packed``)
equals transformers' block-diagonal ``sdpa``, and log-probs computed on the response rows only
(``logits_to_keep``) equal the full computation there, NaN elsewhere, with the same loss and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from miles_lp.config import Where, parse_dataclass
from miles_lp.rl.batch import make_sample
from miles_lp.rollout.testing import tiny_hf
from miles_lp.train import packed_attention as pa
from miles_lp.train.config import TrainConfig
from miles_lp.train.embedded import EmbeddedTrainer, nll_loss, policy_gradient_loss, prediction_span

pytestmark = pytest.mark.usefixtures("one_thread")


def _trainer(arch="qwen3", **kw):
    cfg = parse_dataclass(TrainConfig, {"device": "cpu", "lr": 1e-2, **kw}, Where("<t>", "train"))
    return EmbeddedTrainer(tiny_hf(arch, 0, 2), None, cfg)


def _rl_samples(seed=0, n=5):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(4, 60, (6 + 3 * i,), generator=g).tolist()
        resp = torch.randint(4, 60, (2 + i % 3,), generator=g).tolist()
        s = make_sample(prompt, resp, torch.zeros(len(resp)), i)
        s["advantages"] = torch.randn(len(prompt) + len(resp) - 1, generator=g)
        s["old_logprobs"] = torch.full((len(prompt) + len(resp) - 1,), -3.0)
        out.append(s)
    return out


def test_segments_cut_where_positions_restart():
    pos = torch.tensor([0, 1, 2, 0, 1, 0, 0, 1, 2, 3])
    assert pa.segments(pos) == [(0, 3), (3, 2), (5, 1), (6, 4)]
    assert pa.segments(torch.arange(5)) == [(0, 5)]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_packed_attention_equals_block_diagonal_sdpa(arch):
    tr = _trainer(arch)
    assert tr.packed_attention and tr.model.config._attn_implementation == pa.NAME
    seqs = [s["tokens"] for s in _rl_samples()]
    got, _ = tr.logprobs(seqs)
    tr.model.set_attn_implementation("sdpa")
    want, _ = tr.logprobs(seqs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=2e-5)  # fp32 model: only the kernel's summation order differs


def test_packed_attention_fault_full_row_causal_differs():
    # the check above can fail: one causal attention over the whole row (sequences see each other) is far off
    tr = _trainer()
    seqs = [s["tokens"] for s in _rl_samples()]
    want, _ = tr.logprobs(seqs)
    orig = pa.segments
    try:
        pa.segments = lambda pos: [(0, int(pos.numel()))]
        got, _ = tr.logprobs(seqs)
    finally:
        pa.segments = orig
    assert max(float((g - w).abs().max()) for g, w in zip(got[1:], want[1:], strict=True)) > 1e-3


def test_models_with_sliding_windows_keep_sdpa():
    tr = _trainer()
    tr.model.set_attn_implementation("sdpa")
    tr.model.config.sliding_window = 4
    assert not pa.use_packed_attention(tr.model)
    assert tr.model.config._attn_implementation == "sdpa"


def test_prediction_span():
    s = make_sample([5, 6, 7, 8], [9, 10], torch.zeros(2), 0)
    assert prediction_span(s, 6) == (3, 5)
    assert prediction_span(s["tokens"], 6) == (0, 5)  # a bare sequence: every row
    wide = dict(s, loss_mask=torch.tensor([0.0, 1, 0, 1, 1]))  # a mask outside the response widens the span
    assert prediction_span(wide, 6) == (1, 5)


def test_response_rows_only_logprobs_equal_the_full_computation():
    tr = _trainer()
    batch = _rl_samples()
    full, full_ent = tr.logprobs([s["tokens"] for s in batch])
    rows, rows_ent = tr.logprobs(batch)
    for s, f, fe, r, re in zip(batch, full, full_ent, rows, rows_ent, strict=True):
        lo, hi = s["start"], s["start"] + s["n"]
        assert r.shape == f.shape
        torch.testing.assert_close(r[lo:hi], f[lo:hi], rtol=0, atol=1e-5)
        torch.testing.assert_close(re[lo:hi], fe[lo:hi], rtol=0, atol=1e-5)
        assert torch.isnan(r[:lo]).all() and torch.isnan(r[hi:]).all()  # never computed, never a placeholder


@pytest.mark.parametrize("loss_fn", [nll_loss, policy_gradient_loss])
def test_response_rows_only_train_step_same_loss_and_gradient(loss_fn):
    batch = _rl_samples()
    results = []
    for rows_only in (True, False):
        tr = _trainer()
        samples = batch if rows_only else [{k: v for k, v in s.items() if k not in ("start", "n")} for s in batch]
        tr.optimizer.zero_grad(set_to_none=True)
        loss, _ = tr.accumulate_grads(samples, loss_fn)
        grads = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
        results.append((loss, grads))
    (l1, g1), (l2, g2) = results
    assert math.isfinite(l1) and abs(l1 - l2) <= 1e-6 * max(1.0, abs(l2))
    assert g1.keys() == g2.keys()
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-4, atol=1e-6, msg=n)


def test_a_loss_reading_outside_the_span_turns_non_finite():
    tr = _trainer()

    def reads_prompt_rows(logprobs, entropy, samples, totals):
        return -sum(lp.sum() for lp in logprobs) / totals["tokens"]

    st = tr.train_step(_rl_samples(), reads_prompt_rows)
    assert not st["finite"] and st["skipped"]


def test_per_sequence_log_softmax_equals_the_whole_row():
    from miles_lp.train.embedded import pack_sequences, token_logprobs_and_entropy

    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 50, (n,), generator=g) for n in (5, 9, 3)]
    pack = pack_sequences(seqs, [0, 1, 2], 32)
    logits = torch.randn(1, pack.tokens, 50, generator=g).bfloat16()
    lps, ents = token_logprobs_and_entropy(logits, pack, temperature=0.7)
    whole = torch.log_softmax(logits[0].float() / 0.7, -1)
    for o, n, lp, ent in zip(pack.offsets, pack.lengths, lps, ents, strict=True):
        rows = whole[o:o + n - 1]
        assert torch.equal(lp, rows.gather(-1, pack.input_ids[0, o + 1:o + n, None])[:, 0])
        assert torch.equal(ent, -(rows.exp() * rows).sum(-1))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_segment_attention_backward_against_float64(dtype, tol):
    """The segments' attention: forward byte-equal to the plain sdpa call; gradients within rounding of a float64
    reference, and no farther from it than ATen's own flash-attention backward (the kernel it replaces)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(6, 3, 11, 16, generator=g).to(dtype) for _ in range(4))

    def grads(fn, cast):
        xs = [t.detach().to(cast).requires_grad_(True) for t in (q, k, v)]
        out = fn(*xs)
        out.backward(dout.to(cast))
        return out.detach(), [x.grad.double() for x in xs]

    def sdpa(a, b, c):
        return torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True, scale=0.3)

    got_out, got = grads(lambda a, b, c: pa.SegmentAttention.apply(a, b, c, 0.3), dtype)
    aten_out, aten = grads(sdpa, dtype)
    _, exact = grads(sdpa, torch.float64)
    assert torch.equal(got_out, aten_out)
    for mine, theirs, ref in zip(got, aten, exact, strict=True):
        scale = float(ref.abs().max())
        err, aten_err = float((mine - ref).abs().max()) / scale, float((theirs - ref).abs().max()) / scale
        assert err < tol and err <= max(aten_err, 1e-6), (err, aten_err)


def test_packed_training_gradients_equal_block_diagonal_sdpa():
    """A train step's gradients through the packed attention (SegmentAttention's backward) equal transformers'
    block-diagonal sdpa's to fp32 rounding (fp32 model)."""
    samples = _rl_samples()
    grads = []
    for impl in (pa.NAME, "sdpa"):
        tr = _trainer("llama")
        tr.model.set_attn_implementation(impl)
        tr.optimizer.zero_grad(set_to_none=True)
        tr.accumulate_grads(samples, policy_gradient_loss)
        grads.append({n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 5
    for n, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][n], rtol=1e-4, atol=1e-6, msg=n)
