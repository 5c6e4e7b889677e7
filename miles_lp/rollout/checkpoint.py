"""What the engine reads from a checkpoint folder, as an engine reads it.

* A converted checkpoint (``miles-lp convert``): ``config.json``'s ``quantization_config`` (read with the
  target engine's own matching rules, ``miles_lp.export.configs.engine_formats_for``: that, not the plan,
  decides which modules the engine builds quantized: C1), the ``miles_lp_plan.json`` record (target, the plan
  hash, and the NVFP4 activation scale scope / the FP8 blockwise activation scale rule per weight, which the
  engine config cannot express: the RL recipe
  scales activations per token at run time), and the safetensors headers.
* A plain HF checkpoint (no ``quantization_config``): every module BF16.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

from miles_lp.errors import CheckpointError
from miles_lp.formats.schemes import scheme_for
from miles_lp.formats.spec import Format

PLAN_FILE = "miles_lp_plan.json"
HF_QUANT_CONFIG = "hf_quant_config.json"


@dataclasses.dataclass
class TensorHeader:
    name: str
    dtype: str  # torch dtype name, e.g. "bfloat16", "float8_e4m3fn"
    shape: tuple[int, ...]
    file: Path


@dataclasses.dataclass
class EngineCheckpoint:
    root: Path
    config: dict  # config.json without quantization_config
    quant_config: dict | None
    target: str  # sglang | vllm | compressed-tensors ("sglang" for a BF16 checkpoint: nothing is quantized)
    formats: dict[str, Format]  # "<module>.weight" -> format, as the engine reads the config (absent: BF16)
    # NVFP4 weights: "token" | "tensor"; fp8_block weights: "pow2" | "fp32" (from the plan; default "token")
    activation_scale: dict[str, str]
    plan_hash: str | None
    tensors: dict[str, TensorHeader]

    def format_of(self, weight_name: str) -> Format:
        return self.formats.get(weight_name, Format.BF16)

    @property
    def quantized(self) -> bool:
        return any(f.quantized for f in self.formats.values())


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: not a Hugging Face checkpoint folder") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is unreadable: {exc}") from None


def tensor_headers(root: Path) -> dict[str, TensorHeader]:
    """Every tensor's header, read as the converter reads them (``safetensors_io.open_checkpoint``): with an index,
    exactly the shards it names, each checked against it (a missing shard or a stale index is a ``CheckpointError``
    naming the index and the shard: a glob served a partial model, or a stray extra file's tensors)."""
    from safetensors import safe_open

    from miles_lp.io.safetensors_io import INDEX_NAME, open_checkpoint, weight_candidates

    if not (root / INDEX_NAME).exists() and not weight_candidates(root):
        raise CheckpointError(f"{root}: no *.safetensors files (the engine loads safetensors only, never pickle)")

    files = open_checkpoint(root)  # which files: safetensors_io.select_weight_files, the converter's rule
    if files.ignored:  # never silent; a stray file is not served
        warnings.warn(f"{root}: not serving {files.ignored_note()}", stacklevel=3)
    for f in files.files:  # the loader reads through safetensors itself: it must see the names our parser saw
        with safe_open(str(f), framework="pt") as sf:
            theirs = set(sf.keys())
        ours = set(files.names_in_file(f))
        if theirs != ours:
            raise CheckpointError(f"{f}: safetensors reads {len(theirs)} tensors, the header {len(ours)} (e.g. "
                                  f"{sorted(theirs ^ ours)[:2]}); the file is corrupt: re-save it")
    out: dict[str, TensorHeader] = {}
    for name, h in files.tensors.items():
        dtype = _ST_TO_TORCH.get(h.dtype)
        if dtype is None:
            raise CheckpointError(f"{h.file.name}: tensor '{name}' has safetensors dtype {h.dtype}, "
                                  "which the engine does not load")
        out[name] = TensorHeader(name, dtype, tuple(h.shape), h.file)
    return out


_ST_TO_TORCH = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F8_E4M3": "float8_e4m3fn", "U8": "uint8",
                "I64": "int64", "I32": "int32", "BOOL": "bool"}


def open_checkpoint(path: str | Path) -> EngineCheckpoint:
    """Read config, quantization config, plan record and tensor headers; no tensor data yet."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint '{root}' is not a folder")
    config = _read_json(root / "config.json")
    qc = config.pop("quantization_config", None)
    tensors = tensor_headers(root)
    if qc is None:
        return EngineCheckpoint(root, config, None, "sglang", {}, {}, None, tensors)
    record_path = root / PLAN_FILE
    if not record_path.exists():
        raise CheckpointError(f"{root}: config.json has a quantization_config but there is no {PLAN_FILE}; the "
                              "reference engine serves checkpoints written by `miles-lp convert` (or plain BF16 ones)")
    record = _read_json(record_path)
    from miles_lp.export.configs import engine_formats_for
    from miles_lp.policy import PrecisionPlan, get_layout

    missing = [k for k in ("plan", "target") if k not in record]
    if missing:
        raise CheckpointError(f"{record_path}: no {' or '.join(missing)} recorded; the file is damaged or not "
                              "miles-lp's: re-run `miles-lp convert` for this checkpoint")
    target = record["target"]
    plan = PrecisionPlan.from_json(json.dumps(record["plan"]), layout=get_layout(config))
    files = {HF_QUANT_CONFIG: _read_json(root / HF_QUANT_CONFIG)} if (root / HF_QUANT_CONFIG).exists() else {}
    formats = {n: f for n, f in engine_formats_for(target, qc, files, plan).items() if f.quantized}
    scopes = {}
    for n, f in formats.items():
        scheme = scheme_for(f)
        if not scheme.scaled_activations:
            continue
        e = plan.entries.get(n)
        if scheme.activation_scopes:  # the activation global scale's scope (NVFP4)
            act = getattr(e, "activation_scale", None) if e is not None else None
            scopes[n] = {"per_tensor": "tensor", "per_token": "token"}.get(act, act) or "token"
        else:  # the learner's 1x128 activation tiles (fp8_block): power-of-two scales or fp32 ones
            scopes[n] = "pow2" if (e is not None and e.pow2_scales) else "fp32"
    return EngineCheckpoint(root, config, qc, target, formats, scopes, record.get("plan_hash"), tensors)


def iter_tensors(ck: EngineCheckpoint, device: str = "cpu") -> Iterator[tuple[str, object]]:
    """``(name, tensor)`` for every tensor of the checkpoint, file by file (safetensors only)."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for h in ck.tensors.values():
        by_file.setdefault(h.file, []).append(h.name)
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt", device=device) as sf:
            for n in names:
                yield n, sf.get_tensor(n)
