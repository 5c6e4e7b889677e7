"""NVFP4 (CONTRACT 2): golden vectors for every branch, a scalar reference, scopes, pairs, bounds."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_lp.errors import FormatError
from miles_lp.formats import (
    NVFP4Tensor,
    QuantizedTensor,
    bits,
    nvfp4_global_amax,
    quantize_nvfp4,
    quantize_nvfp4_pair,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


# ------------------------------------------------------------------------------------------------
# A scalar reference written from CONTRACT 2 with Python floats and explicit fp32 rounding
# ------------------------------------------------------------------------------------------------
def ref_s_enc(amax_g: float) -> float:
    s = bits.f32_round(2688.0 / amax_g) if amax_g != 0 else math.inf
    s = bits.FP32_MAX if math.isnan(s) else min(s, bits.FP32_MAX)  # fminf
    return 1.0 if amax_g == 0 or s == 0 else s


def ref_block(vals: list[float], s_enc: float, amax_b: float | None = None) -> tuple[int, list[int]]:
    """(scale byte, codes) of one 16-element block."""
    if amax_b is None:
        amax_b = max([abs(v) for v in vals if not math.isnan(v)], default=0.0)
    s_dec = bits.f32_round(1.0 / s_enc)
    sf_in = bits.f32_round(amax_b * bits.f32_round(s_enc * bits.FP32_INV_6))
    sf = bits.e4m3_encode_exact(min(sf_in, bits.FP32_MAX))
    denom = bits.f32_round(bits.e4m3_value(sf) * s_dec)
    enc = bits.FP32_MAX if denom == 0 else min(bits.f32_round(1.0 / denom), bits.FP32_MAX)
    return sf, [bits.e2m1_encode_exact(bits.f32_round(v * enc)) for v in vals]


def ref_quantize(x: torch.Tensor, amax_g: float) -> tuple[list[int], list[int]]:
    """Row-major scale bytes and codes of a 2-D fp32 tensor with one global amax."""
    s_enc = ref_s_enc(amax_g)
    scales, codes = [], []
    for row in x.tolist():
        for j in range(0, len(row), 16):
            sf, c = ref_block(row[j:j + 16], s_enc)
            scales.append(sf)
            codes.extend(c)
    return scales, codes


def _codes(q: NVFP4Tensor) -> list[int]:
    return bits.unpack_fp4(q.data).flatten().tolist()


# ------------------------------------------------------------------------------------------------
# Golden vectors (hand-computed; see the comments)
# ------------------------------------------------------------------------------------------------
TIES = [0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0]
GOLDEN = [
    # name, values (one block of 16), amax=, expected scale byte, expected data bytes, global_scale bits
    # amax 2688 -> S_enc = 1; amax_b = 6 -> sf = e4m3(fp32(6 * fp32(1/6)) = 1.0) = 0x38; enc = 1:
    # ties go to the even code: .25->0 .75->1.0 1.25->1.0 1.75->2 2.5->2 3.5->4 5->4; 6 -> 0x7; -.25 -> -0
    ("ties", TIES, 2688.0, 0x38, [0x00, 0x22, 0x44, 0x66, 0x87, 0xAA, 0xCC, 0xEE], 0x3F800000),
    # amax_b = 6.3: sf = e4m3(1.05) = 1.0 (1.05 is nearer 1 than 1.125), enc = 1 -> 6.3 and 5.2 saturate to 6
    ("saturation", [6.3, 5.2, -6.3, 0.5] + [0.0] * 12, 2688.0, 0x38, [0x77, 0x1F] + [0x00] * 6, 0x3F800000),
    # all zeros, amax 0: S_enc = 1 (the amax == 0 branch), sf = 0, enc = FLT_MAX, 0 * FLT_MAX = 0
    ("amax0", [0.0] * 16, None, 0x00, [0x00] * 8, 0x3F800000),
    # amax_b = 1e-4 with S_enc = 1: sf = e4m3(1.7e-5) = 0 (below half the smallest subnormal 2^-10):
    # enc = min(1/0, FLT_MAX) = FLT_MAX, so every non-zero element saturates to +-6
    ("sf0", [1e-4, -1e-4, 0.0, 5e-5] + [0.0] * 12, 2688.0, 0x00, [0xF7, 0x70] + [0x00] * 6, 0x3F800000),
    # amax_g = 1e-38: 2688 / amax overflows -> S_enc = FLT_MAX (clamp), S_dec = 2^-128 (0x00200000);
    # sf = e4m3(fp32(1e-38) * fp32(FLT_MAX / 6) ~ 0.567) = 0.5625 (0x31); enc = 1/(0.5625 * 2^-128)
    # overflows -> FLT_MAX; 1e-38 * FLT_MAX ~ 3.4 -> 3 (code 5), 5e-39 * FLT_MAX ~ 1.70 -> 1.5 (code 3)
    ("s_enc_clamp", [1e-38, -1e-38, 5e-39, 0.0] * 4, 1e-38, 0x31, [0xD5, 0x03] * 4, 0x00200000),
    # amax_g = inf (a caller-provided amax): 2688 / inf = 0 -> S_enc = 1 (the S_enc == 0 branch)
    ("s_enc0", TIES, math.inf, 0x38, [0x00, 0x22, 0x44, 0x66, 0x87, 0xAA, 0xCC, 0xEE], 0x3F800000),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", GOLDEN, ids=[c[0] for c in GOLDEN])
def test_golden_vectors(case, device):
    _, vals, amax, scale_byte, data_bytes, gs_bits = case
    x = torch.tensor([vals], dtype=torch.float32, device=device)
    q = quantize_nvfp4(x, amax=amax)
    assert q.scale.view(torch.uint8).tolist() == [[scale_byte]]
    assert q.data.tolist() == [data_bytes]
    assert bits.f32_bits(q.global_scale.item()) == gs_bits
    assert ref_quantize(x.cpu(), amax if amax is not None else 0.0) == ([scale_byte], _codes(q))


def test_nan_and_inf_elements():
    # NaN is ignored by both amaxes and encodes to +6 (cvt.rn.satfinite.e2m1 -> MAX_NORM); inf makes the
    # block amax inf: sf = e4m3(inf -> FLT_MAX) = 448, inf -> 6 and the finite elements go to ~0
    x = torch.tensor([[1.0, math.nan, -2.0] + [0.5] * 13 + [math.inf, 3.0, -math.inf] + [0.0] * 13])
    q = quantize_nvfp4(x, amax=6.0)
    codes = _codes(q)
    assert codes[1] == 0x7
    assert q.scale.view(torch.uint8)[0, 1].item() == 0x7E and codes[16] == 0x7 and codes[18] == 0xF
    clean = x.clone()
    clean[0, 1] = 0.0
    assert quantize_nvfp4(clean, amax=6.0).scale.view(torch.uint8)[0, 0] == q.scale.view(torch.uint8)[0, 0]
    # a NaN inside the tensor does not change the global amax
    assert quantize_nvfp4(x[:, :16]).amax.item() == 2.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_scalar_reference_on_random_data(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=g) * torch.logspace(-3, 3, 8).unsqueeze(1)
    x[0, :16] *= 1e-6  # a block whose scale is subnormal or zero relative to the global amax
    x = x.to(dtype)
    q = quantize_nvfp4(x)
    scales, codes = ref_quantize(x.float(), x.float().abs().max().item())
    assert q.scale.view(torch.uint8).flatten().tolist() == scales
    assert _codes(q) == codes


def test_scopes_and_shapes():
    x = torch.randn(3, 32, 64, dtype=torch.bfloat16)
    t = quantize_nvfp4(x)
    r = quantize_nvfp4(x, scale_scope="row")
    assert isinstance(t, QuantizedTensor)
    assert t.data.shape == (3, 32, 32) and t.scale.shape == (3, 32, 4) and t.scale.dtype == torch.float8_e4m3fn
    assert t.global_scale.shape == (3, 1, 1) and r.global_scale.shape == (3, 32, 1)
    assert quantize_nvfp4(x[0]).global_scale.shape == ()
    assert set(t.components()) == {"data", "scale", "global_scale"}
    assert t.shape == x.shape
    # per expert: each matrix of the stack equals quantizing it alone
    for e in range(3):
        alone = quantize_nvfp4(x[e])
        assert torch.equal(alone.data, t.data[e]) and torch.equal(alone.global_scale, t.global_scale[e, 0, 0])
    # the decode scale is S_dec = fp32(1 / fp32(2688 / amax)), close to but not always equal to amax / 2688
    a = x[0].float().abs().max().item()
    assert quantize_nvfp4(x[0]).global_scale.item() == bits.f32_round(1.0 / bits.f32_round(2688.0 / a))


def test_row_scope_is_batch_invariant():
    g = torch.Generator().manual_seed(2)
    row = torch.randn(1, 128, generator=g, dtype=torch.float32).bfloat16()
    alone = quantize_nvfp4(row, scale_scope="row")
    for n in (1, 7, 33):
        batch = (torch.randn(n, 128, generator=g) * 10 ** torch.randint(-3, 4, (n, 1), generator=g)).bfloat16()
        pos = int(torch.randint(0, n + 1, (1,), generator=g))
        b = torch.cat([batch[:pos], row, batch[pos:]])
        q = quantize_nvfp4(b, scale_scope="row")
        assert torch.equal(q.data[pos], alone.data[0])
        assert torch.equal(q.scale[pos].view(torch.uint8), alone.scale[0].view(torch.uint8))
        assert torch.equal(q.global_scale[pos], alone.global_scale[0])


def test_gate_up_pair_shares_one_global_scale_and_equals_the_fused_tensor():
    gate = torch.randn(4, 32, 64, dtype=torch.bfloat16)
    up = torch.randn(4, 32, 64, dtype=torch.bfloat16) * 3
    up[1] /= 100  # expert 1: gate dominates
    qg, qu = quantize_nvfp4_pair(gate, up)
    assert torch.equal(qg.global_scale, qu.global_scale)
    fused = quantize_nvfp4(torch.cat([gate, up], dim=-2))
    assert torch.equal(torch.cat([qg.data, qu.data], dim=-2), fused.data)
    assert torch.equal(torch.cat([qg.scale, qu.scale], dim=-2).view(torch.uint8), fused.scale.view(torch.uint8))
    assert torch.equal(qg.global_scale, fused.global_scale)
    amax = nvfp4_global_amax(gate, up)
    assert amax.shape == (4, 1, 1)
    assert torch.equal(amax.flatten(), torch.maximum(gate.abs().amax((1, 2)), up.abs().amax((1, 2))).float())
    assert nvfp4_global_amax(gate[0], up[0]).shape == ()
    with pytest.raises(FormatError, match="scale_scope='row' has no shared scale"):
        quantize_nvfp4_pair(gate, up, scale_scope="row")


def test_amax_argument_broadcasts_and_shares_the_scale():
    x = torch.randn(2, 16, 32)
    q = quantize_nvfp4(x, amax=10.0)
    assert q.global_scale.shape == (2, 1, 1) and torch.all(q.global_scale == q.global_scale[0])
    with pytest.raises(FormatError, match=r"amax of shape \(3,\) does not broadcast to \(2, 1, 1\)"):
        quantize_nvfp4(x, amax=torch.ones(3))
    with pytest.raises(FormatError, match="negative"):
        quantize_nvfp4(x, amax=-1.0)


def test_block_2d_uses_the_16x16_tile_amax():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 64, generator=g)
    x[5, 20] = 40.0  # the tile (rows 0-15, cols 16-31) gets this amax on all its 16 rows
    q = quantize_nvfp4(x, block_2d=True)
    s = q.scale.view(torch.uint8)
    assert (s[:16, 1] == s[0, 1]).all() and (s[16:, 1] == s[16, 1]).all()
    s_enc = ref_s_enc(40.0)
    for r in (0, 5, 15):
        sf, codes = ref_block(x[r, 16:32].tolist(), s_enc, amax_b=40.0)
        assert s[r, 1].item() == sf and bits.unpack_fp4(q.data)[r, 16:32].tolist() == codes
    with pytest.raises(FormatError, match=r"shape \(24, 64\).*rows.*24 elements.*16"):
        quantize_nvfp4(torch.randn(24, 64), block_2d=True)
    with pytest.raises(FormatError, match="block_2d=True cannot be combined with scale_scope='row'"):
        quantize_nvfp4(x, block_2d=True, scale_scope="row")


_f32 = st.floats(allow_nan=False, allow_infinity=False, width=32, min_value=-(2.0**100), max_value=2.0**100)


@settings(max_examples=150, deadline=None)
@given(st.lists(_f32, min_size=64, max_size=64), st.sampled_from(["tensor", "row"]))
def test_scaled_error_is_at_most_half_an_e2m1_step_plus_saturation(vals, scope):
    x = torch.tensor(vals, dtype=torch.float32).reshape(2, 32)
    q = quantize_nvfp4(x, scale_scope=scope)
    sf = q.scale.float().repeat_interleave(16, -1)
    s_dec = q.global_scale
    enc = torch.fmin(1.0 / (sf * s_dec), torch.tensor(bits.FP32_MAX))  # CONTRACT 2: min(1 / (sf * S_dec), FLT_MAX)
    v = (x * enc).double()  # the value the E2M1 rounding saw
    code_val = bits.e2m1_table().double()[bits.unpack_fp4(q.data).long()]
    a = v.abs().clamp(max=6)
    half_step = torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))
    sat = (v.abs() - 6).clamp(min=0)
    assert ((v - code_val).abs() <= half_step + sat + 1e-6 * v.abs()).all()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, width=32), min_size=16, max_size=16).filter(lambda v: max(map(abs, v)) > 1e-3))
def test_one_block_decode_error_is_bounded_by_its_amax(vals):
    x = torch.tensor([vals], dtype=torch.float32)  # one block: the block amax is the global amax
    q = quantize_nvfp4(x)
    err = (x - q.dequantize(torch.float32)).abs()
    # half the top E2M1 step (1 of 6) plus the E4M3 scale rounding (2^-4 relative) of amax
    assert (err <= x.abs().max() * (1 / 6 * (1 + 2**-4) + 2**-4) + 1e-30).all()


def test_dequantize():
    x = torch.randn(2, 16, 32)
    q = quantize_nvfp4(x)
    deq = q.dequantize(torch.float32)
    vals = bits.e2m1_table()[bits.unpack_fp4(q.data).long()]
    assert torch.equal(deq, vals * q.scale.float().repeat_interleave(16, -1) * q.global_scale)
    assert q.dequantize().dtype == torch.bfloat16


def test_agreement_with_torchao_nvfp4_is_where_contract_2_says():
    """CONTRACT 2: torchao orders the operations differently and clamps the scale at 2^-6, so its bytes are not
    ours everywhere; but an external implementation pins the rule where the two agree. Measured here (bf16
    input, these seeds): normal data identical; heavy-tailed (Student t, 2 dof) scales identical and 0.25% of
    the data bytes differ; rows spanning 1e-4..1e4 differ in the small rows only (torchao's clamp). A broken
    scale or rounding rule differs in far more (tens of percent)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    g = torch.Generator().manual_seed(0)
    cases = {
        "normal": torch.randn(512, 1024, generator=g),
        # Student t, 2 degrees of freedom: z / sqrt(chi2_2 / 2), chi2_2 / 2 = -log(U) (seeded, unlike .sample())
        "student_t": torch.randn(512, 1024, generator=g) / torch.rand(512, 1024, generator=g).log().neg().sqrt(),
        "wide_rows": torch.randn(512, 1024, generator=g) * torch.logspace(-4, 4, 512).unsqueeze(1),
    }
    rates = {}
    for name, x in cases.items():
        x = x.bfloat16()
        ours = quantize_nvfp4(x)
        s, d = nvfp4_quantize(x, 16, per_tensor_amax_to_scale(ours.amax))
        same_s = s.view(torch.uint8).reshape(ours.scale.shape) == ours.scale.view(torch.uint8)
        same_d = d.view(torch.uint8).reshape(ours.data.shape) == ours.data
        in_agreeing_blocks = same_d[same_s.repeat_interleave(8, dim=-1)]
        rates[name] = (1 - same_s.double().mean().item(), 1 - in_agreeing_blocks.double().mean().item())
        print(f"torchao NVFP4 vs TE rule [{name}]: scale bytes differ {rates[name][0]:.4%}, data bytes differ "
              f"{rates[name][1]:.4%} in blocks whose scales agree")
        if name == "normal":
            assert same_s.all() and same_d.all()
        elif name == "student_t":
            assert rates[name][0] < 0.05 and rates[name][1] < 0.01
        else:  # the clamp at 2^-6 of torchao's scale hits the small rows only
            assert same_s[256:].double().mean() > 0.99 and rates[name][1] < 0.01


@pytest.mark.parametrize(
    "make, kw, match",
    [
        (lambda: torch.randn(4, 40), {}, r"shape \(4, 40\).*K \(axis=-1, 16-blocks\).*40 elements.*keep this tensor BF16"),
        (lambda: torch.randn(64), {}, r"shape \(64,\) has 1 dim.*2-D"),
        (lambda: torch.zeros(4, 32, dtype=torch.int32), {}, r"shape \(4, 32\) has dtype torch.int32"),
        (lambda: torch.zeros(0, 32), {}, r"shape \(0, 32\) is empty"),
        (lambda: torch.zeros(4, 32), {"scale_scope": "token"}, r"scale_scope='token' is not one of"),
    ],
)
def test_refusals(make, kw, match):
    with pytest.raises(FormatError, match=match):
        quantize_nvfp4(make(), **kw)
