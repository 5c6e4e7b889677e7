"""``ray.learner`` against the learner's ranks (``launch/ray_layout.py``) and the placement group the launcher asks
for (``ray_launcher._bundles``): one bundle per Megatron rank, the refusals naming keys and sizes. No cluster."""

from __future__ import annotations

import pytest

from miles_lp.errors import ConfigError
from miles_lp.launch.recipe import load_recipe
from tests.e2e.test_run import RECIPE


def _recipe(tmp_path, *sets):
    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.replace("OUT", str(tmp_path / "runs")))
    return load_recipe(p, ["ray.enabled=true", "train.backend=megatron", *sets])


def _config(arch="qwen3_moe"):
    from miles_lp.checkpoint.tiny import tiny_config

    return tiny_config(arch, 2).to_dict()


def test_cpu_ranks_one_bundle_each_after_rank_0_then_the_engines(tmp_path):
    from miles_lp.launch.ray_launcher import _bundles, rank_bundles
    from miles_lp.launch.ray_layout import learner_layout

    r = _recipe(tmp_path, "train.megatron.ep=2", "train.megatron.dp=4", "rollout.engines=2", "ray.placement=split",
                "ray.learner.num_cpus=2", "ray.rollout.num_cpus=1")
    layout = learner_layout(r, _config())
    assert (layout.world, layout.nodes, layout.gpus_per_node, layout.cpus_per_rank) == (4, 1, 0, 0.5)
    assert layout.device == "cpu"
    assert _bundles(r, layout) == [{"CPU": 0.5}] * 4 + [{"CPU": 1.0}] * 2
    assert rank_bundles(layout) == [1, 2, 3]
    colo = _recipe(tmp_path, "train.megatron.tp=2", "rollout.engines=2", "ray.placement=colocate")
    lay = learner_layout(colo, _config("qwen3"))
    assert lay.world == 2
    assert _bundles(colo, lay) == [{"CPU": 0.5 + 2.0}, {"CPU": 0.5}]  # rank 0 holds the engines under colocate


def test_one_rank_learner_keeps_one_actor_with_its_resources(tmp_path):
    from miles_lp.launch.ray_launcher import _bundles
    from miles_lp.launch.ray_layout import learner_layout

    r = _recipe(tmp_path, "ray.placement=split", "ray.learner.num_cpus=3")
    assert learner_layout(r, _config("qwen3")) is None
    assert _bundles(r, None) == [{"CPU": 3.0}, {"CPU": 1.0}]
    with pytest.raises(ConfigError, match=r"ray.learner.nodes=2: the learner has one rank"):
        learner_layout(_recipe(tmp_path, "ray.learner.nodes=2"), _config("qwen3"))


def test_gpu_layout_one_gpu_per_rank_and_auto_device_follows_it(tmp_path):
    from miles_lp.launch.ray_launcher import _bundles
    from miles_lp.launch.ray_layout import learner_layout

    # the full-scale recipes' form: num_gpus is one node's GPUs; nodes follow from the world
    r = _recipe(tmp_path, "train.device=auto", "train.megatron.ep=2", "train.megatron.dp=4",
                "ray.learner.num_gpus=2", "ray.learner.num_cpus=8", "ray.placement=split")
    layout = learner_layout(r, _config())
    assert (layout.nodes, layout.gpus_per_node, layout.cpus_per_rank, layout.device) == (2, 2, 4.0, "cuda")
    assert _bundles(r, layout)[:4] == [{"CPU": 4.0, "GPU": 1.0}] * 4
    r = _recipe(tmp_path, "train.device=auto", "train.megatron.tp=2", "train.megatron.dp=2",
                "ray.learner.nodes=1", "ray.learner.gpus_per_node=4")
    assert learner_layout(r, _config("qwen3")).nodes == 1


