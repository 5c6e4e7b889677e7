"""Tiny checkpoints for the rollout tests, benchmarks and the sync selftest, built once per process.

``tiny_checkpoint("qwen3_moe", "qwen3_moe_mxfp8_nvfp4_experts.yaml")`` makes a random tiny HF model
(``make_tiny_model``) and converts it with ``convert_checkpoint``; the result is cached per process in one
temporary folder (removed at exit). ``precision``: ``None`` (the BF16 HF checkpoint itself), a recipe file
name under ``recipes/`` or a path, or a format name (``mxfp8`` / ``nvfp4``: the policy default, no rules).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

_ROOT: Path | None = None


def _root() -> Path:
    global _ROOT
    if _ROOT is None:
        _ROOT = Path(tempfile.mkdtemp(prefix="miles-lp-rollout-"))
        atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)
    return _ROOT


def recipe_path(name: str) -> Path:
    p = Path(name)
    if p.exists():
        return p
    return Path(__file__).resolve().parents[2] / "recipes" / name


@functools.cache
def tiny_hf(arch: str, seed: int = 0, num_layers: int = 4) -> Path:
    from miles_lp.checkpoint.tiny import make_tiny_model

    return make_tiny_model(arch, _root() / f"{arch}-s{seed}-l{num_layers}", seed=seed, num_layers=num_layers)


def policy_for(precision: str):
    if precision.endswith((".yaml", ".yml")):
        from miles_lp.policy import load_policy

        return load_policy(recipe_path(precision))
    from miles_lp.config import Where
    from miles_lp.policy import parse_policy

    return parse_policy({"default": precision, "backward": "dequantized"}, Where("<testing>", "precision"))


@functools.cache
def tiny_checkpoint(arch: str, precision: str | None = None, target: str = "sglang", seed: int = 0,
                    num_layers: int = 4) -> Path:
    src = tiny_hf(arch, seed, num_layers)
    if precision is None:
        return src
    from miles_lp.checkpoint.convert import convert_checkpoint

    tag = Path(precision).stem.replace("+", "_")
    out = _root() / f"{arch}-s{seed}-l{num_layers}-{tag}-{target}"
    convert_checkpoint(src, out, policy_for(precision), target=target, progress=False, log=lambda s: None)
    return out
