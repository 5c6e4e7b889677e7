"""The RL loop of ``miles-lp run`` with real SGLang (its CPU platform) as the sampler, the BF16 sampler arms:

* ``tiny-bf16``: BF16 end to end; every check that can run in raise mode, answered inside SGLang; the server killed
  between two steps is found dead, restarted (a new process) and resynced in full; the run resumed from its
  checkpoint starts a fresh server and goes on.
* ``tiny-mxfp8-bf16-sampler``: an MXFP8 learner with a BF16 sampler (the comparison arm).

The engine is what the runner builds for ``rollout.server: launch``: ``SGLangHTTPEngine(None, flavor="launch",
checkpoint=<the run's engine checkpoint>, update_dir=<run>/engine_updates)``, handed to ``Run`` as ``build_engine``
(the recipe key itself is the runner's to route). Slow: each server start is ~30 s on an idle 2-core machine and
~3 min when the cores are shared."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang_env import record, sglang_python_or_skip

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SMALL = ["rl.prompts_per_step=4", "rl.group_size=4", "logging.progress=false", "rollout.backend=sglang",
         "rollout.url=http://127.0.0.1:9", "rollout.device=auto"]  # the url is not used: build_engine starts the server


def _recipe(name: str, tmp: Path, *sets: str):
    from miles_lp.launch.recipe import load_recipe

    return load_recipe(REPO / "recipes" / name, [*SMALL, f"logging.output_dir={tmp / 'runs'}", *sets])


def _builder(run_dir: Path, python: str, ckpt_of):
    from miles_lp.rollout.sglang import SGLangHTTPEngine

    def build():
        return SGLangHTTPEngine(None, flavor="launch", checkpoint=ckpt_of(run_dir), update_dir=run_dir / "engine_updates",
                                server_options={"python": python, "threads": 1})
    return build


def _train_every_check_clean(recipe, tmp_path, name: str, python: str) -> list[dict]:
    """A 2-step run on real SGLang (started by ``_builder``): the initial sync and every step's checks clean."""
    from miles_lp.launch.runner import Run

    run_dir = tmp_path / "runs" / name
    run = Run.start(recipe, run_name=name, build_engine=_builder(run_dir, python, lambda d: d / "engine_init"))
    try:
        assert run.initial.ok and run.initial.verdict("self_check").ok
        rows = run.train(progress=False)
    finally:
        run.close()
    assert len(rows) == 2
    for i, m in enumerate(rows):
        for c in ("layer_audit", "grid", "self_check", "storage", "completeness", "version"):
            assert m[f"sync/check/{c}"] == 1.0, (i, c)
    return rows


def test_bf16_run_on_real_sglang_restart_and_resume(tmp_path):
    from miles_lp.launch.runner import Run

    python = sglang_python_or_skip()
    checks = [f"sync.checks.{c}=raise" for c in ("layer_audit", "grid", "storage", "completeness", "version")]
    recipe = _recipe("tiny-bf16.yaml", tmp_path, "steps=3", "checkpoint_every=1", *checks)
    run_dir = tmp_path / "runs" / "bf16"
    build = _builder(run_dir, python, lambda d: d / "model")  # all-BF16: the engine serves the model folder itself
    run = Run.start(recipe, run_name="bf16", build_engine=build)
    try:
        assert run.engine_ckpt == run_dir / "model"
        assert run.initial.ok and run.initial.verdict("grid").reason.endswith("(full compare)")
        rows = [run.step_once()]
        run.engine.server.kill()  # the SGLang server dies between two steps
        rows.append(run.step_once())
        assert run.restarts == 1 and run.engine.server.running
    finally:
        run.close()
    for i, m in enumerate(rows):
        for c in ("layer_audit", "grid", "storage", "completeness", "version"):
            assert m[f"sync/check/{c}"] == 1.0, (i, c)
        record(what="sglang-cpu run", recipe="tiny-bf16", step=i, kl=m["rollout_corr/kl"],
               max_abs_logprob_diff=m["rollout_corr/logprob_abs_diff_max"], sync_seconds=m["perf/sync_seconds"])
        assert m["rollout_corr/logprob_abs_diff_max"] < 0.05
    assert rows[1]["rollout/engine_restarts"] == 1.0
    resumed = Run.resume(run_dir, build_engine=build)
    try:
        assert resumed.step == 2
        last = resumed.train(progress=False)
    finally:
        resumed.close()
    assert len(last) == 1 and last[0]["sync/check/grid"] == 1.0 and last[0]["sync/check/storage"] == 1.0


