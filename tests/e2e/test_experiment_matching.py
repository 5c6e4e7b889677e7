"""`miles-lp experiment matching` end to end on the tiny recipe: real arms built by the launch package, the
shared grid below the BF16 sampler on k3, outputs written; bad input named."""

import json

import pytest

from miles_lp.cli import main

SMALL = ["--steps", "1", "--prompts", "4", "--resamples", "300", "--set", "rollout.max_response_len=3"]


def test_matching_two_arms(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["experiment", "matching", "recipes/tiny-mxfp8.yaml", *SMALL, "--arms", "shared grid,bf16 sampler",
                 "--workdir", str(tmp_path / "w"), "--out", str(out)]) == 0
    j = json.loads((out / "matching.json").read_text())
    shared, bf16 = j["arms"]["shared grid"], j["arms"]["bf16 sampler"]
    assert shared["model_sha"] == bf16["model_sha"]
    assert shared["tokens"] > 0 and shared["prompts"] == 4
    assert shared["k3_kl"] < bf16["k3_kl"] and shared["k3_kl_pct_vs_ref"] < -50
    assert (out / "matching.png").stat().st_size > 0 and "| shared grid |" in (out / "matching.md").read_text()


@pytest.mark.slow
def test_matching_five_arms_order_on_k3(tmp_path):
    out = tmp_path / "m"
    assert main(["experiment", "matching", "recipes/tiny-mxfp8.yaml", "--steps", "2", "--prompts", "8",
                 "--resamples", "500", "--set", "rollout.max_response_len=4", "--out", str(out)]) == 0
    j = json.loads((out / "matching.json").read_text())
    k3 = next(v for v in j["order"] if v["metric"] == "k3_kl")
    assert k3["holds"], k3


def test_matching_bad_input(tmp_path, capsys):
    assert main(["experiment", "matching", "recipes/tiny-bf16.yaml", *SMALL]) != 0
    assert "compares samplers against an MXFP8 learner" in capsys.readouterr().err
    assert main(["experiment", "matching", "recipes/tiny-mxfp8.yaml", *SMALL, "--arms", "shared,bf16"]) != 0
    assert "unknown arm 'shared'" in capsys.readouterr().err
    assert main(["experiment", "matching", "recipes/tiny-mxfp8.yaml", *SMALL, "--set", "rl.nope=1"]) != 0
    assert "nope" in capsys.readouterr().err


@pytest.mark.slow
def test_micro_batch_sweep_on_tiny_runs(tmp_path, capsys):
    """The sweep rebuilds each run's learner from its recipe and trains on one identical batch (~50 s)."""
    runs = "docs/results/experiments-cpu-2026-12-01"
    assert main(["experiment", "cost", f"{runs}/tiny-bf16-varlen", f"{runs}/tiny-mxfp8-varlen", "--micro-batch-sweep",
                 "--sizes", "64,512,8192", "--repeats", "1", "--out", str(tmp_path)]) == 0
    j = json.loads((tmp_path / "sweep.json").read_text())
    for r in j["runs"].values():
        assert len(r["points"]) == 3 and min(p[1] for p in r["points"]) == 1 < max(p[1] for p in r["points"])
    assert "added_per_micro_batch_vs_base" in j["runs"]["tiny-mxfp8-varlen"]
