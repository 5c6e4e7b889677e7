"""HF checkpoint -> quantized checkpoint that an engine loads: one public function, a small pipeline.

    validate (headers only) -> plan (policy.compile_plan on the real names/shapes, once; or a compiled plan:
    ``convert_with_plan``) -> configs (export.configs: the policy's emitters)
    -> group amax pre-pass (NVFP4 gate/up share one global scale; only for groups split across shards,
       the others are computed from the tensors in memory) -> process shard by shard -> save

Nothing is written before validation, planning and config emission have succeeded; the output folder
appears only when complete (``atomic_output_dir``). Memory: one input tensor at a time plus one output
shard (``max_shard_bytes``, default: the largest input shard).
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

from miles_lp.checkpoint import pipeline
from miles_lp.errors import CheckpointError, ConfigError, FormatError
from miles_lp.export import naming
from miles_lp.export.configs import emit_configs
from miles_lp.export.writer import explain_text, side_file_rows, write_metadata
from miles_lp.formats.api import quantize
from miles_lp.formats.schemes import has_scheme, scheme_for
from miles_lp.io.atomic import atomic_output_dir, check_output_target
from miles_lp.io.safetensors_io import INDEX_NAME, ShardWriter, TensorHeader, sha256_file
from miles_lp.io.validate import SourceCheckpoint, validate_source

COMPILE_MIN_NUMEL = 1 << 22  # with compile=True: torch.compile'd MXFP8 for tensors of >= 4M elements


@dataclasses.dataclass
class ConvertSummary:
    out: Path
    target: str
    weights_by_format: dict[str, int]
    tensors_written: int
    bytes_in: int
    bytes_out: int
    seconds: float
    num_shards: int
    nonfinite: list[str]
    copied: list[str] = dataclasses.field(default_factory=list)  # side files carried over (tokenizer, code, ...)
    not_copied: list[str] = dataclasses.field(default_factory=list)  # "<name> (why)" (never silent)

    @property
    def gb_per_s(self) -> float:
        return self.bytes_in / 1e9 / max(self.seconds, 1e-9)

    def table(self) -> str:
        rows = [("output", str(self.out)), ("target", self.target)]
        rows += [(f"weights {fmt}", str(n)) for fmt, n in sorted(self.weights_by_format.items())]
        rows += [("tensors written", str(self.tensors_written)), ("shards", str(self.num_shards)),
                 ("bytes in", _human(self.bytes_in)), ("bytes out", _human(self.bytes_out)),
                 ("seconds", f"{self.seconds:.2f}"), ("input GB/s", f"{self.gb_per_s:.3f}")]
        if self.nonfinite:
            rows.append(("non-finite (allowed)", ", ".join(self.nonfinite)))
        rows += side_file_rows(self.copied, self.not_copied)
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


# --------------------------------------------------------------------------------------------------------
# small adapters over the policy and formats packages
# --------------------------------------------------------------------------------------------------------
def build_plan(policy, source: SourceCheckpoint):
    """Compile ``policy`` on the checkpoint's own tensor names and shapes (what the embedded learner's
    ``plan_for_model(policy, folder)`` compiles too: one plan, one hash)."""
    from miles_lp.policy import compile_plan, get_layout

    return compile_plan(policy, get_layout(source.config), source.logical)


def codec_options(entry, *, amax=None, compile: bool = False, name: str | None = None) -> dict:
    """``formats.quantize`` options for a checkpoint weight of plan ``entry`` (rowwise MXFP8; NVFP4 with a
    per-tensor global scale, the group's joint ``amax`` and the entry's 2-D blocks; FP8 blockwise in the learner's
    128x128 weight tiles with the entry's ``pow2_scales``: the grid ``miles_lp.train.operands.quantize_weight``
    computes from the same master)."""
    if not has_scheme(entry.format):
        raise FormatError(f"'{name}': format {entry.format.value} cannot be written to a checkpoint (mxfp8, nvfp4, "
                          "fp8_block)")
    return scheme_for(entry.format).weight_options(amax=amax, block_2d=bool(entry.block_2d),
                                                   pow2_scales=bool(entry.pow2_scales), compile=compile, name=name)


#: ``--fp8-decode``: what a block-FP8 input (DeepSeek ``weight_scale_inv``) is decoded to before quantizing.
#: ``bf16`` (default): bf16(fp32(q) * s), DeepSeek's ``fp8_cast_bf16``, i.e. the BF16 checkpoint the recipes tell
#: users to train from, so the conversion is that checkpoint's conversion byte for byte (the learner's initial
#: grid). ``fp32``: fp32(q) * s, one rounding per element (an E4M3 value times an arbitrary fp32 scale needs up
#: to 28 significant bits): closer to the FP8 values, but another MXFP8 grid (4.4% of data bytes
#: differed on a random 512x1024 tensor).
FP8_DECODES = ("bf16", "fp32")
DEFAULT_FP8_DECODE = "bf16"


def dequantize_fp8_block(data, scale_inv, decode: str = DEFAULT_FP8_DECODE):
    import torch

    from miles_lp.formats import dequantize_fp8_blockwise

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[decode]
    return dequantize_fp8_blockwise(data, scale_inv.to(torch.float32), block=(128, 128), dtype=dtype)


# --------------------------------------------------------------------------------------------------------
# the pipeline
# --------------------------------------------------------------------------------------------------------
def _check_finite(name: str, x, allow: bool, found: list[str]) -> None:
    """NaN/inf check in one fast pass (``aminmax`` propagates NaN; ~8 GB/s on CPU, vs ~1.4 for abs().amax())."""
    import torch

    if not x.is_floating_point() or x.numel() == 0:
        return
    lo, hi = torch.aminmax(x.reshape(-1))
    if bool(torch.isfinite(lo).item()) and bool(torch.isfinite(hi).item()):
        return
    if not allow:
        n_bad = int((~torch.isfinite(x)).sum())
        raise CheckpointError(f"tensor '{name}' has {n_bad} non-finite values (NaN/inf); fix the source "
                              "checkpoint, or pass --allow-nonfinite to convert it anyway")
    found.append(name)


def _load(src: SourceCheckpoint, h: TensorHeader, read, device: str, fp8_decode: str = DEFAULT_FP8_DECODE):
    """A tensor as the model holds it: block-FP8 decoded (``fp8_decode``: bf16 or fp32), moved to ``device``."""
    x = read(h)
    sname = src.fp8_scale_of.get(h.name)
    if sname is not None:
        scale_inv = read(src.tensors[sname])
        x = dequantize_fp8_block(x.to(device), scale_inv.to(device), fp8_decode)
    return x.to(device) if device != "cpu" else x


def nvfp4_groups(plan) -> list[tuple[str, ...]]:
    """The plan's joint-scale groups (gate+up) holding an NVFP4 member; refuses a group that mixes formats."""
    groups = [g for g in plan.groups.values() if any(_joint(plan.format_for(n)) for n in g)]
    for g in groups:
        kinds = {plan.format_for(n) for n in g}
        if len(kinds) != 1:
            raise ConfigError(f"joint-scale group {list(g)} mixes formats {sorted(str(k) for k in kinds)}; the "
                              "policy must give gate and up the same format")
    return groups


