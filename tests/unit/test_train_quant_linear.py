"""QuantLinear / QuantExperts: forward grid, gradients per backward mode, weight cache, saved memory.

The references are written independently with plain autograd on the codecs' own quantize/dequantize:
straight-through terms pick which operands each backward GEMM sees (CPU, fp32 GEMMs on bf16-exact values).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miles_lp import formats
from miles_lp.errors import ConfigError
from miles_lp.formats.spec import BackwardMode, Format
from miles_lp.train.memory import SavedTensors
from miles_lp.train.quant_linear import (
    LinearRecipe,
    QuantExperts,
    QuantLinear,
    invalidate_grids,
    invalidate_on_step,
    learner_weights,
    quantized_linear,
)

HP, DEQ, QNT = BackwardMode.HIGH_PRECISION, BackwardMode.DEQUANTIZED, BackwardMode.QUANTIZED


def deq(q):
    return q.dequantize(torch.float32)


def q_x(x, fmt, scope="token"):
    if fmt is Format.MXFP8:
        return formats.quantize_mxfp8(x, axis=-1)
    return formats.quantize_nvfp4(x, scale_scope="row" if scope == "token" else "tensor")


def q_w(w, fmt):
    if fmt is Format.MXFP8:
        return formats.quantize_mxfp8(w, axis=-1)
    return formats.quantize_nvfp4(w, scale_scope="tensor")


class GradQ(torch.autograd.Function):
    """Identity forward; backward replaces the gradient by deq(quantize_mxfp8(g, axis))."""

    @staticmethod
    def forward(ctx, t, axis):
        ctx.axis = axis
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return deq_padded(g, ctx.axis), None


def deq_padded(t, axis):
    """deq(quantize_mxfp8(t, axis)); columnwise: tokens zero-padded to a multiple of 32, then cut back."""
    if axis == -1:
        return deq(formats.quantize_mxfp8(t, axis=-1))
    m = t.shape[0]
    return deq(formats.quantize_mxfp8(F.pad(t, (0, 0, 0, (-m) % 32)), axis=-2))[:m]


def reference(x, w, fmt, mode, scope="token"):
    """Forward value deq(q(x)) @ deq(q(w)).T; gradients as ``mode`` prescribes, by plain autograd."""
    xq, wq = deq(q_x(x.detach(), fmt, scope)), deq(q_w(w.detach(), fmt))
    value = xq @ wq.T
    if mode is HP:
        exact = x @ w.T
        return exact + (value - exact).detach()
    if mode is DEQ:
        x_st = x + (xq - x).detach()
        w_st = w + (wq - w).detach()
        return x_st @ w_st.T
    w_col = deq(formats.quantize_mxfp8(w.detach(), axis=-2))
    x_col = deq_padded(x.detach(), -2)
    out1 = GradQ.apply(x @ w_col.T, -1)  # dx = deq(q_row(dy)) @ deq(q_col(w))
    out2 = GradQ.apply(x_col @ w.T, -2)  # dw = deq(q_col(dy)).T @ deq(q_col(x))
    return value.detach() + (out1 - out1.detach()) + (out2 - out2.detach())


def _data(m=64, k=96, n=128, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(dtype)
    return x, w, dy


CASES = [(Format.MXFP8, HP), (Format.MXFP8, DEQ), (Format.MXFP8, QNT), (Format.NVFP4, HP), (Format.NVFP4, DEQ)]


@pytest.mark.parametrize("fmt,mode", CASES, ids=lambda v: str(v))
def test_dense_forward_and_grads_match_reference(fmt, mode):
    x, w, dy = _data()
    recipe = LinearRecipe(fmt, mode, "token" if fmt is Format.NVFP4 else None)
    y = quantized_linear(x, w, recipe)
    y.backward(dy)
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    y_ref = reference(x, w, fmt, mode)
    y_ref.backward(dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", [Format.MXFP8, Format.NVFP4])
def test_forward_equals_dequantize_then_matmul_bf16_input(fmt):
    x, w, _ = _data(dtype=torch.bfloat16)
    y = quantized_linear(x, w, LinearRecipe(fmt, DEQ, "token" if fmt is Format.NVFP4 else None))
    # bf16 activations: bf16 operands with fp32 accumulation, on CPU as on CUDA (gemm.gemm_operand_dtype)
    ref = q_x(x.detach(), fmt).dequantize(torch.bfloat16) @ q_w(w.detach(), fmt).dequantize(torch.bfloat16).T
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref, rtol=0, atol=0)


def test_nvfp4_per_tensor_activation_scope():
    x, w, _ = _data()
    y = quantized_linear(x, w, LinearRecipe(Format.NVFP4, HP, "tensor"))
    ref = deq(q_x(x.detach(), Format.NVFP4, "tensor")) @ deq(q_w(w.detach(), Format.NVFP4)).T
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)


def test_nvfp4_quantized_backward_is_refused():
    with pytest.raises(ConfigError, match=r"experts\.0\.gate_proj.*NVFP4.*high_precision"):
        LinearRecipe(Format.NVFP4, QNT, "token", name="model.layers.0.mlp.experts.0.gate_proj.weight")


def test_untrainable_format_is_refused():
    with pytest.raises(ConfigError, match="fp8_tensor cannot be trained"):
        LinearRecipe(Format.FP8_TENSOR, DEQ)


def test_quantized_mode_pads_tokens_to_block():
    """M = 40 tokens: the wgrad operands are zero-padded to 64, equal to padding the batch with zeros."""
    x, w, dy = _data(m=40)
    recipe = LinearRecipe(Format.MXFP8, QNT)
    quantized_linear(x, w, recipe).backward(dy)
    xp = F.pad(x.detach(), (0, 0, 0, 24)).requires_grad_()
    wp = w.detach().clone().requires_grad_()
    quantized_linear(xp, wp, recipe).backward(F.pad(dy, (0, 0, 0, 24)))
    torch.testing.assert_close(w.grad, wp.grad, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, xp.grad[:40], rtol=0, atol=0)


def test_bias_gradient():
    x, w, dy = _data()
    b = torch.randn(w.shape[0], requires_grad=True)
    y = quantized_linear(x, w, LinearRecipe(Format.MXFP8, DEQ), bias=b)
    y.backward(dy)
    torch.testing.assert_close(b.grad, dy.sum(0))


# ---- weight cache and learner_weights ------------------------------------------------------------------


def test_weight_quantized_once_per_step_and_exported_bytes_equal_codec():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96, bias=False)
    ql = QuantLinear.from_linear(lin, LinearRecipe(Format.MXFP8, DEQ), canonical="model.layers.0.mlp.up_proj.weight")
    opt = torch.optim.SGD(ql.parameters(), lr=0.1)
    x = torch.randn(32, 64)
    for _ in range(3):  # three micro-batches, one step
        ql(x).sum().backward()
    assert ql.grid.quantize_calls == 1
    (name, q), = list(learner_weights(ql))
    assert name == "model.layers.0.mlp.up_proj.weight"
    assert ql.grid.quantize_calls == 1  # export read the forward's cache
    opt.step()
    (_, q2), = list(learner_weights(ql))
    assert ql.grid.quantize_calls == 2
    ref = formats.quantize_mxfp8(lin.weight.detach(), axis=-1)
    assert torch.equal(q2.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(q2.scale, ref.scale)
    assert not torch.equal(q.data.view(torch.uint8), q2.data.view(torch.uint8))
    ql(x)  # the forward after the step uses the exported grid, no re-quantization
    assert ql.grid.quantize_calls == 2


@pytest.mark.parametrize("update", ["fused_adamw", "data_copy"])
def test_export_after_a_step_that_does_not_bump_the_version_gets_new_bytes(update):
    """AdamW(fused=True) and writes through ``p.data`` leave ``_version`` unchanged: the step hook / an
    explicit ``invalidate_grids`` must still make the next export quantize the new master (C2)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96, bias=False)
    ql = QuantLinear.from_linear(lin, LinearRecipe(Format.MXFP8, DEQ), canonical="w")
    x = torch.randn(32, 64)
    ql(x).sum().backward()
    (_, q1), = list(learner_weights(ql))
    (_, q1b), = list(learner_weights(ql))
    assert ql.grid.quantize_calls == 1 and q1b is q1  # two exports without a step: quantized once
    version = lin.weight._version
    if update == "fused_adamw":
        opt = torch.optim.AdamW(ql.parameters(), lr=0.05, fused=True)
        invalidate_on_step(ql, opt)
        opt.step()
    else:
        lin.weight.data.copy_(torch.randn(96, 64))  # e.g. Megatron copying main params into model params
        assert invalidate_grids(ql) == 1
    assert lin.weight._version == version  # the update really is invisible to the version key
    (_, q2), = list(learner_weights(ql))
    (_, q2b), = list(learner_weights(ql))
    assert ql.grid.quantize_calls == 2 and q2b is q2
    ref = formats.quantize_mxfp8(lin.weight.detach(), axis=-1)
    assert torch.equal(q2.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(q2.scale, ref.scale)
    assert not torch.equal(q1.data.view(torch.uint8), q2.data.view(torch.uint8))


def test_invalidate_grids_reaches_experts():
    qe = QuantExperts(_FakeExperts(), LinearRecipe(Format.MXFP8, DEQ), LinearRecipe(Format.MXFP8, DEQ),
                      *_members())
    list(learner_weights(qe))
    assert (qe.gate_up_grid.quantize_calls, qe.down_grid.quantize_calls) == (1, 1)
    with torch.no_grad():
        qe.gate_up_proj.data.mul_(2)  # no version bump
    assert invalidate_grids(qe) == 1
    out = dict(learner_weights(qe))
    assert (qe.gate_up_grid.quantize_calls, qe.down_grid.quantize_calls) == (2, 2)
    ref = formats.quantize_mxfp8(qe.gate_up_proj[0, :32].detach())
    got = out["model.layers.1.mlp.experts.0.gate_proj.weight"]
    assert torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8))


