"""Ray launcher pieces that need no cluster: address checks and placement bundles."""

from __future__ import annotations

import socket

import pytest

from miles_lp.errors import ConfigError
from miles_lp.launch.ray_launcher import _bundles, _check_reachable, _init_ray
from miles_lp.launch.recipe import load_recipe_text

BASE = "model: {path: 'tiny:qwen3'}\nprecision: {default: mxfp8}\nsteps: 1\n"


def test_unreachable_address_is_named_fast():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # a port nobody listens on
    r = load_recipe_text(BASE + f"ray: {{enabled: true, address: '127.0.0.1:{port}'}}\n")
    with pytest.raises(ConfigError, match=f"ray.address '127.0.0.1:{port}': nothing answers"):
        _init_ray(r)
    with pytest.raises(ConfigError, match="expected host:port"):
        _check_reachable("nowhere")


def test_placement_bundles():
    co = load_recipe_text(BASE + "ray: {enabled: true, placement: colocate, learner: {num_cpus: 1, num_gpus: 1}, "
                                 "rollout: {num_cpus: 2, num_gpus: 1}}\n")
    assert _bundles(co) == [{"CPU": 3.0, "GPU": 1.0}]  # one GPU shared by both roles
    sp = load_recipe_text(BASE + "ray: {enabled: true, placement: split, rollout: {num_cpus: 2}}\n")
    assert _bundles(sp) == [{"CPU": 1.0}, {"CPU": 2.0}]
    with pytest.raises(ConfigError, match="num_cpus sizes a local cluster"):
        load_recipe_text(BASE + "ray: {enabled: true, address: auto, num_cpus: 2}\n")