def _joint(fmt) -> bool:
    """The format's fused siblings share one global scale (NVFP4's gate and up)."""
    return has_scheme(fmt) and scheme_for(fmt).joint_global_scale


def inline_groups(src: SourceCheckpoint, groups: list[tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """``{member: group}`` for the groups whose members are consecutive in storage order (other tensors than
    block-FP8 scales do not sit between them) in one file: the common case (``gate_proj`` then ``up_proj``).

    The conversion loop holds such a group's members as it reads them and quantizes them once the last one
    is read, with the joint amax computed from the tensors in memory: no second read. Other groups (split
    across shards, or far apart) keep the pre-pass (``group_amax``).
    """
    order = {n: i for i, n in enumerate(n for n in src.tensors if n in src.logical)}
    out: dict[str, tuple[str, ...]] = {}
    for g in groups:
        if any(n not in order for n in g):
            continue
        pos = sorted(order[n] for n in g)
        if len({src.tensors[n].file for n in g}) == 1 and pos[-1] - pos[0] == len(g) - 1:
            out.update({n: g for n in g})
    return out


def _joint_amax(amaxes) -> object:
    """The group's amax from its members' (``nvfp4_global_amax``, NaN-ignoring as the codec)."""
    import torch

    return torch.stack(list(amaxes)).amax()


def group_amax(src: SourceCheckpoint, groups: list[tuple[str, ...]], device: str,
               skip: Mapping[str, object] | frozenset = frozenset(),
               fp8_decode: str = DEFAULT_FP8_DECODE) -> dict[str, object]:
    """Pre-pass: the joint amax of every NVFP4 group (gate+up), even across shards; ``{member: amax}``.

    Groups whose members are all in ``skip`` (``inline_groups``: computed during the conversion) are left out.
    """
    from miles_lp.formats import nvfp4_global_amax
    from miles_lp.io.safetensors_io import TensorReader

    out: dict[str, object] = {}
    groups = [g for g in groups if not all(n in skip for n in g)]
    if not groups:
        return out
    members = {n for g in groups for n in g}
    amax: dict[str, object] = {}
    with TensorReader() as reader:
        for name, h in src.tensors.items():  # storage order
            if name in members:
                x = _load(src, h, reader.read, device, fp8_decode)
                amax[name] = nvfp4_global_amax(x).cpu()  # NaN-ignoring, as the codec
    for g in groups:
        joint = _joint_amax(amax[n] for n in g)
        for n in g:
            out[n] = joint
    return out


def convert_checkpoint(src: str | Path, out: str | Path, policy, target: str = "sglang", device: str = "cpu",
                       overwrite: bool = False, allow_nonfinite: bool = False,
                       max_shard_bytes: int | None = None, progress: bool = True,
                       log: Callable[[str], None] | None = None, compile: bool = False,
                       fp8_decode: str = DEFAULT_FP8_DECODE) -> ConvertSummary:
    """Convert the HF checkpoint ``src`` into ``out`` for ``target`` following ``policy``.

    ``policy``: a ``PrecisionPolicy`` (``load_policy`` / ``policy_from_flags``), compiled once on the
    checkpoint's names and shapes; the rest is ``convert_with_plan``.
    """
    source = validate_source(src)
    return convert_with_plan(source, out, build_plan(policy, source), target=target, device=device,
                             overwrite=overwrite, allow_nonfinite=allow_nonfinite, max_shard_bytes=max_shard_bytes,
                             progress=progress, log=log, compile=compile, fp8_decode=fp8_decode)


def convert_with_plan(src: str | Path | SourceCheckpoint, out: str | Path, plan, target: str = "sglang",
                      device: str = "cpu", overwrite: bool = False, allow_nonfinite: bool = False,
                      max_shard_bytes: int | None = None, progress: bool = True,
                      log: Callable[[str], None] | None = None, compile: bool = False,
                      fp8_decode: str = DEFAULT_FP8_DECODE) -> ConvertSummary:
    """Convert ``src`` (a folder or a validated ``SourceCheckpoint``) into ``out`` under a compiled ``plan``.

    The plan is used as it is (formats, joint-scale groups, 2-D blocks): it must have been compiled for this
    checkpoint (its entries are exactly the checkpoint's tensors). ``compile``: use the torch.compile'd MXFP8
    codec for tensors of >= 4M elements (same bytes; off by default: on this 2-core CPU the chunked eager
    codec measured 0.99 GB/s vs 0.55 GB/s compiled, plus a one-time compile). ``fp8_decode``: what a block-FP8
    input is decoded to (``FP8_DECODES``; recorded in ``miles_lp_plan.json``, which ``verify`` follows).
    Raises ``CheckpointError`` / ``ConfigError`` / ``LayoutError`` / ``FormatError`` with nothing written.
    """
    import torch

    from miles_lp import __version__
    from miles_lp.formats import nvfp4_global_amax

    log = log or (lambda s: print(s, file=sys.stderr))
    t0 = time.perf_counter()
    naming.check_target(target)
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda, got '{device}'")
    if fp8_decode not in FP8_DECODES:
        raise ConfigError(f"--fp8-decode must be one of {', '.join(FP8_DECODES)}, got '{fp8_decode}'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here; use --device cpu")
    source = src if isinstance(src, SourceCheckpoint) else validate_source(src)
    out = check_output_target(out, overwrite, (source.root,))
    if set(plan.entries) != set(source.logical):
        other = sorted(set(plan.entries) ^ set(source.logical))
        raise ConfigError(f"the plan was not compiled for {source.root}: {len(other)} tensor name(s) differ, e.g. "
                          f"{other[:3]}; compile it on this checkpoint (convert_checkpoint does)")

    log(explain_text(plan, f"safetensors headers in {source.root}"))
    quantized = {n: e.format for n, e in plan.quantized().items()}
    if not quantized:
        raise ConfigError("the precision policy quantizes no tensor of this checkpoint; nothing to convert "
                          "(check --format / the recipe's rules with `miles-lp explain`)")
    for n, f in quantized.items():
        h = source.tensors[n]
        if len(h.shape) != 2:
            raise CheckpointError(f"'{n}' is planned {f.value} but has shape {list(h.shape)}; checkpoint "
                                  "weights must be 2-D")
        naming.parts(target, f)  # refuses formats the target cannot hold
    quant_config, extra_files = emit_configs(plan, target)

    bytes_in = source.files.total_bytes
    if max_shard_bytes is None:
        max_shard_bytes = max(max(h.stat().st_size for h in source.files.files), 1 << 20)
    groups = nvfp4_groups(plan)
    inline = inline_groups(source, groups)  # joint amax from the tensors in memory
    # pre-pass: groups split across shards only
    amax = group_amax(source, groups, device, skip=inline, fp8_decode=fp8_decode)

    nonfinite: list[str] = []
    threads = torch.get_num_threads()
    if device == "cpu":
        # Per-tensor work here is memory-bound. On a shared 2-core CPU, OpenMP's spin-waiting under
        # oversubscription made identical runs vary 0.95-4.7 s; one intra-op thread measured 0.91 s every time.
        torch.set_num_threads(1)
    counts = collections.Counter(str(plan.format_for(n)) for n in source.logical
                                 if n.endswith(".weight") and len(source.tensors[n].shape) == 2)
    bar = _progress(bytes_in, progress)
    clock = pipeline.Clock()
    reader = pipeline.HashingReader(clock)  # storage order, sha256 on its own thread
    jobs = pipeline.jobs_in_storage_order([n for n in source.tensors if n in source.logical], inline)

    def job_bytes(job) -> int:
        return sum(h.nbytes + (source.tensors[source.fp8_scale_of[h.name]].nbytes if h.name in source.fp8_scale_of
                               else 0) for h in (source.tensors[n] for n in job))

    def load(job):  # the reader thread, in storage order
        return [_load(source, source.tensors[n], reader.read, device, fp8_decode) for n in job]

    def work(job, xs):  # a worker thread; an inline group's joint amax from its members in memory
        bad: list[str] = []
        for name, x in zip(job, xs, strict=True):
            _check_finite(name, x, allow_nonfinite, bad)
        joint = _joint_amax(nvfp4_global_amax(t).cpu() for t in xs) if job[0] in inline else amax.get(job[0])
        tensors: dict = {}
        for name, x in zip(job, xs, strict=True):
            fmt = quantized.get(name)
            if fmt is None:
                tensors[name] = (x.to(torch.bfloat16) if name in source.fp8_scale_of else x).cpu()
            else:
                q = quantize(x, fmt, **codec_options(plan.entry(name), amax=joint,
                                                     compile=compile and x.numel() >= COMPILE_MIN_NUMEL, name=name))
                tensors.update({k: v.cpu() for k, v in naming.encode(target, fmt, name, q).items()})
        return bad, tensors

    def sink(job, result) -> None:  # the writer thread, in storage order: the shards of a sequential loop
        bad, tensors = result
        nonfinite.extend(bad)
        writer.add_many(tensors)
        bar.update(job_bytes(job))
    try:
        with atomic_output_dir(out, overwrite, (source.root,)) as tmp:
            writer = ShardWriter(tmp, max_shard_bytes)
            pipeline.run(jobs, load, work, sink, nbytes=job_bytes, clock=clock,
                         max_inflight_bytes=1 << 28)
            reader.close()
            index = writer.finish()
            digests = {p.name: reader.digests.get(p) or sha256_file(p) for p in source.files.files}
            _write_metadata(tmp, source, plan, target, quant_config, extra_files, index, digests, __version__,
                            nonfinite, fp8_decode)
            bytes_out = sum(p.stat().st_size for p in tmp.iterdir() if p.is_file())
            summary = ConvertSummary(out, target, dict(counts), len(index["weight_map"]), bytes_in, bytes_out,
                                     0.0, writer.num_shards, nonfinite, [p.name for p in source.copied_files()],
                                     source.not_copied())
    finally:
        reader.close()
        bar.close()
        torch.set_num_threads(threads)
    if nonfinite:
        warnings.warn(f"converted with non-finite values in {len(nonfinite)} tensors: {', '.join(nonfinite)}",
                      stacklevel=2)
    summary.seconds = time.perf_counter() - t0
    return summary


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=not enabled, file=sys.stderr)


def _write_metadata(tmp: Path, source: SourceCheckpoint, plan, target: str, quant_config: dict,
                    extra_files: Mapping[str, dict], index: dict, digests: Mapping[str, str], version: str,
                    nonfinite: list[str], fp8_decode: str = DEFAULT_FP8_DECODE) -> None:
    record_source = {"path": str(source.root.absolute()), "files": dict(sorted(digests.items())),
                     "fp8_block_input": source.is_fp8_block,
                     **({"fp8_decode": fp8_decode} if source.is_fp8_block else {}),
                     "dtypes": {n: source.tensors[n].dtype for n in source.logical},
                     "shapes": {n: list(s) for n, s in source.logical.items()}}
    write_metadata(tmp, hf_config=source.config, plan=plan, target=target, quant_config=quant_config,
                   extra_files=extra_files, copied_files=source.copied_files(), source=record_source,
                   index_name=INDEX_NAME, version=version, nonfinite=nonfinite)
