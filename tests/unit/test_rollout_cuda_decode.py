"""The static-cache decode path (``miles_lp.rollout.cuda_decode``) against the eager path, on CPU.

``MILES_LP_DECODE=static`` runs the module's forward over its static KV cache with device-side sampling and no
graphs: the same tokens as the eager path (transformers' forward with a DynamicCache) under greedy decoding, the
same draws at temperature 1 while no row stops early, the same cut at stop tokens. The CUDA-graph replay of the
same step is checked on the device (``-m gpu``)."""

from __future__ import annotations

import pytest
import torch

from miles_lp.rollout import cuda_decode
from miles_lp.rollout.engine import EngineError, SamplingParams
from miles_lp.rollout.reference import EngineFaults, ReferenceEngine
from miles_lp.rollout.sampling import sample
from miles_lp.rollout.testing import tiny_checkpoint

PROMPTS = [[3, 17, 99, 4, 250, 7, 1, 2], [5, 6], [40, 41, 42, 43], [9]]


def _both(monkeypatch, ck, sp, prompts=PROMPTS, **kw):
    import os

    eng = ReferenceEngine(ck, device="cpu", **kw)
    monkeypatch.setenv("MILES_LP_DECODE", "eager")
    a = eng.generate(prompts, sp)
    monkeypatch.setenv("MILES_LP_DECODE", "static")
    b = eng.generate(prompts, sp)
    st = cuda_decode.stats(eng)
    assert st["active"] and st["fused"] == (os.environ.get("MILES_LP_DECODE_FUSED") == "interpret")
    return a, b


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_equals_eager(monkeypatch, arch):
    a, b = _both(monkeypatch, tiny_checkpoint(arch), SamplingParams(max_new_tokens=12, temperature=0.0))
    assert [g.output_ids for g in a] == [g.output_ids for g in b]
    assert [g.finish_reason for g in a] == [g.finish_reason for g in b]
    for g, h in zip(a, b, strict=True):
        assert float((g.logprobs - h.logprobs).abs().max()) < 1e-4


def test_sampled_equals_eager_and_mxfp8(monkeypatch):
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, seed=3)
    for ck in (tiny_checkpoint("qwen3"), tiny_checkpoint("qwen3", "mxfp8")):
        a, b = _both(monkeypatch, ck, sp)
        assert [g.output_ids for g in a] == [g.output_ids for g in b]
        for g, h in zip(a, b, strict=True):
            assert float((g.logprobs - h.logprobs).abs().max()) < 1e-4


def test_stop_tokens_cut_as_eager(monkeypatch):
    ck = tiny_checkpoint("qwen3")
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    a, _ = _both(monkeypatch, ck, greedy)
    stop = a[0].output_ids[3]  # row 0 stops at its 4th token; the others run on unless they emit it
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[stop])
    a, b = _both(monkeypatch, ck, sp)
    assert a[0].finish_reason == "stop" and len(a[0].output_ids) <= 4
    assert [(g.output_ids, g.finish_reason) for g in a] == [(g.output_ids, g.finish_reason) for g in b]


def test_bucket_padding_and_kv_fp8(monkeypatch):
    # 3 rows pad to a bucket of 4 (row 0 repeated); FP8 KV rounds what the cache stores, as the eager cache does
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    a, b = _both(monkeypatch, tiny_checkpoint("qwen3"), sp, prompts=PROMPTS[:3], kv_cache="fp8_e4m3")
    assert [g.output_ids for g in a] == [g.output_ids for g in b]


def test_uniforms_drawn_up_front_equal_per_step_draws():
    # the eager loop draws torch.rand(B, 1) per step from one CPU generator; this path draws [steps, B] at once
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    per_step = torch.cat([torch.rand(5, 1, generator=g1)[:, 0][None] for _ in range(9)])
    assert torch.equal(per_step, torch.rand(9, 5, generator=g2))


@pytest.mark.parametrize("temperature,top_k,top_p,mode", [(1.0, 0, 1.0, "raw"), (0.7, 5, 0.9, "processed"),
                                                          (0.0, 0, 1.0, "raw")])
def test_sample_with_uniform_equals_sample(temperature, top_k, top_p, mode):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    t, lp = sample(logits, temperature, top_k, top_p, g1, mode)
    u = torch.rand(6, 1, generator=g2) if temperature else torch.zeros(6, 1)
    t2, lp2 = cuda_decode.sample_with_uniform(logits, u, temperature, top_k, top_p, mode)
    assert torch.equal(t, t2) and torch.equal(lp, lp2)


