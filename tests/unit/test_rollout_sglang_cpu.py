"""The parts of the SGLang CPU backend that run without SGLang: the two ``sgl_kernel`` ops of the shim (against
their definition, written out element by element), the server's command line, the canonical view of fused
parameters that the checks read, and the client's refusals."""

from __future__ import annotations

import importlib

import pytest
import torch

from miles_lp.rollout.engine import EngineError, tensor_digest
from miles_lp.rollout.sglang_cpu.launch import CPU_FLAGS, server_args

shim = importlib.import_module("miles_lp.rollout.sglang_cpu.shim.sgl_kernel")


def test_assign_req_to_token_pool_matches_its_definition():
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([2, 4, 1], dtype=torch.int32)
    table = torch.zeros(5, 32, dtype=torch.int32)
    start = torch.tensor([0, 3, 8], dtype=torch.int64)
    end = torch.tensor([6, 3, 15], dtype=torch.int64)  # the middle request allocates nothing
    locs = torch.randperm(4096, generator=g)[:13].to(torch.int64)
    want = table.clone()
    at = 0
    for i in range(3):
        for j in range(int(start[i]), int(end[i])):
            want[int(rows[i]), j] = int(locs[at])
            at += 1
    shim.assign_req_to_token_pool_cpu(rows, table, start, end, locs, 32)
    assert torch.equal(table, want)


def test_copy_all_layer_kv_cache_reads_every_source_before_writing():
    bufs = [torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6) + 1000 * b for b in range(4)]
    before = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs], dtype=torch.int64)
    tgt = torch.tensor([1, 2, 3], dtype=torch.int64)  # overlaps the sources: a chain 0->1->2->3
    src = torch.tensor([0, 1, 2], dtype=torch.int64)
    shim.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, old in zip(bufs, before, strict=True):
        want = old.clone()
        want[[1, 2, 3]] = old[[0, 1, 2]]
        assert torch.equal(b, want)


def test_server_args_bind_loopback_with_the_cpu_flags():
    args = server_args("/m", 1234)
    assert args[args.index("--host") + 1] == "127.0.0.1" and args[args.index("--port") + 1] == "1234"
    joined = " ".join(args)
    assert " ".join(CPU_FLAGS) in joined and "--skip-tokenizer-init" in args and "--dtype bfloat16" in joined


