"""`miles-lp serve`'s request checks against a fake engine (no model): a request that does not fit the context is
a 400 with SGLang's message, and /pause_generation without a mode aborts, as SGLang's."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

from miles_lp.rollout.engine import Generation
from miles_lp.rollout.server import serve_in_thread


class FakeEngine:
    context_len = 16
    weight_version = 0

    def __init__(self):
        self.generated, self.paused = [], []

    def generate(self, batch, sp):
        self.generated.append((batch, sp.max_new_tokens))
        return [Generation([7] * 2, torch.zeros(2), "length", 0) for _ in batch]

    def pause(self, mode="retract"):
        self.paused.append(mode)

    def health(self):
        return {"status": "ok"}


@pytest.fixture
def served():
    eng = FakeEngine()
    srv = serve_in_thread(eng)
    yield eng, srv.url
    srv.shutdown()
    srv.server_close()


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_request_beyond_the_context_is_a_400_with_sglangs_message(served):
    eng, url = served
    code, out = post(url + "/generate", {"input_ids": [[1] * 4, [1] * 6], "sampling_params": {"max_new_tokens": 11}})
    assert code == 400 and out["error"]["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 16 tokens. You requested a total of 17 "
        "tokens: 6 tokens from the input messages and 11 tokens for the completion.")
    assert eng.generated == []  # refused before the engine saw it
    code, out = post(url + "/generate", {"input_ids": [1] * 6, "sampling_params": {"max_new_tokens": 10}})
    assert code == 200 and eng.generated == [([[1] * 6], 10)]  # exactly the context: served
    code, _ = post(url + "/generate", {"input_ids": [1] * 6})  # no max_new_tokens: the engine's default and cap
    assert code == 200


def test_pause_without_a_mode_aborts_as_sglang(served):
    eng, url = served
    assert post(url + "/pause_generation", {}) == (200, {"success": True})
    assert post(url + "/pause_generation", {"mode": "retract"})[0] == 200
    assert eng.paused == ["abort", "retract"]


def test_serve_on_ipv6_loopback():
    """`serve --host ::1` (a loopback host the CLI accepts) could not bind: the server was IPv4 only."""
    import socket

    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    from miles_lp.rollout.server import EngineServer

    try:
        srv = EngineServer(FakeEngine(), "::1", 0)
    except OSError as exc:  # IPv6 configured off in this kernel / container
        pytest.skip(f"cannot bind ::1 here: {exc}")
    import threading

    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert srv.url.startswith("http://[::1]:")
        with urllib.request.urlopen(srv.url + "/health", timeout=30) as r:
            assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    finally:
        srv.shutdown()
        srv.server_close()