class _FakeExperts(torch.nn.Module):
    """The attributes transformers-5 fused experts carry (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""

    def __init__(self, e=4, h=64, i=32, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gate_up_proj = torch.nn.Parameter(torch.randn(e, 2 * i, h, generator=g) * 0.1)
        self.down_proj = torch.nn.Parameter(torch.randn(e, h, i, generator=g) * 0.1)
        self.act_fn = F.silu

    def forward(self, hidden, top_k_index, top_k_weights):  # the eager transformers-5 loop, plain linears
        out = torch.zeros_like(hidden)
        for e in range(self.gate_up_proj.shape[0]):
            tok, pos = torch.where(top_k_index == e)
            if tok.numel() == 0:
                continue
            gate, up = F.linear(hidden[tok], self.gate_up_proj[e]).chunk(2, -1)
            h = F.linear(self.act_fn(gate) * up, self.down_proj[e]) * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, h)
        return out


def _members(e=4):
    pre = "model.layers.1.mlp.experts"
    gu = tuple(f"{pre}.{k}.{p}.weight" for k in range(e) for p in ("gate_proj", "up_proj"))
    return gu, tuple(f"{pre}.{k}.down_proj.weight" for k in range(e))


def _routing(t=48, e=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(t)])
    w = torch.softmax(torch.randn(t, 2, generator=g), -1)
    return idx, w


@pytest.mark.parametrize("fmt,mode", CASES, ids=lambda v: str(v))
def test_experts_forward_and_grads_match_reference(fmt, mode):
    ref_mod, q_mod_src = _FakeExperts(), _FakeExperts()
    recipe = LinearRecipe(fmt, mode, "token" if fmt is Format.NVFP4 else None)
    qe = QuantExperts(q_mod_src, recipe, recipe, *_members())
    hidden = torch.randn(48, 64, requires_grad=True)
    h_ref = hidden.detach().clone().requires_grad_()
    idx, rw = _routing()
    dy = torch.randn(48, 64)
    qe(hidden, idx, rw).backward(dy)

    # Reference: the same loop, each expert's linear replaced by the per-expert reference
    # (NVFP4: gate and up quantized as a pair, one global scale per expert).
    out = torch.zeros_like(h_ref)
    for e in range(4):
        tok, pos = torch.where(idx == e)
        gu = ref_mod.gate_up_proj[e]
        gate, up = _ref_gate_up(h_ref[tok], gu, fmt, mode).chunk(2, -1)
        h = reference(F.silu(gate) * up, ref_mod.down_proj[e], fmt, mode) * rw[tok, pos, None]
        out.index_add_(0, tok, h)
    out.backward(dy)
    torch.testing.assert_close(hidden.grad, h_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q_mod_src.gate_up_proj.grad, ref_mod.gate_up_proj.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q_mod_src.down_proj.grad, ref_mod.down_proj.grad, rtol=1e-5, atol=1e-5)


def test_expert_views_are_kept_per_step_and_follow_a_replaced_weight():
    """QuantExperts keeps one per-expert view of each fused grid across forwards (no per-call WeightGrid);
    a replaced fused parameter gets new views, and the output is the new weight's (equal to a fresh module)."""
    src = _FakeExperts()
    recipe = LinearRecipe(Format.MXFP8, DEQ)
    qe = QuantExperts(src, recipe, recipe, *_members())
    hidden = torch.randn(48, 64)
    idx, rw = _routing()
    y1 = qe(hidden, idx, rw)
    views = dict(qe.gate_up_grid._expert_views)
    assert sorted(views) == [0, 1, 2, 3]
    assert torch.equal(qe(hidden, idx, rw), y1)
    assert all(qe.gate_up_grid._expert_views[e] is v for e, v in views.items())  # reused
    other = _FakeExperts(seed=7)
    qe.gate_up_proj = other.gate_up_proj  # a new fused parameter object
    qe.invalidate_grids()
    y2 = qe(hidden, idx, rw)
    assert all(qe.gate_up_grid._expert_views[e] is not v for e, v in views.items())
    fresh = QuantExperts(_FakeExperts(), recipe, recipe, *_members())
    fresh.gate_up_proj = other.gate_up_proj
    assert torch.equal(y2, fresh(hidden, idx, rw)) and not torch.equal(y2, y1)


