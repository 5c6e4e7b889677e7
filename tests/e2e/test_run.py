"""The main job end to end on the real learner, engine and sync (tiny model, CPU): the CI smoke run, a
bit-identical resume, and the failures that must stop a run (non-finite log-probs, a failed checkpoint)."""

from __future__ import annotations

import errno
import json

import pytest
import torch

from miles_lp.cli import main
from miles_lp.errors import CheckpointError
from miles_lp.launch.recipe import load_recipe
from miles_lp.launch.run_dir import RunDir
from miles_lp.launch.runner import Run, deterministic_metrics
from miles_lp.rl.step import RunError

RECIPE = """\
model: {path: "tiny:qwen3", num_layers: 1}
precision: {default: mxfp8, backward: dequantized}
train: {lr: 3.0e-3, device: cpu}
rollout: {device: cpu, max_response_len: 3}
sync:
  checks: {layer_audit: raise, grid: raise, storage: raise, completeness: raise, version: raise}
rl: {prompts_per_step: 2, group_size: 4, mini_batches: 2, clip_high: 0.28}
task: {name: copy, length: 1, alphabet: 4}
logging: {output_dir: OUT, progress: false}
steps: 3
seed: 0
checkpoint_every: 2
"""

REQUIRED = ["reward/mean", "reward/std", "response_length/mean", "response_length/clip_ratio", "actor/entropy",
            "actor/pg_clipfrac", "rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/training_ppl",
            "rollout_corr/rollout_ppl", "rollout_corr/log_ppl_diff", "rollout_corr/ppl_ratio",
            "rollout_corr/chi2_token", "rollout_corr/chi2_seq", "rollout_corr/rollout_is_mean",
            "rollout_corr/rollout_is_eff_sample_size", "rollout_corr/logprob_abs_diff_mean",
            "timing_s/generate", "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/sync",
            "timing_s/checks", "tokens/generate", "tokens/update_actor", "sync/check/grid", "sync/check/sentinel"]


@pytest.fixture
def recipe_file(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.replace("OUT", str(tmp_path / "runs")))
    return p


def test_smoke_cli_run(recipe_file, tmp_path, capsys):
    """CI smoke: 3 steps through `miles-lp run`, every headline metric present and finite."""
    assert main(["run", str(recipe_file), "--run-name", "smoke", "--no-progress"]) == 0
    rd = RunDir(tmp_path / "runs" / "smoke")
    rows = rd.read_metrics()
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in REQUIRED:
        assert all(key in r and r[key] == r[key] for r in rows), key
    assert rows[-1]["sync/check/grid"] == 1.0  # shared grid: every synced tensor byte-equal
    assert abs(rows[0]["rollout_corr/kl"]) < 1e-3  # the engine serves the learner's own grid
    assert rows[-1]["rollout/weight_version"] == 3.0  # initial sync + one per step
    assert (rd.path / "recipe.yaml").is_file() and json.loads((rd.path / "run.json").read_text())["plan_hash"]
    assert rd.latest().name == "step_000003"
    assert json.loads(capsys.readouterr().out)["steps"] == 3
    _export_run_dir_is_the_trained_grid(rd, tmp_path)


