"""The vLLM backend's start when its worker cannot run: reported at once (not after the start timeout), with
the exit code and the log's end, and nothing left behind (no socket folder, no open log)."""

from __future__ import annotations

import glob
import time

import pytest

from miles_lp.rollout.engine import EngineError
from miles_lp.rollout.testing import tiny_checkpoint
from miles_lp.rollout.vllm import VLLMEngine


def test_worker_that_exits_at_once_is_reported_at_once(tmp_path):
    ck = tiny_checkpoint("qwen3", "mxfp8")
    log = tmp_path / "vllm.log"
    log.write_text("earlier line\nImportError: no module named vllm\n")  # what a broken venv leaves there
    before = set(glob.glob("/tmp/miles-lp-vllm-*"))
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"(?s)exited with code 1 before it connected; the end of its log .*"
                                          r"no module named vllm"):
        VLLMEngine(ck, python="/bin/false", start_timeout_s=120, log_path=log)
    assert time.monotonic() - t0 < 30  # not the 120 s start timeout
    assert set(glob.glob("/tmp/miles-lp-vllm-*")) == before
