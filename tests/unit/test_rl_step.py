"""The GRPO step's plumbing with small fakes (no model): stage order, mini-batches, corrections applied,
dynamic sampling, bypass mode, and the stops on non-finite values. The real stack runs in tests/e2e/test_run.py."""

from __future__ import annotations

import math

import pytest
import torch

from miles_lp.config import Where, parse_dataclass
from miles_lp.rl.config import RLConfig
from miles_lp.rl.step import RunError, StepParts, grpo_step
from miles_lp.rl.tasks import Prompt
from miles_lp.rollout.engine import Generation, SamplingParams


class Task:
    name, stop_token_ids, max_response_len = "fake", (2,), 2

    def prompts(self, step, n):
        return [Prompt((1, 4 + i), (4 + i, 2)) for i in range(n)]

    def reward(self, prompt, response):
        return 1.0 if list(response) == list(prompt.answer) else 0.0


class Engine:
    """Prompt i, sample j: output [4+i, 2] (right) for even j, [5, 5] (wrong) for odd j; log-probs fixed."""

    def __init__(self, lp=-1.0, all_right_prompt=None):
        self.weight_version, self.calls, self.lp, self.all_right = 1, [], lp, all_right_prompt

    def generate(self, inputs, sampling):
        self.calls.append(sampling.seed)
        out = []
        for k, ids in enumerate(inputs):
            right = k % 2 == 0 or ids[1] - 4 == self.all_right
            ids_out = [ids[1], 2] if right else [5, 5]
            out.append(Generation(ids_out, torch.full((2,), self.lp), "stop" if right else "length",
                                  self.weight_version))
        return out


class Learner:
    """log p = theta on every position (one shared parameter), so gradients and ratios are known."""

    def __init__(self, lp=-1.0):
        self.theta = torch.nn.Parameter(torch.tensor(lp))
        self.step, self.calls, self.batches = 0, [], []

    def logprobs(self, batch):
        self.calls.append("logprobs")
        seqs = [b["tokens"] if isinstance(b, dict) else b for b in batch]
        return ([torch.full((s.numel() - 1,), float(self.theta.detach())) for s in seqs],
                [torch.full((s.numel() - 1,), 0.5) for s in seqs])

    def train_step(self, samples, loss_fn):
        self.calls.append("train_step")
        self.batches.append(len(samples))
        lps = [self.theta.expand(s["tokens"].numel() - 1) for s in samples]
        ents = [torch.full((s["tokens"].numel() - 1,), 0.5) for s in samples]
        totals = {"tokens": int(sum(float(s["loss_mask"].sum()) for s in samples)), "sequences": len(samples)}
        loss = loss_fn(lps, ents, samples, totals)
        loss.backward()
        g = float(self.theta.grad)
        self.theta.grad = None
        self.step += 1
        return {"loss": float(loss), "grad_norm": abs(g), "tokens": sum(int(s["tokens"].numel()) for s in samples)}


class Sync:
    def __init__(self, engine):
        self.engine, self.n = engine, 0

    def sync(self, learner):
        self.n += 1
        self.engine.weight_version += 1
        return type("R", (), {"metrics": {"perf/sync_seconds": 0.0, "perf/sync_check_seconds": 0.0,
                                          "sync/check/grid": 1.0}})()


def rl(**kw):
    base = {"prompts_per_step": 2, "group_size": 2, "mini_batches": 2}
    base.update(kw)
    return parse_dataclass(RLConfig, base, Where("<t>", "rl"))


def parts(cfg, engine=None, learner=None):
    engine = engine or Engine()
    return StepParts(learner=learner or Learner(), engine=engine, sync=Sync(engine), task=Task(),
                     sampling=SamplingParams(max_new_tokens=2), rl=cfg, seed=3)


def test_stage_order_metrics_and_seed():
    p = parts(rl())
    m = grpo_step(p, 5)
    assert p.learner.calls == ["logprobs", "train_step", "train_step"]  # old pass, then 2 mini-batches
    assert p.learner.batches == [2, 2] and p.sync.n == 1
    assert m["reward/mean"] == 0.5 and m["rl/optimizer_steps"] == 2.0 and m["response_length/clip_ratio"] == 0.5
    assert m["rollout_corr/kl"] == 0.0 and m["rollout_corr/chi2_token"] == 0.0  # engine and learner agree
    assert m["actor/entropy"] == 0.5
    for stage in ("generate", "reward", "old_log_prob", "update_actor", "sync", "checks"):
        assert f"timing_s/{stage}" in m
    assert m["tokens/generate"] == 8.0 and m["tokens/old_log_prob"] == 16.0
    assert p.engine.calls and p.engine.calls == [grpo_step.__globals__["step_seed"](3, 5)]
    grpo_step(parts(rl()), 6)


