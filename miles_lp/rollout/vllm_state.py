"""What a live vLLM model holds, in the checkpoint's own names: the sync checks C2/C3/C4 inside the engine process.

Runs in the vLLM engine process (``miles_lp.rollout.vllm_worker``, the vLLM venv's torch); imports no vllm at
module level so the pure parts are testable anywhere.

Why a capture hook (C2): vLLM fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``, and its
``process_weights_after_loading`` transforms quantized weights (MXFP8 emulation: the E4M3 weight is replaced by
its BF16 dequantization; NVFP4: scales swizzled, one global scale per fused module; CPU BF16 linears may be
repacked). The canonical bytes exist in the engine only between vLLM's weight loaders writing them into the
(fused) parameters and ``process_weights_after_loading``. ``Canonical.install`` wraps every module's
``quant_method.process_weights_after_loading`` so each load / reload copies the parameters at exactly that
point, split back into the checkpoint's tensors (``q_proj.weight`` = rows of ``qkv_proj.weight``). Those are the
bytes vLLM's loaders put where vLLM reads them, not what we sent: a loader that skips or misplaces a name shows
up. Parameters no quant method transforms (norms) are digested live.

What each check compares (``docs/rollout.md``):

* C2 ``parts`` (digested and fingerprinted by ``vllm_worker.Ranks`` after ``merge_parts``): the captured canonical
  tensors (quantized and BF16 linears, embeddings: loaded bytes before post-processing) and the live parameters
  otherwise (norms), vs the learner's export.
* C3 ``self_check``: a quantized linear's serving ``quant_method.apply`` on random BF16 input vs a float64 GEMM
  of the captured canonical weights dequantized here (relative error), plus ``fresh_diff``: the tensor the
  serving kernel reads vs vLLM's own transformation re-applied to the captured canonical bytes (MXFP8
  dequant-at-load: ``dequant_mxfp8_to_bf16``; NVFP4 on the emulation kernel: one global weight / input scale
  per fused module, their inverse and ``alpha``; 0 when the derived state was rebuilt from the synced bytes).
  Every sync: the first and last quantized linear, plus one more (``kind: "rotating"``) that rotates by weight
  version through ``rotation_order`` (every quantized linear, interleaved across projection families), so a
  stale layer anywhere fails within ``len(rotation)`` syncs; on the full-compare syncs ``every_layer`` probes
  all of them at once (the reference engine's ``_c3_rotating`` / ``self_check_every_layer``). The probe inputs,
  the figures, the float64 decodes and the rotation rule are the shared ones (``miles_lp.rollout.self_check``).
* C4 ``pointers``: ``data_ptr()`` of every parameter of every module with a quant method.

Tensor parallelism (``rollout.engine_tp`` N): each TP rank is a vLLM worker process with its own ``STATE``,
capturing its own shard (fused rows split by ``output_partition_sizes``). The ``collective_rpc`` targets at the end
of this module run in every rank; the engine process merges their answers: C2 reassembles each checkpoint tensor
from the ranks' shards byte-exactly (``assemble``; no per-shard compare, so the learner side is unchanged), C3
takes the worst rank's figures per module, C4 and C1 cover every rank.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from miles_lp.formats.schemes import scheme_for
from miles_lp.formats.spec import Format
from miles_lp.rollout import self_check as c3
from miles_lp.rollout.self_check import family

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fmt_of(classes: Iterable[str]) -> str | None:
    n = " ".join(classes).lower()
    if "fp8block" in n:
        return "fp8_block"
    if "mxfp8" in n:
        return "mxfp8"
    if "nvfp4" in n or "fp4" in n:
        return "nvfp4"
    return None


def serving_kernel(qm: Any, scheme: Any) -> Any:
    """The linear kernel a module's quant method serves through: a compressed-tensors scheme's ``kernel``, a
    ModelOpt method's ``kernel``, ``Fp8LinearMethod``'s ``fp8_linear`` (FP8 per-tensor and blockwise); or None."""
    return getattr(scheme, "kernel", None) or getattr(qm, "kernel", None) or getattr(qm, "fp8_linear", None)


def split_fused(module: str, param: str, t: torch.Tensor, sizes: list[int] | None,
                row_block: int = 1) -> dict[str, torch.Tensor]:
    """A (possibly fused) module parameter -> ``{checkpoint name: tensor}``.

    Fused modules: rows split by the shards' output sizes (weights, block scales; FP8 blockwise scales
    (``row_block`` 128) one row per ``row_block`` rows of a shard that is whole blocks); a per-shard vector of
    length #shards (vLLM's per-tensor scales before post-processing) element by element; anything else is one
    value shared by every shard."""
    prefix, _, leaf = module.rpartition(".")
    shards = FUSED.get(leaf)
    if shards is None or not sizes:
        return {f"{module}.{param}": t}
    if (row_block > 1 and param != "weight" and t.ndim == 2 and all(n % row_block == 0 for n in sizes)
            and t.shape[0] == sum(sizes) // row_block):
        sizes = [n // row_block for n in sizes]
    if t.ndim >= 1 and t.shape[0] == sum(sizes):
        out, start = {}, 0
        for s, n in zip(shards, sizes, strict=True):
            out[f"{prefix}.{s}.{param}"] = t[start:start + n]
            start += n
        return out
    if t.ndim == 1 and t.shape[0] == len(shards):
        return {f"{prefix}.{s}.{param}": t[i].reshape(()) for i, s in enumerate(shards)}
    return {f"{prefix}.{s}.{param}": t.reshape(()) if t.numel() == 1 else t for s in shards}


def decode_fp8_block_f64(w: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    """E4M3 ``w`` ``[N, K]`` times its fp32 ``scale_inv`` per ``block x block`` tile, in float64."""
    n, k = w.shape
    s = scale_inv.double().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return w.double() * s


def rotation_order(mods: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Every quantized ``(module, format)`` once, interleaved across projection families
    (``self_check.rotation_order``: the reference engine's ``_c3_rotation`` rule on vLLM's module names)."""
    return c3.rotation_order(mods, lambda m: family(m[0]))