def test_mxfp8_learner_bf16_sampler_arm_on_real_sglang(tmp_path):
    from miles_lp.launch.runner import Run

    python = sglang_python_or_skip()
    recipe = _recipe("tiny-mxfp8-bf16-sampler.yaml", tmp_path, "steps=2", "checkpoint_every=0")
    run_dir = tmp_path / "runs" / "arm"
    run = Run.start(recipe, run_name="arm", build_engine=_builder(run_dir, python, lambda d: d / "model"))
    try:
        rows = run.train(progress=False)
    finally:
        run.close()
    assert len(rows) == 2
    for i, m in enumerate(rows):
        for c in ("grid", "storage", "completeness", "version"):
            assert m[f"sync/check/{c}"] == 1.0, (i, c)
        record(what="sglang-cpu run", recipe="tiny-mxfp8-bf16-sampler", step=i, kl=m["rollout_corr/kl"],
               max_abs_logprob_diff=m["rollout_corr/logprob_abs_diff_max"], sync_seconds=m["perf/sync_seconds"])


def test_mxfp8_run_on_real_sglang_every_check_raise(tmp_path):
    """The shared MXFP8 grid: SGLang serves the run's converted checkpoint (``engine_init``) through its own loader
    with miles-lp's CPU linear method; C1-C5 and the version in raise mode, answered inside SGLang."""

    python = sglang_python_or_skip()
    checks = [f"sync.checks.{c}=raise" for c in ("layer_audit", "grid", "self_check", "storage", "completeness",
                                                 "version")]
    recipe = _recipe("tiny-mxfp8.yaml", tmp_path, "steps=2", "checkpoint_every=0", *checks)
    rows = _train_every_check_clean(recipe, tmp_path, "mxfp8", python)
    for i, m in enumerate(rows):
        record(what="sglang-cpu run", recipe="tiny-mxfp8", step=i, kl=m["rollout_corr/kl"],
               max_abs_logprob_diff=m["rollout_corr/logprob_abs_diff_max"], sync_seconds=m["perf/sync_seconds"])
        assert m["rollout_corr/logprob_abs_diff_max"] < 0.05


def test_fp8_block_run_on_real_sglang_every_check_raise(tmp_path):
    """FP8 blockwise on one grid: SGLang serves the run's ``quant_method: fp8`` + ``weight_block_size: [128, 128]``
    checkpoint through its own loader with miles-lp's CPU linear method (1x128 activation tiles, the learner's
    rule); C1-C5 and the version in raise mode, answered inside SGLang (``tiny:qwen3_wide``: whole 128-row shards)."""

    python = sglang_python_or_skip()
    # server miles-lp: SMALL's placeholder url stands; build_engine starts the server (as ``server: launch`` does)
    recipe = _recipe("tiny-fp8-blockwise-e2e-sglang.yaml", tmp_path, "steps=2", "checkpoint_every=0",
                     "rollout.server=miles-lp")
    rows = _train_every_check_clean(recipe, tmp_path, "fp8-block", python)
    for i, m in enumerate(rows):
        record(what="sglang-cpu run", recipe="tiny-fp8-blockwise-e2e-sglang", step=i, kl=m["rollout_corr/kl"],
               max_abs_logprob_diff=m["rollout_corr/logprob_abs_diff_max"], c3=m["sync/check/self_check/figure"])
        assert 0 < m["sync/check/self_check/figure"] < 0.1  # the 1x128 activation grid's error (0.026 measured)
        assert m["rollout_corr/logprob_abs_diff_max"] < 0.05
