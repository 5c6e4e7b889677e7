"""``rollout.url`` naming a real sglang-router (0.3.2, from SGLang's venv) in front of two servers.

The servers are ``miles-lp serve`` processes on the run's engine checkpoint (SGLang's HTTP API and the live checks);
the router is the stock Rust router, started with ``--worker-urls``. The run asks the router for its servers
(``GET /workers``) and syncs and checks each one: 2 RL steps, every check in raise mode on both, both servers at
the run's weight version afterwards. Skipped (saying why) where SGLang's venv or its router is missing.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from miles_lp.launch.recipe import load_recipe
from tests.sglang_env import sglang_python_or_skip

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny-mxfp8.yaml"
SMALL = ["rl.prompts_per_step=4", "rl.group_size=4", "checkpoint_every=0", "logging.progress=false",
         "sync.checks.self_check=raise"]


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _serve(ckpt: Path) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-m", "miles_lp.cli", "serve", str(ckpt), "--port", "0", "--device", "cpu",
                          "--threads", "1"], stderr=subprocess.PIPE, text=True)
    line = ""
    while "on http://" not in line:
        line = p.stderr.readline()
        assert line or p.poll() is None, "server exited"
    return p, line.rsplit(" on ", 1)[1].split()[0]


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    """(router url, [server urls]): two `miles-lp serve` servers behind sglang-router, all on loopback."""
    python = sglang_python_or_skip()
    if subprocess.run([python, "-c", "import sglang_router.router"], capture_output=True).returncode:
        pytest.skip(f"{python} has no sglang-router (.ci/sglang_venv.sh installs it)")
    from miles_lp.cli import main

    tmp = tmp_path_factory.mktemp("sglang-router")
    sets = [a for s in SMALL for a in ("--set", s)]
    assert main(["run", str(RECIPE), *sets, "--prepare-engine", str(tmp / "prep")]) == 0
    procs, servers = [], []
    try:
        for _ in range(2):
            p, url = _serve(tmp / "prep" / "engine")
            procs.append(p)
            servers.append(url)
        port = _free_port()
        log = open(tmp / "router.log", "w")  # noqa: SIM115 (closed below, after the router)
        procs.append(subprocess.Popen([python, "-m", "sglang_router.launch_router", "--worker-urls", *servers,
                                       "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                                       "--prometheus-port", str(_free_port())], stdout=log, stderr=log))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:  # the router registers its workers after probing them (a few seconds)
            try:
                workers = _get(url + "/workers")["workers"]
                if len(workers) == 2 and all(w["is_healthy"] for w in workers):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp / "router.log").read_text()[-2000:]
            time.sleep(1)
        yield url, servers
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(30)


def test_run_through_router_syncs_and_checks_every_server(router, tmp_path):
    from miles_lp.launch.runner import Run

    url, servers = router
    recipe = load_recipe(RECIPE, [*SMALL, f"logging.output_dir={tmp_path / 'runs'}", "rollout.device=auto",
                                  "rollout.backend=sglang", f"rollout.url={url}", "steps=2"])
    assert recipe.fleet.count == 1
    before = [int(_get(s + "/get_weight_version")["weight_version"]) for s in servers]
    run = Run.start(recipe)
    try:
        rows = run.train(progress=False)
    finally:
        run.close()
    assert sorted(run.recipe.fleet.urls) == sorted(servers)  # the router's servers are the engines
    saved = load_recipe(run.dir.recipe_path)
    assert sorted(saved.fleet.urls) == sorted(servers) and saved.rollout.url == run.recipe.rollout.url
    assert len(rows) == 2
    for m in rows:
        for c in ("layer_audit", "grid", "self_check", "storage", "completeness", "version"):
            for i in range(2):
                assert m[f"sync/check/{c}/engine{i}"] == 1.0, (c, i)
        assert abs(m["rollout_corr/kl"]) < 1e-3  # the shared grid on the reference engine behind both servers
    after = [int(_get(s + "/get_weight_version")["weight_version"]) for s in servers]
    assert [a - b for a, b in zip(after, before, strict=True)] == [3, 3]  # initial sync + 2 steps, each server
