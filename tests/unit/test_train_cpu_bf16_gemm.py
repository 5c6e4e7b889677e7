"""bf16 activations on CPU: the emulated quantized GEMM takes bf16 operands (as on CUDA) and still accumulates in
fp32; the reference path decodes each weight's grid once per step and a new step decodes the new grid."""

from __future__ import annotations

import torch

from miles_lp.formats import quantize_mxfp8
from miles_lp.formats.schemes import scheme_for
from miles_lp.formats.spec import BackwardMode, Format
from miles_lp.rollout.layers import operand_dtype
from miles_lp.train.gemm import gemm_operand_dtype, quantized_linear
from miles_lp.train.grid import WeightGrid
from miles_lp.train.recipe import LinearRecipe


def test_operand_dtype_rule_same_on_both_sides():
    for dt, want in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)):
        assert gemm_operand_dtype(torch.zeros(1, dtype=dt)) is want
        assert operand_dtype(torch.device("cpu"), dt) is want
        for fmt in ("bf16", "mxfp8", "nvfp4"):  # what the engine's layers multiply with (EngineLinear.op_dtype)
            assert scheme_for(fmt).operand_dtype(torch.device("cpu"), dt) is want


def test_cpu_bf16_gemm_accumulates_in_fp32():
    g = torch.Generator().manual_seed(0)
    k = 1536  # long reductions: a bf16 accumulator would be off by many ulps
    x = quantize_mxfp8(torch.randn(64, k, generator=g)).dequantize(torch.bfloat16)
    w = quantize_mxfp8(torch.randn(96, k, generator=g)).dequantize(torch.bfloat16)
    exact = (x.double() @ w.double().T).to(torch.bfloat16)  # one rounding of the exact sum
    y = torch.nn.functional.linear(x, w)
    assert float((y != exact).float().mean()) < 1e-3  # fp32 accumulation: only rare rounding-boundary cases differ
    acc = torch.zeros(64, 96, dtype=torch.bfloat16)  # what a bf16 accumulator gives: far from the exact sum
    for j in range(0, k, 32):
        acc = acc + (x[:, j:j + 32].float() @ w[:, j:j + 32].float().T).to(torch.bfloat16)
    assert float((acc != exact).float().mean()) > 0.1


def test_reference_path_decodes_the_weight_once_per_step():
    recipe = LinearRecipe(Format.MXFP8, BackwardMode.DEQUANTIZED, None)
    grid = WeightGrid(recipe, kernel="reference")
    w = torch.randn(64, 128).bfloat16().requires_grad_(True)
    x = torch.randn(8, 128).bfloat16()
    quantized_linear(x, w, recipe, grid=grid)
    first = grid._deq
    assert first is not None and first.dtype == torch.bfloat16
    y = quantized_linear(x, w, recipe, grid=grid)
    assert grid._deq is first  # the second forward reuses the decode
    y.float().sum().backward()
    with torch.no_grad():
        w.add_(1.0)  # an optimizer step: the version moves
    y2 = quantized_linear(x, w, recipe, grid=grid)
    assert grid._deq is not first
    want = torch.nn.functional.linear(quantize_mxfp8(x).dequantize(torch.bfloat16),
                                      quantize_mxfp8(w.detach()).dequantize(torch.bfloat16))
    assert torch.equal(y2, want)


def test_siblings_quantize_their_common_input_once(monkeypatch):
    """q/k/v and gate/up read one input: the reference path quantizes it once per forward (4 activation grids per
    Llama layer, not 7), and log-probs and gradients are byte-identical to quantizing it per linear."""
    from miles_lp.rollout.testing import policy_for, tiny_hf
    from miles_lp.train import gemm
    from miles_lp.train.config import TrainConfig
    from miles_lp.train.embedded import EmbeddedTrainer, nll_loss, plan_for_model

    src = tiny_hf("llama")
    seqs = [torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 14, 5)]
    samples = [{"tokens": s} for s in seqs]
    calls = [0]
    real = gemm.quantize_activation
    monkeypatch.setattr(gemm, "quantize_activation", lambda x, r: calls.__setitem__(0, calls[0] + 1) or real(x, r))
    out = []
    for shared in (True, False):
        tr = EmbeddedTrainer(src, plan_for_model(policy_for("mxfp8"), src), TrainConfig(device="cpu", param_dtype="bf16"))
        grids = [m.grid for m in tr.model.modules() if hasattr(m, "grid")]
        assert sum(g.input_cache is not None for g in grids) == 5 * tr.model.config.num_hidden_layers
        if not shared:
            for g in grids:
                g.input_cache = None
        calls[0] = 0
        lp, _ = tr.logprobs(seqs)
        n_layers = tr.model.config.num_hidden_layers
        assert calls[0] == (4 if shared else 7) * n_layers
        tr.optimizer.zero_grad(set_to_none=True)
        tr.accumulate_grads(samples, nll_loss)
        grads = {n: m.grad.clone() for n, (_, m) in tr.masters.items() if m.grad is not None}
        out.append((lp, grads))
    (lp_a, g_a), (lp_b, g_b) = out
    assert all(torch.equal(a, b) for a, b in zip(lp_a, lp_b, strict=True))
    assert g_a.keys() == g_b.keys() and all(torch.equal(g_a[n], g_b[n]) for n in g_a)
