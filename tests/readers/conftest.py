"""Shared fixtures of the reader tests: tiny models, their conversions, fixed prompts.

Everything is built once per session (tiny random models from ``make_tiny_model``, no downloads) and cached
by (model, format, target), so the transformers, compressed-tensors and vLLM tests read the same files.
"""

from __future__ import annotations

from pathlib import Path

import pytest

#: Token-id prompts (the tiny models have no tokenizer; vocab 256).
PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37], [200, 3, 77, 150, 42, 8, 99, 120, 64, 7, 250, 11]]

#: --format / recipe name -> precision policy mapping
POLICIES = {
    "mxfp8": {"default": "mxfp8"},
    "nvfp4": {"default": "nvfp4"},
    "mxfp8+nvfp4-experts": {"default": "mxfp8", "rules": [{"role": "routed_experts", "format": "nvfp4"}]},
    "nvfp4-experts": {"default": "bf16", "rules": [{"role": "routed_experts", "format": "nvfp4"}]},
    "mxfp8-bf16-experts": {"default": "mxfp8", "rules": [{"role": "routed_experts", "format": "bf16"}]},
    "mxfp8-attn+nvfp4-mlp": {"default": "mxfp8", "rules": [{"role": "dense_mlp", "format": "nvfp4"}]},
}


class Store:
    def __init__(self, root: Path):
        self.root = root
        self._models: dict[str, Path] = {}
        self._converted: dict[tuple[str, str, str], Path] = {}
        self._deq: dict[Path, Path] = {}

    def model(self, arch: str) -> Path:
        if arch not in self._models:
            from miles_lp.checkpoint.tiny import make_tiny_model

            self._models[arch] = make_tiny_model(arch, self.root / f"src-{arch}", seed=11, num_layers=2)
        return self._models[arch]

    def converted(self, arch: str, fmt: str, target: str) -> Path:
        key = (arch, fmt, target)
        if key not in self._converted:
            from miles_lp.checkpoint.convert import convert_checkpoint
            from miles_lp.config import Where
            from miles_lp.policy import parse_policy

            out = self.root / f"{arch}-{fmt}-{target}"
            policy = parse_policy(POLICIES[fmt], Where("<reader test>", "precision"))
            convert_checkpoint(self.model(arch), out, policy, target=target, progress=False, log=lambda s: None)
            self._converted[key] = out
        return self._converted[key]

    def dequantized(self, ckpt: Path, arch: str) -> Path:
        """A BF16 checkpoint of ``ckpt``'s dequantized weights (the reference's input)."""
        if ckpt not in self._deq:
            from tests.readers.reference import dequantized_checkpoint

            self._deq[ckpt] = dequantized_checkpoint(ckpt, self.model(arch), self.root / f"deq-{ckpt.name}")
        return self._deq[ckpt]


@pytest.fixture(scope="session")
def store(tmp_path_factory) -> Store:
    return Store(tmp_path_factory.mktemp("readers"))