def test_finish_rows():
    rows = cuda_decode.finish_rows([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]], [[.1, .2, .3, .4], [.5, .6, .7, .8], [0, 0]],
                                   [4, 2, 2], {3})
    assert rows == [([1, 2, 3], [.1, .2, .3], "stop"), ([5, 6], [.5, .6], "length"), ([9, 9], [0, 0], "length")]


def test_buckets():
    assert [cuda_decode.batch_bucket(n) for n in (1, 3, 32, 33, 500, 513)] == [1, 4, 32, 48, 512, 576]
    assert cuda_decode.seq_bucket(1) == cuda_decode.seq_bucket(128) == 128 and cuda_decode.seq_bucket(129) == 256


def test_fp8_gemm_choice(monkeypatch):
    from miles_lp.config import runtime_override
    from miles_lp.formats.kernels.fp8_block_decode import MAX_M

    monkeypatch.delenv("MILES_LP_FP8_DECODE_GEMM", raising=False)
    assert [cuda_decode.fp8_gemm(m) for m in (1, MAX_M, MAX_M + 1)] == ["triton", "triton", "scaled_mm"]
    # the H200's measurement (docs/results/h200-fp8-decode-2026-12-02): the Triton GEMM faster than scaled_mm
    # at M = 8 (36.1 vs 43.1 us over the 0.5B layer's 4 GEMMs), about equal at 1, slower at 32 and 64
    assert [cuda_decode.fp8_gemm(m) for m in (1, 8, 9, 32, 64)] == ["triton"] * 2 + ["scaled_mm"] * 3
    with runtime_override(fp8_decode_gemm="triton"):
        assert cuda_decode.fp8_gemm(4096) == "triton"
    with runtime_override(fp8_decode_gemm="scaled_mm"):
        assert cuda_decode.fp8_gemm(1) == "scaled_mm"
    monkeypatch.setenv("MILES_LP_FP8_DECODE_GEMM", "cublas")
    with pytest.raises(EngineError, match=r"MILES_LP_FP8_DECODE_GEMM\) must be one of auto, triton, scaled_mm, got 'cublas'"):
        cuda_decode.fp8_gemm(1)


def test_refusals(monkeypatch):
    monkeypatch.setenv("MILES_LP_DECODE", "static")
    moe = ReferenceEngine(tiny_checkpoint("qwen3_moe"), device="cpu")
    with pytest.raises(EngineError, match="qwen3_moe"):
        moe.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    faulty = ReferenceEngine(tiny_checkpoint("qwen3"), device="cpu", faults=EngineFaults(drop_updates=("*",)))
    with pytest.raises(EngineError, match="faults"):
        faulty.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    monkeypatch.setenv("MILES_LP_DECODE", "graph")
    plain = ReferenceEngine(tiny_checkpoint("qwen3"), device="cpu")
    with pytest.raises(EngineError, match="CUDA"):
        plain.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    monkeypatch.setenv("MILES_LP_DECODE", "auto")  # auto on CPU: the eager path, silently
    assert len(plain.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].output_ids) == 2
    assert not cuda_decode.stats(plain)["active"]
    monkeypatch.setenv("MILES_LP_DECODE", "bogus")
    with pytest.raises(EngineError, match="MILES_LP_DECODE"):
        plain.generate([[1, 2]], SamplingParams(max_new_tokens=2))


def test_update_between_generations_is_served(monkeypatch):
    # a weight update between two generations: the static path serves the new weights (same as eager after it)
    from safetensors.torch import load_file

    a, b = tiny_checkpoint("qwen3"), tiny_checkpoint("qwen3", seed=1)
    eng = ReferenceEngine(a, device="cpu")
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    monkeypatch.setenv("MILES_LP_DECODE", "static")
    eng.generate(PROMPTS, sp)
    new = {}
    for f in sorted(b.glob("*.safetensors")):
        new.update(load_file(f))
    eng.begin_weight_update()
    eng.update_weights(new.items())
    eng.finish_weight_update()
    got = eng.generate(PROMPTS, sp)
    monkeypatch.setenv("MILES_LP_DECODE", "eager")
    want = ReferenceEngine(b, device="cpu").generate(PROMPTS, sp)
    assert [g.output_ids for g in got] == [g.output_ids for g in want]


