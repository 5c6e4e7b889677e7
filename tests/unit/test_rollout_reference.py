"""The reference engine serving converted tiny checkpoints: logprobs vs an independent dequantize-then-run
transformers forward, vs the learner on the shared grid, and update+finish == fresh load (bytes and outputs)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from miles_lp.rollout.engine import Engine, SamplingParams
from miles_lp.rollout.reference import ReferenceEngine
from miles_lp.rollout.testing import tiny_checkpoint, tiny_hf

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = "policies/qwen3-moe-mxfp8-nvfp4-experts.yaml"
PROMPTS = [[3, 17, 99, 4, 250, 7, 1, 2, 8], [5, 6], [40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def moe_ckpt() -> Path:
    return tiny_checkpoint("qwen3_moe", RECIPE)


@pytest.fixture(scope="module")
def engine(moe_ckpt) -> ReferenceEngine:
    return ReferenceEngine(moe_ckpt, device="cpu")


# ---- an independent reference: our own weight decode, transformers' own modules, fake-quantized inputs ----
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def deq_mxfp8(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return data.float() * torch.exp2(scale.float() - 127).repeat_interleave(32, dim=-1)


def deq_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    mag = E2M1[codes & 7]
    vals = torch.where(codes >= 8, -mag, mag)
    return vals * scale.float().repeat_interleave(16, dim=-1) * scale_2.float()


def reference_model(ckpt: Path):
    """transformers' model (eager experts) with every weight dequantized from disk, plus {data_ptr: fmt} of the
    quantized GEMM weights (expert slices included) so a patched F.linear can fake-quantize their inputs."""
    import transformers
    from safetensors.torch import load_file

    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("quantization_config", None)
    hf = transformers.AutoConfig.for_model(**cfg)
    hf._experts_implementation = "eager"  # the default grouped_mm would not call F.linear per expert
    model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.float32).eval()
    disk = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        disk.update(load_file(f))
    weights, fmts = {}, {}
    for name, t in disk.items():
        if not name.endswith(".weight"):
            if name.endswith(("weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale")):
                continue
            weights[name] = t.float()
            continue
        p = name[: -len("weight")]
        if p + "weight_scale_inv" in disk:
            weights[name], fmts[name] = deq_mxfp8(t, disk[p + "weight_scale_inv"]), "mxfp8"
        elif p + "weight_scale_2" in disk:
            weights[name], fmts[name] = deq_nvfp4(t, disk[p + "weight_scale"], disk[p + "weight_scale_2"]), "nvfp4"
        else:
            weights[name] = t.float()
    sd, experts = {}, {}
    for name, w in weights.items():
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if m:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = (w, fmts.get(name, "bf16"))
        else:
            sd[name] = w
    for block, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        sd[f"{block}.gate_up_proj"] = torch.stack([torch.cat([parts[(e, "gate")][0], parts[(e, "up")][0]]) for e in range(n)])
        sd[f"{block}.down_proj"] = torch.stack([parts[(e, "down")][0] for e in range(n)])
    model.load_state_dict(sd, strict=True)
    ptr_fmt = {}
    params = dict(model.named_parameters())
    for name, fmt in fmts.items():
        if name in params:
            ptr_fmt[params[name].data_ptr()] = fmt
    for block, parts in experts.items():
        gu, dn = params[f"{block}.gate_up_proj"], params[f"{block}.down_proj"]
        for (e, which), (_, fmt) in parts.items():
            if fmt == "bf16":
                continue
            t = gu[e] if which in ("gate", "up") else dn[e]
            ptr_fmt[t.data_ptr()] = fmt
    return model, ptr_fmt


def reference_logprobs(ckpt: Path, seqs: list[list[int]], prompt_lens: list[int]) -> list[torch.Tensor]:
    import torch.nn.functional as F

    from miles_lp import formats

    model, ptr_fmt = reference_model(ckpt)
    real_linear = F.linear

    def linear(x, w, b=None):
        fmt = ptr_fmt.get(w.data_ptr())
        if fmt == "mxfp8":
            x = formats.quantize_mxfp8(x.reshape(-1, x.shape[-1])).dequantize(torch.float32).reshape(x.shape)
        elif fmt == "nvfp4":  # the recipe's per-token activation scale
            x = formats.quantize_nvfp4(x.reshape(-1, x.shape[-1]), scale_scope="row").dequantize(
                torch.float32).reshape(x.shape)
        return real_linear(x, w, b)

    out = []
    F.linear = linear
    try:
        with torch.no_grad():
            for s, p in zip(seqs, prompt_lens, strict=True):
                logits = model(input_ids=torch.tensor([s])).logits[0].float()
                lp = torch.log_softmax(logits, -1)[p - 1:-1]
                out.append(lp.gather(-1, torch.tensor(s[p:])[:, None])[:, 0])
    finally:
        F.linear = real_linear
    assert ptr_fmt, "the reference found no quantized weight"
    return out


def test_engine_protocol(engine):
    assert isinstance(engine, Engine)
    q = engine.quantized_params()
    assert set(q.values()) == {"mxfp8", "nvfp4"}
    assert q["model.layers.0.self_attn.q_proj.weight"] == "mxfp8"
    assert q["model.layers.0.mlp.experts.3.down_proj.weight"] == "nvfp4"
    assert "lm_head.weight" not in q and "model.layers.3.self_attn.q_proj.weight" not in q  # last 15%: bf16
    specs = engine.param_specs()
    assert specs["model.layers.0.self_attn.q_proj.weight"] == ("float8_e4m3fn", (128, 64))
    assert specs["model.layers.0.self_attn.q_proj.weight_scale_inv"] == ("uint8", (128, 2))
    assert specs["model.layers.0.mlp.experts.0.gate_proj.weight"] == ("uint8", (64, 32))
    assert specs["model.layers.0.mlp.experts.0.gate_proj.weight_scale"] == ("float8_e4m3fn", (64, 4))
    assert specs["model.layers.0.mlp.experts.0.gate_proj.weight_scale_2"] == ("float32", ())
    h = engine.health()
    assert h["status"] == "ok" and h["quantized_layers"] == {"mxfp8": 12, "nvfp4": 36}


def test_logprobs_equal_independent_dequantized_forward(engine, moe_ckpt):
    """MUST-SHOW: batched, left-padded, KV-cached sampling == one full forward per sequence of a plain
    transformers model on the dequantized weights with fake-quantized inputs (float tolerance)."""
    gens = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, seed=3, temperature=1.0))
    seqs = [p + g.output_ids for p, g in zip(PROMPTS, gens, strict=True)]
    ref = reference_logprobs(moe_ckpt, seqs, [len(p) for p in PROMPTS])
    diffs = [float((g.logprobs - r).abs().max()) for g, r in zip(gens, ref, strict=True)]
    assert all(len(g.output_ids) == 10 and g.finish_reason == "length" for g in gens)
    assert max(diffs) < 1e-4, diffs


def test_logprobs_equal_learner_on_shared_grid(engine):
    """The learner (EmbeddedTrainer, fp32 master from the BF16 source, the same recipe) computes the same
    logprobs on the sampled tokens: it quantizes its weights onto the grid the converter wrote."""
    from miles_lp.policy import load_policy
    from miles_lp.rollout.testing import recipe_path
    from miles_lp.train.config import TrainConfig
    from miles_lp.train.embedded import EmbeddedTrainer

    gens = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=5))
    src = tiny_hf("qwen3_moe")
    policy = load_policy(recipe_path(RECIPE))
    from miles_lp.train.embedded import plan_for_model

    plan = plan_for_model(policy, src)
    trainer = EmbeddedTrainer(src, plan, TrainConfig(device="cpu"))
    seqs = [torch.tensor(p + g.output_ids) for p, g in zip(PROMPTS, gens, strict=True)]
    lps, _ = trainer.logprobs(seqs)
    diffs = [float((lp[len(p) - 1:] - g.logprobs).abs().max()) for lp, p, g in zip(lps, PROMPTS, gens, strict=True)]
    assert max(diffs) < 1e-4, diffs


def test_routed_experts_recorded(engine):
    g = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=4, seed=0, return_routed_experts=True))
    for p, x in zip(PROMPTS, g, strict=False):
        assert x.routed_experts.shape == (len(p) + 4 - 1, 4, 2)  # positions fed, MoE layers, top_k
        assert int(x.routed_experts.min()) >= 0 and int(x.routed_experts.max()) < 4
    # the same prompt alone routes the same way (routing is per token, not per batch)
    alone = engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=4, seed=0, return_routed_experts=True))[0]
    assert torch.equal(alone.routed_experts[: len(PROMPTS[1])], g[1].routed_experts[: len(PROMPTS[1])])


def _buckets(ckpt: Path, n: int = 3):
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(f))
    names = sorted(tensors)
    return [[(k, tensors[k]) for k in names[i::n]] for i in range(n)]


def test_update_then_finish_equals_fresh_load(moe_ckpt):
    """MUST-SHOW: an engine updated in place with another checkpoint's tensors == a fresh load of that checkpoint,
    byte for byte in every canonical tensor and in outputs; the storage the kernels read did not move."""
    other = tiny_checkpoint("qwen3_moe", RECIPE, seed=1)
    live = ReferenceEngine(moe_ckpt, device="cpu")
    ptrs = live.storage_pointers()
    before = live.weight_digests()
    live.begin_weight_update()
    for bucket in _buckets(other):
        live.update_weights(bucket)
    report = live.finish_weight_update()
    fresh = ReferenceEngine(other, device="cpu")
    assert report["not_written"] == 0 and report["weight_version"] == 1 and live.weight_version == 1
    assert live.storage_pointers() == ptrs
    after = live.weight_digests()
    assert after == fresh.weight_digests()
    assert all(after[k] != before[k] for k in after if k.endswith("proj.weight"))  # every linear moved
    for name, layer_live in live.model.named_modules():  # derived state too (operands, swizzled scales)
        if hasattr(layer_live, "derived"):
            d_fresh = fresh.model.get_submodule(name).derived()
            for k, t in layer_live.derived().items():
                assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t, d_fresh[k].view(
                    torch.uint8) if t.element_size() == 1 else d_fresh[k]), (name, k)
    sp = SamplingParams(max_new_tokens=8, seed=11)
    a, b = live.generate(PROMPTS, sp), fresh.generate(PROMPTS, sp)
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids and torch.equal(x.logprobs, y.logprobs)
        assert x.weight_version == 1 and y.weight_version == 0


def test_bf16_checkpoint_matches_transformers():
    """A plain BF16 HF checkpoint: the engine (fp32 activations) == transformers' own fp32 forward."""
    import transformers

    src = tiny_hf("qwen3")
    eng = ReferenceEngine(src, device="cpu")
    assert eng.quantized_params() == {}
    g = eng.generate(PROMPTS, SamplingParams(max_new_tokens=5, seed=2))
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    for p, x in zip(PROMPTS, g, strict=True):
        s = torch.tensor([p + x.output_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=s).logits[0].float(), -1)[len(p) - 1:-1]
        ref = lp.gather(-1, s[0, len(p):, None])[:, 0]
        assert float((ref - x.logprobs).abs().max()) < 1e-4


