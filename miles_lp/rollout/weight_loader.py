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
3. finds the touched modules: the owner of each loaded name (``<module>.<param>``, with SGLang's fused names from
   ``policy.consumers.PACKED_MODULES``: ``q/k/v_proj`` -> ``qkv_proj``, ``gate/up_proj`` -> ``gate_up_proj``,
   DeepSeek's ``q_a_proj`` / ``kv_a_proj_with_mqa`` -> ``fused_qkv_a_proj_with_mqa``; ``experts.{e}.*`` ->
   ``experts``, and ``shared_experts.*`` -> ``experts`` where SGLang fused the shared expert into the MoE), plus
   any module whose tensors were re-bound or written through autograd-visible ops (version counter moved;
   SGLang's ``param.data.copy_`` does not move it, hence the names). A quantized weight (one sent with its
   ``weight_scale*``) of a layer this model holds that maps to no module with post-processing is refused before
   anything is loaded: its derived state would stay stale;
4. refuses backends whose post-processing is not idempotent (it transforms the canonical tensors in place, so
   running it again on already-processed tensors is wrong): the known names in ``NON_IDEMPOTENT``, and any
   module whose canonical tensors the post-processing changed (checked after the run);
5. re-runs the post-processing on each touched module, then copies every re-bound tensor back into the storage
   captured in step 1 (the storage CUDA graphs captured) and puts the captured tensor back on the module;
6. asserts that no captured data pointer moved (``EngineError`` otherwise: a shape or dtype change cannot be
   copied back).

DeepSeek's MLA (``q_lora_rank`` set): SGLang builds one ``fused_qkv_a_proj_with_mqa`` (a replicated linear, whole
on every TP rank) and its ``load_weights`` assembles it itself, within one call: it keeps each of ``q_a_proj.<t>``
/ ``kv_a_proj_with_mqa.<t>`` until the other half of the same tensor ``<t>`` (``weight``, ``weight_scale_inv``,
...) has arrived, then loads ``cat([q_a, kv_a], dim=0)`` (q rows first; the output dimension, which is also the
row dimension of every per-block scale: MXFP8 ``[N, K/32]``, FP8 block ``[ceil(N/128), K/128]``, NVFP4 ``[N,
K/16]``), and for a 0-d tensor (a per-tensor scale) q_a's alone. A half without its partner in the same call is
kept in a local dict and silently dropped when the call ends. So this loader (``FUSED_IN_LOAD``), before loading,
refuses a call holding one half of a pair without the other, and a pair of 0-d tensors that differ (the engine
would serve kv_a's rows with q_a's scale); after post-processing it compares the fused module's canonical tensors
byte for byte with the concatenation it sent (``"fused_checked"`` in the report). The names sent are the
checkpoint's (never the fused name: SGLang's loader matches ``kv_a_proj_with_mqa`` inside
``fused_qkv_a_proj_with_mqa`` and would cache it as a half). Read from SGLang's models/deepseek_v2.py (the
load_weights of DeepseekV2ForCausalLM; ``DeepseekV2WeightLoaderMixin`` in newer versions); SGLang itself does not
run on these machines: tested on a module tree shaped like SGLang's (tests/unit/test_rollout_weight_loader_mla.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

from miles_lp.policy.consumers import PACKED_MODULES
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


#: (shard suffix, fused module suffix): SGLang's fused linears, from the one table the policy and the readers use
STACKED = tuple((f".{shard}", f".{fused}") for fused, shards in PACKED_MODULES.items() for shard in shards)

#: fused modules SGLang's ``load_weights`` assembles from their shards within one call (see the module docstring):
#: fused module -> shards in concatenation order (dim 0). q/k/v and gate/up are written shard by shard by their
#: parameters' own loaders (``shard_id``), so they may come in separate calls.
FUSED_IN_LOAD = {"fused_qkv_a_proj_with_mqa": PACKED_MODULES["fused_qkv_a_proj_with_mqa"]}

_EXPERT = re.compile(r"(.*\.experts)\.\d+\.(gate|up|down)_proj")
_SHARED = re.compile(r"(.*\.mlp)\.shared_experts\.(gate|up|down)_proj")  # fused into the MoE as its last expert
_LAYER = re.compile(r"(.*?\.layers\.\d+)\.")
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "weight_scale_2", "weight_global_scale")


def _owners(name: str, known: set[str]) -> list[str]:
    """The module holding ``name``: the first of its own module, its fused module, its FusedMoE that this model
    has; a fused shared expert (no ``shared_experts`` module) goes to the layer's ``experts``."""
    prefix = name.rpartition(".")[0]
    cands = [prefix]
    cands += [prefix[: -len(a)] + b for a, b in STACKED if prefix.endswith(a)]
    m = _EXPERT.fullmatch(prefix)
    if m:
        cands.append(m.group(1))
    found = [c for c in cands if c in known][:1]
    if not found and (m := _SHARED.fullmatch(prefix)) and f"{m.group(1)}.experts" in known:
        found = [f"{m.group(1)}.experts"]
    return found


def _fused_pairs(named: list[tuple[str, torch.Tensor]], modules: set[str]) -> dict[tuple[str, str], dict]:
    """``{(fused module, tensor suffix): {shard: (name, tensor)}}`` for the names of ``FUSED_IN_LOAD`` shards
    whose fused module this model has (``modules``: every module name)."""
    out: dict[tuple[str, str], dict] = {}
    for name, t in named:
        prefix, _, attr = name.rpartition(".")
        base, _, shard = prefix.rpartition(".")
        for fused, shards in FUSED_IN_LOAD.items():
            if shard in shards and f"{base}.{fused}" in modules:
                out.setdefault((f"{base}.{fused}", attr), {})[shard] = (name, t)
    return out


