"""Quantized linear layers for the learner: the forward computes on exactly the grid the sampler serves.

Emulated GEMM (CONTRACT 1, "exactness note"): ``y = deq(q(x)) @ deq(q(w)).T``. Each dequantized operand
is exactly representable in bf16, so a bf16 GEMM with fp32 accumulation computes what a native MXFP8 /
NVFP4 GEMM computes, up to accumulation order. On CUDA with bf16 activations the operands are bf16 and
cuBLAS accumulates in fp32; elsewhere (CPU, fp32 activations) the GEMM runs in fp32 on the same
bf16-exact values, which is the same result up to accumulation order.

Forward quantization (from the BF16/FP32 master, never from an earlier quantized copy):

* MXFP8: weight and input rowwise (1x32 blocks along K).
* NVFP4: weight with a per-tensor global scale (per expert for ``[E, N, K]``; gate and up share one:
  the fused ``gate_up_proj`` is one matrix per expert, separate gate/up modules pass a joint amax),
  optional 16x16 2-D weight blocks; activations per token (``scale_scope="row"``, the RL recipe) or
  per tensor, as the plan entry says.

Backward modes (``BackwardMode``; TE's ``NVTE_BACKWARD_OVERRIDE``, CONTRACT 7):

* ``high_precision``: dgrad = dy @ w, wgrad = dy.T @ x on the original operands. Saves x and w.
* ``dequantized``: dgrad = dy @ deq(wq), wgrad = dy.T @ deq(xq) on the forward's rowwise operands.
  Saves only the compact quantized x and w (bytes + scales); nothing columnwise is kept.
* ``quantized`` (MXFP8 only; TE's default MXFP8 recipe): every operand is quantized along the reduction
  dim of its backward GEMM, from full precision. In TE ``module/linear.py`` the dgrad GEMM is
  ``general_gemm(weight, grad_output, layout="NN")`` and wgrad ``general_gemm(inputmat, grad_output,
  layout="NT")``; a non-transposed MXFP8 operand uses its columnwise data (``tensor/mxfp8_tensor.py``,
  rowwise and columnwise usages). Hence: dgrad (reduces over N) = deq(q_row(dy)) @ deq(q_col(w)); wgrad
  (reduces over tokens M) = deq(q_col(dy)).T @ deq(q_col(x)). Columnwise blocks run along tokens, so M is
  zero-padded to a multiple of 32 for the wgrad operands (zero rows change neither a block's amax nor the
  GEMM: this equals padding the batch with zero tokens, as TE's MoE token padding does).

The quantized weight of a module is cached once per optimizer step; ``learner_weights(model)`` yields that
cache, so weight export reads the very bytes the forward used. The cache is keyed on the master's storage
and ``_version``, which in-place updates through autograd-visible tensors bump (``AdamW(foreach=...)``,
``p.add_`` under ``no_grad``). Some updates do not bump it: ``AdamW(fused=True)`` and writes through
``p.data`` (Megatron's optimizers copy main params into model params that way). So an optimizer step must
also call ``invalidate_grids(model)``; ``invalidate_on_step(model, optimizer)`` registers that as a
``torch.optim`` step post-hook (the embedded trainer does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from miles_lp.errors import ConfigError, FormatError
from miles_lp.formats.spec import MXFP8_BLOCK, NVFP4_BLOCK, BackwardMode, Format
from miles_lp.train import fused

# ---------------------------------------------------------------------------------------------------------
# Recipe of one linear (what the plan entry of its weight says)
# ---------------------------------------------------------------------------------------------------------

TRAINABLE_FORMATS = (Format.MXFP8, Format.NVFP4)


@dataclasses.dataclass(frozen=True)
class LinearRecipe:
    """How one quantized linear computes: its format, backward mode and activation scale scope."""

    format: Format
    backward: BackwardMode = BackwardMode.DEQUANTIZED
    activation_scale: str | None = None  # NVFP4: "token" (per-row global scale) | "tensor"
    block_2d: bool = False  # NVFP4 weights: 16x16 scale tiles
    name: str = "<linear>"  # for error messages

    def __post_init__(self):
        fmt = Format(self.format)
        object.__setattr__(self, "format", fmt)
        object.__setattr__(self, "backward", BackwardMode(self.backward))
        if fmt not in TRAINABLE_FORMATS:
            raise ConfigError(
                f"{self.name}: format {fmt.value} cannot be trained by miles-lp's QuantLinear "
                f"(trainable: {', '.join(f.value for f in TRAINABLE_FORMATS)}); keep the tensor bf16 in the "
                "policy or convert it to one of those")
        if fmt is Format.NVFP4 and self.backward is BackwardMode.QUANTIZED:
            raise ConfigError(
                f"{self.name}: NVFP4 with backward 'quantized' (FP4 backward GEMMs, which need stochastic "
                "rounding and Hadamard transforms) is not part of the RL recipe; use backward "
                "'high_precision' or 'dequantized' for NVFP4 tensors (seed 002)")
        if fmt is Format.NVFP4 and self.activation_scale not in (None, "token", "tensor"):
            raise ConfigError(f"{self.name}: activation_scale must be 'token' or 'tensor', "
                              f"got {self.activation_scale!r}")

    @classmethod
    def from_entry(cls, entry: Any, name: str | None = None) -> LinearRecipe | None:
        """The recipe of a ``PlanEntry`` (``None`` for a BF16 entry: the layer stays high precision)."""
        fmt = Format(entry.format)
        if not fmt.quantized:
            return None
        backward = getattr(entry, "backward", None) or BackwardMode.DEQUANTIZED
        scope = getattr(entry, "activation_scale", None)
        scope = {"per_token": "token", "per_tensor": "tensor"}.get(scope, scope)
        if fmt is Format.NVFP4 and scope is None:
            scope = "token"
        return cls(fmt, BackwardMode(backward), scope if fmt is Format.NVFP4 else None,
                   bool(getattr(entry, "block_2d", False)), name or getattr(entry, "name", "<linear>"))

    @property
    def nvfp4_row_scope(self) -> str:
        return "row" if self.activation_scale in (None, "token") else "tensor"


# ---------------------------------------------------------------------------------------------------------
# Operand quantizers: thin calls into miles_lp.formats (the codecs own every bit of the rule)
# ---------------------------------------------------------------------------------------------------------


def quantize_weight(w: torch.Tensor, recipe: LinearRecipe, *, amax: torch.Tensor | None = None):
    """The forward (rowwise) grid of a weight ``[..., N, K]`` from its master values."""
    from miles_lp import formats

    w = w.detach()
    if recipe.format is Format.MXFP8:
        return formats.quantize_mxfp8(w, axis=-1)
    return formats.quantize_nvfp4(w, scale_scope="tensor", amax=amax, block_2d=recipe.block_2d)


def quantize_activation(x: torch.Tensor, recipe: LinearRecipe):
    """The forward grid of the input ``[M, K]`` (per token under NVFP4 with ``activation_scale: token``)."""
    from miles_lp import formats

    if recipe.format is Format.MXFP8:
        return formats.quantize_mxfp8(x, axis=-1)
    return formats.quantize_nvfp4(x, scale_scope=recipe.nvfp4_row_scope)


def quantize_columnwise(t: torch.Tensor, recipe: LinearRecipe):
    """A backward operand with 32x1 blocks along dim -2 (``quantized`` mode; MXFP8 only)."""
    from miles_lp import formats

    assert recipe.format is Format.MXFP8  # LinearRecipe refuses NVFP4 + quantized
    return formats.quantize_mxfp8(t, axis=-2)


def quantize_rowwise(t: torch.Tensor, recipe: LinearRecipe):
    from miles_lp import formats

    assert recipe.format is Format.MXFP8
    return formats.quantize_mxfp8(t, axis=-1)


def weight_amax(w: torch.Tensor) -> torch.Tensor:
    """Per-matrix amax ``[..., 1, 1]`` (fp32) of a weight ``[..., N, K]``, NaN ignored."""
    a = torch.nan_to_num(w.detach().abs().float(), nan=0.0)
    return a.amax(dim=(-2, -1), keepdim=True)


# ---------------------------------------------------------------------------------------------------------
# Quantized tensors through save_for_backward (so that saved_tensors_hooks see every byte kept)
# ---------------------------------------------------------------------------------------------------------


class _Packed:
    """The static part of a quantized-tensor dataclass; its tensor fields travel via save_for_backward."""

    __slots__ = ("cls", "static", "names")

    def __init__(self, q: Any):
        self.cls = type(q)
        self.static: dict[str, Any] = {}
        self.names: list[str] = []
        for f in dataclasses.fields(q):
            if not f.init:
                continue
            v = getattr(q, f.name)
            if isinstance(v, torch.Tensor):
                self.names.append(f.name)
            else:
                self.static[f.name] = v

    def tensors(self, q: Any) -> list[torch.Tensor]:
        return [getattr(q, n) for n in self.names]

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        return self.cls(**self.static, **dict(zip(self.names, tensors, strict=True)))


def _replace_tensors(q: Any, fn: Callable[[str, torch.Tensor], torch.Tensor], **static: Any) -> Any:
    """A copy of quantized tensor ``q`` with every tensor field mapped through ``fn(name, t)``."""
    kw = {}
    for f in dataclasses.fields(q):
        if not f.init:
            continue
        v = getattr(q, f.name)
        kw[f.name] = fn(f.name, v) if isinstance(v, torch.Tensor) else static.get(f.name, v)
    return type(q)(**kw)


def _shape_field(q: Any) -> str | None:
    names = {f.name for f in dataclasses.fields(q)}
    return next((n for n in ("logical_shape", "shape") if n in names), None)


def select_expert(q: Any, e: int) -> Any:
    """Expert ``e`` of a quantized ``[E, N, K]`` tensor, as the quantized ``[N, K]`` tensor it equals.

    A per-matrix global scale (and amax) ``[E, 1, 1]`` becomes the 0-d one of a 2-D quantization.
    """
    per_matrix = getattr(q, "scale_scope", "tensor") == "tensor"

    def pick(name: str, t: torch.Tensor) -> torch.Tensor:
        t = t[e]
        if per_matrix and name in ("global_scale", "amax") and t.shape == (1, 1):
            t = t.reshape(())
        return t

    static = {}
    field = _shape_field(q)
    if field is not None:
        static[field] = type(getattr(q, field))(tuple(q.shape)[1:])
    return _replace_tensors(q, pick, **static)


def select_rows(q: Any, rows: slice | torch.Tensor) -> Any:
    """Rows of a rowwise-quantized ``[N, K]`` tensor (data, scales and a per-row global scale follow).

    Rowwise blocks lie inside a row, so the rows of the quantized whole are the quantization of the rows,
    except for a per-tensor global scale, which stays the whole tensor's (gate/up share it by design).
    """
    n = q.shape[-2]

    def pick(name: str, t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 2 and t.shape[-2] == n:
            return t[..., rows, :] if isinstance(rows, slice) else t.index_select(-2, rows.to(t.device))
        return t

    static = {}
    field = _shape_field(q)
    if field is not None:
        count = len(range(n)[rows]) if isinstance(rows, slice) else int(rows.numel())
        static[field] = type(getattr(q, field))((*tuple(q.shape)[:-2], count, q.shape[-1]))
    return _replace_tensors(q, pick, **static)


# ---------------------------------------------------------------------------------------------------------
# The emulated GEMMs
# ---------------------------------------------------------------------------------------------------------


def _operand_dtype(x: torch.Tensor) -> torch.dtype:
    """bf16 operands (fp32 accumulation in cuBLAS) on CUDA for bf16 activations, fp32 otherwise."""
    return torch.bfloat16 if (x.is_cuda and x.dtype == torch.bfloat16) else torch.float32


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-t.shape[-2]) % multiple
    return F.pad(t, (0, 0, 0, pad)) if pad else t


class _QuantLinearFn(torch.autograd.Function):
    """y = deq(q(x)) @ deq(wq).T (+ b); backward per ``recipe.backward``. x is ``[M, K]``.

    Two implementations of every quantize/dequantize, with the same bytes: the reference (the codecs,
    eager) and the compiled one (``miles_lp.train.fused``: one fused pass per operand), chosen by
    ``grid.use_compiled(x)`` (``kernel="auto"``: compiled on CUDA, reference elsewhere).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grid: WeightGrid):
        recipe = grid.recipe
        op = _operand_dtype(x)
        compiled = grid.use_compiled(x)
        w_deq_cached = None
        if compiled:
            _check_operand(x, recipe, -1, "input")
            wq, w_deq = grid.rowwise_dequantized(weight, op)
            w_deq_cached = w_deq if grid.cache_dequantized else None
            xq, x_deq = fused_activation(x, recipe, op)
        else:
            wq = grid.rowwise(weight)
            xq = quantize_activation(x, recipe)
            x_deq, w_deq = xq.dequantize(op), wq.dequantize(op)
        y = F.linear(x_deq, w_deq)
        del x_deq, w_deq
        if bias is not None:
            y = y + bias.to(y.dtype)
        y = y.to(x.dtype)

        ctx.recipe, ctx.op, ctx.x_dtype, ctx.w_dtype = recipe, op, x.dtype, weight.dtype
        ctx.has_bias, ctx.compiled = bias is not None, compiled
        ctx.w_deq = None
        mode = recipe.backward
        if mode is BackwardMode.HIGH_PRECISION:
            ctx.save_for_backward(x, weight)
        elif mode is BackwardMode.DEQUANTIZED:
            ctx.xp, ctx.wp = _Packed(xq), _Packed(wq)
            ctx.save_for_backward(*ctx.xp.tensors(xq), *ctx.wp.tensors(wq))
            # The step's dequantized weight (held by the grid for the whole step, not per micro-batch): dgrad
            # reuses it instead of decoding wq again.
            ctx.w_deq = w_deq_cached
        else:  # QUANTIZED: columnwise copies from full precision (x along tokens, w along N)
            wc = grid.columnwise(weight)
            xc = _quantize_columnwise_checked(_pad_rows(x, MXFP8_BLOCK), recipe, "input", compiled=compiled)
            ctx.xp, ctx.wp = _Packed(xc), _Packed(wc)
            ctx.save_for_backward(*ctx.xp.tensors(xc), *ctx.wp.tensors(wc))
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        recipe, op, mode, compiled = ctx.recipe, ctx.op, ctx.recipe.backward, ctx.compiled
        saved = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias
        dequantize = fused_dequantize if compiled else _reference_dequantize
        dx = dw = db = None
        if mode is BackwardMode.HIGH_PRECISION:
            x, weight = saved
            g = dy.to(op)
            if need_x:
                dx = g @ weight.to(op)
            if need_w:
                dw = g.t() @ x.to(op)
        elif mode is BackwardMode.DEQUANTIZED:
            nx = len(ctx.xp.names)
            xq, wq = ctx.xp.rebuild(saved[:nx]), ctx.wp.rebuild(saved[nx:])
            g = dy.to(op)
            if need_x:
                w_deq = ctx.w_deq if ctx.w_deq is not None else dequantize(wq, op)
                dx = g @ w_deq
            if need_w:
                dw = g.t() @ dequantize(xq, op)
        else:
            nx = len(ctx.xp.names)
            xc, wc = ctx.xp.rebuild(saved[:nx]), ctx.wp.rebuild(saved[nx:])
            if need_x:  # blocks along N (dgrad reduces over N)
                if compiled:
                    _check_operand(dy, recipe, -1, "grad_output")
                    g_row = fused.mxfp8_qdq(dy, -1, op)[1]
                else:
                    g_row = quantize_rowwise(dy, recipe).dequantize(op)
                dx = g_row @ dequantize(wc, op)
            if need_w:
                dy_p = _pad_rows(dy, MXFP8_BLOCK)
                if compiled:
                    _check_operand(dy_p, recipe, -2, "grad_output")
                    g_col = fused.mxfp8_qdq(dy_p, -2, op)[1]
                else:
                    g_col = _quantize_columnwise_checked(dy_p, recipe, "grad_output").dequantize(op)
                dw = g_col.t() @ dequantize(xc, op)  # padded zero rows add nothing
        if need_b:
            db = dy.float().sum(0)
        if dx is not None:
            dx = dx.to(ctx.x_dtype)
        if dw is not None:
            dw = dw.to(ctx.w_dtype)
        ctx.w_deq = None
        return dx, dw, db, None


