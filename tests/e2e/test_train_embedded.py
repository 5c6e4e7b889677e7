"""The embedded trainer on tiny transformers models: plan applied by module swap (fused MoE experts too),
determinism, micro-batching, packing, and the exported grid."""

from __future__ import annotations

import json

import pytest
import torch

from miles_lp import formats
from miles_lp.checkpoint.tiny import ARCHS, make_tiny_model
from miles_lp.config import Where
from miles_lp.policy import compile_plan, get_layout, parse_policy
from miles_lp.train.config import TrainConfig
from miles_lp.train.embedded import EmbeddedTrainer, nll_loss
from miles_lp.train.quant_linear import QuantExperts, QuantLinear


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = make_tiny_model(arch, tmp_path_factory.mktemp(arch), num_layers=2)
        return cache[arch]
    return get


def plan_for(model_dir, raw):
    layout = get_layout(json.loads((model_dir / "config.json").read_text()))
    return compile_plan(parse_policy(raw, Where("<test>", "precision")), layout)


MXFP8_NVFP4_EXPERTS = {"default": "mxfp8", "backward": "dequantized",
                       "rules": [{"role": "routed_experts", "format": "nvfp4"}]}


def samples(lengths=(40, 33, 50, 20), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(0, 256, (n,), generator=g)} for n in lengths]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_swaps_and_steps(tiny_dir, arch):
    d = tiny_dir(arch)
    tr = EmbeddedTrainer(d, plan_for(d, MXFP8_NVFP4_EXPERTS), TrainConfig(lr=1e-3, micro_batch_tokens=96))
    kinds = {type(m) for m in tr.model.modules()}
    assert QuantLinear in kinds
    if arch not in ("qwen3", "qwen3_wide", "llama"):  # the dense tiny architectures
        assert QuantExperts in kinds
    s = tr.train_step(samples())
    assert s["finite"] and s["micro_batches"] == 2 and s["padded_tokens"] == 192  # padded to 32 under MXFP8
    assert {n for n, _ in tr.learner_weights()} == set(tr.plan.quantized())


def test_deterministic_under_seed(tiny_dir):
    d = tiny_dir("qwen3_moe")
    runs = []
    for _ in range(2):
        tr = EmbeddedTrainer(d, plan_for(d, MXFP8_NVFP4_EXPERTS), TrainConfig(lr=1e-3, seed=3, micro_batch_tokens=64))
        losses = [tr.train_step(samples())["loss"] for _ in range(3)]
        runs.append((losses, {k: v.clone() for k, v in tr.model.state_dict().items()}))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
    assert runs[0][0][2] < runs[0][0][0]


def test_gradients_do_not_depend_on_micro_batching(tiny_dir):
    d = tiny_dir("qwen3_moe")
    grads = []
    for budget in (64, 4096):
        tr = EmbeddedTrainer(d, plan_for(d, MXFP8_NVFP4_EXPERTS), TrainConfig(micro_batch_tokens=budget))
        _, packs = tr.accumulate_grads(samples(), nll_loss)
        grads.append(({n: p.grad.clone() for n, p in tr.model.named_parameters()}, len(packs)))
    assert grads[0][1] == 4 and grads[1][1] == 1
    for n, g in grads[0][0].items():
        torch.testing.assert_close(g, grads[1][0][n], rtol=1e-4, atol=1e-6, msg=n)


