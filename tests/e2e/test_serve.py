"""`miles-lp serve` over loopback: the SGLang HTTP subset, exercised by a real HTTP client (urllib) and by the
SGLang adapter (SGLangHTTPEngine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import torch

from miles_lp.errors import BackendUnavailable
from miles_lp.rollout.engine import EngineBusy, EngineError, SamplingParams, WeightUpdateError
from miles_lp.rollout.reference import ReferenceEngine
from miles_lp.rollout.server import serve_in_thread
from miles_lp.rollout.sglang import SGLangHTTPEngine
from miles_lp.rollout.testing import tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = "policies/qwen3-moe-mxfp8-nvfp4-experts.yaml"
KEY = "test-key-123"
PROMPTS = [[3, 17, 99, 4], [5, 6, 7]]


@pytest.fixture(scope="module")
def ckpts():
    return tiny_checkpoint("qwen3_moe", RECIPE), tiny_checkpoint("qwen3_moe", RECIPE, seed=1)


@pytest.fixture(scope="module")
def served(ckpts):
    engine = ReferenceEngine(ckpts[0], device="cpu")
    srv = serve_in_thread(engine, api_key=KEY)
    yield engine, srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def client(served):
    return SGLangHTTPEngine(served[1].url, api_key=KEY)


def post(url, path, body, key=KEY, raw=False):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_generate_wire_format(served):
    engine, srv = served
    code, out = post(srv.url, "/generate", {"input_ids": PROMPTS[0], "sampling_params": {
        "max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 4}, "return_logprob": True})
    assert code == 200
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["weight_version"] == str(engine.weight_version) and meta["completion_tokens"] == 5
    lps = meta["output_token_logprobs"]
    assert [x[1] for x in lps] == out["output_ids"] and all(x[2] is None and x[0] < 0 for x in lps)
    local = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=5, seed=4))[0]
    assert local.output_ids == out["output_ids"]
    assert torch.equal(local.logprobs, torch.tensor([x[0] for x in lps], dtype=torch.float32))
    code, batch = post(srv.url, "/generate", {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 2},
                                              "return_logprob": True, "return_routed_experts": True})
    assert code == 200 and len(batch) == 2 and len(batch[1]["meta_info"]["routed_experts"]) == len(PROMPTS[1]) + 1


def test_api_key(served):
    _, srv = served
    assert post(srv.url, "/generate", {"input_ids": [1]}, key=None)[0] == 401
    assert post(srv.url, "/generate", {"input_ids": [1]}, key="wrong")[0] == 401
    assert post(srv.url, "/flush_cache", {}, key="wrong")[0] == 401
    with urllib.request.urlopen(srv.url + "/health", timeout=10) as r:  # liveness needs no key
        assert r.status == 200
    with pytest.raises(EngineError, match="401 unauthorized"):
        SGLangHTTPEngine(srv.url, api_key="wrong").generate([[1]], SamplingParams(max_new_tokens=1))


@pytest.mark.parametrize("body, match", [
    ({"input_ids": [1] * 300}, "prompt 0 has 300 tokens; the context is 256"),
    ({"input_ids": [1], "sampling_params": {"top_p": 2.0}}, "top_p must be in"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}}, "must be an integer"),
    ({"input_ids": [1], "sampling_params": {"temprature": 1.0}}, "unknown sampling_params key 'temprature'"),
    ({"input_ids": [1], "sampling_params": {"repetition_penalty": 1.3}}, "not supported"),
    ({"text": "hello"}, "'input_ids' is required"),
    ({"input_ids": [1], "image_data": "x"}, r"unknown /generate field\(s\) \['image_data'\]"),
])
def test_generate_bad_input(served, body, match):
    import re

    code, out = post(served[1].url, "/generate", body)
    assert code == 400 and re.search(match, out["error"]["message"]), out


@pytest.mark.parametrize("length", ["-1", "abc", " 12x"])
def test_content_length_that_is_not_a_byte_count_is_a_400(served, length):
    """A negative Content-Length would make the handler wait for the client to hang up; a non-number was a 500."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(served[1].url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Length: {length}\r\n\r\n".encode())
        chunks = []
        while chunk := s.recv(65536):  # the server closes the connection after this answer
            chunks.append(chunk)
        reply = b"".join(chunks).decode(errors="replace")
    assert reply.startswith("HTTP/1.1 400"), reply[:200]
    assert "is not a byte count" in reply


def test_client_update_equals_fresh_load(served, client, ckpts):
    from safetensors.torch import load_file

    engine, _ = served
    new = {}
    for f in sorted(ckpts[1].glob("*.safetensors")):
        new.update(load_file(f))
    names = sorted(new)
    ptrs = client.storage_pointers()
    v0 = client.weight_version
    # a bad bucket (unknown name, then a wrong dtype) aborts the update: nothing written, old weights serve
    before = client.weight_digests()
    client.begin_weight_update()
    with pytest.raises(WeightUpdateError, match="unknown parameter 'model.layers.0.mlp.gate_proj.weight'"):
        client.update_weights([(names[0], new[names[0]]), ("model.layers.0.mlp.gate_proj.weight", torch.zeros(2))])
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(WeightUpdateError, match="dtype float32, the engine holds float8_e4m3fn"):
        client.update_weights([(q, new[q].float())])
    assert client.weight_digests() == before
    with pytest.raises(EngineBusy, match="refused until it finishes"):
        client.generate([[1]], SamplingParams(max_new_tokens=1))
    for i in range(3):
        client.update_weights((n, new[n]) for n in names[i::3])
    report = client.finish_weight_update(weight_version=v0 + 5)
    assert report["weight_version"] == v0 + 5 == client.weight_version
    fresh = ReferenceEngine(ckpts[1], device="cpu")
    assert client.weight_digests() == fresh.weight_digests()
    assert client.storage_pointers() == ptrs
    got = client.read_weights([q])[q]
    assert torch.equal(got.view(torch.uint8), new[q].view(torch.uint8))
    sp = SamplingParams(max_new_tokens=6, seed=9)
    a, b = client.generate(PROMPTS, sp), fresh.generate(PROMPTS, sp)
    assert [x.output_ids for x in a] == [x.output_ids for x in b]
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b, strict=True))
    assert all(x.weight_version == v0 + 5 for x in a)
    # and back, from disk (SGLang's /update_weights_from_disk)
    client.update_from_disk(str(ckpts[0]))
    assert client.weight_digests() == ReferenceEngine(ckpts[0], device="cpu").weight_digests()
    with pytest.raises(WeightUpdateError, match="not a checkpoint folder"):
        client.update_from_disk("/nonexistent")


