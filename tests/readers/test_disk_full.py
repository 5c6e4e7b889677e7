"""A full disk while converting -> exit 2, one line naming the output folder and the free
space, no traceback; an existing OUT (with --overwrite) keeps every byte.

safetensors reports a failed write as its own ``SafetensorError`` (not ``OSError``), with the errno only in
its text. The first test raises exactly that type and text from the real writer's call site; the second
fills a real 96 KiB tmpfs (root only; skipped where ``mount`` is not allowed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from safetensors import SafetensorError

from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.cli import main

MSG = "Error while serializing: I/O error: No space left on device (os error 28)"


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("dfsrc") / "m", seed=3, num_layers=2)


def _tree(p: Path) -> dict[str, bytes]:
    return {str(f.relative_to(p)): f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file()}


def _convert(capsys, src, out, *flags):
    rc = main(["convert", "--hf-checkpoint", str(src), "--output", str(out), "--no-progress", "--format", "mxfp8",
               "--max-shard-size", "40KB", *flags])
    return rc, capsys.readouterr().err


def _check_one_line(err: str, out: Path) -> str:
    lines = [ln for ln in err.splitlines() if "error" in ln.lower()]
    assert len(lines) == 1, err
    line = lines[0]
    assert "Traceback" not in err and "SafetensorError" not in err
    assert line.startswith("miles-lp convert: error: cannot write output folder " + str(out))
    assert "No space left on device" in line and "no space left on the device" in line
    assert " MB free in " in line and "Nothing was written" in line
    return line


def test_safetensor_error_from_the_writer_exits_2_with_one_line(capsys, src, tmp_path, monkeypatch):
    import safetensors.torch as st

    real, calls = st.save_file, []

    def full_disk(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:  # the first shard was written, the second hits the full disk
            raise SafetensorError(MSG)
        real(tensors, path, metadata=metadata)

    out = tmp_path / "out"
    rc, _ = _convert(capsys, src, out)
    assert rc == 0
    before = _tree(out)
    monkeypatch.setattr(st, "save_file", full_disk)
    rc, err = _convert(capsys, src, out, "--overwrite")
    assert rc == 2, err
    _check_one_line(err, out)
    assert len(calls) == 2
    assert _tree(out) == before  # the old output survived, byte for byte
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary or old sibling left


def test_other_writer_errors_name_the_shard(tmp_path):
    from miles_lp.errors import CheckpointError
    from miles_lp.io.safetensors_io import as_os_error

    e = as_os_error(SafetensorError(MSG), tmp_path / "s.safetensors")
    assert isinstance(e, OSError) and e.errno == 28 and e.filename == str(tmp_path / "s.safetensors")
    e = as_os_error(SafetensorError("Error while serializing: bad dtype"), tmp_path / "s.safetensors")
    assert isinstance(e, CheckpointError) and "s.safetensors" in str(e) and "bad dtype" in str(e)


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a real full disk needs root to mount a small tmpfs")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs not allowed here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_real_full_tmpfs(capsys, src, small_tmpfs):
    """The source (~0.5 MB) converts to ~0.3 MB of MXFP8: it does not fit in 96 KiB."""
    out = small_tmpfs / "out"
    out.mkdir()
    (out / "miles_lp_plan.json").write_text("the previous checkpoint")
    rc, err = _convert(capsys, src, out, "--overwrite")
    assert rc == 2, err
    _check_one_line(err, out)
    assert _tree(out) == {"miles_lp_plan.json": b"the previous checkpoint"}
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["out"]
