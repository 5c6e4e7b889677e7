"""The reference engine on CUDA (run on the H200 with `pytest -m gpu`; not run on the CPU-only dev machines).

bf16 activations (the engine's default on CUDA, as the learner's) vs the fp32 CPU engine on the same tokens; an
update + finish on CUDA equals a fresh CUDA load byte for byte; the self-check through the CUDA kernels."""

from __future__ import annotations

import pytest
import torch

from miles_lp.rollout.engine import SamplingParams
from miles_lp.rollout.reference import ReferenceEngine
from miles_lp.rollout.testing import tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
RECIPE = "policies/qwen3-moe-mxfp8-nvfp4-experts.yaml"
PROMPTS = [[3, 17, 99, 4, 250, 7, 1, 2], [5, 6], [40, 41, 42, 43]]


def test_cuda_engine_matches_cpu_engine():
    ck = tiny_checkpoint("qwen3_moe", RECIPE)
    gpu, cpu = ReferenceEngine(ck, device="cuda"), ReferenceEngine(ck, device="cpu")
    assert gpu.health()["dtype"] == "bfloat16" and gpu.quantized_params() == cpu.quantized_params()
    gens = gpu.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=0))
    seqs = [p + g.output_ids for p, g in zip(PROMPTS, gens, strict=True)]
    a, b = gpu.score(seqs), cpu.score(seqs)
    assert max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True)) < 0.1  # bf16 vs fp32 activations
    for g, s, p in zip(gens, a, PROMPTS, strict=True):  # generate's logprobs == teacher-forced ones, on CUDA
        assert float((g.logprobs - s[len(p) - 1:]).abs().max()) < 0.05
    sc = gpu.self_check()
    assert sc["ok"], sc


def test_cuda_update_equals_fresh_load():
    from safetensors.torch import load_file

    a, b = tiny_checkpoint("qwen3_moe", RECIPE), tiny_checkpoint("qwen3_moe", RECIPE, seed=1)
    live = ReferenceEngine(a, device="cuda")
    ptrs = live.storage_pointers()
    new = {}
    for f in sorted(b.glob("*.safetensors")):
        new.update(load_file(f))
    live.begin_weight_update()
    live.update_weights((k, v.cuda()) for k, v in new.items())
    live.finish_weight_update()
    fresh = ReferenceEngine(b, device="cuda")
    assert live.storage_pointers() == ptrs
    assert live.weight_digests() == fresh.weight_digests()
    sp = SamplingParams(max_new_tokens=8, seed=4)
    x, y = live.generate(PROMPTS, sp), fresh.generate(PROMPTS, sp)
    assert [g.output_ids for g in x] == [g.output_ids for g in y]
    assert all(torch.equal(g.logprobs, h.logprobs) for g, h in zip(x, y, strict=True))