def _reference_dequantize(q: Any, dtype: torch.dtype) -> torch.Tensor:
    return q.dequantize(dtype)


def fused_dequantize(q: Any, dtype: torch.dtype) -> torch.Tensor:
    """``q.dequantize(dtype)`` through the compiled decode (same bytes)."""
    if q.format is Format.MXFP8:
        return fused.mxfp8_dequantize(q, dtype)
    return fused.nvfp4_dequantize(q, dtype)


def fused_activation(x: torch.Tensor, recipe: LinearRecipe, dtype: torch.dtype):
    """``(quantize_activation(x, recipe), its dequantization)`` in one compiled pass."""
    if recipe.format is Format.MXFP8:
        return fused.mxfp8_qdq(x, -1, dtype)
    return fused.nvfp4_qdq(x, recipe.nvfp4_row_scope, dtype)


def _check_operand(t: torch.Tensor, recipe: LinearRecipe, axis: int, what: str) -> None:
    """The codecs' refusals, before a compiled kernel sees the tensor (same rule, named after the layer)."""
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16) or t.numel() == 0:
        raise FormatError(f"{recipe.name}: {what} of shape {tuple(t.shape)} and dtype {t.dtype} cannot be "
                          "quantized (float32/bfloat16/float16, non-empty)")
    block = MXFP8_BLOCK if recipe.format is Format.MXFP8 else NVFP4_BLOCK
    if t.shape[axis] % block:
        raise FormatError(f"{recipe.name}: {what} of shape {tuple(t.shape)}: dim {axis} has {t.shape[axis]} "
                          f"elements, not a multiple of the {recipe.format.value} block of {block}; keep this "
                          "layer BF16 with a policy rule")


