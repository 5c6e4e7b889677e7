"""``encode_weight`` / ``engine_tensors`` (plan checked against the export) and ``export_groups`` (atomic units
for the sync's buckets) on tiny qwen2_moe (q/k/v biases, shared expert) and deepseek_v3 (MLA) learners."""

from __future__ import annotations

import pytest
import torch

from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.cli.convert import policy_for_format
from miles_lp.config import Where
from miles_lp.errors import CheckpointError
from miles_lp.export import ExportGroup, encode_weight, engine_tensors, export_groups, group_key
from miles_lp.formats import Format, quantize_mxfp8
from miles_lp.policy import parse_policy
from miles_lp.train.config import TrainConfig
from miles_lp.train.embedded import EmbeddedTrainer, plan_for_model

DENSE_NVFP4 = {"default": "nvfp4", "backward": "high_precision"}


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    cache = {}

    def get(arch, fmt="mxfp8+nvfp4-experts"):
        if (arch, fmt) not in cache:
            d = make_tiny_model(arch, tmp_path_factory.mktemp(arch), num_layers=2)
            pol = parse_policy(DENSE_NVFP4, Where("<t>", "precision")) if fmt == "dense-nvfp4" \
                else policy_for_format(fmt)
            cache[arch, fmt] = EmbeddedTrainer(d, plan_for_model(pol, d), TrainConfig(device="cpu"))
        return cache[arch, fmt]
    return get


def test_groups_partition_the_engine_tensors(learner):
    tr = learner("qwen2_moe")
    flat = dict(engine_tensors(tr.export_weights(), tr.plan, "sglang"))
    groups = list(export_groups(tr.export_weights(), tr.plan, "sglang"))
    merged: dict[str, torch.Tensor] = {}
    for g in groups:
        assert isinstance(g, ExportGroup) and not (merged.keys() & g.tensors.keys())
        merged.update(g.tensors)
        assert g.nbytes == sum(t.numel() * t.element_size() for t in g.tensors.values())
    assert merged.keys() == flat.keys()
    assert all(torch.equal(merged[k].reshape(-1).view(torch.uint8), flat[k].reshape(-1).view(torch.uint8)) for k in flat)
    by_key = {g.key: g for g in groups}
    assert len(by_key) == len(groups)  # each key once: a group is never split
    qkv = by_key["model.layers.1.self_attn.qkv_proj"]
    assert set(qkv.sources) == {f"model.layers.1.self_attn.{p}_proj.{k}" for p in "qkv" for k in ("weight", "bias")}
    assert "model.layers.1.self_attn.q_proj.weight_scale_inv" in qkv.tensors
    experts = by_key["model.layers.1.mlp.experts"]
    assert len(experts.sources) == 3 * 4 and "model.layers.1.mlp.experts.3.down_proj.weight_scale_2" in experts.tensors
    shared = by_key["model.layers.1.mlp.shared_expert.gate_up_proj"]
    assert set(shared.sources) == {f"model.layers.1.mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up")}
    assert by_key["model.norm.weight"].sources == ("model.norm.weight",)
    assert by_key["model.layers.1.mlp.gate.weight"].sources == ("model.layers.1.mlp.gate.weight",)  # router alone


def test_mla_and_dense_nvfp4_groups(learner):
    tr = learner("deepseek_v3")
    keys = {g.key: g for g in export_groups(tr.export_weights(), tr.plan, "vllm")}
    qa = keys["model.layers.1.self_attn.fused_qkv_a_proj_with_mqa"]
    assert set(qa.sources) == {"model.layers.1.self_attn.q_a_proj.weight",
                               "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"}
    tr = learner("qwen3", "dense-nvfp4")
    g = {x.key: x for x in export_groups(tr.export_weights(), tr.plan, "sglang")}["model.layers.0.mlp.gate_up_proj"]
    s_gate = g.tensors["model.layers.0.mlp.gate_proj.weight_scale_2"]
    s_up = g.tensors["model.layers.0.mlp.up_proj.weight_scale_2"]
    assert torch.equal(s_gate, s_up)  # one global scale for the fused GEMM, in the same bucket


def test_incomplete_or_duplicated_streams_are_refused(learner):
    tr = learner("qwen3_moe")
    drop = "model.layers.0.mlp.experts.2.up_proj.weight"
    with pytest.raises(CheckpointError, match=r"incomplete.*model.layers.0.mlp.experts.*experts.2.up_proj"):
        list(export_groups(((n, t) for n, t in tr.export_weights() if n != drop), tr.plan, "sglang"))
    items = list(tr.export_weights())
    with pytest.raises(CheckpointError, match="exported twice"):
        list(export_groups(items + items[:1], tr.plan, "sglang"))


def test_encode_weight_checks_the_plan(learner):
    tr = learner("qwen3", "mxfp8")
    w = tr.model.state_dict()["model.layers.0.self_attn.o_proj.weight"]
    q = quantize_mxfp8(w)
    out = encode_weight("model.layers.0.self_attn.o_proj.weight", q, tr.plan, "vllm")
    assert set(out) == {"model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.weight_scale"}
    with pytest.raises(CheckpointError, match="plain torch.float32 tensor.*C2"):
        encode_weight("model.layers.0.self_attn.o_proj.weight", w, tr.plan, "sglang")
    with pytest.raises(CheckpointError, match="plan says bf16.*C1"):
        encode_weight("model.norm.weight", quantize_mxfp8(torch.ones(64, 64)), tr.plan, "sglang")
    norm = torch.ones(64, dtype=torch.bfloat16)
    assert encode_weight("model.norm.weight", norm, tr.plan, "sglang") == {"model.norm.weight": norm}
    assert group_key("model.layers.0.self_attn.k_proj.bias", tr.plan.layout) == "model.layers.0.self_attn.qkv_proj"
    assert tr.plan.format_for("model.layers.0.self_attn.o_proj.weight") is Format.MXFP8
