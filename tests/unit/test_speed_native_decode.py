"""The fused CPU MXFP8 decode (``formats.native.mxfp8_decode_rowwise``) gives ``MXFP8Tensor.dequantize``'s bits, and
the learner computes the same log-probs and gradients with it as without it.

The oracle is the eager torch decode (``native.decodes`` off): every E4M3 code at every E8M0 scale byte (NaN
codes and the NaN scale 0xFF included) to bf16 and fp32, both builds (AVX-512 and the portable C), random data in
stacked and sliced tensors; mutated kernels must be caught. Then a tiny Llama under MXFP8 (``dequantized``
backward, bf16 compute copies as the SmolLM2 recipe, and fp32): log-probs, every gradient, the step's new weights
and the exported grid are ``torch.equal`` with the decode on and off.
"""

from __future__ import annotations

import pytest
import torch

from miles_lp.formats import native
from miles_lp.formats.mxfp8 import quantize_mxfp8
from miles_lp.formats.tensors import MXFP8Tensor

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernels are off")

DTYPES = (torch.bfloat16, torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _eager(q: MXFP8Tensor, dtype: torch.dtype, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(native, "decodes", lambda data, dtype: False)
        return q.dequantize(dtype)


def _every_code_at_every_scale() -> MXFP8Tensor:
    """[256, 256]: row r holds the 256 E4M3 codes (8 blocks of 32), every block of row r has scale byte r."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    data = codes.repeat(256, 1).view(torch.float8_e4m3fn)
    return MXFP8Tensor(data=data, scale=codes[:, None].expand(256, 8).contiguous(), axis=-1)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_code_at_every_scale_equals_the_eager_decode(dtype, portable, monkeypatch):
    q = _every_code_at_every_scale()
    lib = native.load(extra_flags=("-mno-avx512f",)) if portable else None
    got = native.mxfp8_decode_rowwise(q.data, q.scale, dtype, lib=lib)
    want = _eager(q, dtype, monkeypatch)
    assert got.dtype == dtype and torch.equal(_bits(got), _bits(want))
    assert torch.isnan(want).sum() > 256  # the NaN codes and the NaN scale are in the comparison


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 96), (1, 32), (257, 576)])
def test_dequantize_uses_the_kernel_and_equals_the_eager_decode(dtype, shape, monkeypatch):
    g = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(shape, generator=g) * torch.logspace(-42, 36, shape[-1])).to(torch.bfloat16)
    q = quantize_mxfp8(x)
    calls = []
    real = native.mxfp8_decode_rowwise
    monkeypatch.setattr(native, "mxfp8_decode_rowwise", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = q.dequantize(dtype)
    assert calls == [1]  # the kernel answered
    assert torch.equal(_bits(got), _bits(_eager(q, dtype, monkeypatch)))
    if len(shape) == 3:  # a non-contiguous slice of a stack (an expert's rows)
        sub = MXFP8Tensor(data=q.data[1, 1:4], scale=q.scale[1, 1:4], axis=-1)
        assert torch.equal(_bits(sub.dequantize(dtype)), _bits(_eager(sub, dtype, monkeypatch)))


def test_columnwise_and_fp16_keep_the_eager_decode(monkeypatch):
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(native, "mxfp8_decode_rowwise", lambda *a, **k: pytest.fail("kernel called"))
    col = quantize_mxfp8(x, axis=-2)
    assert col.dequantize(torch.bfloat16).shape == (64, 64)
    assert quantize_mxfp8(x).dequantize(torch.float16).dtype == torch.float16


def test_a_scale_of_another_shape_is_left_to_the_torch_ops(monkeypatch):
    """The kernel reads ``data.numel() / 32`` scale bytes: a scale of another shape never reaches it (the torch ops
    broadcast it, or raise)."""
    monkeypatch.setattr(native, "mxfp8_decode_rowwise", lambda *a, **k: pytest.fail("kernel called"))
    q = quantize_mxfp8(torch.randn(4, 64, dtype=torch.bfloat16))
    assert MXFP8Tensor(data=q.data, scale=q.scale[:, :1], axis=-1).dequantize(torch.bfloat16).shape == (4, 64)
    with pytest.raises(RuntimeError):
        MXFP8Tensor(data=q.data, scale=q.scale[:3], axis=-1).dequantize(torch.bfloat16)


@pytest.mark.parametrize("old,new,flags,what", [
    ("+ ((u >> 16) & 1u)) >> 16", ") >> 16", ("-mno-avx512f",), "portable bf16: ties rounded up, not to even"),
    ("if (em < 8u) return sign | f2u((float)em * 0.001953125f);", "", ("-mno-avx512f",),
     "portable E4M3 subnormals decoded as normals"),
    ("return e == 0u ? 0x00400000u :", "return e == 0u ? 0u :", (), "E8M0 byte 0 decoded as zero, not 2^-127"),
    ("_mm512_set1_epi32(0x7FF00000)), sign);", "_mm512_set1_epi32(0x7FC00000)), sign);", (),
     "AVX-512 E4M3 NaN with another payload"),
    ("_mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(8))", "_mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(1))", (),
     "AVX-512 E4M3 subnormals decoded as normals"),
])
def test_a_mutated_decode_is_caught(old, new, flags, what, monkeypatch):
    assert old in native.SOURCE, f"anchor for mutant '{what}' is gone: update the mutant"
    lib = native.load(native.SOURCE.replace(old, new), extra_flags=flags)
    q = _every_code_at_every_scale()
    caught = [not torch.equal(_bits(native.mxfp8_decode_rowwise(q.data, q.scale, dt, lib=lib)),
                              _bits(_eager(q, dt, monkeypatch))) for dt in DTYPES]
    assert any(caught), f"mutant '{what}' not caught"


# ---------------------------------------------------------------------------------------------------------
# the learner: the same numbers with the kernel as with the eager decode
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from miles_lp.checkpoint.tiny import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"), num_layers=2)


def _run(model_dir, param_dtype, eager: bool, monkeypatch):
    from miles_lp.config import Where
    from miles_lp.policy import parse_policy
    from miles_lp.train.config import TrainConfig
    from miles_lp.train.embedded import EmbeddedTrainer, plan_for_model

    with monkeypatch.context() as m:
        if eager:
            m.setattr(native, "decodes", lambda data, dtype: False)
        else:  # the kernel must answer (else this compares the eager path with itself)
            real = native.mxfp8_decode_rowwise
            m.setattr(native, "mxfp8_decode_rowwise", lambda *a, **k: calls.append(1) or real(*a, **k))
        calls: list[int] = []
        policy = parse_policy({"default": "mxfp8", "backward": "dequantized"}, Where("<test>", "precision"))
        tr = EmbeddedTrainer(model_dir, plan_for_model(policy, model_dir),
                             TrainConfig(device="cpu", lr=1e-2, param_dtype=param_dtype))
        g = torch.Generator().manual_seed(0)
        samples = [{"tokens": torch.randint(0, 256, (n,), generator=g)} for n in (40, 33, 50)]
        lp0, ent0 = tr.logprobs(samples)
        tr.optimizer.zero_grad(set_to_none=True)
        tr.accumulate_grads(samples)
        params = [p for grp in tr.optimizer.param_groups for p in grp["params"]]  # the fp32 masters under bf16
        grads = {i: p.grad.clone() for i, p in enumerate(params) if p.grad is not None}
        tr.train_step(samples)
        lp1, _ = tr.logprobs(samples)
        weights = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        weights.update({i: p.detach().clone() for i, p in enumerate(params)})
        grid = {n: (q.data.view(torch.uint8).clone(), q.scale.clone()) for n, q in tr.learner_weights()}
        assert bool(calls) != eager
    return lp0 + ent0 + lp1, grads, weights, grid


@pytest.mark.parametrize("param_dtype", ["bf16", None])
def test_learner_logprobs_grads_and_step_bit_identical_with_the_kernel(tiny_llama, param_dtype, monkeypatch):
    new = _run(tiny_llama, param_dtype, False, monkeypatch)
    old = _run(tiny_llama, param_dtype, True, monkeypatch)
    for a, b in zip(new[0], old[0], strict=True):
        assert torch.equal(a, b)
    for got, want in zip(new[1:], old[1:], strict=True):
        assert got.keys() == want.keys() and got
        for name in got:
            for a, b in zip(*(v if isinstance(v, tuple) else (v,) for v in (got[name], want[name])), strict=True):
                assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_threads_split_large_tensors_into_the_same_bytes(dtype, monkeypatch):
    """4096 blocks or more run on torch's threads (OpenMP slices of whole blocks): the bytes of one thread and of
    the eager codec, quantize and decode."""
    if not native.library().threaded():
        pytest.skip("the C compiler has no OpenMP: the kernels run on one thread")
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(700, 1536, generator=g) * torch.logspace(-40, 30, 1536)).to(dtype)  # 33,600 blocks
    x[5, :40] = float("nan")
    before = torch.get_num_threads()
    out = {}
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            q = quantize_mxfp8(x)
            out[n] = (q.data.view(torch.uint8), q.scale, _bits(q.dequantize(dtype)))
    finally:
        torch.set_num_threads(before)
    with native.disabled():
        ref = quantize_mxfp8(x)
    want = (ref.data.view(torch.uint8), ref.scale, _bits(_eager(ref, dtype, monkeypatch)))
    for n, got in out.items():
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), f"{n} threads"