def test_packing_does_not_leak_between_sequences(tiny_dir):
    d = tiny_dir("qwen3")
    tr = EmbeddedTrainer(d, plan_for(d, {"default": "mxfp8"}), TrainConfig(micro_batch_tokens=4096))
    batch = [s["tokens"] for s in samples()]
    packed, ent = tr.logprobs(batch)
    for i, seq in enumerate(batch):
        alone, ent1 = tr.logprobs([seq])
        torch.testing.assert_close(packed[i], alone[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ent[i], ent1[0], rtol=1e-4, atol=1e-4)
        assert packed[i].shape == (seq.numel() - 1,) and (packed[i] <= 0).all()


def test_exported_grid_equals_codec_on_updated_master(tiny_dir):
    d = tiny_dir("qwen3_moe")
    tr = EmbeddedTrainer(d, plan_for(d, MXFP8_NVFP4_EXPERTS), TrainConfig(lr=1e-2))
    tr.train_step(samples())
    lw = dict(tr.learner_weights())
    sd = tr.model.state_dict()
    q = lw["model.layers.1.self_attn.o_proj.weight"]
    ref = formats.quantize_mxfp8(sd["model.layers.1.self_attn.o_proj.weight"])
    assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(q.scale, ref.scale)
    gu = sd["model.layers.0.mlp.experts.gate_up_proj"][1]
    rg, ru = formats.quantize_nvfp4_pair(gu[:64], gu[64:])
    for name, r in (("gate_proj", rg), ("up_proj", ru)):
        got = lw[f"model.layers.0.mlp.experts.1.{name}.weight"]
        assert torch.equal(got.data, r.data) and torch.equal(got.global_scale, r.global_scale)
        assert torch.equal(got.scale.view(torch.uint8), r.scale.view(torch.uint8))


def test_dense_nvfp4_gate_up_share_one_global_scale(tiny_dir):
    d = tiny_dir("qwen3")
    tr = EmbeddedTrainer(d, plan_for(d, {"default": "nvfp4", "backward": "high_precision"}), TrainConfig())
    tr.logprobs([samples()[0]["tokens"]])
    lw = dict(tr.learner_weights())
    sd = tr.model.state_dict()
    rg, ru = formats.quantize_nvfp4_pair(sd["model.layers.0.mlp.gate_proj.weight"],
                                         sd["model.layers.0.mlp.up_proj.weight"])
    g, u = lw["model.layers.0.mlp.gate_proj.weight"], lw["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(g.global_scale, u.global_scale) and torch.equal(g.global_scale, rg.global_scale)
    assert torch.equal(g.data, rg.data) and torch.equal(u.data, ru.data)


def test_bf16_master_weights(tiny_dir):
    d = tiny_dir("qwen3")
    tr = EmbeddedTrainer(d, plan_for(d, {"default": "mxfp8"}), TrainConfig(master_dtype="bf16", lr=1e-3))
    assert all(p.dtype == torch.bfloat16 for p in tr.model.parameters())
    assert tr.train_step(samples())["finite"]


def test_trainer_step_invalidates_the_grid_even_without_a_version_bump(tiny_dir, monkeypatch):
    """The trainer's optimizer step hook drops the cached grids: AdamW(fused=True) leaves ``_version`` alone,
    yet the export after the step holds the new master's bytes, quantized once for the step."""
    real = torch.optim.AdamW

    def fused_adamw(params, **kw):
        kw.pop("foreach", None)
        return real(params, fused=True, **kw)
    monkeypatch.setattr(torch.optim, "AdamW", fused_adamw)
    d = tiny_dir("qwen3")
    tr = EmbeddedTrainer(d, plan_for(d, {"default": "mxfp8"}), TrainConfig(lr=1e-2))
    assert tr.optimizer.defaults["fused"]
    name = "model.layers.0.self_attn.o_proj.weight"
    ql = tr.model.get_submodule("model.layers.0.self_attn.o_proj")
    tr.logprobs([samples()[0]["tokens"]])
    before = dict(tr.learner_weights())[name]
    calls, version = ql.grid.quantize_calls, ql.weight._version
    tr.train_step(samples())
    assert ql.weight._version == version  # the update did not bump the version key
    lw1, lw2 = dict(tr.learner_weights()), dict(tr.learner_weights())
    assert ql.grid.quantize_calls == calls + 1 and lw1[name] is lw2[name]  # once per step
    ref = formats.quantize_mxfp8(ql.weight.detach())
    assert torch.equal(lw1[name].data.view(torch.uint8), ref.data.view(torch.uint8))
    assert not torch.equal(lw1[name].data.view(torch.uint8), before.data.view(torch.uint8))


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"])
def test_quant_experts_reproduce_each_architectures_experts(arch):
    """Every MoE architecture's transformers-5 fused experts: QuantExperts with BF16 recipes reproduces the
    module's own forward (routing, gating, weighting), and with MXFP8 it equals that forward run on
    the dequantized grid for gate_up when down stays BF16 and inputs already lie on the grid."""
    import transformers

    from miles_lp.checkpoint.tiny import tiny_config
    from miles_lp.formats.spec import BackwardMode, Format
    from miles_lp.train.quant_linear import LinearRecipe

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch, num_layers=2), dtype=torch.float32)
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.dim() == 3
    e = experts.gate_up_proj.shape[0]
    gu_names = [f"g{i}.{p}" for i in range(e) for p in ("gate", "up")]
    dn_names = [f"d{i}" for i in range(e)]
    hidden = torch.randn(24, experts.gate_up_proj.shape[-1])
    g = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(24)])
    w = torch.softmax(torch.randn(24, 2, generator=g), -1)
    want = experts(hidden, idx, w)
    got = QuantExperts(experts, None, None, gu_names, dn_names)(hidden, idx, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # transformers may sum in another order

    recipe = LinearRecipe(Format.MXFP8, BackwardMode.DEQUANTIZED, name="gate_up")
    qe = QuantExperts(experts, recipe, None, gu_names, dn_names)
    x_grid = formats.quantize_mxfp8(hidden).dequantize(torch.float32)  # per-token blocks: a fixed point
    got = qe(x_grid, idx, w)
    with torch.no_grad():
        experts.gate_up_proj.copy_(formats.quantize_mxfp8(experts.gate_up_proj).dequantize(torch.float32))
    want = experts(x_grid, idx, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