def _in_interpreter(call: str) -> None:
    """Run ``call`` (a function of this file) in a fresh process with Triton's interpreter on from the start
    (Triton's own library functions, ``tl.sum``, are interpreted only if Triton is imported that way)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve()
    env = {**os.environ, "TRITON_INTERPRET": "1", "MILES_LP_DECODE_FUSED": "interpret", "PYTHONWARNINGS": "ignore"}
    code = f"import sys; sys.path.insert(0, {str(here.parent)!r}); import {here.stem} as t; t.{call}"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900,
                       cwd=here.parents[2])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fused_kernels_greedy_equals_eager(arch):
    # the fused elementwise kernels (rollout._decode_triton) in Triton's interpreter on fp32: the same tokens
    _in_interpreter(f"check_fused_greedy({arch!r})")


@pytest.mark.slow
@pytest.mark.parametrize("fused", ["0", "interpret"])
def test_fp8_decode_gemm_greedy_equals_eager(fused):
    # the fp8_block group path through the Triton decode GEMM (interpreter), fused kernels off / on
    _in_interpreter(f"check_fp8_decode_gemm_greedy({fused!r})")


@pytest.mark.slow
def test_fused_kernels_match_torch_ops():
    _in_interpreter("check_fused_kernels()")


class _Env:
    """monkeypatch's setenv for the interpreter subprocess."""

    def setenv(self, k, v):
        import os

        os.environ[k] = v


def check_fused_greedy(arch: str) -> None:
    monkeypatch = _Env()
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    a, b = _both(monkeypatch, tiny_checkpoint(arch), sp)
    assert [g.output_ids for g in a] == [g.output_ids for g in b]
    for g, h in zip(a, b, strict=True):
        assert float((g.logprobs - h.logprobs).abs().max()) < 1e-4


def check_fp8_decode_gemm_greedy(fused: str) -> None:
    # the fp8_native group path with the Triton decode GEMM, in the interpreter on the tiny fp8_block Qwen3 (fp32
    # activations, partial 128-blocks): _op_kind is widened to CPU (it takes fp8_native on sm_90 only); the eager
    # path quantizes the same activations with the codec and runs the emulated GEMM: the same greedy tokens
    from miles_lp.config import runtime_override
    from miles_lp.formats.kernels import fp8_block_decode as fd
    from miles_lp.formats.spec import Format

    real_kind = cuda_decode._op_kind
    cuda_decode._op_kind = lambda layer, x: ("fp8_native" if layer.kernel_format is Format.FP8_BLOCK
                                             else real_kind(layer, x))
    calls = []
    real_mm = fd.decode_mm
    fd.decode_mm = lambda *a, **k: calls.append(a[0].shape[0]) or real_mm(*a, **k)
    _Env().setenv("MILES_LP_DECODE_FUSED", fused)
    sp = SamplingParams(max_new_tokens=4, temperature=0.0)
    with runtime_override(fp8_decode_gemm="triton"):
        a, b = _both(_Env(), tiny_checkpoint("qwen3", "fp8_block"), sp, prompts=PROMPTS[:2])
    assert calls and max(calls) == 2 * 8 and min(calls) == 2, calls  # prefill [B*W] and one token per row
    assert [g.output_ids for g in a] == [g.output_ids for g in b]
    for g, h in zip(a, b, strict=True):
        assert float((g.logprobs - h.logprobs).abs().max()) < 1e-4


def check_fused_kernels() -> None:
    # each kernel against the eager ops it replaces, in the interpreter (fp32)
    g = torch.Generator().manual_seed(0)
    x, d, w = torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g), torch.randn(96, generator=g)
    xo, y = cuda_decode.add_rms(x, d, w, 1e-6)
    s = x + d
    ref = w * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.allclose(xo, s) and torch.allclose(y, ref, atol=1e-5)
    _, y0 = cuda_decode.add_rms(x, None, w, 1e-6)
    assert torch.allclose(y0, w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)), atol=1e-5)
    gate, up = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g)
    assert torch.allclose(cuda_decode.silu_mul(gate, up), torch.nn.functional.silu(gate) * up, atol=1e-6)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, t, h, hd = 2, 3, 4, 16
    src = torch.randn(b * t, h * hd, generator=g)
    nw = torch.randn(hd, generator=g)
    ang = torch.randn(b * t, hd // 2, generator=g)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    dst = torch.full((b, h, 8, hd), float("nan"))
    col = torch.tensor([2])
    cuda_decode.heads(src, t, hd, dst, col, nw, 1e-6, cos, sin)
    xs = src.view(b, t, h, hd)
    xs = nw * (xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-6))
    q, _ = apply_rotary_pos_emb(xs.transpose(1, 2), xs.transpose(1, 2), cos.view(b, t, hd), sin.view(b, t, hd))
    assert torch.allclose(dst[:, :, 2:2 + t], q, atol=1e-5)
    assert dst[:, :, :2].isnan().all() and dst[:, :, 2 + t:].isnan().all()  # only columns col .. col + t - 1


