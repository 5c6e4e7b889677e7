"""The recipe's ``model:``: an HF checkpoint folder as is, or ``tiny:<arch>`` built locally (no hub access)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from miles_lp.errors import ConfigError
from miles_lp.launch.recipe import ModelConfig


def prepare_model(cfg: ModelConfig, out: Path) -> Path:
    """The checkpoint folder the run trains: ``cfg.path`` itself, or a tiny model written to ``out``
    (deterministic in ``cfg.seed``; an existing folder built from the same settings is reused)."""
    if not cfg.is_tiny:
        path = Path(cfg.path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path {path}: not an HF checkpoint folder (no config.json); use a checkpoint "
                              "folder or tiny:<arch>")
        return path
    stamp = {"arch": cfg.arch, "num_layers": cfg.num_layers, "seed": cfg.seed, "overrides": dict(cfg.overrides)}
    marker = out / "miles_lp_tiny.json"
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return out
    import torch
    import transformers

    from miles_lp.checkpoint.tiny import tiny_config
    from miles_lp.io.atomic import atomic_output_dir

    config = tiny_config(cfg.arch, num_layers=cfg.num_layers)
    for key, value in cfg.overrides.items():
        if not hasattr(config, key):
            raise ConfigError(f"model.overrides.{key}: the {cfg.arch} config has no field '{key}'")
        setattr(config, key, value)
    torch.manual_seed(cfg.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with atomic_output_dir(out, overwrite=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        (Path(tmp) / marker.name).write_text(json.dumps(stamp))
    return out


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


#: the files of a model folder whose sizes ``model_id`` records (the weights and their index)
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")


def model_id(model_dir: str | Path) -> dict[str, Any] | None:
    """A cheap content id of a model folder: config.json's sha256 and the weight files' names and
    sizes (no weight bytes are read). run.json records it at start; a resume compares (``runner.check_resumed_model``),
    so a folder replaced by another model under the same path is refused. None when there is no config.json."""
    d = Path(model_dir)
    try:
        config = (d / "config.json").read_bytes()
    except OSError:
        return None
    weights = {p.name: p.stat().st_size for p in sorted(d.iterdir()) if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES)}
    return {"config_sha256": hashlib.sha256(config).hexdigest(), "weight_files": weights}


def model_id_difference(recorded: dict[str, Any], now: dict[str, Any] | None) -> str | None:
    """What differs between two ``model_id`` values, in words; None when they are equal."""
    if now is None:
        return "it has no config.json now"
    diffs = []
    if recorded.get("config_sha256") != now.get("config_sha256"):
        diffs.append("its config.json differs")
    a, b = dict(recorded.get("weight_files") or {}), dict(now.get("weight_files") or {})
    for name in sorted(set(a) | set(b)):
        if name not in b:
            diffs.append(f"{name} is gone")
        elif name not in a:
            diffs.append(f"{name} is new")
        elif a[name] != b[name]:
            diffs.append(f"{name} is {b[name]} bytes (was {a[name]})")
    return "; ".join(diffs) or None


def file_id(path: str | Path) -> dict[str, Any] | None:
    """A task file's content id (its sha256 and size), recorded in run.json as ``task_id`` and compared at resume:
    a prompts file changed between the start and a resume would feed the resumed steps other prompts. None when
    the file cannot be read."""
    h = hashlib.sha256()
    try:
        with Path(path).open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError:
        return None
    return {"path": str(path), "sha256": h.hexdigest(), "size": Path(path).stat().st_size}