def _ref_gate_up(x, gu, fmt, mode):
    if fmt is Format.MXFP8 or mode is QNT:
        return reference(x, gu, fmt, mode)
    inter = gu.shape[0] // 2
    qg, qu = formats.quantize_nvfp4_pair(gu[:inter].detach(), gu[inter:].detach())
    wq = torch.cat([deq(qg), deq(qu)])
    xq = deq(q_x(x.detach(), fmt))
    if mode is HP:
        exact = x @ gu.T
        return exact + (xq @ wq.T - exact).detach()
    return (x + (xq - x).detach()) @ (gu + (wq - gu).detach()).T


@pytest.mark.parametrize("fmt", [Format.MXFP8, Format.NVFP4])
def test_experts_learner_weights_equal_codec_per_expert(fmt):
    src = _FakeExperts()
    recipe = LinearRecipe(fmt, DEQ, "token" if fmt is Format.NVFP4 else None)
    qe = QuantExperts(src, recipe, recipe, *_members())
    qe(torch.randn(48, 64), *_routing())
    out = dict(learner_weights(qe))
    gu_names, down_names = _members()
    assert list(out) == list(gu_names) + list(down_names)
    assert qe.gate_up_grid.quantize_calls == 1
    inter = 32
    for e in range(4):
        gate, up = src.gate_up_proj[e, :inter].detach(), src.gate_up_proj[e, inter:].detach()
        if fmt is Format.MXFP8:
            refs = [formats.quantize_mxfp8(gate), formats.quantize_mxfp8(up)]
        else:
            refs = list(formats.quantize_nvfp4_pair(gate, up))
        refs.append(q_w(src.down_proj[e].detach(), fmt))
        for name, ref in zip((gu_names[2 * e], gu_names[2 * e + 1], down_names[e]), refs, strict=True):
            got = out[name]
            assert type(got) is type(ref)
            for key, t in ref.components().items():
                g = got.components()[key]
                assert g.shape == t.shape, (name, key)
                assert torch.equal(g.view(torch.uint8) if g.dtype.is_floating_point and g.element_size() == 1
                                   else g, t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1
                                   else t), (name, key)


