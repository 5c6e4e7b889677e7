"""``.ci/sglang_venv.sh``: ``sglang_venv DIR`` builds SGLang's CPU venv once, reuses one that imports sglang, rebuilds
only a venv it made itself (its marker file), and refuses anyone else's folder, naming it. The function runs for real
(bash, the file sourced), with a fake ``python3`` on PATH whose ``-m venv`` makes a fake venv (its python "imports
sglang" when the folder holds ``sglang_ok``, and sglang-router when it holds ``router_ok``; its pip logs each call, and
fails when FAKE_PIP_FAIL is set): nothing is installed and no network is used. sglang-router is added to a venv this
file built (marked), never to anyone else's."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci" / "sglang_venv.sh"
MARKER = ".miles-lp-ci-sglang-venv"

VENV_PYTHON = """#!/bin/sh
d=$(cd "$(dirname "$0")/.." && pwd)
if [ "$1" = "-c" ]; then
    case "$2" in *sglang_router*) [ -f "$d/router_ok" ]; exit $? ;; esac
    [ -f "$d/sglang_ok" ]; exit $?
fi
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
    shift 2; echo "pip $*" >> "$d/pip.log"; [ -z "$FAKE_PIP_FAIL" ]; exit $?
fi
exit 2
"""

PYTHON3 = """#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
    mkdir -p "$3/bin" && echo "home = /fake" > "$3/pyvenv.cfg" && cp "$FAKE_VENV_PYTHON" "$3/bin/python" \\
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
        return subprocess.run(["bash", "-c", f'set -euo pipefail; source "{SCRIPT}"; sglang_venv "$1"', "x",
                               str(venv)], env={**env, **extra}, capture_output=True, text=True, timeout=60)
    return run


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_builds_a_missing_venv_and_marks_it(fake, tmp_path):
    venv = tmp_path / "cache" / "venv-sglang-cpu-0.5.23"
    out = fake(venv)
    assert out.returncode == 0, out.stderr
    assert (venv / MARKER).is_file() and (venv / "pyvenv.cfg").is_file()
    log = (venv / "pip.log").read_text().splitlines()
    assert log[:2] == ["pip install -q torch==2.14.1", "pip install -q --no-deps sglang==0.5.23"]
    assert len(log) == 5 and log[2].startswith("pip install -q torch==2.14.1 transformers==5.19.0 ")
    assert log[3] == "pip install -q --no-deps torchvision==0.29.1"
    assert log[4] == "pip install -q --no-deps sglang-router==0.3.2"  # its Python needs are the server's, above
    assert "sglang-kernel" not in log[2] and "flashinfer" not in log[2]  # CUDA-only: never installed


def test_a_users_own_venv_is_refused_and_kept(fake, tmp_path):
    venv = tmp_path / "myvenv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")
    (venv / "bin" / "python").chmod(0o755)
    (venv / "precious.txt").write_text("mine")
    out = fake(venv)
    assert out.returncode == 1
    assert f"{venv} does not import sglang and was not built by .ci/sglang_venv.sh" in out.stderr
    assert "MILES_LP_CI_SKIP_SGLANG=1" in out.stderr
    assert (venv / "precious.txt").read_text() == "mine" and not (venv / MARKER).exists()


def test_a_venv_that_imports_sglang_is_reused_untouched(fake, tmp_path):
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    shutil.copy(tmp_path / "venv_python", venv / "bin" / "python")
    (venv / "sglang_ok").write_text("")
    assert fake(venv).returncode == 0
    assert not (venv / "pip.log").exists() and not (venv / MARKER).exists()


@pytest.mark.parametrize("marked, has_router, want", [(True, False, ["pip install -q --no-deps sglang-router==0.3.2"]),
                                                      (True, True, []), (False, False, [])])
def test_the_router_is_added_to_its_own_venv_only(fake, tmp_path, marked, has_router, want):
    """A venv this file built before sglang-router joined it gets the router (and nothing else); one that has it,
    or anyone else's venv, is left as it is."""
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    shutil.copy(tmp_path / "venv_python", venv / "bin" / "python")
    (venv / "sglang_ok").write_text("")
    if marked:
        (venv / MARKER).write_text("made by .ci/sglang_venv.sh")
    if has_router:
        (venv / "router_ok").write_text("")
    assert fake(venv).returncode == 0
    log = venv / "pip.log"
    assert (log.read_text().splitlines() if log.exists() else []) == want


def test_its_own_broken_venv_is_rebuilt(fake, tmp_path):
    venv = tmp_path / "venv"
    assert fake(venv, FAKE_PIP_FAIL="1").returncode != 0  # a build that failed half-way: marked, so it is ours
    assert (venv / MARKER).is_file()
    (venv / "leftover").write_text("")
    out = fake(venv)
    assert out.returncode == 0 and "does not import sglang: rebuilding it" in out.stderr
    assert not (venv / "leftover").exists() and (venv / MARKER).is_file()
