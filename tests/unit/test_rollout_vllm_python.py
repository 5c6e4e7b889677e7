"""Where the vLLM CPU engine's interpreter is looked for: ``MILES_LP_VLLM_PYTHON``, the checkout's
``build/venv-vllm``, then the venv `.ci/run` builds (``MILES_LP_VLLM_VENV``, else ``$XDG_CACHE_HOME`` or
``~/.cache``), and a refusal that names the venv it would use and a bad ``MILES_LP_VLLM_PYTHON``."""

from __future__ import annotations

import pytest

from miles_lp.rollout import vllm


@pytest.fixture
def clean(monkeypatch, tmp_path):
    for var in ("MILES_LP_VLLM_PYTHON", "MILES_LP_VLLM_VENV", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(vllm, "REPO", tmp_path / "repo")  # no build/venv-vllm there
    return tmp_path


def _python(root):
    p = root / "bin" / "python"
    p.parent.mkdir(parents=True)
    p.write_text("")
    return str(p)


def test_the_ci_venv_is_found_where_ci_builds_it(clean, monkeypatch):
    assert vllm.vllm_python() is None
    assert str(clean / "home" / ".cache" / "miles-lp" / vllm.VLLM_VENV_NAME) in vllm.vllm_missing()
    home = _python(clean / "home" / ".cache" / "miles-lp" / vllm.VLLM_VENV_NAME)
    assert vllm.vllm_python() == home
    monkeypatch.setenv("XDG_CACHE_HOME", str(clean / "xdg"))
    assert vllm.vllm_python() is None and str(clean / "xdg" / "miles-lp") in vllm.vllm_missing()
    xdg = _python(clean / "xdg" / "miles-lp" / vllm.VLLM_VENV_NAME)
    assert vllm.vllm_python() == xdg
    monkeypatch.setenv("MILES_LP_VLLM_VENV", str(clean / "mine"))
    mine = _python(clean / "mine")
    assert vllm.vllm_python() == mine
    repo = _python(clean / "repo" / "build" / "venv-vllm")  # the checkout's link comes first
    assert vllm.vllm_python() == repo


def test_a_bad_explicit_interpreter_is_named_not_replaced(clean, monkeypatch):
    _python(clean / "home" / ".cache" / "miles-lp" / vllm.VLLM_VENV_NAME)
    monkeypatch.setenv("MILES_LP_VLLM_PYTHON", str(clean / "absent" / "python"))
    assert vllm.vllm_python() is None  # an explicit choice is not silently swapped for another venv
    assert vllm.vllm_missing().endswith(f": MILES_LP_VLLM_PYTHON={clean / 'absent' / 'python'} does not exist")
    with pytest.raises(vllm.BackendUnavailable, match="MILES_LP_VLLM_PYTHON=.* does not exist"):
        vllm.VLLMEngine(clean / "ckpt")
