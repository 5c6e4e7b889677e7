"""The fused CPU kernels (``formats.native``) give the reference codecs' bytes, and the tests can tell.

The oracle is the eager torch path of ``quantize_mxfp8`` / ``quantize_nvfp4`` (``native.disabled()``),
whose bytes the other format tests pin to TE's rule. Covered: every (bf16 element, E8M0 scale) pair that
can occur in an MXFP8 block, random bit patterns (NaN, inf, subnormals of both signs), zero, tiny and
huge tensors, fp32 input, stacks, NVFP4 tensor/row scopes, 2D tiles, a given (also zero / NaN) amax, the
gate/up shared amax; both builds (AVX-512 and the portable C); and mutated kernels that must be caught.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from miles_lp.formats import bits, mxfp8, native, nvfp4

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernels are off")


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.int32)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_u8(a), _u8(b))


def _bf16_patterns() -> torch.Tensor:
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def _random_bits(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bfloat16:
        return torch.randint(-2**15, 2**15, shape, generator=g, dtype=torch.int32).to(torch.int16).view(dtype)
    return torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int32).view(torch.float32)


@functools.lru_cache(maxsize=1)
def _every_scale_blocks() -> torch.Tensor:
    """bf16 [N, 32]: for every E8M0 byte e a block can get, the largest bf16 amax giving e (alternating sign,
    in a rotating slot), then every bf16 pattern of magnitude <= that amax (both signs) and every NaN in the
    other 31 slots: every (element, scale) pair an MXFP8 block of bf16 input can hold; plus every pattern
    next to an inf (scale 0xFE)."""
    codes = torch.arange(0x7F80, dtype=torch.int32).to(torch.int16)  # +0 .. largest finite, ascending
    pos, neg = codes.view(torch.bfloat16), (codes | -0x8000).view(torch.bfloat16)
    nan = torch.cat([torch.arange(0x7F81, 0x8000), torch.arange(0xFF81, 0x10000)]).to(torch.int16).view(torch.bfloat16)
    e = bits.e8m0_round_up(pos.to(torch.float32) * bits.fp32_scalar(bits.FP32_INV_448_BITS))
    last = torch.nonzero(e[1:] != e[:-1]).flatten().tolist() + [e.numel() - 1]  # last index of each byte
    blocks = []
    for j, i in enumerate(last):
        vals = torch.cat([pos[: i + 1], neg[: i + 1], nan])
        vals = torch.cat([vals, vals[: -vals.numel() % 31]]).view(-1, 31)
        amax_col = (pos if j % 2 else neg)[i].expand(vals.shape[0], 1)
        blocks.append(torch.cat([amax_col, vals], dim=1).roll(j % 32, dims=1))
    every = _bf16_patterns()
    every = torch.cat([every, every[: -every.numel() % 31]]).view(-1, 31)
    inf = torch.tensor([math.inf], dtype=torch.bfloat16).expand(every.shape[0], 1)
    blocks.append(torch.cat([every, inf], dim=1))
    blocks.append(torch.cat([-inf, every], dim=1))
    return torch.cat(blocks)


_REF: dict[tuple, object] = {}


def _reference_mxfp8(x: torch.Tensor):
    key = (x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype, x._version)
    if key not in _REF:  # the mutants and builds reuse one oracle result per input
        with native.disabled():
            _REF[key] = (x, mxfp8.quantize_mxfp8(x))
    return _REF[key][1]


def _mxfp8_pair(x: torch.Tensor, lib=None):
    ref = _reference_mxfp8(x)
    if lib is None:
        got = mxfp8.quantize_mxfp8(x)
        return ref, (got.data, got.scale)
    return ref, native.mxfp8_rowwise(x.contiguous(), lib=lib)


def _assert_mxfp8(x: torch.Tensor, lib=None) -> None:
    ref, (data, scale) = _mxfp8_pair(x, lib)
    assert _same_bytes(ref.scale, scale), "scale bytes differ"
    diff = (_u8(ref.data) != _u8(data)).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} element bytes differ, first at {diff[0].tolist()}"


# ---------------------------------------------------------------------------------------------------------
# element conversions (the scalar C functions, also used for NVFP4's scale bytes)
# ---------------------------------------------------------------------------------------------------------
def _specials() -> torch.Tensor:
    v = [0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 448.0, -448.0, 464.0, 463.99, 480.0, 2.0**-6,
         2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-127, 2.0**-149, 6.0, 5.0, 2.5, 0.25, 0.75, 1.25, 1.75, 3.5, 1e38]
    t = torch.tensor(v, dtype=torch.float32)
    sig_nan = torch.tensor([0x7F800001, 0xFF800001, 0x7FBFFFFF], dtype=torch.int64).to(torch.int32).view(torch.float32)
    return torch.cat([t, -t, sig_nan])


def test_e4m3_and_e2m1_casts_equal_bits_module():
    y = torch.cat([_random_bits((1 << 21,), torch.float32, 1), _specials(), _bf16_patterns().to(torch.float32)])
    assert torch.equal(native.e4m3_cast(y), bits.e4m3_satfinite(y).view(torch.uint8))
    assert torch.equal(native.e2m1_cast(y), bits.e2m1_codes(y))


# ---------------------------------------------------------------------------------------------------------
# MXFP8
# ---------------------------------------------------------------------------------------------------------
def test_mxfp8_every_element_at_every_scale():
    x = _every_scale_blocks()
    assert x.shape[0] > 100_000  # millions of (element, scale) pairs, not a handful
    _assert_mxfp8(x)
    _assert_mxfp8(x.to(torch.float32))  # the fp32 kernel on the same values


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(64, 32), (257, 96), (3, 8, 64), (2048, 512)])
def test_mxfp8_random_bits_and_normal_data(dtype, shape):
    _assert_mxfp8(_random_bits(shape, dtype, seed=shape[-1]))
    g = torch.Generator().manual_seed(7)
    for scale in (0.02, 1e-30, 1e30, 0.0):
        _assert_mxfp8((torch.randn(shape, generator=g) * scale).to(dtype))


def test_mxfp8_fp32_subnormal_and_special_blocks():
    sub = torch.randint(1, 0x800000, (512, 64), dtype=torch.int32)  # fp32 subnormals, both signs
    sub[::2] |= -0x80000000
    x = sub.view(torch.float32).clone()
    x[3, 5] = math.nan
    x[7, 40] = math.inf
    x[9, :32] = math.nan  # an all-NaN block: scale 0, elements 0x7F
    _assert_mxfp8(x)
    _assert_mxfp8(x.to(torch.bfloat16))


def test_mxfp8_dispatch_is_native_and_fp16_is_not(monkeypatch):
    calls = []
    real = native.mxfp8_rowwise
    monkeypatch.setattr(native, "mxfp8_rowwise", lambda *a, **k: calls.append(1) or real(*a, **k))
    mxfp8.quantize_mxfp8(torch.randn(64, 64).to(torch.bfloat16))
    mxfp8.quantize_mxfp8(torch.randn(64, 64).to(torch.float16))  # fp16: the eager path
    mxfp8.quantize_mxfp8(torch.randn(64, 64), axis=-2)  # columnwise: the eager path
    assert calls == [1]


# ---------------------------------------------------------------------------------------------------------
# NVFP4
# ---------------------------------------------------------------------------------------------------------
def _nvfp4_pair(x: torch.Tensor, **kw):
    with native.disabled():
        ref = nvfp4.quantize_nvfp4(x, **kw)
    return ref, nvfp4.quantize_nvfp4(x, **kw)


def _assert_nvfp4(x: torch.Tensor, **kw) -> None:
    ref, got = _nvfp4_pair(x, **kw)
    for part in ("data", "scale", "global_scale", "amax"):
        a, b = getattr(ref, part), getattr(got, part)
        assert _same_bytes(a, b), f"{part} differs ({kw})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kw", [{}, {"scale_scope": "row"}, {"block_2d": True}])
def test_nvfp4_random_bits_and_data(dtype, kw):
    _assert_nvfp4(_random_bits((128, 256), dtype, seed=3), **kw)
    g = torch.Generator().manual_seed(11)
    for scale in (0.02, 1e-30, 1e-40, 1e30, 0.0):
        _assert_nvfp4((torch.randn(4, 64, 128, generator=g) * scale).to(dtype), **kw)
    x = (torch.randn(96, 4096, generator=g) * 0.02).to(dtype)  # several eager slices
    x[5, 17], x[40, 1000] = math.nan, -math.inf
    _assert_nvfp4(x, **kw)


def test_nvfp4_given_amax_zero_nan_and_pair():
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 48, 64, generator=g) * 0.1).to(torch.bfloat16)
    for amax in (0.0, math.nan, 1e-3, 3.0, torch.tensor([[[0.5]], [[2.0]]])):
        _assert_nvfp4(x, amax=amax)
        _assert_nvfp4(x, amax=amax, block_2d=True)
    gate, up = x[0].clone(), x[1].clone() * 3
    with native.disabled():
        ref = nvfp4.quantize_nvfp4_pair(gate, up)
    got = nvfp4.quantize_nvfp4_pair(gate, up)
    for r, q in zip(ref, got, strict=True):
        assert _same_bytes(r.data, q.data) and _same_bytes(r.scale, q.scale)
        assert _same_bytes(r.global_scale, q.global_scale)


def test_global_amax_kernel_ignores_nan():
    x = _random_bits((33, 80), torch.bfloat16, seed=9)
    with native.disabled():
        ref = nvfp4.nvfp4_global_amax(x)
    assert _same_bytes(nvfp4.nvfp4_global_amax(x), ref)
    assert _same_bytes(native.row_amax(x), bits.nan_ignoring_abs(x.to(torch.float32)).amax(dim=-1))


# ---------------------------------------------------------------------------------------------------------
# the portable build, mutants, fallback
# ---------------------------------------------------------------------------------------------------------
def test_portable_build_gives_the_same_bytes():
    lib = native.load(extra_flags=("-mno-avx512f",))
    x = _every_scale_blocks()[::7].contiguous()
    _assert_mxfp8(x, lib=lib)
    y = _random_bits((64, 128), torch.float32, seed=4)
    R = y.shape[0]
    s_dec, ss = nvfp4._scales(native.row_amax(y).amax())
    with native.disabled():
        ref = nvfp4.quantize_nvfp4(y)
    data, sf = native.nvfp4_encode(y, s_dec.expand(R), ss.expand(R), lib=lib)
    assert _same_bytes(data, ref.data) and _same_bytes(sf, ref.scale)


@pytest.mark.parametrize("old,new,flags,what", [
    ("((a >> 20) & 1u)", "0u", ("-mno-avx512f",), "portable e4m3: ties rounded down, not to even"),
    ("if (b <= 0x400000) e = 0;", "", ("-mno-avx512f",), "E8M0 subnormal rule dropped"),
    ("mx = a > mx ? a : mx;", "mx = a;", ("-mno-avx512f",), "portable amax: last element, not the max"),
    ("_mm512_set1_epi32(0x7FFFF)", "_mm512_set1_epi32(0x80000)", (), "AVX-512 e4m3: ties rounded up"),
    ("_mm256_cmple_epi16_mask(a, _mm256_set1_epi16(0x7F80))", "_mm256_cmple_epi16_mask(a, _mm256_set1_epi16(0x7FFF))",
     (), "AVX-512 amax: NaN not ignored"),
])
def test_a_mutated_kernel_is_caught(old, new, flags, what):
    assert old in native.SOURCE, f"anchor for mutant '{what}' is gone: update the mutant"
    lib = native.load(native.SOURCE.replace(old, new), extra_flags=flags)
    x = _every_scale_blocks()[::5].contiguous()
    ref, (data, scale) = _mxfp8_pair(x, lib)
    assert not (_same_bytes(ref.data, data) and _same_bytes(ref.scale, scale)), f"mutant '{what}' not caught"


@pytest.mark.parametrize("env,warned", [({"MILES_LP_NATIVE": "0"}, False), ({"CC": "no-such-cc"}, True)])
def test_switch_and_missing_compiler_fall_back_to_eager(env, warned, tmp_path, monkeypatch):
    monkeypatch.setattr(native, "_lib", None)  # a fresh start (monkeypatch restores the loaded library)
    monkeypatch.setattr(native, "_failed", None)
    monkeypatch.setenv("MILES_LP_CACHE_DIR", str(tmp_path))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.warns(RuntimeWarning, match="fused CPU codecs unavailable.*no C compiler") if warned else _no_warning():
        q = mxfp8.quantize_mxfp8(torch.ones(4, 32))
    assert native.library() is None and not native.usable(torch.ones(2))
    assert int(q.scale[0, 0]) == bits.e8m0_closed_form(1.0)  # the eager path answered


class _no_warning:
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


def test_build_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_LP_CACHE_DIR", str(tmp_path))
    cc = native._compiler()
    first = native._build(cc)
    mtime = first.stat().st_mtime_ns
    assert native._build(cc) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left behind
