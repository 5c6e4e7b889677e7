"""``--resume`` of a folder that is no run folder says so, before the recipe is read or anything starts;
the resume command a stopped run prints carries ``--set steps=N`` when a resume raised the run's steps."""

from __future__ import annotations

import shlex

import pytest

from miles_lp.cli import main
from miles_lp.errors import ConfigError
from miles_lp.launch import ray_launcher
from miles_lp.launch.recipe import load_recipe
from miles_lp.launch.run_dir import RunDir
from miles_lp.launch.runner import Run, resume_note, resumed_recipe
from tests.e2e.test_run import RECIPE


def _cli(capsys, folder, *extra) -> str:
    assert main(["run", "recipes/tiny-mxfp8.yaml", "--resume", str(folder), *extra]) == 2
    return capsys.readouterr().err


def test_a_folder_that_is_no_run_folder_is_named_as_such(tmp_path, capsys):
    model = tmp_path / "tiny"  # what a user passes: a model folder
    model.mkdir()
    (model / "config.json").write_text("{}")
    err = _cli(capsys, model)
    assert f"--resume {model}: not a miles-lp run folder (no recipe.yaml and no run.json). A run folder is what " \
           "`miles-lp run RECIPE` creates under logging.output_dir: recipe.yaml (the effective recipe), run.json, " \
           "plan.json, metrics.jsonl and checkpoints/" in err
    assert "file not found" not in err
    (model / "recipe.yaml").write_text("steps: 1\n")  # a recipe alone is not a run either
    assert f"--resume {model}: not a miles-lp run folder (no run.json)" in _cli(capsys, model)


def test_a_missing_folder_a_file_and_the_runs_parent(tmp_path, capsys):
    assert f"--resume {tmp_path / 'nope'}: no such folder" in _cli(capsys, tmp_path / "nope")
    f = tmp_path / "recipe.yaml"
    f.write_text("x: 1\n")
    assert f"--resume {f}: a file, not a run folder" in _cli(capsys, f)
    runs = tmp_path / "runs"
    for name in ("a", "b"):
        rd = RunDir.create(runs, name)
        rd.write_header("steps: 1\n", None, {})
    (runs / "junk").mkdir()
    err = _cli(capsys, runs)
    assert f"--resume {runs}: not a miles-lp run folder" in err
    assert f"it holds 2 run folder(s), e.g. {runs / 'a'}, {runs / 'b'}: pass one of them" in err


def test_refused_before_a_ray_cluster_starts(tmp_path, capsys, monkeypatch):
    def no_ray(recipe):
        raise AssertionError("ray.init before the folder was checked")

    monkeypatch.setattr(ray_launcher, "_init_ray", no_ray)
    assert "not a miles-lp run folder" in _cli(capsys, tmp_path, "--set", "ray.enabled=true")


def test_the_api_refuses_it_too(tmp_path):
    with pytest.raises(ConfigError, match=r"--resume .*: not a miles-lp run folder \(no recipe.yaml and no run.json\)"):
        resumed_recipe(RunDir(tmp_path), None)
    with pytest.raises(ConfigError, match=r"no such folder"):
        Run.resume(tmp_path / "nope")


def test_the_resume_command_names_raised_steps(tmp_path):
    rd = RunDir.create(tmp_path / "runs", "r")
    rd.write_header(RECIPE.replace("OUT", str(tmp_path / "runs")), None, {})  # steps: 3
    assert load_recipe(rd.recipe_path).steps == 3
    rd.save_checkpoint(2, {"kind": "x"}, {})
    cmd = f"miles-lp run {shlex.quote(str(rd.recipe_path))} --resume {shlex.quote(str(rd.path))}"
    for steps, tail in ((None, ""), (3, ""), (6, " --set steps=6")):
        assert resume_note(rd, steps) == (f"the last checkpoint is {rd.checkpoints / 'step_000002'} (it resumes at "
                                          f"step 2): {cmd}{tail}")
    # the printed command is accepted by a resume: the saved recipe with only steps raised
    assert resumed_recipe(rd, load_recipe(rd.recipe_path, ["steps=6"])).steps == 6
