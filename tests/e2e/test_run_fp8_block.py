"""recipes/tiny-fp8-blockwise-e2e.yaml through `miles-lp run` (CPU, emulated): the learner trains fp8_block, the
reference engine serves its own grid from a ``quant_method: fp8`` checkpoint, every sync's checks C1-C5 pass
in raise mode and the sampler's log-probs equal the learner's; `miles-lp selftest sync` on the same recipe catches
the faults each check exists for (the fp32 block scales are scales to the sync: an unwritten one is seen; a sampler
that rounds them to powers of two serves another grid, which C2 sees)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_lp.cli import main
from miles_lp.launch.run_dir import RunDir

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-fp8-blockwise-e2e.yaml"
CHECKS = ("layer_audit", "grid", "self_check", "storage", "completeness", "version")


@pytest.mark.slow
def test_tiny_fp8_blockwise_recipe_runs_with_every_check_passing(tmp_path, capsys):
    assert main(["run", str(RECIPE), "--run-name", "fp8b", "--no-progress", "--set", "steps=2",
                 "--set", f"logging.output_dir={tmp_path / 'runs'}", "--set", "checkpoint_every=0"]) == 0
    rd = RunDir(tmp_path / "runs" / "fp8b")
    rows = rd.read_metrics()
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert all(r[f"sync/check/{c}"] == 1.0 for c in CHECKS), {c: r[f"sync/check/{c}"] for c in CHECKS}
        assert 0 < r["sync/check/self_check/figure"] < 0.1  # the served GEMM vs float64 on the synced weights
        assert abs(r["rollout_corr/kl"]) < 1e-3
    # before any update every served tensor is the learner's own: log-probs equal to float noise. After one, the
    # high-precision tensors (norms, embeddings, lm_head) are served in BF16 from the learner's FP32 masters, as in
    # every recipe of this stack (tiny-mxfp8 measures the same order of log-prob difference)
    assert rows[0]["rollout_corr/logprob_abs_diff_max"] < 1e-5
    qc = json.loads((rd.path / "engine_init" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    assert json.loads(capsys.readouterr().out)["steps"] == 2


@pytest.mark.slow
def test_selftest_sync_on_the_fp8_blockwise_recipe(tmp_path):
    out = tmp_path / "table.json"
    rc = main(["selftest", "sync", "--recipe", str(RECIPE), "--only", "missing scales", "--only", "stale derived",
               "--only", "engine loader skips", "--only", "first/last", "--only", "powers of two", "--json", str(out),
               "--workdir", str(tmp_path / "w")])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 0, rows
    assert rows[0]["fault"] == "healthy sync" and rows[0]["verdict"] == "clean"
    by = {r["fault"]: r for r in rows[1:]}
    assert len(by) == 5 and all(r["verdict"] == "CAUGHT" for r in by.values()), by
    assert "completeness" in by["missing scales (unwritten staging)"]["caught_by"]
    assert "self_check" in by["stale derived layout (finish without rebuild)"]["caught_by"]
    assert "grid" in by["engine loader skips names"]["caught_by"]
    assert "layer_audit" in by["first/last BF16 layers disagree"]["caught_by"]
    assert by["different grid: FP8 block scales rounded to powers of two"]["caught_by"] == ["grid"]