# ---- saved-for-backward memory ---------------------------------------------------------------------------


def saved_bytes(mode, fmt=Format.MXFP8, m=256, k=512, n=512, master=torch.bfloat16):
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(n, k, dtype=master) * 0.05)
    ql = QuantLinear.from_linear(torch.nn.Linear(k, n, bias=False), LinearRecipe(fmt, mode), "w")
    ql.weight = w
    with SavedTensors() as saved:
        y = ql(x)
    y.sum().backward()  # the saved tensors are usable
    return saved


def test_saved_bytes_per_mode():
    m, k, n = 256, 512, 512
    hp, dq, qn = (saved_bytes(mode, m=m, k=k, n=n) for mode in (HP, DEQ, QNT))
    x_bf16, w_bf16 = m * k * 2, n * k * 2
    assert hp.bytes == x_bf16 + w_bf16  # the original operands
    # dequantized: 1 byte per element + one E8M0 byte per 32, for x and w (rowwise only)
    assert dq.bytes == (m * k + n * k) * (1 + 1 / 32)
    assert qn.bytes == (m * k + n * k) * (1 + 1 / 32)  # columnwise copies instead of rowwise
    assert dq.bytes / hp.bytes == pytest.approx(0.515625)
    nv = saved_bytes(DEQ, Format.NVFP4, m=m, k=k, n=n)
    assert nv.bytes < dq.bytes / 1.8  # 4-bit payload + E4M3 scale per 16 + per-token fp32 scales


