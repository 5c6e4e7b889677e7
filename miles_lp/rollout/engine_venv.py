"""Where an engine that lives in its own venv (vLLM's CPU build, SGLang's CPU platform) finds its interpreter.

Each engine pins packages that clash with this environment, so `.ci/run` builds it a venv once per machine, named
after its pins under ``$XDG_CACHE_HOME/miles-lp`` (``~/.cache``). The lookup order is the same for every engine:
the ``*_PYTHON`` variable, else the checkout's ``build/<link>`` (`.ci/run` links it), else the cached venv."""

from __future__ import annotations

import os
from pathlib import Path


def cached_venv(venv_env: str, name: str) -> Path:
    """``$venv_env`` if set, else ``$XDG_CACHE_HOME/miles-lp/<name>`` (``~/.cache`` when unset)."""
    env = os.environ.get(venv_env)
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path(os.environ.get("HOME") or "/tmp") / ".cache")
    return Path(cache) / "miles-lp" / name


def venv_python(python_env: str, repo: Path, build_link: str, venv: Path) -> str | None:
    """``$python_env`` (None when it names a missing file), else ``repo/build/<build_link>/bin/python``, else
    ``venv/bin/python``, else None."""
    env = os.environ.get(python_env)
    if env:
        return env if Path(env).exists() else None
    for p in (repo / "build" / build_link / "bin" / "python", venv / "bin" / "python"):
        if p.exists():
            return str(p)
    return None


def missing_python(python_env: str, what: str, how: str) -> str:
    """One line: no interpreter for ``what``, how to get one, and a ``$python_env`` that names no file."""
    env = os.environ.get(python_env)
    bad = f": {python_env}={env} does not exist" if env else ""
    return f"no {what} interpreter (set {python_env} to a python with {how}){bad}"