def test_mismatch_metrics_compare_engine_and_learner_before_the_update():
    p = parts(rl(), engine=Engine(lp=-1.5), learner=Learner(lp=-1.0))
    m = grpo_step(p, 0)
    assert m["rollout_corr/kl"] == pytest.approx(-0.5)  # mean(lp_rollout - lp_train)
    assert m["rollout_corr/logprob_abs_diff_mean"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(min(math.exp(0.5), 2.0))


def test_correction_weights_reach_the_loss():
    # rollout lp -1.5, learner -1.0: token IS weight e^.5 = 1.6487; TIS at 1.2 truncates to 1.2
    p_is = parts(rl(mini_batches=1, rollout_correction={"rollout_is": "token", "rollout_is_threshold": 1.2}),
                 engine=Engine(lp=-1.5))
    p_no = parts(rl(mini_batches=1), engine=Engine(lp=-1.5))
    m_is, m_no = grpo_step(p_is, 0), grpo_step(p_no, 0)
    assert m_is["actor/grad_norm"] == pytest.approx(1.2 * m_no["actor/grad_norm"], rel=1e-5)
    # rejection: token_k1 with bounds [0.9, 1.1] rejects every token (|log ratio| = .5): nothing trains
    p_rs = parts(rl(mini_batches=1, rollout_correction={"rollout_rs": "token_k1", "rollout_rs_threshold": "0.9_1.1"}),
                 engine=Engine(lp=-1.5))
    m_rs = grpo_step(p_rs, 0)
    assert m_rs["rollout_corr/rollout_rs_masked_fraction"] == 1.0 and m_rs["actor/grad_norm"] == 0.0


def test_dynamic_sampling_drops_all_equal_groups():
    # prompt 1 answered right by every sample: its group has zero variance and is dropped
    p = parts(rl(dynamic_sampling=True), engine=Engine(all_right_prompt=1))
    m = grpo_step(p, 0)
    assert m["rl/groups_kept"] == 1.0 and m["rl/samples_trained"] == 2.0 and p.learner.batches == [1, 1]
    # every group all-equal: no optimizer step and no sync
    p2 = parts(rl(dynamic_sampling=True, group_size=2, prompts_per_step=1), engine=Engine(all_right_prompt=0))
    m2 = grpo_step(p2, 0)
    assert m2["rl/optimizer_steps"] == 0.0 and p2.sync.n == 0 and "timing_s/sync" not in m2


def test_bypass_mode_skips_the_old_pass_and_measures_mismatch_on_the_first_mini_batch():
    p = parts(rl(rollout_correction={"bypass_mode": True}), engine=Engine(lp=-1.5), learner=Learner(lp=-1.0))
    m = grpo_step(p, 0)
    assert p.learner.calls == ["train_step", "train_step"]
    assert m["rollout_corr/kl"] == pytest.approx(-0.5) and "timing_s/old_log_prob" not in m


def test_kl_reference_pass_only_when_coefficient_positive():
    ref = Learner(lp=-2.0)
    p = parts(rl(kl_coef=0.5, kl_estimator="k1"))
    p.reference = ref
    m = grpo_step(p, 0)
    assert ref.calls == ["logprobs"] and m["actor/kl_loss"] == pytest.approx(1.0)  # k1 = -1 - (-2)
    assert "tokens/ref" in m and m["tokens/ref"] > 0


def test_nonfinite_values_stop_the_step_naming_it():
    eng = Engine()
    real = eng.generate

    def nan_gen(inputs, sampling):
        g = real(inputs, sampling)
        g[1].logprobs[1] = float("nan")
        return g
    eng.generate = nan_gen
    with pytest.raises(RunError, match="step 7: non-finite rollout log-probs from the engine in sample 1"):
        grpo_step(parts(rl(), engine=eng), 7)
    with pytest.raises(RunError, match="step 2: non-finite learner log-probs"):
        grpo_step(parts(rl(), learner=Learner(lp=float("inf"))), 2)

    class NanLoss(Learner):
        def train_step(self, samples, loss_fn):
            s = super().train_step(samples, loss_fn)
            s["loss"] = float("nan")
            return s
    with pytest.raises(RunError, match="step 4: non-finite loss or gradient .* mini-batch 0"):
        grpo_step(parts(rl(), learner=NanLoss()), 4)


# ---- routing replay (Miles R3): the step's plumbing; the learner side is tests/unit/test_train_routing_replay.py
class RoutingEngine(Engine):
    """Engine that returns routes [len(prompt) + len(output) - 1, 1 layer, top 2] (``drop``: samples without)."""

    def __init__(self, drop=()):
        super().__init__()
        self.drop, self.sampling = set(drop), None

    def generate(self, inputs, sampling):
        self.sampling = sampling
        out = super().generate(inputs, sampling)
        for i, (ids, g) in enumerate(zip(inputs, out, strict=True)):
            if i not in self.drop:
                g.routed_experts = torch.full((len(ids) + len(g.output_ids) - 1, 1, 2), i)
        return out


class RoutingLearner(Learner):
    def __init__(self):
        super().__init__()
        self.seen, self.routing_stats = [], {}

    def logprobs(self, batch):
        self.seen.append(("logprobs", list(batch)))
        self.routing_stats = {"routing_agreement": 0.75, "routing_agreement_token": 0.5}
        return super().logprobs(batch)

    def train_step(self, samples, loss_fn):
        self.seen.append(("train_step", list(samples)))
        return {**super().train_step(samples, loss_fn), "routing_agreement": 0.25 * len(self.seen)}


def test_routing_replay_routes_travel_to_the_learner_not_the_reference():
    eng, lrn, ref = RoutingEngine(), RoutingLearner(), RoutingLearner()
    p = parts(rl(routing_replay=True, kl_coef=0.1), engine=eng, learner=lrn)
    p.reference = ref
    m = grpo_step(p, 0)
    assert eng.sampling.return_routed_experts  # asked of the engine
    kind, items = lrn.seen[0]
    assert kind == "logprobs" and all(isinstance(b, dict) for b in items)
    for i, b in enumerate(items):  # sample i carries the engine's routes for sample i, aligned with its tokens
        assert b["index"] == i and b["routed_experts"].shape == (b["tokens"].numel() - 1, 1, 2)
        assert int(b["routed_experts"][0, 0, 0]) == i
    for kind, samples in lrn.seen[1:]:  # both mini-batches train on the replayed routes
        assert kind == "train_step" and all(int(s["routed_experts"][0, 0, 0]) == s["index"] for s in samples)
    assert all(isinstance(b, torch.Tensor) for b in ref.seen[0][1])  # the frozen reference: tokens only
    assert m["rollout_corr/routing_agreement"] == 0.75 and m["rollout_corr/routing_agreement_token"] == 0.5
    assert m["actor/routing_agreement"] == pytest.approx((0.5 + 0.75) / 2)
    # off: no routes asked for, none sent, no routing figures
    eng2, lrn2 = RoutingEngine(), RoutingLearner()
    m2 = grpo_step(parts(rl(), engine=eng2, learner=lrn2), 0)
    assert not eng2.sampling.return_routed_experts and isinstance(lrn2.seen[0][1][0], torch.Tensor)
    assert "routing_replayed" not in str(m2) and "rollout_corr/routing_agreement" not in m2


def test_routing_replay_bypass_mode_takes_agreement_from_the_first_mini_batch():
    lrn = RoutingLearner()
    m = grpo_step(parts(rl(routing_replay=True, rollout_correction={"bypass_mode": True}), engine=RoutingEngine(),
                        learner=lrn), 0)
    assert [k for k, _ in lrn.seen] == ["train_step", "train_step"]
    assert m["rollout_corr/routing_agreement"] == 0.25  # mini-batch 0 (before any update)


def test_routing_replay_missing_routes_stop_the_step_naming_the_sample():
    with pytest.raises(RunError, match=r"step 4: rl.routing_replay is on but the engine returned no routed experts "
                                       r"for sample 2 \(prompt \[1, 5\]; 1 of 4 samples lack them\)"):
        grpo_step(parts(rl(routing_replay=True), engine=RoutingEngine(drop={2}), learner=RoutingLearner()), 4)
    with pytest.raises(RunError, match=r"no routed experts for any sample: a dense model \(no MoE layers\)"):
        grpo_step(parts(rl(routing_replay=True), engine=RoutingEngine(drop=range(4)), learner=RoutingLearner()), 0)


class AbortingEngine(Engine):
    """Engine whose first ``times`` calls end prompt ``group``'s samples with ``abort`` (another client's
    ``/pause_generation`` with mode abort); later calls answer normally."""

    def __init__(self, group, times, **kw):
        super().__init__(**kw)
        self.group, self.times, self.inputs = group, times, []

    def generate(self, inputs, sampling):
        self.inputs.append([list(i) for i in inputs])
        out = super().generate(inputs, sampling)
        if len(self.calls) <= self.times:
            out = [Generation(g.output_ids[:1], g.logprobs[:1], "abort", g.weight_version)
                   if ids[1] - 4 == self.group else g for g, ids in zip(out, inputs, strict=True)]
        return out


def test_aborted_groups_are_regenerated_then_dropped_and_counted():
    # regenerated once (the default): the step trains on every group, as if nothing was aborted
    clean = grpo_step(parts(rl()), 0)
    p = parts(rl(), engine=AbortingEngine(group=1, times=1))
    m = grpo_step(p, 0)
    assert p.engine.inputs[1] == [[1, 5], [1, 5]]  # only the aborted group is sampled again ...
    assert p.engine.calls[1] != p.engine.calls[0]  # ... under its own seed
    assert m["rollout/aborted"] == 2.0 and m["rollout/regenerated"] == 2.0 and m["rollout/aborted_groups_dropped"] == 0
    assert m["rl/samples_trained"] == 4.0 and m["reward/mean"] == clean["reward/mean"]
    assert clean["rollout/aborted"] == 0.0 and clean["rollout/regenerated"] == 0.0
    # still aborted after the retries: the group is dropped whole (no reward, no loss tokens, no rollout_corr)
    p = parts(rl(abort_retries=1), engine=AbortingEngine(group=1, times=99, lp=-1.5))
    m = grpo_step(p, 0)
    assert m["rollout/aborted"] == 4.0 and m["rollout/aborted_groups_dropped"] == 1.0
    assert m["rl/samples_trained"] == 2.0 and m["rl/groups_kept"] == 1.0 and sum(p.learner.batches) == 2
    assert m["response_length/max"] == 2.0  # the cut-short (1-token) responses are not measured
    p0 = parts(rl(abort_retries=0), engine=AbortingEngine(group=1, times=99))
    m0 = grpo_step(p0, 0)
    assert len(p0.engine.calls) == 1 and m0["rollout/aborted_groups_dropped"] == 1.0 and m0["rollout/regenerated"] == 0
    # every group aborted: nothing to train on, the step stops naming it
    every = AbortingEngine(group=0, times=99)
    p = StepParts(learner=Learner(), engine=every, sync=Sync(every), task=Task(), sampling=SamplingParams(max_new_tokens=2),
                  rl=rl(prompts_per_step=1, group_size=2, mini_batches=1), seed=3)
    with pytest.raises(RunError, match=r"step 4: the engine aborted a generation in every group \(1 groups"):
        grpo_step(p, 4)
    assert p.learner.calls == [] and p.sync.n == 0
    with pytest.raises(Exception, match=r"rl.abort_retries.: must be >= 0"):
        rl(abort_retries=-1)


class _CapEngine(Engine):
    """Every sample the same capped response: every group all-equal (dropped), every response at the length cap."""

    def generate(self, inputs, sampling):
        return [Generation([5, 5], torch.full((2,), -1.0), "length", self.weight_version) for _ in inputs]


class _SentinelSync(Sync):
    def __init__(self, engine, mode):
        from miles_lp.sync.config import SentinelConfig
        from miles_lp.sync.sentinel import Sentinel

        super().__init__(engine)
        self.sentinel, self._mode, self.lines = Sentinel(SentinelConfig(consecutive_steps=1)), mode, []

    def mode(self, name):
        return self._mode

    def log(self, line):
        self.lines.append(line)


@pytest.mark.parametrize("mode", ["warn", "raise"])
def test_a_step_without_a_sync_still_reports_its_sentinel_verdict(mode):
    """Every group dropped -> no optimizer step, no sync; the step's C6 verdict (every response at the
    length cap) is still in its metrics and log line, and fails the step in raise mode."""
    import dataclasses

    p = parts(rl(dynamic_sampling=True, group_size=2, prompts_per_step=1), engine=_CapEngine())
    p = dataclasses.replace(p, sync=_SentinelSync(p.engine, mode))
    if mode == "raise":
        with pytest.raises(RunError, match=r"step 0: C6 sentinel: failed.*length cap.*no optimizer step"):
            grpo_step(p, 0)
        return
    m = grpo_step(p, 0)
    assert m["rl/optimizer_steps"] == 0.0 and p.sync.n == 0
    assert m["sync/check/sentinel"] == 0.0 and "FAILED" in p.sync.lines[0] and "length cap" in p.sync.lines[0]
