"""What `miles-lp explain` shows: the plan grouped by layer range and role, totals per format, warnings.

Pure functions of a compiled plan. Reading a model folder (config.json, safetensors headers) is file I/O and
lives in ``miles_lp.io.validate.load_model_layout``, so ``policy`` imports nothing from ``checkpoint``
(``checkpoint`` builds on ``policy``, not the other way round).
"""

from __future__ import annotations

from typing import Any

from miles_lp.formats.schemes import scheme_for
from miles_lp.formats.spec import Format
from miles_lp.policy.layouts.base import Shape
from miles_lp.policy.plan import PrecisionPlan


def bytes_per_tensor(fmt: Format, shape: Shape) -> float:
    """Stored bytes: elements plus scales (MXFP8 1 B + 1 B/32; NVFP4 0.5 B + 1 B/16 + 4 B global)."""
    n = 1
    for d in shape:
        n *= d
    return scheme_for(fmt).stored_bytes(n, tuple(shape))  # the format's scheme (miles_lp.formats.schemes)


def _ranges(layers: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for i in sorted(layers):
        if out and i == out[-1][1] + 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def explain_plan(plan: PrecisionPlan) -> dict[str, Any]:
    rules = {f"rules[{i}]": r for i, r in enumerate(plan.policy.get("rules", []))}
    acc: dict[tuple[str, str, str], dict[int | None, list[int]]] = {}
    for e in plan.entries.values():
        n = 1
        for d in e.shape:
            n *= d
        per = acc.setdefault((e.role.value, e.format.value, e.rule), {})
        t = per.setdefault(e.layer, [0, 0])
        t[0] += 1
        t[1] += n
    rows = []
    for (role, fmt, rule), per in acc.items():
        layers = [k for k in per if k is not None]
        spans: list[tuple[int | None, int | None]] = [(None, None)] if None in per else []
        spans += _ranges(layers)
        for a, b in spans:
            keys = [None] if a is None else list(range(a, b + 1))
            tensors = sum(per[k][0] for k in keys)
            params = sum(per[k][1] for k in keys)
            where = "model" if a is None else (f"layer {a}" if a == b else f"layers {a}-{b}")
            if a is not None and a >= plan.num_layers:
                where += " (mtp)"
            desc = rule
            if rule in rules:
                sel = {k: v for k, v in rules[rule].items() if k in ("match", "layers", "role")}
                desc += " " + " ".join(f"{k}={v if not isinstance(v, list) or len(v) > 1 else v[0]}"
                                       for k, v in sel.items())
            rows.append({"layers": where, "start": -1 if a is None else a, "role": role, "format": fmt,
                         "rule": desc, "tensors": tensors, "params": params})
    rows.sort(key=lambda r: (r["start"], r["role"], r["format"]))
    totals: dict[str, dict[str, float]] = {}
    bf16_bytes = 0.0
    for e in plan.entries.values():
        n = 1
        for d in e.shape:
            n *= d
        t = totals.setdefault(e.format.value, {"tensors": 0, "params": 0, "bytes": 0.0})
        t["tensors"] += 1
        t["params"] += n
        t["bytes"] += bytes_per_tensor(e.format, e.shape)
        bf16_bytes += 2 * n
    total_bytes = sum(t["bytes"] for t in totals.values())
    mtp_present = len({e.layer for e in plan.entries.values() if e.layer is not None and e.layer >= plan.num_layers})
    return {"model_type": plan.model_type, "num_layers": plan.num_layers, "num_mtp_layers": mtp_present,
            "tensors": len(plan.entries), "plan_hash": plan.hash, "policy": plan.policy, "rows": rows,
            "totals": totals, "bytes": total_bytes, "bf16_bytes": bf16_bytes,
            "compression": bf16_bytes / total_bytes if total_bytes else 1.0, "warnings": list(plan.warnings)}


def _h(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)  # pragma: no cover


def _p(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def format_explain(report: dict[str, Any], source: str = "") -> str:
    lines = [f"model: {report['model_type']}, {report['num_layers']} layers"
             + (f" + {report['num_mtp_layers']} MTP" if report["num_mtp_layers"] else "")
             + f", {report['tensors']} tensors" + (f" ({source})" if source else ""),
             f"plan: sha256 {report['plan_hash'][:16]}  default={report['policy']['default']} "
             f"backward={report['policy']['backward']}", ""]
    w = [max(len("LAYERS"), *(len(r["layers"]) for r in report["rows"])),
         max(len("ROLE"), *(len(r["role"]) for r in report["rows"])), 6]
    lines.append(f"{'LAYERS':<{w[0]}}  {'ROLE':<{w[1]}}  {'FORMAT':<{w[2]}}  {'TENSORS':>8}  {'PARAMS':>9}  RULE")
    for r in report["rows"]:
        lines.append(f"{r['layers']:<{w[0]}}  {r['role']:<{w[1]}}  {r['format']:<{w[2]}}  {r['tensors']:>8}  "
                     f"{_p(r['params']):>9}  {r['rule']}")
    lines += ["", f"{'FORMAT':<10}  {'TENSORS':>8}  {'PARAMS':>9}  {'BYTES':>10}"]
    for fmt, t in sorted(report["totals"].items()):
        lines.append(f"{fmt:<10}  {int(t['tensors']):>8}  {_p(t['params']):>9}  {_h(t['bytes']):>10}")
    lines.append(f"{'total':<10}  {report['tensors']:>8}  {'':>9}  {_h(report['bytes']):>10}   "
                 f"(bf16: {_h(report['bf16_bytes'])}, compression {report['compression']:.2f}x)")
    if report["warnings"]:
        lines += ["", "warnings:"] + [f"  - {w_}" for w_ in report["warnings"]]
    return "\n".join(lines)
