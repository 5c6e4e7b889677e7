"""Written weight files get a plain file's mode, and the output-folder errors name the calling
command's own flag (make-tiny-model's is ``--out``, convert's ``--output``).

safetensors' writer creates its files 0600 while config.json beside them is 0644 (umask 022): a server under
another uid could read the config but not the weights. convert, export and make-tiny-model (CLI and API) must
write every ``*.safetensors`` with ``0o666 & ~umask``, like the configs; checked under two umasks."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.cli import main
from miles_lp.io.atomic import current_umask

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "policies/qwen3-moe-mxfp8-nvfp4-experts.yaml")


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _modes(folder: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir() if p.is_file()}


def _assert_plain(folder: Path, mask: int) -> None:
    modes = _modes(folder)
    weights = [n for n in modes if n.endswith(".safetensors")]
    assert weights and modes["config.json"] == 0o666 & ~mask, modes
    assert {modes[n] for n in weights} == {0o666 & ~mask}, modes  # was 0o600


def test_current_umask_reads_without_changing_it(umask):
    assert current_umask() == umask
    assert current_umask() == umask


def test_convert_export_and_tiny_model_write_plain_modes(tmp_path, umask):
    src = make_tiny_model("qwen3_moe", tmp_path / "src", seed=2, max_shard_size="200KB")  # the API: 2 shards
    _assert_plain(src, umask)
    assert main(["make-tiny-model", "--arch", "qwen3", "--out", str(tmp_path / "tiny")]) == 0
    _assert_plain(tmp_path / "tiny", umask)
    assert main(["convert", "--hf-checkpoint", str(src), "--output", str(tmp_path / "conv"), "--recipe", RECIPE,
                 "--target", "compressed-tensors", "--max-shard-size", "150KB", "--no-progress"]) == 0
    _assert_plain(tmp_path / "conv", umask)
    assert main(["export", "--hf-checkpoint", str(src), "--output", str(tmp_path / "exp"), "--recipe", RECIPE,
                 "--target", "compressed-tensors"]) == 0
    _assert_plain(tmp_path / "exp", umask)


def test_make_tiny_model_names_its_own_flag(tmp_path, capsys):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "todo.txt").write_text("mine\n")
    assert main(["make-tiny-model", "--arch", "qwen3", "--out", str(folder), "--overwrite"]) != 0
    err = capsys.readouterr().err
    assert "is not a checkpoint" in err and "choose another --out or remove" in err and "--output" not in err, err
    assert (folder / "todo.txt").read_text() == "mine\n"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert main(["make-tiny-model", "--arch", "qwen3", "--out", str(a_file)]) != 0
    err = capsys.readouterr().err
    assert "exists and is not a folder; choose another --out" in err and "--output" not in err, err


def test_convert_still_names_output(tmp_path, capsys):
    src = make_tiny_model("qwen3", tmp_path / "src")
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "todo.txt").write_text("mine\n")
    assert main(["convert", "--hf-checkpoint", str(src), "--output", str(folder), "--format", "mxfp8", "--overwrite",
                 "--no-progress"]) != 0
    assert "choose another --output or remove" in capsys.readouterr().err