class Canonical:
    """The capture hook and the per-check answers for one live vLLM model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.modules = dict(model.named_modules())
        self.tensors: dict[str, torch.Tensor] = {}  # checkpoint name -> copy taken before post-processing
        self.captures = 0
        self.faults: dict[str, list[str]] = {}
        self.rank = 0  # this process's tensor-parallel rank
        #: the checkpoint's tensor shapes: vLLM holds a per-tensor scale as ``[1]`` where the file has ``[]``
        self.shapes: dict[str, tuple[int, ...]] = {}
        #: checkpoint name -> how many consecutive TP ranks hold the same shard (KV heads fewer than ranks)
        self.replicas: dict[str, int] = {}

    # ---- the hook ---------------------------------------------------------------------------------------
    def install(self) -> int:
        by_id = {id(m): n for n, m in self.modules.items()}
        done = set()
        for mod in self.modules.values():
            qm = getattr(mod, "quant_method", None)
            if qm is None or not hasattr(qm, "process_weights_after_loading") or id(qm) in done:
                continue
            done.add(id(qm))
            orig = qm.process_weights_after_loading

            def wrapped(layer, *a, _orig=orig, **k):
                n = by_id.get(id(layer))
                if n is not None:
                    self.capture(n, layer)
                return _orig(layer, *a, **k)

            qm.process_weights_after_loading = wrapped
        return len(done)

    def capture(self, name: str, layer: torch.nn.Module) -> None:
        # this rank's rows of a fused module (``output_partition_sizes``; = ``output_sizes`` at tp 1)
        sizes = getattr(layer, "output_partition_sizes", None) or getattr(layer, "output_sizes", None)
        block = getattr(layer, "weight_block_size", None)
        kv_replicas = int(getattr(layer, "num_kv_head_replicas", 1) or 1)
        for p, t in layer.named_parameters(recurse=False):
            for cname, part in split_fused(name, p, t.detach(), sizes, int(block[0]) if block else 1).items():
                want = self.shapes.get(cname)
                if want is not None and tuple(part.shape) != want and part.numel() == math.prod(want):
                    part = part.reshape(want)  # same bytes, the checkpoint's shape
                self.tensors[cname] = part.clone()
                if kv_replicas > 1 and cname.rsplit(".", 2)[-2] in ("k_proj", "v_proj"):
                    self.replicas[cname] = kv_replicas  # one KV head held by that many consecutive ranks
        self.captures += 1

    # ---- C2 ---------------------------------------------------------------------------------------------
    def tensor(self, name: str) -> torch.Tensor | None:
        """The canonical tensor ``name``: captured before post-processing, else the live parameter."""
        if name in self.tensors:
            return self.tensors[name]
        try:
            return self.model.get_parameter(name).detach()
        except AttributeError:
            return None

    def capture_count(self) -> int:
        return self.captures

    def parts(self, names: Iterable[str]) -> dict[str, tuple[torch.Tensor | None, int]]:
        """This rank's copy of each tensor (``tensor``: its TP shard, or the whole tensor where every rank holds it;
        None where absent) and how many consecutive ranks hold that same shard (``replicas``)."""
        return {n: (self.tensor(n), self.replicas.get(n, 1)) for n in names}

    def set_faults(self, faults: Mapping[str, list]) -> None:
        """Fault injection (tests): ``ranks`` (optional) limits the faults to those TP ranks."""
        ranks = faults.get("ranks")
        self.faults = ({k: list(v) for k, v in faults.items() if k != "ranks"}
                       if ranks is None or self.rank in ranks else {})

    def sources(self, names: Iterable[str]) -> dict[str, str]:
        return {n: ("loaded, before process_weights_after_loading" if n in self.tensors else
                    "live parameter" if self.tensor(n) is not None else "absent") for n in names}

    # ---- C4 ---------------------------------------------------------------------------------------------
    def pointers(self) -> dict[str, int]:
        out = {}
        for name, mod in self.modules.items():
            if getattr(mod, "quant_method", None) is None:
                continue
            for p, t in mod.named_parameters(recurse=False):
                out[f"{name}.{p}"] = t.data_ptr()
        return out

    # ---- C3 ---------------------------------------------------------------------------------------------
    def quantized_modules(self) -> list[tuple[str, str]]:
        out = []
        for name, mod in self.modules.items():
            qm = getattr(mod, "quant_method", None)
            if qm is None or not hasattr(mod, "weight"):
                continue
            scheme = getattr(mod, "scheme", None)
            kernel = serving_kernel(qm, scheme)
            f = fmt_of(type(x).__name__ for x in (qm, scheme, kernel) if x is not None)
            if f is not None:
                out.append((name, f))
        return out

    def _shards(self, name: str) -> list[str]:
        """The checkpoint modules a (possibly fused) vLLM module holds, in row order."""
        prefix, _, leaf = name.rpartition(".")
        if leaf in FUSED and getattr(self.modules[name], "output_sizes", None):
            return [f"{prefix}.{s}" for s in FUSED[leaf]]
        return [name]

    def _dequant(self, name: str, fmt: str) -> torch.Tensor:
        parts = []
        for s in self._shards(name):
            t = self.tensors
            if fmt == "mxfp8":
                parts.append(c3.decode_mxfp8_f64(t[f"{s}.weight"], t[f"{s}.weight_scale"]))
            elif fmt == "fp8_block":
                parts.append(decode_fp8_block_f64(t[f"{s}.weight"], t[f"{s}.weight_scale_inv"]))
            else:
                parts.append(c3.decode_nvfp4_f64(t[f"{s}.weight"], t[f"{s}.weight_scale"], t[f"{s}.weight_scale_2"]))
        return torch.cat(parts, dim=0)

    def probe(self, name: str, fmt: str, x: torch.Tensor, kind: str) -> dict[str, Any]:
        """One quantized module: its serving ``quant_method.apply`` on ``x`` vs a float64 GEMM of its captured
        canonical weights (``rel_err``), and ``fresh_diff`` (MXFP8: the served BF16 operand vs the captured bytes
        dequantized again; NVFP4 on vLLM's emulation kernel: ``_nvfp4_fresh_diff``): exactly 0 when
        post-processing ran on the synced bytes. ``x``: bf16, its width
        the module's input features."""
        mod = self.modules[name]
        try:
            w64 = self._dequant(name, fmt)
        except KeyError as exc:
            return {"rel_err": float("inf"), "kind": kind, "format": fmt,
                    "reason": f"no captured canonical tensor {exc}"}
        with torch.no_grad():
            x = x.to(w64.device)  # drawn on the CPU (the same probe on any device), served where the module lives
            y = mod.quant_method.apply(mod, x, None)
            ref = c3.reference_gemm(x, w64)
            entry: dict[str, Any] = {"rel_err": float(c3.rel_err(y, ref)), "kind": kind, "format": fmt}
            served = mod.weight.detach()
            if fmt == "mxfp8" and served.dtype == torch.bfloat16 and tuple(served.shape) == tuple(w64.shape):
                fresh = w64.to(torch.float32).to(torch.bfloat16)  # exact: E4M3 x 2^k is a bf16 value
                entry["fresh_diff"] = float((served.to(torch.float32) - fresh.to(torch.float32)).abs().max())
            elif fmt == "fp8_block" and getattr(mod, "miles_lp_operand", None) is not None:
                op = mod.miles_lp_operand  # the emulation kernel's operand vs the captured bytes decoded again
                if tuple(op.shape) == tuple(w64.shape):
                    entry["fresh_diff"] = float((op.double() - w64.to(op.dtype).double()).abs().max())
            elif fmt == "nvfp4":
                d = self._nvfp4_fresh_diff(name, mod)
                if d is not None:
                    entry["fresh_diff"] = d
        return entry

    def _nvfp4_fresh_diff(self, name: str, mod: torch.nn.Module) -> float | None:
        """NVFP4 on vLLM's emulation kernel (``EmulationNvFp4LinearKernel``): its post-processing keeps the packed
        weight and the E4M3 block scales as loaded (fused rows concatenated, not swizzled: the kernel is called with
        ``swizzle=False``) and derives ``weight_global_scale = max(weight_scale_2)``, ``input_global_scale =
        max(input_scale)``, its inverse and ``alpha`` (their product) over the fused shards. Re-derived here from
        the captured canonical tensors: the max difference of the operand the kernel dequantizes (own decode) and
        of the derived scalars, exactly 0 when post-processing ran on the synced bytes. None where the serving
        layout is another kernel's (GPU kernels swizzle and pad the scales) or a tensor is missing."""
        qm = mod.quant_method
        kernel = getattr(getattr(mod, "scheme", None), "kernel", None) or getattr(qm, "kernel", None)
        if kernel is None or type(kernel).__name__ != "EmulationNvFp4LinearKernel":
            return None
        t, shards = self.tensors, self._shards(name)
        try:
            w = torch.cat([t[f"{s}.weight"] for s in shards])
            sc = torch.cat([t[f"{s}.weight_scale"] for s in shards])
            wgs = torch.stack([t[f"{s}.weight_scale_2"].reshape(()) for s in shards]).max().to(torch.float32)
            igs = torch.stack([t[f"{s}.input_scale"].reshape(()) for s in shards]).max().to(torch.float32)
        except KeyError:
            return None
        got = {k: getattr(mod, k, None) for k in ("weight", "weight_scale", "weight_global_scale")}
        if any(v is None for v in got.values()) or got["weight"].shape != w.shape or got["weight_scale"].shape != sc.shape:
            return None
        served = c3.decode_nvfp4_f64(got["weight"].detach(), got["weight_scale"].detach(), got["weight_global_scale"])
        diffs = [float((served - c3.decode_nvfp4_f64(w, sc, wgs)).abs().max())]
        fresh = {"input_global_scale": igs, "input_global_scale_inv": (1.0 / igs).to(torch.float32),
                 "alpha": igs * wgs}
        for k, v in fresh.items():
            live = getattr(mod, k, None)
            if live is not None:
                diffs.append(float((live.detach().to(torch.float64).reshape(()) - v.to(torch.float64)).abs()))
        return max(diffs)

    def _in_features(self, name: str, fmt: str) -> int | None:
        """The module's input width from its captured canonical weight (its scheme's on-disk rule: a ``packed``
        weight, NVFP4's, holds two values a byte)."""
        w = self.tensors.get(f"{self._shards(name)[0]}.weight")
        if w is None:
            return None
        part = next(p for p in scheme_for(Format(fmt)).parts("vllm") if p.suffix == "weight")
        return int(w.shape[1]) * (2 if part.shape == "packed" else 1)

    def _rot_probe(self, name: str, fmt: str, seed: int, tokens: int, kind: str) -> dict[str, Any]:
        """``probe`` on the rotating / every-layer input: seeded by ``seed + 1`` (independent of the fixed pair's
        draws, so their figures do not move) and the same for a module at every sync."""
        width = self._in_features(name, fmt)
        if width is None:
            return {"rel_err": float("inf"), "kind": kind, "format": fmt,
                    "reason": f"no captured canonical tensor for {name}"}
        x = c3.rotating_input(seed, width, tokens).to(torch.bfloat16)
        return self.probe(name, fmt, x, kind)

    def self_check(self, seed: int = 0, tokens: int = 8, version: int | None = None) -> dict[str, Any]:
        """The first and the last quantized linear (``kind: "dense"``): serving ``apply`` on random input vs float64
        of the captured canonical weights; ``fresh_diff`` where vLLM's derived state can be re-derived here
        (MXFP8; NVFP4 on the emulation kernel). With ``version`` (the engine's weight version), one more: ``rotation_order()[version % len]``
        (``kind: "rotating"``; none when that one is of the fixed pair). Keys: ``<vLLM module>.weight``."""
        mods = self.quantized_modules()
        if not mods:
            return {"layers": {}, "reason": "the live model has no quantized linear module"}
        pick = [mods[0]] + ([mods[-1]] if len(mods) > 1 else [])
        widths = {m: self._in_features(*m) for m in pick}
        # one generator for the pair, drawn in this order (their figures as before)
        xs = iter(c3.probe_inputs(seed, [w for w in widths.values() if w is not None], tokens))
        layers = {}
        for name, fmt in pick:
            if widths[(name, fmt)] is None:
                layers[f"{name}.weight"] = {"rel_err": float("inf"), "kind": "dense", "format": fmt,
                                            "reason": f"no captured canonical tensor for {name}"}
                continue
            layers[f"{name}.weight"] = self.probe(name, fmt, next(xs).to(torch.bfloat16), "dense")
        out: dict[str, Any] = {"layers": layers, "what": "serving quant_method.apply on random bf16 input vs a "
                               "float64 GEMM of the canonical weights captured before process_weights_after_loading"}
        if version is not None:
            rot = rotation_order(mods)
            i = int(version) % len(rot)
            name, fmt = rot[i]
            out["rotation"] = {"position": i, "length": len(rot), "module": name}
            if (name, fmt) not in pick:
                layers[f"{name}.weight"] = self._rot_probe(name, fmt, seed, tokens, "rotating")
        return out

    def every_layer(self, seed: int = 0, tokens: int = 8) -> dict[str, dict[str, Any]]:
        """C3 over every quantized linear (``kind: "every"``), the rotating probe's input and figures for each:
        ``{<vLLM module>.weight: {"rel_err", "fresh_diff" (where re-derivable), "kind", "format"}}``. For the full-compare
        syncs (the initial one, after a restart): a stale module anywhere fails at once."""
        return {f"{name}.weight": self._rot_probe(name, fmt, seed, tokens, "every")
                for name, fmt in rotation_order(self.quantized_modules())}

    # ---- faults (fault-injection tests only) -------------------------------------------------------------
    def matching_modules(self, key: str) -> list[str]:
        pats = self.faults.get(key) or []
        return [n for n in self.modules if any(fnmatch.fnmatchcase(n, p) for p in pats)]

    def filter_update(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        pats = self.faults.get("drop") or []
        return {n: t for n, t in tensors.items() if not any(fnmatch.fnmatchcase(n, p) for p in pats)}

    def snapshot_stale(self) -> dict[str, dict[str, torch.Tensor]]:
        # parameters and buffers (the FP8 blockwise emulation kernel's operand is a buffer)
        return {n: {p: t.detach().clone() for p, t in [*self.modules[n].named_parameters(recurse=False),
                                                       *self.modules[n].named_buffers(recurse=False)]}
                for n in self.matching_modules("stale")}

    def restore_stale(self, snap: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Fault: the derived (served) state of these modules is left as before the update, in place."""
        with torch.no_grad():
            for n, params in snap.items():
                for p, old in params.items():
                    getattr(self.modules[n], p).data.copy_(old)

    def rebind(self) -> None:
        """Fault: these modules' parameters re-bound to fresh copies (later loads land where nothing reads)."""
        for n in self.matching_modules("rebind"):
            mod = self.modules[n]
            for p, t in list(mod.named_parameters(recurse=False)):
                new = torch.nn.Parameter(t.detach().clone(), requires_grad=False)
                for attr, val in vars(t).items():  # vLLM's weight_loader and friends live on the Parameter
                    setattr(new, attr, val)
                setattr(mod, p, new)


#: the engine process's one ``Canonical`` (set by ``attach``, run through ``LLM.apply_model`` in-process)
STATE: Canonical | None = None


def attach(model: torch.nn.Module) -> int:
    """``apply_model`` target: build the process's ``Canonical`` for the live model and install the hook."""
    global STATE
    STATE = Canonical(model)
    return STATE.install()


# ---- tensor-parallel ranks ----------------------------------------------------------------------------------------
# At ``tensor_parallel_size`` N each TP rank is its own process holding its shard of the model and its own
# ``STATE``. The functions below taking ``worker`` are ``collective_rpc`` targets (module-level: vLLM's multiproc
# executor sends them by reference), run in every rank; at tp 1 (executor ``uni``) they run in the engine process.
# The ``merge_*`` functions run in the engine process on the per-rank answers, in rank order.

def introspect(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """``apply_model`` target (C1 / C4 introspection): per linear module its quant method / scheme / kernel class
    names, the format they imply, and its parameters' dtypes, shapes and data pointers (this rank's)."""
    out = {}
    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if qm is None or not hasattr(mod, "weight"):
            continue
        scheme = getattr(mod, "scheme", None)
        kernel = serving_kernel(qm, scheme)
        classes = [type(x).__name__ for x in (qm, scheme, kernel) if x is not None]
        params = {k: [str(v.dtype).removeprefix("torch."), list(v.shape), v.data_ptr()]
                  for k, v in mod.named_parameters(recurse=False)}
        out[name] = {"classes": classes, "format": fmt_of(classes), "params": params}
    return out


def attach_rank(worker) -> int:
    """``collective_rpc`` target: this rank's ``Canonical`` for its live model, the capture hook installed."""
    global STATE
    STATE = Canonical(worker.get_model())
    try:
        from vllm.distributed.parallel_state import get_tp_group

        STATE.rank = int(get_tp_group().rank_in_group)
    except (ImportError, AssertionError):  # no TP group (not started by vLLM)
        STATE.rank = 0
    return STATE.install()


def on_rank(worker, method: str, *args: Any, **kwargs: Any) -> Any:
    """``collective_rpc`` target: ``STATE.<method>(*args, **kwargs)`` in this rank's process."""
    return getattr(STATE, method)(*args, **kwargs)


def set_shapes(worker, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """``collective_rpc`` target: the checkpoint's tensor shapes, before the first capture."""
    STATE.shapes = {n: tuple(s) for n, s in shapes.items()}


def reload_on_rank(worker, tensors: Mapping[str, torch.Tensor]) -> bool:
    """``collective_rpc`` target: the checkpoint-format reload (post-processing included) of the given whole
    checkpoint tensors in this rank; vLLM's weight loaders keep the rank's own shard. The fault hooks of the
    fault-injection tests around it (all off unless set)."""
    st = STATE
    tensors = st.filter_update(tensors)
    snap = st.snapshot_stale()
    worker.reload_weights(weights_iterator=iter(list(tensors.items())), is_checkpoint_format=True)
    st.restore_stale(snap)
    st.rebind()
    return True


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (dtype and shape included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def assemble(parts: list[tuple[torch.Tensor | None, int]],
             shape: tuple[int, ...] | None) -> tuple[torch.Tensor | None, str | None]:
    """One checkpoint tensor from every TP rank's copy (``Canonical.parts``, in rank order) -> ``(tensor, None)``,
    ``(None, None)`` where no rank holds it, or ``(None, why)`` where the ranks' copies do not make one tensor.

    Exact, no tolerance: the shards (one per group of ``replicas`` consecutive ranks, which must hold identical
    bytes: KV heads fewer than ranks) are concatenated in rank order along the one dimension where a shard's
    shape differs from the checkpoint's ``shape`` (column-parallel rows, row-parallel columns, vocab rows; the
    vocabulary's padding rows at the end are dropped). A tensor whose every shard has the checkpoint's shape is
    held whole by every rank (norms, per-tensor scales, a row-parallel bias): every rank's bytes must be equal."""
    if len(parts) == 1:
        return parts[0][0], None
    ts = [t for t, _ in parts]
    absent = [r for r, t in enumerate(ts) if t is None]
    if len(absent) == len(ts):
        return None, None
    if absent:
        return None, f"absent on TP rank(s) {absent}"
    reps = max(1, int(parts[0][1]))
    if len(ts) % reps:
        return None, f"{reps} replicas per shard do not divide {len(ts)} TP ranks"
    for g in range(0, len(ts), reps):
        for r in range(g + 1, g + reps):
            if not _same(ts[r], ts[g]):
                return None, f"TP ranks {g} and {r} hold the same shard with different bytes"
    shards = ts[::reps]
    if shape is None or all(tuple(t.shape) == tuple(shape) for t in shards):
        for r, t in enumerate(shards[1:], 1):
            if not _same(t, shards[0]):
                return None, f"held whole by every TP rank, but rank {r * reps} differs from rank 0"
        return shards[0], None
    dims = [d for d in range(len(shape)) if shards[0].ndim == len(shape) and shards[0].shape[d] != shape[d]]
    if len(dims) != 1 or any(tuple(t.shape) != tuple(shards[0].shape) for t in shards):
        return None, (f"shards {[list(t.shape) for t in shards]} do not cut the checkpoint's {list(shape)} "
                      "along one dimension")
    d = dims[0]
    full = torch.cat(shards, dim=d)
    if full.shape[d] < shape[d]:
        return None, f"shards {[list(t.shape) for t in shards]} cover {full.shape[d]} of {shape[d]} along dim {d}"
    return full.narrow(d, 0, shape[d]), None


def merge_parts(per_rank: list[Mapping[str, tuple[torch.Tensor | None, int]]], names: Iterable[str],
                shapes: Mapping[str, tuple[int, ...]]) -> tuple[dict[str, torch.Tensor | None], dict[str, str]]:
    """``assemble`` for each name: ``({name: tensor or None}, {name: why the ranks disagree})``."""
    got: dict[str, torch.Tensor | None] = {}
    bad: dict[str, str] = {}
    for n in names:
        t, why = assemble([r[n] for r in per_rank], shapes.get(n))
        got[n] = t
        if why is not None:
            bad[n] = why
    return got, bad


def merge_pointers(per_rank: list[Mapping[str, int]]) -> dict[str, int]:
    """C4 over every rank: rank 0's names as they are, rank r's as ``<name>@tp<r>`` (each rank's own addresses)."""
    out = dict(per_rank[0])
    for r, ptrs in enumerate(per_rank[1:], 1):
        out.update({f"{n}@tp{r}": p for n, p in ptrs.items()})
    return out


def merge_layers(per_rank: list[Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """C3 figures over every rank, per module: each rank probes its own shard (its serving ``apply`` vs a float64
    GEMM of its captured shard); the module's entry is the worst rank's ``rel_err`` and ``fresh_diff``, any rank's
    ``reason``, and ``tp_ranks``. A module missing on some rank gets ``rel_err`` inf."""
    if len(per_rank) == 1:
        return {k: dict(v) for k, v in per_rank[0].items()}
    out: dict[str, dict[str, Any]] = {}
    for key in dict.fromkeys(k for r in per_rank for k in r):
        entries = [r.get(key) for r in per_rank]
        first = next(e for e in entries if e is not None)
        e = dict(first)
        e["tp_ranks"] = len(per_rank)
        if any(x is None for x in entries):
            e["rel_err"] = float("inf")
            e["reason"] = f"not probed on TP rank(s) {[i for i, x in enumerate(entries) if x is None]}"
            out[key] = e
            continue
        e["rel_err"] = max(float(x["rel_err"]) for x in entries)
        if any("fresh_diff" in x for x in entries):
            e["fresh_diff"] = max(float(x.get("fresh_diff", float("inf"))) for x in entries)
        reasons = [f"TP rank {i}: {x['reason']}" for i, x in enumerate(entries) if x.get("reason")]
        if reasons:
            e["reason"] = "; ".join(reasons)
        out[key] = e
    return out


def merge_self_check(per_rank: list[Mapping[str, Any]]) -> dict[str, Any]:
    """``Canonical.self_check`` over every rank: rank 0's answer with ``layers`` merged (``merge_layers``)."""
    out = dict(per_rank[0])
    out["layers"] = merge_layers([r.get("layers") or {} for r in per_rank])
    if len(per_rank) > 1:
        out["tp_ranks"] = len(per_rank)
    return out


def merge_introspection(per_rank: list[Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """C1 over every rank: rank 0's per-module answer; where another rank serves a module through other classes or
    another format (or not at all), the module's ``format`` says so (and matches no plan's format)."""
    out = {k: dict(v) for k, v in per_rank[0].items()}
    for r, layers in enumerate(per_rank[1:], 1):
        for name in dict.fromkeys([*out, *layers]):
            mine, theirs = out.get(name), layers.get(name)
            if mine is None or theirs is None or (mine["classes"], mine["format"]) != (theirs["classes"], theirs["format"]):
                base = dict(mine or theirs)
                base["format"] = (f"TP ranks differ: rank 0 {None if mine is None else mine['format']}, rank {r} "
                                  f"{None if theirs is None else theirs['format']}")
                out[name] = base
    return out