def _quantize_columnwise_checked(t: torch.Tensor, recipe: LinearRecipe, what: str, *, compiled: bool = False):
    from miles_lp import formats

    try:
        if compiled:
            return formats.quantize_mxfp8(t.detach(), axis=-2, compile=True)
        return quantize_columnwise(t, recipe)
    except FormatError as exc:
        raise FormatError(f"{recipe.name}: columnwise {what} of shape {tuple(t.shape)}: {exc}") from exc


# ---------------------------------------------------------------------------------------------------------
# The per-step weight grid (cache) of one weight
# ---------------------------------------------------------------------------------------------------------


def _version_key(ts: Sequence[torch.Tensor]) -> tuple:
    return tuple((t.data_ptr(), t._version, t.dtype, t.device, tuple(t.shape)) for t in ts)


KERNELS = ("auto", "reference", "compiled")


class WeightGrid:
    """The quantized views of one master weight, computed once per optimizer step.

    ``rowwise(w)`` is the forward grid (and what ``learner_weights`` exports); ``columnwise(w)`` the
    ``quantized``-mode dgrad operand. ``amax_partners`` are weights that share this weight's NVFP4 global
    scale (a separate gate for an up projection and vice versa); ``amax_fn(w)``, when set, gives the NVFP4
    global amax instead (e.g. all-reduced over a tensor-parallel group).

    ``kernel``: ``"reference"`` (the codecs, eager), ``"compiled"`` (``miles_lp.train.fused``: fused
    quantize->dequantize under ``torch.compile``, the same bytes) or ``"auto"`` (compiled for CUDA tensors,
    NVFP4 only where Inductor compiles exact division; reference otherwise). On the compiled path, ``rowwise_dequantized(w, dtype)`` also keeps the
    dequantized forward operand for the step when ``cache_dequantized`` (one ``dtype`` copy of the weight,
    e.g. 2 bytes per element in bf16; later micro-batches and dgrad reuse it). Set it False to trade that
    memory for one decode per forward and per backward.
    """

    def __init__(self, recipe: LinearRecipe, *, kernel: str = "auto", cache_dequantized: bool = True):
        if kernel not in KERNELS:
            raise ConfigError(f"{recipe.name}: kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        self.recipe = recipe
        self.kernel = kernel
        self.cache_dequantized = cache_dequantized
        self.amax_partners: list[torch.Tensor] = []
        self.amax_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._row: Any = None
        self._row_key: tuple | None = None
        self._deq: torch.Tensor | None = None  # dequantized rowwise grid (compiled path), same key as _row
        self._col: Any = None
        self._col_key: tuple | None = None
        self.quantize_calls = 0  # observable in tests: once per step

    def use_compiled(self, t: torch.Tensor) -> bool:
        """``compiled``: always; ``auto``: on CUDA, MXFP8 always and NVFP4 when this torch's Inductor can
        compile exact fp32 division (NVFP4's scale math divides; both byte-equal to the reference on the
        H200, 2026-11-29, ``pytest -m gpu``); ``reference``: never."""
        if self.kernel == "auto":
            if not t.is_cuda:
                return False
            if self.recipe.format is Format.NVFP4:
                from miles_lp.formats._compile import exact_division_available

                return exact_division_available()
            return self.recipe.format is Format.MXFP8
        return self.kernel == "compiled"

    def _key(self, weight: torch.Tensor) -> tuple:
        return _version_key([weight, *self.amax_partners])

    def _amax(self, weight: torch.Tensor) -> torch.Tensor | None:
        if self.recipe.format is not Format.NVFP4:
            return None
        if self.amax_fn is not None:
            return self.amax_fn(weight)
        if not self.amax_partners:
            return None
        amax = weight_amax(weight)
        for p in self.amax_partners:
            amax = torch.maximum(amax, weight_amax(p).to(amax.device))
        return amax.reshape(()) if weight.dim() == 2 else amax

    def _fresh(self, key: tuple) -> bool:
        if self._row is not None and key == self._row_key:
            return True
        self._row, self._deq, self._row_key = None, None, None
        return False

    def rowwise(self, weight: torch.Tensor):
        key = self._key(weight)
        if not self._fresh(key):
            with torch.no_grad():
                if self.use_compiled(weight) and self.recipe.format is Format.MXFP8:
                    from miles_lp import formats

                    self._row = formats.quantize_mxfp8(weight.detach(), axis=-1, compile=True)
                else:
                    self._row = quantize_weight(weight, self.recipe, amax=self._amax(weight))
            self._row_key = key
            self.quantize_calls += 1
        return self._row

    def rowwise_dequantized(self, weight: torch.Tensor, dtype: torch.dtype) -> tuple[Any, torch.Tensor]:
        """(rowwise grid, its dequantization in ``dtype``) through the compiled kernels; cached per step."""
        key = self._key(weight)
        if self._fresh(key):
            if self._deq is not None and self._deq.dtype == dtype:
                return self._row, self._deq
            with torch.no_grad():
                deq = fused_dequantize(self._row, dtype)
        else:
            _check_operand(weight, self.recipe, -1, "weight")
            with torch.no_grad():
                w = weight.detach()
                if self.recipe.format is Format.MXFP8:
                    q, deq = fused.mxfp8_qdq(w, -1, dtype)
                else:
                    q, deq = fused.nvfp4_qdq(w, "tensor", dtype, amax=self._amax(weight),
                                             block_2d=self.recipe.block_2d)
            self._row, self._row_key = q, key
            self.quantize_calls += 1
        self._deq = deq if self.cache_dequantized else None
        return self._row, deq

    def columnwise(self, weight: torch.Tensor):
        key = self._key(weight)
        if self._col is None or key != self._col_key:
            with torch.no_grad():
                self._col = _quantize_columnwise_checked(weight.detach(), self.recipe, "weight",
                                                         compiled=self.use_compiled(weight))
            self._col_key = key
        return self._col

    def invalidate(self) -> None:
        self._row = self._col = self._deq = None
        self._row_key = self._col_key = None


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, entry: Any, bias: torch.Tensor | None = None,
                     *, grid: WeightGrid | None = None) -> torch.Tensor:
    """Functional QuantLinear: ``x [..., K]`` times ``weight [N, K]`` on the grid of plan ``entry``.

    ``entry`` is a ``PlanEntry`` or a ``LinearRecipe``; a BF16 entry runs ``F.linear``.
    """
    recipe = entry if isinstance(entry, LinearRecipe) else LinearRecipe.from_entry(entry)
    if recipe is None:
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    if grid is None:
        grid = WeightGrid(recipe)
    k = x.shape[-1]
    y = _QuantLinearFn.apply(x.reshape(-1, k), weight, bias, grid)
    return y.reshape(*x.shape[:-1], y.shape[-1])


