"""Routing replay (Miles R3) in the embedded trainer: replayed routes against an independent forced-route forward,
bit-identity when the learner's own routes are replayed, gradients into the router, the packed-row alignment,
and the refusals (shape, expert id, duplicates, missing routes, dense model, a learner without the hook)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miles_lp.rollout.testing import tiny_hf
from miles_lp.train.config import TrainConfig
from miles_lp.train.embedded import EmbeddedTrainer, PackedLearnerSteps, nll_loss, plan_for_model
from miles_lp.train.routing_replay import (
    RoutingReplayError,
    moe_routers,
    pack_routes,
    same_expert_set,
    validate_routes,
)

ARCHS = ["qwen3_moe", "qwen2_moe", "deepseek_v3", "mixtral"]


def _seqs(n=(5, 9, 3, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 60, (k,), generator=g) for k in n]


def _forced(seqs, layers, experts, top_k):
    """A fabricated route per sample: a position- and layer-dependent cyclic shift (distinct experts per row)."""
    out = []
    for s in seqs:
        pos = torch.arange(s.numel() - 1)[:, None, None]
        lay = torch.arange(layers)[None, :, None]
        out.append((pos * 3 + lay + torch.arange(top_k)[None, None, :]) % experts)
    return out


def _weights_from_logits(router, logits, idx):
    """Gate weights of ``idx`` as the HF router's own code computes them for its top-k (written from the
    transformers-5 modeling files, independently of miles_lp.train.routing_replay)."""
    cls = type(router).__name__
    if cls == "DeepseekV3TopkRouter":
        w = logits.float().sigmoid().gather(1, idx)
        if router.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * router.routed_scaling_factor
    w = torch.softmax(logits.float(), dim=-1).gather(1, idx)
    if cls == "MixtralTopKRouter" or router.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return w if cls == "MixtralTopKRouter" else w.to(logits.dtype)


def _forced_forward(model, tokens, route):
    """Independent computation: ONE sequence, unpacked, through the plain HF forward; each experts module's
    inputs are replaced by a forward pre-hook (``top_k_index`` := the route, ``top_k_weights`` := the router's
    probabilities at it, from logits captured by a hook on the router). Returns log p(x_t | x_<t), t >= 1."""
    routers = moe_routers(model)
    logits_of, handles = {}, []
    experts = [m for _, m in model.named_modules() if hasattr(m, "gate_up_proj") and m.gate_up_proj.dim() == 3]
    assert len(experts) == len(routers)
    for i, (r, ex) in enumerate(zip(routers, experts, strict=True)):
        handles.append(r.module.register_forward_hook(lambda m, a, out, i=i: logits_of.__setitem__(i, out[0])))

        def pre(m, args, i=i, r=r):
            hidden, _, _ = args
            idx = torch.zeros(hidden.shape[0], route.shape[2], dtype=torch.long)
            idx[: route.shape[0]] = route[:, i]
            idx[route.shape[0]:] = torch.arange(route.shape[2])  # the last token (feeds no log-prob)
            return hidden, idx, _weights_from_logits(r.module, logits_of[i], idx)

        handles.append(ex.register_forward_pre_hook(pre))
    try:
        out = model(input_ids=tokens[None], use_cache=False).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    return torch.log_softmax(out, -1)[:-1].gather(-1, tokens[1:, None])[:, 0]


def _trainer(arch, plan=None, **cfg):
    path = tiny_hf(arch, 0, 2)
    if plan is not None:
        from miles_lp.rollout.testing import policy_for

        plan = plan_for_model(policy_for(plan), path)
    return EmbeddedTrainer(path, plan, TrainConfig(device="cpu", **cfg))


@pytest.mark.parametrize("arch", ARCHS)
def test_fabricated_routes_equal_forced_router_forward(arch):
    """(a) Learner log-probs with a fabricated route (packed, several micro-batches) equal an independent
    unpacked forward whose experts are forced to that route; the route changes the log-probs (can fail)."""
    tr = _trainer(arch, micro_batch_tokens=16)  # 4 sequences -> several packs
    seqs = _seqs()
    r0 = tr.moe_routers()[0]
    routes = _forced(seqs, len(tr.moe_routers()), r0.num_experts, r0.top_k)
    lp_replay, _ = tr.logprobs([{"tokens": s, "routed_experts": r} for s, r in zip(seqs, routes, strict=True)])
    assert tr.routing_stats["routing_agreement"] < 1.0  # the fabricated route is not the learner's own
    lp_own, _ = tr.logprobs(seqs)
    with torch.no_grad():
        ref = [_forced_forward(tr.model, s, r) for s, r in zip(seqs, routes, strict=True)]
    for a, b in zip(lp_replay, ref, strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=0)
    assert max(float((a - b).abs().max()) for a, b in zip(lp_replay, lp_own, strict=True)) > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_replaying_own_routes_is_bit_identical(arch):
    """The learner's own routes (recorded from its unreplayed forward) replayed: log-probs equal bit for bit,
    agreement 1 (MXFP8 plan: the filler positions of the packed row keep their own routing)."""
    tr = _trainer(arch, plan="mxfp8")
    seqs = _seqs()
    rec = []
    hs = [r.module.register_forward_hook(lambda m, a, o: rec.append(o[2].detach().clone())) for r in tr.moe_routers()]
    lp0, _ = tr.logprobs(seqs)
    for h in hs:
        h.remove()
    packed = torch.stack(rec, 1)  # one pack: [T, layers, k]
    samples, off = [], 0
    for s in seqs:
        samples.append({"tokens": s, "routed_experts": packed[off:off + s.numel() - 1]})
        off += s.numel()
    lp1, _ = tr.logprobs(samples)
    assert all(torch.equal(a, b) for a, b in zip(lp0, lp1, strict=True))
    assert tr.routing_stats == {"routing_agreement": 1.0, "routing_agreement_token": 1.0,
                                "routing_replayed_tokens": float(sum(s.numel() - 1 for s in seqs))}


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_router_gradient_flows_through_replayed_weights(arch):
    """The router's gradient under replay equals the independent forced forward's (weights gathered from the
    learner's own probabilities), and is non-zero."""
    tr = _trainer(arch)
    seqs = _seqs((6, 8))
    r0 = tr.moe_routers()[0]
    routes = _forced(seqs, len(tr.moe_routers()), r0.num_experts, r0.top_k)
    samples = [{"tokens": s, "routed_experts": r} for s, r in zip(seqs, routes, strict=True)]
    tr.optimizer.zero_grad()
    tr.accumulate_grads(samples, nll_loss)
    got = [r.module.weight.grad.clone() for r in tr.moe_routers()]
    tr.optimizer.zero_grad()
    n = sum(s.numel() - 1 for s in seqs)
    loss = sum(-_forced_forward(tr.model, s, r).sum() for s, r in zip(seqs, routes, strict=True)) / n
    loss.backward()
    for g, r in zip(got, tr.moe_routers(), strict=True):
        assert float(g.abs().max()) > 0
        torch.testing.assert_close(g, r.module.weight.grad, atol=1e-6, rtol=1e-4)


def test_pack_routes_alignment():
    """Sample j's row t lands at packed position offset_j + t; the last token of each sample and the filler are
    not replayed."""
    a = torch.arange(4 * 1 * 2).reshape(4, 1, 2)  # a sample of 5 tokens
    b = 100 + torch.arange(2 * 1 * 2).reshape(2, 1, 2)  # 3 tokens
    packed, rep = pack_routes([a, b], [0, 5], [5, 3], 10, 1, 2)
    assert torch.equal(packed[0:4], a) and torch.equal(packed[5:7], b)
    assert rep.tolist() == [True] * 4 + [False] + [True] * 2 + [False] * 3
    assert same_expert_set(torch.tensor([[1, 2]]), torch.tensor([[2, 1]])).tolist() == [True]
    assert same_expert_set(torch.tensor([[1, 2]]), torch.tensor([[1, 3]])).tolist() == [False]


@pytest.mark.parametrize("routes, match", [
    (torch.zeros(3, 2, 2, dtype=torch.long), r"shape \(3, 2, 2\), the learner needs \(4, 2, 2\)"),
    (torch.zeros(4, 1, 2, dtype=torch.long), r"needs \(4, 2, 2\)"),
    (torch.zeros(4, 2, 2), "integer expert ids"),
    (torch.tensor([[[0, 1], [2, 4]]] * 4), r"routed_experts\[0, 1, 1\] = 4 is not an expert id of this model \(0 .. 3\)"),
    (torch.tensor([[[0, 1], [-1, 2]]] * 4), r"routed_experts\[0, 1, 0\] = -1"),
    (torch.tensor([[[0, 1], [3, 3]]] * 4), r"routed_experts\[0, 1\] = \[3, 3\] names an expert twice"),
    ([[0, 1]], "must be a tensor"),
])
def test_bad_routes_name_the_sample(routes, match):
    """(c) Bad routes are refused naming the batch item (and its sample index) and the first bad entry."""
    tr = _trainer("qwen3_moe")
    good = _forced([torch.arange(4, 9)], 2, 4, 2)[0]
    batch = [{"tokens": torch.arange(4, 9), "routed_experts": good},
             {"tokens": torch.arange(4, 9), "routed_experts": routes, "index": 7}]
    with pytest.raises(RoutingReplayError, match=r"batch item 1 \(sample index 7\): .*" + match):
        tr.logprobs(batch)
    with pytest.raises(RoutingReplayError, match=r"batch item 1 \(sample index 7\)"):
        tr.train_step([dict(b, loss_mask=torch.ones(4)) for b in batch], nll_loss)


def test_missing_routes_dense_model_and_unsupported_learner():
    tr = _trainer("qwen3_moe")
    good = _forced([torch.arange(4, 9)], 2, 4, 2)[0]
    with pytest.raises(RoutingReplayError, match=r"batch item 1 has no routed_experts while others do"):
        tr.logprobs([{"tokens": torch.arange(4, 9), "routed_experts": good}, {"tokens": torch.arange(4, 9)}])
    dense = _trainer("qwen3")
    with pytest.raises(RoutingReplayError, match=r"model \(qwen3\) has no MoE layers.*rl.routing_replay: false"):
        dense.logprobs([{"tokens": torch.arange(4, 9), "routed_experts": good}])

    class NoHook(PackedLearnerSteps):  # e.g. the Megatron learner until it has the hook
        pass

    with pytest.raises(RoutingReplayError, match=r"NoHook cannot replay routed experts yet.*no replay hook"):
        NoHook()._batch_routes([{"tokens": torch.arange(4, 9), "routed_experts": good}])
    # a plain batch still works and reports no routing figures; the model is untouched after a replay
    lp, _ = tr.logprobs([torch.arange(4, 9)])
    assert tr.routing_stats == {} and all("forward" not in vars(r.module) for r in tr.moe_routers())


def test_validate_routes_accepts_int32():
    r = validate_routes(torch.zeros(3, 1, 2, dtype=torch.int32) + torch.tensor([0, 1], dtype=torch.int32),
                        positions=3, layers=1, top_k=2, num_experts=4, what="x")
    assert r.dtype == torch.long


def test_router_output_matches_hf_when_not_replayed():
    """The replay's weight formula on the learner's own top-k equals the HF router's scores (every arch), i.e.
    ROUTERS describes each router faithfully."""
    from miles_lp.train.routing_replay import replay_routes

    for arch in ARCHS:
        tr = _trainer(arch)
        for r in tr.moe_routers():
            h = torch.randn(6, tr.model.config.hidden_size)
            logits, scores, idx = r.module(h)
            with replay_routes([r], idx[:, None, :], torch.ones(6, dtype=torch.bool)):
                l2, s2, i2 = r.module(h)
            assert torch.equal(i2, idx) and torch.equal(s2, scores) and s2.dtype == scores.dtype, arch
            assert torch.equal(F.linear(h.to(l2.dtype), r.module.weight.to(l2.dtype)) if arch != "deepseek_v3"
                               else logits, l2), arch


def test_every_replay_backend_has_a_learner_with_the_hook():
    """The recipe accepts rl.routing_replay for the backends in REPLAY_BACKENDS: each one's learner replays."""
    from miles_lp.train.routing_replay import REPLAY_BACKENDS

    assert REPLAY_BACKENDS == {"embedded", "megatron"}
    assert EmbeddedTrainer.supports_routing_replay
    pytest.importorskip("megatron.core")
    from miles_lp.train.megatron.learner import MegatronLearner

    assert MegatronLearner.supports_routing_replay  # tests/unit/test_train_megatron_replay.py covers its semantics
