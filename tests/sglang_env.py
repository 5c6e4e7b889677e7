"""What the tests of the real SGLang backend share: SGLang's interpreter or a skip saying why, and the figures they
measure (printed; appended as JSON lines to ``MILES_LP_ROLLOUT_FIGURES`` when set, for docs/rollout.md)."""

from __future__ import annotations

import json
import os

import pytest

FIGURES = os.environ.get("MILES_LP_ROLLOUT_FIGURES")


def sglang_python_or_skip() -> str:
    """SGLang's venv interpreter (``MILES_LP_SGLANG_PYTHON``, else the venv ``.ci/sglang_venv.sh`` builds), or skip
    the test with the reason: ``MILES_LP_CI_SKIP_SGLANG=1``, or no such interpreter."""
    from miles_lp.rollout.sglang_cpu.launch import sglang_missing, sglang_python

    if os.environ.get("MILES_LP_CI_SKIP_SGLANG") == "1":
        pytest.skip("MILES_LP_CI_SKIP_SGLANG=1: the real SGLang tests are off")
    python = sglang_python()
    if python is None:
        pytest.skip(sglang_missing())
    return python


def record(**kw) -> None:
    print(json.dumps(kw))
    if FIGURES:
        with open(FIGURES, "a") as f:
            f.write(json.dumps(kw) + "\n")
