"""The embedded trainer as a ``Learner``: whole-model export under HF names, the C1 record, resume.

Tiny models (2 layers). Every check compares against the source checkpoint's own bytes or the codecs.
"""

from __future__ import annotations

import copy

import pytest
import torch

from miles_lp import formats
from miles_lp.checkpoint.tiny import ARCHS, make_tiny_model, tiny_config
from miles_lp.config import Where
from miles_lp.errors import CheckpointError, ConfigError
from miles_lp.io.safetensors_io import open_checkpoint, read_tensor
from miles_lp.policy import parse_policy
from miles_lp.train.config import TrainConfig
from miles_lp.train.embedded import EmbeddedTrainer, plan_for_model
from miles_lp.train.learner import Learner
from miles_lp.train.state_io import load_learner_state, save_learner_state

MIXED = {"default": "mxfp8", "backward": "dequantized", "rules": [{"role": "routed_experts", "format": "nvfp4"}]}
BF16_EXPERTS = {"default": "mxfp8", "rules": [{"role": "routed_experts", "format": "bf16"}]}
CPU = TrainConfig(device="cpu", lr=1e-2)


def policy(raw):
    return parse_policy(raw, Where("<test>", "precision"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = make_tiny_model(arch, tmp_path_factory.mktemp(arch), num_layers=2)
        return cache[arch]
    return get


def samples(lengths=(40, 33, 50), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(0, 256, (n,), generator=g)} for n in lengths]


def trainer(d, raw=MIXED, config=CPU):
    return EmbeddedTrainer(d, plan_for_model(policy(raw), d), config)


def reference_grid(tr, name):
    """The codec on the current master weight: MXFP8 rowwise, NVFP4 with gate+up sharing one amax."""
    sd = tr.model.state_dict()
    info = tr.layout.describe(name)
    entry = tr.plan.entry(name)
    if entry.format is formats.Format.MXFP8 or info.expert is None:
        w = sd.get(name)
        assert w is not None
        return formats.quantize_mxfp8(w) if entry.format is formats.Format.MXFP8 else None
    pre = f"model.layers.{info.layer}.mlp.experts."
    e, (gate, _, down) = info.expert, tr.layout.spec.expert_proj  # mixtral: w1, w3, w2
    if name.endswith(f".{down}.weight"):
        return formats.quantize_nvfp4(sd[pre + "down_proj"][e])
    gu = sd[pre + "gate_up_proj"][e]
    half = gu.shape[0] // 2
    g, u = formats.quantize_nvfp4_pair(gu[:half], gu[half:])
    return g if name.endswith(f".{gate}.weight") else u


def same_q(a, b) -> bool:
    ca, cb = a.components(), b.components()
    return ca.keys() == cb.keys() and all(
        torch.equal(ca[k].reshape(-1).view(torch.uint8), cb[k].reshape(-1).view(torch.uint8)) for k in ca)


@pytest.mark.parametrize("arch", ARCHS)
def test_export_covers_every_checkpoint_tensor(tiny, arch):
    d = tiny(arch)
    tr = trainer(d)
    ck = open_checkpoint(d).tensors
    ex = list(tr.export_weights())
    names = [n for n, _ in ex]
    assert len(names) == len(set(names)) and set(names) == set(ck)  # every tensor, once
    for name, t in ex:
        if name in tr.plan.quantized():
            assert not isinstance(t, torch.Tensor) and t.format is tr.plan.format_for(name)
            ref = reference_grid(tr, name)
            if ref is not None:
                assert same_q(t, ref), name
        else:  # BF16 parameters and buffers: the checkpoint's own dtype and bytes (fp32 master round trip)
            want = read_tensor(ck[name])
            assert isinstance(t, torch.Tensor) and t.dtype == want.dtype and torch.equal(t, want), name
    if arch == "deepseek_v3":  # an F32 buffer in a BF16 checkpoint keeps F32
        assert ck["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == "F32"


def test_bf16_fused_experts_expand_to_per_expert_names(tiny):
    d = tiny("qwen3_moe")
    tr = trainer(d, BF16_EXPERTS)
    ck = open_checkpoint(d).tensors
    ex = dict(tr.export_weights())
    for e in range(4):
        for p in ("gate_proj", "up_proj", "down_proj"):
            n = f"model.layers.1.mlp.experts.{e}.{p}.weight"
            assert isinstance(ex[n], torch.Tensor) and torch.equal(ex[n], read_tensor(ck[n])), n
    assert "model.layers.1.mlp.experts.gate_up_proj" not in ex


def test_export_after_steps_is_the_codec_of_the_new_master(tiny):
    d = tiny("qwen3_moe")
    tr = trainer(d)
    before = dict(tr.export_weights())
    for _ in range(2):
        assert tr.train_step(samples())["finite"]
    after = dict(tr.export_weights())
    changed = 0
    for name in tr.plan.quantized():
        assert same_q(after[name], reference_grid(tr, name)), name
        changed += not same_q(after[name], before[name])
    assert changed > len(tr.plan.quantized()) // 2  # the steps moved the grid
    sd = tr.model.state_dict()
    n = "model.layers.0.input_layernorm.weight"
    assert after[n].dtype == torch.bfloat16 and torch.equal(after[n], sd[n].to(torch.bfloat16))


def _tied_checkpoint(tmp_path):
    import transformers

    cfg = tiny_config("qwen3", num_layers=1)
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path, model


def test_tied_weights_exported_once_under_the_stored_name(tmp_path):
    d, model = _tied_checkpoint(tmp_path)
    assert "lm_head.weight" not in open_checkpoint(d).tensors
    for source in (d, model):  # from the folder (its names) and in memory (first name of a shared storage)
        tr = EmbeddedTrainer(source, plan_for_model(policy({"default": "mxfp8"}), source), CPU)
        names = [n for n, _ in tr.export_weights()]
        assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
        assert len(names) == len(set(names)) == len(open_checkpoint(d).tensors)


def test_executed_quantized_is_recorded_by_the_forward_not_read_from_the_plan(tiny):
    d = tiny("qwen3_moe")
    tr = trainer(d)
    assert tr.executed_quantized() == {}  # nothing ran yet
    tr.logprobs([samples()[0]["tokens"]])
    want = {n: e.format.value for n, e in tr.plan.quantized().items()}
    assert tr.executed_quantized() == want
    # fault injection: a module that runs BF16 although the plan quantizes it is missing from the record
    tr2 = trainer(d)
    ql = tr2.model.get_submodule("model.layers.0.self_attn.o_proj")
    lin = torch.nn.Linear(ql.in_features, ql.out_features, bias=False)
    lin.weight = ql.weight
    tr2.model.model.layers[0].self_attn.o_proj = lin
    tr2.logprobs([samples()[0]["tokens"]])
    got = tr2.executed_quantized()
    assert "model.layers.0.self_attn.o_proj.weight" not in got and len(got) == len(want) - 1


def test_resume_is_bit_identical(tiny, tmp_path):
    d = tiny("qwen3_moe")
    a = trainer(d)
    for _ in range(2):
        a.train_step(samples(seed=1))
    save_learner_state(a.state_dict(), tmp_path / "state")
    losses_a = [a.train_step(samples(seed=s))["loss"] for s in (2, 3)]
    final_a = {k: v.clone() for k, v in a.model.state_dict().items()}

    b = trainer(d)
    b.load_state_dict(load_learner_state(tmp_path / "state"))
    assert b.step == 2
    losses_b = [b.train_step(samples(seed=s))["loss"] for s in (2, 3)]
    assert losses_a == losses_b and b.step == 4
    assert all(torch.equal(final_a[k], v) for k, v in b.model.state_dict().items())
    assert all(same_q(x, y) for (_, x), (_, y) in zip(a.learner_weights(), b.learner_weights(), strict=True))

    # control: the same weights without the optimizer state do not resume (the test can fail)
    c = trainer(d)
    c.model.load_state_dict(load_learner_state(tmp_path / "state")["model"])
    losses_c = [c.train_step(samples(seed=s))["loss"] for s in (2, 3)]
    assert losses_c[0] == losses_a[0] and losses_c[1] != losses_a[1]


def test_state_round_trip_keeps_types(tmp_path):
    import random

    state = {"step": 3, "opt": {"state": {0: {"t": torch.arange(3.0)}}, "param_groups": [{"betas": (0.9, 0.99)}]},
             "rng": {"python": random.getstate(), "torch": torch.get_rng_state()}, "none": None}
    save_learner_state(state, tmp_path / "s")
    back = load_learner_state(tmp_path / "s")
    assert back["opt"]["state"][0]["t"].tolist() == [0.0, 1.0, 2.0]
    assert back["opt"]["param_groups"][0]["betas"] == (0.9, 0.99) and back["rng"]["python"] == random.getstate()
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"]) and back["none"] is None and back["step"] == 3
    with pytest.raises(CheckpointError, match="is a object"):
        save_learner_state({"x": object()}, tmp_path / "bad")
    with pytest.raises(CheckpointError, match="not a learner state folder: tensors.safetensors is missing"):
        load_learner_state(tmp_path)


def test_refusals(tiny):
    d = tiny("qwen3")
    with pytest.raises(ConfigError, match="compiled PrecisionPlan.*plan_for_model"):
        EmbeddedTrainer(d, policy(MIXED), CPU)
    a, b = trainer(d, {"default": "mxfp8"}), trainer(d, {"default": "nvfp4"})
    with pytest.raises(ConfigError, match="saved under plan"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ConfigError, match="kind 'megatron'"):
        a.load_state_dict({**a.state_dict(), "kind": "megatron"})


def test_embedded_trainer_is_a_learner(tiny):
    tr = trainer(tiny("qwen3"))
    assert isinstance(tr, Learner)
    st = copy.deepcopy(tr.state_dict())
    assert set(st) >= {"model", "optimizer", "step", "rng"}
