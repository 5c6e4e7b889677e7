"""Dry validation pass over an input checkpoint: folder, config, every shard header, the index, dtypes.

Runs before any byte of output is written (STYLE: "a dry validation pass over all shards"). Reads headers
only; non-finite values are checked while converting (they need the data).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from miles_lp.errors import CheckpointError, ConfigError, LayoutError
from miles_lp.io.safetensors_io import (
    FLOAT_DTYPES,
    INDEX_NAME,
    CheckpointFiles,
    TensorHeader,
    open_checkpoint,
    weight_candidates,
)

FP8_BLOCK = 128
SCALE_INV_SUFFIX = "_scale_inv"  # DeepSeek-V3 block-FP8: "<m>.weight" + "<m>.weight_scale_inv"
# Side files: every top-level file but the weights is copied into the output (tokenizers of any
# kind, remote code named by config.json's ``auto_map``, processor configs, README, LICENSE, ...); these are not.
REWRITTEN_FILES = ("config.json", "miles_lp_plan.json")  # the output's own are written
_QUANT_METADATA = ("hf_quant_config.json",)  # ModelOpt's: the output's own is written from the plan
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")  # never read (safetensors only)
_OTHER_WEIGHT_SUFFIXES = (".safetensors", ".h5", ".msgpack", ".gguf", ".onnx", ".npz")


def side_file_verdict(path: Path) -> str | None:
    """Why a top-level entry of the input folder is NOT copied into the output, or None if it is copied."""
    name = path.name
    if path.is_dir():
        return "a folder: only top-level files are copied"
    if not path.is_file():
        return "not a regular file"
    if name.startswith("."):
        return "a hidden file"
    if name in REWRITTEN_FILES:
        return "rewritten for the output"
    if name in _QUANT_METADATA:
        return "the input's quantization metadata: the output's own is written from the plan"
    if name == INDEX_NAME or name.endswith(".index.json"):
        return "a weight index: the output's own is written"
    if name.endswith(_PICKLE_SUFFIXES):
        return "pickle weights, never read or copied: safetensors only"
    if name.endswith(_OTHER_WEIGHT_SUFFIXES):
        return "weights, not converted: the output holds its own"
    return None


@dataclasses.dataclass
class SourceCheckpoint:
    """A validated input checkpoint."""

    root: Path
    config: dict
    files: CheckpointFiles
    fp8_scale_of: dict[str, str]  # block-FP8 weight name -> its weight_scale_inv name
    logical: dict[str, tuple[int, ...]]  # what the model holds: every tensor but the FP8 scale_inv ones

    @property
    def tensors(self) -> dict[str, TensorHeader]:
        return self.files.tensors

    @property
    def is_fp8_block(self) -> bool:
        return bool(self.fp8_scale_of)

    def copied_files(self) -> list[Path]:
        """Every top-level file of the input the output carries unchanged (``side_file_verdict`` is None)."""
        return [p for p in sorted(self.root.iterdir()) if side_file_verdict(p) is None]

    def not_copied(self) -> list[str]:
        """``"<name> (why)"`` for every top-level entry not copied, except the weights and files rewritten for
        the output; remote code that config.json's or tokenizer_config.json's ``auto_map`` names but the folder
        lacks is listed too."""
        converted = {p.name for p in self.files.files} | {INDEX_NAME, "config.json"}
        ignored = {p.name: why for p, why in self.files.ignored.items()}  # other *.safetensors: why not read
        out = []
        for p in sorted(self.root.iterdir()):
            why = ignored.get(p.name) or side_file_verdict(p)
            if why is not None and p.name not in converted:
                out.append(f"{p.name}{'/' if p.is_dir() else ''} ({why})")
        named = {m: "config.json" for m in auto_map_modules(self.config)}
        try:  # Kimi-K2 / Moonlight: tokenizer_config.json's auto_map names tokenization_kimi.py
            tok = json.loads((self.root / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            tok = None
        if isinstance(tok, dict):
            named.update({m: "tokenizer_config.json" for m in auto_map_modules(tok) if m not in named})
        out += [f"{m} (named by {by} auto_map, absent from {self.root})" for m, by in sorted(named.items())
                if not (self.root / m).is_file()]
        return out


def auto_map_modules(config: dict) -> list[str]:
    """The local ``<module>.py`` files a config's ``auto_map`` names (config.json, tokenizer_config.json) (``"configuration_deepseek.DeepseekV3Config"``;
    ``"repo--module.Class"`` entries live in another repository and are left out)."""
    auto_map = config.get("auto_map")
    refs = []
    for v in (auto_map.values() if isinstance(auto_map, dict) else ()):
        refs += v if isinstance(v, list) else [v]
    mods = {r.rsplit(".", 1)[0] + ".py" for r in refs if isinstance(r, str) and "." in r and "--" not in r}
    return sorted(mods)


def read_config(root: str | Path) -> dict:
    root = Path(root)
    if not root.exists():
        raise CheckpointError(f"input folder {root} does not exist; pass the folder of a Hugging Face "
                              "checkpoint to --hf-checkpoint")
    if not root.is_dir():
        raise CheckpointError(f"input {root} is not a folder; pass the folder of a Hugging Face checkpoint")
    path = root / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{root} has no config.json; pass the folder of a Hugging Face checkpoint "
                              "(config.json + *.safetensors)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{path}: no 'model_type'; cannot tell the architecture")
    return config


def already_quantized(config: dict) -> tuple[object, object] | None:
    """``(quant_method, weight_block_size)`` when ``config`` says its weights are already quantized in a form the
    converter does not read (anything but DeepSeek-style block FP8), else None: the one rule convert and
    ``explain --model`` refuse by."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    block = qc.get("weight_block_size") if isinstance(qc, dict) else None
    if method == "fp8" and list(block or []) == [FP8_BLOCK, FP8_BLOCK]:
        return None
    return method, block


