"""The full-scale recipes validate with `miles-lp run --dry-run` against config.json fixtures of the real shapes
(no weights): schema, plan (with the rules each recipe states), task, backends and placement."""

import json
from pathlib import Path

import pytest

from miles_lp.cli import main

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
RECIPES = {"qwen3-8b-mxfp8": "qwen3-8b", "qwen3-8b-fp8-blockwise": "qwen3-8b", "qwen3-30b-a3b-mxfp8": "qwen3-30b-a3b",
           "qwen3-30b-a3b-nvfp4-experts": "qwen3-30b-a3b", "qwen3-30b-a3b-nvfp4-experts-hp": "qwen3-30b-a3b",
           "deepseek-v3-mxfp8": "deepseek-v3"}
ROOT = Path(__file__).resolve().parents[2]


def sets(model):
    return ["--set", f"model.path={FIX / model}", "--set", f"task.path={FIX / 'prompts.jsonl'}"]


# the default suite dry-runs two (a dense and an MoE one); the rest are slow (DeepSeek-V3's plan has 45k
# tensors: ~13 s to compile on 2 cores). `pytest -m slow tests/e2e/test_experiment_recipes.py` runs them all.
FAST = ("qwen3-8b-mxfp8", "qwen3-30b-a3b-nvfp4-experts")


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(RECIPES)])
def test_dry_run_full_scale(name, capsys):
    assert main(["run", str(ROOT / "recipes" / f"{name}.yaml"), "--dry-run", *sets(RECIPES[name])]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["train_backend"] == "megatron" and out["rollout_backend"] == "sglang"
    ray = out["ray"]
    assert {k: ray[k] for k in ("enabled", "address", "placement")} == {"enabled": True, "address": "auto",
                                                                       "placement": "split"}
    lr = ray["learner_ranks"]  # every learner rank a Ray actor, one GPU each, the layout holding the world
    assert lr["actor_per_rank"] and lr["ranks"] == lr["nodes"] * lr["gpus_per_node"] >= 2
    assert out["plan_hash"] and out["quantized_tensors"] > 0 and out["plan_warnings"] == []
    # the engine's config, emitted and re-read with SGLang's own matching: every planned weight as planned
    eng = out["engine_config"]
    assert eng["target"] == "sglang" and eng["engine_reads_plan"] is True
    assert eng["quantization_config"]["quant_method"] in ("mxfp8", "modelopt", "fp8")
    # Megatron/TE from the plan; the sizes were checked against the model; the one-process limit is stated
    meg = out["megatron"]
    assert meg["parallel"]["tp"] >= 1 and meg["kwargs"] and isinstance(meg["env"], dict)
    # what the Megatron learner's own size rules refuse at start: only the Transformer Engine path off Blackwell + TE
    # (tp / pp / dp / ep > 1, MLA included, run as a MegatronGroup and are not listed)
    refusals = [w for w in out["would_refuse_at_start"] if w.startswith("train.megatron")]
    if meg["parallel"].get("impl", "transformer_engine") == "local":  # qwen3-8b-fp8-blockwise: the local path
        assert refusals == [], refusals
    else:
        assert len(refusals) == 1 and "the Transformer Engine path needs Blackwell + TE" in refusals[0], refusals
    local = main(["run", str(ROOT / "recipes" / f"{name}.yaml"), "--dry-run", *sets(RECIPES[name]),
                  "--set", "train.megatron.impl=local"])
    assert local == 0
    after = json.loads(capsys.readouterr().out)["would_refuse_at_start"]
    assert [w for w in after if w.startswith("train.megatron")] == [], after


def test_dry_run_refuses_a_tp_that_does_not_divide_the_heads(capsys):
    """Qwen3-8B has 32 heads and 8 key/value heads: tp 3 cannot split them."""
    assert main(["run", str(ROOT / "recipes" / "qwen3-8b-mxfp8.yaml"), "--dry-run", *sets("qwen3-8b"),
                 "--set", "train.megatron.tp=3"]) == 2
    assert "tp=3 must divide the attention heads" in capsys.readouterr().err


def plan(name):
    from miles_lp.launch.recipe import load_recipe
    from miles_lp.policy import compile_plan, get_layout

    r = load_recipe(ROOT / "recipes" / f"{name}.yaml", [f"model.path={FIX / RECIPES[name]}",
                                                       f"task.path={FIX / 'prompts.jsonl'}"])
    cfg = json.loads((FIX / RECIPES[name] / "config.json").read_text())
    return r, compile_plan(r.precision, get_layout(cfg))


@pytest.mark.slow
def test_deepseek_plan_states_its_rules():
    from miles_lp.formats.spec import Format

    _, p = plan("deepseek-v3-mxfp8")
    f = p.format_for
    assert f("model.layers.10.self_attn.kv_b_proj.weight") is Format.BF16
    assert f("model.layers.10.mlp.shared_experts.gate_proj.weight") is Format.BF16
    assert f("model.layers.10.mlp.experts.3.up_proj.weight") is Format.MXFP8
    assert f("model.layers.60.mlp.experts.3.up_proj.weight") is Format.BF16  # last 15% of 61 layers


def test_qwen_plans_state_their_rules():
    from miles_lp.formats.spec import Format

    for name, backward in (("qwen3-30b-a3b-nvfp4-experts", "dequantized"),
                           ("qwen3-30b-a3b-nvfp4-experts-hp", "high_precision")):
        r, p = plan(name)
        assert r.precision.backward.value == backward if hasattr(r.precision.backward, "value") else \
            r.precision.backward == backward
        assert p.format_for("model.layers.3.mlp.experts.5.down_proj.weight") is Format.NVFP4
        assert p.format_for("model.layers.3.self_attn.q_proj.weight") is Format.MXFP8
        assert p.format_for("model.layers.47.mlp.experts.5.down_proj.weight") is Format.BF16
    _, p = plan("qwen3-8b-mxfp8")
    assert p.format_for("model.layers.35.mlp.gate_up_proj.weight" if "model.layers.35.mlp.gate_up_proj.weight"
                        in p.entries else "model.layers.35.mlp.gate_proj.weight") is Format.MXFP8
    assert p.format_for("lm_head.weight") is Format.BF16


def test_dry_run_names_a_missing_model(tmp_path, capsys):
    assert main(["run", str(ROOT / "recipes" / "qwen3-8b-mxfp8.yaml"), "--dry-run", "--set",
                 f"model.path={tmp_path}"]) != 0
    assert "no config.json" in capsys.readouterr().err
