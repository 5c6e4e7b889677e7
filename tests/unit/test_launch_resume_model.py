"""Fixes in the run's start and resume, each on a hand-made run folder (nothing is built):

* M4: a resume reads the model the run started from, or refuses naming both (run.json's model_dir and model_id),
  and the same prompts file (task_id);
* L11: a resume whose ``steps`` leave nothing to run is refused, and records no resume;
* L12: the transport refusals of the start are the dry run's too, in recipe keys;
* L17: ``~`` in the path-valued keys is expanded at parse time (recipe.yaml records it);
* L14: ``logging.output_dir`` under a regular file or an uncreatable folder is a ConfigError naming the path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from miles_lp.cli import main
from miles_lp.errors import ConfigError
from miles_lp.launch import ray_launcher
from miles_lp.launch.model import model_id
from miles_lp.launch.recipe import load_recipe
from miles_lp.launch.run_dir import RunDir
from miles_lp.launch.runner import Run, resumed_recipe

RECIPE = """\
model: {path: MODEL}
precision: {default: mxfp8}
train: {device: cpu}
rollout: {device: cpu, max_response_len: 3}
task: {name: copy, length: 1, alphabet: 4}
logging: {output_dir: runs, progress: false}
steps: 2
checkpoint_every: 1
"""


def _model(folder: Path, weights: bytes = b"x" * 64) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "qwen3"}')
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def _run_folder(tmp_path: Path, model_text: str, model_dir: Path | None, *, at_step: int = 1,
                extra: str = "") -> RunDir:
    """A run folder as a start leaves it: recipe.yaml (``model.path: model_text`` as written), run.json (through
    ``write_header``, so with the model_id a start records), a checkpoint at ``at_step``."""
    rd = RunDir.create(tmp_path / "runs", "r")
    info = {"model_dir": str(model_dir.resolve())} if model_dir is not None else {}
    rd.write_header(RECIPE.replace("MODEL", model_text) + extra, None, info)
    step = rd.checkpoints / f"step_{at_step:06d}"
    step.mkdir(parents=True)
    (step / "loop.json").write_text(json.dumps({"step": at_step}))
    (rd.checkpoints / "latest.json").write_text(json.dumps({"step": at_step, "path": step.name}))
    return rd


# ---- M4 ------------------------------------------------------------------------------------------------------
def test_model_and_task_paths_are_recorded_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = load_recipe(_write(tmp_path, RECIPE.replace("MODEL", "dq")), ["task.name=jsonl", "task.path=p.jsonl"])
    assert r.model.path == str(tmp_path / "dq") and r.task.path == str(tmp_path / "p.jsonl")
    saved = yaml.safe_load(r.to_yaml())  # what Run.start / the Ray start write as RUN_DIR/recipe.yaml
    assert saved["model"]["path"] == str(tmp_path / "dq") and saved["task"]["path"] == str(tmp_path / "p.jsonl")
    assert saved["logging"]["output_dir"] == "runs"  # kept as written: RunDir makes the run folder absolute
    tiny = load_recipe(_write(tmp_path, RECIPE.replace("MODEL", "tiny:qwen3")))
    assert tiny.model.path == "tiny:qwen3" and tiny.raw["model"]["path"] == "tiny:qwen3"


def test_resume_from_another_folder_refuses_a_relative_model_path_of_another_model(tmp_path, monkeypatch, capsys):
    """The case: an older run's recipe.yaml says ``path: dq``; resumed from a folder holding another
    ``dq``, it silently trained against that model's config and KL reference."""
    a, b = tmp_path / "a", tmp_path / "b"
    rd = _run_folder(tmp_path, "dq", _model(a / "dq"))
    _model(b / "dq")
    monkeypatch.chdir(a)
    assert resumed_recipe(rd, None).steps == 2  # where it started: the same model, accepted
    monkeypatch.chdir(b)
    with pytest.raises(ConfigError, match=f"model.path {b / 'dq'} is not the model this run started from: run.json's "
                                          f"model_dir is {a / 'dq'} .*now {b}\\); resume from the folder the run "
                                          "started in, or set model.path"):
        resumed_recipe(rd, None)
    # the CLI refuses it before anything is built (Run.__init__ would build the model first)
    monkeypatch.setattr(Run, "__init__", lambda *a, **k: pytest.fail("built before the refusal"))
    assert main(["run", str(rd.recipe_path), "--resume", str(rd.path), "--set", "steps=3"]) == 2
    assert f"run.json's model_dir is {a / 'dq'}" in capsys.readouterr().err
    assert "resumes" not in rd.info()