# ---------------------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------------------


class QuantLinear(torch.nn.Module):
    """A drop-in ``nn.Linear`` whose GEMM runs on the plan's grid. Keeps ``weight`` / ``bias`` names.

    ``canonical`` is the canonical HF name of the weight (what ``learner_weights`` yields).
    """

    is_quantized_module = True  # learner_weights(model) collects modules that set this
    ran_quantized = False  # set by forward: the C1 record (executed_quantized), not read from the plan

    def __init__(self, in_features: int, out_features: int, recipe: LinearRecipe, *, bias: bool = False,
                 canonical: str | None = None, kernel: str = "auto", device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        self.recipe = recipe
        self.canonical = canonical or recipe.name
        self.grid = WeightGrid(recipe, kernel=kernel)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, recipe: LinearRecipe, canonical: str | None = None,
                    *, kernel: str = "auto") -> QuantLinear:
        """Wrap an existing ``nn.Linear``, sharing (not copying) its parameters.

        ``kernel``: ``auto`` | ``reference`` | ``compiled`` (see ``WeightGrid``).
        """
        q = cls.__new__(cls)
        torch.nn.Module.__init__(q)
        q.in_features, q.out_features = linear.in_features, linear.out_features
        q.weight = linear.weight
        q.bias = linear.bias
        q.recipe = recipe
        q.canonical = canonical or recipe.name
        q.grid = WeightGrid(recipe, kernel=kernel)
        return q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ran_quantized = True
        return quantized_linear(x, self.weight, self.recipe, self.bias, grid=self.grid)

    def executed_quantized(self) -> dict[str, str]:
        """``{canonical: format}`` once a forward ran this GEMM quantized (empty before)."""
        return {self.canonical: self.recipe.format.value} if self.ran_quantized else {}

    def invalidate_grids(self) -> None:
        self.grid.invalidate()

    def learner_weights(self) -> Iterator[tuple[str, Any]]:
        yield self.canonical, self.grid.rowwise(self.weight)

    def extra_repr(self) -> str:
        r = self.recipe
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={r.format.value}, backward={r.backward.value}"
                + (f", activation_scale={r.activation_scale}" if r.activation_scale else ""))


