"""``rollout.url`` naming an sglang-router (``launch/router.py``): its servers become the run's engines.

A stand-in router answers ``GET /workers`` in sglang-router 0.3.2's shape (measured against the real router:
``{"workers": [{"url", "worker_type", "is_healthy", ...}], "total", "stats"}``); a stand-in server answers 404
there, as SGLang's and ``miles-lp serve`` do. The real router in front of two real servers:
``tests/e2e/test_run_sglang_router.py``.
"""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from miles_lp.errors import ConfigError
from miles_lp.launch.recipe import load_recipe_text
from miles_lp.launch.router import with_router_workers

BASE = """
model: {path: "tiny:qwen3", num_layers: 1}
precision: {default: mxfp8}
rollout: {backend: sglang, server: miles-lp, %s}
steps: 1
"""


def _worker(url: str, kind: str = "regular", healthy: bool = True) -> dict:
    return {"id": "x", "url": url, "model_id": "unknown", "priority": 50, "cost": 1.0, "worker_type": kind,
            "is_healthy": healthy, "load": 0, "connection_mode": "HTTP", "disable_health_check": False}


@pytest.fixture
def serve():
    """Start stand-in HTTP servers: ``serve(workers)`` -> base url; workers None: a server (404 on /workers)."""
    servers = []

    def start(workers: list[dict] | None) -> str:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path != "/workers" or workers is None:
                    self.send_response(404)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    self.wfile.write(b'{"detail": "Not Found"}')
                    return
                body = json.dumps({"workers": workers, "total": len(workers)}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=s.serve_forever, daemon=True).start()
        servers.append(s)
        return f"http://127.0.0.1:{s.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def test_router_url_becomes_its_servers(serve):
    router = serve([_worker("http://127.0.0.1:31001"), _worker("http://127.0.0.1:31002/")])
    recipe = load_recipe_text(BASE % f"url: {router}", "r.yaml")
    assert recipe.fleet.count == 1
    lines = []
    got = with_router_workers(recipe, log=lines.append)
    assert got.fleet.urls == ("http://127.0.0.1:31001", "http://127.0.0.1:31002") and got.fleet.count == 2
    assert got.raw["rollout"]["urls"] == list(got.fleet.urls) and "url" not in got.raw["rollout"]
    assert "urls:" in got.to_yaml()  # what the run folder's recipe.yaml records
    assert got.rollout.url == "http://127.0.0.1:31001"  # the rollout section's own checks read the first
    assert lines and "is an sglang-router: its 2 server(s)" in lines[0]


def test_server_url_is_left_as_it_is(serve):
    server = serve(None)
    recipe = load_recipe_text(BASE % f"url: {server}", "r.yaml")
    assert with_router_workers(recipe, log=lambda s: None) is recipe


def test_unreachable_url_is_left_to_the_engine_probe():
    recipe = load_recipe_text(BASE % "url: http://127.0.0.1:9", "r.yaml")
    assert with_router_workers(recipe, log=lambda s: None) is recipe


@pytest.mark.parametrize("workers, match", [
    ([], "with no worker"),
    ([_worker("http://127.0.0.1:31001"), _worker("http://127.0.0.1:31002", healthy=False)],
     "worker http://127.0.0.1:31002 is unhealthy"),
    ([_worker("http://127.0.0.1:31001", kind="prefill"), _worker("http://127.0.0.1:31002", kind="decode")],
     "prefill/decode disaggregation"),
])
def test_router_that_cannot_be_synced_is_refused(serve, workers, match):
    router = serve(workers)
    recipe = load_recipe_text(BASE % f"url: {router}", "r.yaml")
    with pytest.raises(ConfigError, match=match) as err:
        with_router_workers(recipe, log=lambda s: None)
    assert str(err.value).startswith("r.yaml:4: rollout.url: ")  # the line of rollout.url


def test_router_listed_among_servers_is_refused(serve):
    server, router = serve(None), serve([_worker("http://127.0.0.1:31001")])
    recipe = load_recipe_text(BASE % f"urls: [{server}, {router}]", "r.yaml")
    with pytest.raises(ConfigError, match=r"rollout.urls\[1\] .* is an sglang-router: give it alone as rollout.url"):
        with_router_workers(recipe, log=lambda s: None)


def test_other_backends_ask_nothing():
    recipe = load_recipe_text(BASE.replace("backend: sglang, server: miles-lp, %s", "backend: reference"), "r.yaml")
    assert with_router_workers(recipe) is recipe
