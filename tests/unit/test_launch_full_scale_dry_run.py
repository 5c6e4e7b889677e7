"""Every full-scale recipe's ``--dry-run`` on a config-only folder of its model (tests/fixtures/configs) lists
nothing in ``would_refuse_at_start`` but the absent weights, the absent task file and, on hardware without
Blackwell + Transformer Engine, the TE line: the recipes are otherwise runnable as written on their hardware."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_lp.cli import main

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"

#: what a config-only folder on this machine may still be refused for
ALLOWED = ("no safetensors weights", "task jsonl: cannot read",
           "impl=transformer_engine: only the local path (miles-lp GEMMs in Megatron's linears) runs here")

RECIPES = {
    "qwen3-8b-mxfp8.yaml": "qwen3-8b",
    "qwen3-8b-fp8-blockwise.yaml": "qwen3-8b",
    "qwen3-30b-a3b-mxfp8.yaml": "qwen3-30b-a3b",
    "qwen3-30b-a3b-nvfp4-experts.yaml": "qwen3-30b-a3b",
    "qwen3-30b-a3b-nvfp4-experts-hp.yaml": "qwen3-30b-a3b",
    "deepseek-v3-mxfp8.yaml": "deepseek-v3",
}


def _dry(capsys, recipe: str, model: str) -> dict:
    assert main(["run", str(ROOT / "recipes" / recipe), "--dry-run", "--set",
                 f"model.path={CONFIGS / model}"]) == 0
    return json.loads(capsys.readouterr().out)


def _unexpected(out: dict) -> list[str]:
    return [r for r in out["would_refuse_at_start"] if not any(a in r for a in ALLOWED)]


@pytest.mark.parametrize("recipe", [r for r in RECIPES if not r.startswith("deepseek")])
def test_full_scale_recipe_is_refused_for_nothing_but_weights_task_and_te(capsys, recipe):
    out = _dry(capsys, recipe, RECIPES[recipe])
    assert _unexpected(out) == [], out["would_refuse_at_start"]
    refused = " | ".join(out["would_refuse_at_start"])
    assert "no safetensors weights" in refused and "task jsonl: cannot read" in refused
    assert out["train_backend"] == "megatron" and out["sync_transport"] in ("nccl", "ray")
    assert out["ray"]["learner_ranks"]["ranks"] >= 2  # every learner rank a Ray actor, the layout holding the world


def test_deepseek_v3_recipe_is_refused_for_nothing_but_weights_task_and_te(capsys):
    """pp 8 over 61 layers: Megatron's uneven first / last stages, 7 + 6 stages of 8 + 6, as the recipe sets them."""
    out = _dry(capsys, "deepseek-v3-mxfp8.yaml", "deepseek-v3")
    assert _unexpected(out) == [], out["would_refuse_at_start"]
    refused = " | ".join(out["would_refuse_at_start"])
    assert "no safetensors weights" in refused and "task jsonl: cannot read" in refused
