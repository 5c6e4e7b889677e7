"""``verify_checkpoint(out, source=None)``: prove a converted checkpoint keeps the precision contract.

Every check reports a verdict, or why it could not run (C7):

* ``record``     ``miles_lp_plan.json`` is present, the plan parses and its hash matches the recorded one;
* ``index``      every shard header is valid and the index names exactly the tensors the shards hold;
* ``tensors``    every tensor the plan implies is present with the target's dtype and shape, and nothing else;
* ``config``     config.json (and hf_quant_config.json) equal what the policy's emitters write for the plan,
                 and, read back with the engine's own skip-matching rules, quantize exactly the plan's layer
                 set with the plan's formats (C1, offline);
* ``scales``     scales are finite and in range (no E8M0 NaN byte, E4M3 scales finite and >= 0, global
                 scales finite and > 0, ``input_scale`` == 1.0);
* ``source``     (``--source``) the source files are the ones converted (sha256);
* ``grid``       (``--source``) every quantized tensor's bytes equal a fresh quantization of the source, every
                 other tensor equals the source (C2);
* ``error``      (``--source``) every decoded weight is within the format's element-wise error bound.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from miles_lp.checkpoint.safetensors_io import CheckpointFiles, TensorReader, open_checkpoint
from miles_lp.errors import MilesLPError
from miles_lp.export import naming
from miles_lp.formats.spec import MXFP8_BLOCK, NVFP4_BLOCK, Format

PASS, FAIL, SKIP = "pass", "FAIL", "skip"
E8M0_MAX_FINITE = 247  # the largest E8M0 scale byte a finite bf16/fp16/fp32 block produces (TE's rule)
_MAX_LISTED = 5


@dataclasses.dataclass
class CheckResult:
    check: str
    verdict: str  # pass | FAIL | skip
    detail: str


@dataclasses.dataclass
class VerifyReport:
    out: Path
    checks: list[CheckResult] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """All checks passed; a skipped check (e.g. no --source) does not fail the report."""
        return all(c.verdict != FAIL for c in self.checks)

    def add(self, check: str, verdict: str, detail: str) -> None:
        self.checks.append(CheckResult(check, verdict, detail))

    def format(self) -> str:
        w = max((len(c.check) for c in self.checks), default=5)
        lines = [f"verify {self.out}"]
        for c in self.checks:
            first, *rest = c.detail.splitlines() or [""]
            lines.append(f"  [{c.verdict:>4}] {c.check:<{w}}  {first}")
            lines += [f"  {'':>6} {'':<{w}}  {r}" for r in rest]
        lines.append("result: " + ("OK" if self.ok else "FAILED"))
        return "\n".join(lines)


def _listing(problems: list[str]) -> str:
    more = f"\n... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    return "\n".join(problems[:_MAX_LISTED]) + more


# --------------------------------------------------------------------------------------------------------
class _Ctx:
    """What the checks share: the record, the plan, the output files, the expected tensor table."""

    def __init__(self, out: Path):
        self.out = out
        self.record: dict | None = None
        self.plan = None
        self.target: str = ""
        self.files: CheckpointFiles | None = None
        self.formats: dict[str, Format] = {}  # quantized weights only
        self.shapes: dict[str, tuple] = {}  # logical source shapes
        self.dtypes: dict[str, str] = {}  # source dtypes


def verify_checkpoint(out: str | Path, source: str | Path | None = None,
                      log: Callable[[str], None] | None = None) -> VerifyReport:
    out = Path(out)
    report = VerifyReport(out)
    ctx = _Ctx(out)
    _check_record(ctx, report)
    _check_index(ctx, report)
    _check_tensors(ctx, report)
    _check_config(ctx, report)
    _check_scales(ctx, report)
    if source is None:
        for name in ("source", "grid", "error"):
            report.add(name, SKIP, "no --source given: pass --source IN to compare with the input checkpoint")
    else:
        _check_source(ctx, report, Path(source))
    return report


def _prereq(report: VerifyReport, name: str, ok: bool, why: str) -> bool:
    if not ok:
        report.add(name, SKIP, f"could not run: {why}")
    return ok


def _check_record(ctx: _Ctx, report: VerifyReport) -> None:
    from miles_lp.checkpoint.convert import PLAN_FILE

    path = ctx.out / PLAN_FILE
    if not ctx.out.is_dir():
        report.add("record", FAIL, f"{ctx.out} is not a folder")
        return
    if not path.is_file():
        report.add("record", FAIL, f"no {PLAN_FILE}: not written by `miles-lp convert` (or it was removed)")
        return
    try:
        record = json.loads(path.read_text())
        from miles_lp.policy import PrecisionPlan, get_layout

        config = json.loads((ctx.out / "config.json").read_text())
        plan = PrecisionPlan.from_json(json.dumps(record["plan"]), layout=get_layout(config))
        target = naming.check_target(record["target"])
        shapes = {n: tuple(s) for n, s in record["source"]["shapes"].items()}
        dtypes = dict(record["source"]["dtypes"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError, MilesLPError) as exc:
        report.add("record", FAIL, f"{PLAN_FILE} or config.json is unreadable: {exc}")
        return
    if plan.hash != record.get("plan_hash"):
        report.add("record", FAIL, f"plan hash {plan.hash} != recorded {record.get('plan_hash')}: "
                                   f"{PLAN_FILE} was edited")
        return
    ctx.record, ctx.plan, ctx.target, ctx.shapes, ctx.dtypes = record, plan, target, shapes, dtypes
    for name in shapes:
        fmt = Format(plan.format_for(name))
        if fmt.quantized:
            ctx.formats[name] = fmt
    report.add("record", PASS, f"plan {plan.hash[:12]}, target {target}, miles-lp "
                               f"{record.get('miles_lp_version')}, {len(ctx.formats)} quantized weights")


def _check_index(ctx: _Ctx, report: VerifyReport) -> None:
    try:
        ctx.files = open_checkpoint(ctx.out)
    except MilesLPError as exc:
        report.add("index", FAIL, str(exc))
        return
    report.add("index", PASS, f"{len(ctx.files.files)} shards, {len(ctx.files.tensors)} tensors, headers valid")


def expected_tensors(target: str, formats: dict[str, Format], shapes: dict[str, tuple],
                     dtypes: dict[str, str]) -> dict[str, tuple[str, tuple]]:
    """``{on-disk name: (dtype, shape)}`` the converter writes for this plan and source."""
    table: dict[str, tuple[str, tuple]] = {}
    for name, shape in shapes.items():
        fmt = formats.get(name)
        if fmt is not None:
            table.update(naming.expected(target, fmt, name, shape))
        else:
            dt = dtypes[name]
            table[name] = ("BF16" if dt == "F8_E4M3" else dt, tuple(shape))
    return table


def _check_tensors(ctx: _Ctx, report: VerifyReport) -> None:
    if not _prereq(report, "tensors", ctx.plan is not None and ctx.files is not None,
                   "the record or the index failed"):
        return
    want = expected_tensors(ctx.target, ctx.formats, ctx.shapes, ctx.dtypes)
    have = ctx.files.tensors
    problems = [f"missing tensor '{n}' ({dt} {list(s)})" for n, (dt, s) in want.items() if n not in have]
    problems += [f"unexpected tensor '{n}' (not in the plan)" for n in have if n not in want]
    for n, (dt, s) in want.items():
        h = have.get(n)
        if h is not None and (h.dtype != dt or tuple(h.shape) != tuple(s)):
            problems.append(f"'{n}' is {h.dtype} {list(h.shape)}, the plan needs {dt} {list(s)}")
    if problems:
        report.add("tensors", FAIL, _listing(problems))
    else:
        report.add("tensors", PASS, f"{len(want)} tensors with the plan's dtypes and shapes")


def _check_config(ctx: _Ctx, report: VerifyReport) -> None:
    from miles_lp.checkpoint.configs import emit_configs

    if not _prereq(report, "config", ctx.plan is not None, "the record failed"):
        return
    try:
        config = json.loads((ctx.out / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        report.add("config", FAIL, f"config.json unreadable: {exc}")
        return
    problems = []
    try:
        want_qc, want_files = emit_configs(ctx.plan, ctx.target)
    except MilesLPError as exc:
        report.add("config", SKIP, f"could not run: cannot re-emit the config for this plan: {exc}")
        return
    disk_files = {}
    for fname in want_files:
        try:
            disk_files[fname] = json.loads((ctx.out / fname).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            problems.append(f"{fname} missing or unreadable: {exc}")
    qc = config.get("quantization_config")
    problems += _consumer_problems(ctx, qc, disk_files)
    if qc != want_qc:
        problems.append("config.json quantization_config differs from what the plan emits: "
                        + _dict_diff(want_qc, qc))
    for fname, content in want_files.items():
        if fname in disk_files and disk_files[fname] != content:
            problems.append(f"{fname} differs from what the plan emits: " + _dict_diff(content, disk_files[fname]))
    if problems:
        report.add("config", FAIL, _listing(problems))
    else:
        report.add("config", PASS, f"quantization_config ({(qc or {}).get('quant_method')}) equals the plan's; "
                                   f"the engine's skip rules select exactly the plan's {len(ctx.formats)} weights")


def _dict_diff(want, have) -> str:
    if not isinstance(want, dict) or not isinstance(have, dict):
        return f"expected {json.dumps(want)[:200]}, found {json.dumps(have)[:200]}"
    keys = sorted(set(want) | set(have))
    diffs = [k for k in keys if want.get(k) != have.get(k)]
    parts = []
    for k in diffs[:3]:
        w, h = want.get(k), have.get(k)
        if isinstance(w, list) and isinstance(h, list):
            parts.append(f"'{k}': missing {sorted(set(map(str, w)) - set(map(str, h)))[:4]}, "
                         f"extra {sorted(set(map(str, h)) - set(map(str, w)))[:4]}")
        else:
            parts.append(f"'{k}': expected {json.dumps(w)[:120]}, found {json.dumps(h)[:120]}")
    return "; ".join(parts)


def _consumer_problems(ctx: _Ctx, qc, disk_files: dict) -> list[str]:
    """Read the on-disk config the way the engine does; list weights whose format differs from the plan."""
    from miles_lp.checkpoint.configs import engine_formats_for

    try:
        engine = engine_formats_for(ctx.target, qc, disk_files, ctx.plan)
    except MilesLPError as exc:
        return [f"the engine could not read this config: {exc}"]
    problems = []
    for name in ctx.shapes:
        if not name.endswith(".weight") or len(ctx.shapes[name]) != 2:
            continue
        want = ctx.formats.get(name, Format.BF16)
        got = engine.get(name, Format.BF16)
        if got != want:
            problems.append(f"C1: the engine would load '{name}' as {got.value}, the plan says {want.value}")
    return problems


def _check_scales(ctx: _Ctx, report: VerifyReport) -> None:
    import torch

    if not _prereq(report, "scales", ctx.plan is not None and ctx.files is not None,
                   "the record or the index failed"):
        return
    problems = []
    checked = 0
    allowed = set(ctx.record.get("nonfinite_allowed", []))  # converted with --allow-nonfinite
    with TensorReader() as reader:
        for weight, fmt in ctx.formats.items():
            if weight in allowed:
                continue
            prefix = naming.module_prefix(weight)
            for p in naming.parts(ctx.target, fmt):
                h = ctx.files.tensors.get(prefix + p.suffix)
                if h is None or p.component == "data":
                    continue
                t = reader.read(h)
                checked += 1
                bad = _scale_problem(p, t)
                if bad:
                    problems.append(f"'{h.name}': {bad}")
    del torch
    note = f" ({len(allowed)} weights converted with --allow-nonfinite not checked)" if allowed else ""
    if problems:
        report.add("scales", FAIL, _listing(problems))
    else:
        report.add("scales", PASS, f"{checked} scale tensors finite and in range{note}")


def _scale_problem(part, t) -> str | None:
    import torch

    if part.dtype == "U8":  # E8M0: 0xFF is NaN
        n = int((t == 0xFF).sum())
        if n:
            return f"{n} E8M0 scale bytes are 0xFF (NaN)"
        # The largest finite weight (fp32 max ~2^128) needs ceil(log2(2^128 / 448)) + 127 = 247; larger bytes
        # (0xFE: an inf block) mean a non-finite or corrupted weight.
        n = int((t > E8M0_MAX_FINITE).sum())
        return (f"{n} E8M0 scale bytes above {E8M0_MAX_FINITE} (2^{E8M0_MAX_FINITE - 127}): no finite weight "
                "needs them (an inf block, or corruption)") if n else None
    if part.dtype == "F8_E4M3":
        f = t.to(torch.float32)
        if not bool(torch.isfinite(f).all()):
            return f"{int((~torch.isfinite(f)).sum())} E4M3 scales are NaN"
        if bool((f < 0).any()):
            return f"{int((f < 0).sum())} E4M3 scales are negative"
        return None
    f = t.to(torch.float32)
    if part.component is None:
        return None if bool((f == naming.INPUT_SCALE_VALUE).all()) else (
            f"must be {naming.INPUT_SCALE_VALUE} (per-token activations), found {f.tolist()}")
    if not bool(torch.isfinite(f).all()) or not bool((f > 0).all()):
        return f"global scale must be finite and > 0, found {f.tolist()}"
    return None


# --------------------------------------------------------------------------------------------------------
def _check_source(ctx: _Ctx, report: VerifyReport, source: Path) -> None:
    from miles_lp.checkpoint.convert import sha256_file

    if not _prereq(report, "source", ctx.plan is not None and ctx.files is not None,
                   "the record or the index failed"):
        for name in ("grid", "error"):
            report.add(name, SKIP, "could not run: the record or the index failed")
        return
    try:
        from miles_lp.checkpoint.validate import validate_source

        src = validate_source(source)
    except MilesLPError as exc:
        report.add("source", FAIL, f"cannot read --source: {exc}")
        for name in ("grid", "error"):
            report.add(name, SKIP, "could not run: --source unreadable")
        return
    recorded = ctx.record["source"]["files"]
    actual = {p.name: sha256_file(p) for p in src.files.files}
    if actual != recorded:
        diff = sorted(set(actual.items()) ^ set(recorded.items()))
        report.add("source", FAIL, f"{source} is not the checkpoint that was converted (sha256 differs for "
                                   f"{sorted({n for n, _ in diff})[:4]}); comparisons below are against it anyway")
    else:
        report.add("source", PASS, f"{len(actual)} source files match the recorded sha256")
    _check_grid_and_error(ctx, report, src)


def _check_grid_and_error(ctx: _Ctx, report: VerifyReport, src) -> None:
    import torch

    from miles_lp.checkpoint.convert import _load, group_amax, quantize

    formats = ctx.formats
    names = [n for n in ctx.shapes if n in src.logical]
    missing = [n for n in ctx.shapes if n not in src.logical]
    grid_problems = [f"source has no tensor '{n}'" for n in missing]
    err_problems: list[str] = []
    worst: dict[str, float] = {}
    amax = group_amax(src, ctx.plan, {**formats}, "cpu")
    have = ctx.files.tensors
    allowed_nonfinite = set(ctx.record.get("nonfinite_allowed", []))
    with TensorReader() as out_reader, TensorReader() as src_reader:
        for name in names:
            x = _load(src, src.tensors[name], src_reader.read, "cpu")
            fmt = formats.get(name)
            if fmt is None:
                h = have.get(name)
                if h is None:
                    grid_problems.append(f"'{name}' missing")
                    continue
                y = out_reader.read(h)
                ref = (x.to(torch.bfloat16) if name in src.fp8_scale_of else x).contiguous()
                if y.dtype != ref.dtype or y.shape != ref.shape or not torch.equal(
                        y.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)):
                    grid_problems.append(f"'{name}' (kept {y.dtype}) differs from the source")
                continue
            fresh = naming.encode(ctx.target, fmt, name,
                                          quantize(x, fmt, ctx.plan.entry(name), amax=amax.get(name), name=name))
            disk = {}
            for n, t in fresh.items():
                h = have.get(n)
                if h is None:
                    grid_problems.append(f"'{n}' missing")
                    continue
                disk[n] = out_reader.read(h)
                if disk[n].shape != t.shape or disk[n].dtype != t.dtype or not torch.equal(
                        disk[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)):
                    nd = _n_diff(disk[n], t)
                    grid_problems.append(f"'{n}': {nd} bytes differ from a fresh {fmt.value} quantization "
                                         "of the source (off the learner's grid)")
            if len(disk) != len(fresh) or name in allowed_nonfinite:
                continue
            bad, rel = _error_bound(ctx.target, fmt, name, disk, x)
            worst[fmt.value] = max(worst.get(fmt.value, 0.0), rel)
            if bad:
                err_problems.append(f"'{name}': {bad}")
    if grid_problems:
        report.add("grid", FAIL, _listing(grid_problems))
    else:
        report.add("grid", PASS, f"{len(formats)} quantized weights byte-equal to a fresh quantization; "
                                 f"{len(names) - len(formats)} other tensors equal the source")
    if err_problems:
        report.add("error", FAIL, _listing(err_problems))
    else:
        figures = ", ".join(f"{k} max rel. Frobenius error {v:.4f}" for k, v in sorted(worst.items()))
        skipped = sorted(allowed_nonfinite & set(formats))
        note = (f"; not checked ({len(skipped)}, converted with --allow-nonfinite): {', '.join(skipped[:4])}"
                if skipped else "")
        report.add("error", PASS, f"every decoded element within its format's bound ({figures}){note}")


def _n_diff(a, b) -> int:
    import torch

    if a.numel() * a.element_size() != b.numel() * b.element_size():
        return max(a.numel(), b.numel())
    return int((a.reshape(-1).view(torch.uint8) != b.reshape(-1).view(torch.uint8)).sum())


def decode(target: str, fmt: Format, weight: str, tensors: dict, shape: tuple):
    """A codec tensor object (MXFP8Tensor / NVFP4Tensor) from on-disk tensors."""
    import torch

    import miles_lp.formats as F

    comps = naming.decode_components(target, fmt, weight, tensors)
    if fmt is Format.MXFP8:
        return F.MXFP8Tensor(data=comps["data"], scale=comps["scale"], axis=-1)
    g = comps["global_scale"]
    return F.NVFP4Tensor(data=comps["data"], scale=comps["scale"], global_scale=g,
                         amax=torch.full_like(g, float("nan")), logical_shape=tuple(shape))


def _error_bound(target: str, fmt: Format, weight: str, disk: dict, x) -> tuple[str | None, float]:
    """Element-wise bound of the format, from the block scales on disk.

    MXFP8 (block scale s = 2^(e-127)): |x - q| <= max(|x| / 16, s / 1024): E4M3 has 3 mantissa bits (half
    an ulp <= 2^-4 relative for normals), subnormal spacing 2^-9 s; no saturation since amax <= 448 s.
    NVFP4 (effective block scale s = sf * S_dec): |x - q| <= max(|x|, s) / 4 (+ the E4M3-underflow floor
    6 * 2^-9 * S_dec / 2 for blocks whose scale rounds to zero): E2M1 spacing is 0.5 below 2, 1 below 4,
    2 up to 6; saturation after rounding sf down costs at most |x| / 16.
    """
    import torch

    q = decode(target, fmt, weight, disk, tuple(x.shape))
    xf = x.to(torch.float32)
    dq = q.dequantize(torch.float32)
    err = (dq - xf).abs()
    comps = naming.decode_components(target, fmt, weight, disk)
    if fmt is Format.MXFP8:
        s = torch.exp2(comps["scale"].to(torch.float32) - 127).repeat_interleave(MXFP8_BLOCK, dim=-1)
        bound = torch.maximum(xf.abs() / 16, s / 1024)
    else:
        g = comps["global_scale"].to(torch.float32)
        s = (comps["scale"].to(torch.float32) * g).repeat_interleave(NVFP4_BLOCK, dim=-1)
        bound = torch.maximum(torch.maximum(xf.abs(), s) / 4, 6 * 2.0**-10 * g)
    bad = err > bound * (1 + 1e-6)
    rel = float(torch.linalg.vector_norm(dq - xf) / torch.linalg.vector_norm(xf).clamp_min(1e-30))
    if bool(bad.any()):
        i = int(bad.reshape(-1).nonzero()[0])
        return (f"{int(bad.sum())} elements outside the {fmt.value} bound (first: x={float(xf.reshape(-1)[i])!r}, "
                f"decoded {float(dq.reshape(-1)[i])!r}, bound {float(bound.reshape(-1)[i])!r})"), rel
    return None, rel
