"""`verify OUT --recipe R.yaml --target T [--source IN]`: a checkpoint without our record
(miles_lp_plan.json) is checked against a plan compiled from the recipe: tensors, config (as the engine reads it),
scales, and with --source the grid and error bounds; source (no recorded sha256) and record are skipped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.checkpoint.verify import verify_checkpoint
from miles_lp.cli import main
from miles_lp.policy import load_policy

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "policies/qwen3-moe-mxfp8-nvfp4-experts.yaml")
OTHER = str(ROOT / "recipes" / "policies/qwen3-moe-nvfp4-experts.yaml")  # attention BF16: another plan
PLAN = "miles_lp_plan.json"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("vr")
    src = make_tiny_model("qwen3_moe", root / "src", seed=5)
    outs = {}
    for target in ("sglang", "compressed-tensors"):
        out = root / f"out-{target}"
        assert main(["convert", "--hf-checkpoint", str(src), "--output", str(out), "--recipe", RECIPE,
                     "--target", target, "--no-progress"]) == 0
        (out / PLAN).unlink()  # as another tool's checkpoint: no record
        outs[target] = out
    return src, outs


def _verdicts(report):
    return {c.check: c.verdict for c in report.checks}


def _verify(out, target, source=None, recipe=RECIPE):
    return verify_checkpoint(out, source=source, policy=load_policy(recipe), target=target, recipe_name=recipe)


def test_without_a_record_plain_verify_can_check_nothing(made):
    _, outs = made
    v = _verdicts(verify_checkpoint(outs["sglang"]))
    assert v["record"] == "FAIL" and v["tensors"] == v["config"] == v["scales"] == "skip"


@pytest.mark.parametrize("target", ["sglang", "compressed-tensors"])
def test_recipe_mode_with_source_runs_every_check(made, target):
    src, outs = made
    report = _verify(outs[target], target, source=src)
    v = _verdicts(report)
    assert report.ok, report.format()
    assert v == {"index": "pass", "record": "skip", "plan": "pass", "tensors": "pass", "config": "pass",
                 "scales": "pass", "source": "skip", "grid": "pass", "error": "pass"}, report.format()
    assert "no record of the converted files' sha256" in next(c.detail for c in report.checks if c.check == "source")


def test_recipe_mode_without_source_reads_the_names_back(made):
    _, outs = made
    report = _verify(outs["sglang"], "sglang")
    v = _verdicts(report)
    assert report.ok and v["tensors"] == v["config"] == v["scales"] == v["plan"] == "pass", report.format()
    assert v["grid"] == v["error"] == v["source"] == "skip"
    assert "the checkpoint's tensors imply for sglang" in next(c.detail for c in report.checks if c.check == "plan")


def test_a_scale_off_the_te_grid_fails_grid(made, tmp_path):
    """An MXFP8 scale one exponent higher in a few blocks (what CONTRACT 9 measured for llm-compressor)."""
    src, outs = made
    out = tmp_path / "o"
    shutil.copytree(outs["sglang"], out)
    for f in sorted(out.glob("*.safetensors")):
        sd = load_file(f)
        names = [n for n in sd if n.endswith("q_proj.weight_scale_inv")]
        if names:
            sd[names[0]] = sd[names[0]].clone()
            sd[names[0]].view(-1)[:3] += 1
            save_file(sd, str(f), metadata={"format": "pt"})
            break
    else:
        pytest.fail("no MXFP8 scale found")
    assert _verdicts(_verify(out, "sglang"))["scales"] == "pass"  # in range: only the grid check can see it
    report = _verify(out, "sglang", source=src)
    grid = next(c for c in report.checks if c.check == "grid")
    assert not report.ok and grid.verdict == "FAIL" and names[0] in grid.detail


def test_another_plan_or_target_fails(made):
    _, outs = made
    v = _verdicts(_verify(outs["sglang"], "sglang", recipe=OTHER))  # attention is MXFP8 on disk, BF16 in OTHER
    assert v["tensors"] == "FAIL" and v["config"] == "FAIL"
    v = _verdicts(_verify(outs["sglang"], "vllm"))  # vLLM names the MXFP8 scale weight_scale
    assert v["tensors"] == "FAIL"


def test_foreign_config_fields_are_notes_without_a_record(made, tmp_path):
    src, outs = made
    out = tmp_path / "o"
    shutil.copytree(outs["compressed-tensors"], out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["producer"] = {"name": "another-tool"}  # engines ignore it
    (out / "config.json").write_text(json.dumps(cfg))
    report = _verify(out, "compressed-tensors")
    config = next(c for c in report.checks if c.check == "config")
    assert config.verdict == "pass" and "notes (not failures without a record)" in config.detail
    assert "'producer'" in config.detail


def test_cli(made, capsys):
    src, outs = made
    out = str(outs["sglang"])
    assert main(["verify", out, "--recipe", RECIPE, "--target", "sglang", "--source", str(src)]) == 0
    assert "result: OK" in capsys.readouterr().out
    assert main(["verify", out, "--recipe", RECIPE]) == 2
    assert "--recipe needs --target" in capsys.readouterr().err
    assert main(["verify", out, "--target", "sglang"]) == 2
    assert "--target goes with --recipe" in capsys.readouterr().err
    assert main(["verify", out]) == 1  # no record: FAIL
