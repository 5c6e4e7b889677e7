"""Environment variables are for locations, credentials, child processes and debugging; behaviour is in config.

Every ``MILES_LP_*`` variable the library reads is listed in ``miles_lp.config.ENVIRONMENT`` with its kind, and in
docs/configuration.md's table; each behaviour switch is a typed key of the recipe's ``runtime:`` section
(``RuntimeConfig``) whose variable is only a debugging override; library code does not write ``os.environ``
outside the exact list below."""

from __future__ import annotations

import ast
import dataclasses
import re
import textwrap
from pathlib import Path

import pytest

from miles_lp import config
from miles_lp.config import (
    ENVIRONMENT,
    RUNTIME_ENV,
    RuntimeConfig,
    runtime,
    runtime_override,
    switch,
    use_runtime,
)
from miles_lp.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "miles_lp"

#: (module, variable written) of the library's remaining writes to ``os.environ``. Exact: a new write fails, and a
#: listed one that is gone must be removed here.
KNOWN_ENV_WRITES: set[tuple[str, str]] = {
    # a process's own entry point configuring the engine it is about to import (vLLM reads only its environment)
    ("rollout/vllm_worker.py", "VLLM_ENABLE_V1_MULTIPROCESSING"),
    ("rollout/vllm_worker.py", "VLLM_CPU_KVCACHE_SPACE"),
    ("rollout/vllm_worker.py", "VLLM_ALLOW_INSECURE_SERIALIZATION"),
    # not yet moved to their config keys / a child environment (modules reworked elsewhere)
    ("rollout/sglang.py", "FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH"),
    ("rollout/sglang_cpu/hook.py", "ENV_PORT"),
    ("rollout/sglang_cpu/hook.py", "ENV_KEY"),
    ("formats/kernels/runtime.py", "TRITON_INTERPRET"),  # Triton's own switch, around loading an interpreted module
    ("train/megatron/te.py", "<dynamic>"),  # TE / Megatron settings they read only from the environment
    ("train/megatron/te.py", "k"),
    ("launch/ray_launcher.py", "var"),  # a Ray variable around starting a local cluster
}


def _source_vars() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for p in PKG.rglob("*.py"):
        if p == PKG / "config.py":
            continue
        for v in re.findall(r"MILES_LP_[A-Z0-9_]*", p.read_text()):
            if v.startswith("MILES_LP_SYNC_CHECK_"):  # MILES_LP_SYNC_CHECK_<CHECK>: one listed family
                v = "MILES_LP_SYNC_CHECK_"
            out.setdefault(v, set()).add(str(p.relative_to(PKG)))
    return out


def test_every_variable_the_library_reads_is_listed_with_its_kind():
    found = _source_vars()
    assert not sorted(set(found) - set(ENVIRONMENT)), (
        "MILES_LP_* variables missing from miles_lp.config.ENVIRONMENT (add each, with its kind; a behaviour "
        f"switch is a RuntimeConfig key): { {v: sorted(found[v]) for v in set(found) - set(ENVIRONMENT)} }")
    unread = set(ENVIRONMENT) - set(found) - set(RUNTIME_ENV.values())  # those: read by config.switch
    assert not unread, f"listed but read nowhere: {sorted(unread)}"


def test_every_variable_is_in_the_docs_table():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    rows = set(re.findall(r"^\| `(MILES_LP_[A-Z0-9_]*)`", doc, re.M))
    assert rows == set(ENVIRONMENT), sorted(rows ^ set(ENVIRONMENT))
    for key in RUNTIME_ENV:
        assert f"`runtime.{key}`" in doc, key


def test_every_behaviour_switch_is_a_config_key_and_its_variable_a_debug_override():
    assert set(RUNTIME_ENV) == {f.name for f in dataclasses.fields(RuntimeConfig)}
    for var in RUNTIME_ENV.values():
        assert ENVIRONMENT[var].kind == "debug"
    assert {v.kind for v in ENVIRONMENT.values()} <= {"location", "credential", "process", "debug", "ci"}