class _QKV(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head_size, self.total_num_heads, self.total_num_kv_heads = 4, 2, 1
        self.weight = torch.nn.Parameter(torch.randn(16, 8, dtype=torch.bfloat16), requires_grad=False)


class _GateUp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.output_sizes = [6, 6]
        self.weight = torch.nn.Parameter(torch.randn(12, 8, dtype=torch.bfloat16), requires_grad=False)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        layer = self.model.layers[0]
        layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
        layer.self_attn.qkv_proj, layer.mlp.gate_up_proj = _QKV(), _GateUp()
        self.lm_head = torch.nn.Linear(8, 3, bias=False)


def test_introspection_splits_fused_parameters_into_checkpoint_views():
    from miles_lp.rollout.sglang_cpu.introspect import SGLangIntrospection

    m = _Model()
    ins = SGLangIntrospection(m)
    views = ins.views()
    qkv = m.model.layers[0].self_attn.qkv_proj.weight
    p = "model.layers.0."
    assert torch.equal(views[p + "self_attn.q_proj.weight"], qkv[:8])
    assert torch.equal(views[p + "self_attn.k_proj.weight"], qkv[8:12])
    assert torch.equal(views[p + "self_attn.v_proj.weight"], qkv[12:])
    assert views[p + "self_attn.k_proj.weight"].data_ptr() == qkv.data_ptr() + 8 * 8 * 2  # a view, not a copy
    assert ins.param_specs()[p + "mlp.up_proj.weight"] == ("bfloat16", (6, 8))
    assert ins.weight_digests([p + "mlp.gate_proj.weight"]) == {
        p + "mlp.gate_proj.weight": tensor_digest(m.model.layers[0].mlp.gate_up_proj.weight[:6].contiguous())}
    assert ins.quantized_params() == {}  # nothing here serves in low precision
    assert ins.self_check()["layers"] == {}


def test_injected_faults_change_what_the_checks_read(monkeypatch):
    from miles_lp.rollout.sglang_cpu.introspect import SGLangIntrospection

    m = _Model()
    with pytest.raises(EngineError, match="MILES_LP_SGLANG_FAULTS=1"):
        SGLangIntrospection(m).inject("perturb", "lm_head.weight")
    monkeypatch.setenv("MILES_LP_SGLANG_FAULTS", "1")
    ins = SGLangIntrospection(m)
    name = "model.layers.0.mlp.up_proj.weight"
    d0, p0 = ins.weight_digests([name]), ins.storage_pointers()
    ins.inject("perturb", name)
    assert ins.weight_digests([name]) != d0 and ins.storage_pointers() == p0
    ins.inject("rebind", name)
    p1 = ins.storage_pointers()
    assert p1[name] != p0[name] and p1["model.layers.0.mlp.gate_proj.weight"] != p0["model.layers.0.mlp.gate_proj.weight"]
    assert p1["lm_head.weight"] == p0["lm_head.weight"]


def test_the_client_refuses_launch_without_what_it_needs():
    from miles_lp.rollout.sglang import SGLangHTTPEngine

    with pytest.raises(EngineError, match="checkpoint="):
        SGLangHTTPEngine(None, flavor="launch")
    with pytest.raises(EngineError, match="give no url"):
        SGLangHTTPEngine("http://127.0.0.1:1", flavor="launch", checkpoint="/x", update_dir="/y")
    with pytest.raises(EngineError, match="needs the server's url"):
        SGLangHTTPEngine(None, flavor="sglang")


class _FakeSGLang:
    """What the client sees of SGLang 0.5.23's HTTP surface on the disk path: no /get_weight_version (404), the
    version in /model_info as a string, /update_weights_from_disk recording its body."""

    def __init__(self):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.version, self.bodies, self.paths = "0", [], []
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.paths.append(self.path)
                if self.path == "/model_info":
                    return self._send(200, {"weight_version": fake.version})
                if self.path == "/health":
                    return self._send(200, {})
                self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(n) or b"{}")
                fake.paths.append(self.path)
                if self.path == "/update_weights_from_disk":
                    fake.bodies.append(body)
                    fake.version = body.get("weight_version", fake.version)
                self._send(200, {"success": True})

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"


def test_disk_updates_speak_sglangs_fields(tmp_path):
    """The version read from /model_info after /get_weight_version answers 404, sent back as SGLang's string
    field, and ``keep_pause`` while paused (SGLang resumes generation after a disk update otherwise)."""
    from safetensors.torch import save_file

    from miles_lp.rollout.sglang import SGLangHTTPEngine

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    w = torch.ones(2, 2, dtype=torch.bfloat16)
    save_file({"w": w}, str(ckpt / "model.safetensors"))
    fake = _FakeSGLang()
    try:
        eng = SGLangHTTPEngine(fake.url, flavor="sglang", checkpoint=ckpt, update_dir=tmp_path / "up")
        assert eng.weight_version == 0 and fake.paths == ["/get_weight_version", "/model_info"]
        eng.pause()
        eng.begin_weight_update()
        eng.update_weights([("w", 2 * w)])
        eng.finish_weight_update(weight_version=1)
        body = fake.bodies[-1]
        assert body["weight_version"] == "1" and body["keep_pause"] is True
        assert eng.weight_version == 1 and fake.paths[-1] == "/model_info"  # no second 404
        eng.resume()
        eng.begin_weight_update()
        eng.update_weights([("w", w)])
        eng.finish_weight_update(weight_version=2)
        assert "keep_pause" not in fake.bodies[-1]
        # what the sync sends: no version. SGLang would keep "2" (C5 then fails); the client asks for the next one
        eng.begin_weight_update()
        eng.update_weights([("w", w)])
        eng.finish_weight_update()
        assert fake.bodies[-1]["weight_version"] == "3" and eng.weight_version == 3
        # a server started without --weight-version reports SGLang's "default" (read as -1): the next is 0
        fake.version = "default"
        assert eng.weight_version == -1
        eng.begin_weight_update()
        eng.update_weights([("w", w)])
        eng.finish_weight_update()
        assert fake.bodies[-1]["weight_version"] == "0" and eng.weight_version == 0
    finally:
        fake.srv.shutdown()