# ---------------------------------------------------------------------------------------------------------
# The compiled path (miles_lp.train.fused): the same bytes as the reference, on CPU and on CUDA
# ---------------------------------------------------------------------------------------------------------


def _special_values(m, k, dtype, device, seed=0):
    """Random rows plus zero, NaN, inf, tiny and huge blocks (the cases where codecs usually diverge)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]
    x[0, :32] = 0.0
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3, :32] = 1e-30
    x[4, 7] = -0.0
    x[5, :] = 3e38
    return x.to(dtype).to(device)


def _bytes_equal(a, b):
    for name, t in a.components().items():
        u = b.components()[name]
        assert t.dtype == u.dtype and t.shape == u.shape, name
        assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)
                           if t.dtype == torch.float32 else t, u.view(torch.uint8) if u.element_size() == 1
                           else u.view(torch.int32) if u.dtype == torch.float32 else u), name


def _same_values(a, b):
    """Bit-equal, except that NaN payloads may differ (a NaN element decodes to some NaN either way)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))
    ib = {2: torch.int16, 4: torch.int32}[a.element_size()]
    assert torch.equal(a.masked_fill(nan, 0).view(ib), b.masked_fill(nan, 0).view(ib))


def _check_fused_codecs(device, dtype, m, k, fmts=(Format.MXFP8, Format.NVFP4)):
    from miles_lp.train import fused

    x = _special_values(m, k, dtype, device)
    if Format.MXFP8 in fmts:
        for axis in (-1, -2):
            q, dq = fused.mxfp8_qdq(x, axis, dtype)
            ref = formats.quantize_mxfp8(x, axis=axis)
            _bytes_equal(q, ref)
            _same_values(dq, ref.dequantize(dtype))
            _same_values(fused.mxfp8_dequantize(ref, torch.float32), ref.dequantize(torch.float32))
    if Format.NVFP4 in fmts:
        xf = torch.nan_to_num(x, posinf=0.0)  # NVFP4 activations: finite rows (an inf row has global scale 1)
        for scope in ("row", "tensor"):
            q, dq = fused.nvfp4_qdq(xf, scope, torch.float32)
            ref = formats.quantize_nvfp4(xf, scale_scope=scope)
            _bytes_equal(q, ref)
            _same_values(dq, ref.dequantize(torch.float32))
            _same_values(fused.nvfp4_dequantize(ref, dtype), ref.dequantize(dtype))