def test_pause_continue_and_introspection(served, client):
    engine, _ = served
    client.pause()  # mode retract
    assert client.health()["status"] == "paused"
    with pytest.raises(EngineBusy, match="paused"):
        client.generate([[1]], SamplingParams(max_new_tokens=1))  # the engine's pause timeout is 0 here
    client.resume()
    client.flush_cache()
    assert client.generate([[1]], SamplingParams(max_new_tokens=1))[0].finish_reason == "length"
    assert client.quantized_params() == engine.quantized_params()
    sc = client.self_check()
    assert sc["ok"] and 2 <= len(sc["layers"]) <= 3  # the fixed pair, and the rotating layer unless it is one of them


def test_stock_sglang_flavor_refuses_pickle_path(served):
    c = SGLangHTTPEngine(served[1].url, api_key=KEY, flavor="sglang")
    with pytest.raises(BackendUnavailable, match="pickle"):
        c.begin_weight_update()


@pytest.mark.slow  # a fresh interpreter importing torch + transformers: ~5 s idle, ~20 s on a loaded 2-core CPU
def test_cli_serve_process(ckpts, tmp_path):
    """The real `miles-lp serve` process: binds loopback, announces its URL, answers with the key only."""
    env = dict(os.environ, MILES_LP_API_KEY=KEY)
    p = subprocess.Popen([sys.executable, "-m", "miles_lp.cli", "serve", str(ckpts[0]), "--port", "0", "--device",
                          "cpu", "--threads", "1"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while "on http://" not in line:
            line = p.stderr.readline()
            assert line or p.poll() is None, "server exited"
        url = line.rsplit(" on ", 1)[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        assert post(url, "/generate", {"input_ids": [1, 2]}, key=None)[0] == 401
        code, out = post(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3},
                                            "return_logprob": True})
        assert code == 200 and len(out["output_ids"]) == 3
    finally:
        p.terminate()
        p.wait(20)


def test_cli_serve_refuses_a_network_host_without_a_key(ckpts, monkeypatch, capsys):
    from miles_lp.cli import main

    monkeypatch.delenv("MILES_LP_API_KEY", raising=False)
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    assert main(["serve", str(ckpts[0]), "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "serving beyond this host without an API key" in capsys.readouterr().err


@pytest.mark.parametrize("flags, match", [
    (["--port", "70000"], r"--port must be 0-65535"),
    (["--device", "gpu"], r"--device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    (["--threads", "0"], r"--threads must be >= 1"),
    (["--pause-timeout", "-1"], r"--pause-timeout must be >= 0"),
])
def test_cli_serve_bad_flags_are_one_line_errors(ckpts, capsys, flags, match):
    import re

    from miles_lp.cli import main

    assert main(["serve", str(ckpts[0]), *flags]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and "Traceback" not in err, err


def test_cli_serve_port_in_use_and_truncated_shard(ckpts, capsys, tmp_path):
    import shutil
    import socket

    from miles_lp.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert main(["serve", str(ckpts[0]), "--port", str(s.getsockname()[1]), "--device", "cpu"]) == 2
    assert "another process holds the port" in capsys.readouterr().err
    bad = tmp_path / "bad"
    shutil.copytree(ckpts[0], bad)
    f = sorted(bad.glob("*.safetensors"))[0]
    f.write_bytes(f.read_bytes()[:-100])
    assert main(["serve", str(bad), "--port", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"{f}: truncated: tensor" in err and "Traceback" not in err, err


def test_a_refused_one_shot_update_leaves_the_server_serving(served, client):
    """One bad /update_weights_from_tensor (finish=true) used to leave the engine 'updating': every later
    /generate was 503. It is aborted (nothing was written) and the previous weights serve on."""
    from safetensors.torch import save

    engine, srv = served
    v = client.weight_version
    req = urllib.request.Request(srv.url + "/update_weights_from_tensor", data=save({"nope.weight": torch.zeros(1)}),
                                 headers={"Authorization": f"Bearer {KEY}",
                                          "Content-Type": "application/octet-stream"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=60)
    assert exc.value.code == 400 and "unknown parameter" in exc.value.read().decode()
    assert engine.health()["status"] == "ok"
    assert client.generate([[1, 2]], SamplingParams(max_new_tokens=1))[0].weight_version == v
    # a multi-bucket client aborts its own open update through /miles_lp/abort_update
    client.begin_weight_update()
    with pytest.raises(WeightUpdateError, match="unknown parameter"):
        client.update_weights([("nope.weight", torch.zeros(1))])
    client.abort_weight_update()
    assert engine.health()["status"] == "ok" and client.weight_version == v
    assert status_of(post(srv.url, "/miles_lp/abort_update", {})) == 200  # outside an update: a no-op


def status_of(answer):
    return answer[0]
