"""The embedded reference engine: serves a converted checkpoint with the emulated kernels (CPU or one GPU).

    engine = ReferenceEngine("/tmp/tiny-mxfp8")                 # a `miles-lp convert` output, or a BF16 HF folder
    gens = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8, seed=0))
    engine.begin_weight_update(); engine.update_weights(bucket); engine.finish_weight_update()

``ReferenceEngine`` implements the engine protocol (``miles_lp.rollout.engine.Engine``, every optional
``Capability`` included) from one module per job, each a mixin over the one engine state built here:

=====================  ================================================================================
``build``              the transformers model, ``EngineLinear`` / ``EngineExperts`` in place of its linears,
                       the tensor index, the load (no random init)
``introspect``         C1 ``quantized_params``, C2 digests / fingerprints / ``read_weights``, C4
                       ``storage_pointers``, ``check_state`` (C2 + C4 in one read)
``c3``                 C3 ``self_check`` / ``self_check_begin`` / ``self_check_every_layer`` through the shared
                       probe (``rollout.self_check``), with its CUDA graphs (``rotating_graph``)
``updates``            ``begin`` / ``update_weights`` / ``finish`` / ``abort`` / ``update_from_disk``
``generation``         ``generate``, ``score``, ``pause`` / ``resume`` / ``flush_cache``
=====================  ================================================================================

Faults (``faults.EngineFaults``) reproduce the known silent failures of CONTRACT 5 on purpose, so the sync
checks can be shown to catch them; with the default ``EngineFaults()`` none is on.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch

from miles_lp.rollout.checkpoint import EngineCheckpoint, open_checkpoint
from miles_lp.rollout.engine import Capability, EngineError
from miles_lp.rollout.kv_cache import KV_CACHE_DTYPES
from miles_lp.rollout.layers import EngineLinear, LinearStack, engine_linears, stack_linears, stack_params
from miles_lp.rollout.reference.build import ReferenceBuild, resolve_device, resolve_dtype
from miles_lp.rollout.reference.c3 import ReferenceSelfCheck
from miles_lp.rollout.reference.faults import EngineFaults
from miles_lp.rollout.reference.generation import ReferenceGeneration
from miles_lp.rollout.reference.introspect import ReferenceIntrospection
from miles_lp.rollout.reference.updates import ReferenceUpdates


class ReferenceEngine(ReferenceBuild, ReferenceIntrospection, ReferenceSelfCheck, ReferenceUpdates,
                      ReferenceGeneration):
    """See the module docstring. ``checkpoint``: a folder (converted or BF16 HF)."""

    #: every optional part of the engine protocol: the sync reads them instead of probing
    capabilities = frozenset(Capability)

    def __init__(self, checkpoint: str | Path, *, device: str = "auto", dtype: str | torch.dtype | None = "auto",
                 kv_cache: str = "bf16", kv_scales: tuple[float, float] = (1.0, 1.0),
                 faults: EngineFaults | None = None, pause_timeout_s: float = 0.0, threads: int | None = None,
                 activation_mode: str = "plan"):
        if kv_cache not in KV_CACHE_DTYPES:
            raise EngineError(f"kv_cache must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache!r}")
        self.device = resolve_device(device)
        self.act_dtype = resolve_dtype(dtype, self.device)
        self.kv_cache, self.kv_scales = kv_cache, tuple(float(s) for s in kv_scales)
        self.faults = faults or EngineFaults()
        self.activation_mode = activation_mode  # "plan" (default) | "vllm": see rollout.layers.ACTIVATION_MODES
        self.pause_timeout_s = pause_timeout_s
        if threads is not None:
            torch.set_num_threads(threads)
        t0 = time.perf_counter()
        self.ckpt: EngineCheckpoint = open_checkpoint(checkpoint)
        self.model = self._build_model()
        # the module tree is fixed from here on (updates write tensors, never modules): walk it once
        self._linears: list[EngineLinear] = [m for _, m in engine_linears(self.model)]
        # every projection's layers (all experts of all layers; the q_proj of all layers; ...) in one stacked
        # storage: updates land in a few strided copies and finish derives them in a few batched passes
        self._stacks: list[LinearStack] = stack_linears(self.model)
        stack_params(self.model)  # the norms and routers of all layers too
        stacked = {p for st in self._stacks for p in st.prefixes}
        self._singles: list[EngineLinear] = [m for m in self._linears if m.prefix not in stacked]
        self._index_tensors()
        self._load_all()
        for st in self._stacks:
            st.process_weights_after_loading()
        for layer in self._singles:
            layer.process_weights_after_loading()
        self.load_seconds = time.perf_counter() - t0
        self.weight_version = 0
        self.context_len = int(self.ckpt.config.get("max_position_embeddings") or 0) or 1 << 30
        self.vocab_size = int(self.hf_config.vocab_size)
        # serving state
        self._cond = threading.Condition()
        self._gen_lock = threading.Lock()
        self._c3_lock = threading.RLock()  # one self-check at a time (``c3.c3_guarded``)
        # added to the weight version where C3's rotating layer is chosen: the run's sync count before this engine
        # started (a resumed or restarted run probes the layer a straight run would, ``launch.runner``)
        self.c3_rotation_base = 0
        self._paused = False
        self._pause_mode = "retract"
        self._updating = False
        self._stepping = False
        self._cache_epoch = 0
        self._in_flight = 0  # generate calls running
        self.parked = 0  # times an in-flight generation parked at a step boundary (pause / update)
        self._touched: set[str] = set()
        self._written: set[str] = set()
        self._partial = False  # a failed update wrote some tensors: refuse generation until a full update
        self._plans: dict[tuple, tuple] = {}  # bucket signature -> (copy plan, names written, layers touched)
        self._plans_storage: int | None = None  # the one staging buffer the cached plans read
        self._cache_plans = True
        self._closed = False

    def health(self) -> dict[str, Any]:
        q = self.quantized_params()
        counts: dict[str, int] = {}
        for f in q.values():
            counts[f] = counts.get(f, 0) + 1
        status = "closed" if self._closed else "updating" if self._updating else "paused" if self._paused else "ok"
        return {"status": status, "backend": "reference", "weight_version": self.weight_version,
                "model_type": self.ckpt.config.get("model_type"), "target": self.ckpt.target,
                "plan_hash": self.ckpt.plan_hash, "device": str(self.device),
                "dtype": str(self.act_dtype).removeprefix("torch."), "kv_cache": self.kv_cache,
                "activation_mode": self.activation_mode,
                "kv_cache_mismatch_source": self.kv_cache != "bf16", "quantized_layers": counts,
                "context_len": self.context_len, "in_flight": self._in_flight, "parked": self.parked,
                "faults": self.faults.active()}

    def close(self) -> None:
        self._closed = True
        self._plans.clear()
        self.model = None  # type: ignore[assignment]