def test_tied_embeddings(tmp_path):
    """Tied lm_head (Qwen2.5-0.5B's shape, the CUDA benchmark model): served from the embedding's tensor."""
    import transformers

    from miles_lp.checkpoint.tiny import tiny_config

    cfg = tiny_config("qwen3")
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp_path)
    eng = ReferenceEngine(tmp_path, device="cpu")
    assert eng.model.lm_head.weight is eng.model.model.embed_tokens.weight
    assert "lm_head.weight" not in eng.param_specs()
    seq = [1, 2, 3, 4, 5, 6]
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(ref(input_ids=torch.tensor([seq])).logits[0], -1)[:-1]
    assert float((eng.score([seq])[0] - lp.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]).abs().max()) < 1e-5


@pytest.mark.parametrize("arch, precision", [("llama", "mxfp8"), ("qwen2_moe", RECIPE), ("mixtral", RECIPE),
                                             ("deepseek_v3", "policies/deepseek-v3-mxfp8.yaml")])
def test_architectures_match_learner(arch, precision):
    """Other layouts (shared experts, Mixtral's w1/w2/w3 and block_sparse_moe names, MLA + sigmoid router): the
    engine serves the checkpoint's canonical names and equals the learner on the shared grid."""
    from miles_lp.rollout.testing import policy_for
    from miles_lp.train.config import TrainConfig
    from miles_lp.train.embedded import EmbeddedTrainer, plan_for_model

    eng = ReferenceEngine(tiny_checkpoint(arch, precision), device="cpu")
    assert set(eng.param_specs()) == set(eng.ckpt.tensors)
    gens = eng.generate(PROMPTS[:2], SamplingParams(max_new_tokens=5, seed=0))
    src = tiny_hf(arch)
    trainer = EmbeddedTrainer(src, plan_for_model(policy_for(precision), src), TrainConfig(device="cpu"))
    lps, _ = trainer.logprobs([torch.tensor(p + g.output_ids) for p, g in zip(PROMPTS, gens, strict=False)])
    assert max(float((lp[len(p) - 1:] - g.logprobs).abs().max()) for lp, p, g in zip(lps, PROMPTS, gens,
                                                                                       strict=False)) < 1e-4
    assert eng.self_check()["ok"]


