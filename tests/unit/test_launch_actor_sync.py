"""sync.transport nccl / gloo: what the launcher refuses before any actor starts (the gloo run itself is the
slow test tests/e2e/test_run_ray.py::test_gloo_broadcast_sync_matches_the_object_store_path)."""

from __future__ import annotations

import pytest

from miles_lp.launch.recipe import load_recipe
from tests.e2e.test_run import RECIPE


def test_broadcast_transport_refusals(tmp_path):
    """NCCL on CPU, a broadcast without Ray, NCCL with both ranks on one GPU: refused, naming the keys."""
    from miles_lp.errors import ConfigError
    from miles_lp.launch.actor_sync import check_broadcast

    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.replace("OUT", str(tmp_path / "runs")))
    with pytest.raises(ConfigError, match=r"sync.transport: nccl needs CUDA devices .* on CPU use gloo"):
        check_broadcast(load_recipe(p, ["ray.enabled=true", "ray.placement=split", "sync.transport=nccl"]))
    with pytest.raises(ConfigError, match=r"set ray.enabled: true"):
        check_broadcast(load_recipe(p, ["sync.transport=gloo"]))
    gpu = ["ray.enabled=true", "sync.transport=nccl", "train.device=cuda", "rollout.device=cuda"]
    with pytest.raises(ConfigError, match=r"NCCL refuses two ranks on one device.*ray.placement: split"):
        check_broadcast(load_recipe(p, [*gpu, "ray.placement=colocate"]))
    check_broadcast(load_recipe(p, [*gpu, "ray.placement=split"]))  # accepted (not run here: no two GPUs)


def test_dry_run_names_the_broadcast_refusal(tmp_path):
    from miles_lp.launch.dry_run import dry_run

    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.replace("OUT", str(tmp_path / "runs")))
    out = dry_run(load_recipe(p, ["sync.transport=gloo"]))
    assert out["sync_transport"] == "gloo"
    assert any("set ray.enabled: true" in r for r in out["would_refuse_at_start"]), out["would_refuse_at_start"]
    assert not dry_run(load_recipe(p, ["sync.transport=gloo", "ray.enabled=true"]))["would_refuse_at_start"]
