"""``rollout.engines`` / ``rollout.urls``: parsed into the recipe's fleet, every bad combination refused naming
the key; several engines for a comparison arm refused at start (and by --dry-run)."""

from __future__ import annotations

import pytest

from miles_lp.errors import ConfigError
from miles_lp.launch.engines import check_fleet, engines_of
from miles_lp.launch.recipe import load_recipe
from tests.e2e.test_run import RECIPE

SGL = ["rollout.backend=sglang", "rollout.device=auto"]


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.replace("OUT", str(tmp_path / "runs")))
    return p


def test_engines_and_urls_give_the_count(path):
    assert engines_of(load_recipe(path)) == 1
    assert engines_of(load_recipe(path, ["rollout.engines=3"])) == 3
    r = load_recipe(path, [*SGL, "rollout.urls=[http://127.0.0.1:30000, http://127.0.0.1:30001]"])
    assert engines_of(r) == 2 and r.fleet.urls[1] == "http://127.0.0.1:30001"
    assert r.rollout.url == "http://127.0.0.1:30000"


@pytest.mark.parametrize("sets, match", [
    (["rollout.engines=0"], r"'rollout.engines': must be an integer >= 1"),
    (["rollout.urls=[http://127.0.0.1:30000]"], r"'rollout.urls': urls names running SGLang servers"),
    ([*SGL, "rollout.url=http://127.0.0.1:1", "rollout.urls=[http://127.0.0.1:2]"], r"either url .* or urls"),
    ([*SGL, "rollout.urls=[http://127.0.0.1:2, http://127.0.0.1:2]"], r"a server is named twice"),
    ([*SGL, "rollout.engines=3", "rollout.urls=[http://127.0.0.1:2, http://127.0.0.1:3]"], r"engines: 3 but urls"),
    ([*SGL, "rollout.engines=2", "rollout.url=http://127.0.0.1:2"], r"name each server in urls"),
    ([*SGL, "rollout.urls=[http://127.0.0.1:2, 'ftp://x:1']"], r"rollout.urls.1"),
])
def test_bad_fleet_keys_are_refused_by_name(path, sets, match):
    with pytest.raises(ConfigError, match=match):
        load_recipe(path, sets)


def test_several_engines_take_every_transport_but_not_a_comparison_arm(path):
    for transport in ("gloo", "ray"):
        check_fleet(load_recipe(path, ["rollout.engines=2", "ray.enabled=true", f"sync.transport={transport}"]))
    from pathlib import Path

    arm = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "tiny-mxfp8-bf16-sampler.yaml",
                      ["rollout.engines=2"])
    with pytest.raises(ConfigError, match=r"rollout.engines: 2 with sampler_precision"):
        check_fleet(arm)
