"""Megatron ranks placed as Ray actors (``ray_ranks.RayPlacement``): the same learner, the same numbers as spawned
processes. CPU here (gloo, ``gpus_per_node: 0``; one CPU per rank): a local Ray cluster on loopback
(``launch.ray_launcher.start_local_ray``), rank 0 in the test process, rank 1 a ``_RankActor`` in a placement
group that this placement reserves and removes. A rank that fails is named with its traceback and ends its
actor, as a spawned rank does. GPU placement (one GPU per actor, ``nodes x gpus_per_node`` = the world) did not
run here: only its refusals are tested.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path

import pytest
import torch

mc = pytest.importorskip("megatron.core", reason="megatron-core not installed (extra 'megatron')")
import ray  # noqa: E402 - a core dependency
from test_train_megatron_dp import CFG, Section, assert_equal_to_one_rank, run, seqs  # noqa: E402

from miles_lp.errors import ConfigError  # noqa: E402
from miles_lp.train.embedded import nll_loss, plan_for_model  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    import torch.distributed as dist

    from miles_lp.launch.ray_launcher import start_local_ray

    warnings.filterwarnings("ignore")
    assert not dist.is_initialized(), "another test module left a torch.distributed group behind"
    here = str(Path(__file__).parent)  # the actors unpickle this folder's config class
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False,
                    runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
    ray.shutdown()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from miles_lp.checkpoint.tiny import make_tiny_model

    return make_tiny_model("qwen3", tmp_path_factory.mktemp("megray") / "qwen3", num_layers=2)


def cfg(**megatron):
    return dataclasses.replace(CFG, megatron=Section(**megatron))


@pytest.mark.slow  # a Ray cluster, a 2-rank group and a one-rank learner: ~60 s on 2 cores
def test_dp2_on_ray_actors_equals_one_rank_and_a_failing_actor_is_named(cluster, ckpt):
    from miles_lp.cli.convert import policy_for_format
    from miles_lp.train.megatron.group import GroupError, MegatronGroup
    from miles_lp.train.megatron.learner import MegatronLearner
    from miles_lp.train.megatron.ray_ranks import RayPlacement

    plan = plan_for_model(policy_for_format("mxfp8"), ckpt)
    placement = RayPlacement(nodes=1, gpus_per_node=0)
    got = run(MegatronGroup(ckpt, plan, cfg(dp=2), placement=placement))
    assert placement._own_group is None  # the placement group it reserved is removed on close
    assert_equal_to_one_rank(got, run(MegatronLearner(ckpt, plan, CFG)))

    def rank1_fails(lp, ent, samples, totals):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise RuntimeError("boom on the actor")
        return nll_loss(lp, ent, samples, totals)

    g = MegatronGroup(ckpt, plan, cfg(dp=2), placement=RayPlacement())
    try:
        ranks = g.run_on_ranks(lambda learner: (learner.rank(), os.getpid()))
        assert [r for r, _ in ranks] == [0, 1] and ranks[1][1] != os.getpid()  # rank 1 lives in the actor
        with pytest.raises(GroupError, match=r"(?s)Megatron rank 1 failed during train_step.*boom on the actor"):
            g.train_step([{"tokens": s} for s in seqs()], rank1_fails)
        with pytest.raises(GroupError, match="the Megatron group is stopped"):
            g.logprobs(seqs())
    finally:
        g.close()
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_gpu_placement_refusals():
    from miles_lp.train.megatron.ray_ranks import RayPlacement

    gpu = dataclasses.replace(CFG, device="cuda")
    with pytest.raises(ConfigError, match=r"nodes=2 x gpus_per_node=2 = 4 GPUs, but the Megatron group has 8 ranks"):
        RayPlacement(nodes=2, gpus_per_node=2).check(8, gpu)
    with pytest.raises(ConfigError, match="gpus_per_node=0: a CUDA learner needs one GPU per rank"):
        RayPlacement().check(2, gpu)
    with pytest.raises(ConfigError, match="gpus_per_node=1 with a CPU learner"):
        RayPlacement(gpus_per_node=1).check(2, CFG)
    with pytest.raises(ConfigError, match=r"names the bundle of each rank > 0: 3 bundle\(s\)"):
        RayPlacement(placement_group=object(), bundles=[1]).check(4, CFG)
    if not ray.is_initialized():  # 2 x 4 = 8 ranks: the sizes pass, then Ray itself is needed
        with pytest.raises(ConfigError, match="Ray is not initialised in this process"):
            RayPlacement(nodes=2, gpus_per_node=4).check(8, gpu)
