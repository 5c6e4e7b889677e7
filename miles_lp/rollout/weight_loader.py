"""The custom weight loader for SGLang's ``--custom-weight-loader`` (CONTRACT 5 and 10).

SGLang calls a registered loader as ``fn(model, named_tensors)`` in every TP worker when an update is sent with
``load_format="miles_lp.rollout.weight_loader.load_weights"``. Its tensor path otherwise runs
``model.load_weights`` only, and serving kernels that derive layouts at load (FlashInfer / DeepGEMM MXFP8:
``weight_scale_inv_swizzled`` / ``_deepgemm``; shuffled or interleaved experts) keep serving the old derived
state, silently. This loader:

1. captures every tensor attribute of every quantized module (``quant_method`` with
   ``process_weights_after_loading``, or a module with its own ``process_weights_after_loading``: the reference
   engine's layers) with its data pointer and version counter;
2. loads (``model.load_weights`` or the ``load=`` callable);
3. finds the touched modules: the owner of each loaded name (``<module>.<param>``, with SGLang's stacked names:
   ``q/k/v_proj`` -> ``qkv_proj``, ``gate/up_proj`` -> ``gate_up_proj``, ``experts.{e}.*`` -> ``experts``), plus
   any module whose tensors were re-bound or written through autograd-visible ops (version counter moved;
   SGLang's ``param.data.copy_`` does not move it, hence the names);
4. refuses backends whose post-processing is not idempotent (it transforms the canonical tensors in place, so
   running it again on already-processed tensors is wrong): the known names in ``NON_IDEMPOTENT``, and any
   module whose canonical tensors the post-processing changed (checked after the run);
5. re-runs the post-processing on each touched module, then copies every re-bound tensor back into the storage
   captured in step 1 (the storage CUDA graphs captured) and puts the captured tensor back on the module;
6. asserts that no captured data pointer moved (``EngineError`` otherwise: a shape or dtype change cannot be
   copied back).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from miles_lp.rollout.engine import EngineError

#: post-processing backends known to rewrite their canonical tensors in place (verl's refit loader refuses the
#: first; TRT-LLM MoE paths shuffle / interleave expert weights in place)
NON_IDEMPOTENT = ("flashinfer_trtllm", "trtllm")


def _post_process(module: torch.nn.Module) -> Callable[[], None] | None:
    qm = getattr(module, "quant_method", None)
    if qm is not None and callable(getattr(qm, "process_weights_after_loading", None)):
        return lambda: qm.process_weights_after_loading(module)
    own = getattr(module, "process_weights_after_loading", None)
    if callable(own):
        return own
    return None


def _backend_name(module: torch.nn.Module) -> str:
    qm = getattr(module, "quant_method", None)
    parts = [type(qm).__name__ if qm is not None else ""]
    for obj in (qm, module):
        for attr in ("backend", "moe_runner_backend", "kernel_backend"):
            v = getattr(obj, attr, None)
            if v is not None:
                parts.append(str(getattr(v, "value", v)))
    return " ".join(parts).lower()


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = dict(module.named_parameters(recurse=False))
    out.update(module.named_buffers(recurse=False))
    for k, v in vars(module).items():  # plain tensor attributes (some kernels keep their layouts there)
        if isinstance(v, torch.Tensor) and not k.startswith("_") and k not in out:
            out[k] = v
    return out


STACKED = ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
           (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj"))


def _owners(name: str, known: set[str]) -> list[str]:
    import re

    prefix = name.rpartition(".")[0]
    cands = [prefix]
    cands += [prefix[: -len(a)] + b for a, b in STACKED if prefix.endswith(a)]
    m = re.fullmatch(r"(.*\.experts)\.\d+\.(gate|up|down)_proj", prefix)
    if m:
        cands.append(m.group(1))
    return [c for c in cands if c in known]


def load_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                 load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] | None = None) -> dict[str, Any]:
    """Load ``named_tensors`` into ``model``, re-run the touched modules' post-processing, keep their storage.

    Returns ``{"touched": [module names], "copied_back": [module.attr], "pointers_checked": n}``.
    """
    modules = [(name, m, fn) for name, m in model.named_modules() if (fn := _post_process(m)) is not None]
    captured = {name: {a: (t, t.data_ptr(), t._version) for a, t in _tensors(m).items()} for name, m, _ in modules}
    names: list[str] = []

    def recorded():
        for n, t in named_tensors:
            names.append(n)
            yield n, t

    (load or model.load_weights)(recorded())
    known = {name for name, _, _ in modules}
    by_name = {o for n in names for o in _owners(n, known)}
    touched = []
    for name, m, fn in modules:
        now = _tensors(m)
        if name in by_name or any(a not in now or now[a] is not t or t._version != v
                                  for a, (t, _, v) in captured[name].items()):
            touched.append((name, m, fn))
    copied = []
    for name, m, fn in touched:
        backend = _backend_name(m)
        if any(b in backend for b in NON_IDEMPOTENT):
            raise EngineError(f"'{name}': post-processing backend '{backend}' is not idempotent (it rewrites the "
                              "loaded tensors in place); live updates cannot re-run it: choose another MoE/GEMM "
                              "backend for RL (e.g. flashinfer_cutlass / deepgemm / triton)")
        loaded = {a: t.detach().clone() for a, t in _tensors(m).items()}
        fn()
        for a, (t0, _, _) in captured[name].items():
            new = getattr(m, a, None)
            if not isinstance(new, torch.Tensor) or new is t0:
                continue
            if new.shape != t0.shape or new.dtype != t0.dtype:
                raise EngineError(f"'{name}.{a}': post-processing produced {new.dtype} {list(new.shape)} where "
                                  f"{t0.dtype} {list(t0.shape)} was captured; it cannot be copied back into the "
                                  "captured storage")
            with torch.no_grad():
                t0.copy_(new)
            if isinstance(getattr(type(m), a, None), property):
                continue
            if a in m._parameters:
                m._parameters[a] = t0 if isinstance(t0, torch.nn.Parameter) else torch.nn.Parameter(t0, False)
            elif a in m._buffers:
                m._buffers[a] = t0
            else:
                setattr(m, a, t0)
            copied.append(f"{name}.{a}")
        for a, before in loaded.items():
            if a in captured[name] and _is_canonical(a) and not torch.equal(_bytes(getattr(m, a)), _bytes(before)):
                raise EngineError(f"'{name}.{a}': the post-processing changed a loaded tensor in place (not "
                                  "idempotent); live updates cannot re-run it on this backend")
    n = 0
    for name, m, _ in modules:
        now = _tensors(m)
        for a, (_, ptr, _) in captured[name].items():
            if a in now:
                n += 1
                if now[a].data_ptr() != ptr:
                    raise EngineError(f"'{name}.{a}': data pointer moved during the update (captured storage lost)")
    return {"touched": [name for name, _, _ in touched], "copied_back": copied, "pointers_checked": n}


#: canonical (loaded) tensor suffixes; derived ones (swizzled, deepgemm, operand) may change
CANONICAL = ("weight", "weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale", "weight_packed",
             "weight_global_scale", "bias")


def _is_canonical(attr: str) -> bool:
    return attr in CANONICAL


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t