class QuantExperts(torch.nn.Module):
    """Drop-in for transformers-5 fused experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``).

    Same parameter names and forward signature ``(hidden_states, top_k_index, top_k_weights)`` as the
    eager implementation of Qwen3-MoE / Qwen2-MoE / Mixtral / DeepSeek-V3 in transformers 5. Each
    projection is quantized for all experts at once (NVFP4: one global scale per expert matrix, so gate
    and up of an expert share it); every expert's GEMM is a ``quantized_linear`` on its slice of the grid.
    ``gate_up_members`` / ``down_members`` are the canonical names (``(e0.gate, e0.up, e1.gate, ...)`` and
    ``(e0.down, e1.down, ...)``, as ``ModelLayout.describe(...).members`` lists them).
    """

    is_quantized_module = True

    def __init__(self, experts: torch.nn.Module, gate_up: LinearRecipe | None, down: LinearRecipe | None,
                 gate_up_members: Sequence[str], down_members: Sequence[str]):
        super().__init__()
        self.num_experts = experts.gate_up_proj.shape[0]
        self.gate_up_proj = experts.gate_up_proj
        self.down_proj = experts.down_proj
        self.act_fn = experts.act_fn
        self.gate_up_recipe, self.down_recipe = gate_up, down
        self.gate_up_grid = WeightGrid(gate_up) if gate_up else None
        self.down_grid = WeightGrid(down) if down else None
        if len(gate_up_members) != 2 * self.num_experts or len(down_members) != self.num_experts:
            raise ConfigError(f"QuantExperts: expected {2 * self.num_experts} gate/up and {self.num_experts} "
                              f"down member names, got {len(gate_up_members)} and {len(down_members)}")
        self.gate_up_members, self.down_members = tuple(gate_up_members), tuple(down_members)
        self.ran_gate_up = self.ran_down = False  # set by forward (executed_quantized)
        if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False) or not getattr(
                experts, "has_gate", True) or not getattr(experts, "is_concatenated", True) or getattr(
                experts, "has_post_expert_norm", False):
            raise ConfigError(f"QuantExperts: unsupported experts module {type(experts).__name__} (transposed, "
                              "biased, gateless, post-expert-normed or interleaved gate/up weights); keep its "
                              "experts bf16 in the policy or use the Megatron backend")
        # The architecture's own gating (transformers-5 ``_apply_gate``: act(gate) * up for every supported
        # MoE), so an architecture that overrides it keeps its semantics.
        self._apply_gate = getattr(experts, "_apply_gate", None)

    def _proj(self, x: torch.Tensor, weight: torch.Tensor, e: int, recipe, grid) -> torch.Tensor:
        if recipe is None:
            return F.linear(x, weight[e].to(x.dtype))
        if grid is self.gate_up_grid:
            self.ran_gate_up = True
        else:
            self.ran_down = True
        return _expert_linear(x, weight, e, grid)

    def executed_quantized(self) -> dict[str, str]:
        """``{canonical: format}`` of the projections a forward ran quantized. All experts of a projection at
        once: one grid quantizes every expert matrix, whichever experts the tokens were routed to."""
        out: dict[str, str] = {}
        for ran, recipe, members in ((self.ran_gate_up, self.gate_up_recipe, self.gate_up_members),
                                     (self.ran_down, self.down_recipe, self.down_members)):
            if ran and recipe is not None:
                out.update(dict.fromkeys(members, recipe.format.value))
        return out

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            if e == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[e])
            state = hidden_states[token_idx]
            gate_up = self._proj(state, self.gate_up_proj, e, self.gate_up_recipe, self.gate_up_grid)
            if self._apply_gate is not None:
                h = self._apply_gate(gate_up)
            else:
                gate, up = gate_up.chunk(2, -1)
                h = self.act_fn(gate) * up
            h = self._proj(h, self.down_proj, e, self.down_recipe, self.down_grid)
            h = h * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, h.to(final.dtype))
        return final

    def invalidate_grids(self) -> None:
        for grid in (self.gate_up_grid, self.down_grid):
            if grid is not None:
                grid.invalidate()

    def learner_weights(self) -> Iterator[tuple[str, Any]]:
        if self.gate_up_grid is not None:
            q = self.gate_up_grid.rowwise(self.gate_up_proj)
            inter = self.gate_up_proj.shape[1] // 2
            for e in range(self.num_experts):
                qe = select_expert(q, e)
                yield self.gate_up_members[2 * e], select_rows(qe, slice(0, inter))
                yield self.gate_up_members[2 * e + 1], select_rows(qe, slice(inter, 2 * inter))
        if self.down_grid is not None:
            q = self.down_grid.rowwise(self.down_proj)
            for e in range(self.num_experts):
                yield self.down_members[e], select_expert(q, e)

    def extra_repr(self) -> str:
        def fmt(r):
            return "bf16" if r is None else f"{r.format.value}/{r.backward.value}"
        return (f"num_experts={self.num_experts}, gate_up={fmt(self.gate_up_recipe)}, "
                f"down={fmt(self.down_recipe)}")


