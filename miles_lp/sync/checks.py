"""The sync checks C1-C5 as small functions; each returns a ``Verdict`` (CONTRACT 5, seed 000).

They compare what the learner did with what the live engine reports, never with the configuration alone:
a rule-based audit passed 28 of 28 layers while the engine held 56 of 311 parameters in the wrong
precision (seed 000, F2). C6 is ``miles_lp.sync.sentinel``; C7 is that every function here returns a
verdict, including why it could not run.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from miles_lp.export import naming
from miles_lp.formats.schemes import find_scheme
from miles_lp.sync.buckets import Ledger
from miles_lp.sync.items import Item
from miles_lp.sync.verdict import Verdict, failed, ok, skipped


def _fmt(v: Any) -> str:
    return str(getattr(v, "value", v)).lower()


def _high_precision(fmt: str) -> bool:
    """The format is not quantized (its scheme is BF16's)."""
    scheme = find_scheme(fmt)
    return scheme is not None and not scheme.format.quantized


def _norm(m: Mapping[str, Any]) -> dict[str, str]:
    """``{name: _fmt(format)}``, ``_fmt`` once per distinct format (a handful), not once per name."""
    try:
        table = {f: _fmt(f) for f in set(m.values())}
    except TypeError:  # an unhashable format value
        return {n: _fmt(f) for n, f in m.items()}
    return dict(zip(m.keys(), map(table.__getitem__, m.values()), strict=True))


# --- C1 ----------------------------------------------------------------------------------------------------

def layer_audit(executed: Mapping[str, Any] | None, engine: Mapping[str, Any],
                plan: Mapping[str, Any]) -> Verdict:
    """C1: the weights the learner executed in low precision (recorded during its forward) vs the engine's
    live ``quantized_params()`` vs the plan; every disagreement by name and format.

    ``executed`` is ``None`` or empty before the learner's first forward (the initial sync): the engine is
    then audited against the plan alone, and the reason says so."""
    eng, pln = _norm(engine), _norm(plan)
    sides = {"engine": eng, "plan": pln}
    if executed:
        sides["learner"] = _norm(executed)
    what = " vs ".join(sides) if executed else "engine vs plan (the learner has not run a forward yet)"
    if all(s == eng for s in sides.values()):  # the healthy case: one C-level comparison per side
        return ok("layer_audit", 0.0, f"{len(eng)} low-precision parameters agree ({what})")
    names = sorted(set().union(*(s.keys() for s in sides.values())))
    bad = []
    for n in names:
        got = {side: m.get(n, "bf16") for side, m in sides.items()}
        if len(set(got.values())) > 1:
            bad.append(n + " (" + ", ".join(f"{s} {f}" for s, f in got.items()) + ")")
    if bad:
        return failed("layer_audit", float(len(bad)), f"{len(bad)} of {len(names)} low-precision parameters "
                      f"disagree ({what})", bad)
    return ok("layer_audit", 0.0, f"{len(names)} low-precision parameters agree ({what})")


# --- C2 ----------------------------------------------------------------------------------------------------

def grid_digests(expected: Mapping[str, str], engine: Mapping[str, str]) -> Verdict:
    """C2 (every sync): the digest of each engine tensor equals the digest of the learner's export."""
    bad = sorted(n for n, d in expected.items() if engine.get(n) != d)
    if bad:
        return failed("grid", float(len(bad)), f"{len(bad)} of {len(expected)} engine tensors differ from the "
                      "learner's export (digest)", bad)
    return ok("grid", 0.0, f"{len(expected)} tensors equal the learner's export (digest)")


def grid_full(expected: Mapping[str, torch.Tensor], engine: Mapping[str, torch.Tensor]) -> Verdict:
    """C2 (full compare): byte equality of every engine tensor with the learner's export."""
    bad, diff_bytes, total = [], 0, 0
    for n, t in expected.items():
        e = engine.get(n)
        a = t.detach().contiguous().reshape(-1).view(torch.uint8)
        total += a.numel()
        if e is None or e.dtype != t.dtype or tuple(e.shape) != tuple(t.shape):
            bad.append(f"{n} (engine {None if e is None else (str(e.dtype), list(e.shape))})")
            diff_bytes += a.numel()
            continue
        b = e.detach().contiguous().reshape(-1).view(torch.uint8).to(a.device)
        d = int((a != b).sum())
        if d:
            bad.append(f"{n} ({d} bytes)")
            diff_bytes += d
    if bad:
        return failed("grid", float(len(bad)), f"{len(bad)} of {len(expected)} engine tensors differ from the "
                      f"learner's export ({diff_bytes} of {total} bytes, full compare)", bad)
    return ok("grid", 0.0, f"{len(expected)} tensors, {total} bytes equal the learner's export (full compare)")


def global_scale_names(target: str, plan_groups: Mapping[str, Sequence[str]],
                       plan_formats: Mapping[str, Any]) -> list[tuple[str, list[str]]]:
    """For each joint-scale group of the plan (NVFP4 gate + up: a format whose scheme has
    ``joint_global_scale``): the engine names of its members' global scales (``weight_scale_2`` for SGLang/vLLM,
    ``weight_global_scale`` for compressed-tensors)."""
    naming.check_target(target)
    out = []
    suffixes: dict[str, str] = {}
    for group, members in plan_groups.items():
        fmts = {_fmt(plan_formats.get(m)) for m in members}
        if len(members) < 2 or len(fmts) != 1:
            continue
        (fmt,) = fmts
        if fmt not in suffixes:
            scheme = find_scheme(fmt)
            suffixes[fmt] = "" if scheme is None or not scheme.joint_global_scale else next(
                p.suffix for p in naming.parts(target, scheme.format) if p.component == "global_scale")
        if suffixes[fmt]:
            out.append((group, [naming.module_prefix(m) + suffixes[fmt] for m in members]))
    return out


def joint_scales(groups: Sequence[tuple[str, list[str]]], engine: Mapping[str, torch.Tensor]) -> Verdict:
    """C2 (joint scale): the members of each NVFP4 gate/up group hold ONE global scale in the engine (SGLang
    and vLLM fuse gate and up into one GEMM with one scale; CONTRACT 2). ``engine``: the global-scale tensors
    by name (the engine's, or the export's once the grid check proved the engine equals it byte for byte)."""
    if not groups:
        return skipped("grid", "no NVFP4 gate/up group in the plan")
    bad = []
    firsts: list[torch.Tensor] = []
    others: list[torch.Tensor] = []
    for group, names in groups:
        vals = [engine.get(n) for n in names]
        if any(v is None for v in vals):
            bad.append(f"{group} (missing {[n for n, v in zip(names, vals, strict=True) if v is None]})")
            continue
        firsts.extend([vals[0]] * (len(vals) - 1))
        others.extend(vals[1:])
    if not bad and firsts:
        # the healthy case (one 4-byte global scale per member, all of one dtype, shape and device): two stacks,
        # one comparison of the bits, one device->host transfer, no Python per member; any difference is then
        # located by the general path below
        both = firsts + others
        if (list(map(_DATA_PTR, firsts)) == list(map(_DATA_PTR, others)) and len(set(map(_DTYPE, both))) == 1
                and len(set(map(_DEVICE, both))) == 1 and len(set(map(_SHAPE, both))) == 1):
            # every member reads the very same memory (the learner's export: views of one joint scale) with one
            # dtype, shape and device: one value by construction, no device read
            return ok("grid", 0.0, f"{len(groups)} NVFP4 gate/up groups share one global scale (one tensor each)")
        same = _same_scalars(firsts, others)
        if same is not None and not bool((same[0] != same[1]).any()):
            return ok("grid", 0.0, f"{len(groups)} NVFP4 gate/up groups share one global scale")
    pairs: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (group index, first member, another member)
    for gi, (_, names) in enumerate(groups):
        vals = [engine.get(n) for n in names]
        if any(v is None for v in vals):
            continue
        pairs.extend((gi, vals[0], v) for v in vals[1:])
    # all comparisons in one batched op and one device->host transfer (not one per group)
    by_dev: dict[torch.device, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for p in pairs:
        by_dev.setdefault(p[1].device, []).append(p)
    differ: set[int] = set()
    for ps in by_dev.values():
        if all(a.numel() == 1 and a.element_size() == 4 and b.numel() == 1 and b.element_size() == 4 for _, a, b in ps):
            a = torch.stack([x.reshape(()) for _, x, _ in ps]).view(torch.int32)
            b = torch.stack([y.reshape(()).to(x.device) for _, x, y in ps]).view(torch.int32)
            ne = (a != b).tolist()
        else:
            ne = [not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8).to(x.device))
                  for _, x, y in ps]
        differ.update(gi for (gi, _, _), d in zip(ps, ne, strict=True) if d)
    for gi in sorted(differ):
        group, names = groups[gi]
        bad.append(f"{group} ({', '.join(f'{float(engine[n].reshape(-1)[0]):.6g}' for n in names)})")
    if bad:
        return failed("grid", float(len(bad)), f"{len(bad)} of {len(groups)} NVFP4 gate/up groups hold separate "
                      "global scales in the engine (one fused GEMM needs one)", bad)
    return ok("grid", 0.0, f"{len(groups)} NVFP4 gate/up groups share one global scale")