def test_resume_refuses_a_model_folder_replaced_under_the_same_path(tmp_path):
    model = _model(tmp_path / "m")
    rd = _run_folder(tmp_path, str(model), model)
    assert rd.info()["model_id"] == model_id(model) and rd.info()["model_id"]["weight_files"] == {
        "model.safetensors": 64}
    resumed_recipe(rd, None)
    (model / "model.safetensors").write_bytes(b"y" * 65)
    with pytest.raises(ConfigError, match=f"the model folder {model} is not the one this run started from "
                                          r"\(model.safetensors is 65 bytes \(was 64\)"):
        resumed_recipe(rd, None)
    (model / "model.safetensors").write_bytes(b"y" * 64)
    (model / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match="its config.json differs"):
        resumed_recipe(rd, None)


def test_a_users_recipe_with_a_relative_path_names_both_paths(tmp_path, monkeypatch):
    """Resumed with the user's own recipe file (relative model.path) from another folder, against a run whose
    recipe.yaml records the absolute path: refused naming both (the run's own recipe.yaml resumes it)."""
    a, b = tmp_path / "a", tmp_path / "b"
    rd = _run_folder(tmp_path, str(_model(a / "dq")), a / "dq")
    _model(b / "dq")
    user = _write(tmp_path, RECIPE.replace("MODEL", "dq"))
    monkeypatch.chdir(b)
    with pytest.raises(ConfigError, match=f"in section\\(s\\) model \\(model.path: this recipe names {b / 'dq'}, "
                                          f"the run's {a / 'dq'}: a relative path"):
        resumed_recipe(rd, load_recipe(user, ["steps=3"]))
    assert resumed_recipe(rd, load_recipe(rd.recipe_path, ["steps=3"])).model.path == str(a / "dq")


def test_a_tiny_model_is_the_run_folders_own(tmp_path, monkeypatch):
    """tiny:<arch>: RUN_DIR/model, wherever the run folder is now (a copied folder resumes); its id is compared."""
    rd = _run_folder(tmp_path, "tiny:qwen3", tmp_path / "elsewhere" / "model")  # recorded where it was built
    resumed_recipe(rd, None)  # no RUN_DIR/model yet: it is rebuilt from the recipe's tiny settings
    _model(rd.path / "model")
    info = rd.info()
    info["model_id"] = model_id(rd.path / "model")
    (rd.path / "run.json").write_text(json.dumps(info))
    monkeypatch.chdir(tmp_path / "runs")
    resumed_recipe(rd, None)
    (rd.path / "model" / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="model.safetensors is gone"):
        resumed_recipe(rd, None)


def test_a_prompts_file_changed_since_the_start_is_refused(tmp_path):
    model = _model(tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [1, 2], "answer": [3]}\n')
    rd = _run_folder(tmp_path, str(model), model)
    text = rd.recipe_path.read_text().replace("task: {name: copy, length: 1, alphabet: 4}",
                                              f"task: {{name: jsonl, path: {prompts}}}")
    rd.write_header(text, None, {"model_dir": str(model)})  # what a start with task jsonl writes
    assert rd.info()["task_id"]["size"] == prompts.stat().st_size
    assert resumed_recipe(rd, None).task.path == str(prompts)
    prompts.write_text('{"prompt": [1, 2], "answer": [4]}\n')
    with pytest.raises(ConfigError, match=f"task.path {prompts} is not the prompts file this run started from "
                                          r".*the resumed steps would draw other prompts"):
        resumed_recipe(rd, None)
    prompts.unlink()
    with pytest.raises(ConfigError, match="now it cannot be read"):
        resumed_recipe(rd, None)


# ---- L11 -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("ray", [False, True])
def test_resume_with_steps_at_or_below_the_run_is_refused_before_anything(tmp_path, monkeypatch, capsys, steps,
                                                                          ray):
    model = _model(tmp_path / "m")
    rd = _run_folder(tmp_path, str(model), model, at_step=2, extra="ray: {enabled: true}\n" if ray else "")
    monkeypatch.setattr(Run, "__init__", lambda *a, **k: pytest.fail("built before the refusal"))
    monkeypatch.setattr(ray_launcher, "_init_ray", lambda r: pytest.fail("ray started before the refusal"))
    assert main(["run", str(rd.recipe_path), "--resume", str(rd.path), "--set", f"steps={steps}"]) == 2
    assert (f"--resume {rd.path}: the run is at step 2 (its latest checkpoint, step_000002) and steps is {steps}: "
            "nothing to run; pass --set steps=M with M > 2 to continue") in capsys.readouterr().err
    with pytest.raises(ConfigError, match="the run is at step 2 .* M > 2"):
        Run.resume(rd.path, load_recipe(rd.recipe_path, [f"steps={steps}"]))
    assert "resumes" not in rd.info()  # no resume recorded
    assert resumed_recipe(rd, load_recipe(rd.recipe_path, ["steps=3"])).steps == 3


