"""The per-step weight grid of one master weight: its quantized views, computed once per optimizer step.

The cache is keyed on the master's storage and ``_version``, which in-place updates through autograd-visible
tensors bump (``AdamW(foreach=...)``, ``p.add_`` under ``no_grad``). Some updates do not bump it:
``AdamW(fused=True)`` and writes through ``p.data`` (Megatron's optimizers copy main params into model params
that way). So an optimizer step must also call ``invalidate_grids(model)`` (``miles_lp.train.quant_linear``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from miles_lp.errors import ConfigError
from miles_lp.train import fused
from miles_lp.train.operands import (
    check_operand,
    fused_dequantize,
    fused_weight,
    quantize_columnwise_checked,
    quantize_weight,
    weight_amax,
)
from miles_lp.train.recipe import LinearRecipe


def version_key(ts: Sequence[torch.Tensor]) -> tuple:
    return tuple((t.data_ptr(), t._version, t.dtype, t.device, t.shape) for t in ts)


KERNELS = ("auto", "reference", "compiled")


class _NullCtx:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL = _NullCtx()


def no_grad_if_enabled():
    """``torch.no_grad()``, or nothing when grad mode is already off (inside an autograd Function's forward:
    the hot path; entering no_grad costs a mode switch and an object per call)."""
    return torch.no_grad() if torch.is_grad_enabled() else _NULL


class WeightGrid:
    """The quantized views of one master weight, computed once per optimizer step.

    ``rowwise(w)`` is the forward grid (and what ``learner_weights`` exports); ``columnwise(w)`` the
    ``quantized``-mode dgrad operand. ``amax_partners`` are weights that share this weight's NVFP4 global
    scale (a separate gate for an up projection and vice versa); ``amax_reduce(a)``, when set, reduces the local
    NVFP4 global amax (this weight's and its partners', ``[..., 1, 1]``) to the one the grid uses (e.g. MAX over a
    tensor-parallel group, ``miles_lp.train.megatron.naming.tp_amax_reduce``).

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
        self.amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._row: Any = None
        self._row_key: tuple | None = None
        self._deq: torch.Tensor | None = None  # dequantized rowwise grid (compiled path), same key as _row
        self._col: Any = None
        self._col_key: tuple | None = None
        self._t: Any = None  # FP8 blockwise: fp8_block_gemm.WeightOperands of the forward grid (native GEMMs)
        self.quantize_calls = 0  # observable in tests: once per step
        #: shared by sibling linears reading one input (``gemm.InputCache``; set by ``share_input_caches``)
        self.input_cache: Any = None
        self.scheme = recipe.scheme

    def use_compiled(self, t: torch.Tensor) -> bool:
        """``compiled``: always; ``auto``: on CUDA, MXFP8 always and NVFP4 when this torch's Inductor can
        compile exact fp32 division (NVFP4's scale math divides; both byte-equal to the reference on the
        H200, 2026-11-29, ``pytest -m gpu``); ``reference``: never. FP8 blockwise: never (its GEMMs are native,
        ``miles_lp.train.fp8_block_gemm``, or the codecs). The format's scheme decides
        (``FormatScheme.use_compiled``)."""
        return self.scheme.use_compiled(self.kernel, t)

    def _key(self, weight: torch.Tensor) -> tuple:
        if not self.amax_partners:  # (the common case, without building a list and a generator per call)
            return ((weight.data_ptr(), weight._version, weight.dtype, weight.device, weight.shape),)
        return version_key([weight, *self.amax_partners])

    def _amax(self, weight: torch.Tensor) -> torch.Tensor | None:
        if not self.scheme.joint_global_scale:
            return None
        if not self.amax_partners and self.amax_reduce is None:
            return None
        amax = weight_amax(weight)
        for p in self.amax_partners:
            amax = torch.maximum(amax, weight_amax(p).to(amax.device))
        if self.amax_reduce is not None:  # e.g. MAX over the tensor-parallel group: the unsharded amax
            amax = self.amax_reduce(amax)
        return amax.reshape(()) if weight.dim() == 2 else amax

    def _fresh(self, key: tuple) -> bool:
        if self._row is not None and key == self._row_key:
            return True
        self._row, self._deq, self._row_key, self._t = None, None, None, None
        return False

    def rowwise(self, weight: torch.Tensor):
        key = self._key(weight)
        if not self._fresh(key):
            with torch.no_grad():
                self._row = quantize_weight(weight, self.recipe, amax=self._amax(weight),
                                            compile=self.use_compiled(weight))
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
            check_operand(weight, self.recipe, -1, "weight")
            with no_grad_if_enabled():
                # (fused detaches for its compiled graphs; the kernels read the data pointer)
                q, deq = fused_weight(weight, self.recipe, dtype, self._amax(weight))
            self._row, self._row_key = q, key
            self.quantize_calls += 1
        self._deq = deq if self.cache_dequantized else None
        return self._row, deq

    def both_dequantized(self, weight: torch.Tensor, dtype: torch.dtype) -> tuple[Any, torch.Tensor, Any]:
        """(rowwise grid, its decode in ``dtype``, columnwise grid): the ``quantized`` mode's weight operands
        from ONE read of the master (``fused.mxfp8_qdq_both``; compiled path, MXFP8, N a multiple of 32).
        Cached per step like ``rowwise_dequantized`` / ``columnwise`` (whichever ran first is reused)."""
        key = self._key(weight)
        row_fresh = self._fresh(key) and (self._deq is not None and self._deq.dtype == dtype)
        col_fresh = self._col is not None and key == self._col_key
        if row_fresh and col_fresh:
            return self._row, self._deq, self._col
        if row_fresh or col_fresh or weight.shape[-2] % 32:
            q, deq = self.rowwise_dequantized(weight, dtype)
            return q, deq, self.columnwise(weight)
        check_operand(weight, self.recipe, -1, "weight")
        with torch.no_grad():
            q, deq, col, _ = fused.mxfp8_qdq_both(weight.detach(), dtype, dequant=("row",))
        self._row, self._row_key = q, key
        self._deq = deq if self.cache_dequantized else None
        self._col, self._col_key = col, key
        self.quantize_calls += 1
        return q, deq, col

    def columnwise(self, weight: torch.Tensor):
        if self.scheme.transposable_weight:  # FP8 blockwise: one 128x128 tile serves the weight and its transpose
            return self.rowwise(weight)
        key = self._key(weight)
        if self._col is None or key != self._col_key:
            with torch.no_grad():
                self._col = quantize_columnwise_checked(weight.detach(), self.recipe, "weight",
                                                         compiled=self.use_compiled(weight))
            self._col_key = key
        return self._col

    def fp8_block_native(self, weight: torch.Tensor):
        """``fp8_block_gemm.WeightOperands``: the 128x128 forward grid, its data transposed ``[K, N]`` and the
        GEMMs' scale views, from one read of the master through ``miles_lp.formats.kernels.fp8_block`` (the
        codec's bytes); cached per step like ``rowwise`` (one quantization per step serves the forward, dgrad and
        the weight export)."""
        key = self._key(weight)
        if self._t is not None and self._fresh(key):
            return self._t
        from miles_lp.formats.kernels import fp8_block
        from miles_lp.train.fp8_block_gemm import WeightOperands

        with torch.no_grad():
            q, t, st = fp8_block.quantize_weight(weight, self.recipe.pow2_scales, transposed=True, scale_t=True)
            ops = WeightOperands(q, t, st)
        self._row, self._row_key, self._t = q, key, ops
        self.quantize_calls += 1
        return ops

    def invalidate(self) -> None:
        self._t = None
        self._row = self._col = self._deq = None
        self._row_key = self._col_key = None