def _same_scalars(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``a`` and ``b`` stacked as int32 bits when every tensor of both is one 4-byte element of one dtype, shape
    and device (``torch.stack`` refuses other shapes and devices; the dtypes are checked first, so no type
    promotion can make two different encodings equal); else None."""
    if len(set(map(_DTYPE, a)) | set(map(_DTYPE, b))) != 1:
        return None
    try:
        sa, sb = torch.stack(a), torch.stack(b)
    except (RuntimeError, TypeError):
        return None
    if sa.element_size() != 4 or sa.numel() != len(a) or sb.shape != sa.shape:
        return None
    return sa.view(torch.int32), sb.view(torch.int32)


_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_SHAPE = operator.attrgetter("shape")
_DATA_PTR = torch.Tensor.data_ptr


# --- C3 ----------------------------------------------------------------------------------------------------

def self_check(result: Mapping[str, Any] | None, tolerance: float) -> Verdict:
    """C3: the engine ran one quantized dense layer and one expert through its serving kernel on random input
    vs a high-precision GEMM on the dequantized synced weights; every relative error <= ``tolerance``
    (healthy ~0.03 dense / ~0.05 expert; stale derived state ~1; seed 000)."""
    layers = dict((result or {}).get("layers") or {})
    if not layers:
        why = (result or {}).get("reason") or "; ".join((result or {}).get("skipped") or ()) or (
            "the engine reported no quantized layer to check")
        return skipped("self_check", str(why))
    # ``{name: rel_err}`` or ``{name: {"rel_err": e, "kind": ..., "format": ...}}`` (the reference engine).
    # Optional ``fresh_diff``: the serving kernel vs the same kernel on state derived afresh from the canonical
    # tensors, exactly 0 when healthy. The tolerance alone sees stale state only once the weights moved far
    # from what it was derived from (a wrong layout: ~1 at once; old weights after small steps: barely).
    # An entry without ``rel_err`` (the reference engine's rotating layer) is checked by ``fresh_diff`` alone.
    # An entry with neither figure, or a figure that is not a number, fails: a layer nothing measured is no evidence.
    errs: dict[str, float] = {}
    fresh: dict[str, float] = {}
    bad: list[str] = []
    for n, e in layers.items():
        entry = e if isinstance(e, Mapping) else {"rel_err": e}
        if "rel_err" not in entry and "fresh_diff" not in entry:
            bad.append(f"{n} (no figure reported: neither rel_err nor fresh_diff)")
        for key, into in (("rel_err", errs), ("fresh_diff", fresh)):
            if key in entry:
                v = _number(entry[key])
                if v is None:
                    bad.append(f"{n} ({key} is not a number: {entry[key]!r})")
                else:
                    into[n] = v
    worst = max(errs.values(), key=lambda e: math.inf if not math.isfinite(e) else e) if errs else 0.0
    bad += [f"{n} ({e:.4g})" for n, e in errs.items() if not (math.isfinite(e) and e <= tolerance)]
    bad += [f"{n} (serving differs from a fresh derivation by {d:.3g})" for n, d in fresh.items() if d != 0]
    figs = ", ".join(f"{n.split('.', 2)[-1]}={e:.3g}" for n, e in errs.items())
    extra = len(set(fresh) - set(errs))
    figs += f" (+{extra} checked against a fresh derivation)" if extra else ""
    if bad:
        n_bad = len({b.split(" (", 1)[0] for b in bad})  # a layer can fail both ways: count it once
        return failed("self_check", worst, f"{n_bad} of {len(layers)} layers failed (relative error above "
                      f"{tolerance}, or serving differs from a fresh derivation): the serving kernel does not compute "
                      "the synced weights (stale derived state?)", bad)
    how = (result or {}).get("graph")  # the reference engine: "graph replay" | "eager ..." (how it ran)
    return ok("self_check", worst, f"{len(layers)} layers within {tolerance}: {figs}" + (f" ({how})" if how else ""))


def _number(v: Any) -> float | None:
    """``v`` as a float when it is a real number (NaN / inf included: the tolerance fails those), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) and not (isinstance(v, torch.Tensor) and v.numel() == 1):
        return None
    return float(v)


