"""Run folders: metrics, atomic checkpoints that survive a failed write, pruning, and the curve plot."""

from __future__ import annotations

import errno

import pytest
import torch

from miles_lp.errors import CheckpointError, ConfigError
from miles_lp.launch.run_dir import RunDir
from miles_lp.train.state_io import save_learner_state


def state(v: float):
    return {"kind": "x", "step": int(v), "model": {"w": torch.full((3,), v)}, "rng": (1, [2, 3])}


def test_metrics_append_read_truncate(tmp_path):
    rd = RunDir.create(tmp_path, "r")
    for s in range(4):
        rd.append_metrics(s, {"reward/mean": s / 10})
    assert [r["step"] for r in rd.read_metrics()] == [0, 1, 2, 3]
    rd.truncate_metrics(2)
    assert [r["reward/mean"] for r in rd.read_metrics()] == [0.0, 0.1]
    with pytest.raises(ConfigError, match="exists, is not empty and holds no checkpoint to resume from"):
        RunDir.create(tmp_path, "r")


def test_checkpoints_atomic_latest_and_pruned(tmp_path, monkeypatch):
    rd = RunDir.create(tmp_path, "r")
    assert rd.latest() is None
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        rd.load_checkpoint()
    for s in (1, 2, 3):
        rd.save_checkpoint(s, state(float(s)), {"data_position": s})
    assert rd.latest().name == "step_000003"
    assert sorted(p.name for p in rd.checkpoints.glob("step_*")) == ["step_000002", "step_000003"]  # two kept
    st, loop = rd.load_checkpoint()
    assert torch.equal(st["model"]["w"], torch.full((3,), 3.0)) and st["rng"] == (1, [2, 3])
    assert loop["step"] == 3 and loop["data_position"] == 3
    import miles_lp.train.state_io as sio

    real = sio.save_learner_state

    def half_then_full(st, path, **kw):  # writes part of the folder, then the disk is full
        (path.parent / "partial").write_text("x")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(sio, "save_learner_state", half_then_full)
    with pytest.raises(CheckpointError, match="step 4 could not be written.*No space left.*previous checkpoint is "
                                              "intact.*step_000003"):
        rd.save_checkpoint(4, state(4.0), {})
    monkeypatch.setattr(sio, "save_learner_state", real)
    assert rd.latest().name == "step_000003" and not (rd.checkpoints / "step_000004").exists()
    assert not [p for p in rd.checkpoints.iterdir() if p.name.startswith(".")]  # no temp left behind
    assert torch.equal(rd.load_checkpoint()[0]["model"]["w"], torch.full((3,), 3.0))


def test_plot_runs(tmp_path):
    from miles_lp.launch.plot import plot_runs, smooth

    assert smooth([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]
    for name, k in (("a", 1.0), ("b", 2.0)):
        rd = RunDir.create(tmp_path, name)
        for s in range(5):
            rd.append_metrics(s, {"reward/mean": k * s, "rollout_corr/kl": 0.0})
    out = plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "img" / "p.png", keys=("reward/mean", "rollout_corr/kl"))
    assert out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"


def test_tensorboard_missing_is_one_line_not_a_failure(tmp_path, monkeypatch, capsys):
    import sys

    from miles_lp.launch.runner import _tensorboard

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    assert _tensorboard(tmp_path) is None
    assert "tensorboard package is not installed; metrics go to metrics.jsonl only" in capsys.readouterr().err


def test_learner_state_keys_that_collide_are_refused(tmp_path):
    """A dict key holding '/' would share a safetensors key with a nested one: refused, not overwritten."""
    state = {"a/b": torch.zeros(2), "a": {"b": torch.ones(2)}}
    with pytest.raises(CheckpointError, match=r"two tensors at 'a/b'"):
        save_learner_state(state, tmp_path / "s")
    assert not (tmp_path / "s").exists()



def test_checkpoint_temps_of_a_killed_run_are_pruned(tmp_path):
    """A kill while writing step 40 left its temp folder; the resumed run (from step 20) never writes step 40's
    name again, so the next checkpoint removes every temp whose process is gone, and keeps a live one."""
    import os

    rd = RunDir.create(tmp_path, "r")
    rd.checkpoints.mkdir(parents=True)
    dead = rd.checkpoints / ".step_000040.miles-lp-tmp-999999999"
    live = rd.checkpoints / f".step_000050.miles-lp-tmp-{os.getppid()}"  # another process, alive
    dead.mkdir()
    live.mkdir()
    rd.save_checkpoint(21, state(1.0), {})
    assert not dead.exists() and live.exists()
    assert rd.latest().name == "step_000021"
