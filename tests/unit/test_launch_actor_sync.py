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


def _listening(port: int) -> list[str]:
    import os

    import psutil

    return sorted({c.laddr.ip for c in psutil.net_connections(kind="inet") if c.pid == os.getpid()
                   and c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port})


def test_the_group_store_listens_on_the_nodes_address_only():
    """The broadcast group's rendezvous store (rank 0, in the learner actor) listens on the node's
    address (127.0.0.1 in the local cluster), not on every interface as torch's own TCPStore server does."""
    import datetime
    import socket
    import threading

    import torch.distributed as dist

    from miles_lp.launch.actor_sync import group_store

    timeout = datetime.timedelta(seconds=30)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stores = {}
    master = threading.Thread(target=lambda: stores.setdefault(0, group_store("127.0.0.1", port, 0, timeout)))
    master.start()  # waits for the other rank, as in the actor
    stores[1] = group_store("127.0.0.1", port, 1, timeout)
    master.join(timeout=30)
    stores[0].set("k", "v")
    assert stores[1].get("k") == b"v"  # the two ranks rendezvous through it
    assert _listening(port) == ["127.0.0.1"]
    # what init_method="tcp://127.0.0.1:PORT" starts instead: the measurement sees every interface
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        plain_port = s.getsockname()[1]
    plain = dist.TCPStore("127.0.0.1", plain_port, 1, True, timeout)
    assert plain.num_keys() >= 0 and _listening(plain_port)
    assert not all(ip.startswith(("127.", "::ffff:127.")) for ip in _listening(plain_port)), _listening(plain_port)


def test_actor_sync_answers_mode_and_log_so_a_step_without_a_sync_still_raises(monkeypatch):
    """The gap under Ray with sync.transport gloo | nccl: the RL step reports a step without an optimizer
    step through ``sync.mode`` / ``sync.log``; ActorSync had neither, so a raise-mode sentinel failure never raised."""
    import pytest

    from miles_lp.launch.actor_sync import ActorSync
    from miles_lp.rl.step import RunError, _report_sentinel_without_sync
    from miles_lp.sync.config import SyncConfig
    from miles_lp.sync.verdict import failed

    monkeypatch.setattr(ActorSync, "connect", lambda self, engine_actor: None)
    lines = []
    s = ActorSync(None, None, "sglang", None, env={"MILES_LP_SYNC_CHECK_GRID": "off"},
                  config=SyncConfig().with_modes(sentinel="raise"), log=lines.append)
    assert s.mode("sentinel") == "raise" and s.mode("grid") == "off"
    v = failed("sentinel", 3.0, "every response hit the length cap for 3 steps in a row")
    m = {}
    with pytest.raises(RunError, match="step 4: C6 sentinel: failed"):
        _report_sentinel_without_sync(s, v, 4, m)
    assert m["sync/check/sentinel"] == 0.0 and "FAILED" in lines[0]
