"""The CUDA-graph decode (``miles_lp.rollout.cuda_decode``) on the device (``pytest -m gpu``; the H200).

A random Qwen3 of Qwen2.5-0.5B's widths (2 layers; every projection a multiple of 128, so fp8_block takes the
native GEMM): graph replay equals the same static step run without graphs, bit for bit; the generated tokens'
log-probs equal the eager forward's teacher-forced ones (``score``) to bf16 tolerance; a weight update between
generations is served by the captured graphs exactly as a fresh engine serves it."""

from __future__ import annotations

import pytest
import torch

from miles_lp.rollout import cuda_decode
from miles_lp.rollout.engine import SamplingParams
from miles_lp.rollout.reference import ReferenceEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PROMPTS = [[3, 17, 99, 4, 250, 7, 1, 2], [5, 6], [40, 41, 42, 43], [9, 8, 7]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from miles_lp.bench.rollout import _convert, _model

    root = tmp_path_factory.mktemp("decode")
    src = _model("0.5b", "cuda", root, num_layers=2)
    return {"bf16": src, **{p: _convert(src, p, "cuda", root) for p in ("fp8_block", "fp8_block+pow2", "mxfp8")}}


def _gen(monkeypatch, eng, mode, sp):
    monkeypatch.setenv("MILES_LP_DECODE", mode)
    return eng.generate(PROMPTS, sp)


@pytest.mark.parametrize("prec", ["bf16", "fp8_block", "fp8_block+pow2", "mxfp8"])
def test_graph_equals_static_and_scores(monkeypatch, checkpoints, prec):
    eng = ReferenceEngine(checkpoints[prec], device="cuda")
    assert cuda_decode.unsupported_reason(eng) is None
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, seed=2)
    g = _gen(monkeypatch, eng, "graph", sp)
    st = cuda_decode.stats(eng)
    assert st["graphs"] and st["captures"] == 1
    if prec.startswith("fp8_block"):
        dec = cuda_decode.decoder(eng)
        kinds = {grp.kind for layer in dec.fwd.layers for grp in layer.groups()}
        assert kinds == {"fp8_native"}, kinds
    s = _gen(monkeypatch, eng, "static", sp)
    assert [x.output_ids for x in g] == [x.output_ids for x in s]
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(g, s, strict=True))
    again = _gen(monkeypatch, eng, "graph", sp)  # replays the captured graph from a fresh prefill
    assert [x.output_ids for x in again] == [x.output_ids for x in g]
    assert cuda_decode.stats(eng)["captures"] == 1
    seqs = [p + x.output_ids for p, x in zip(PROMPTS, g, strict=True)]
    monkeypatch.setenv("MILES_LP_DECODE", "eager")
    # bf16 activations and other kernels (fused elementwise ops, one GEMM over concatenated weights); a quantized
    # input moves a whole E4M3 step where the two paths' bf16 inputs round apart, so quantized formats get more
    # room (MXFP8 measured 0.127 max on the H200); fp8_block: also the native GEMM against the fp32 emulated one
    worst, mean = (0.1, 0.05) if prec == "bf16" else (0.2, 0.06)
    for x, sc, p in zip(g, eng.score(seqs), PROMPTS, strict=True):
        d = (x.logprobs - sc[len(p) - 1:]).abs()
        assert float(d.max()) < worst and float(d.mean()) < mean


def test_update_served_by_captured_graph(monkeypatch, checkpoints, tmp_path):
    from safetensors.torch import load_file

    from miles_lp.bench.rollout import _convert, _model

    src = _model("0.5b", "cuda", tmp_path, num_layers=2)  # the same random model again, then perturbed
    new = {}
    ck = _convert(src, "fp8_block", "cuda", tmp_path)
    for f in sorted(ck.glob("*.safetensors")):
        new.update(load_file(f))
    g = torch.Generator().manual_seed(9)
    for k, v in new.items():  # other block scales and other norms: a different model on the same grid
        if k.endswith("weight_scale_inv") or k.endswith("norm.weight"):
            new[k] = v * (1 + 0.5 * torch.rand(v.shape, generator=g)).to(v.dtype)
    live = ReferenceEngine(checkpoints["fp8_block"], device="cuda")
    sp = SamplingParams(max_new_tokens=16, temperature=0.0)
    _gen(monkeypatch, live, "graph", sp)
    live.begin_weight_update()
    live.update_weights((k, v.cuda()) for k, v in new.items())
    live.finish_weight_update()
    got = _gen(monkeypatch, live, "graph", sp)
    assert cuda_decode.stats(live)["captures"] == 1  # no re-capture: the graph reads the updated storage
    from safetensors.torch import save_file

    for f in sorted(ck.glob("*.safetensors")):
        names = load_file(f).keys()
        save_file({k: new[k].contiguous() for k in names}, f)
    fresh = ReferenceEngine(ck, device="cuda")
    want = _gen(monkeypatch, fresh, "graph", sp)
    assert [x.output_ids for x in got] == [x.output_ids for x in want]
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(got, want, strict=True))


def test_fp8_decode_gemm_choices(monkeypatch, checkpoints):
    """``runtime.fp8_decode_gemm``: the Triton decode GEMM (``auto`` at these token counts) and cuBLAS's
    block-scaled GEMM each get their own graph, and each scores like the eager forward."""
    from miles_lp.formats.kernels import fp8_block_decode as fd

    calls = []
    real = fd.decode_mm
    monkeypatch.setattr(fd, "decode_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    eng = ReferenceEngine(checkpoints["fp8_block"], device="cuda")
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3)
    out, used = {}, {}
    for gemm in ("auto", "scaled_mm"):
        monkeypatch.setenv("MILES_LP_FP8_DECODE_GEMM", gemm)
        calls.clear()
        out[gemm] = _gen(monkeypatch, eng, "graph", sp)
        used[gemm] = len(calls)
    assert used["auto"] > 0 and used["scaled_mm"] == 0, used
    assert cuda_decode.stats(eng)["captures"] == 2  # one graph per GEMM choice
    monkeypatch.setenv("MILES_LP_DECODE", "eager")
    for g in out.values():
        seqs = [p + x.output_ids for p, x in zip(PROMPTS, g, strict=True)]
        for x, sc, p in zip(g, eng.score(seqs), PROMPTS, strict=True):
            d = (x.logprobs - sc[len(p) - 1:]).abs()
            assert float(d.max()) < 0.2 and float(d.mean()) < 0.06