def _export_run_dir_is_the_trained_grid(rd: RunDir, tmp_path) -> None:
    """`miles-lp export --run-dir`: the engine checkpoint of the run's latest learner state, i.e. every quantized
    weight the codec's grid of the TRAINED master (not of the initial model), every other tensor its BF16."""
    from safetensors.torch import load_file

    from miles_lp.formats import quantize_mxfp8
    from miles_lp.train.state_io import load_learner_state

    out = tmp_path / "trained-mxfp8"
    assert main(["export", "--run-dir", str(rd.path), "--target", "sglang", "--output", str(out)]) == 0
    assert main(["verify", str(out)]) == 0
    from miles_lp.checkpoint.verify import verify_checkpoint

    report = {c.check: c for c in verify_checkpoint(out, source=rd.path / "model", log=lambda s: None).checks}
    assert report["source"].verdict == "pass"  # the model the learner was built on
    assert report["grid"].verdict == "skip" and "trained" in report["grid"].detail  # not "off the learner's grid"
    assert all(c.verdict != "FAIL" for c in report.values())
    exported = {}
    for f in out.glob("*.safetensors"):
        exported.update(load_file(f))
    master = load_learner_state(rd.latest() / "learner")["model"]
    initial = {}
    for f in (rd.path / "model").glob("*.safetensors"):
        initial.update(load_file(f))
    q = quantize_mxfp8(master["model.layers.0.mlp.down_proj.weight"], axis=-1)
    data = exported["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(exported["model.layers.0.mlp.down_proj.weight_scale_inv"], q.scale)
    assert not torch.equal(master["model.layers.0.mlp.down_proj.weight"].to(initial[
        "model.layers.0.mlp.down_proj.weight"].dtype), initial["model.layers.0.mlp.down_proj.weight"])  # trained
    assert torch.equal(exported["model.norm.weight"], master["model.norm.weight"].to(torch.bfloat16))
    with pytest.raises(SystemExit):  # the run's own policy: --format is refused by the parser
        main(["export", "--run-dir", str(rd.path), "--format", "mxfp8", "--output", str(tmp_path / "x")])
    assert main(["export", "--run-dir", str(rd.path), "--hf-checkpoint", str(rd.path / "model"),
                 "--output", str(tmp_path / "x")]) == 2


def test_export_run_dir_from_another_folder(tmp_path, monkeypatch):
    """A run under a relative logging.output_dir, exported from another working directory: run.json records the
    model folder absolute, so `export --run-dir` finds it."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.replace("OUT", "runs"))
    monkeypatch.chdir(tmp_path / "a")
    assert main(["run", str(p), "--run-name", "rel", "--no-progress", "--set", "steps=1"]) == 0
    monkeypatch.chdir(tmp_path / "b")
    out = tmp_path / "b" / "exported"
    assert main(["export", "--run-dir", str(tmp_path / "a" / "runs" / "rel"), "--output", str(out)]) == 0
    assert list(out.glob("*.safetensors"))


def test_resume_from_another_folder_reads_the_runs_own_model(tmp_path, monkeypatch, capsys):
    """On the real stack: a run started with a relative model.path, resumed from a folder holding
    another model of that name. The run's recipe.yaml names the model absolute, so the resume reads the run's
    (its learner, frozen KL reference and config); the user's recipe file read there names the other one and
    is refused, naming both."""
    from miles_lp.checkpoint.tiny import make_tiny_model

    a, b = tmp_path / "a", tmp_path / "b"
    make_tiny_model("qwen3", a / "dq", num_layers=1)
    make_tiny_model("qwen3", b / "dq", num_layers=1, seed=5)
    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.replace("OUT", str(tmp_path / "runs")).replace('"tiny:qwen3", num_layers: 1', "dq")
                 .replace("clip_high: 0.28}", "clip_high: 0.28, kl_coef: 0.05}"))
    monkeypatch.chdir(a)
    first = Run.start(load_recipe(p, ["steps=1"]), "rel")
    first.train()
    first.close()
    rd = first.dir
    assert load_recipe(rd.recipe_path).model.path == str(a / "dq")  # recorded absolute
    monkeypatch.chdir(b)
    assert main(["run", str(p), "--resume", str(rd.path), "--set", "steps=2", "--no-progress"]) == 2
    assert f"model.path: this recipe names {b / 'dq'}, the run's {a / 'dq'}" in capsys.readouterr().err
    run = Run.resume(rd.path, load_recipe(rd.recipe_path, ["steps=2"]))
    try:
        assert run.model_dir == a / "dq" and run.reference is not None
        run.train(progress=False)
    finally:
        run.close()
    assert [r["step"] for r in rd.read_metrics()] == [0, 1] and len(rd.info()["resumes"]) == 1


@pytest.mark.slow
def test_resume_is_bit_identical(recipe_file):
    straight = load_recipe(recipe_file, ["steps=4"])
    a = Run.start(straight, "straight")
    a.train()
    two = Run.start(load_recipe(recipe_file, ["steps=2"]), "resumed")
    two.train()
    b = Run.resume(two.dir.path, straight)
    assert b.step == 2
    b.train()
    ra, rb = deterministic_metrics(a.dir.read_metrics()), deterministic_metrics(b.dir.read_metrics())
    assert len(ra) == len(rb) == 4
    assert ra == rb  # every metric of every step, exactly
    sa, sb = a.learner.state_dict()["model"], b.learner.state_dict()["model"]
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.slow
def test_resume_refuses_a_different_recipe(recipe_file):
    r = Run.start(load_recipe(recipe_file, ["steps=2"]), "x")
    r.train()
    with pytest.raises(Exception, match="differs from the run's recipe.yaml in section\\(s\\) rl"):
        Run.resume(r.dir.path, load_recipe(recipe_file, ["rl.kl_coef=0.1"]))


def test_an_environment_override_of_the_checks_is_printed_and_recorded(recipe_file, monkeypatch, capsys):
    """MILES_LP_SYNC_CHECKS=off left in a shell turns raise-mode checks off: never unseen."""
    monkeypatch.setenv("MILES_LP_SYNC_CHECKS", "off")
    monkeypatch.setenv("MILES_LP_SYNC_CHECK_GRID", "raise")  # the per-check variable wins
    r = Run.start(load_recipe(recipe_file, ["steps=1"]), "envoff")
    try:
        m = r.train()[-1]
    finally:
        r.close()
    err = capsys.readouterr().err
    assert "sync.checks.storage: raise -> off (from the environment: MILES_LP_SYNC_CHECKS, " in err
    assert "sync.checks.grid" not in err  # raise in the recipe, raise from the environment
    info = json.loads((r.dir.path / "run.json").read_text())
    assert info["sync_check_overrides"]["storage"] == ["raise", "off"] and "grid" not in info["sync_check_overrides"]
    assert m["sync/check/storage"] == -1.0 and m["sync/check/grid"] == 1.0  # what ran is what was printed
    # a resume under another environment records its own overrides, the first start's stay
    monkeypatch.delenv("MILES_LP_SYNC_CHECKS")
    monkeypatch.delenv("MILES_LP_SYNC_CHECK_GRID")
    monkeypatch.setenv("MILES_LP_SYNC_CHECK_COMPLETENESS", "warn")
    b = Run.resume(r.dir.path, load_recipe(recipe_file, ["steps=2"]))
    b.close()
    assert "sync.checks.completeness: raise -> warn (from the environment: MILES_LP_SYNC_CHECK_COMPLETENESS)" in \
        capsys.readouterr().err
    info = json.loads((r.dir.path / "run.json").read_text())
    assert info["sync_check_overrides"]["storage"] == ["raise", "off"]
    assert [{k: v for k, v in e.items() if k != "time"} for e in info["resumes"]] == [
        {"resumed_at_step": 1, "sync_check_overrides": {"completeness": ["raise", "warn"]}}]


@pytest.mark.slow
def test_nonfinite_rollout_logprobs_stop_the_run_naming_the_step(recipe_file):
    from miles_lp.launch.runner import make_engine

    recipe = load_recipe(recipe_file)
    holder = {}

    def poisoned():
        eng = make_engine(recipe, holder["ckpt"])
        real = eng.generate

        def generate(inputs, sampling):
            gens = real(inputs, sampling)
            if eng.weight_version >= 2:  # from the second step on
                lp = gens[3].logprobs.clone()  # the engine's are inference tensors
                lp[0] = float("nan")
                gens[3].logprobs = lp
            return gens
        eng.generate = generate
        return eng

    class R(Run):
        def __init__(self, *a, **kw):
            holder["ckpt"] = None
            super().__init__(*a, build_engine=self._engine, **kw)

        def _engine(self):
            holder["ckpt"] = self.engine_ckpt
            return poisoned()

    run = R.start(recipe, "nan")
    with pytest.raises(RunError, match="step 1: non-finite rollout log-probs from the engine in sample 3"):
        run.train()


@pytest.mark.slow
def test_failed_checkpoint_keeps_the_previous_one(recipe_file, monkeypatch):
    run = Run.start(load_recipe(recipe_file, ["checkpoint_every=1", "steps=3"]), "disk")
    run.step_once()
    first = run.dir.latest()
    assert first.name == "step_000001"
    import miles_lp.train.state_io as sio

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(sio, "save_learner_state", full)
    with pytest.raises(CheckpointError, match="checkpoint at step 2 could not be written.*No space left.*previous "
                                              "checkpoint is intact.*step_000001"):
        run.step_once()
    assert run.dir.latest() == first and (first / "learner" / "tensors.safetensors").is_file()
    assert not list(run.dir.checkpoints.glob(".*step_000002*")) and not (run.dir.checkpoints / "step_000002").exists()


def test_invalid_recipe_fails_before_anything_starts(recipe_file, tmp_path, capsys):
    recipe_file.write_text(recipe_file.read_text().replace("group_size: 4", "group_size: 4, gruop: 1"))
    assert main(["run", str(recipe_file)]) == 2
    assert "unknown key 'gruop'" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_dry_run(recipe_file, capsys):
    assert main(["run", str(recipe_file), "--dry-run"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["quantized_tensors"] > 0 and out["samples_per_step"] == 8



def test_megatron_learner_runs_the_main_job(tmp_path):
    """`train.backend: megatron`: the same loop on the Megatron-Core learner (tp = 1, CPU), every check in raise
    mode, the engine on the learner's own grid at the start (kl 0) and after each sync (grid check 1)."""
    pytest.importorskip("megatron.core")
    p = tmp_path / "meg.yaml"
    p.write_text(RECIPE.replace("OUT", str(tmp_path / "runs")).replace(
        "train: {lr: 3.0e-3, device: cpu}", "train: {backend: megatron, lr: 3.0e-3, device: cpu}").replace(
        "steps: 3", "steps: 2"))
    assert main(["run", str(p), "--run-name", "meg", "--no-progress"]) == 0
    rows = RunDir(tmp_path / "runs" / "meg").read_metrics()
    assert [r["step"] for r in rows] == [0, 1]
    # the learner's grid, up to fp32 rounding: the engine's GEMMs have other row counts than the learner's (a GRPO
    # group's prompt is prefilled once), and CPU BLAS rounds per shape (~2e-8 here; a grid mismatch is ~1e-3)
    assert abs(rows[0]["rollout_corr/kl"]) < 1e-6
    assert all(r["sync/check/grid"] == 1.0 and r["sync/check/layer_audit"] == 1.0 for r in rows)
    assert rows[-1]["actor/step"] == 4.0  # two mini-batches per step


def test_sampling_temperature_is_the_learners(recipe_file):
    """At rollout.sampling.temperature 0.6 the engine reports the tempered log-prob and the learner divides its
    logits by 0.6 (verl's actor temperature): the two agree token for token. A learner left at T = 1 scores the
    same tokens differently (mean |dlogprob| ~0.06 here) while rollout_corr/kl stays near 0."""
    import dataclasses

    rows = {}
    for name, force in (("t06", None), ("t06_learner_t1", 1.0)):
        r = load_recipe(recipe_file, ["steps=1", "rollout.sampling.temperature=0.6"])
        if force is not None:
            r = dataclasses.replace(r, train=dataclasses.replace(r.train, logits_temperature=force))
        run = Run.start(r, name)
        try:
            rows[name] = run.train()[0]
        finally:
            run.close()
    # equal up to fp32 GEMM-shape rounding (~2e-8: the engine prefills each distinct prompt once, other row counts
    # than the learner's packed row); the wrong temperature is ~0.06
    assert rows["t06"]["rollout_corr/logprob_abs_diff_mean"] < 1e-6 and abs(rows["t06"]["rollout_corr/kl"]) < 1e-6
    assert rows["t06_learner_t1"]["rollout_corr/logprob_abs_diff_mean"] > 0.01


def test_a_failed_warn_mode_check_is_printed_and_summarised(recipe_file, capsys):
    """warn mode: the failed verdict reaches stderr (not only a 0.0 in metrics.jsonl) and the summary counts it."""
    from miles_lp.launch.runner import summary

    # the untrained policy hits the 3-token length cap: the C6 sentinel trips after one such step
    r = Run.start(load_recipe(recipe_file, ["steps=2", "sync.checks.sentinel=warn",
                                            "sync.sentinel.consecutive_steps=1"]), "warned")
    try:
        rows = r.train()
    finally:
        r.close()
    err = capsys.readouterr().err
    failed = [k for k, v in rows[-1].items() if k.startswith("sync/check/") and k.count("/") == 2 and v == 0.0]
    assert failed, rows[-1]
    assert "miles-lp run: sync v" in err and "FAILED" in err
    s = summary(rows)
    assert all(s[f"{k}/failed_steps"] >= 1 for k in failed)


def test_aborted_generations_are_regenerated_or_dropped_on_the_real_stack(recipe_file):
    """On the real learner, engine and sync: the second prompt's group comes back aborted (as after
    another client's /pause_generation with mode abort). With a retry only that group is sampled again and the step
    trains on every sample; without one the group is dropped whole and the step trains on the rest, checks passing."""
    import dataclasses

    for retries, trained, dropped in ((1, 8.0, 0.0), (0, 4.0, 1.0)):
        run = Run.start(load_recipe(recipe_file, ["steps=1", "checkpoint_every=0", f"rl.abort_retries={retries}"]),
                        f"abort{retries}")
        real, calls = run.engine.generate, []

        def generate(inputs, sampling, real=real, calls=calls):
            gens = real(inputs, sampling)
            calls.append(len(inputs))
            if len(calls) == 1:  # the first call: group 1 (samples 4-7) cut short
                gens = [dataclasses.replace(g, finish_reason="abort") if i >= 4 else g for i, g in enumerate(gens)]
            return gens

        run.engine.generate = generate
        try:
            m = run.train()[-1]
        finally:
            run.close()
        assert calls == ([8, 4] if retries else [8])
        assert m["rollout/aborted"] == 4.0 and m["rollout/aborted_groups_dropped"] == dropped
        assert m["rollout/regenerated"] == (4.0 if retries else 0.0)
        assert m["rl/samples_trained"] == trained and m["tokens/generate"] > 0
        assert m["sync/check/grid"] == 1.0 and m["sync/check/completeness"] == 1.0
