"""`miles-lp run --dry-run` on the engine backends: the vLLM target's config, and what a vLLM run would refuse."""

import json
from pathlib import Path

from miles_lp.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _dry(capsys, recipe, *sets):
    args = ["run", str(ROOT / "recipes" / recipe), "--dry-run"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_vllm_recipe_dry_run_emits_the_vllm_config(capsys, monkeypatch, tmp_path):
    fake = tmp_path / "python"
    fake.write_text("")
    monkeypatch.setenv("MILES_LP_VLLM_PYTHON", str(fake))
    out = _dry(capsys, "tiny-mxfp8-vllm.yaml")
    assert out["rollout_backend"] == "vllm"
    eng = out["engine_config"]
    assert eng["target"] == "vllm" and eng["engine_reads_plan"] is True
    assert eng["quantization_config"]["quant_method"] == "modelopt"
    assert out["would_refuse_at_start"] == []


def test_vllm_dry_run_names_a_missing_interpreter_and_quantized_experts(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MILES_LP_VLLM_PYTHON", str(tmp_path / "absent" / "python"))
    out = _dry(capsys, "tiny-nvfp4-experts.yaml", "rollout.backend=vllm")
    refuse = " | ".join(out["would_refuse_at_start"])
    assert "no vLLM interpreter (set MILES_LP_VLLM_PYTHON" in refuse
    assert "quantized routed experts are Triton-only in vLLM" in refuse


def test_vllm_run_refuses_quantized_experts_before_starting_vllm(tmp_path):
    """What the dry run lists is what the run refuses: no vLLM process is started for it."""
    import pytest

    from miles_lp.errors import ConfigError
    from miles_lp.launch.recipe import load_recipe
    from miles_lp.launch.runner import Run

    recipe = load_recipe(ROOT / "recipes" / "tiny-nvfp4-experts.yaml",
                         ["rollout.backend=vllm", f"logging.output_dir={tmp_path}", "logging.progress=false"])
    with pytest.raises(ConfigError, match=r"quantized routed-expert weights \(e.g. model\.layers\.\d+\.mlp\.experts"):
        Run.start(recipe)


def test_sglang_launch_dry_run_names_a_missing_interpreter(capsys, monkeypatch, tmp_path):
    """rollout.server launch starts SGLang from its own venv: without one the dry run says so, as for vLLM."""
    fake = tmp_path / "python"
    fake.write_text("")
    monkeypatch.setenv("MILES_LP_SGLANG_PYTHON", str(fake))
    assert _dry(capsys, "tiny-mxfp8-sglang.yaml")["would_refuse_at_start"] == []
    monkeypatch.setenv("MILES_LP_SGLANG_PYTHON", str(tmp_path / "absent" / "python"))
    refuse = " | ".join(_dry(capsys, "tiny-mxfp8-sglang.yaml")["would_refuse_at_start"])
    assert "rollout.server launch: no SGLang interpreter (set MILES_LP_SGLANG_PYTHON" in refuse
