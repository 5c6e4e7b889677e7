"""The Megatron backend's backward equals the embedded trainer's (Megatron backward was checked only
for finiteness).

1. Layer level, every (format, backward mode): a Megatron QuantColumnParallelLinear / QuantRowParallelLinear
   and the embedded trainer's QuantLinear on the same weight, input and output gradient give the same output,
   input gradient and weight gradient, bit for bit.
2. Whole model (qwen3_moe, CPU, fp32 master): the embedded trainer's model (transformers + the plan's module
   swap) and the Megatron GPT model (HF weights loaded, the same plan attached) give the same loss and the same
   gradients for the tensors that map one to one (embedding, lm_head, router, attention output, each expert's
   down projection), within a stated tolerance (the GEMM order differs; quantized activations can then round
   differently in a few blocks).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from miles_lp.config import Where
from miles_lp.formats.spec import BackwardMode, Format
from miles_lp.policy import compile_plan, get_layout, parse_policy

mc = pytest.importorskip("megatron.core", reason="megatron-core not installed (extra 'megatron')")


@pytest.fixture(scope="module")
def cpu_forward():
    """Megatron's forward on a CPU-only torch (as in test_train_megatron.py): two CUDA-only call sites
    redirected for this module only."""
    if torch.cuda.is_available():
        yield
        return
    import megatron.core.tensor_parallel as tp

    class _NoFork:
        def fork(self, *a, **k):
            return contextlib.nullcontext()

    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.cuda, "current_device", lambda: "cpu")
        m.setattr(tp, "get_cuda_rng_tracker", lambda *a, **k: _NoFork())
        yield


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny GEMMs; two OpenMP threads are far slower on the shared CPU
    yield
    torch.set_num_threads(n)


def _policy(raw):
    return parse_policy(raw, Where("<test>", "precision"))


@pytest.fixture(scope="module")
def models(mp, cpu_forward):
    import transformers

    from miles_lp.checkpoint.tiny import tiny_config
    from miles_lp.train.megatron.model import build_gpt_model, load_hf_weights

    cfg = tiny_config("qwen3_moe", num_layers=2)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for k, v in hf.state_dict().items():
            if k.endswith("mlp.gate.weight"):
                v.copy_(torch.randn_like(v))  # routing that differs from token to token
    meg = build_gpt_model(cfg, quantized=True)
    load_hf_weights(meg, hf.state_dict(), cfg)
    return cfg, hf, meg


CASES = [(Format.MXFP8, BackwardMode.HIGH_PRECISION), (Format.MXFP8, BackwardMode.DEQUANTIZED),
         (Format.MXFP8, BackwardMode.QUANTIZED), (Format.NVFP4, BackwardMode.HIGH_PRECISION),
         (Format.NVFP4, BackwardMode.DEQUANTIZED)]


@pytest.mark.parametrize("layer", ["qkv", "fc2"])
@pytest.mark.parametrize("fmt,mode", CASES, ids=[f"{f.value}-{m.value}" for f, m in CASES])
def test_megatron_linear_grads_equal_the_embedded_quant_linear(models, layer, fmt, mode):
    from miles_lp.train.quant_linear import LinearRecipe, QuantLinear

    _, _, meg = models
    mod = (meg.decoder.layers[0].self_attention.linear_qkv if layer == "qkv"
           else meg.decoder.layers[0].mlp.experts.local_experts[0].linear_fc2)
    recipe = LinearRecipe(fmt, mode, "token" if fmt is Format.NVFP4 else None, name=layer)
    saved = (mod.recipe, mod.members, mod.grid)
    try:
        mod.set_recipe(recipe, ("w",))
        g = torch.Generator().manual_seed(5)
        n, k = mod.weight.shape
        x = torch.randn(64, k, generator=g, requires_grad=True)
        dy = torch.randn(64, n, generator=g)
        mod.weight.grad = None
        y, _ = mod(x)
        y.backward(dy)
        lin = torch.nn.Linear(k, n, bias=False)
        lin.weight = torch.nn.Parameter(mod.weight.detach().clone())
        emb = QuantLinear.from_linear(lin, recipe, "w", kernel="reference")
        x2 = x.detach().clone().requires_grad_(True)
        y2 = emb(x2)
        y2.backward(dy)
        assert torch.equal(y, y2), "forward"
        assert torch.equal(x.grad, x2.grad), "input gradient"
        assert torch.equal(mod.weight.grad, lin.weight.grad), "weight gradient"
        assert mod.weight.grad.abs().sum() > 0
    finally:
        mod.weight.grad = None
        mod.recipe, mod.members, mod.grid = saved


def _megatron_logits(meg, ids):
    s = ids.shape[1]
    pos = torch.arange(s)[None].expand(ids.shape[0], -1)
    mask = torch.triu(torch.ones(s, s), 1).bool()[None, None]
    return meg(ids, pos, attention_mask=mask)


def _nll(logits, ids):
    lp = torch.log_softmax(logits[:, :-1].float(), -1)
    return -lp.gather(-1, ids[:, 1:, None]).mean()


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _run_both(models, raw, tol):
    """The same batch through the embedded trainer's model and the Megatron model; both backwards done."""
    import copy

    from miles_lp.train.embedded import apply_plan
    from miles_lp.train.megatron.layers import attach_plan
    from miles_lp.train.megatron.model import build_gpt_model, load_hf_weights

    cfg, hf0, _ = models
    layout = get_layout(cfg)
    plan = compile_plan(_policy(raw), layout, require_quantized=False)
    hf = copy.deepcopy(hf0)
    meg = build_gpt_model(cfg, quantized=True)
    load_hf_weights(meg, hf.state_dict(), cfg)
    if plan.quantized():
        apply_plan(hf, plan, layout)
        attach_plan(meg, plan, layout)
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    loss_hf = _nll(hf(input_ids=ids, use_cache=False).logits, ids)
    loss_meg = _nll(_megatron_logits(meg, ids), ids)
    assert abs(loss_hf.item() - loss_meg.item()) < tol * loss_hf.item()
    loss_hf.backward()
    loss_meg.backward()
    return cfg, hf, meg