def _check_compiled_linear_equals_reference(device, dtype, m, k, n, cases=CASES):
    """Forward, gradients and exported grid of kernel='compiled' equal kernel='reference', bit for bit."""
    from miles_lp.train.quant_linear import WeightGrid

    for fmt, mode in cases:
        recipe = LinearRecipe(fmt, mode, "token" if fmt is Format.NVFP4 else None)
        outs = {}
        for kernel in ("reference", "compiled"):
            x, w, dy = (t.detach().to(device) for t in _data(m, k, n, dtype=dtype))
            x.requires_grad_(), w.requires_grad_()
            grid = WeightGrid(recipe, kernel=kernel)
            for _ in range(2):  # second micro-batch: the step's cached (dequantized) grid
                x.grad = w.grad = None
                y = quantized_linear(x, w, recipe, grid=grid)
                y.backward(dy)
            assert grid.quantize_calls == 1
            outs[kernel] = (y.detach(), x.grad, w.grad, grid.rowwise(w))
        (y0, gx0, gw0, q0), (y1, gx1, gw1, q1) = outs["reference"], outs["compiled"]
        assert torch.equal(y0, y1) and torch.equal(gx0, gx1) and torch.equal(gw0, gw1), (fmt, mode)
        _bytes_equal(q0, q1)


@pytest.mark.slow
def test_compiled_path_equals_reference_cpu():
    _check_fused_codecs("cpu", torch.bfloat16, 64, 128)
    _check_fused_codecs("cpu", torch.float32, 64, 64)
    _check_compiled_linear_equals_reference("cpu", torch.float32, 64, 96, 128)


MX_CASES = [c for c in CASES if c[0] is Format.MXFP8]
NV_CASES = [c for c in CASES if c[0] is Format.NVFP4]


@pytest.mark.gpu
def test_compiled_mxfp8_equals_reference_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check_fused_codecs("cuda", torch.bfloat16, 1024, 2048, fmts=(Format.MXFP8,))
    _check_fused_codecs("cuda", torch.float32, 256, 512, fmts=(Format.MXFP8,))
    _check_compiled_linear_equals_reference("cuda", torch.bfloat16, 512, 1024, 768, MX_CASES)
    _check_compiled_linear_equals_reference("cuda", torch.bfloat16, 96, 256, 128, MX_CASES)  # 2nd shape: dynamic
    _check_compiled_linear_equals_reference("cuda", torch.bfloat16, 100, 256, 128, MX_CASES)  # tokens padded
    ql = QuantLinear.from_linear(torch.nn.Linear(256, 128, bias=False, device="cuda"), LinearRecipe(Format.MXFP8))
    assert ql.grid.use_compiled(ql.weight)  # kernel="auto" picks the compiled path for MXFP8 on CUDA


@pytest.mark.gpu
def test_compiled_nvfp4_equals_reference_cuda():
    """Failed on the H200 (torch 2.11) before Inductor's IEEE division was requested (see fused.py)."""
    from miles_lp.train import fused

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not fused.exact_division_available():
        pytest.skip("this torch's Inductor has no eager_numerics.division_rounding")
    _check_fused_codecs("cuda", torch.bfloat16, 1024, 2048, fmts=(Format.NVFP4,))
    _check_compiled_linear_equals_reference("cuda", torch.bfloat16, 512, 1024, 768, NV_CASES)


