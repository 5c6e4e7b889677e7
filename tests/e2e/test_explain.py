"""`miles-lp explain` on the DeepSeek-V3-shaped fixture and on a saved tiny model."""

import json
from pathlib import Path

import pytest

from miles_lp.cli import main

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "deepseek_v3_config.json"


def test_explain_deepseek_v3_fixture(capsys, tmp_path):
    plan_path = tmp_path / "plan.json"
    rc = main(["explain", str(ROOT / "recipes" / "deepseek_v3_mxfp8.yaml"), "--model", str(FIXTURE), "--mtp",
               "--save-plan", str(plan_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "61 layers + 1 MTP" in out
    assert "layers 51-60    routed_experts  bf16" in out
    assert "layers 3-50     routed_experts  mxfp8" in out
    assert "rules[2] role=mla_kv_b" in out and "compression" in out
    assert json.loads(plan_path.read_text())["num_layers"] == 61


def test_explain_json_and_warnings(capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("precision:\n  default: mxfp8\n  rules:\n    - {role: attention, format: bf16}\n"
                      "    - {match: '*.o_proj', format: bf16}\n    - {match: '*.nothing', format: bf16}\n")
    rc = main(["explain", str(recipe), "--model", str(FIXTURE), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert report["totals"]["mxfp8"]["tensors"] > 40000
    assert any("shadowed" in w for w in report["warnings"]) and any("matched no tensor" in w for w in report["warnings"])


def test_explain_saved_tiny_model_uses_headers(capsys, tmp_path):
    pytest.importorskip("transformers")
    from miles_lp.checkpoint.tiny import make_tiny_model

    d = make_tiny_model("qwen3_moe", tmp_path / "m")
    rc = main(["explain", str(ROOT / "recipes" / "qwen3_moe_mxfp8_nvfp4_experts.yaml"), "--model", str(d)])
    out = capsys.readouterr().out
    assert rc == 0 and "safetensors headers" in out and "nvfp4" in out


def test_explain_bad_recipe_exit_2(capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("precision:\n  default: mxfp8\n  rules:\n    - {layers: last 150%, format: bf16}\n")
    assert main(["explain", str(recipe), "--model", str(FIXTURE)]) == 2
    assert "r.yaml:4:" in capsys.readouterr().err
