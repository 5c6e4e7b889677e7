"""The reference engine's introspection for C1, C2 and C4 (``ReferenceEngine``'s second job), read from the live
modules, never from a config.

C1 ``quantized_params``: the format each live layer built at its last ``process_weights_after_loading``. C2
``weight_digests`` / ``weight_fingerprints`` / ``weight_group_fingerprints`` / ``read_weights``: the canonical
(on-disk named) tensors as the modules hold them now (a re-bound parameter is what is read). C4
``storage_pointers``: ``data_ptr()`` of every tensor the serving kernels read. ``check_state`` answers C2 and C4
from one read of the live tensors. The sync calls these every step over ~2,000-4,000 tensors, so the lookups are
C-level maps over tables built once at load (``ReferenceBuild._index_tensors``).
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from miles_lp.multitensor import digest as _digest
from miles_lp.multitensor import kernels as _kernels
from miles_lp.rollout.engine import EngineError, tensor_digest
from miles_lp.rollout.layers import EngineLinear, LinearStack, derived_epoch, describe_layer


def live_attr(module: torch.nn.Module, attr: str) -> Any:
    """``getattr(module, attr)`` for a parameter or buffer without ``nn.Module.__getattr__`` (a Python frame per
    call; the checks read ~2,000 of these per sync): the same lookup order (the instance dict, then parameters,
    then buffers), so a re-bound parameter is seen exactly as ``getattr`` sees it."""
    d = module.__dict__
    t = d.get(attr)
    if t is None:
        t = d["_parameters"].get(attr)
        if t is None:
            t = d["_buffers"].get(attr)
            if t is None:
                t = getattr(module, attr)
    return t


def live_gather(entries: Sequence[tuple[dict, str, torch.nn.Module]]) -> list[torch.Tensor]:
    """``[live_attr(module, attr) for (module.__dict__, attr, module) in entries]`` in one comprehension (no Python
    frame per tensor; C4 and C2 read ~2,000-4,000 of these per sync): the same lookup order as ``live_attr`` (the
    instance dict, then parameters, then buffers, then ``getattr``), read live each call, so a re-bound
    parameter or buffer is seen exactly as ``getattr`` sees it."""
    return [t if (t := d.get(a)) is not None else t if (t := d["_parameters"].get(a)) is not None
            else live_attr(m, a) for d, a, m in entries]

DATA_PTR = torch.Tensor.data_ptr


class ReferenceIntrospection:
    """``ReferenceEngine``'s C1 / C2 / C4 answers. Reads the tensor index of ``ReferenceBuild`` and the layer lists
    (``_linears``, ``_stacks``); keeps its own caches (``_fp_plans``: C2's per-layout plans; ``_ptab``: C4's
    pointer table)."""

    _linears: list[EngineLinear]
    _stacks: list[LinearStack]

    def param_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """``{on-disk name: (dtype, shape)}`` of everything an update may write."""
        return {n: (str(d).removeprefix("torch."), tuple(s)) for n, (d, s) in self._expected.items()}

    def _live(self, name: str) -> torch.Tensor:
        module, attr, _ = self._owner[name]
        t = live_attr(module, attr)
        exp_dtype = self._expected[name][0]
        return t.detach() if t.dtype == exp_dtype else t.detach().to(exp_dtype)  # fp32-held BF16: exact

    def quantized_params(self) -> dict[str, str]:
        """``{"<module>.weight": format}`` of every layer whose kernel computes in low precision, read from what
        each live layer built at its last ``process_weights_after_loading`` (C1)."""
        out = {}
        for layer in self._linears:
            if layer.kernel_format is not None and layer.kernel_format.quantized:
                out[f"{layer.prefix}weight"] = layer.kernel_format.value
        return out

    def layers(self) -> dict[str, dict[str, Any]]:
        return {f"{layer.prefix}weight": describe_layer(layer) for layer in self._linears}

    def weight_digests(self, names: Iterable[str] | None = None) -> dict[str, str]:
        names = list(self._owner) if names is None else list(names)
        self._known(names)
        return {n: tensor_digest(self._live(n)) for n in names}

    def weight_fingerprints(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """Device-side checksums of the live canonical tensors (``miles_lp.multitensor.digest.fingerprints``: one
        device->host transfer), for the sync's C2 check where host blake2b digests would dominate the sync."""
        names = list(self._owner) if names is None else list(names)
        self._known(names)
        return _digest.fingerprints({n: self._live(n) for n in names})

    def weight_group_fingerprints(self, groups: Mapping[str, Sequence[str]]) -> dict[str, str]:
        """``miles_lp.multitensor.digest.group_fingerprints`` of the live canonical tensors, one per group of names
        (in the given order): the sync's per-sync C2 at one reduction per atomic group."""
        return _digest.group_strings(list(groups), *self._group_digests(groups, self._canonical_live(), None))

    def _canonical_live(self) -> list[torch.Tensor]:
        """The live canonical tensors in owner order, as ``live_gather(self._entries)`` (the same lookup order: the
        instance dict, then parameters, then buffers), read now: when every one was a parameter at load, two
        C-level maps (the parameter dicts' items; whether any instance dict shadows a name), else ``live_gather``."""
        if self._params_only:
            try:
                live = list(map(operator.getitem, self._homes, self._attrs))
            except KeyError:  # a parameter removed: the full lookup (buffers, getattr) says what is there now
                return live_gather(self._entries)
            if not any(map(operator.is_, live, itertools.repeat(None))) and not any(
                    map(operator.contains, self._idicts, self._attrs)):
                return live
        return live_gather(self._entries)

    def _group_plan(self, groups: Mapping[str, Sequence[str]]) -> list:
        """Per-layout plan of C2's engine side, cached by the groups object (WeightSync passes its layout's, the
        same every sync) and checked equal to it: the names validated once; [groups, group ids, counts, each
        member's index in the owner order, expected dtypes, fast-path snapshot or None]."""
        plan = self._fp_plans.get(id(groups))
        if plan is None or plan[0] != groups:
            names = [n for ns in groups.values() for n in ns]
            self._known(names)
            index = {n: i for i, n in enumerate(self._owner_names)}
            plan = [dict(groups), list(groups), [len(ns) for ns in groups.values()], [index[n] for n in names],
                    [self._expected[n][0] for n in names], None]
            if len(self._fp_plans) > 8:
                self._fp_plans.clear()
            self._fp_plans[id(groups)] = plan
        return plan

    def _group_digests(self, groups: Mapping[str, Sequence[str]], canon: list[torch.Tensor],
                       canon_ptrs: tuple[int, ...] | None, *, collect: bool = True
                       ) -> tuple[list[str], list[int] | torch.Tensor]:
        """C2's engine side from ``canon`` (the live canonical tensors in owner order, read by the caller now)
        and, when the caller read them too, their data pointers. Fast path (CUDA, or the Triton interpreter):
        while every member is the very tensor object the previous call digested, at the same address (identity
        and ``data_ptr``, both read now), the launch tables, member heads and dtype checks of that call are
        reused (``kernels.PreparedValues``: one launch, no per-tensor host work); anything else takes the full
        path (``digest._group_values``: every member's dtype, shape, size and address read again). Returns each
        group's head and int64 sum (``digest.group_strings`` makes ``group_fingerprints``' strings of them);
        ``collect=False``: on the fast path the sums as the int64 device tensor the launch fills (no host
        synchronisation yet; the caller reads it)."""
        plan = self._group_plan(groups)
        _, gids, counts, order, dtypes, fast = plan
        if fast is not None:
            ptrs = canon_ptrs if canon_ptrs is not None else tuple(map(DATA_PTR, canon))
            if ptrs == fast[0] and all(map(operator.is_, canon, fast[1])):
                sums = fast[3].run()
                return fast[2], sums.cpu().tolist() if collect else sums
            plan[5] = None
        # the live tensors (read now: a re-bound parameter is what is digested), only read under no_grad, so no
        # detach; an fp32-held BF16 tensor converted (exact)
        live = [canon[i] for i in order]
        conv = [t if t.dtype == d else t.detach().to(d) for t, d in zip(live, dtypes, strict=True)]
        if not conv or not all(counts) or len({t.device for t in conv}) != 1:  # not this engine's layout, but exact
            strs = _digest.group_fingerprints_flat(gids, counts, conv)
            heads = [strs[g].rpartition(":")[0] for g in gids]
            vals = [int(strs[g].rpartition(":")[2], 16) for g in gids]
            return heads, [v - (1 << 64) if v >> 63 else v for v in vals]
        heads, i = [], 0
        for k in counts:
            heads.append(_digest.group_head(conv[i:i + k]))  # from the live members' dtypes and shapes
            i += k
        sums = _digest.group_values(counts, conv)
        dev = conv[0].device
        if _kernels.enabled(dev) and all(map(operator.is_, conv, live)) and all(t.is_contiguous() for t in conv):
            slots, mults = _digest.group_plan(counts)
            prepared = _kernels.PreparedValues(conv, slots, mults, len(gids), _digest.row_weights(dev))
            plan[5] = (canon_ptrs if canon_ptrs is not None else tuple(map(DATA_PTR, canon)), tuple(canon), heads,
                       prepared)
        return heads, sums

    def _pointer_table(self) -> tuple:
        """(derived epoch, names, derived accessors, stack accessors) of every tensor the serving kernels read
        (``storage_pointers``' names in its order), rebuilt when any layer's set of derived buffers changed
        (``layers.derived_epoch``); the tensors themselves are read live at each call."""
        epoch = derived_epoch()
        tab = self.__dict__.get("_ptab")
        if tab is not None and tab[0] == epoch:
            return tab
        names = list(self._owner_names)
        der = ([], [], [], [])  # per derived buffer: its layer's instance dict, buffer dict, name, layer
        for layer in self._linears:
            d, b, pre = layer.__dict__, layer.__dict__["_buffers"], layer.prefix
            for k in layer._derived:
                names.append(pre + k)
                for col, v in zip(der, (d, b, k, layer), strict=True):
                    col.append(v)
        stk = ([], [])  # per stacked tensor: the stack's dict (canonical / derived: a new dict bumps the epoch), key
        for st in self._stacks:
            head = st.layers[0].prefix + "stack."
            for part in (st.canonical, st.derived):
                for k in part:
                    names.append(head + k)
                    stk[0].append(part)
                    stk[1].append(k)
        tab = self._ptab = (epoch, tuple(names), der, stk)
        return tab

    def _served(self) -> tuple[tuple[str, ...], list[torch.Tensor], list[torch.Tensor]]:
        """(names, live canonical tensors in owner order, every served tensor in ``names`` order), read now."""
        names, rest = self._served_rest()
        canon = self._canonical_live()
        return names, canon, [*canon, *rest]

    def _served_rest(self) -> tuple[tuple[str, ...], list[torch.Tensor]]:
        """(names, the served tensors after the canonical ones: derived buffers, then stacks), read now. A derived
        buffer is its layer's ``_buffers`` entry unless the instance dict shadows it (then ``getattr``, as
        ``live_attr``): C-level maps in the usual case."""
        _, names, (ds, bs, ks, ms), (parts, keys) = self._pointer_table()
        try:
            derived = list(map(operator.getitem, bs, ks))
        except KeyError:
            derived = None
        if (derived is None or any(map(operator.is_, derived, itertools.repeat(None)))
                or any(map(operator.contains, ds, ks))):
            derived = [t if (t := b.get(k)) is not None and k not in d else live_attr(m, k)
                       for d, b, k, m in zip(ds, bs, ks, ms, strict=True)]
        derived.extend(map(operator.getitem, parts, keys))
        return names, derived

    def check_state(self, groups: Mapping[str, Sequence[str]] | None = None) -> dict[str, Any]:
        """C4 and C2's engine side from ONE read of the live tensors: ``{"names": tuple, "pointers":
        tuple, "group_heads": list | None, "group_values": list | None, "pointer_seconds": float}``.
        ``names``/``pointers`` are ``storage_pointers()`` as two aligned tuples (``names`` the same object while
        the set of served tensors stands: one tuple comparison per sync); ``group_heads``/``group_values`` are
        ``weight_group_fingerprints(groups)`` of the same canonical tensors before formatting (the strings are
        ``digest.group_strings(list(groups), heads, values)``; None when ``groups`` is None), so the healthy
        case compares two lists of ints. ``pointer_seconds``: the host time of the pointer read alone (what C4
        costs), so the caller can split the call's time between the two checks. The digest is launched right
        after the canonical tensors are read and collected after the rest of the pointers: its device time runs
        under that host walk."""
        t0 = time.perf_counter()
        canon = self._canonical_live()
        cptrs = tuple(map(DATA_PTR, canon))
        t1 = time.perf_counter()
        pending = self._group_digests(groups, canon, cptrs, collect=False) if groups is not None else None
        t2 = time.perf_counter()
        names, rest = self._served_rest()
        ptrs = cptrs + tuple(map(DATA_PTR, rest))
        t3 = time.perf_counter()
        out = {"names": names, "pointers": ptrs, "group_heads": None, "group_values": None,
               "pointer_seconds": (t1 - t0) + (t3 - t2)}
        if pending is not None:
            heads, values = pending
            out["group_heads"] = heads
            out["group_values"] = values if isinstance(values, list) else values.cpu().tolist()
        return out

    def read_weights(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        names = list(names)
        self._known(names)
        return {n: self._live(n).cpu().clone() for n in names}

    def _known(self, names: Sequence[str]) -> None:
        bad = [n for n in names if n not in self._owner]
        if bad:
            raise EngineError(f"unknown parameter(s) {bad[:3]}; the engine's names are the checkpoint's")

    def storage_pointers(self) -> dict[str, int]:
        """``data_ptr()`` of every tensor the serving kernels read: canonical (live module attributes) and derived
        (``<module>.<derived>``: ``operand``, ``scale_swizzled``, ...). Stacked experts serve from views: each
        expert's pointer is that of its own view (where its kernel reads), and the stacks themselves are listed as
        ``<expert 0 prefix>stack.<name>`` (the storage the views and the batched rebuild must stay in). Every
        tensor is read live at each call; the list of names is rebuilt when a layer's set of derived buffers
        changes (``check_state`` reads the same)."""
        names, _, served = self._served()
        return dict(zip(names, map(DATA_PTR, served), strict=True))
