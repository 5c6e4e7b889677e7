"""``rollout.backend: sglang`` in ``miles-lp run``: the runner as the client of an SGLang-protocol server.

The server is our own ``miles-lp serve`` (a real process, loopback, API key from the environment), serving the
converted checkpoint of the run's tiny model. Two update paths:

* ``server: miles-lp``: tensor updates (safetensors bodies) and the live checks through ``/miles_lp/*``;
  3 RL steps with every check in raise mode.
* ``server: sglang`` (what a stock SGLang server needs, its tensor path being pickle): each sync exported as a
  checkpoint folder and loaded through ``/update_weights_from_disk`` (our server's disk endpoint); the checks a
  stock server cannot answer run in warn mode (raise for them is refused at start), are skipped with the reason, and
  the served weights are verified here through the miles-lp endpoints the stock client does not use.

An unreachable url fails before step 1, naming it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from miles_lp.errors import ConfigError
from miles_lp.launch.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny-mxfp8.yaml"
KEY = "test-key-engines"
SMALL = ["rl.prompts_per_step=4", "rl.group_size=4", "checkpoint_every=0", "logging.progress=false",
         "sync.checks.self_check=raise"]


def _recipe(tmp: Path, *sets: str):
    # rollout.device is the reference engine's: the recipe's `cpu` goes back to its default for another backend
    drop = ["rollout.device=auto"] if any(s.startswith("rollout.backend=") for s in sets) else []
    return load_recipe(RECIPE, [*SMALL, f"logging.output_dir={tmp / 'runs'}", *drop, *sets])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`miles-lp serve` on the converted checkpoint of tiny-mxfp8's model (the names/dtypes/shapes the run syncs)."""
    from miles_lp.cli import main

    tmp = tmp_path_factory.mktemp("sglang-server")
    # the documented first step: `miles-lp run RECIPE --prepare-engine DIR` writes what the server must serve
    sets = [a for s in SMALL for a in ("--set", s)]
    assert main(["run", str(RECIPE), *sets, "--prepare-engine", str(tmp / "prep")]) == 0
    ckpt = tmp / "prep" / "engine"
    env = dict(os.environ, MILES_LP_API_KEY=KEY)
    p = subprocess.Popen([sys.executable, "-m", "miles_lp.cli", "serve", str(ckpt), "--port", "0", "--device", "cpu",
                          "--threads", "1"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while "on http://" not in line:
            line = p.stderr.readline()
            assert line or p.poll() is None, "server exited"
        yield line.rsplit(" on ", 1)[1].split()[0]
    finally:
        p.terminate()
        p.wait(30)


@pytest.fixture
def api_key(monkeypatch):
    monkeypatch.setenv("MILES_LP_API_KEY", KEY)  # the runner's client reads it from the environment


def _get(url: str, path: str):
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _train(recipe):
    from miles_lp.launch.runner import Run

    run = Run.start(recipe)
    try:
        return run, run.train(progress=False)
    finally:
        run.close()


def test_run_against_miles_lp_serve_tensor_path(server, api_key, tmp_path):
    recipe = _recipe(tmp_path, "rollout.backend=sglang", f"rollout.url={server}", "steps=3")
    run, rows = _train(recipe)
    assert len(rows) == 3
    for i, m in enumerate(rows):  # every check answered by the live server and clean, in raise mode
        for c in ("layer_audit", "grid", "self_check", "storage", "completeness", "version"):
            assert m[f"sync/check/{c}"] == 1.0, (i, c)
        assert m["rollout/weight_version"] == i + 1
    assert run.initial.verdict("grid").reason.endswith("(full compare)")
    # the shared grid on the same reference engine, over HTTP: the rollout log-probs are the learner's
    assert all(abs(m["rollout_corr/kl"]) < 1e-3 for m in rows)
    assert int(_get(server, "/get_weight_version")["weight_version"]) >= 4  # initial sync + 3 steps


def test_run_updates_from_disk_like_stock_sglang(server, api_key, tmp_path, capsys):
    """``server: sglang``: no tensor path, no introspection; every sync is a checkpoint folder on disk."""
    from miles_lp.launch.dry_run import dry_run
    from miles_lp.rollout.engine import tensor_digest
    from miles_lp.rollout.sglang import SGLangHTTPEngine

    # C1-C4 in warn mode: raise for a check a stock server can never answer is refused at start
    # (tests/unit/test_launch_stock_sglang.py)
    warn = [f"sync.checks.{c}=warn" for c in ("layer_audit", "grid", "self_check", "storage")]
    recipe = _recipe(tmp_path, "rollout.backend=sglang", f"rollout.url={server}", "rollout.server=sglang", "steps=2",
                     *warn)
    out = dry_run(recipe)
    assert out["checks_never_answered"] == ["layer_audit", "grid", "self_check", "storage"]
    assert out["would_refuse_at_start"] == []
    before = int(_get(server, "/get_weight_version")["weight_version"])
    run, rows = _train(recipe)
    assert "a stock server) answers none of layer_audit, grid, self_check, storage" in capsys.readouterr().err
    assert int(_get(server, "/get_weight_version")["weight_version"]) == before + 3  # initial sync + 2 steps
    m = rows[-1]
    assert m["sync/check/completeness"] == 1.0 and m["sync/check/version"] == 1.0
    for c in ("layer_audit", "grid", "self_check", "storage"):  # a stock server cannot answer: skipped, never "ok"
        assert m[f"sync/check/{c}"] == -1.0, c
    assert "cannot report its live quantized parameters" in run.initial.verdict("layer_audit").reason
    folders = sorted((run.dir.path / "engine_updates").glob("update_*"))
    assert len(folders) == 1 and (folders[0] / "config.json").is_file()  # the newest kept, older removed
    # what the server now serves is the learner's last export, byte for byte (checked through the miles-lp
    # endpoints, which the stock client does not use)
    from safetensors.torch import load_file

    exported = load_file(folders[0] / "model.safetensors")
    assert set(exported) == set(run.sync.spec)  # every tensor of the served checkpoint, once
    served = SGLangHTTPEngine(server, api_key=KEY).weight_digests(list(exported))
    assert served == {n: tensor_digest(t) for n, t in exported.items()}


def test_stock_client_without_update_dir_refuses_tensor_path(server):
    from miles_lp.errors import BackendUnavailable
    from miles_lp.rollout.sglang import SGLangHTTPEngine

    c = SGLangHTTPEngine(server, api_key=KEY, flavor="sglang")
    with pytest.raises(BackendUnavailable, match="pickle"):
        c.begin_weight_update()
    with pytest.raises(BackendUnavailable, match="stock SGLang server"):
        c.weight_digests()


def test_unreachable_url_fails_before_step_one(tmp_path):
    from miles_lp.launch.runner import Run

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    url = f"http://127.0.0.1:{port}"
    recipe = _recipe(tmp_path, "rollout.backend=sglang", f"rollout.url={url}", "steps=1")
    for _ in range(2):  # the same run name again: refused for the same reason, not for a leftover folder
        with pytest.raises(ConfigError, match=rf"rollout.url {url}: no engine answers there"):
            Run.start(recipe, run_name="unreachable")
    assert not (tmp_path / "runs" / "unreachable").exists()  # no half-made run folder (model/, engine_init/)


@pytest.mark.slow
def test_ray_launcher_against_miles_lp_serve(server, api_key, tmp_path):
    """The same client inside the Ray launcher's rollout actor (a local cluster): 2 steps, every check raise."""
    from miles_lp.launch.ray_launcher import run_with_ray

    recipe = _recipe(tmp_path, "rollout.backend=sglang", f"rollout.url={server}", "steps=2", "ray.enabled=true",
                     "ray.num_cpus=2")
    rows = []
    out = run_with_ray(recipe, progress=False, on_step=lambda run, m: rows.append(m))
    assert out["steps"] == 2
    for m in rows:
        for c in ("layer_audit", "grid", "self_check", "storage", "completeness", "version"):
            assert m[f"sync/check/{c}"] == 1.0, c
