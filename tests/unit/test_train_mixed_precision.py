"""``train.param_dtype: bf16`` with an fp32 master (embedded trainer): BF16 compute copies, FP32 masters in the
optimizer, gradients accumulated in FP32, the copies = the masters rounded after each step, the export = the
copies, resume bit-identical, and the refusals."""

from __future__ import annotations

import pytest
import torch

from miles_lp.config import Where, parse_dataclass
from miles_lp.errors import ConfigError
from miles_lp.rollout.testing import policy_for, tiny_hf
from miles_lp.train.config import TrainConfig
from miles_lp.train.embedded import EmbeddedTrainer, nll_loss, plan_for_model
from miles_lp.train.quant_linear import learner_weights


def _cfg(**kw):
    return parse_dataclass(TrainConfig, {"device": "cpu", "lr": 1e-2, **kw}, Where("<t>", "train"))


def _trainer(arch="qwen3_moe", precision="mxfp8", **kw):
    path = tiny_hf(arch, 0, 2)
    plan = plan_for_model(policy_for(precision), path) if precision else None
    return EmbeddedTrainer(path, plan, _cfg(**kw))


def _samples(n=(9, 7, 12), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(4, 60, (k,), generator=g)} for k in n]


def test_bf16_copies_fp32_masters_and_the_step():
    tr = _trainer(param_dtype="bf16")
    assert {p.dtype for p in tr.model.parameters()} == {torch.bfloat16}
    opt_params = [p for g in tr.optimizer.param_groups for p in g["params"]]
    assert {p.dtype for p in opt_params} == {torch.float32}
    assert len(opt_params) == len(tr.masters) == len(list(tr.model.parameters()))  # tied weights once
    before = {n: m.detach().clone() for n, (_, m) in tr.masters.items()}
    st = tr.train_step(_samples(), nll_loss)
    assert st["finite"] and st["step"] == 1
    moved = 0
    for name, (prm, master) in tr.masters.items():
        assert torch.equal(prm, master.detach().to(torch.bfloat16)), name  # the copy = the master, rounded
        assert prm.grad is None and prm.dtype == torch.bfloat16
        moved += int(not torch.equal(master, before[name]))
    assert moved > len(tr.masters) // 2
    # buffers keep their dtype; the export and the quantized grids read the compute copies
    exported = dict(tr.export_weights())
    emb = tr.masters["model.embed_tokens.weight"][0]
    assert torch.equal(exported["model.embed_tokens.weight"], emb)
    from miles_lp.formats import quantize_mxfp8

    for name, grid in learner_weights(tr.model):
        if ".experts." in name:
            continue
        w = tr.model.get_submodule(name.removesuffix(".weight")).weight
        ref = quantize_mxfp8(w.detach())
        assert torch.equal(grid.data.view(torch.uint8), ref.data.view(torch.uint8)), name
        break


def test_gradients_accumulate_in_fp32_across_micro_batches():
    """The masters' gradient (fp32) barely depends on the micro-batch split: each micro-batch's weight gradient
    is a BF16 tensor (autograd gives a parameter's dtype; Megatron's fused wgrad writes fp32 main_grad directly,
    torch cannot), rounded once, then summed in fp32: ~2^-9 relative per micro-batch, not per token."""
    grads = []
    for budget in (8192, 12):
        tr = _trainer(precision=None, param_dtype="bf16", micro_batch_tokens=budget)
        tr.optimizer.zero_grad()
        _, packs = tr.accumulate_grads(_samples(), nll_loss)
        grads.append(({n: m.grad.clone() for n, (_, m) in tr.masters.items()}, len(packs)))
    (g1, n1), (g2, n2) = grads
    assert n1 == 1 and n2 == 3
    for name in g1:
        assert g1[name].dtype == torch.float32
        rel = float((g1[name] - g2[name]).norm() / g1[name].norm().clamp_min(1e-30))
        assert rel < 1e-2, (name, rel)