def test_each_switch_is_read_through_the_config_or_refused_in_it():
    """A key is read with ``switch("<key>")`` somewhere in the library, or it is in ``ENV_ONLY`` (its code still
    reads only the variable) and a recipe value for it is refused: never a key that silently does nothing."""
    src = "\n".join(p.read_text() for p in PKG.rglob("*.py") if p != PKG / "config.py")
    read = {k for k in RUNTIME_ENV if f'switch("{k}")' in src}
    assert read == set(RUNTIME_ENV) - config.ENV_ONLY, sorted(read ^ (set(RUNTIME_ENV) - config.ENV_ONLY))
    for key in config.ENV_ONLY:
        f = next(f for f in dataclasses.fields(RuntimeConfig) if f.name == key)
        other = {"kernels": "reference", "fp8_gemm": "emulated"}.get(key, not f.default)
        with pytest.raises(ConfigError, match=f"'runtime.{key}': not read from the config yet.*{RUNTIME_ENV[key]}"):
            config.parse_dataclass(RuntimeConfig, {key: other}, config.Where("r.yaml", "runtime"))


def _writes(path: Path) -> set[str]:
    """The variables ``path`` writes into ``os.environ`` (``<dynamic>`` where the name is not a constant)."""
    out = set()

    def name(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return node.id if isinstance(node, ast.Name) else "<dynamic>"

    def is_environ(node):
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign) else node.targets if isinstance(node, ast.Delete) else []
        for t in targets:
            if isinstance(t, ast.Subscript) and is_environ(t.value):
                out.add(name(t.slice))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if is_environ(f.value) and f.attr in ("setdefault", "pop", "update", "clear", "popitem"):
                out.add(name(node.args[0]) if node.args and f.attr != "update" else "<dynamic>")
            if f.attr == "putenv":
                out.add(name(node.args[0]) if node.args else "<dynamic>")
    return out


def test_library_code_writes_no_environment_variable_outside_the_list():
    found = {(str(p.relative_to(PKG)), v) for p in PKG.rglob("*.py") for v in _writes(p)}
    assert not sorted(found - KNOWN_ENV_WRITES), ("library code writing os.environ (use a config key, "
                                                  "miles_lp.config.runtime_override, or a child process's env): "
                                                  f"{sorted(found - KNOWN_ENV_WRITES)}")
    assert not sorted(KNOWN_ENV_WRITES - found), f"listed but gone (remove them): {sorted(KNOWN_ENV_WRITES - found)}"


def test_the_write_finder_sees_each_form(tmp_path):
    p = tmp_path / "m.py"
    p.write_text(textwrap.dedent("""\
        import os
        os.environ["A"] = "1"
        os.environ.setdefault("B", "1")
        os.environ.pop(name, None)
        del os.environ["C"]
        os.environ.update(x)
        os.putenv("D", "1")
        print(os.environ.get("E"))
        """))
    assert _writes(p) == {"A", "B", "name", "C", "<dynamic>", "D"}


@pytest.fixture
def clean(monkeypatch):
    for var in RUNTIME_ENV.values():
        monkeypatch.delenv(var, raising=False)
    old = config._RUNTIME
    yield monkeypatch
    use_runtime(old)


def test_a_switch_is_the_config_value_unless_its_debug_variable_is_set(clean):
    assert switch("sync_graphs") is True and switch("kernels") == "auto" and switch("pipeline_workers") is None
    use_runtime(RuntimeConfig(sync_graphs=False, sync_kernels="reference", pipeline_workers=2))
    assert switch("sync_graphs") is False and switch("sync_kernels") == "reference"
    assert switch("pipeline_workers") == 2
    clean.setenv("MILES_LP_SYNC_GRAPHS", "1")
    clean.setenv("MILES_LP_SYNC_KERNELS", "auto")
    clean.setenv("MILES_LP_PIPELINE", "0")
    clean.setenv("MILES_LP_KERNELS", "reference")
    assert switch("sync_graphs") is True and switch("sync_kernels") == "auto" and switch("pipeline_workers") == 0
    assert switch("kernels") == "reference"
    assert runtime() == dataclasses.replace(RuntimeConfig(pipeline_workers=0), kernels="reference")
    clean.setenv("MILES_LP_SYNC_GRAPHS", "0")  # the variables' old readings: only "0" turns a bool off
    assert runtime().sync_graphs is False


