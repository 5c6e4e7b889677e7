"""An engine checkpoint from a learner: ``miles-lp export``, the same files ``miles-lp convert`` writes.

    learner = learner_from_hf("/tmp/tiny", load_policy("recipe.yaml"))      # or any Learner (a resumed run)
    export_learner(learner, "/tmp/tiny-mxfp8", target="sglang", base="/tmp/tiny")

``export_learner`` takes ANY ``Learner`` (miles_lp/train/learner.py): it streams ``learner.export_weights()``
through ``miles_lp.export.tensors.encode_weight`` (the target's names; the plan checked against what the
learner exports) into shards, and writes the configs (``export.configs.emit_configs``: the same emitters as
convert) and ``miles_lp_plan.json`` with ``write_metadata``, the function convert writes its metadata with.
``base`` is the HF checkpoint the learner's model came from: its ``config.json`` (minus any
``quantization_config``), tokenizer files and sha256 digests go into the output, as convert copies them from its
input. Output appears atomically (``atomic_output_dir``).

For the same weights, ``convert`` and ``export`` give identical tensors, names and configs (tested per target
on qwen3, qwen3_moe, qwen2_moe, deepseek_v3): an engine started from a converted checkpoint starts on the
learner's grid, and a live sync (which sends the same ``encode_weight`` output) keeps it there.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from miles_lp.errors import CheckpointError, ConfigError
from miles_lp.export import naming
from miles_lp.export.tensors import encode_weight, is_quantized, planned_format

PLAN_FILE = "miles_lp_plan.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default shard size


def plan_record(plan) -> dict:
    """The plan as the JSON object ``miles_lp_plan.json`` embeds (``PrecisionPlan.to_json`` parsed once)."""
    return json.loads(plan.to_json())


def write_metadata(tmp: Path, *, hf_config: Mapping[str, Any], plan, target: str, quant_config: dict,
                   extra_files: Mapping[str, dict], copied_files: Iterable[Path], source: dict, index_name: str,
                   version: str, nonfinite: Iterable[str] = (), extra: Mapping[str, Any] | None = None) -> None:
    """The input's side files (``copied_files``: every top-level non-weight file, ``SourceCheckpoint.copied_files``),
    then config.json (the HF config with the target's ``quantization_config``), the emitters' extra files and
    ``miles_lp_plan.json`` (version, target, plan + hash, source, index)."""
    from miles_lp.io.safetensors_io import write_json

    for p in copied_files:  # first: the files written below are the output's own, whatever the input held
        shutil.copy2(p, tmp / p.name)
    config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    config["quantization_config"] = quant_config
    write_json(tmp / "config.json", config)
    for fname, content in extra_files.items():
        write_json(tmp / fname, content)
    record = {
        "miles_lp_version": version,
        "target": target,
        "plan_hash": plan.hash,
        "plan": plan_record(plan),
        "source": source,
        "nonfinite_allowed": list(nonfinite),
        "index": index_name,
        **(extra or {}),
    }
    write_json(tmp / PLAN_FILE, record)


def side_file_rows(copied: list[str], not_copied: list[str]) -> list[tuple[str, str]]:
    """Summary rows for the input's side files: what was copied, and every file not copied with the reason."""
    rows = [("copied files", ", ".join(copied) if copied else "none")]
    if not_copied:
        rows.append(("not copied", "; ".join(not_copied)))
    return rows


def explain_text(plan, source: str = "") -> str:
    """The effective plan as ``miles-lp explain`` shows it (rows per layer range and role, totals, warnings)."""
    from miles_lp.policy.explain import explain_plan, format_explain

    return format_explain(explain_plan(plan), source)


@dataclasses.dataclass
class ExportSummary:
    out: Path
    target: str
    weights_by_format: dict[str, int]
    tensors_written: int
    bytes_out: int
    seconds: float
    num_shards: int
    step: int
    copied: list[str] = dataclasses.field(default_factory=list)  # the base's side files carried over
    not_copied: list[str] = dataclasses.field(default_factory=list)  # "<name> (why)"

    def table(self) -> str:
        rows = [("output", str(self.out)), ("target", self.target), ("learner step", str(self.step))]
        rows += [(f"weights {fmt}", str(n)) for fmt, n in sorted(self.weights_by_format.items())]
        rows += [("tensors written", str(self.tensors_written)), ("shards", str(self.num_shards)),
                 ("bytes out", f"{self.bytes_out / 1e6:.2f} MB"), ("seconds", f"{self.seconds:.2f}")]
        rows += side_file_rows(self.copied, self.not_copied)
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


def preflight(out: str | Path, base: str | Path, target: str, overwrite: bool):
    """The checks that need no learner (run them before loading one): target, output folder, base checkpoint.
    Returns ``(output path, validated base SourceCheckpoint)``."""
    from miles_lp.io.atomic import check_output_target
    from miles_lp.io.validate import validate_source

    naming.check_target(target)
    src = validate_source(base)
    out = check_output_target(out, overwrite, (src.root,))
    return out, src


def export_learner(learner, out: str | Path, *, target: str = "sglang", base: str | Path,
                   overwrite: bool = False, max_shard_bytes: int | None = None,
                   log: Callable[[str], None] | None = None) -> ExportSummary:
    """Write an engine checkpoint for ``target`` from ``learner`` (any ``Learner``) into ``out``.

    ``base``: the HF checkpoint folder the learner's model came from (config.json, tokenizer files, digests).
    Refuses (nothing written): an unknown target, a plan without quantized tensors or with formats the target
    cannot hold, an exported tensor that disagrees with the plan, and an export that misses or adds tensors
    relative to the plan (C5).
    """
    from miles_lp import __version__
    from miles_lp.export.configs import emit_configs
    from miles_lp.io.atomic import atomic_output_dir
    from miles_lp.io.safetensors_io import INDEX_NAME, ShardWriter, sha256_file, st_dtype

    log = log or (lambda s: print(s, file=sys.stderr))
    t0 = time.perf_counter()
    naming.check_target(target)
    plan = learner.plan
    if plan is None or not plan.quantized():
        raise ConfigError("the learner's plan quantizes no tensor; an engine checkpoint would be BF16 (use the "
                          "model folder itself, or a recipe whose precision: section quantizes something)")
    for entry in plan.quantized().values():
        naming.parts(target, entry.format)  # refuses formats the target cannot hold
    out, src = preflight(out, base, target, overwrite)
    quant_config, extra_files = emit_configs(plan, target)
    log(explain_text(plan, f"learner {type(learner).__name__} at step {learner.step}"))
    if max_shard_bytes is None:
        max_shard_bytes = max((p.stat().st_size for p in src.files.files), default=DEFAULT_MAX_SHARD_BYTES)

    shapes: dict[str, list[int]] = {}
    dtypes: dict[str, str] = {}
    counts: collections.Counter = collections.Counter()
    storages: set[int] = set()
    with atomic_output_dir(out, overwrite, (src.root,)) as tmp:
        writer = ShardWriter(tmp, max(max_shard_bytes, 1 << 20))
        for name, value in learner.export_weights():
            if name in shapes:
                raise CheckpointError(f"the learner exported '{name}' twice")
            encoded = encode_weight(name, value, plan, target)
            for k, v in encoded.items():
                v = v.detach().cpu()
                ptr = v.untyped_storage().data_ptr()
                if ptr in storages:  # safetensors refuses aliases (gate/up share one NVFP4 global scale tensor)
                    v = v.clone()
                storages.add(v.untyped_storage().data_ptr())
                writer.add(k, v)
            shapes[name] = list(value.shape)
            if is_quantized(value):
                h = src.tensors.get(name)
                dtypes[name] = "BF16" if h is None or name in src.fp8_scale_of else h.dtype
            else:
                dtypes[name] = st_dtype(value.dtype)
            if name.endswith(".weight") and len(value.shape) == 2:
                counts[planned_format(plan, name).value] += 1
        missing, extra = sorted(set(plan.entries) - set(shapes)), sorted(set(shapes) - set(plan.entries))
        if missing or extra:
            raise CheckpointError(f"the learner's export does not match its plan: {len(missing)} planned tensor(s) "
                                  f"not exported (e.g. {missing[:3]}), {len(extra)} not in the plan (e.g. "
                                  f"{extra[:3]}); every tensor must be exported once (C5)")
        index = writer.finish()
        digests = {p.name: sha256_file(p) for p in src.files.files}
        source = {"path": str(src.root.absolute()), "files": dict(sorted(digests.items())),
                  "fp8_block_input": src.is_fp8_block, "dtypes": dtypes, "shapes": shapes}
        write_metadata(tmp, hf_config=src.config, plan=plan, target=target, quant_config=quant_config,
                       extra_files=extra_files, copied_files=src.copied_files(), source=source,
                       index_name=INDEX_NAME, version=__version__,
                       extra={"producer": "export", "learner": {"class": type(learner).__name__,
                                                                "step": int(learner.step)}})
        bytes_out = sum(p.stat().st_size for p in tmp.iterdir() if p.is_file())
        summary = ExportSummary(out, target, dict(counts), len(index["weight_map"]), bytes_out, 0.0,
                                writer.num_shards, int(learner.step), [p.name for p in src.copied_files()],
                                src.not_copied())
    summary.seconds = time.perf_counter() - t0
    return summary