class _ExpertView(WeightGrid):
    """Serves expert ``e``'s slice of the fused grid of ``parent`` (quantized once for all experts)."""

    def __init__(self, parent: WeightGrid, fused_weight: torch.Tensor, e: int):
        super().__init__(parent.recipe, kernel=parent.kernel, cache_dequantized=parent.cache_dequantized)
        self.parent, self.fused_weight, self.e = parent, fused_weight, e

    def rowwise(self, weight_e: torch.Tensor):
        return select_expert(self.parent.rowwise(self.fused_weight), self.e)

    def rowwise_dequantized(self, weight_e: torch.Tensor, dtype: torch.dtype):
        q, deq = self.parent.rowwise_dequantized(self.fused_weight, dtype)
        return select_expert(q, self.e), deq[self.e]

    def columnwise(self, weight_e: torch.Tensor):
        return select_expert(self.parent.columnwise(self.fused_weight), self.e)


def _expert_linear(x: torch.Tensor, fused_weight: torch.Tensor, e: int, grid: WeightGrid) -> torch.Tensor:
    """``x @ fused_weight[e].T`` on the fused grid; the gradient lands in row ``e`` of the fused weight."""
    return _QuantLinearFn.apply(x, fused_weight[e], None, _ExpertView(grid, fused_weight, e))