def test_an_override_wins_for_its_block_and_is_checked(clean):
    clean.setenv("MILES_LP_SYNC_KERNELS", "digest")
    with runtime_override(sync_kernels="reference"):
        assert switch("sync_kernels") == "reference"
    assert switch("sync_kernels") == "digest"
    with pytest.raises(TypeError, match="no run-time switch"):
        with runtime_override(sync_kernel="reference"):
            pass
    with pytest.raises(ConfigError, match="sync_kernels"):
        with runtime_override(sync_kernels="digest,nope"):
            pass


def test_the_formats_and_train_switches_follow_the_config(clean):
    """The codecs' and QuantLinear's switches are read from the process's config at each call, not from their
    variables at import: a recipe's ``runtime:`` value and a ``runtime_override`` are obeyed at once."""
    from miles_lp.formats import native
    from miles_lp.train import launch

    calls = []

    def bind(*a, **k):
        calls.append(1)

    use_runtime(RuntimeConfig(native=False, linear_bind=False))
    assert native.library() is None
    assert launch._bind(bind, ()) is None and calls == []
    use_runtime(RuntimeConfig())
    with runtime_override(native=False):
        assert native.library() is None
    with runtime_override(linear_bind=True):
        launch._bind(bind, ())
    assert calls == [1]


def test_the_recipe_runtime_section_is_typed_and_strict(tmp_path):
    from miles_lp.launch.recipe import load_recipe

    base = "model: {path: 'tiny:qwen3'}\nprecision: {default: mxfp8}\nsteps: 1\n"
    p = tmp_path / "r.yaml"
    p.write_text(base + "runtime: {sync_graphs: false, pipeline_workers: 0}\n")
    r = load_recipe(p)
    assert r.runtime == RuntimeConfig(sync_graphs=False, pipeline_workers=0)
    p.write_text(base + "runtime: {sync_grpahs: false}\n")
    with pytest.raises(ConfigError, match=r"r.yaml:4: 'runtime.sync_grpahs': unknown key .*did you mean 'sync_graphs'"):
        load_recipe(p)
    p.write_text(base + "ray: {enabled: true}\nruntime: {sync_graphs: false}\n")  # every actor applies it
    assert load_recipe(p).runtime == RuntimeConfig(sync_graphs=False)
    p.write_text(base + "runtime: {kernels: triton}\n")
    with pytest.raises(ConfigError, match=r"'runtime.kernels': must be one of 'auto', 'reference'"):
        load_recipe(p)


def test_miles_lp_run_makes_the_recipe_runtime_the_process_switches(tmp_path, clean):
    """``miles-lp run`` applies the recipe's ``runtime:`` section before anything is built (stopped right after)."""
    import argparse

    import miles_lp.launch.runner as runner
    from miles_lp.cli import run as cli_run

    class Stop(Exception):
        pass

    seen = {}

    def stop(recipe):
        seen.update(graphs=switch("sync_graphs"), workers=switch("pipeline_workers"))
        raise Stop

    clean.setattr(runner, "check_transport", stop)
    p = tmp_path / "r.yaml"
    p.write_text("model: {path: 'tiny:qwen3'}\nprecision: {default: mxfp8}\nsteps: 1\n"
                 "runtime: {sync_graphs: false, pipeline_workers: 1}\n")
    parser = argparse.ArgumentParser()
    cli_run.add_arguments(parser)
    with pytest.raises(Stop):
        cli_run.run(parser.parse_args([str(p)]))
    assert seen == {"graphs": False, "workers": 1}