def validate_source(root: str | Path) -> SourceCheckpoint:
    """Check the folder, config.json, every shard header and the index; classify block-FP8 weights."""
    root = Path(root)
    config = read_config(root)
    quantized = already_quantized(config)
    if quantized is not None:
        method, block = quantized
        raise CheckpointError(
            f"{root / 'config.json'}: the input is already quantized (quant_method={method!r}, "
            f"weight_block_size={block!r}); convert from the BF16/FP16/FP32 checkpoint or a DeepSeek-style "
            "block-FP8 one (quant_method 'fp8', weight_block_size [128, 128])")
    files = open_checkpoint(root)
    fp8_scale_of: dict[str, str] = {}
    scale_names: set[str] = set()
    for name, h in files.tensors.items():
        if h.dtype in FLOAT_DTYPES or name.endswith(SCALE_INV_SUFFIX):
            continue
        if h.dtype == "F8_E4M3":
            sname = name + SCALE_INV_SUFFIX
            s = files.tensors.get(sname)
            if s is None:
                raise CheckpointError(f"FP8 tensor '{name}' ({h.file.name}) has no '{sname}': only DeepSeek-style "
                                      "block-FP8 inputs (128x128 blocks with weight_scale_inv) are supported")
            if len(h.shape) != 2:
                raise CheckpointError(f"FP8 tensor '{name}' must be 2-D, got {list(h.shape)}")
            want = tuple(math.ceil(d / FP8_BLOCK) for d in h.shape)
            if s.shape != want or s.dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"'{sname}' is {s.dtype} {list(s.shape)}; a 128x128 block scale of "
                                      f"{list(h.shape)} must be a float {list(want)}")
            fp8_scale_of[name] = sname
            scale_names.add(sname)
        # other dtypes (integer buffers) are copied as they are
    stray = [n for n in files.tensors if n.endswith(SCALE_INV_SUFFIX) and n not in scale_names]
    if stray:
        raise CheckpointError(f"'{stray[0]}' has no FP8 weight next to it ('{stray[0][:-len(SCALE_INV_SUFFIX)]}' "
                              "is missing or not float8_e4m3fn); the checkpoint is inconsistent")
    logical = {n: h.shape for n, h in files.tensors.items() if n not in scale_names}
    return SourceCheckpoint(root, config, files, fp8_scale_of, logical)


def read_safetensors_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes from safetensors headers only (no tensor data is read), through the converter's
    index-aware reader (``open_checkpoint``, whose ``select_weight_files`` picks the files): with
    ``model.safetensors.index.json`` exactly the shards it names are read, a shard it names that is missing, or a
    tensor it names that no shard holds, is a ``CheckpointError`` naming the index and the shard (a
    glob gave a silently partial plan, and a stray ``consolidated.safetensors`` next to the shards was read too);
    without an index, ``model.safetensors`` alone, else the one ``*.safetensors``, and several are an error; a
    corrupt or truncated file is a ``CheckpointError`` naming it."""
    return {name: h.shape for name, h in open_checkpoint(model_dir).tensors.items()}


def has_safetensors(model_dir: Path) -> bool:
    """The folder holds weights the converter would read (an index, or any non-hidden ``*.safetensors``)."""
    return (model_dir / INDEX_NAME).exists() or bool(weight_candidates(model_dir))


def load_model_layout(model: str | Path, include_mtp: bool = False):
    """``--model``: a directory with config.json (+ safetensors headers if present) or a config.json path.

    Returns ``(ModelLayout, {name: shape}, where the names came from)`` (``miles-lp explain``)."""
    from miles_lp.policy import get_layout

    path = Path(model)
    cfg_path = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--model: no config.json at {cfg_path}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--model: {cfg_path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"--model: {cfg_path} holds a JSON {type(config).__name__}, not a config mapping")
    try:
        layout = get_layout(config)
        if path.is_dir() and has_safetensors(path):
            files = open_checkpoint(path)
            where = f"safetensors headers in {path}"
            if files.ignored:  # named, never silent: e.g. Mistral's consolidated.safetensors
                where += f" (other files: {files.ignored_note()})"
            return layout, {name: h.shape for name, h in files.tensors.items()}, where
        return layout, layout.synthesize(include_mtp=include_mtp), f"synthesized from {cfg_path}"
    except LayoutError as exc:
        raise LayoutError(f"--model {cfg_path}: {exc}") from None