def test_kernel_auto_is_reference_on_cpu_and_unknown_kernel_refused():
    from miles_lp.train.quant_linear import WeightGrid

    grid = WeightGrid(LinearRecipe(Format.MXFP8))
    assert not grid.use_compiled(torch.zeros(1))
    assert WeightGrid(LinearRecipe(Format.MXFP8), kernel="compiled").use_compiled(torch.zeros(1))
    with pytest.raises(ConfigError, match="kernel must be one of auto, reference, compiled"):
        WeightGrid(LinearRecipe(Format.MXFP8), kernel="triton")


@pytest.mark.parametrize("case", ["mxfp8", "nvfp4_tensor", "nvfp4_row"])
def test_select_experts_equals_select_expert_field_by_field(case):
    """The one-unbind form used by QuantExperts.learner_weights gives, for every expert, the object
    select_expert(q, e) gives: every field equal, tensors the same views (storage, offset, strides)."""
    import dataclasses

    from miles_lp.train.operands import select_expert, select_experts

    w = torch.randn(3, 32, 64)
    if case == "mxfp8":
        q = formats.quantize_mxfp8(w)
    else:
        q = formats.quantize_nvfp4(w, scale_scope="tensor" if case == "nvfp4_tensor" else "row")
    many = select_experts(q)
    assert len(many) == 3
    for e, got in enumerate(many):
        want = select_expert(q, e)
        assert type(got) is type(want)
        for f in dataclasses.fields(want):
            a, b = getattr(got, f.name), getattr(want, f.name)
            if isinstance(b, torch.Tensor):
                assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride(), f.name
                assert a.data_ptr() == b.data_ptr()
                assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f.name
            else:
                assert a == b, f.name
    if case == "nvfp4_tensor":
        assert many[1].global_scale.shape == () and many[1].amax.shape == ()


@pytest.mark.parametrize("case", ["mxfp8", "nvfp4_tensor", "nvfp4_row"])
def test_select_expert_rows_equals_select_rows_of_select_expert(case):
    """The gate/up split QuantExperts.learner_weights exports equals the per-expert, per-block composition
    ``select_rows(select_expert(q, e), block p)`` field by field: the same views, the same bytes, and a per-matrix
    global scale shared by gate and up of one expert (NVFP4: one global scale per expert matrix)."""
    import dataclasses

    from miles_lp.train.operands import select_expert, select_expert_rows, select_rows

    w = torch.randn(3, 64, 64)
    w[1, 40:] *= 8  # expert 1's up rows dominate its amax: a split that took the block's own would differ
    if case == "mxfp8":
        q = formats.quantize_mxfp8(w)
    else:
        q = formats.quantize_nvfp4(w, scale_scope="tensor" if case == "nvfp4_tensor" else "row")
    got = select_expert_rows(q, 2)
    assert len(got) == 6
    for i, g in enumerate(got):
        e, p = divmod(i, 2)
        want = select_rows(select_expert(q, e), slice(32 * p, 32 * (p + 1)))
        assert type(g) is type(want)
        for f in dataclasses.fields(want):
            a, b = getattr(g, f.name), getattr(want, f.name)
            if isinstance(b, torch.Tensor):
                assert (a.shape, a.dtype, a.stride(), a.data_ptr()) == (b.shape, b.dtype, b.stride(), b.data_ptr()), \
                    f.name
                assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f.name
            else:
                assert a == b, f.name
        assert torch.equal(g.dequantize(torch.float32), want.dequantize(torch.float32))
    if case == "nvfp4_tensor":
        assert got[2].global_scale.data_ptr() == got[3].global_scale.data_ptr()  # gate and up of expert 1
        assert not torch.equal(got[0].global_scale, got[2].global_scale)
    with pytest.raises(ValueError, match="does not split into 3 row blocks"):
        select_expert_rows(q, 3)
