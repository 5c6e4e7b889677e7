"""A loss function's own figures (``stats``, ``recorded``: ``rl.batch.GRPOLoss``'s, the RL metrics ``actor/pg_loss``,
``actor/pg_clipfrac``, ...) after a step of a ``MegatronGroup``: what it added on every rank that computes the loss
(tp rank 0 of the last pipeline stage of each data-parallel replica), as one rank computing every micro-batch has
them. Without the sum, rank 0 held its replica's share under dp and nothing at pp > 1 (the last stage computes the
loss). CPU, gloo, spawned ranks."""

from __future__ import annotations

import collections
import dataclasses
import warnings

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core not installed (extra 'megatron')")

from miles_lp.train.config import MegatronSection, TrainConfig  # noqa: E402
from miles_lp.train.embedded import nll_loss, plan_for_model  # noqa: E402

CFG = TrainConfig(backend="megatron", lr=1e-3, device="cpu", micro_batch_tokens=64, seed=3)
LENGTHS = (17, 30, 9, 40, 23, 50)  # 3 micro-batches of 64 tokens under MXFP8's 32-token padding


def figures_loss():
    """A loss function keeping figures (a local class: cloudpickled by value to the ranks)."""

    class Figures:
        def __init__(self):
            self.stats: dict[str, float] = collections.defaultdict(float)
            self.recorded: dict[int, torch.Tensor] = {}

        def __call__(self, lp, ent, samples, totals):
            loss = nll_loss(lp, ent, samples, totals)
            self.stats["loss"] += float(loss.detach())
            self.stats["samples"] += len(samples)
            for s in samples:
                self.recorded[int(s["index"])] = s["tokens"].float().sum()
            return loss
    return Figures()


def samples():
    g = torch.Generator().manual_seed(0)
    return [{"tokens": torch.randint(0, 256, (n,), generator=g), "index": i} for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    import torch.distributed as dist

    from miles_lp.checkpoint.tiny import make_tiny_model

    warnings.filterwarnings("ignore")
    assert not dist.is_initialized(), "another test module left a torch.distributed group behind"
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("megfig") / "qwen3", num_layers=2)


def step(learner, loss_fn):
    try:
        stats = learner.train_step(samples(), loss_fn)
    finally:
        learner.close()
    return stats


@pytest.mark.slow  # two 2-rank groups and a one-rank learner: ~1.5 min on 2 cores
def test_group_loss_figures_equal_one_ranks(ckpt):
    from miles_lp.cli.convert import policy_for_format
    from miles_lp.train.megatron.group import MegatronGroup
    from miles_lp.train.megatron.learner import MegatronLearner

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plan = plan_for_model(policy_for_format("mxfp8"), ckpt)
        one = figures_loss()
        step(MegatronLearner(ckpt, plan, CFG), one)
        assert one.stats["samples"] == len(LENGTHS) and sorted(one.recorded) == list(range(len(LENGTHS)))
        for sizes in ({"dp": 2}, {"pp": 2}):
            fig = figures_loss()
            fig.stats["loss"] = 1.0  # figures from an earlier mini-batch stay and are added to
            fig.stats["samples"] = 10.0
            step(MegatronGroup(ckpt, plan, dataclasses.replace(CFG, megatron=MegatronSection(**sizes))), fig)
            assert fig.stats["samples"] == 10.0 + len(LENGTHS), sizes
            assert fig.stats["loss"] == pytest.approx(1.0 + one.stats["loss"], rel=1e-6), sizes
            assert sorted(fig.recorded) == sorted(one.recorded), sizes
            assert all(torch.equal(fig.recorded[i], one.recorded[i]) for i in one.recorded)
    finally:
        torch.set_num_threads(n)
