"""The reference engine's weight updates (``ReferenceEngine``'s fourth job), with SGLang's semantics (CONTRACT 5).

``begin_weight_update`` stops serving (new ``generate`` calls are refused; one in flight parks at its next step);
``update_weights`` checks the whole bucket (names, shapes, dtypes, duplicates) before writing anything, then
``copy_`` into the tensors captured at load (storage and data pointers unchanged; the stacked projections in a
few strided copies, ``miles_lp.multitensor.strided``); ``finish_weight_update`` re-runs
``process_weights_after_loading`` on the touched layers (in place), bumps ``weight_version`` and serves again.
``update_from_disk`` is SGLang's ``update_weights_from_disk``. A failed update never serves a mix of old and new
weights under a new version.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from miles_lp.multitensor import strided
from miles_lp.rollout.engine import EngineError, WeightUpdateError
from miles_lp.rollout.layers import EngineLinear, LinearStack
from miles_lp.rollout.reference.faults import EngineFaults, matches


class ReferenceUpdates:
    """``ReferenceEngine``'s update cycle. Writes through the tensor index of ``ReferenceBuild`` (``_owner``,
    ``_captured``, ``_check``); shares the serving state with ``ReferenceGeneration`` (``_cond``, ``_updating``,
    ``_stepping``, ``_partial``, ``_cache_epoch``); keeps the bucket copy plans (``_plans``)."""

    _stacks: list[LinearStack]
    _singles: list[EngineLinear]
    _cond: threading.Condition
    faults: EngineFaults
    weight_version: int

    def begin_weight_update(self) -> None:
        self.__dict__["_c3_pending"] = None  # a queued self-check replay read the previous weights
        if (rot := self.__dict__.get("_rot_graph_state")) is not None:
            rot.pending = None
        with self._cond:
            if self._updating and not self._partial:
                raise EngineError("begin_weight_update: an update is already in progress (call finish_weight_update)")
            self._cond.wait_for(lambda: not self._stepping)
            self._updating = True
            self._touched.clear()
            self._written.clear()
        for name in self._owner:
            if self.faults.rebind and matches(name, self.faults.rebind):
                module, attr, _ = self._owner[name]
                old = getattr(module, attr)
                setattr(module, attr, torch.nn.Parameter(old.detach().clone(), requires_grad=False))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if not self._updating:
            raise EngineError("update_weights outside begin_weight_update() ... finish_weight_update(); call "
                              "begin_weight_update first")
        bucket = list(named_tensors)
        # A bucket with the same names, dtypes, shapes and source addresses as one already applied (the sync's
        # staging buffer, reused every step) replays that bucket's copy plan: the checks below depend on nothing
        # else, and the plan's views keep their storage alive, so an address cannot be reused by another buffer.
        try:
            key = tuple((name, t.data_ptr(), t.dtype, t.shape) for name, t in bucket)
        except AttributeError:  # not a tensor: the checks below say which
            key = None
        hit = self._plans.get(key) if key is not None else None
        if hit is None:
            seen: set[str] = set()
            for name, t in bucket:  # the whole bucket is checked before any byte is written
                if not isinstance(t, torch.Tensor):
                    raise WeightUpdateError(f"update bucket: '{name}' is a {type(t).__name__}, not a tensor")
                if name in seen:
                    raise WeightUpdateError(f"update bucket: '{name}' appears twice")
                seen.add(name)
                self._check(name, t.dtype, t.shape, where="update bucket")
            pairs, written, touched = [], set(), set()
            for name, t in bucket:
                if self.faults.drop_updates and matches(name, self.faults.drop_updates):
                    continue
                pairs.append((self._captured[name], t))  # in place: the storage captured at load
                written.add(name)
                layer = self._owner[name][2]
                if layer is not None:
                    touched.add(layer.prefix)
            hit = (strided.copy_plan(pairs), frozenset(written), frozenset(touched))  # stacks: a few strided copies
            # kept only for a bucket staged in ONE buffer (a transport's reused staging), and only for the latest
            # such buffer: the plans' views hold it alive (one buffer, whatever the number of buckets), never
            # tensors loaded from disk
            storages = {t.untyped_storage().data_ptr() for _, t in bucket} if key is not None else set()
            if self._cache_plans and len(storages) == 1:
                (storage,) = storages
                if storage != self._plans_storage or len(self._plans) >= 1024:  # another buffer / layout
                    self._plans.clear()
                    self._plans_storage = storage
                self._plans[key] = hit
        plan, written, touched = hit
        self._written |= written
        self._touched |= touched
        with torch.no_grad():
            strided.run_plan(plan)

    def abort_weight_update(self) -> None:
        """Drop an open update that wrote nothing (every bucket is checked whole before its first byte): the
        engine serves its previous weights again, same version. After a written bucket the previous weights are
        gone: generation stays refused until a full update (begin ... finish). A no-op outside an update."""
        written = self._drop_update()
        if written:
            raise EngineError(f"abort_weight_update: {written} tensor(s) were already written; the previous weights "
                              "are gone: send a full update (begin ... finish)")

    def _drop_update(self) -> int:
        """End an open update without finishing it: nothing written -> serving the previous weights again;
        some written -> a partial state (generation refused until a complete update). Returns the count written."""
        with self._cond:
            if not self._updating:
                return 0
            written = len(self._written)
            if written:
                self._partial = True
            else:
                self._updating = False
                self._touched.clear()
                self._cond.notify_all()
            return written

    def finish_weight_update(self, weight_version: int | None = None) -> dict[str, Any]:
        """Rebuild the derived state of the touched layers, bump (or set) ``weight_version``, serve again.

        Returns ``{"rebuilt": n layers, "written": n tensors, "not_written": n, "weight_version": v}`` (C5)."""
        if not self._updating:
            raise EngineError("finish_weight_update without begin_weight_update")
        rebuilt = 0
        skip = self.faults.skip_rebuild
        for st in self._stacks:  # all experts of a projection at once when the whole stack was updated
            todo = [m for m in st.layers if m.prefix in self._touched and not (skip and matches(m.prefix, skip))]
            if len(todo) == len(st.layers):
                rebuilt += st.process_weights_after_loading()
            else:
                for layer in todo:
                    layer.process_weights_after_loading()
                rebuilt += len(todo)
        for layer in self._singles:
            if layer.prefix in self._touched and not (skip and matches(layer.prefix, skip)):
                layer.process_weights_after_loading()
                rebuilt += 1
        report = {"rebuilt": rebuilt, "written": len(self._written),
                  "not_written": len(set(self._owner) - self._written)}
        with self._cond:
            self.weight_version = self.weight_version + 1 if weight_version is None else int(weight_version)
            # a partial state ends only with an update that wrote every tensor (a small update would serve a mix)
            self._partial = self._partial and report["not_written"] > 0
            self._updating = False
            self._cache_epoch += 1
            self._cond.notify_all()
        report["weight_version"] = self.weight_version
        return report

    def update_from_disk(self, path: str | Path, weight_version: int | None = None) -> dict[str, Any]:
        """SGLang's ``update_weights_from_disk``: every tensor of checkpoint ``path`` (the served checkpoint's
        names, dtypes and shapes) checked from the headers first, then written in place, file by file."""
        from miles_lp.rollout.checkpoint import tensor_headers

        root = Path(path)
        if not root.is_dir():
            raise WeightUpdateError(f"update_weights_from_disk: '{root}' is not a checkpoint folder")
        headers = tensor_headers(root)
        for name, h in headers.items():
            self._check(name, getattr(torch, h.dtype), h.shape, where=str(root))
        self.begin_weight_update()
        try:
            from safetensors import safe_open

            self._cache_plans = False  # file tensors: new every call, never kept alive by a cached plan
            for f in sorted({h.file for h in headers.values()}):
                with safe_open(str(f), framework="pt") as sf:
                    self.update_weights((n, sf.get_tensor(n)) for n in sf.keys())
        except BaseException as exc:
            # never serve a mix of old and new weights under a new version (SGLang rolls back): nothing written ->
            # the previous weights serve on; some written -> generation refused until a full update
            self._cache_plans = True
            written = self._drop_update()
            if written and isinstance(exc, Exception):
                raise WeightUpdateError(f"update_weights_from_disk {root}: failed after {written} tensor(s) were "
                                        f"written ({type(exc).__name__}: {exc}); generation is refused until a full "
                                        "update succeeds") from exc
            raise
        self._cache_plans = True
        return self.finish_weight_update(weight_version)