def _check_pairs(pairs: dict[tuple[str, str], dict]) -> None:
    """Before loading: every shard of each fused tensor in this call, and 0-d shards equal (SGLang keeps the
    first shard's alone)."""
    for (fused, attr), got in pairs.items():
        shards = FUSED_IN_LOAD[fused.rpartition(".")[2]]
        missing = [s for s in shards if s not in got]
        if missing:
            have = next(iter(got.values()))[0]
            base = fused.rpartition(".")[0]
            raise EngineError(f"'{have}' was sent without {', '.join(f'{base}.{s}.{attr}' for s in missing)} in the "
                              f"same call: SGLang assembles {fused}.{attr} from both within one load_weights call "
                              "and drops a half whose partner is not in it (the fused module would keep serving "
                              "the old weights). Send both shards' tensors in one bucket (export_groups does)")
        ts = [got[s][1] for s in shards]
        if all(t.dim() == 0 for t in ts) and not all(torch.equal(_bytes(t), _bytes(ts[0])) for t in ts[1:]):
            values = ", ".join(f"{s}: {got[s][1].item()!r}" for s in shards)
            raise EngineError(f"{fused}.{attr}: the shards' per-tensor values differ ({values}); SGLang keeps "
                              f"{shards[0]}'s for the fused module, so the other shard's rows would be served with "
                              "the wrong scale: give the shards one joint value (as the plan's fused groups do)")


def _verify_fused(model: torch.nn.Module, pairs: dict[tuple[str, str], dict]) -> list[str]:
    """After the load and the post-processing: each fused module's canonical tensor holds the shards
    concatenated along dim 0 in ``FUSED_IN_LOAD`` order (a 0-d one: the first shard's), byte for byte."""
    checked = []
    mods = dict(model.named_modules())
    for (fused, attr), got in pairs.items():
        live = _tensors(mods[fused]).get(attr)
        if live is None or not _is_canonical(attr):
            continue
        ts = [got[s][1] for s in FUSED_IN_LOAD[fused.rpartition(".")[2]]]
        want = ts[0] if ts[0].dim() == 0 else torch.cat([t.to(live.device) for t in ts], dim=0)
        if want.dim() == 0 and live.numel() == 1:  # a per-tensor value may be held as [1]
            want = want.reshape(live.shape)
        if live.dtype != want.dtype or tuple(live.shape) != tuple(want.shape):
            raise EngineError(f"'{fused}.{attr}' is {live.dtype} {list(live.shape)}, but its shards concatenate "
                              f"to {want.dtype} {list(want.shape)}: this engine does not fuse them as expected")
        if not torch.equal(_bytes(live), _bytes(want.to(live.device))):
            raise EngineError(f"'{fused}.{attr}': after the update its bytes are not "
                              f"{' + '.join(FUSED_IN_LOAD[fused.rpartition('.')[2]])} concatenated along dim 0; the "
                              "engine loaded the shards elsewhere or not at all (stale or misplaced weights)")
        checked.append(f"{fused}.{attr}")
    return checked


def _unowned_quantized(names: list[str], known: set[str]) -> list[str]:
    """Quantized weights (a ``<m>.weight`` / ``<m>.weight_packed`` sent with a ``<m>.weight_scale*``) that map to no
    module with post-processing in a layer this model holds (a layer it does not hold, such as DeepSeek's MTP layer
    in the main model or another pipeline stage's, is skipped as SGLang's loader skips it)."""
    sent = set(names)
    out = []
    for n in names:
        stem, _, attr = n.rpartition(".")
        if attr not in ("weight", "weight_packed") or not any(f"{stem}.{s}" in sent for s in SCALE_SUFFIXES):
            continue
        if _owners(n, known):
            continue
        layer = _LAYER.match(n)
        if layer and not any(k.startswith(layer.group(1) + ".") for k in known):
            continue
        out.append(n)
    return out


def load_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                 load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] | None = None) -> dict[str, Any]:
    """Load ``named_tensors`` into ``model``, re-run the touched modules' post-processing, keep their storage.

    Returns ``{"touched": [module names], "copied_back": [module.attr], "pointers_checked": n, "fused_checked":
    [fused module.attr compared with its shards]}``.
    """
    modules = [(name, m, fn) for name, m in model.named_modules() if (fn := _post_process(m)) is not None]
    all_modules = {name for name, _ in model.named_modules()}
    known = {name for name, _, _ in modules}
    named = list(named_tensors)  # SGLang hands a list; the names are checked before anything is loaded
    names = [n for n, _ in named]
    unowned = _unowned_quantized(names, known)
    if unowned:
        raise EngineError(f"'{unowned[0]}' ({len(unowned)} quantized weight(s) in all) maps to no module with "
                          "post-processing in this model: its derived state would not be rebuilt (stale serving "
                          "state). The name must be the checkpoint's, of a module this model has (fused names: "
                          "policy.consumers.PACKED_MODULES)")
    pairs = _fused_pairs(named, all_modules)
    _check_pairs(pairs)
    captured = {name: {a: (t, t.data_ptr(), t._version) for a, t in _tensors(m).items()} for name, m, _ in modules}

    (load or model.load_weights)(iter(named))
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
    return {"touched": [name for name, _, _ in touched], "copied_back": copied, "pointers_checked": n,
            "fused_checked": _verify_fused(model, pairs)}


#: canonical (loaded) tensor suffixes; derived ones (swizzled, deepgemm, operand) may change
CANONICAL = ("weight", "weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale", "weight_packed",
             "weight_global_scale", "bias")


def _is_canonical(attr: str) -> bool:
    return attr in CANONICAL


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t
