"""Run folders under faults: a torn metrics line, a folder left by a run that never started, and the
combinations the recipe refuses before anything is built."""

from __future__ import annotations

import json

import pytest

from miles_lp.errors import CheckpointError, ConfigError
from miles_lp.launch.recipe import load_recipe
from miles_lp.launch.run_dir import RunDir
from tests.e2e.test_run import RECIPE


def test_torn_last_metrics_line_is_dropped_and_damage_elsewhere_is_named(tmp_path, capsys):
    rd = RunDir.create(tmp_path, "r")
    rd.append_metrics(0, {"a": 1.0})
    with rd.metrics_path.open("a") as f:
        f.write('{"step": 1, "a": 0.')  # a kill in the middle of an append
    assert rd.read_metrics() == [{"step": 0, "a": 1.0}]
    assert "metrics.jsonl:2: dropping a torn last line" in capsys.readouterr().err
    rd.truncate_metrics(1)  # what a resume does first: the torn line is gone from the file too
    assert [json.loads(x) for x in rd.metrics_path.read_text().splitlines()] == [{"step": 0, "a": 1.0}]
    rd.metrics_path.write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(CheckpointError, match=r"metrics.jsonl:2: not a JSON metrics row .* repair or remove"):
        rd.read_metrics()


def test_run_folder_messages_tell_a_run_from_a_leftover(tmp_path):
    rd = RunDir.create(tmp_path, "r")
    (rd.path / "model").mkdir()
    with pytest.raises(ConfigError, match=r"holds no checkpoint to resume from; choose another logging.run_name or "
                                          r"remove that folder"):
        RunDir.create(tmp_path, "r")
    rd.discard_unstarted()
    assert not rd.path.exists()
    rd = RunDir.create(tmp_path, "r")
    rd.save_checkpoint(1, {"kind": "x"}, {})
    with pytest.raises(ConfigError, match=r"holds a run; .* continue it with --resume"):
        RunDir.create(tmp_path, "r")
    rd.discard_unstarted()  # a run with a checkpoint is never removed
    assert (rd.checkpoints / "latest.json").is_file()


@pytest.mark.parametrize("overrides, match", [
    (["sampler_precision={default: mxfp8}", "ray.enabled=true"], r"sampler_precision.*without Ray only so far"),
    (["sampler_precision={default: mxfp8}", "train.backend=megatron"], r"sampler_precision.*megatron learner"),
    (["model.path=tiny:qwen3_moe", "rl.routing_replay=true", "rollout.backend=vllm"],
     r"rl.routing_replay.*vLLM's offline engine does not report"),
])
def test_combinations_refused_at_parse_naming_the_key(tmp_path, overrides, match):
    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.replace("OUT", str(tmp_path / "runs")))
    with pytest.raises(ConfigError, match=match):
        load_recipe(p, overrides)


def test_broadcast_with_the_megatron_learner_is_accepted(tmp_path):
    """The sync's own group leaves the Megatron learner's world alone (the run: tests/e2e/test_run_ray.py::
    test_megatron_learner_syncs_over_its_own_group), so the combination is no longer refused."""
    from miles_lp.launch.actor_sync import check_broadcast

    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.replace("OUT", str(tmp_path / "runs")))
    check_broadcast(load_recipe(p, ["ray.enabled=true", "sync.transport=gloo", "train.backend=megatron"]))


@pytest.mark.parametrize("overrides, match", [
    (["rollout.backend=sglang", "rollout.url=http://127.0.0.1:1", "rollout.kv_cache=fp8_e4m3"],
     r"rollout.kv_cache.*backend sglang does not read kv_cache .*--kv-cache-dtype"),
    (["rollout.backend=sglang", "rollout.url=http://127.0.0.1:1", "rollout.max_model_len=4096"],
     r"backend sglang does not read max_model_len"),
    (["rollout.backend=vllm", "rollout.device=cuda"], r"backend vllm does not read device .*CPU build"),
    (["rollout.max_model_len=4096"], r"backend reference does not read max_model_len"),
])
def test_rollout_keys_a_backend_does_not_read_are_refused(tmp_path, overrides, match):
    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.replace("OUT", str(tmp_path / "runs")).replace("rollout: {device: cpu, ", "rollout: {"))
    with pytest.raises(ConfigError, match=match):
        load_recipe(p, overrides)


def test_response_cap_shorter_than_the_answer_is_refused_at_start(tmp_path):
    from miles_lp.launch.dry_run import dry_run
    from miles_lp.launch.runner import Run

    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.replace("OUT", str(tmp_path / "runs")))
    recipe = load_recipe(p, ["task.length=3", "rollout.max_response_len=2"])  # the answer: 3 symbols + EOS
    msg = r"rollout.max_response_len 2 is shorter than the task's longest answer \(4 tokens"
    assert any("rollout.max_response_len 2 is shorter" in r for r in dry_run(recipe)["would_refuse_at_start"])
    with pytest.raises(ConfigError, match=msg):
        Run.start(recipe, run_name="short")
    assert not (tmp_path / "runs" / "short").exists()


