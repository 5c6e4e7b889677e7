"""``verify_checkpoint(out, source=None)``: prove a converted checkpoint keeps the precision contract.

Every check reports a verdict, or why it could not run (C7):

* ``record``     ``miles_lp_plan.json`` is present, the plan parses and its hash matches the recorded one;
* ``index``      every shard header is valid and the index names exactly the tensors the shards hold;
* ``tensors``    every tensor the plan and the on-disk config imply is present with the target's dtype and
                 shape, and nothing else (a tensor the declared scheme needs, such as compressed-tensors
                 W4A4's ``input_global_scale``, is required: an engine leaves a missing one ``torch.empty``);
* ``config``     config.json (and hf_quant_config.json) equal what the policy's emitters write for the plan,
                 and, read back with the engine's own skip-matching rules, quantize exactly the plan's layer
                 set with the plan's formats and scheme fields (``export.schemes``: group sizes, bits,
                 strategy, block size, ...; a difference FAILs with and without a record) (C1, offline);
* ``scales``     scales are finite and in range (no E8M0 NaN byte, E4M3 scales finite and >= 0, global
                 scales and FP8 blockwise fp32 block scales finite and > 0, the static activation scale the recipe defines), every fused group
                 (q/k/v, gate/up, MLA q_a/kv_a: what SGLang and vLLM fuse into one GEMM) stores ONE NVFP4
                 global scale, and the largest block scale of each NVFP4 scope is 448 (its global scale
                 is that scope's amax / 2688);
* ``source``     (``--source``) the source files are the ones converted (sha256);
* ``grid``       (``--source``) every quantized tensor's bytes equal a fresh quantization of the source, the
                 NVFP4 global scale from its fused group's amax; every other tensor equals the source (C2);
* ``error``      (``--source``) every decoded weight is within the format's element-wise error bound.

Independence. ``verify`` is the oracle the converter is judged by, so it shares no code path with it: the
expected bytes come from ``miles_lp.formats.oracle`` (a second, plainly written reference codec), the on-disk
layout of each target from the table below (written from CONTRACT 4, not from ``miles_lp.export.naming``),
the fused groups from the engines' fusing rules (not from the policy's groups), the group amax and the
source hashes from here. Only the plan (the declaration being checked), the policy's config emitters (the
``config`` check) and the safetensors header reader are shared.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path

from miles_lp.checkpoint.disk_layout import (  # the oracle's tables (re-exported: verify's public API)
    CT_INPUT_GLOBAL_SCALE,
    PLAN_FILE,
    TARGETS,
    Part,
    expected_tensors,
    fused_groups,
    required_parts,
    weight_prefix,
)
from miles_lp.errors import CheckpointError, MilesLPError
from miles_lp.formats.spec import FP8_BLOCK_SIZE, MXFP8_BLOCK, NVFP4_BLOCK, Format
from miles_lp.io.safetensors_io import CheckpointFiles, TensorReader, open_checkpoint, sha256_file

PASS, FAIL, SKIP = "pass", "FAIL", "skip"
E8M0_MAX_FINITE = 247  # the largest E8M0 scale byte a finite bf16/fp16/fp32 block produces (TE's rule)
E4M3_MAX_BYTE = 0x7E  # 448: the block scale of the block that holds an NVFP4 scope's amax
STATIC_INPUT_SCALE = 1.0  # the static activation DECODE scale the recipe defines: activations are scaled per token
#                           at run time, so converters write 1.0 (docs/converter.md). ModelOpt ``input_scale``
#                           stores it as is; compressed-tensors ``input_global_scale`` as the encode scale 1 / it.
_MAX_LISTED = 5


# --------------------------------------------------------------------------------------------------------
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


class _Ctx:
    """What the checks share: the record, the plan, the output files, the on-disk config."""

    def __init__(self, out: Path):
        self.out = out
        self.record: dict | None = None
        self.plan = None
        self.target: str = ""
        self.files: CheckpointFiles | None = None
        self.quant_config = None
        self.formats: dict[str, Format] = {}  # quantized weights only
        self.shapes: dict[str, tuple] = {}  # logical source shapes
        self.dtypes: dict[str, str] = {}  # source dtypes
        self.fp8_decode = "fp32"  # how a block-FP8 source was decoded (the record's; fp32 before it was recorded)
        self.recipe = None  # (policy, target, name): --recipe mode, the plan compiled here without a record

    def parts(self, fmt: Format) -> tuple[Part, ...]:
        return required_parts(self.target, fmt, self.quant_config)

    @property
    def nonfinite_allowed(self) -> set[str]:
        if self.record is None:  # --recipe mode: no record of --allow-nonfinite, every scale is checked
            return set()
        return set(self.record.get("nonfinite_allowed", []))  # converted with --allow-nonfinite


def verify_checkpoint(out: str | Path, source: str | Path | None = None,
                      log: Callable[[str], None] | None = None, *, policy=None, target: str | None = None,
                      recipe_name: str = "the recipe", fp8_decode: str = "bf16") -> VerifyReport:
    """Run every check on ``out``. The plan comes from its ``miles_lp_plan.json`` record, or, with ``policy``
    (a ``PrecisionPolicy``, ``verify --recipe``) and ``target``, is compiled here without a record (a
    checkpoint another tool wrote), on the source's names and shapes (``source``) or on the names and shapes
    the checkpoint's own tensors imply for ``target``; ``fp8_decode``: how a block-FP8 ``source`` is decoded
    then (the record's value otherwise)."""
    import torch

    out = Path(out)
    report = VerifyReport(out)
    ctx = _Ctx(out)
    if policy is not None:
        if target not in TARGETS:
            raise CheckpointError(f"verify --recipe needs --target, one of {', '.join(TARGETS)} (got {target!r})")
        if fp8_decode not in ("bf16", "fp32"):
            raise CheckpointError(f"--fp8-decode must be bf16 or fp32, got {fp8_decode!r}")
        ctx.recipe = (policy, target, recipe_name)
        ctx.fp8_decode = fp8_decode
    threads = torch.get_num_threads()
    # Small element-wise ops: on a shared 2-core CPU, OpenMP spin-waiting under oversubscription made the
    # reference codec 9x slower with 2 threads than with 1 (measured; the converter does the same).
    torch.set_num_threads(1)
    try:
        _run_checks(ctx, report, source)
    finally:
        torch.set_num_threads(threads)
    return report


def _run_checks(ctx: _Ctx, report: VerifyReport, source) -> None:
    if ctx.recipe is None:
        _check_record(ctx, report)
        _check_index(ctx, report)
    else:
        _check_index(ctx, report)
        _plan_from_recipe(ctx, report, source)
    _check_tensors(ctx, report)
    _check_config(ctx, report)
    _check_scales(ctx, report)
    if source is None:
        for name in ("source", "grid", "error"):
            report.add(name, SKIP, "no --source given: pass --source IN to compare with the input checkpoint")
    else:
        _check_source(ctx, report, Path(source))


def _prereq(report: VerifyReport, name: str, ok: bool, why: str) -> bool:
    if not ok:
        report.add(name, SKIP, f"could not run: {why}")
    return ok


def _check_record(ctx: _Ctx, report: VerifyReport) -> None:
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
        target = record["target"]
        if target not in TARGETS:
            raise ValueError(f"unknown target {target!r}")
        if record["source"].get("fp8_decode", "fp32") not in ("bf16", "fp32"):
            raise ValueError(f"source.fp8_decode {record['source']['fp8_decode']!r} is not bf16 or fp32")
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
    ctx.quant_config = config.get("quantization_config")
    ctx.fp8_decode = record["source"].get("fp8_decode", "fp32")
    for name in shapes:
        fmt = Format(plan.format_for(name))
        if fmt.quantized:
            ctx.formats[name] = fmt
    report.add("record", PASS, f"plan {plan.hash[:12]}, target {target}, miles-lp "
                               f"{record.get('miles_lp_version')}, {len(ctx.formats)} quantized weights")


def logical_from_output(target: str, files: CheckpointFiles, quant_config=None) -> tuple[dict, dict]:
    """``({name: shape}, {name: dtype})`` of the model a checkpoint for ``target`` holds, read back from its
    on-disk tensors with the target's layout table (not from a record): a module whose data and scale parts
    are all present (``<m>.weight`` E4M3 + an U8 scale: MXFP8; packed U8 + an E4M3 scale: NVFP4; E4M3 + an F32
    block scale: FP8 blockwise) is one logical
    ``<m>.weight`` [N, K] (dtype unknown: BF16 assumed); every other tensor is itself."""
    have = files.tensors
    shapes: dict[str, tuple] = {}
    dtypes: dict[str, str] = {}
    folded: set[str] = set()
    for fmt in (Format.MXFP8, Format.NVFP4, Format.FP8_BLOCK):
        parts = required_parts(target, fmt, quant_config)
        data = next(p for p in parts if p.role == "data")
        scale = next(p for p in parts if p.role == "scale")
        for name, h in have.items():
            if not name.endswith("." + data.suffix) or h.dtype != data.dtype or len(h.shape) != 2:
                continue
            prefix = name[: -len(data.suffix)]
            sh = have.get(prefix + scale.suffix)
            if sh is None or sh.dtype != scale.dtype or prefix + "weight" in shapes:
                continue
            n, k = h.shape
            shapes[prefix + "weight"] = (n, 2 * k if data.shape == "half" else k)
            dtypes[prefix + "weight"] = "BF16"
            folded |= {prefix + p.suffix for p in parts if prefix + p.suffix in have}
    for name, h in have.items():
        if name not in folded and name not in shapes:
            shapes[name], dtypes[name] = tuple(h.shape), h.dtype
    return shapes, dtypes


def _plan_from_recipe(ctx: _Ctx, report: VerifyReport, source) -> None:
    """``--recipe`` mode: the plan compiled from the recipe's policy, as convert compiles it, on the source's names
    and shapes (``--source``) or on those the checkpoint's tensors imply for the target."""
    from miles_lp.policy import compile_plan, get_layout

    policy, target, name = ctx.recipe
    report.add("record", SKIP, f"not used: the plan is compiled from {name} for target {target} (no record needed)")
    try:
        config = json.loads((ctx.out / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        report.add("plan", FAIL, f"config.json unreadable: {exc}")
        return
    try:
        if source is not None:
            from miles_lp.io.validate import validate_source

            src = validate_source(source)
            shapes = dict(src.logical)
            dtypes = {n: src.tensors[n].dtype for n in src.logical}
            where = f"the names and shapes of --source {source}"
        elif ctx.files is not None:
            shapes, dtypes = logical_from_output(target, ctx.files, config.get("quantization_config"))
            where = f"the names and shapes the checkpoint's tensors imply for {target}"
        else:
            report.add("plan", SKIP, "could not run: the index failed and no --source names the tensors")
            return
        plan = compile_plan(policy, get_layout(config), shapes)
    except MilesLPError as exc:
        report.add("plan", FAIL, f"cannot compile {name} here: {exc}")
        return
    ctx.plan, ctx.target, ctx.shapes, ctx.dtypes = plan, target, shapes, dtypes
    ctx.quant_config = config.get("quantization_config")
    ctx.formats = {n: Format(plan.format_for(n)) for n in shapes if Format(plan.format_for(n)).quantized}
    report.add("plan", PASS, f"plan {plan.hash[:12]} compiled from {name} on {where}: {len(shapes)} tensors, "
                             f"{len(ctx.formats)} quantized weights")


def _check_index(ctx: _Ctx, report: VerifyReport) -> None:
    try:
        ctx.files = open_checkpoint(ctx.out)
    except MilesLPError as exc:
        report.add("index", FAIL, str(exc))
        return
    row = f"{len(ctx.files.files)} shards, {len(ctx.files.tensors)} tensors, headers valid"
    mistral = [p.name for p in ctx.files.ignored if p.name.startswith("consolidated")]
    if mistral:  # vLLM's load_format auto switches to Mistral's format when one exists, whatever the index says
        report.add("index", FAIL, f"{row}, but the folder also holds {', '.join(mistral)}, which is not part of this "
                                  "output: vLLM then loads Mistral's consolidated*.safetensors instead of the index's "
                                  "shards; remove it")
        return
    note = f"; other files: {ctx.files.ignored_note()}" if ctx.files.ignored else ""  # named, not read
    report.add("index", PASS, row + note)


def _check_tensors(ctx: _Ctx, report: VerifyReport) -> None:
    if not _prereq(report, "tensors", ctx.plan is not None and ctx.files is not None,
                   "the record or the index failed"):
        return
    try:
        want = expected_tensors(ctx.target, ctx.formats, ctx.shapes, ctx.dtypes, ctx.quant_config)
    except MilesLPError as exc:
        report.add("tensors", FAIL, str(exc))
        return
    have = ctx.files.tensors
    problems = []
    for n, (dt, s) in want.items():
        if n in have:
            continue
        why = (": the declared scheme (an nvfp4-pack-quantized config group with input_activations, W4A4) needs "
               "it; vLLM would leave it torch.empty" if n.endswith("." + CT_INPUT_GLOBAL_SCALE.suffix) else "")
        problems.append(f"missing tensor '{n}' ({dt} {list(s)}){why}")
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
    from miles_lp.export.configs import emit_configs

    if not _prereq(report, "config", ctx.plan is not None, "the record failed"):
        return
    try:
        config = json.loads((ctx.out / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        report.add("config", FAIL, f"config.json unreadable: {exc}")
        return
    problems = []
    # Our own checkpoint (a record) must hold exactly what our emitters write. Without a record (--recipe: another
    # tool may have written it, with fields of its own) the contract is how the engine reads it (C1): differences
    # from our emitters' text are listed as notes.
    strict = ctx.recipe is None
    notes: list[str] = []
    textual = problems if strict else notes
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
            textual.append(f"{fname} missing or unreadable: {exc}")
    qc = config.get("quantization_config")
    problems += _consumer_problems(ctx, qc, disk_files, want_qc, want_files)
    if qc != want_qc:
        textual.append("config.json quantization_config differs from what the plan emits: " + _dict_diff(want_qc, qc))
    for fname, content in want_files.items():
        if fname in disk_files and disk_files[fname] != content:
            textual.append(f"{fname} differs from what the plan emits: " + _dict_diff(content, disk_files[fname]))
    if problems:
        report.add("config", FAIL, _listing(problems + notes))
    elif strict:
        report.add("config", PASS, f"quantization_config ({(qc or {}).get('quant_method')}) equals the plan's; "
                                   f"the engine's skip rules select exactly the plan's {len(ctx.formats)} weights")
    else:
        note = ("; notes (not failures without a record):\n" + _listing(notes)) if notes else \
            "; it also equals what the plan emits"
        report.add("config", PASS, f"read as the engine reads it, quantization_config "
                                   f"({(qc or {}).get('quant_method')}) quantizes exactly the plan's "
                                   f"{len(ctx.formats)} weights with the plan's formats and scheme fields "
                                   f"(C1){note}")


def _dict_diff(want, have, path: str = "") -> str:
    """The first differences between two JSON values, by key path (lists: the missing and extra entries)."""
    if not isinstance(want, dict) or not isinstance(have, dict):
        return f"{path + ': ' if path else ''}expected {json.dumps(want)[:200]}, found {json.dumps(have)[:200]}"
    keys = sorted(set(want) | set(have))
    diffs = [k for k in keys if want.get(k) != have.get(k)]
    parts = []
    for k in diffs[:3]:
        w, h, at = want.get(k), have.get(k), f"{path}.{k}" if path else k
        if isinstance(w, list) and isinstance(h, list):
            parts.append(f"'{at}': missing {sorted(set(map(str, w)) - set(map(str, h)))[:4]}, "
                         f"extra {sorted(set(map(str, h)) - set(map(str, w)))[:4]}")
        elif isinstance(w, dict) and isinstance(h, dict):
            parts.append(_dict_diff(w, h, at))
        else:
            parts.append(f"'{at}': expected {json.dumps(w)[:120]}, found {json.dumps(h)[:120]}")
    return "; ".join(parts)


def _consumer_problems(ctx: _Ctx, qc, disk_files: dict, want_qc, want_files: dict) -> list[str]:
    """Read the on-disk config the way the engine does; list weights whose format differs from the plan, and
    the scheme fields (group size, bits, strategy, block size, ...: `export.schemes`) the engine would read
    with another value than the plan's own config gives it. A FAIL with and without a record."""
    from miles_lp.export.configs import engine_schemes_for
    from miles_lp.export.schemes import BF16, compare

    try:
        engine = engine_schemes_for(ctx.target, qc, disk_files, ctx.plan)
    except MilesLPError as exc:
        return [f"the engine could not read this config: {exc}"]
    try:
        planned = engine_schemes_for(ctx.target, want_qc, want_files, ctx.plan)
    except MilesLPError as exc:  # our emitters re-read what they write: this is a bug here, not in the checkpoint
        return [f"the plan's own config cannot be read back ({exc}); report this as a miles-lp bug"]
    problems = []
    fields: dict[tuple, tuple[dict, dict]] = {}  # (field, found, plan's, format) -> ({on-disk place}, {weight})
    for name in ctx.shapes:
        if not name.endswith(".weight") or len(ctx.shapes[name]) != 2:
            continue
        want = ctx.formats.get(name, Format.BF16)
        got = engine.get(name, BF16)
        if got.format != want:
            problems.append(f"C1: the engine would load '{name}' as {got.format.value}, the plan says {want.value}")
            continue
        for param, plan_value in compare(got, planned.get(name, BF16)):
            wheres, names = fields.setdefault((param.key, _shown(param.value), _shown(plan_value), want.value),
                                              ({}, {}))
            wheres[param.where] = names[name] = None
    for (_, found, plan_value, fmt), (wheres, names) in fields.items():
        where = next(iter(wheres)) + (f" (and {len(wheres) - 1} more such entries)" if len(wheres) > 1 else "")
        first = next(iter(names))
        problems.append(f"C1: {where} is {found}, the plan's {fmt} scheme has {plan_value}: the engine would read "
                        f"{len(names)} weight(s) with it, e.g. '{first}'")
    return problems


def _shown(v) -> str:
    return v if isinstance(v, str) and v.startswith("(") else json.dumps(v)


# --------------------------------------------------------------------------------------------------------
# scales (no source needed)
# --------------------------------------------------------------------------------------------------------
def _s_dec_of(part: Part, t) -> float:
    """The decode global scale S_dec a stored global-scale tensor means (engines: ModelOpt ``weight_scale_2``
    is S_dec; compressed-tensors ``weight_global_scale`` is its reciprocal)."""
    v = float(t.reshape(-1)[0])
    if part.stored == "dec":
        return v
    return 1.0 / v if v != 0 and math.isfinite(v) else math.nan


def _check_scales(ctx: _Ctx, report: VerifyReport) -> None:
    import torch

    if not _prereq(report, "scales", ctx.plan is not None and ctx.files is not None,
                   "the record or the index failed"):
        return
    problems = []
    checked = 0
    allowed = ctx.nonfinite_allowed
    have = ctx.files.tensors
    stored_global: dict[str, tuple[str, torch.Tensor]] = {}  # NVFP4 weight -> (on-disk name, raw global scale)
    max_scale_byte: dict[str, int] = {}  # NVFP4 weight -> its largest E4M3 block scale byte
    with TensorReader() as reader:
        for weight, fmt in ctx.formats.items():
            if weight in allowed:
                continue
            for p in ctx.parts(fmt):
                h = have.get(weight_prefix(weight) + p.suffix)
                if h is None or p.role == "data":
                    continue  # a missing tensor is the `tensors` check's finding
                t = reader.read(h)
                checked += 1
                bad = _scale_problem(ctx.target, p, t)
                if bad:
                    problems.append(f"'{h.name}': {bad}")
                elif p.role == "global":
                    stored_global[weight] = (h.name, t.reshape(-1)[:1].clone())
                elif p.role == "scale" and p.dtype == "F8_E4M3":
                    max_scale_byte[weight] = int(t.reshape(-1).view(torch.uint8).max())
    problems += _group_scale_problems(ctx, stored_global, max_scale_byte)
    note = f" ({len(allowed)} weights converted with --allow-nonfinite not checked)" if allowed else ""
    if problems:
        report.add("scales", FAIL, _listing(problems))
    else:
        n_groups = len(fused_groups(n for n, f in ctx.formats.items() if f is Format.NVFP4))
        report.add("scales", PASS, f"{checked} scale tensors finite and in range; {n_groups} fused NVFP4 groups "
                                   f"share one global scale{note}")


def _group_scale_problems(ctx: _Ctx, stored_global: dict, max_scale_byte: dict[str, int]) -> list[str]:
    """Every fused group stores one global scale (bit for bit), and in each scope (a fused group, or a lone
    tensor) the largest block scale is 448: the block holding the scope's amax gets fp32(amax * fp32(S_enc *
    fp32(1/6))) ~ 448 exactly when S_enc = 2688 / amax, so any other maximum means the global scale was
    derived from another amax (the converter's amax, not the group's)."""
    import torch

    problems = []
    nvfp4 = [n for n, f in ctx.formats.items() if f is Format.NVFP4 and n in stored_global]
    groups = fused_groups(nvfp4)
    in_group = {m for g in groups.values() for m in g}
    scopes = [(label, members) for label, members in groups.items()]
    scopes += [(n, (n,)) for n in nvfp4 if n not in in_group]
    for label, members in scopes:
        raw = [stored_global[m][1] for m in members]
        if len({int(r.view(torch.int32)) for r in raw}) > 1:
            vals = ", ".join(f"'{stored_global[m][0]}' = {float(r):.9g}" for m, r in zip(members, raw, strict=True))
            problems.append(f"fused group {label}: {len(members)} shards store different NVFP4 global scales "
                            f"({vals}); SGLang/vLLM fuse them into one GEMM and keep ONE value, distorting the "
                            "others: the global scale must come from the group's joint amax / 2688")
            continue
        part = next(p for p in ctx.parts(Format.NVFP4) if p.role == "global")
        s_dec = _s_dec_of(part, raw[0])
        top = max(max_scale_byte.get(m, 0) for m in members)
        if top == 0 and s_dec == 1.0:  # an all-zero scope: TE's S_enc = 1, every block scale 0
            continue
        if not s_dec > 2.0**-120:  # amax < 2688 / FLT_MAX: S_enc clamped at FLT_MAX, no block reaches 448
            continue
        if top != E4M3_MAX_BYTE:
            problems.append(f"{'fused group ' if len(members) > 1 else ''}{label}: the largest E4M3 block scale "
                            f"is byte {top:#04x}, not 0x7e (448): the global scale {s_dec:.9g} is not this "
                            "scope's amax / 2688")
    return problems


def _input_value(part: Part) -> float:
    return STATIC_INPUT_SCALE if part.stored == "dec" else 1.0 / STATIC_INPUT_SCALE


def _scale_problem(target: str, part: Part, t) -> str | None:
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
        u = t.reshape(-1).view(torch.uint8)
        n = int(((u & 0x7F) == 0x7F).sum())
        if n:
            return f"{n} E4M3 scales are NaN"
        n = int((u >= 0x80).sum())  # the sign bit: a scale from |x| is never negative (nor -0)
        return f"{n} E4M3 scales are negative" if n else None
    f = t.to(torch.float32)
    if part.role == "input":
        want = _input_value(part)
        return None if bool((f == want).all()) else (
            f"must be {want} (the recipe's static activation scale {STATIC_INPUT_SCALE}, stored as "
            f"{'the encode scale 1 / it' if part.stored == 'enc' else 'the decode scale'}; activations are "
            f"scaled per token at run time), found {f.tolist()}")
    if part.role == "scale":  # FP8 blockwise: fp32(1 / scale), scale = 448 / amax or 1 (an all-zero block)
        n = int((~torch.isfinite(f) | (f <= 0)).sum())
        return f"{n} fp32 block scales are not finite and > 0 (a NaN/inf weight, or corruption)" if n else None
    if not bool(torch.isfinite(f).all()) or not bool((f > 0).all()):
        return f"global scale must be finite and > 0, found {f.tolist()}"
    return None


# --------------------------------------------------------------------------------------------------------
# source, grid and error (--source)
# --------------------------------------------------------------------------------------------------------
def _check_source(ctx: _Ctx, report: VerifyReport, source: Path) -> None:
    if not _prereq(report, "source", ctx.plan is not None and ctx.files is not None,
                   "the record or the index failed"):
        for name in ("grid", "error"):
            report.add(name, SKIP, "could not run: the record or the index failed")
        return
    try:
        from miles_lp.io.validate import validate_source

        src = validate_source(source)
    except MilesLPError as exc:
        report.add("source", FAIL, f"cannot read --source: {exc}")
        for name in ("grid", "error"):
            report.add(name, SKIP, "could not run: --source unreadable")
        return
    actual = {p.name: sha256_file(p) for p in src.files.files} if ctx.record is not None else {}
    recorded = ctx.record["source"]["files"] if ctx.record is not None else None
    if recorded is None:
        report.add("source", SKIP, f"no record of the converted files' sha256 (--recipe mode); the grid and error "
                                   f"checks below compare with {source} as given")
    elif actual != recorded:
        diff = sorted(set(actual.items()) ^ set(recorded.items()))
        report.add("source", FAIL, f"{source} is not the checkpoint that was converted (sha256 differs for "
                                   f"{sorted({n for n, _ in diff})[:4]}); comparisons below are against it anyway")
    else:
        note = f" (other files, as convert read it: {src.files.ignored_note()})" if src.files.ignored else ""
        report.add("source", PASS, f"{len(actual)} source files match the recorded sha256{note}")
    trained = _trained_steps(ctx.record)
    if trained:
        why = (f"an export of a learner trained {trained} optimizer step(s) past --source: its weights are not the "
               "source's, so a fresh quantization of the source is not their grid (their grid was checked live at "
               "every sync by C2, and at export against the learner's plan)")
        for name in ("grid", "error"):
            report.add(name, SKIP, why)
        return
    _check_grid_and_error(ctx, report, src)


def _trained_steps(record: dict | None) -> int:
    """Optimizer steps between the recorded source and these weights (``miles-lp export --run-dir``); 0 for a
    conversion or an export of an untrained learner (or no record)."""
    if record is None or record.get("producer") != "export":
        return 0
    learner = record.get("learner")
    return int(learner.get("step", 0)) if isinstance(learner, dict) else 0


def _load_source(src, name: str, read, fp8_decode: str = "fp32"):
    """A source tensor as the model holds it: block-FP8 decoded by the oracle, fp32(q) * s, then rounded to bf16
    when the conversion decoded to bf16 (``fp8_decode``, from the record); others as stored."""
    import torch

    from miles_lp.formats import oracle

    x = read(src.tensors[name])
    sname = src.fp8_scale_of.get(name)
    if sname is not None:
        x = oracle.fp8_block_decode(x, read(src.tensors[sname]))
        if fp8_decode == "bf16":
            x = x.to(torch.bfloat16)
    return x


def _same_bytes(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def expected_quantized(target: str, fmt: Format, weight: str, x, *, amax: float | None = None,
                       block_2d: bool = False, quant_config=None, pow2_scales: bool = False) -> dict:
    """The oracle's on-disk tensors for weight ``x`` (``amax``: the fused group's NVFP4 global amax;
    ``pow2_scales``: the plan entry's FP8 blockwise scale rule)."""
    import torch

    from miles_lp.formats import oracle

    prefix = weight_prefix(weight)
    out = {}
    # Rows are independent given the global amax (16-row tiles for 2-D blocks): the reference codec runs on
    # slices of ~64K elements, whose float64 temporaries stay in cache (2-3x faster than whole tensors here).
    step = max(16, (1 << 16) // max(x.shape[-1], 1) // 16 * 16)
    if fmt is Format.MXFP8:
        parts = [oracle.mxfp8_quantize(x[i:i + step]) for i in range(0, x.shape[0], step)]
        comps = {"data": torch.cat([d for d, _ in parts]).view(torch.float8_e4m3fn),
                 "scale": torch.cat([e for _, e in parts])}
    elif fmt is Format.FP8_BLOCK:  # bands of 128 rows are independent
        band = max(FP8_BLOCK_SIZE, step // FP8_BLOCK_SIZE * FP8_BLOCK_SIZE)
        parts = [oracle.fp8_block_quantize(x[i:i + band], FP8_BLOCK_SIZE, pow2_scales)
                 for i in range(0, x.shape[0], band)]
        comps = {"data": torch.cat([d for d, _ in parts]).view(torch.float8_e4m3fn),
                 "scale": torch.cat([s for _, s in parts])}
    else:
        amax = oracle.nvfp4_amax(x) if amax is None else amax
        parts = [oracle.nvfp4_quantize(x[i:i + step], amax, block_2d=block_2d) for i in range(0, x.shape[0], step)]
        comps = {"data": torch.cat([d for d, _, _ in parts]),
                 "scale": torch.cat([s for _, s, _ in parts]).view(torch.float8_e4m3fn), "global": parts[0][2]}
    for p in required_parts(target, fmt, quant_config):
        if p.role in ("data", "scale"):
            out[prefix + p.suffix] = comps[p.role]
            continue
        if p.role == "global":  # CT stores fp32(1 / S_dec)
            value = comps["global"] if p.stored == "dec" else 1.0 / comps["global"]
        else:
            value = _input_value(p)
        t = torch.tensor(value, dtype=torch.float64).to(torch.float32)
        out[prefix + p.suffix] = t.reshape(()) if p.shape == "scalar" else t.reshape(1)
    return out


def _group_amaxes(ctx: _Ctx, src, names: list[str], read) -> dict[str, float]:
    """{member: joint amax} for every fused group of NVFP4 weights (a pre-pass over the members)."""
    from miles_lp.formats import oracle

    groups = fused_groups(n for n in names if ctx.formats.get(n) is Format.NVFP4)
    out = {}
    for members in groups.values():
        amax = max(oracle.nvfp4_amax(_load_source(src, m, read, ctx.fp8_decode)) for m in members)
        out.update({m: amax for m in members})
    return out


def _check_grid_and_error(ctx: _Ctx, report: VerifyReport, src) -> None:
    import torch

    formats = ctx.formats
    names = [n for n in src.tensors if n in src.logical and n in ctx.shapes]  # storage order
    grid_problems = [f"source has no tensor '{n}'" for n in ctx.shapes if n not in src.logical]
    err_problems: list[str] = []
    worst: dict[str, float] = {}
    have = ctx.files.tensors
    allowed_nonfinite = ctx.nonfinite_allowed
    n_compared = 0
    with TensorReader() as out_reader, TensorReader() as src_reader:
        group_amax = _group_amaxes(ctx, src, names, src_reader.read)
        for name in names:
            x = _load_source(src, name, src_reader.read, ctx.fp8_decode)
            fmt = formats.get(name)
            if fmt is None:
                h = have.get(name)
                if h is None:
                    grid_problems.append(f"'{name}' missing")
                    continue
                y = out_reader.read(h)
                ref = x.to(torch.bfloat16) if name in src.fp8_scale_of else x
                n_compared += 1
                if not _same_bytes(y, ref):
                    grid_problems.append(f"'{name}' (kept {y.dtype}) differs from the source")
                continue
            want = expected_quantized(ctx.target, fmt, name, x, amax=group_amax.get(name),
                                      block_2d=bool(ctx.plan.entry(name).block_2d), quant_config=ctx.quant_config,
                                      pow2_scales=bool(ctx.plan.entry(name).pow2_scales))
            disk = {}
            for n, t in want.items():
                h = have.get(n)
                if h is None:
                    grid_problems.append(f"'{n}' missing")
                    continue
                disk[n] = out_reader.read(h)
                n_compared += 1
                if not _same_bytes(disk[n], t):
                    grid_problems.append(_grid_message(n, disk[n], t, fmt, name in group_amax))
            if len(disk) != len(want) or name in allowed_nonfinite:
                continue
            bad, rel = _error_check(ctx, fmt, name, disk, x)
            worst[fmt.value] = max(worst.get(fmt.value, 0.0), rel)
            if bad:
                err_problems.append(f"'{name}': {bad}")
    if grid_problems:
        report.add("grid", FAIL, _listing(grid_problems))
    else:
        n_groups = len(fused_groups(n for n in names if formats.get(n) is Format.NVFP4))
        report.add("grid", PASS, f"{len(formats)} quantized weights byte-equal to the reference codec "
                                 f"({n_groups} fused NVFP4 groups with the joint amax); {len(names) - len(formats)} "
                                 f"other tensors equal the source; {n_compared} tensors compared")
    if err_problems:
        report.add("error", FAIL, _listing(err_problems))
    else:
        figures = ", ".join(f"{k} max rel. Frobenius error {v:.4f}" for k, v in sorted(worst.items()))
        skipped = sorted(allowed_nonfinite & set(formats))
        note = (f"; not checked ({len(skipped)}, converted with --allow-nonfinite): {', '.join(skipped[:4])}"
                if skipped else "")
        report.add("error", PASS, f"every decoded element within its format's bound ({figures}){note}")


def _grid_message(n: str, disk, want, fmt: Format, grouped: bool) -> str:
    import torch

    if disk.dtype == torch.float32 and want.dtype == torch.float32 and disk.numel() == 1 == want.numel():
        scope = "its fused group's joint amax" if grouped else "the tensor's amax"
        return (f"'{n}': {float(disk.reshape(-1)[0])!r} != {float(want.reshape(-1)[0])!r}, the NVFP4 global "
                f"scale from {scope} (TE's rule: 1 / fp32(2688 / amax))")
    return f"'{n}': {_n_diff(disk, want)} bytes differ from a fresh {fmt.value} quantization of the source " \
           "(off the learner's grid)"


def _n_diff(a, b) -> int:
    import torch

    if a.numel() * a.element_size() != b.numel() * b.element_size():
        return max(a.numel(), b.numel())
    return int((a.reshape(-1).view(torch.uint8) != b.reshape(-1).view(torch.uint8)).sum())


def _components(target: str, fmt: Format, weight: str, tensors: Mapping) -> dict:
    """data / scale / S_dec (a float) from on-disk tensors, the way the engines read them."""
    comps = {}
    for p in required_parts(target, fmt):
        name = weight_prefix(weight) + p.suffix
        if p.role == "input":
            continue
        if name not in tensors:
            raise CheckpointError(f"missing tensor '{name}' ({fmt.value} {p.role} for target {target})")
        comps[p.role] = _s_dec_of(p, tensors[name]) if p.role == "global" else tensors[name]
    return comps


def decode(target: str, fmt: Format, weight: str, tensors: dict, shape: tuple):
    """A codec tensor object (MXFP8Tensor / NVFP4Tensor) from on-disk tensors (for tests and tools)."""
    import torch

    import miles_lp.formats as F

    c = _components(target, fmt, weight, tensors)
    if fmt is Format.MXFP8:
        return F.MXFP8Tensor(data=c["data"], scale=c["scale"], axis=-1)
    if fmt is Format.FP8_BLOCK:
        return F.FP8BlockTensor(data=c["data"], scale_inv=c["scale"], block=(FP8_BLOCK_SIZE, FP8_BLOCK_SIZE))
    g = torch.tensor(c["global"], dtype=torch.float32)
    return F.NVFP4Tensor(data=c["data"], scale=c["scale"], global_scale=g,
                         amax=torch.full_like(g, float("nan")), logical_shape=tuple(shape))


def error_bound(fmt: Format, x, scale_values, s_dec: float | None = None):
    """The element-wise bound |x - decoded| <= bound of ``fmt`` (float64, x's shape), from the block scales.

    MXFP8 (``scale_values``: the block scale s = 2^(e-127) per block): max(|x| / 16, s / 1024): E4M3 has 3
    mantissa bits (half an ulp <= 2^-4 relative for normals), subnormal spacing 2^-9 s; no saturation since
    amax <= 448 s.
    NVFP4 (``scale_values``: the E4M3 block scale sf per block; ``s_dec``: the decode global scale; the
    effective block scale is s = sf * S_dec): max(|x|, s) / 4, at least 6 * 2^-10 * S_dec (the E4M3-underflow
    floor for blocks whose scale rounds to zero): E2M1 spacing is 0.5 below 2, 1 below 4, 2 up to 6;
    saturation after rounding sf down costs at most |x| / 16.
    FP8 blockwise (``scale_values``: the fp32 decode scale s per 128x128 block): max(|x| / 16, s / 1024) as MXFP8,
    plus |x| * 2^-22 for the fp32 roundings of x * scale and of s = fp32(1 / scale) (the scale is not a power of
    two) and the saturation of amax * fp32(448 / amax) just above 448.
    """
    import torch

    xf = x.to(torch.float64).abs()
    if fmt is Format.MXFP8:
        s = scale_values.to(torch.float64).repeat_interleave(MXFP8_BLOCK, dim=-1)
        return torch.maximum(xf / 16, s / 1024)
    if fmt is Format.FP8_BLOCK:
        n, k = xf.shape[-2], xf.shape[-1]
        s = scale_values.to(torch.float64).repeat_interleave(FP8_BLOCK_SIZE, -2).repeat_interleave(
            FP8_BLOCK_SIZE, -1)[..., :n, :k]
        return torch.maximum(xf / 16, s / 1024) + xf * 2.0**-22
    s = (scale_values.to(torch.float64) * s_dec).repeat_interleave(NVFP4_BLOCK, dim=-1)
    return torch.maximum(torch.maximum(xf, s) / 4, torch.full_like(xf, 6 * 2.0**-10 * s_dec))


def error_violations(x, decoded, bound):
    """Boolean mask of the elements outside ``bound`` (a relative slack of 1e-6 for the float64 arithmetic)."""
    import torch

    return (decoded.to(torch.float64) - x.to(torch.float64)).abs() > bound * (1 + 1e-6)


def _error_check(ctx: _Ctx, fmt: Format, weight: str, disk: dict, x) -> tuple[str | None, float]:
    import torch

    from miles_lp.formats import oracle

    c = _components(ctx.target, fmt, weight, disk)
    if fmt is Format.MXFP8:
        dq = oracle.mxfp8_decode(c["data"], c["scale"])
        bound = error_bound(fmt, x, torch.pow(2.0, c["scale"].to(torch.float64) - 127))
    elif fmt is Format.FP8_BLOCK:
        s = c["scale"].to(torch.float64)
        n, k = c["data"].shape
        dq = oracle.e4m3_decode(c["data"]) * s.repeat_interleave(FP8_BLOCK_SIZE, 0).repeat_interleave(
            FP8_BLOCK_SIZE, 1)[:n, :k]
        bound = error_bound(fmt, x, s)
    else:
        dq = oracle.nvfp4_decode(c["data"], c["scale"], c["global"])
        bound = error_bound(fmt, x, oracle.e4m3_decode(c["scale"]), c["global"])
    xf = x.to(torch.float64)
    bad = error_violations(xf, dq, bound)
    rel = float(torch.linalg.vector_norm(dq - xf) / torch.linalg.vector_norm(xf).clamp_min(1e-30))
    if bool(bad.any()):
        i = int(bad.reshape(-1).nonzero()[0])
        return (f"{int(bad.sum())} elements outside the {fmt.value} bound (first: x={float(xf.reshape(-1)[i])!r}, "
                f"decoded {float(dq.reshape(-1)[i])!r}, bound {float(bound.reshape(-1)[i])!r})"), rel
    return None, rel