def test_park_modes_mid_generation(monkeypatch):
    # the step boundary: a park that returns "retract" recomputes prompt + tokens so far (same weights: same greedy
    # tokens), "in_place" keeps the cache, "abort" ends every row with the tokens it has
    eng = ReferenceEngine(tiny_checkpoint("qwen3"), device="cpu")
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    monkeypatch.setenv("MILES_LP_DECODE", "static")
    want = eng.generate(PROMPTS, sp)
    real = eng._park

    def parks(script):
        calls = iter(script)

        def park():
            real()
            return next(calls, None)
        return park

    for script in ([None, None, None, "retract"], [None, "in_place", None, "retract", None, "retract"]):
        monkeypatch.setattr(eng, "_park", parks(script))
        got = eng.generate(PROMPTS, sp)
        assert [g.output_ids for g in got] == [g.output_ids for g in want]
        for g, h in zip(got, want, strict=True):
            assert float((g.logprobs - h.logprobs).abs().max()) < 1e-4
    monkeypatch.setattr(eng, "_park", parks([None, None, None, "abort"]))
    got = eng.generate(PROMPTS, sp)
    assert all(g.finish_reason == "abort" and g.output_ids == h.output_ids[:3] for g, h in zip(got, want, strict=True))


def test_engine_and_decoder_are_freed_together(monkeypatch):
    import gc
    import weakref

    monkeypatch.setenv("MILES_LP_DECODE", "static")
    eng = ReferenceEngine(tiny_checkpoint("qwen3"), device="cpu")
    eng.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    ref = weakref.ref(cuda_decode.decoder(eng))
    del eng
    gc.collect()
    assert ref() is None


def test_graph_captures_are_serialized_process_wide(monkeypatch):
    """Two engines sharing a GPU in one process capture in their own threads: the decode slot's capture (its
    warm-up included) and the rotating-graph capture hold one lock, and capture in thread_local mode so other
    threads' CUDA work is not an error of the capture. CPU stand-ins for the CUDA calls record the overlap (the
    real capture is not run here: no GPU)."""
    import contextlib
    import threading
    import time

    from miles_lp.rollout.reference import rotating_graph

    events: list[tuple[str, str]] = []
    modes: list[str] = []

    def name():
        return threading.current_thread().name

    class Stream:
        def __init__(self):
            events.append(("begin", name()))  # the slot's warm-up starts with its side stream

        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def graph(g, pool=None, capture_error_mode="global"):
        modes.append(capture_error_mode)
        if not events or events[-1] != ("begin", name()):
            events.append(("begin", name()))
        time.sleep(0.05)  # a capture takes a while: another thread would enter now if nothing held it off
        yield
        events.append(("end", name()))

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream.__new__(Stream))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    def slot():
        s = object.__new__(cuda_decode._Slot)
        for k in ("tok", "pos", "col", "t", "valid", "tokens", "logprobs"):
            setattr(s, k, torch.zeros(2))
        s.caches, s.pool, s.graph, s.graphs = [], None, None, True
        s._step = lambda: time.sleep(0.01)
        return s

    start = threading.Barrier(3)

    def run(fn):
        start.wait(10)
        fn()

    jobs = [slot()._capture, slot()._capture, lambda: rotating_graph.capture(lambda: torch.zeros(1), None)]
    threads = [threading.Thread(target=run, args=(fn,), name=f"engine{i}") for i, fn in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(events) == 6, events
    for i in range(0, 6, 2):  # begin, end of one thread before the next begins
        assert events[i][0] == "begin" and events[i + 1] == ("end", events[i][1]), events
    assert sorted(n for k, n in events if k == "end") == ["engine0", "engine1", "engine2"]
    assert modes == ["thread_local"] * 3