class _FakeMethod:
    """A serving quant method: the GEMM on its weight, or on the weight's rows rotated (a stale layout)."""

    miles_lp_format = "mxfp8"

    def __init__(self, stale: bool = False):
        self.stale = stale

    def apply(self, layer, x, bias=None):
        w = layer.weight.float()
        return (x.float() @ (w.roll(1, 0) if self.stale else w).t()).to(x.dtype)

    def dequantized_weight(self, layer):
        return layer.weight.double()


class _FakeLinear(torch.nn.Module):
    input_size = 8

    def __init__(self, stale: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(6, 8, dtype=torch.bfloat16), requires_grad=False)
        self.quant_method = _FakeMethod(stale)


def test_self_check_probes_the_first_linear_and_rotates_through_the_others():
    from miles_lp.rollout.sglang_cpu.introspect import SGLangIntrospection

    model = torch.nn.ModuleDict({f"l{i}": _FakeLinear(stale=(i == 2)) for i in range(4)})
    ins = SGLangIntrospection(model)
    seen = []
    for _ in range(4):
        out = ins.self_check(seed=0)
        seen.append({n: round(v["rel_err"], 3) > 0.25 for n, v in out["layers"].items()})
        assert [v["kind"] for v in out["layers"].values()] == ["dense", "rotating"]
    assert [sorted(s) for s in seen] == [["l0.weight", "l1.weight"], ["l0.weight", "l2.weight"],
                                         ["l0.weight", "l3.weight"], ["l0.weight", "l1.weight"]]
    assert [any(s.values()) for s in seen] == [False, True, False, False]  # the stale l2 fails the sync it is probed


class _LoaderParam(torch.nn.Parameter):
    """Shaped like SGLang's ``BasevLLMParameter``: ``__new__(cls, data, **kw)``, its loader and block attributes in
    the instance dict."""

    def __new__(cls, data, **kwargs):
        return super().__new__(cls, data=data, requires_grad=False)

    def __init__(self, data, weight_loader):
        self._weight_loader = weight_loader
        self.output_dim, self.format_ue8m0 = 0, True

    @property
    def weight_loader(self):
        return self._weight_loader


def _copy_rows(param, loaded, rows=None):  # what a fused linear's loader does: write one shard's rows in place
    (param.data if rows is None else param.data[rows]).copy_(loaded)


def test_the_scale_answers_to_both_loaders_names_and_the_checks_see_one_tensor():
    """Llama's SGLang loader asks for ``weight_scale``, Qwen3's for ``weight_scale_inv``: both must land in the
    bytes the GEMM and the checks read; the checks list the tensor once, under the checkpoint's name."""
    from miles_lp.rollout.sglang_cpu.introspect import SGLangIntrospection
    from miles_lp.rollout.sglang_cpu.linear import ALIAS, add_scale_alias

    m = _Model()
    gate_up = m.model.layers[0].mlp.gate_up_proj
    gate_up.weight_scale_inv = _LoaderParam(torch.zeros(12, 1, dtype=torch.uint8), weight_loader=_copy_rows)
    add_scale_alias(gate_up)
    params = dict(m.named_parameters())  # what both SGLang loaders look names up in
    inv, alias = (params[f"model.layers.0.mlp.gate_up_proj.{s}"] for s in ("weight_scale_inv", "weight_scale"))
    assert alias is not inv and alias.data_ptr() == inv.data_ptr() and getattr(alias, ALIAS) == "weight_scale_inv"
    assert type(alias) is _LoaderParam and alias.weight_loader is _copy_rows and alias.format_ue8m0
    alias.weight_loader(alias, torch.full((6, 1), 127, dtype=torch.uint8), slice(0, 6))  # Llama's name: gate
    inv.weight_loader(inv, torch.full((6, 1), 126, dtype=torch.uint8), slice(6, 12))  # Qwen3's name: up
    assert inv.view(-1).tolist() == [127] * 6 + [126] * 6
    views = SGLangIntrospection(m).views()
    assert not any(n.endswith(".weight_scale") for n in views)
    assert views["model.layers.0.mlp.gate_proj.weight_scale_inv"].view(-1).tolist() == [127] * 6
    assert views["model.layers.0.mlp.up_proj.weight_scale_inv"].view(-1).tolist() == [126] * 6
    with pytest.raises(ValueError, match="already has a parameter 'weight_scale'"):
        add_scale_alias(gate_up)
