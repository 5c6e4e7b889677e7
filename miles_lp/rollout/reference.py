"""The embedded reference engine: serves a converted checkpoint with the emulated kernels (CPU or one GPU).

    engine = ReferenceEngine("/tmp/tiny-mxfp8")                 # a `miles-lp convert` output, or a BF16 HF folder
    gens = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8, seed=0))
    engine.begin_weight_update(); engine.update_weights(bucket); engine.finish_weight_update()

Build: the transformers model from ``config.json`` (no random init: every parameter is loaded, and a tensor the
model lacks or a parameter the checkpoint lacks is a ``CheckpointError``); every ``nn.Linear`` becomes an
``EngineLinear`` and every fused experts module an ``EngineExperts`` of per-expert ``EngineLinear`` (the
checkpoint's own names), in the format the engine reads from ``quantization_config`` (``rollout.checkpoint``).
Then ``process_weights_after_loading`` on every layer (``rollout.layers``).

Generation: batched, left-padded, transformers' KV cache (``kv_cache: fp8_e4m3`` rounds K/V as the engines do,
``rollout.kv_cache``), one token per step for every unfinished row, finished rows dropped from the batch.
``Generation.logprobs`` are raw policy log-probs (temperature 1; ``rollout.sampling``). Prompts must be shorter
than the context (``max_position_embeddings``); ``max_new_tokens`` is capped at what fits (finish ``length``).

Updates (SGLang's semantics; CONTRACT 5): ``begin_weight_update`` stops serving (new ``generate`` calls are
refused; one in flight parks at its next step); ``update_weights`` checks the whole bucket (names, shapes, dtypes,
duplicates) before writing anything, then ``copy_`` into the tensors captured at load (storage and data pointers
unchanged); ``finish_weight_update`` re-runs ``process_weights_after_loading`` on the touched layers (in place),
bumps ``weight_version`` and serves again. Parked generations then continue as their pause mode says
(``retract``: recompute the KV of prompt + tokens so far with the new weights, SGLang's ``retract``).

Faults (``EngineFaults``) reproduce the known silent failures of CONTRACT 5 on purpose, so the sync checks
can be shown to catch them (the fault-injection selftest, `miles-lp selftest sync`); with the default ``EngineFaults()`` none is on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import itertools
import operator
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from miles_lp.errors import CheckpointError
from miles_lp.formats.spec import Format
from miles_lp.rollout.checkpoint import EngineCheckpoint, iter_tensors, open_checkpoint
from miles_lp.rollout.engine import (
    Capability,
    EngineBusy,
    EngineError,
    Generation,
    SamplingParams,
    WeightUpdateError,
    tensor_digest,
)
from miles_lp.rollout.kv_cache import KV_CACHE_DTYPES, make_cache
from miles_lp.rollout.layers import (
    EngineExpert,
    EngineExperts,
    EngineLinear,
    LinearStack,
    derived_epoch,
    describe_layer,
    engine_linears,
    share_input_caches,
    stack_linears,
    stack_params,
)
from miles_lp.rollout.sampling import sample

PAUSE_MODES = ("abort", "retract", "in_place")
SELF_CHECK_TOLERANCE = 0.25  # CONTRACT 5: healthy ~0.03 dense / ~0.05 expert (MXFP8), stale ~1


@dataclasses.dataclass(frozen=True)
class EngineFaults:
    """Deliberate faults (all off by default). Patterns are ``fnmatch`` patterns; ``"*"`` matches everything.

    ``skip_rebuild``: layers (module prefix, e.g. ``"*.experts.*"``) whose derived state ``finish_weight_update``
    does not rebuild: the kernel keeps serving the old operand and swizzled scales (stale layout, C3).
    ``rebind``: canonical tensor names that ``begin_weight_update`` re-binds: the module gets a fresh copy while
    the update still writes into the tensor captured at load (re-bound parameter, C4).
    ``drop_updates``: names ``update_weights`` accepts but does not write (a loader that skips names, C2/C5).
    ``quantize_lm_head``: the sampler serves ``lm_head`` in MXFP8 although the checkpoint holds it BF16 (C1).
    """

    skip_rebuild: tuple[str, ...] = ()
    rebind: tuple[str, ...] = ()
    drop_updates: tuple[str, ...] = ()
    quantize_lm_head: bool = False

    def active(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name)}


def _match(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"device '{spec}': no CUDA device is available here; use device='cpu'")
    return dev


def _resolve_dtype(spec: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(spec, torch.dtype):
        return spec
    if spec in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    if spec not in table:
        raise EngineError(f"dtype must be auto, fp32 or bf16, got {spec!r}")
    return table[spec]


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older transformers
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def _is_fused_experts(module: torch.nn.Module) -> bool:
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gu, torch.nn.Parameter) and gu.dim() == 3 and isinstance(down, torch.nn.Parameter)
            and down.dim() == 3)


def _set_child(root: torch.nn.Module, dotted: str, new: torch.nn.Module) -> None:
    parent_name, _, child = dotted.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)



def _attr(module: torch.nn.Module, attr: str) -> Any:
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


def _gather(entries: Sequence[tuple[dict, str, torch.nn.Module]]) -> list[torch.Tensor]:
    """``[_attr(module, attr) for (module.__dict__, attr, module) in entries]`` in one comprehension (no Python
    frame per tensor; C4 and C2 read ~2,000-4,000 of these per sync): the same lookup order as ``_attr`` (the
    instance dict, then parameters, then buffers, then ``getattr``), read live each call, so a re-bound
    parameter or buffer is seen exactly as ``getattr`` sees it."""
    return [t if (t := d.get(a)) is not None else t if (t := d["_parameters"].get(a)) is not None
            else _attr(m, a) for d, a, m in entries]

_DATA_PTR = torch.Tensor.data_ptr


def _c3_guarded(fn):
    """One self-check at a time (the server's handler threads share the probes, the stand-ins and the graphs), run
    on the engine's own CUDA device: a handler thread's current device is 0 whatever the engine's, and a capture on
    another device's stream records nothing while the ops run eagerly."""
    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        dev = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with self._c3_lock, dev:
            return fn(self, *args, **kwargs)
    return run


class ReferenceEngine:
    """See the module docstring. ``checkpoint``: a folder (converted or BF16 HF)."""

    #: every optional part of the engine protocol: the sync reads them instead of probing
    capabilities = frozenset(Capability)

    def __init__(self, checkpoint: str | Path, *, device: str = "auto", dtype: str | torch.dtype | None = "auto",
                 kv_cache: str = "bf16", kv_scales: tuple[float, float] = (1.0, 1.0),
                 faults: EngineFaults | None = None, pause_timeout_s: float = 0.0, threads: int | None = None,
                 activation_mode: str = "plan"):
        if kv_cache not in KV_CACHE_DTYPES:
            raise EngineError(f"kv_cache must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache!r}")
        self.device = _resolve_device(device)
        self.act_dtype = _resolve_dtype(dtype, self.device)
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
        self._c3_lock = threading.RLock()  # one self-check at a time (``_c3_guarded``)
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

    # ------------------------------------------------------------------------------------------------
    # build and load
    # ------------------------------------------------------------------------------------------------
    def _build_model(self) -> torch.nn.Module:
        import transformers

        cfg = transformers.AutoConfig.for_model(**self.ckpt.config)
        self.hf_config = cfg
        with _no_init_weights(), torch.device(self.device):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=self.act_dtype)
        model.eval()
        import inspect

        # transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns)
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        ck = self.ckpt
        from miles_lp.policy import get_layout

        # in-memory (transformers-5) names -> the checkpoint's canonical names (Mixtral: mlp.experts.gate_up_proj
        # holds block_sparse_moe.experts.{e}.w1/w3; mlp.gate is block_sparse_moe.gate)
        self.layout = get_layout(ck.config)
        tied = bool(getattr(cfg, "tie_word_embeddings", False)) and "lm_head.weight" not in ck.tensors
        if tied:
            model.tie_weights()  # lm_head reads the embedding's tensor (from_config under no_init_weights leaves them apart)
            if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
                raise CheckpointError("tie_word_embeddings is set but transformers did not tie lm_head to the embedding")
        quantized_weights = set(ck.formats)
        for name, module in list(model.named_modules()):
            if isinstance(module, torch.nn.Linear):
                if name == "lm_head" and tied:
                    continue  # shares the embedding's tensor (loaded once, under its embedding name)
                canon = self._canonical(f"{name}.weight")
                _set_child(model, name, self._engine_linear(canon[: -len(".weight")], module.in_features,
                                                            module.out_features, module.bias is not None))
                quantized_weights.discard(canon)
            elif _is_fused_experts(module):
                if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False):
                    raise CheckpointError(f"'{name}': experts module {type(module).__name__} (transposed or biased "
                                          "experts) is not supported by the reference engine")
                e_count, two_i, hidden = module.gate_up_proj.shape
                inter = two_i // 2
                gu = self.layout.describe(f"{name}.gate_up_proj").members  # (e0.gate, e0.up, e1.gate, ...)
                dn = self.layout.describe(f"{name}.down_proj").members
                if len(gu) != 2 * e_count or len(dn) != e_count:
                    raise CheckpointError(f"'{name}': the layout names {len(gu)} gate/up and {len(dn)} down tensors "
                                          f"for {e_count} experts")
                experts = [EngineExpert(self._engine_linear(_strip_weight(gu[2 * e]), hidden, inter, False),
                                        self._engine_linear(_strip_weight(gu[2 * e + 1]), hidden, inter, False),
                                        self._engine_linear(_strip_weight(dn[e]), inter, hidden, False))
                           for e in range(e_count)]
                quantized_weights.difference_update([*gu, *dn])
                apply_gate = None
                if getattr(type(module), "_apply_gate", None) is not None and \
                        type(module)._apply_gate.__name__ != "_default_apply_gate":
                    apply_gate = module._apply_gate  # the architecture's own gating (keeps the old module alive)
                    module.gate_up_proj = module.down_proj = None  # ... but not its empty fused tensors
                _set_child(model, name, EngineExperts(experts, module.act_fn, apply_gate))
        model.requires_grad_(False)  # a sampler: no autograd state on any tensor
        share_input_caches(model)
        if quantized_weights:
            raise CheckpointError(f"the quantization config quantizes {len(quantized_weights)} weight(s) the model "
                                  f"has no linear layer for, e.g. {sorted(quantized_weights)[:3]}")
        return model

    def _canonical(self, name: str) -> str:
        """The checkpoint name of in-memory tensor ``name`` (itself unless the layout maps it to one other)."""
        members = self.layout.describe(name).members  # unknown names describe as themselves
        return members[0] if len(members) == 1 else name

    def _engine_linear(self, name: str, k: int, n: int, bias: bool) -> EngineLinear:
        """An ``EngineLinear`` for the checkpoint module ``name`` (its canonical prefix, without ``.weight``)."""
        ck = self.ckpt
        wname = f"{name}.weight"
        fmt = ck.format_of(wname)
        h = ck.tensors.get(wname)
        wdtype = getattr(torch, h.dtype) if (h is not None and fmt is Format.BF16) else torch.bfloat16
        serve = None
        if name == "lm_head" and self.faults.quantize_lm_head and fmt is Format.BF16:
            serve = Format.MXFP8
        return EngineLinear(f"{name}.", k, n, disk_format=fmt, target=ck.target, bias=bias, weight_dtype=wdtype,
                            activation_scale=ck.activation_scale.get(wname, "token"), act_dtype=self.act_dtype,
                            device=self.device, serve_format=serve, activation_mode=self.activation_mode)

    def _index_tensors(self) -> None:
        """name -> (owner module, attribute, tensor captured now, owning EngineLinear or None), on-disk names."""
        self._owner: dict[str, tuple[torch.nn.Module, str, EngineLinear | None]] = {}
        self._captured: dict[str, torch.Tensor] = {}
        seen: dict[int, str] = {}
        for mname, module in self.model.named_modules():
            local = list(module.named_parameters(recurse=False)) + [
                (b, t) for b, t in module.named_buffers(recurse=False) if b not in module._non_persistent_buffers_set]
            for attr, t in local:
                if isinstance(module, EngineLinear):
                    full = module.prefix + attr  # the checkpoint's name, whatever the module path
                else:
                    full = self._canonical(f"{mname}.{attr}" if mname else attr)
                if id(t) in seen:  # a tied tensor: loaded and updated under its first name
                    continue
                seen[id(t)] = full
                self._owner[full] = (module, attr, module if isinstance(module, EngineLinear) else None)
                self._captured[full] = t
        self._expected: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for full, (_module, attr, layer) in self._owner.items():
            t = self._captured[full]
            if layer is not None:
                dtype, shape = layer.canonical_specs()[attr]
            else:
                h = self.ckpt.tensors.get(full)
                dtype = getattr(torch, h.dtype) if h is not None else t.dtype
                shape = tuple(t.shape)
            self._expected[full] = (dtype, shape)
        # name -> (module.__dict__, attribute, module): the live lookup without a frame per tensor (``_gather``)
        self._entry = {n: (m.__dict__, a, m) for n, (m, a, _) in self._owner.items()}
        self._entries = list(self._entry.values())
        self._owner_names = list(self._entry)
        # the same lookups as C-level maps when every tensor is a registered parameter (the usual case): its
        # module's ``_parameters`` dict, unless the instance dict shadows the name (then ``_gather``)
        homes = [m.__dict__["_parameters"] for m, a, _ in self._owner.values()]
        self._params_only = all(a in h for h, (_, a, _) in zip(homes, self._owner.values(), strict=True))
        self._homes = homes
        self._idicts = [m.__dict__ for m, _, _ in self._owner.values()]
        self._attrs = [a for _, a, _ in self._owner.values()]
        self._fp_plans: dict[int, tuple] = {}  # id(groups) -> (groups, names, entries, dtypes): C2's engine side

    def _load_all(self) -> None:
        ck = self.ckpt
        unknown = sorted(set(ck.tensors) - set(self._owner))
        if unknown:
            raise CheckpointError(f"{ck.root}: {len(unknown)} tensor(s) the engine's model has no parameter for, e.g. "
                                  f"{unknown[:3]} (is config.json's quantization_config the one this checkpoint was "
                                  "written with?)")
        missing = sorted(set(self._owner) - set(ck.tensors))
        if missing:
            raise CheckpointError(f"{ck.root}: {len(missing)} parameter(s) of the model are not in the checkpoint, "
                                  f"e.g. {missing[:3]}; the engine loads every tensor (no random init)")
        for name, h in ck.tensors.items():
            self._check(name, getattr(torch, h.dtype), h.shape, where=f"{ck.root}")
        with torch.no_grad():
            for name, t in iter_tensors(ck):
                self._captured[name].copy_(t)

    def _check(self, name: str, dtype: torch.dtype, shape: Sequence[int], where: str) -> None:
        exp = self._expected.get(name)
        if exp is None:
            raise WeightUpdateError(f"{where}: unknown parameter '{name}' (names are the checkpoint's on-disk tensor "
                                    f"names for target {self.ckpt.target})")
        if dtype != exp[0]:
            raise WeightUpdateError(f"{where}: '{name}' has dtype {str(dtype).removeprefix('torch.')}, the engine "
                                    f"holds {str(exp[0]).removeprefix('torch.')}")
        if tuple(shape) != tuple(exp[1]):
            raise WeightUpdateError(f"{where}: '{name}' has shape {list(shape)}, the engine holds {list(exp[1])}")

    # ------------------------------------------------------------------------------------------------
    # introspection
    # ------------------------------------------------------------------------------------------------
    def param_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """``{on-disk name: (dtype, shape)}`` of everything an update may write."""
        return {n: (str(d).removeprefix("torch."), tuple(s)) for n, (d, s) in self._expected.items()}

    def _live(self, name: str) -> torch.Tensor:
        module, attr, _ = self._owner[name]
        t = _attr(module, attr)
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
        """Device-side checksums of the live canonical tensors (``miles_lp.sync.digest.fingerprints``: one
        device->host transfer), for the sync's C2 check where host blake2b digests would dominate the sync."""
        from miles_lp.sync.digest import fingerprints

        names = list(self._owner) if names is None else list(names)
        self._known(names)
        return fingerprints({n: self._live(n) for n in names})

    def weight_group_fingerprints(self, groups: Mapping[str, Sequence[str]]) -> dict[str, str]:
        """``miles_lp.sync.digest.group_fingerprints`` of the live canonical tensors, one per group of names (in
        the given order): the sync's per-sync C2 at one reduction per atomic group."""
        from miles_lp.sync.digest import group_strings

        return group_strings(list(groups), *self._group_digests(groups, self._canonical_live(), None))

    def _canonical_live(self) -> list[torch.Tensor]:
        """The live canonical tensors in owner order, as ``_gather(self._entries)`` (the same lookup order: the
        instance dict, then parameters, then buffers), read now: when every one was a parameter at load, two
        C-level maps (the parameter dicts' items; whether any instance dict shadows a name), else ``_gather``."""
        if self._params_only:
            try:
                live = list(map(operator.getitem, self._homes, self._attrs))
            except KeyError:  # a parameter removed: the full lookup (buffers, getattr) says what is there now
                return _gather(self._entries)
            if not any(map(operator.is_, live, itertools.repeat(None))) and not any(
                    map(operator.contains, self._idicts, self._attrs)):
                return live
        return _gather(self._entries)

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
        from miles_lp.sync import digest as _digest
        from miles_lp.sync import kernels as _kernels

        plan = self._group_plan(groups)
        _, gids, counts, order, dtypes, fast = plan
        if fast is not None:
            ptrs = canon_ptrs if canon_ptrs is not None else tuple(map(_DATA_PTR, canon))
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
            heads.append(_digest._head(conv[i:i + k]))  # from the live members' dtypes and shapes
            i += k
        sums = _digest.group_values(counts, conv)
        dev = conv[0].device
        if _kernels.enabled(dev) and all(map(operator.is_, conv, live)) and all(t.is_contiguous() for t in conv):
            slots, mults = _digest.group_plan(counts)
            prepared = _kernels.PreparedValues(conv, slots, mults, len(gids), _digest._wcol(dev))
            plan[5] = (canon_ptrs if canon_ptrs is not None else tuple(map(_DATA_PTR, canon)), tuple(canon), heads,
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
        ``_attr``): C-level maps in the usual case."""
        _, names, (ds, bs, ks, ms), (parts, keys) = self._pointer_table()
        try:
            derived = list(map(operator.getitem, bs, ks))
        except KeyError:
            derived = None
        if (derived is None or any(map(operator.is_, derived, itertools.repeat(None)))
                or any(map(operator.contains, ds, ks))):
            derived = [t if (t := b.get(k)) is not None and k not in d else _attr(m, k)
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
        cptrs = tuple(map(_DATA_PTR, canon))
        t1 = time.perf_counter()
        pending = self._group_digests(groups, canon, cptrs, collect=False) if groups is not None else None
        t2 = time.perf_counter()
        names, rest = self._served_rest()
        ptrs = cptrs + tuple(map(_DATA_PTR, rest))
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
        return dict(zip(names, map(_DATA_PTR, served), strict=True))

    @_c3_guarded
    def self_check_begin(self, seed: int = 0) -> bool:
        """Start the self-check's device work now, when it is a captured graph whose key still holds (CUDA): the
        replay is queued and ``self_check(seed)`` collects it, so it runs while the caller does host work (the
        sync's C4 pointer walk). Returns whether a replay was queued. Dropped by any weight update (the
        replay must read the bytes ``self_check`` is asked about) and checked again at collection."""
        self.__dict__["_c3_pending"] = None
        rot = self.__dict__.get("_rot_graph_state")
        if rot is not None:
            rot.pending = None
        if not self._graphs_on() or (self.__dict__.get("_c3_graph") is None and rot is None):
            return False
        work, _ = self._c3_work(seed)
        queued = False
        if rot is not None:  # the rotating layer's replay, when its stand-in's graph exists
            layer = self._rotating_layer({layer for _, layer, _, _ in work})
            queued = layer is not None and rot.launch(_fresh_config(layer)[1:], layer, self.weight_version)
        key = self._c3_key(work) if work else None
        g = self.__dict__.get("_c3_graph")
        if key is None or g is None or g[0] != key or self.__dict__.get("_c3_graph_off") is not None:
            return queued
        g[1].replay()
        self.__dict__["_c3_pending"] = (seed, key, g, self.weight_version)
        return True

    def _c3_work(self, seed: int) -> tuple[list[tuple], dict[str, Any]]:
        """The self-check's layers and probes: [(kind, layer, x, x64)] and the result skeleton."""
        dense = expert = None
        for layer in self._linears:  # the first quantized dense layer and the first quantized expert
            if layer.kernel_format is None or not layer.kernel_format.quantized or layer.disk_format is Format.BF16:
                continue
            if ".experts." in f".{layer.prefix}":
                expert = expert or layer
            else:
                dense = dense or layer
            if dense is not None and expert is not None:
                break
        out: dict[str, Any] = {"tolerance": SELF_CHECK_TOLERANCE, "layers": {}, "skipped": []}
        probes = self._probes(seed, dense, expert)
        work = []  # (kind, layer, probe x, its float64 copy)
        for kind, layer in (("dense", dense), ("expert", expert)):
            if layer is None:
                out["skipped"].append(f"no quantized {kind} layer")
                continue
            work.append((kind, layer, *probes[kind]))
            out["layers"][f"{layer.prefix}weight"] = {"kind": kind, "format": layer.kernel_format.value}
        return work, out

    @_c3_guarded
    def self_check(self, seed: int = 0) -> dict[str, Any]:
        """C3: one quantized dense layer and one quantized expert through the serving ``apply`` on random input,
        vs a float64 GEMM on the dequantized canonical weights; relative Frobenius error per layer."""
        self.__dict__["_rot_seed"] = seed  # the probes the rotating graphs are prepared with (every-layer pass)
        work, out = self._c3_work(seed)
        pending = self.__dict__.get("_c3_pending")
        self.__dict__["_c3_pending"] = None
        if work:  # one device->host transfer for both layers' figures (float64: the values float() gives)
            vals, out["graph"] = self._c3_values(work, pending if pending and pending[0] == seed else None)
            for i, v in enumerate(out["layers"].values()):
                v["rel_err"], v["fresh_diff"] = vals[2 * i], vals[2 * i + 1]
        rot = self._c3_rotating(seed, {layer for _, layer, _, _ in work})
        if rot is not None:
            layer, rel, diff, how = rot
            out["layers"][f"{layer.prefix}weight"] = {"kind": "rotating", "format": layer.kernel_format.value,
                                                      "rel_err": rel, "fresh_diff": diff, "graph": how}
        layers = out["layers"].values()
        out["ok"] = bool(layers) and all(v.get("rel_err", 0.0) <= SELF_CHECK_TOLERANCE and v["fresh_diff"] == 0
                                         for v in layers)
        return out

    def _c3_rotation(self) -> list[EngineLinear]:
        """Every quantized layer, interleaved across projections (stacks) so that consecutive syncs probe
        different projections: each projection within a few syncs, each layer within ``len()`` syncs."""
        rot = self.__dict__.get("_c3_rotation_list")
        if rot is None:
            def quantized(m):
                return m.kernel_format is not None and m.kernel_format.quantized and m.disk_format is not Format.BF16
            groups = [[m for m in st.layers if quantized(m)] for st in self._stacks]
            groups += [[m] for m in self._singles if quantized(m)]
            groups = [g for g in groups if g]
            rot = [g[i] for i in range(max((len(g) for g in groups), default=0)) for g in groups if i < len(g)]
            self.__dict__["_c3_rotation_list"] = rot
        return rot

    @_c3_guarded
    def self_check_every_layer(self) -> dict[str, dict[str, Any]]:
        """C3 over every quantized layer: the serving kernel vs the same kernel on state derived afresh from its
        canonical tensors (``fresh_diff``, exactly 0 when healthy), ``{<module>.weight: {...}}``. The cost of one
        more ``finish``: run on the full-compare syncs (the initial one, after a restart), not every step."""
        out = {}
        for layer in self._c3_rotation():
            y, y_fresh = self._serving_and_fresh(layer, self._rot_probe(0, layer.in_features))
            d = (y.double() - y_fresh.double()).abs().max()
            out[f"{layer.prefix}weight"] = {"kind": "every", "format": layer.kernel_format.value, "fresh_diff": d}
        if out:
            vals = torch.stack([v["fresh_diff"] for v in out.values()]).tolist()  # one device -> host transfer
            for v, d in zip(out.values(), vals, strict=True):
                v["fresh_diff"] = d
        if self._graphs_on():  # the rotating probe's graphs, one per layer configuration, captured here once
            rot = self._rot_graphs()
            for layer in self._c3_rotation():
                x = self._rot_probe(self.__dict__.get("_rot_seed", 0), layer.in_features)
                rot.prepare(_fresh_config(layer)[1:], layer, x,
                            lambda layer=layer, x=x: self._c3_rotating_eager(layer, x))
        return out

    def _rotating_scratch(self, layer: EngineLinear) -> EngineLinear:
        """A private copy of ``layer``'s configuration, one kept per configuration but prefix (the experts of a
        projection share one): no module built per sync. ``rotating_graph.serving_and_fresh`` sets its canonical
        tensors and rebuilds its derived state at each use."""
        cfg = _fresh_config(layer)[1:]
        cache = self.__dict__.setdefault("_rot_scratch", {})
        fresh = cache.get(cfg)
        if fresh is None:
            fresh = cache[cfg] = layer.detached_copy()
        return fresh

    def _rot_probe(self, seed: int, width: int) -> torch.Tensor:
        """The rotating / every-layer probe input of ``width`` features: the same tensor every sync."""
        key = (seed, width, self.device, self.act_dtype)
        probes = self.__dict__.setdefault("_rot_probes", {})
        x = probes.get(key)
        if x is None:
            g = torch.Generator(device="cpu").manual_seed(seed + 1)
            x = torch.randn(16, width, generator=g).to(self.device, self.act_dtype)
            if len(probes) > 16:
                probes.clear()
            probes[key] = x
        return x

    def _serving_and_fresh(self, layer: EngineLinear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s serving kernel on ``x``, and the same kernel on state derived afresh from its canonical
        tensors (equal when healthy)."""
        from miles_lp.rollout.rotating_graph import serving_and_fresh

        return serving_and_fresh(layer, self._rotating_scratch(layer), x)

    def _c3_rotating(self, seed: int, fixed: set) -> tuple[EngineLinear, float, float, str] | None:
        """C3 beyond its fixed pair: one more layer per sync, the next of ``_c3_rotation`` (by weight version),
        its serving kernel vs a float64 GEMM of its dequantized canonical weights (rel_err) and vs the same kernel
        on state derived afresh from its canonical tensors (fresh_diff, exactly 0 when healthy), so stale derived
        state of any layer shows within a bounded number of syncs. On CUDA a graph per layer configuration
        (``rotating_graph``: the live tensors copied into a kept stand-in, then one replay); else eager, on a
        kept scratch copy per layer configuration. Returns (layer, rel_err, fresh_diff, how)."""
        layer = self._rotating_layer(fixed)
        if layer is None:
            return None
        x = self._rot_probe(seed, layer.in_features)
        if self._graphs_on():
            figs, how = self._rot_graphs().values(_fresh_config(layer)[1:], layer, x, self.weight_version,
                                                  lambda: self._c3_rotating_eager(layer, x))
        else:
            figs, how = self._c3_rotating_eager(layer, x), "eager"
        return layer, figs[0], figs[1], how

    def _rotating_layer(self, fixed: set) -> EngineLinear | None:
        rot = self._c3_rotation()
        if not rot:
            return None
        layer = rot[(self.weight_version + self.c3_rotation_base) % len(rot)]
        return None if layer in fixed else layer

    def _graphs_on(self) -> bool:
        import os

        return self.device.type == "cuda" and os.environ.get("MILES_LP_SYNC_GRAPHS", "1") != "0"

    def _rot_graphs(self):
        from miles_lp.rollout.rotating_graph import RotatingGraphs

        g = self.__dict__.get("_rot_graph_state")
        if g is None:
            g = self.__dict__["_rot_graph_state"] = RotatingGraphs()
        return g

    def _c3_rotating_eager(self, layer: EngineLinear, x: torch.Tensor) -> list[float]:
        from miles_lp.rollout.rotating_graph import figures

        return figures(layer, self._rotating_scratch(layer), x, x.double()).tolist()

    def _c3_figures(self, work: list[tuple]) -> torch.Tensor:
        """Per layer of ``work``: rel_err and fresh_diff (float64, stacked, on the engine's device; no host
        synchronisation, so the whole of it can be captured in a CUDA graph)."""
        figures: list[torch.Tensor] = []
        for _, layer, x, x64 in work:
            with torch.no_grad():
                # layer.apply(x) for this 2-D x, without the siblings' input cache (a memo of the same
                # function: a probe held there across syncs could be taken for a serving input)
                xq = self._probe_input(layer, x)
                y = layer.gemm(xq, x.dtype).double()
                w = dequantize_exact(layer.decoded(), torch.float64)
                ref = x64 @ w.T
                fresh = self._freshly_derived(layer)
                # the fresh copy quantizes the input exactly as the layer does when its grid key is the same
                # (its canonical tensors, the input scale among them, are copies of the layer's)
                fq = xq if _input_key(fresh) == _input_key(layer) else fresh._quantize_input(x)
                y_fresh = fresh.gemm(fq, x.dtype).double()
                # rel_err alone cannot see derived state left from the previous weights after a small (RL-sized)
                # step: it stays at the healthy quantization error. The same kernel on state derived afresh from
                # the canonical tensors is exactly equal when healthy (the derivation is deterministic).
                figures.append((y - ref).norm() / ref.norm().clamp_min(1e-30))
                figures.append((y - y_fresh).abs().max())
        return torch.stack(figures)

    def _c3_key(self, work: list[tuple]) -> tuple | None:
        """What a captured C3 graph depends on: per layer its identity, kernel format, derived set, input grid
        key, the addresses of every tensor it reads (live canonical and derived, the private fresh copy's, the
        probe and its quantized form), all read now. None while the private copy or the quantized probe do not
        exist yet for this configuration (the eager call builds them)."""
        fresh_cache = self.__dict__.get("_fresh_cache", {})
        probe_q = self.__dict__.get("_probe_q", {})
        key = []
        for _, layer, x, x64 in work:
            hit = fresh_cache.get(layer.prefix)
            q = probe_q.get((id(x), _input_key(layer)))
            if hit is None or hit[0] != _fresh_config(layer) or q is None or q[0] is not x:
                return None
            fresh = hit[1]
            key.append((id(layer), layer.kernel_format, tuple(sorted(layer._derived)), _input_key(layer),
                        _input_key(fresh), tuple(sorted(fresh._derived)), id(fresh), x.data_ptr(), x64.data_ptr(),
                        q[1].data_ptr(),
                        tuple(t.data_ptr() for t in layer.canonical().values()),
                        tuple(t.data_ptr() for t in layer.derived().values()),
                        tuple(t.data_ptr() for t in fresh.canonical().values()),
                        tuple(t.data_ptr() for t in fresh.derived().values())))
        return tuple(key)

    def _c3_values(self, work: list[tuple], pending: tuple | None = None) -> tuple[list[float], str]:
        """The self-check's figures and how they were computed. On CUDA (unless ``MILES_LP_SYNC_GRAPHS=0``) the
        whole computation (~100 kernels: two GEMM pairs, the float64 reference, the fresh derivation) is captured
        once in a CUDA graph and replayed while everything it reads is where it was captured (``_c3_key``: the
        same tensors at the same addresses, the same formats and derived sets), so a sync pays one replay instead
        of ~100 launches of host work; the replay reads the live bytes, so stale derived state shows exactly as
        in the eager path. A graph is kept only if its first replay equals the eager figures bit for bit;
        anything else (a capture error, a mismatch) runs eager from then on, the reason in ``graph``."""
        import os

        from miles_lp.rollout.rotating_graph import same_figures

        if self.device.type != "cuda" or os.environ.get("MILES_LP_SYNC_GRAPHS", "1") == "0":
            return self._c3_figures(work).tolist(), "eager"
        off = self.__dict__.get("_c3_graph_off")
        if off is not None:
            return self._c3_figures(work).tolist(), "eager (" + off + ")"
        key = self._c3_key(work)
        g = self.__dict__.get("_c3_graph")
        if g is not None and key is not None and g[0] == key:
            g[4][0] += 1
            if g[4][0] % _C3_RECHECK:
                if pending is not None and pending[1] == key and pending[2] is g and pending[3] == self.weight_version:
                    return g[2].tolist(), "graph replay (queued early)"  # self_check_begin's replay, what it read
                g[1].replay()
                return g[2].tolist(), "graph replay"
            # every _C3_RECHECK-th replay also runs eager and must agree bit for bit (a buffer the captured
            # kernels read but the key does not name, e.g. inside a kernel library, cannot drift unseen)
            g[1].replay()
            got = g[2].tolist()
            vals = self._c3_figures(work).tolist()
            if same_figures(got, vals):
                return vals, "graph replay (checked against eager)"
            self.__dict__["_c3_graph"] = None
            self.__dict__["_c3_graph_off"] = f"replay {got} != eager {vals} after {g[4][0]} replays"
            return vals, "eager (" + self.__dict__["_c3_graph_off"] + ")"
        vals = self._c3_figures(work).tolist()  # eager: builds the private copy and the quantized probe
        key = self._c3_key(work)
        if key is None:
            return vals, "eager"
        self.__dict__["_c3_graph"] = None
        captures = self.__dict__["_c3_captures"] = self.__dict__.get("_c3_captures", 0) + 1
        if captures > 8:  # what it reads keeps moving: a capture per sync would cost more than it saves
            self.__dict__["_c3_graph_off"] = f"captured {captures - 1} times, the tensors it reads keep moving"
            return vals, "eager (" + self.__dict__["_c3_graph_off"] + ")"
        try:
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA call (a parked generation) is not an error of this capture
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                static = self._c3_figures(work)
            # figures are >= 0 (or NaN): a graph that recorded nothing cannot pass the first-replay check with
            # values left from the capture
            static.fill_(-1.0)
            graph.replay()
            got = static.tolist()
        except Exception as exc:  # noqa: BLE001 (any capture failure: the eager path stays exact)
            self.__dict__["_c3_graph_off"] = f"capture failed: {type(exc).__name__}: {str(exc)[:160]}"
            return vals, "eager (" + self.__dict__["_c3_graph_off"] + ")"
        same = same_figures(got, vals)
        if not same or self._c3_key(work) != key:
            self.__dict__["_c3_graph_off"] = (f"first replay {got} != eager {vals}" if not same else
                                              "capture moved a tensor it reads")
            return vals, "eager (" + self.__dict__["_c3_graph_off"] + ")"
        # the graph's entry holds every tensor of ``work`` (the probes), so nothing it reads is freed under it
        self.__dict__["_c3_graph"] = (key, graph, static, work, [0])
        return vals, "eager, graph captured"

    def _probes(self, seed: int, dense, expert) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The self-check's random inputs (and their float64 copies), drawn from ``seed`` in the order dense,
        expert, as before; cached per (seed, layers' widths, device, dtype): they are the same every sync."""
        key = (seed, None if dense is None else dense.in_features, None if expert is None else expert.in_features,
               self.device, self.act_dtype)
        cache = self.__dict__.setdefault("_probe_cache", {})
        hit = cache.get(key)
        if hit is None:
            g = torch.Generator(device="cpu").manual_seed(seed)
            hit = {}
            for kind, layer in (("dense", dense), ("expert", expert)):
                if layer is not None:
                    x = torch.randn(16, layer.in_features, generator=g).to(self.device, self.act_dtype)
                    hit[kind] = (x, x.double())
            if len(cache) > 16:
                cache.clear()
            cache[key] = hit
        return hit

    def _probe_input(self, layer: EngineLinear, x: torch.Tensor) -> torch.Tensor:
        """``layer._quantize_input(x)`` of a probe ``x`` (held by ``_probes``: the same tensor every sync), kept
        per grid key when it depends on ``x`` and that key alone (``activation_mode`` ``plan``: the quantizer
        reads no layer state); a static-scale mode (``vllm``: the layer's ``input_scale``) is quantized each call."""
        if layer.activation_mode != "plan":
            return layer._quantize_input(x)
        cache = self.__dict__.setdefault("_probe_q", {})
        key = (id(x), _input_key(layer))
        hit = cache.get(key)
        if hit is None or hit[0] is not x:
            if len(cache) > 16:
                cache.clear()
            hit = cache[key] = (x, layer._quantize_input(x))  # holds x: its id cannot be reused meanwhile
        return hit[1]

    def _freshly_derived(self, layer: EngineLinear) -> EngineLinear:
        """``_freshly_derived(layer)`` with the private copy kept per layer and configuration: its canonical
        tensors are copied from the live layer now and its derived state rebuilt from them (own storage, never a
        view of a stack or a sibling's cached input), as a new copy would be, without building a module per sync."""
        cfg = _fresh_config(layer)
        cache = self.__dict__.setdefault("_fresh_cache", {})
        hit = cache.get(layer.prefix)
        if hit is None or hit[0] != cfg:
            fresh = _freshly_derived(layer)
            cache[layer.prefix] = (cfg, fresh)
            return fresh
        fresh = hit[1]
        with torch.no_grad():
            for suffix, t in layer.canonical().items():
                _attr(fresh, suffix).copy_(t)
        fresh.process_weights_after_loading()
        return fresh

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

    # ------------------------------------------------------------------------------------------------
    # serving state
    # ------------------------------------------------------------------------------------------------
    def pause(self, mode: str = "retract") -> None:
        """Stop generating at the next step boundary (``abort``: in-flight requests end with finish ``abort``;
        ``retract``: they resume after ``resume()`` recomputing their KV; ``in_place``: they keep their KV)."""
        if mode not in PAUSE_MODES:
            raise EngineError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        with self._cond:
            self._paused, self._pause_mode = True, mode
            self._cond.wait_for(lambda: not self._stepping)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def flush_cache(self) -> None:
        """No KV outlives a request here (no prefix cache); a generation parked ``in_place`` recomputes its KV."""
        with self._cond:
            self._cache_epoch += 1

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
            if self.faults.rebind and _match(name, self.faults.rebind):
                module, attr, _ = self._owner[name]
                old = getattr(module, attr)
                setattr(module, attr, torch.nn.Parameter(old.detach().clone(), requires_grad=False))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if not self._updating:
            raise EngineError("update_weights outside begin_weight_update() ... finish_weight_update(); call "
                              "begin_weight_update first")
        from miles_lp.sync.strided import copy_plan, run_plan

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
                if self.faults.drop_updates and _match(name, self.faults.drop_updates):
                    continue
                pairs.append((self._captured[name], t))  # in place: the storage captured at load
                written.add(name)
                layer = self._owner[name][2]
                if layer is not None:
                    touched.add(layer.prefix)
            hit = (copy_plan(pairs), frozenset(written), frozenset(touched))  # stacks: a few strided copies
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
            run_plan(plan)

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
            todo = [m for m in st.layers if m.prefix in self._touched and not (skip and _match(m.prefix, skip))]
            if len(todo) == len(st.layers):
                rebuilt += st.process_weights_after_loading()
            else:
                for layer in todo:
                    layer.process_weights_after_loading()
                rebuilt += len(todo)
        for layer in self._singles:
            if layer.prefix in self._touched and not (skip and _match(layer.prefix, skip)):
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
        from miles_lp.rollout.checkpoint import _headers

        root = Path(path)
        if not root.is_dir():
            raise WeightUpdateError(f"update_weights_from_disk: '{root}' is not a checkpoint folder")
        headers = _headers(root)
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

    def close(self) -> None:
        self._closed = True
        self._plans.clear()
        self.model = None  # type: ignore[assignment]

    # ------------------------------------------------------------------------------------------------
    # generation
    # ------------------------------------------------------------------------------------------------
    def validate_prompts(self, input_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.tolist()
        if not input_ids:
            raise EngineError("generate: empty batch")
        prompts = []
        for i, p in enumerate(input_ids):
            p = [int(t) for t in p]
            if not p:
                raise EngineError(f"generate: prompt {i} is empty")
            if len(p) >= self.context_len:
                raise EngineError(f"generate: prompt {i} has {len(p)} tokens; the context is {self.context_len} "
                                  "(max_position_embeddings): shorten the prompt")
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise EngineError(f"generate: prompt {i} has token ids outside the vocabulary [0, {self.vocab_size}): "
                                  f"{bad[:3]}")
            prompts.append(p)
        return prompts

    def generate(self, input_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        sampling.validate()
        prompts = self.validate_prompts(input_ids)
        for i, p in enumerate(prompts):  # SGLang and vLLM refuse it too: a cut response would read as `length`
            if len(p) + sampling.max_new_tokens > self.context_len:
                raise EngineError(f"generate: prompt {i} has {len(p)} tokens + max_new_tokens "
                                  f"{sampling.max_new_tokens} = {len(p) + sampling.max_new_tokens}, beyond the "
                                  f"context {self.context_len} (max_position_embeddings): lower max_new_tokens "
                                  "(rollout.max_response_len) or shorten the prompt")
        with self._gen_lock:
            with self._cond:
                if self._closed:
                    raise EngineBusy("generate: the engine is closed")
                if self._partial:
                    raise EngineBusy("generate: a failed weight update left a partial state; generation is refused "
                                     "until a full update (begin_weight_update ... finish_weight_update) succeeds")
                if self._updating:
                    raise EngineBusy("generate: a weight update is in progress (begin_weight_update ... "
                                      "finish_weight_update); generation is refused until it finishes")
                if self._paused and not self._cond.wait_for(lambda: not self._paused, timeout=self.pause_timeout_s):
                    raise EngineBusy("generate: the engine is paused; call resume() (continue_generation)")
            self._in_flight += 1
            try:
                with torch.inference_mode():
                    return self._run(prompts, sampling)
            finally:
                self._in_flight -= 1

    def score(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Teacher-forced raw log-probs ``log p(x_t | x_<t)`` for t = 1..L-1 of each sequence (fp32, CPU): the
        serving kernels on given tokens (vLLM's ``prompt_logprobs``), for comparisons on identical inputs."""
        seqs = self.validate_prompts(sequences)
        with self._gen_lock, torch.inference_mode():
            out = []
            for s in seqs:
                ids = torch.tensor([s], device=self.device)
                cache = make_cache(self.hf_config, self.kv_cache, *self.kv_scales)  # K/V through the cache's rounding
                logits = self.model(input_ids=ids, use_cache=True, **{self._cache_kwarg: cache}).logits[0].float()
                lp = torch.log_softmax(logits, -1)[:-1]
                out.append(lp.gather(-1, ids[0, 1:, None])[:, 0].cpu())
            return out

    def _forward(self, ids, mask, pos, cache):
        kw = {self._cache_kwarg: cache}
        return self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                          **kw).logits[:, -1]

    def _prefill(self, seqs: list[list[int]], rows: list[int], recorder):
        """Left-padded prefill of ``seqs``; returns (logits [R, V], cache, mask [R, L], next positions [R, 1])."""
        lens = [len(s) for s in seqs]
        width = max(lens)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[r, width - len(s):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp_(min=0)
        cache = make_cache(self.hf_config, self.kv_cache, *self.kv_scales)
        with self._routing(recorder, len(seqs), width):
            logits = self._forward(ids, mask, pos, cache)
        return logits, cache, mask, pos[:, -1:] + 1, lens

    def _routing(self, recorder, batch: int, width: int):
        model = self.model
        import contextlib

        @contextlib.contextmanager
        def ctx():
            if recorder is None:
                yield
                return
            mods = [m for m in model.modules() if isinstance(m, EngineExperts)]
            step: list[torch.Tensor] = []
            for m in mods:
                m.recorder = lambda idx, step=step: step.append(idx.reshape(batch, width, -1).cpu())
            try:
                yield
            finally:
                for m in mods:
                    m.recorder = None
            if step:
                recorder(torch.stack(step, dim=2))  # [B, T, layers, top_k]
        return ctx()

    def _park(self) -> str | None:
        """At a step boundary: wait while paused or updating, then mark the next step as running (atomically, so a
        ``pause()`` returns only once no step runs). Returns None (not parked), or the pause mode it woke from."""
        with self._cond:
            mode = None
            if self._paused or self._updating:
                mode = self._pause_mode if self._paused else "retract"
                if mode == "abort":
                    return "abort"
                epoch, version = self._cache_epoch, self.weight_version
                self.parked += 1
                self._cond.wait_for(lambda: not (self._paused or self._updating) or self._closed)
                if self._closed:
                    return "abort"
                if mode == "in_place" and epoch != self._cache_epoch and version == self.weight_version:
                    mode = "retract"  # the cache was flushed while parked: recompute
            self._stepping = True
            return mode

    def _run(self, prompts: list[list[int]], sp: SamplingParams) -> list[Generation]:
        from miles_lp.rollout import cuda_decode  # static KV cache + CUDA graphs where they apply

        fast = cuda_decode.maybe_run(self, prompts, sp)
        if fast is not None:
            return fast
        n = len(prompts)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        stop = set(sp.stop_token_ids)
        budget = [min(sp.max_new_tokens, self.context_len - len(p)) for p in prompts]
        outs: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        routes: list[list[torch.Tensor]] = [[] for _ in range(n)]
        want_routes = sp.return_routed_experts
        active = list(range(n))  # original indices of the rows in the batch

        def prefill_recorder(r: torch.Tensor, rows=None, lens=None):
            for j, b in enumerate(rows):
                routes[b] = [r[j, r.shape[1] - lens[j]:]]

        def prefill(rows):
            seqs = [prompts[b] + outs[b] for b in rows]
            lens = [len(s) for s in seqs]
            rec = (lambda r: prefill_recorder(r, rows, lens)) if want_routes else None
            return self._prefill(seqs, rows, rec)

        self._park()  # marks the step as running
        try:
            logits, cache, mask, pos, _ = prefill(active)
        finally:
            self._set_stepping(False)
        while True:
            tokens, lp = sample(logits, sp.temperature, sp.top_k, sp.top_p, gen, sp.logprob_mode)
            tokens_l, lp_l = tokens.tolist(), lp.float().cpu().tolist()
            keep = []
            for j, b in enumerate(active):
                t = tokens_l[j]
                outs[b].append(t)
                lps[b].append(lp_l[j])
                if t in stop:
                    reasons[b] = "stop"
                elif len(outs[b]) >= budget[b]:
                    reasons[b] = "length"
                else:
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(active):
                idx = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(idx)
                mask, pos, tokens = mask[idx], pos[idx], tokens[idx]
                active = [active[j] for j in keep]
            mode = self._park()
            if mode == "abort":
                for b in active:
                    reasons[b] = "abort"
                break
            try:
                if mode == "retract":
                    logits, cache, mask, pos, _ = prefill(active)
                    continue
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                rec = None
                if want_routes:
                    def rec(r, rows=tuple(active)):
                        for j, b in enumerate(rows):
                            routes[b].append(r[j])
                with self._routing(rec, len(active), 1):
                    logits = self._forward(tokens[:, None], mask, pos, cache)
                pos = pos + 1
            finally:
                self._set_stepping(False)
        version = self.weight_version
        result = []
        for b in range(n):
            r = None
            if want_routes and routes[b]:
                r = torch.cat(routes[b], dim=0)[: len(prompts[b]) + len(outs[b]) - 1]
            result.append(Generation(outs[b], torch.tensor(lps[b], dtype=torch.float32), reasons[b] or "length",
                                     version, r))
        return result

    def _set_stepping(self, on: bool) -> None:
        with self._cond:
            self._stepping = on
            if not on:
                self._cond.notify_all()


def _input_key(layer) -> tuple:
    """What ``EngineLinear.quantize_input``'s cache keys the activation grid by."""
    return (layer.kernel_format, layer.activation_scale, layer.activation_mode, layer.op_dtype)


_E2M1: dict[tuple, torch.Tensor] = {}
_C3_RECHECK = 64  # every this many C3 graph replays, one is also run eager and compared bit for bit


def dequantize_exact(q, dtype: torch.dtype) -> torch.Tensor:
    """``q.dequantize(dtype)`` (the codecs' torch code, same ops in the same order: the same bytes), except that
    NVFP4's E2M1 decode table is made once per device and kept, not built from a Python list at each call (a
    host->device copy, which a CUDA graph capture refuses). ``tests/unit/test_rollout_self_check_graph.py``
    compares both on random codes."""
    from miles_lp.formats import NVFP4Tensor, bits
    from miles_lp.formats.spec import NVFP4_BLOCK as _BLOCK

    if not isinstance(q, NVFP4Tensor):
        return q.dequantize(dtype)
    dev = q.data.device
    table = _E2M1.get((str(dev),))
    if table is None:
        table = _E2M1[(str(dev),)] = bits.e2m1_table(dev)
    codes = bits.unpack_fp4(q.data).to(torch.int64)  # [..., K]
    vals = table[codes]
    sf = q.scale.to(torch.float32).repeat_interleave(_BLOCK, dim=-1)  # [..., K]
    return ((vals * sf) * q.global_scale).to(dtype)


def _fresh_config(layer) -> tuple:
    """The configuration a kept private copy of ``layer`` must share (``ReferenceEngine._freshly_derived``)."""
    return (layer.prefix, layer.in_features, layer.out_features, layer.disk_format, layer.target, layer.has_bias,
            layer.weight_dtype, layer.activation_scale, layer.act_dtype, layer.device_, layer.serve_format,
            layer.activation_mode)


def _freshly_derived(layer):
    """A private copy of ``layer`` whose derived kernel state is rebuilt from its canonical tensors now (its
    own storage: never a view of a stack, never the live siblings' cached input)."""
    fresh = layer.detached_copy()
    fresh.process_weights_after_loading()
    return fresh


def _strip_weight(name: str) -> str:
    """``<module>.weight`` -> ``<module>`` (a layout member's module prefix)."""
    return name[: -len(".weight")]