# ---- L12 -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sets, match", [
    (["sync.transport=ray"], "sync.transport: ray relays the sync's buckets through Ray's object store, which exists "
                             "only in a Ray run; set ray.enabled: true, or sync.transport: inprocess"),
    (["sync.transport=cuda_ipc"], "sync.transport: cuda_ipc shares CUDA buffers between processes, but this host has "
                                  "no CUDA device; set sync.transport: inprocess"),
])
def test_transports_the_start_refuses_are_in_the_dry_run(tmp_path, monkeypatch, capsys, sets, match):
    import torch

    from miles_lp.launch.dry_run import dry_run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    sets = [*sets, f"logging.output_dir={tmp_path}"]
    refusals = dry_run(load_recipe("recipes/tiny-mxfp8.yaml", sets))["would_refuse_at_start"]
    assert len(refusals) == 1 and refusals[0].startswith(match)
    assert main(["run", "recipes/tiny-mxfp8.yaml", *[a for s in sets for a in ("--set", s)], "--run-name", "t"]) == 2
    err = capsys.readouterr().err
    assert match in err and "ray.init()" not in err and "Traceback" not in err
    assert not (tmp_path / "t").exists()
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
        Run.start(load_recipe("recipes/tiny-mxfp8.yaml", sets), "t2")


def test_an_already_quantized_model_path_is_in_the_dry_run(tmp_path):
    from miles_lp.launch.dry_run import dry_run

    q = tmp_path / "q"
    q.mkdir()
    from miles_lp.checkpoint.tiny import tiny_config

    config = tiny_config("qwen3", num_layers=1).to_dict()  # a convert output's config: the model's + its quant config
    (q / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "modelopt"}}))
    try:
        refusals = dry_run(load_recipe("recipes/tiny-mxfp8.yaml", [f"model.path={q}"]))["would_refuse_at_start"]
    except ConfigError as exc:  # a plan the layout cannot compile from this config is an error of its own
        pytest.fail(f"the dry run raised instead of listing the refusal: {exc}")
    assert any(f"model.path {q}: " in r and "the input is already quantized (quant_method='modelopt'" in r
               for r in refusals), refusals


# ---- L17 -----------------------------------------------------------------------------------------------------
def test_a_tilde_in_path_keys_is_expanded_at_parse_time(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    r = load_recipe(_write(tmp_path, RECIPE.replace("MODEL", "~/models/m")),
                    ["logging.output_dir=~/runs", "task.name=jsonl", "task.path=~/data.jsonl"])
    home = tmp_path / "home"
    assert (r.model.path, r.task.path, r.logging.output_dir) == (str(home / "models/m"), str(home / "data.jsonl"),
                                                                 str(home / "runs"))
    saved = yaml.safe_load(r.to_yaml())
    assert saved["logging"]["output_dir"] == str(home / "runs") and saved["model"]["path"] == str(home / "models/m")
    rd = RunDir.create(r.logging.output_dir, "x")
    assert rd.path == home / "runs" / "x" and not (tmp_path / "~").exists()


# ---- L14 -----------------------------------------------------------------------------------------------------
def test_an_output_dir_that_cannot_be_a_folder_is_named(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for root, blocker in ((afile, afile), (afile / "deeper", afile)):
        with pytest.raises(ConfigError, match=f"logging.output_dir {root}: the run folder {root / 'r'} cannot be "
                                              f"created: {blocker} is a file, not a folder"):
            RunDir.create(root, "r")
    with pytest.raises(ConfigError, match=f"the run folder {afile} cannot be created: {afile} is a file"):
        RunDir.create(tmp_path, "afile")  # the run's own name is the file
    if Path("/proc").is_dir():
        with pytest.raises(ConfigError, match=r"logging.output_dir /proc/nope: the run folder /proc/nope/r cannot be "
                                              r"created in /proc \(No such file or directory\)"):
            RunDir.create("/proc/nope", "r")
    assert main(["run", "recipes/tiny-mxfp8.yaml", "--set", f"logging.output_dir={afile}", "--set", "steps=1"]) == 2
    err = capsys.readouterr().err
    assert f"{afile} is a file, not a folder; set logging.output_dir to a folder" in err and "Traceback" not in err


def _write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p