# --- C4 ----------------------------------------------------------------------------------------------------

def storage_identity(baseline: Mapping[str, int] | None, now: Mapping[str, int]) -> Verdict:
    """C4: the tensors the engine serves from (and CUDA graphs captured) are the ones recorded at load: same
    names, same data pointers. A re-bound parameter leaves later updates in a tensor nobody reads."""
    if not baseline:
        return skipped("storage", "no storage pointers were recorded at load (the engine reported none)")
    if now == baseline:  # one C-level comparison of the two dicts (the healthy case, every sync)
        return ok("storage", 0.0, f"{len(baseline)} served tensors keep their storage")
    changed = sorted(n for n, p in baseline.items() if now.get(n) != p)
    extra = sorted(set(now) - set(baseline))
    bad = changed + [f"{n} (new)" for n in extra]
    if bad:
        return failed("storage", float(len(bad)), f"{len(bad)} of {len(baseline)} served tensors are not the "
                      "storage recorded at load (re-bound parameters)", bad)
    return ok("storage", 0.0, f"{len(baseline)} served tensors keep their storage")


# --- C5 ----------------------------------------------------------------------------------------------------

def parse_digest(d: str) -> tuple[str, tuple[int, ...]]:
    """``"float8_e4m3fn[64, 32]:abcd"`` -> ``("float8_e4m3fn", (64, 32))`` (``tensor_digest``'s format)."""
    head = d.split(":", 1)[0]
    dtype, _, shape = head.partition("[")
    dims = shape.rstrip("]").strip()
    return dtype, tuple(int(x) for x in dims.split(",")) if dims else ()