@pytest.mark.parametrize("sets, message", [
    (["train.device=auto", "ray.learner.nodes=2", "ray.learner.gpus_per_node=4"],
     r"ray.learner: nodes=2 x gpus_per_node=4 = 8 GPUs, but the learner has train.megatron tp=2 x pp=1 x dp=2 = 4 "
     r"ranks \(one GPU each\)"),
    (["train.device=auto", "ray.learner.gpus_per_node=3"], r"nodes=1 x gpus_per_node=3 = 3 GPUs.* = 4 ranks"),
    (["train.device=cpu", "ray.learner.gpus_per_node=4"], r"ray.learner.gpus_per_node=4 with train.device: cpu"),
    (["train.device=cuda", "ray.learner.gpus_per_node=0"], r"train.device: cuda needs one GPU per learner rank"),
    (["train.device=auto", "ray.learner.num_gpus=4", "ray.learner.gpus_per_node=2"],
     r"ray.learner.num_gpus=4.0 and ray.learner.gpus_per_node=2 disagree"),
    (["train.device=auto", "ray.learner.num_gpus=0.5"], r"ray.learner.num_gpus=0.5: a learner of 4 ranks takes one "
                                                        r"whole GPU per rank"),
    (["train.device=cpu", "ray.learner.nodes=3"], r"ray.learner.nodes=3 does not divide the learner's "
                                                  r"train.megatron tp=2 x pp=1 x dp=2 = 4 ranks"),
])
def test_layouts_that_do_not_hold_the_world_are_refused_naming_sizes(tmp_path, sets, message):
    from miles_lp.launch.ray_layout import learner_layout

    r = _recipe(tmp_path, "train.megatron.tp=2", "train.megatron.dp=2", *sets)
    with pytest.raises(ConfigError, match=message):
        learner_layout(r, _config("qwen3"))


def test_unknown_and_bad_learner_keys_are_refused_with_the_yaml_key(tmp_path):
    with pytest.raises(ConfigError, match=r"ray\.learner.*gpu_per_node"):
        _recipe(tmp_path, "ray.learner.gpu_per_node=4")
    with pytest.raises(ConfigError, match=r"ray\.learner\.nodes.*must be >= 1"):
        _recipe(tmp_path, "ray.learner.nodes=0")
    with pytest.raises(ConfigError, match=r"ray\.learner\.gpus_per_node.*must be >= 0"):
        _recipe(tmp_path, "ray.learner.gpus_per_node=-1")


def test_dry_run_lists_the_rank_actors_and_a_layout_that_does_not_fit(tmp_path):
    from miles_lp.launch.dry_run import dry_run

    out = dry_run(_recipe(tmp_path, "model.path=tiny:qwen3", "train.megatron.tp=2", "train.megatron.dp=2",
                          "ray.learner.num_cpus=4"))
    assert out["ray"]["learner_ranks"] == {"ranks": 4, "nodes": 1, "gpus_per_node": 0, "cpus_per_rank": 1.0,
                                           "actor_per_rank": True}
    bad = dry_run(_recipe(tmp_path, "model.path=tiny:qwen3", "train.megatron.tp=2", "train.megatron.dp=2",
                          "ray.learner.nodes=3"))
    assert bad["ray"]["learner_ranks"] is None
    assert any("ray.learner.nodes=3 does not divide" in line for line in bad["would_refuse_at_start"])


@pytest.mark.parametrize("recipe, fixture, ranks, nodes, gpus", [
    ("qwen3-8b-mxfp8.yaml", "qwen3-8b", 4, 1, 4),
    ("qwen3-30b-a3b-mxfp8.yaml", "qwen3-30b-a3b", 8, 1, 8),
    ("deepseek-v3-mxfp8.yaml", "deepseek-v3", 128, 16, 8),  # the Transformer Engine refusal does not hide it
])
def test_full_scale_recipes_place_one_gpu_per_rank(recipe, fixture, ranks, nodes, gpus):
    from pathlib import Path

    from miles_lp.launch.dry_run import dry_run

    root = Path(__file__).resolve().parents[2]
    r = load_recipe(root / "recipes" / recipe, [f"model.path={root / 'tests/fixtures/configs' / fixture}"])
    out = dry_run(r)
    assert out["ray"]["learner_ranks"] == {"ranks": ranks, "nodes": nodes, "gpus_per_node": gpus,
                                           "cpus_per_rank": 8.0, "actor_per_rank": True}
    assert not any(line.startswith("ray.learner") for line in out["would_refuse_at_start"])