def test_response_cap_beyond_the_model_context_is_refused_naming_both_keys(tmp_path):
    """Prompt + max_response_len over max_position_embeddings (256 for tiny models) is refused in
    the dry run and at start, before the learner or the engine is built; the fitting cap still starts."""
    from miles_lp.launch.dry_run import dry_run
    from miles_lp.launch.runner import Run, check_task_fits
    from miles_lp.rl.tasks import make_task

    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.replace("OUT", str(tmp_path / "runs")))
    recipe = load_recipe(p, ["rollout.max_response_len=100000"])
    msg = (r"rollout.max_response_len 100000 \(--set rollout.max_response_len=100000\) \+ the task's longest prompt "
           r"\(3 tokens\) = 100003 tokens, beyond the model's context \(max_position_embeddings 256 .*set "
           r"rollout.max_response_len <= 253")
    refused = dry_run(recipe)["would_refuse_at_start"]
    assert len(refused) == 1 and "max_position_embeddings 256" in refused[0]
    with pytest.raises(ConfigError, match=msg):
        Run.start(recipe, run_name="long")
    assert not (tmp_path / "runs" / "long").exists()
    task = make_task(load_recipe(p).task)
    assert task.max_prompt_len == 3  # BOS, 1 symbol, SEP
    fits = load_recipe(p, ["rollout.max_response_len=253"])
    check_task_fits(fits, task, {"max_position_embeddings": 256})  # exactly the context: accepted
    assert dry_run(fits)["would_refuse_at_start"] == []
    with pytest.raises(ConfigError, match=r"= 257 tokens, beyond .*max_position_embeddings 256"):
        check_task_fits(load_recipe(p, ["rollout.max_response_len=254"]), task,
                        {"text_config": {"max_position_embeddings": 256}})
    check_task_fits(load_recipe(p, ["rollout.max_response_len=100000"]), task, {})  # a config that does not say


@pytest.mark.parametrize("extra, match", [(["--run-name", "y"], "--run-name names a new run"),
                                          (["--dry-run"], "--dry-run checks a recipe before a new run")])
def test_run_cli_refuses_flags_a_resume_would_ignore(tmp_path, capsys, extra, match):
    from miles_lp.cli import main

    assert main(["run", "recipes/tiny-mxfp8.yaml", "--resume", str(tmp_path), *extra]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--resume", "x"], ["--dry-run"], ["--run-name", "y"]])
def test_prepare_engine_refuses_run_flags(tmp_path, capsys, extra):
    from miles_lp.cli import main

    assert main(["run", "recipes/tiny-mxfp8.yaml", "--prepare-engine", str(tmp_path / "e"), *extra]) == 2
    assert "--prepare-engine only writes the engine's checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()
    (tmp_path / "e").mkdir()  # an existing folder is never written into
    assert main(["run", "recipes/tiny-mxfp8.yaml", "--prepare-engine", str(tmp_path / "e")]) == 2
    assert "already exists" in capsys.readouterr().err


def test_a_cuda_device_on_a_host_without_cuda_is_one_line(tmp_path, capsys, monkeypatch):
    import torch

    from miles_lp.cli import main
    from miles_lp.launch.dry_run import dry_run
    from miles_lp.launch.recipe import load_recipe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    recipe = load_recipe("recipes/tiny-mxfp8.yaml", ["train.device=cuda", f"logging.output_dir={tmp_path}"])
    assert any("train.device: cuda, but this host has no CUDA device" in r for r in dry_run(recipe)["would_refuse_at_start"])
    assert main(["run", "recipes/tiny-mxfp8.yaml", "--set", "train.device=cuda", "--set",
                 f"logging.output_dir={tmp_path}", "--run-name", "nocuda"]) == 2
    err = capsys.readouterr().err
    assert "train.device: cuda, but this host has no CUDA device; set train.device: cpu" in err and "Traceback" not in err
    assert not (tmp_path / "nocuda").exists()


def test_prepare_engine_prints_a_run_command_that_parses_with_the_users_overrides(tmp_path, capsys):
    import shlex

    from miles_lp.cli import main
    from miles_lp.launch.recipe import load_recipe

    assert main(["run", "recipes/tiny-mxfp8.yaml", "--set", "steps=2", "--set", "rollout.device=cpu",
                 "--prepare-engine", str(tmp_path / "e")]) == 0
    line = next(ln.strip() for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("miles-lp run "))
    argv = shlex.split(line)[2:]
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert "steps=2" in sets and "rollout.device=auto" in sets and "rollout.device=cpu" not in sets
    r = load_recipe(argv[0], sets)  # the sglang backend refuses reference-engine keys: none is left
    assert r.rollout.backend == "sglang" and r.steps == 2
    assert (tmp_path / "e" / "engine" / "miles_lp_plan.json").is_file()