def test_wire_roundtrip_is_bit_exact():
    import torch

    from miles_lp.formats import quantize_mxfp8
    from miles_lp.launch.wire import pack, unpack
    from miles_lp.rollout.engine import Generation

    x = torch.randn(4, 64).bfloat16()
    q = quantize_mxfp8(x)
    g = Generation([1, 2], torch.tensor([-0.5, float("nan")]), "stop", 3)
    back = unpack(pack({"q": q, "g": [g], "t": (torch.tensor(5), torch.empty(0, 3))}))
    assert torch.equal(back["q"].data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(back["q"].scale, q.scale) and type(back["q"]) is type(q)
    assert back["g"][0].output_ids == [1, 2] and torch.equal(back["g"][0].logprobs.isnan(), g.logprobs.isnan())
    assert back["t"][0].item() == 5 and back["t"][1].shape == (0, 3)


class _Remote:
    """An actor method as the proxy calls it (``.remote(...)``), run at once; ``ray.get`` is patched to identity."""

    def __init__(self, fn):
        self.remote = fn


class _FakeActor:
    def __init__(self, worker):
        for name in ("get", "set", "call", "surface"):
            setattr(self, name, _Remote(getattr(worker, name)))


def _fake_engine_actor(engine):
    from miles_lp.launch.ray_launcher import EngineWorker

    worker = EngineWorker.__new__(EngineWorker)  # no recipe, no checkpoint: the wrapper around ``engine`` only
    worker.engine = engine
    return _FakeActor(worker)


class _RotatingEngine:
    """Stands for the reference / vLLM engine: a plain ``c3_rotation_base`` and its own weight-version count."""

    def __init__(self):
        self.weight_version, self.c3_rotation_base = 0, 0

    def generate(self, prompts, params):
        return []


class _HttpEngine:
    """Stands for the HTTP SGLang adapter: no ``c3_rotation_base`` (the run must skip it, not fail)."""

    def __init__(self):
        self.weight_version = 0

    def generate(self, prompts, params):
        return []


def test_engine_proxy_sets_the_actor_engines_rotation_base(monkeypatch):
    """``runner._rotation_base`` on the proxy sets the attribute in the actor's engine (a proxy-local attribute
    would leave the engine counting from its own start); an engine without it is skipped; a name the engine
    lacks is refused in the actor."""
    import ray

    from miles_lp.launch.ray_launcher import EngineProxy
    from miles_lp.launch.runner import _rotation_base

    monkeypatch.setattr(ray, "get", lambda x, **kw: x)
    eng = _RotatingEngine()
    proxy = EngineProxy(_fake_engine_actor(eng))
    _rotation_base(proxy, 7)
    assert eng.c3_rotation_base == 7 and proxy.c3_rotation_base == 7 and "c3_rotation_base" not in vars(proxy)
    http = _HttpEngine()
    hp = EngineProxy(_fake_engine_actor(http))
    _rotation_base(hp, 7)
    assert not hasattr(http, "c3_rotation_base") and not hasattr(hp, "c3_rotation_base")
    worker_set = _fake_engine_actor(http).set.remote
    with pytest.raises(AttributeError, match="_HttpEngine.*no attribute 'c3_rotation_base' to set"):
        worker_set("c3_rotation_base", 7)


def test_restarted_actor_engine_gets_the_runs_sync_count(monkeypatch):
    """``RayRun.restart_engine``: the fresh actor's engine counts versions from its own start, so its
    ``c3_rotation_base`` must be the run's syncs before it (resumed at 2 + 3 served by the dead engine: 5), set
    after the full resync and before the re-run step's sync; the HTTP adapter (no attribute) restarts too."""
    import types

    import ray

    from miles_lp.launch.ray_launcher import EngineProxy, RayRun

    monkeypatch.setattr(ray, "get", lambda x, **kw: x)
    monkeypatch.setattr(ray, "kill", lambda actor: None)

    def restart(make):
        dead, fresh = make(), make()
        dead.weight_version = 4  # its initial sync (1) + 3 step syncs

        class Sync:
            expected_version = 4

            def initial_sync(self, learner):
                fresh.weight_version += 1
                self.expected_version = fresh.weight_version
                return types.SimpleNamespace(weight_version=1)

        run = RayRun.__new__(RayRun)  # the restart path alone: no cluster, no recipe
        run.engine_actor = _fake_engine_actor(dead)
        run.engine = EngineProxy(run.engine_actor)
        run.sync, run.learner, run.restarts, run.version_offset = Sync(), None, 0, 2
        run.initial = types.SimpleNamespace(weight_version=1)
        run._start_engine = lambda: _fake_engine_actor(fresh)
        run.restart_engine()
        assert run.restarts == 1 and run.version_offset == 5 and run.engine.weight_version == 1
        return dead, fresh

    dead, fresh = restart(_RotatingEngine)
    assert fresh.c3_rotation_base == 5 and dead.c3_rotation_base == 0
    _, fresh = restart(_HttpEngine)
    assert not hasattr(fresh, "c3_rotation_base")


def test_local_cluster_start_switches_ray_to_loopback_for_the_init_only(monkeypatch):
    """start_local_ray: during ray.init Ray's multi-node switch is off, in this process and in the
    environment its processes inherit, so the node IP (which its servers bind) is loopback; restored after, also
    when ray.init fails. The sockets themselves are measured in tests/e2e/test_run_ray_loopback.py (slow)."""
    import os

    import ray
    from ray._private import ray_constants

    from miles_lp.launch import ray_launcher

    var = ray_launcher.MULTI_NODE_VAR
    seen = []

    def fake_init(**kw):
        from ray._private import services

        seen.append((ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(var), services.get_node_ip_address(), kw))
        raise RuntimeError("no cluster in a unit test")

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setenv(var, "1")
    switch = ray_constants.ENABLE_RAY_CLUSTER
    with pytest.raises(RuntimeError, match="no cluster"):
        ray_launcher.start_local_ray(num_cpus=1, include_dashboard=False)
    assert seen == [(False, "0", "127.0.0.1", {"num_cpus": 1, "include_dashboard": False})]
    assert ray_constants.ENABLE_RAY_CLUSTER == switch and os.environ[var] == "1"
    monkeypatch.delenv(var)
    with pytest.raises(RuntimeError):
        ray_launcher.start_local_ray()
    assert var not in os.environ and ray_constants.ENABLE_RAY_CLUSTER == switch
