"""Every process a run starts runs under the recipe's ``runtime:`` section, not only ``miles-lp run``'s own: the
Ray actors (learner, engines) apply it from the recipe they parse, a Megatron rank from ``RankSpec.runtime`` (rank
0's configured switches), the vLLM / SGLang engine processes from ``MILES_LP_RUNTIME`` (``child_runtime_env``).
Each test sets switches away from their defaults in this process and reads them back where the code runs.
The same through a Ray cluster: tests/e2e/test_run_ray_runtime.py (slow)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_lp.config import (
    RUNTIME_CHILD_ENV,
    RUNTIME_ENV,
    RuntimeConfig,
    child_runtime_env,
    configured_runtime,
    runtime,
    use_runtime,
    use_runtime_from_env,
)
from miles_lp.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
#: switches away from their defaults that change nothing a CPU test computes (C3 graphs and converter threads)
CHANGED = RuntimeConfig(sync_graphs=False, pipeline_workers=1)
RUNTIME_YAML = "runtime: {sync_graphs: false, pipeline_workers: 1}\n"


@pytest.fixture
def clean(monkeypatch):
    """No debugging variable or handed-over section set; this process's switches restored after."""
    for var in (*RUNTIME_ENV.values(), RUNTIME_CHILD_ENV):
        monkeypatch.delenv(var, raising=False)
    old = configured_runtime()
    yield monkeypatch
    use_runtime(old)


def test_a_child_process_gets_the_configured_switches_and_only_them(clean):
    use_runtime(CHANGED)
    env = child_runtime_env()
    assert json.loads(env[RUNTIME_CHILD_ENV]) == {"sync_graphs": False, "pipeline_workers": 1}
    code = ("import dataclasses, json; from miles_lp.config import runtime, use_runtime_from_env; "
            "use_runtime_from_env(); print(json.dumps(dataclasses.asdict(runtime())))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == dataclasses.asdict(CHANGED)
    use_runtime(RuntimeConfig())
    assert json.loads(child_runtime_env()[RUNTIME_CHILD_ENV]) == {}  # defaults: nothing handed over


def test_a_handed_over_section_is_validated_as_the_recipe_is(clean):
    clean.setenv(RUNTIME_CHILD_ENV, '{"sync_grpahs": false}')
    with pytest.raises(ConfigError, match=r"MILES_LP_RUNTIME.*'runtime.sync_grpahs': unknown key .*sync_graphs"):
        use_runtime_from_env()
    clean.setenv(RUNTIME_CHILD_ENV, "{not json")
    with pytest.raises(ConfigError, match="MILES_LP_RUNTIME: not JSON"):
        use_runtime_from_env()
    clean.delenv(RUNTIME_CHILD_ENV)
    use_runtime(CHANGED)
    assert use_runtime_from_env() == CHANGED  # nothing handed over: this process's switches stay


def test_the_engine_processes_are_started_with_the_switches(clean, tmp_path):
    """The vLLM worker's and the SGLang server's environment (``vllm_worker.main`` and ``sglang_cpu/serve.py``
    call ``use_runtime_from_env`` first; they import vLLM / SGLang, so they are exercised by the engine tests)."""
    import miles_lp.rollout.checkpoint as ckpt_mod
    import miles_lp.rollout.vllm as vllm
    from miles_lp.rollout.sglang_cpu.launch import SGLangCPUServer

    use_runtime(CHANGED)
    want = child_runtime_env()[RUNTIME_CHILD_ENV]
    assert SGLangCPUServer(tmp_path, python=sys.executable).env()[RUNTIME_CHILD_ENV] == want

    class Started(Exception):
        pass

    seen = {}

    def popen(cmd, env, **kw):
        seen.update(env)
        raise Started

    clean.setattr(ckpt_mod, "open_checkpoint", lambda path: None)
    clean.setattr(vllm.subprocess, "Popen", popen)
    with pytest.raises(Started):
        vllm.VLLMEngine(tmp_path, python=sys.executable)
    assert seen[RUNTIME_CHILD_ENV] == want
    for src in ("rollout/vllm_worker.py", "rollout/sglang_cpu/serve.py"):
        assert "use_runtime_from_env()" in (ROOT / "miles_lp" / src).read_text(), src


def _recipe_yaml(tmp_path) -> str:
    return (f"model: {{path: {str(tmp_path / 'model')!r}}}\nprecision: {{default: mxfp8}}\nsteps: 1\n"
            "train: {device: cpu}\nrollout: {device: cpu}\nray: {enabled: true}\n" + RUNTIME_YAML)


def test_the_ray_actors_apply_the_recipe_section(clean, tmp_path):
    """The learner and engine actors' classes, built here as Ray builds them in their own processes (this process
    starts at the defaults, as an actor's does): each reports the recipe's switches."""
    from miles_lp.checkpoint.tiny import make_tiny_model
    from miles_lp.launch.ray_launcher import EngineWorker, LearnerWorker

    model = make_tiny_model("qwen3", tmp_path / "model", num_layers=1)
    text = _recipe_yaml(tmp_path)
    use_runtime(RuntimeConfig())
    learner = LearnerWorker(text, "r.yaml", str(model), None, 1, None)
    assert learner.switches() == dataclasses.asdict(CHANGED)
    use_runtime(RuntimeConfig())
    engine = EngineWorker(str(model), text, "r.yaml", 1)
    assert engine.switches() == dataclasses.asdict(CHANGED)


def test_a_megatron_rank_runs_under_rank_0s_switches(clean, tmp_path):
    """A 2-rank data-parallel group on gloo: rank 1 is a spawned process; it reports rank 0's switches."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed (extra 'megatron')")
    import torch

    from miles_lp.checkpoint.tiny import make_tiny_model
    from miles_lp.train.config import MegatronSection, TrainConfig
    from miles_lp.train.megatron.group import MegatronGroup

    def switches(learner):  # cloudpickled by value to rank 1
        import dataclasses

        from miles_lp.config import runtime

        return dataclasses.asdict(runtime())

    model = make_tiny_model("qwen3", tmp_path / "model", num_layers=1)
    use_runtime(CHANGED)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    group = MegatronGroup(model, None, TrainConfig(backend="megatron", device="cpu",
                                                   megatron=MegatronSection(dp=2)), timeout_s=120)
    try:
        assert group.run_on_ranks(switches) == [dataclasses.asdict(runtime())] * 2 == [dataclasses.asdict(CHANGED)] * 2
    finally:
        group.close()
        torch.set_num_threads(threads)
