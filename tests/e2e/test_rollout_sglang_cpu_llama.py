"""Real SGLang (0.5.23, its CPU platform) serving a tiny Llama-architecture model in MXFP8 (our ``--target sglang``
checkpoint, miles-lp's CPU linear method): every ``weight_scale_inv`` loads, at start and on a disk update.

SGLang's Llama loader renames every checkpoint ``*.weight_scale_inv`` to ``*.weight_scale`` before it looks the
parameter up (``sglang/srt/models/llama.py:723``); the MXFP8 linear registers ``weight_scale_inv``. Without the
second name the CPU linear method gives the scale (``sglang_cpu.linear.add_scale_alias``), all 14 scales here are
dropped, stay zero, and the model serves a different policy. Qwen3's loader keeps the name: its MXFP8 tests are in
``test_rollout_sglang_cpu_server.py``. Slow: one server start (~30 s on an idle 2-core machine, ~3 min shared)."""

from __future__ import annotations

import pytest
import torch

from tests.sglang_env import record, sglang_python_or_skip

pytestmark = pytest.mark.slow
PROMPTS = [[3, 17, 99, 4, 250, 7, 1, 2], [5, 6, 9, 11]]


def _disk(ckpt) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {n: t for f in sorted(ckpt.glob("*.safetensors")) for n, t in load_file(f).items()}


def test_llama_mxfp8_on_real_sglang_loads_every_scale(tmp_path):
    from miles_lp.rollout.engine import SamplingParams, tensor_digest
    from miles_lp.rollout.sglang import SGLangHTTPEngine
    from miles_lp.rollout.testing import policy_for, tiny_checkpoint, tiny_hf
    from miles_lp.train.config import TrainConfig
    from miles_lp.train.embedded import EmbeddedTrainer, plan_for_model

    python = sglang_python_or_skip()
    ckpt = tiny_checkpoint("llama", "mxfp8", num_layers=2)
    other = tiny_checkpoint("llama", "mxfp8", seed=1, num_layers=2)  # same names and shapes, other bytes
    disk = _disk(ckpt)
    scales = sorted(n for n in disk if n.endswith(".weight_scale_inv"))
    assert len(scales) == 14 and all(disk[n].dtype == torch.uint8 and disk[n].any() for n in scales)
    eng = SGLangHTTPEngine(None, flavor="launch", checkpoint=ckpt, update_dir=tmp_path / "updates",
                           server_options={"python": python, "threads": 1})
    try:
        held = eng.weight_digests(list(disk))
        assert held == {n: tensor_digest(t) for n, t in disk.items()}  # every scale as stored, none left zero
        assert eng.quantized_params() == dict.fromkeys((n for n in disk if n.endswith("_proj.weight")), "mxfp8")
        assert set(eng.param_specs()) == set(disk)  # the scale's second name is not a tensor of its own
        hf = tiny_hf("llama", 0, 2)
        learner = EmbeddedTrainer(hf, plan_for_model(policy_for("mxfp8"), hf), TrainConfig(device="cpu"))
        gens = eng.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=0))
        seqs = [torch.tensor(p + g.output_ids) for p, g in zip(PROMPTS, gens, strict=True)]
        lps, _ = learner.logprobs(seqs)
        gap = max(float((g.logprobs - lp[len(p) - 1:].float()).abs().max())
                  for g, lp, p in zip(gens, lps, PROMPTS, strict=True))
        record(what="sglang-cpu llama mxfp8 max |logprob - learner|", value=gap)
        assert gap < 0.05  # the served policy is the learner's (zero scales: every logit ~0, gaps of several nats)
        eng.update_from_disk(str(other), weight_version=1)  # the same loader again, on the update path
        new = _disk(other)
        assert eng.weight_digests(list(new)) == {n: tensor_digest(t) for n, t in new.items()}
        assert any(not torch.equal(new[n], disk[n]) for n in scales)
        log = (tmp_path / "sglang-server.log").read_text(errors="replace")
        assert "not found in params_dict" not in log
    finally:
        eng.close()