def _grad_pairs(cfg, hf, meg, routers: bool):
    pairs = {
        "embedding": (hf.model.embed_tokens.weight, meg.embedding.word_embeddings.weight),
        "lm_head": (hf.lm_head.weight, meg.output_layer.weight),
    }
    for i in range(cfg.num_hidden_layers):
        hl, ml = hf.model.layers[i], meg.decoder.layers[i]
        if routers:
            pairs[f"layers.{i}.router"] = (hl.mlp.gate.weight, ml.mlp.router.weight)
        pairs[f"layers.{i}.o_proj"] = (hl.self_attn.o_proj.weight, ml.self_attention.linear_proj.weight)
        for e in range(cfg.num_experts):
            down = hl.mlp.experts.down_proj
            pairs[f"layers.{i}.experts.{e}.down"] = ((down, e), ml.mlp.experts.local_experts[e].linear_fc2.weight)
    return pairs


def _worst(pairs) -> dict[str, float]:
    worst = {}
    for name, (h, m) in pairs.items():
        gh = h[0].grad[h[1]] if isinstance(h, tuple) else h.grad
        assert gh is not None and m.grad is not None, name
        assert gh.abs().sum() > 0, name
        worst[name] = _rel(m.grad, gh)
    return worst


QUANT = {"default": "mxfp8", "backward": "dequantized", "rules": [{"role": "routed_experts", "format": "nvfp4"}]}


@pytest.mark.parametrize("raw,tol", [
    ({"default": "bf16"}, 1e-5),  # no quantization: fp32 up to summation order (measured <= 1.5e-6)
    (QUANT, 0.05),  # measured <= 1.5e-2 (layer 0, downstream of the router difference below), 2e-7 elsewhere
], ids=["bf16", "mxfp8+nvfp4-experts"])
def test_whole_model_loss_and_grads_equal_the_embedded_trainers(models, raw, tol):
    """Embedding, lm_head, attention output and every expert's down projection; routers too without
    quantization (with it, see the next test)."""
    cfg, hf, meg = _run_both(models, raw, tol)
    worst = _worst(_grad_pairs(cfg, hf, meg, routers=not plan_quantizes(raw)))
    bad = {n: r for n, r in worst.items() if not r < tol}
    assert not bad, f"gradients differ beyond {tol}: {bad}"


def plan_quantizes(raw) -> bool:
    return raw.get("default") != "bf16" or bool(raw.get("rules"))


@pytest.mark.xfail(strict=True, reason=(
    "Megatron-Core 0.16 multiplies the routing probability into the down projection's INPUT "
    "(MLP.forward(per_token_scale=probs): intermediate * probs, then linear_fc2), so its fc2 quantizes p * act; "
    "the embedded trainer (and SGLang/vLLM fused MoE) quantize act and multiply p after the down projection. "
    "With quantized experts the router gradients then differ by ~8-11% (measured) and the MXFP8 fc2 activation "
    "grid differs from the engine's"))
def test_router_grads_equal_under_quantized_experts(models):
    cfg, hf, meg = _run_both(models, QUANT, 0.05)
    worst = _worst({k: v for k, v in _grad_pairs(cfg, hf, meg, routers=True).items() if "router" in k})
    assert max(worst.values()) < 0.05, worst
