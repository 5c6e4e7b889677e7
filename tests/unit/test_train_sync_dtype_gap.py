"""What the sync sends vs what the learner computes with, for the tensors it sends in BF16 (norms, embeddings, every
linear of a BF16 run): with FP32 masters and no ``param_dtype`` the learner's forward reads FP32 values and the
export rounds them to the checkpoint's BF16, so an update below half a BF16 ulp never reaches the engine (the
cause of the growing ``rollout_corr/kl`` in docs/pretrained.md). ``param_dtype: bf16`` computes with the very BF16
copies the export sends."""

from __future__ import annotations

import pytest
import torch

from miles_lp.train.config import TrainConfig
from miles_lp.train.embedded import EmbeddedTrainer, nll_loss

pytestmark = pytest.mark.usefixtures("one_thread")


def _trainer(tmp_path, **kw):
    import transformers

    from miles_lp.checkpoint.tiny import tiny_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", num_layers=1), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "m")
    t = EmbeddedTrainer(tmp_path / "m", None, TrainConfig(lr=1e-5, betas=(0.9, 0.99), device="cpu", **kw))
    seqs = [torch.randint(4, 100, (12,)) for _ in range(4)]
    t.train_step([{"tokens": s} for s in seqs], nll_loss)
    return t


def _gap(t) -> tuple[float, int]:
    params = dict(t.model.named_parameters())
    worst, unchanged = 0.0, 0
    for name, sent in t.export_weights():
        mine = params[name].detach()
        worst = max(worst, float((mine.float() - sent.float()).abs().max()))
        unchanged += int((mine != sent.to(mine.dtype)).any())
    return worst, unchanged


def test_fp32_masters_send_a_rounded_copy_of_what_the_learner_computes_with(tmp_path):
    t = _trainer(tmp_path)
    assert next(t.model.parameters()).dtype == torch.float32
    worst, differing = _gap(t)
    assert worst > 0 and differing > 0  # the engine gets other numbers than the learner's forward reads
    # the sent copy is the BF16 rounding of the master: sub-ulp updates vanish from it
    w = t.model.model.norm.weight.detach()
    sent = dict(t.export_weights())["model.norm.weight"]
    assert torch.equal(sent, w.to(torch.bfloat16)) and not torch.equal(sent.float(), w)


def test_param_dtype_bf16_computes_with_what_is_sent(tmp_path):
    t = _trainer(tmp_path, param_dtype="bf16")
    assert next(t.model.parameters()).dtype == torch.bfloat16
    assert _gap(t) == (0.0, 0)
