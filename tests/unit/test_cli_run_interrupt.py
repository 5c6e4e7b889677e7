"""Ctrl-C on `miles-lp run`: the note names the last checkpoint and the exact resume command, or says
there is nothing to resume (and removes a folder that recorded nothing). The run itself is a stand-in that raises
KeyboardInterrupt where the loop would; the folder, its checkpoints and metrics are real."""

from __future__ import annotations

import shlex
import types

import pytest

from miles_lp.cli import main
from miles_lp.launch import runner
from miles_lp.launch.run_dir import RunDir
from tests.e2e.test_run import RECIPE


class Interrupted:
    """A started run whose loop gets Ctrl-C at ``step``."""

    def __init__(self, rd: RunDir, step: int, steps: int | None = None):
        self.dir, self.step, self.closed = rd, step, False
        self.recipe = types.SimpleNamespace(steps=steps)  # the run's effective steps (a resume may raise them)

    def train(self, progress=None):
        raise KeyboardInterrupt

    def close(self):
        self.closed = True


@pytest.fixture
def recipe(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.replace("OUT", str(tmp_path / "runs")))
    return p


def _folder(tmp_path, recipe, rows: int, checkpoint: int | None) -> RunDir:
    rd = RunDir.create(tmp_path / "runs", "r")
    rd.write_header(recipe.read_text(), None, {})
    for step in range(rows):
        rd.append_metrics(step, {"reward/mean": 0.5})
    if checkpoint is not None:
        rd.save_checkpoint(checkpoint, {"kind": "x"}, {})
    return rd


def _run(monkeypatch, capsys, recipe, fake):
    monkeypatch.setattr(runner.Run, "start", classmethod(lambda cls, r, name=None: fake))
    code = main(["run", str(recipe), "--no-progress"])
    return code, capsys.readouterr().err


def test_interrupt_names_the_last_checkpoint_and_the_resume_command(tmp_path, monkeypatch, capsys, recipe):
    rd = _folder(tmp_path, recipe, rows=11, checkpoint=10)
    fake = Interrupted(rd, 11)
    code, err = _run(monkeypatch, capsys, recipe, fake)
    cmd = f"miles-lp run {shlex.quote(str(rd.recipe_path))} --resume {shlex.quote(str(rd.path))}"
    assert code == 130 and fake.closed
    assert (f"interrupted at step 11 (11 metrics rows in {rd.metrics_path}); the last checkpoint is "
            f"{rd.checkpoints / 'step_000010'} (it resumes at step 10): {cmd}") in err
    assert rd.latest() is not None  # nothing removed


def test_interrupt_before_any_checkpoint_says_there_is_nothing_to_resume(tmp_path, monkeypatch, capsys, recipe):
    rd = _folder(tmp_path, recipe, rows=0, checkpoint=None)
    code, err = _run(monkeypatch, capsys, recipe, Interrupted(rd, 0))
    assert code == 130 and "interrupted at step 0; no checkpoint and no metrics row yet: nothing to resume" in err
    assert not rd.path.exists()  # a folder that recorded nothing is removed, as for a run interrupted while starting
    rd = _folder(tmp_path, recipe, rows=1, checkpoint=None)
    code, err = _run(monkeypatch, capsys, recipe, Interrupted(rd, 1))
    assert code == 130 and "no checkpoint yet (checkpoint_every: 2, and the last step writes one): nothing to resume" \
        in err and f"{rd.path} keeps the metrics of 1 step(s)" in err
    assert rd.metrics_path.is_file()


def test_interrupt_while_starting(tmp_path, monkeypatch, capsys, recipe):
    def start(cls, r, name=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner.Run, "start", classmethod(start))
    assert main(["run", str(recipe), "--no-progress"]) == 130
    assert "interrupted while starting: nothing was recorded (no run folder is left)" in capsys.readouterr().err