def test_first_forward_is_the_bf16_model_and_fp32_masters_keep_small_updates():
    """Step 0: the forward of the HF model with BF16 parameters and its buffers as built (RoPE ``inv_freq`` stays
    fp32, as in the reference engine's BF16 model; a ``master_dtype: bf16`` trainer casts it). Updates below a
    BF16 ulp are lost by a BF16 master and kept by the FP32 one."""
    import transformers

    mixed = _trainer(precision=None, param_dtype="bf16", lr=1e-5)
    plain = _trainer(precision=None, master_dtype="bf16", lr=1e-5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_hf("qwen3_moe", 0, 2)), dtype=torch.float32)
    for prm in hf.parameters():
        prm.data = prm.data.to(torch.bfloat16)
    s = _samples()
    with torch.no_grad():
        for smp in s:  # one sequence per call: the same shapes as the plain forward (BF16 rounding is shape-bound)
            t = smp["tokens"]
            (x,), _ = mixed.logprobs([t])
            ref = torch.log_softmax(hf(input_ids=t[None], use_cache=False).logits[0].float(), -1)[:-1]
            assert torch.equal(x, ref.gather(-1, t[1:, None])[:, 0])
    w0 = {n: m.detach().clone() for n, (_, m) in mixed.masters.items()}
    p0 = {n: p.detach().clone() for n, p in plain.model.named_parameters()}
    for _ in range(3):
        mixed.train_step(s, nll_loss)
        plain.train_step(s, nll_loss)
    name = "model.layers.0.self_attn.q_proj.weight"
    kept = float((mixed.masters[name][1] != w0[name]).float().mean())
    lost = float((dict(plain.model.named_parameters())[name] != p0[name]).float().mean())
    assert kept > 0.9 and lost < kept, (kept, lost)


def test_resume_is_bit_identical(tmp_path):
    from miles_lp.train.state_io import load_learner_state, save_learner_state

    a = _trainer(param_dtype="bf16")
    a.train_step(_samples(seed=1), nll_loss)
    save_learner_state(a.state_dict(), tmp_path / "s")
    b = _trainer(param_dtype="bf16")
    b.load_state_dict(load_learner_state(tmp_path / "s"))
    for t in (a, b):
        t.train_step(_samples(seed=2), nll_loss)
    for (n, (pa, ma)), (_, (pb, mb)) in zip(a.masters.items(), b.masters.items(), strict=True):
        assert torch.equal(ma, mb) and torch.equal(pa, pb), n
    plain = _trainer()
    with pytest.raises(ConfigError, match="param_dtype different from master_dtype, this trainer runs the other"):
        plain.load_state_dict(load_learner_state(tmp_path / "s"))


def test_refusals():
    with pytest.raises(ConfigError, match="param_dtype.*fp32 compute copies of a bf16 master"):
        _cfg(param_dtype="fp32", master_dtype="bf16")
    with pytest.raises(ConfigError, match="implemented by the embedded learner only"):
        _cfg(param_dtype="bf16", backend="megatron")
    assert not _cfg(param_dtype="fp32").mixed_precision and _cfg(param_dtype="bf16").compute_dtype == "bf16"
    from miles_lp.launch.recipe import load_recipe_text

    text = ("model: {path: 'tiny:qwen3', num_layers: 1}\nprecision: {default: mxfp8}\n"
            "train: {device: cpu, param_dtype: bf16}\nrollout: {device: cpu, dtype: DT}\nsteps: 1\n")
    with pytest.raises(ConfigError, match=r"'train.param_dtype'.*rollout.dtype is fp32; set rollout.dtype: auto or bf16"):
        load_recipe_text(text.replace("DT", "fp32"))
    assert load_recipe_text(text.replace("DT", "bf16")).train.mixed_precision
    assert load_recipe_text(text.replace("DT", "auto")).train.compute_dtype == "bf16"