# ---------------------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------------------


def learner_weights(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """``(canonical_name, quantized tensor)`` for every quantized weight of ``model``: the forward grid.

    The grid is the per-step cache: after ``optimizer.step()`` the first forward (or this call, whichever
    comes first) quantizes the new master once and both read that one result. BF16 parameters are not
    yielded (read them from ``named_parameters``).
    """
    for module in model.modules():
        if getattr(module, "is_quantized_module", False):
            yield from module.learner_weights()


def executed_quantized(model: torch.nn.Module) -> dict[str, str]:
    """``{canonical name: format}`` of every weight a forward of ``model`` has run quantized (C1: what the
    modules recorded while computing, not what the plan says)."""
    out: dict[str, str] = {}
    for module in model.modules():
        fn = getattr(module, "executed_quantized", None)
        if getattr(module, "is_quantized_module", False) and callable(fn):
            out.update(fn())
    return out


def invalidate_grids(model: torch.nn.Module) -> int:
    """Drop every cached weight grid of ``model`` (call after each optimizer step); returns how many modules.

    Needed because not every weight update bumps the version counter the cache is keyed on
    (``AdamW(fused=True)``, writes through ``p.data``); after this the next forward or ``learner_weights``
    quantizes the new master once.
    """
    n = 0
    for module in model.modules():
        fn = getattr(module, "invalidate_grids", None)
        if getattr(module, "is_quantized_module", False) and callable(fn):
            fn()
            n += 1
    return n


def invalidate_on_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """Register ``invalidate_grids(model)`` as a step post-hook of ``optimizer``; returns the hook handle."""
    return optimizer.register_step_post_hook(lambda *_: invalidate_grids(model))
