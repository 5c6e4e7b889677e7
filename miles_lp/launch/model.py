"""The recipe's ``model:``: an HF checkpoint folder as is, or ``tiny:<arch>`` built locally (no hub access)."""

from __future__ import annotations

import json
from pathlib import Path

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

    from miles_lp.checkpoint.atomic import atomic_output_dir
    from miles_lp.checkpoint.tiny import tiny_config

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
