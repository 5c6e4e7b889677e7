"""Many small copies as a few strided ones: the per-tensor launch cost, not the bytes, dominates a sync.

A sync moves ~1000 tensors, most of them the per-expert slices of a few stacked tensors: the learner's grid of
one projection is ``[E, N, K]`` and each expert's export is a view of it; the engine's experts are views of its
``[E, ...]`` stacks (``miles_lp.rollout.layers.LinearStack``); a bucket's slots follow each other at a fixed
stride. ``batched_copy(pairs)`` finds, among ``(dst, src)`` pairs of equal shape and dtypes whose destinations
share one storage and whose sources share one storage, runs where both advance by a constant number of elements,
and copies each run with one ``as_strided`` view per side: one kernel instead of one per tensor. It reads only
host metadata (pointers, shapes, strides: no device synchronization) and falls back to ``dst.copy_(src)``
for anything it cannot prove safe (non-contiguous tensors, overlapping destinations, misaligned offsets).
The bytes written are exactly those of the per-tensor copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Pair = tuple[torch.Tensor, torch.Tensor]  # (dst, src)


_WIDE = (torch.int64, torch.int32, torch.int16)
_WIDTH = {torch.int64: 8, torch.int32: 4, torch.int16: 2}


def as_words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Contiguous ``t``'s bytes as a flat ``dtype`` tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8).view(dtype)


def _base(t: torch.Tensor) -> tuple[int, int]:
    """(storage pointer, offset of ``t`` in elements of its dtype from it)."""
    ptr = t.untyped_storage().data_ptr()
    return ptr, t.storage_offset()


def _runs(offsets: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Split ``offsets`` (dst, src element offsets, in order) into maximal runs of constant (dst, src) steps;
    ``(start, length)`` each."""
    out, i, n = [], 0, len(offsets)
    while i < n:
        j = i + 1
        if j < n:
            dd, ds = offsets[j][0] - offsets[i][0], offsets[j][1] - offsets[i][1]
            while j + 1 < n and offsets[j + 1][0] - offsets[j][0] == dd and offsets[j + 1][1] - offsets[j][1] == ds:
                j += 1
            j += 1
        out.append((i, j - i))
        i = j
    return out


def _strided_views(d0: torch.Tensor, s0: torch.Tensor, counts, dsteps, ssteps) -> Pair:
    """``counts`` (an int or a (rows, cols) pair) copies of ``s0``'s shape, advancing by ``dsteps`` / ``ssteps``
    elements, as one strided (dst, src) view pair; when both sides hold the same dtype, in the widest word that divides every
    size and offset (the same bytes, a fraction of the elements)."""
    counts = (counts,) if isinstance(counts, int) else tuple(counts)
    dsteps = (dsteps,) if isinstance(dsteps, int) else tuple(dsteps)
    ssteps = (ssteps,) if isinstance(ssteps, int) else tuple(ssteps)
    if d0.dtype == s0.dtype:
        es = d0.element_size()
        nbytes = d0.numel() * es
        for dt in _WIDE:
            w = _WIDTH[dt]
            if w <= es:
                break
            if nbytes % w or d0.data_ptr() % w or s0.data_ptr() % w or any((x * es) % w for x in (*dsteps, *ssteps)):
                continue
            k = w // es
            dw, sw = as_words(d0, dt), as_words(s0, dt)
            dv = dw.as_strided((*counts, dw.numel()), (*(x // k for x in dsteps), 1), dw.storage_offset())
            sv = sw.as_strided((*counts, sw.numel()), (*(x // k for x in ssteps), 1), sw.storage_offset())
            return dv, sv
    dv = d0.as_strided((*counts, *d0.shape), (*dsteps, *d0.stride()), d0.storage_offset())
    sv = s0.as_strided((*counts, *s0.shape), (*ssteps, *s0.stride()), s0.storage_offset())
    return dv, sv


def _grid2(offsets: list[tuple[int, int]]) -> tuple[tuple[int, int], int, int, int] | None:
    """``((rows, cols), step_dst, src_row_step, src_col_step)`` when the destinations advance by one constant step
    and the sources follow a 2-D pattern ``s0 + row * a + col * b`` (gate and up of expert e reading one NVFP4
    global scale, the next expert the next one: ``b = 0``); ``None`` otherwise (one constant step included: the
    1-D runs handle it)."""
    n = len(offsets)
    if n < 4:
        return None
    d0, s0 = offsets[0]
    dd = offsets[1][0] - d0
    b = offsets[1][1] - s0
    cols = 1
    while cols < n and offsets[cols][1] - offsets[cols - 1][1] == b:
        cols += 1
    if cols in (1, n) or n % cols:
        return None
    a = offsets[cols][1] - s0
    for j, (d, s) in enumerate(offsets):
        if d != d0 + j * dd or s != s0 + (j // cols) * a + (j % cols) * b:
            return None
    if a < 0 or b < 0:
        return None
    return (n // cols, cols), dd, a, b


def batched_copy(pairs: Sequence[Pair]) -> int:
    """``dst.copy_(src)`` for every pair, as few strided copies as the layout allows; returns the copies issued
    (``copy_plan`` then ``run_plan``)."""
    return run_plan(copy_plan(pairs))


def run_plan(plan: Sequence[Pair]) -> int:
    """Issue the copies of a ``copy_plan`` (it stays valid while its tensors' storage does: a receiver whose
    buckets arrive in the same staging buffer every sync can keep it)."""
    for d, s in plan:
        d.copy_(s)
    return len(plan)


def copy_plan(pairs: Sequence[Pair]) -> list[Pair]:
    """The ``(dst view, src view)`` copies that write every pair: one strided view pair per run, the pair itself
    where no run applies.

    A run is copied through ``dst0.as_strided((n, *shape), (step_dst, *stride))`` and the same for the source
    (``step_src`` may be 0: one source read by several destinations). The destinations must be distinct tensors
    (every caller writes each tensor once); a run's destinations must not overlap (``step_dst >= numel``) and
    every tensor must be contiguous, else those pairs are copied one by one."""
    groups: dict[tuple, list[int]] = {}
    meta: list[tuple[int, int] | None] = []
    for i, (d, s) in enumerate(pairs):
        if d.is_contiguous() and s.is_contiguous() and d.numel() > 0:
            dp, do = _base(d)
            sp, so = _base(s)
            key = (dp, sp, d.dtype, s.dtype, tuple(d.shape), tuple(s.shape), d.device, s.device)
            groups.setdefault(key, []).append(i)
            meta.append((do, so))
        else:
            meta.append(None)
    plan: list[Pair] = []
    done = [False] * len(pairs)
    for idx in groups.values():
        if len(idx) < 2:
            continue
        offs = [meta[i] for i in idx]
        grid = _grid2(offs)
        if grid is not None and grid[1] >= pairs[idx[0]][0].numel():
            (rows, cols), (dd, a, b) = grid[0], grid[1:]
            d0, s0 = pairs[idx[0]]
            plan.append(_strided_views(d0, s0, (rows, cols), (cols * dd, dd), (a, b)))
            for i in idx:
                done[i] = True
            continue
        for start, length in _runs(offs):
            if length < 2:
                continue
            run = idx[start:start + length]
            d0, s0 = pairs[run[0]]
            dd = offs[start + 1][0] - offs[start][0]
            ds = offs[start + 1][1] - offs[start][1]
            if dd < d0.numel() or ds < 0:  # overlapping or backwards destinations: one by one
                continue
            plan.append(_strided_views(d0, s0, length, dd, ds))
            for i in run:
                done[i] = True
    plan.extend(p for i, p in enumerate(pairs) if not done[i])
    return plan
