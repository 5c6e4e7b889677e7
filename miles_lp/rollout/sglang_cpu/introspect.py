"""The checks answered by SGLang itself: what its model holds, read inside the SGLang process.

``SGLangIntrospection(model_runner)`` answers the ``/miles_lp/*`` questions of ``miles-lp serve`` (C1 ``quantized_params``,
C2 ``weight_digests`` / ``read_weights``, C3 ``self_check``, C4 ``storage_pointers``, ``param_specs``) from the live
``torch.nn.Module`` SGLang built and serves from, never from a config. SGLang fuses q/k/v into ``qkv_proj`` and
gate/up into ``gate_up_proj``: each canonical (checkpoint) tensor is the matching row block of the fused
parameter, a view of SGLang's own storage, so a digest or a pointer read here is of the bytes SGLang computes with.

``inject(kind, name)`` (only when the server was started with ``MILES_LP_SGLANG_FAULTS=1``): a fault written into the
live model, as a broken loader would leave it: ``perturb`` flips the bits of one element of ``name`` in place (C2
must catch it), ``double_scale`` doubles the float tensor ``name`` (a block scale) in place (C2), ``rebind`` moves the fused parameter holding ``name`` to new storage with the same values (C4 must
catch it), ``stale_layout`` rotates the rows of the derived GEMM operand of the linear holding ``name`` (a layout
derived wrong or left stale: C3 must catch it).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from miles_lp.rollout import self_check as c3
from miles_lp.rollout.engine import EngineError, tensor_digest

#: SGLang's fused parameters: fused module name -> (its checkpoint shards in row order, how their sizes are read)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
PROBE_ROWS = 4


def _shard_rows(module: torch.nn.Module, fused: str) -> list[int]:
    """Rows of each checkpoint shard in a fused weight (tensor parallel size 1: SGLang's CPU server here)."""
    if fused == "qkv_proj":
        hd = int(module.head_size)
        return [int(module.total_num_heads) * hd, int(module.total_num_kv_heads) * hd,
                int(module.total_num_kv_heads) * hd]
    return [int(s) for s in module.output_sizes]


def _rel_err(mod: torch.nn.Module, seed: int) -> float:
    """Relative Frobenius error (``self_check.rel_err``) of ``mod``'s serving GEMM on the shared probe
    (``PROBE_ROWS`` bf16 rows) vs the float64 reference."""
    from miles_lp.rollout.sglang_cpu.linear import reference_output

    x = c3.probe_inputs(seed, [mod.input_size], PROBE_ROWS)[0].to(torch.bfloat16)
    with torch.no_grad():
        got = mod.quant_method.apply(mod, x, None)
        want = reference_output(mod, x)
    return float(c3.rel_err(got, want))


class SGLangIntrospection:
    def __init__(self, owner: Any):
        """``owner``: SGLang's ``ModelRunner`` (its ``model`` read at each call) or a ``torch.nn.Module``."""
        self._owner = owner
        self.faults_allowed = os.environ.get("MILES_LP_SGLANG_FAULTS") == "1"

    @property
    def model(self) -> torch.nn.Module:
        return self._owner if isinstance(self._owner, torch.nn.Module) else self._owner.model

    # ---- the canonical view of SGLang's parameters ----------------------------------------------------------
    def views(self) -> dict[str, torch.Tensor]:
        """``{checkpoint name: a view of the live tensor}``; rebuilt per call (a rebound parameter shows)."""
        from miles_lp.rollout.sglang_cpu.linear import ALIAS

        modules = dict(self.model.named_modules())
        out: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            if hasattr(p, ALIAS):  # a second name for a tensor listed under its own (``linear.add_scale_alias``)
                continue
            mod_name, _, leaf = name.rpartition(".")
            base = mod_name.rpartition(".")[2]
            if base in FUSED and p.dim() >= 1:
                parent = mod_name.rpartition(".")[0]
                rows = _shard_rows(modules[mod_name], base)
                if p.dim() == 1 and p.shape[0] == len(FUSED[base]) != sum(rows):  # one scalar per shard (NVFP4's
                    for i, shard in enumerate(FUSED[base]):  # global and input scales): 0-d, as on disk
                        out[f"{parent}.{shard}.{leaf}"] = p.data[i]
                    continue
                rb = getattr(getattr(modules[mod_name], "quant_method", None), "row_block", 1)
                if leaf != "weight" and rb > 1 and all(n % rb == 0 for n in rows) and p.shape[0] == sum(rows) // rb:
                    rows = [n // rb for n in rows]  # one scale row per block of rows (FP8 blockwise)
                if sum(rows) != p.shape[0]:
                    raise EngineError(f"{name}: {p.shape[0]} rows, its shards {FUSED[base]} have {rows}")
                at = 0
                for shard, n in zip(FUSED[base], rows, strict=True):
                    out[f"{parent}.{shard}.{leaf}"] = p.data[at:at + n]
                    at += n
            elif p.dim() == 1 and p.shape[0] == 1 and leaf in ("weight_scale_2", "input_scale"):
                out[name] = p.data[0]  # SGLang keeps a 1-element array of a scalar the checkpoint stores 0-d
            else:
                out[name] = p.data
        return out

    def _pick(self, names: Iterable[str] | None) -> dict[str, torch.Tensor]:
        v = self.views()
        if names is None:
            return v
        names = list(names)
        return {n: v[n] for n in names if n in v}

    # ---- the answers ----------------------------------------------------------------------------------------
    def param_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in self.views().items()}

    def weight_digests(self, names: Iterable[str] | None = None) -> dict[str, str]:
        return {n: tensor_digest(t) for n, t in self._pick(names).items()}

    def read_weights(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return {n: t.detach().clone().contiguous() for n, t in self._pick(names).items()}

    def storage_pointers(self) -> dict[str, int]:
        return {n: int(t.data_ptr()) for n, t in self.views().items()}

    def quantized_params(self) -> dict[str, str]:
        """C1: ``{checkpoint weight name: format}`` of every linear whose live quant method is not SGLang's
        unquantized one, read from the module (``quant_method`` and the weight's dtype)."""
        from miles_lp.rollout.sglang_cpu.linear import live_format

        modules = dict(self.model.named_modules())
        out: dict[str, str] = {}
        for name, mod in modules.items():
            fmt = live_format(mod)
            if fmt is None:
                continue
            base, parent = name.rpartition(".")[2], name.rpartition(".")[0]
            for shard in FUSED.get(base, (base,)):
                out[f"{parent}.{shard}.weight" if base in FUSED else f"{name}.weight"] = fmt
        return out

    def self_check(self, seed: int = 0) -> dict[str, Any]:
        """C3: the first quantized dense linear and one rotating through the others (the next one at each call: each
        within as many syncs as there are linears) through SGLang's serving ``quant_method.apply`` on the shared
        probe (``miles_lp.rollout.self_check``) vs a float64 GEMM on its weights decoded afresh
        (``linear.reference_output``)."""
        from miles_lp.rollout.sglang_cpu.linear import live_format

        out: dict[str, Any] = {"tolerance": c3.TOLERANCE, "layers": {}, "skipped": []}
        linears = [(n, m, f) for n, m in self.model.named_modules()
                   if (f := live_format(m)) is not None and ".experts" not in n]
        calls = self.__dict__.get("_c3_calls", 0)
        self._c3_calls = calls + 1
        picks = [("dense", linears[0])] if linears else []
        if len(linears) > 1:
            picks.append(("rotating", linears[1 + calls % (len(linears) - 1)]))
        for kind, (name, mod, fmt) in picks:
            out["layers"][f"{name}.weight"] = {"kind": kind, "format": fmt, "rel_err": _rel_err(mod, seed)}
        if not out["layers"]:
            out["reason"] = "SGLang's model holds no quantized linear (every linear serves BF16)"
        out["ok"] = c3.passes(out["layers"].values())
        return out

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "backend": "sglang", "introspection": "in the SGLang scheduler process"}

    # ---- fault injection (tests, selftest) ------------------------------------------------------------------
    def inject(self, kind: str, name: str) -> dict[str, Any]:
        if not self.faults_allowed:
            raise EngineError("fault injection is off (start the server with MILES_LP_SGLANG_FAULTS=1)")
        views = self.views()
        if name not in views:
            raise EngineError(f"no served tensor '{name}'")
        if kind == "perturb":
            flat = views[name].view(-1)
            raw = flat[:1].view(torch.uint8)
            raw.copy_(raw ^ 0x40)  # the exponent's top bits of one element: far off the learner's grid
            return {"injected": kind, "name": name}
        if kind == "double_scale":  # a float tensor (a block scale) doubled in place
            if not views[name].is_floating_point() or views[name].element_size() < 2:
                raise EngineError(f"'{name}' is not a float tensor ({views[name].dtype}): cannot double it")
            views[name].mul_(2)
            return {"injected": kind, "name": name}
        if kind == "stale_layout":  # the derived GEMM operand of the linear holding ``name``, rows rotated
            mod = self._module_of(views[name])
            op = getattr(mod, "miles_lp_operand", None)
            if op is None:
                raise EngineError(f"'{name}' is not served by miles-lp's CPU linear method: no derived operand")
            op.copy_(op.roll(1, dims=0))
            return {"injected": kind, "name": name}
        if kind == "rebind":
            for pname, p in self.model.named_parameters():
                if views[name].untyped_storage().data_ptr() == p.data.untyped_storage().data_ptr():
                    p.data = p.data.clone()  # same values, new storage: the kernels' captured pointer goes stale
                    return {"injected": kind, "name": name, "parameter": pname}
        raise EngineError(f"unknown fault kind {kind!r} (perturb | rebind | stale_layout)")

    def _module_of(self, view: torch.Tensor) -> torch.nn.Module:
        ptr = view.untyped_storage().data_ptr()
        for mod in self.model.modules():
            w = mod._parameters.get("weight")
            if w is not None and w.untyped_storage().data_ptr() == ptr:
                return mod
        raise EngineError("no module holds that tensor")