@pytest.mark.parametrize("precision, dtype", [("mxfp8", "bf16"), ("mxfp8", "fp32"), ("bf16", "bf16")])
def test_shared_prompt_prefill_gives_the_same_bytes(precision, dtype, monkeypatch):
    """A GRPO batch repeats each prompt group_size times: the engine prefills each distinct prompt once and gathers
    its logits and K/V to the rows that repeat it. Tokens and log-probs are byte-identical to one prefill per row
    (1 and 2 intra-op threads), and the shared prefill did run on the distinct prompts only."""
    ckpt = tiny_hf("llama") if precision == "bf16" else tiny_checkpoint("llama", precision)
    eng = ReferenceEngine(ckpt, device="cpu", dtype=dtype)
    batch = [p for p in PROMPTS for _ in range(4)]  # GRPO order: each group's samples side by side
    sp = SamplingParams(max_new_tokens=6, seed=3)
    widths: list[int] = []
    real = eng._prefill
    monkeypatch.setattr(eng, "_prefill", lambda seqs, rows, rec: widths.append(len(seqs)) or real(seqs, rows, rec))
    for threads in (1, 2):
        torch.set_num_threads(threads)  # (the one_thread fixture restores the setting)
        eng.share_prompts = True
        shared = eng.generate(batch, sp)
        assert widths[-1] == len(PROMPTS)
        eng.share_prompts = False
        own = eng.generate(batch, sp)
        assert widths[-1] == len(batch)
        for a, b in zip(shared, own, strict=True):
            assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
            assert torch.equal(a.logprobs, b.logprobs)
    assert len({tuple(g.output_ids) for g in shared}) > len(PROMPTS)  # the samples of a group differ