def validate_update(items: Iterable[Item], spec: Mapping[str, tuple[str, tuple[int, ...]]],
                    engine_quantized: Mapping[str, Any]) -> Verdict:
    """C5, before any byte is written: every engine tensor is sent, nothing else, each with the engine's
    dtype and shape; a BF16 weight is never sent to a low-precision parameter, nor the reverse. A failure
    refuses the whole update (the previous weights keep serving)."""
    items = list(items)
    sent = {it.name: it for it in items}
    bad = []
    for n in sorted(set(sent) - set(spec)):
        bad.append(f"{n} (unknown to the engine)")
    for n in sorted(set(spec) - set(sent)):
        bad.append(f"{n} (not in the learner's export)")
    eng_q = {n: _fmt(f) for n, f in engine_quantized.items()}
    for n, it in sent.items():
        if n not in spec:
            continue
        dtype, shape = spec[n]
        got = str(it.tensor.dtype).removeprefix("torch.")
        if got != dtype or tuple(it.tensor.shape) != tuple(shape):
            bad.append(f"{n} (sent {got}{list(it.tensor.shape)}, engine holds {dtype}{list(shape)})")
        if it.component in (None, "data"):  # the weight itself: precision must match the engine's parameter
            held = eng_q.get(it.source, "bf16")
            sent_fmt = _fmt(it.fmt)
            if _high_precision(held) != _high_precision(sent_fmt):
                bad.append(f"{it.source} ({sent_fmt} weight sent to a {held} parameter)")
    if bad:
        return failed("completeness", float(len(bad)), f"update refused before any byte was written: {len(bad)} "
                      "problem(s)", bad)
    return ok("completeness", 0.0, f"{len(sent)} tensors fit the engine (names, dtypes, shapes, precision)")


def completeness(ledger: Ledger, buckets_sent: int) -> Verdict:
    """C5, after the last bucket: every expected tensor written exactly once, none unexpected, no scale
    element still holding the 0xFF NaN code the staging buffer was filled with."""
    probs = ledger.problems()
    bad = ([f"{n} (never written)" for n in probs["missing"]] + [f"{n} (written twice)" for n in probs["repeated"]]
           + [f"{n} (unexpected)" for n in probs["unexpected"]]
           + [f"{n} (staged scale bytes not written: NaN code)" for n in probs["unwritten_scale_bytes"]])
    got = ledger.buckets_received
    if got != buckets_sent:
        bad.insert(0, f"{buckets_sent - got} of {buckets_sent} buckets never arrived")
    if bad:
        return failed("completeness", float(len(bad)), f"incomplete update: {len(bad)} problem(s) "
                      f"({len(ledger.writes)} of {len(ledger.expected)} tensors written)", bad)
    return ok("completeness", 0.0, f"{len(ledger.expected)} tensors written once in {got} buckets; staged "
              "scales fully written")


def version(expected: int, engine_version: int, generation_version: int | None = None) -> Verdict:
    """The weight version increments once per sync and the engine reports it (also with its generations)."""
    got = {"engine": engine_version}
    if generation_version is not None:
        got["generation"] = generation_version
    bad = [f"{k} reports {v}" for k, v in got.items() if v != expected]
    if bad:
        return failed("version", float(engine_version), f"expected weight version {expected}: " + ", ".join(bad))
    return ok("version", float(expected), f"weight version {expected}")
