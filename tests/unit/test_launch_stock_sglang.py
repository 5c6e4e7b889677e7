"""Against a stock SGLang server (``rollout.server: sglang``) C1-C4 can never be answered, so ``raise``
for any of them is refused at start (and listed by ``--dry-run``), naming the key, the recipe line or the ``--set`` /
environment variable that set it, and the ways out; ``warn`` runs and says once at start that they are skipped."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from miles_lp.errors import ConfigError
from miles_lp.launch.dry_run import dry_run
from miles_lp.launch.recipe import load_recipe
from miles_lp.launch.runner import Run, check_answerable, never_answered, note_skipped_checks

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-mxfp8.yaml"  # layer_audit, grid, storage: raise; self_check: warn
STOCK = ["rollout.backend=sglang", "rollout.url=http://127.0.0.1:9", "rollout.server=sglang", "rollout.device=auto"]
C14 = ("layer_audit", "grid", "self_check", "storage")
WARN = [f"sync.checks.{c}=warn" for c in C14]


def _checks_line(path: Path) -> int:
    """The recipe's own line of ``sync.checks`` (a flow mapping: every check on that line or the next)."""
    return next(i for i, s in enumerate(path.read_text().splitlines(), 1) if s.strip().startswith("checks:"))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in [v for v in os.environ if v.startswith("MILES_LP_SYNC_CHECK")]:
        monkeypatch.delenv(var)


def test_raise_refused_naming_key_file_line_and_fix():
    line = _checks_line(RECIPE)
    recipe = load_recipe(RECIPE, STOCK)
    with pytest.raises(ConfigError) as ei:
        check_answerable(recipe, {})
    msg = str(ei.value)
    assert ei.value.source == str(RECIPE) and ei.value.line == line
    assert msg.startswith(f"{RECIPE}:{line}: sync.checks.layer_audit: raise (line {line}), sync.checks.grid: raise "
                          f"(line {line}), sync.checks.storage: raise (line {line}): a stock SGLang server")
    assert "self_check" not in msg.split(": a stock")[0]  # warn in this recipe: not refused
    assert "Set sync.checks.layer_audit: warn, sync.checks.grid: warn, sync.checks.storage: warn" in msg
    assert "rollout.server: miles-lp" in msg


def test_a_set_override_is_named_instead_of_the_file_line():
    recipe = load_recipe(RECIPE, [*STOCK, "sync.checks.layer_audit=warn", "sync.checks.grid=off",
                                  "sync.checks.storage=warn", "sync.checks.self_check=raise"])
    with pytest.raises(ConfigError, match=re.escape("sync.checks.self_check: raise (--set sync.checks.self_check=raise)"
                                                    ": a stock SGLang server (rollout.server: sglang) can never answer "
                                                    "it: it has no endpoint reporting its serving kernels' output (C3)")):
        check_answerable(recipe, {})
    # a whole section replaced by --set: that --set is the origin
    recipe = load_recipe(RECIPE, [*STOCK, "sync.checks={grid: raise}"])
    with pytest.raises(ConfigError, match=re.escape("sync.checks.grid: raise (--set sync.checks={grid: raise})")):
        check_answerable(recipe, {})


def test_environment_overrides_to_raise_are_refused_the_same_way():
    recipe = load_recipe(RECIPE, [*STOCK, *WARN])
    check_answerable(recipe, {})  # all warn: starts
    with pytest.raises(ConfigError) as ei:
        check_answerable(recipe, {"MILES_LP_SYNC_CHECKS": "raise"})
    msg = str(ei.value)
    assert all(f"sync.checks.{c}: raise (MILES_LP_SYNC_CHECKS=raise)" in msg for c in C14)
    assert "Set MILES_LP_SYNC_CHECK_LAYER_AUDIT=warn" in msg and "(or unset MILES_LP_SYNC_CHECKS)" in msg
    # the per-check variable wins, as in SyncConfig.with_env: both directions
    env = {"MILES_LP_SYNC_CHECKS": "raise", **{f"MILES_LP_SYNC_CHECK_{c.upper()}": "warn" for c in C14}}
    check_answerable(recipe, env)
    with pytest.raises(ConfigError, match=re.escape("sync.checks.grid: raise (MILES_LP_SYNC_CHECK_GRID=raise)")):
        check_answerable(load_recipe(RECIPE, STOCK), {"MILES_LP_SYNC_CHECK_GRID": "raise"})
    # an environment that turns the recipe's raise to warn makes it startable (the file says raise, the run warns)
    check_answerable(load_recipe(RECIPE, [*STOCK, "sync.checks.self_check=warn"]), {"MILES_LP_SYNC_CHECKS": "warn"})


def test_only_a_stock_server_is_refused():
    check_answerable(load_recipe(RECIPE), {})  # reference engine: every check answered
    check_answerable(load_recipe(RECIPE, [s for s in STOCK if s != "rollout.server=sglang"]), {})  # miles-lp serve
    assert never_answered(load_recipe(RECIPE, [s for s in STOCK if s != "rollout.server=sglang"])) == []


def test_run_start_refuses_before_building_anything(tmp_path, monkeypatch):
    import miles_lp.launch.runner as runner

    def never(*a, **k):
        raise AssertionError("the refusal must come before the model is prepared")
    monkeypatch.setattr("miles_lp.launch.model.prepare_model", never)
    monkeypatch.setattr(runner, "make_engine", never)
    recipe = load_recipe(RECIPE, [*STOCK, f"logging.output_dir={tmp_path / 'runs'}", "logging.progress=false"])
    with pytest.raises(ConfigError, match=r"sync\.checks\.grid: raise \(line \d+\).*can never answer them"):
        Run.start(recipe)
    assert not list((tmp_path / "runs").glob("*"))  # no run folder left behind
    monkeypatch.setenv("MILES_LP_SYNC_CHECK_LAYER_AUDIT", "raise")  # read from the driver's environment at start
    recipe = load_recipe(RECIPE, [*STOCK, *WARN, f"logging.output_dir={tmp_path / 'runs'}"])
    with pytest.raises(ConfigError, match=re.escape("(MILES_LP_SYNC_CHECK_LAYER_AUDIT=raise)")):
        Run.start(recipe)


def test_dry_run_lists_the_refusal_and_the_skipped_checks(capsys, monkeypatch):
    from miles_lp.cli import main

    args = ["run", str(RECIPE), "--dry-run", *[a for s in STOCK for a in ("--set", s)]]
    assert main(args) == 0  # listed, not fatal: the rest of the recipe is still validated
    out = json.loads(capsys.readouterr().out)
    refusals = [r for r in out["would_refuse_at_start"] if "stock SGLang server" in r]
    assert len(refusals) == 1 and refusals[0].startswith(f"{RECIPE}:{_checks_line(RECIPE)}: sync.checks.layer_audit")
    assert out["checks_never_answered"] == list(C14)
    assert main([*args, *[a for s in WARN for a in ("--set", s)]]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not [r for r in out["would_refuse_at_start"] if "stock SGLang server" in r]
    assert out["checks_never_answered"] == list(C14)  # warn: still named (skipped at every sync)
    monkeypatch.setenv("MILES_LP_SYNC_CHECKS", "raise")  # the dry run applies this shell's variables as the run would
    out = dry_run(load_recipe(RECIPE, [*STOCK, *WARN]))
    assert any("(MILES_LP_SYNC_CHECKS=raise)" in r for r in out["would_refuse_at_start"])
    monkeypatch.setenv("MILES_LP_SYNC_CHECKS", "off")
    out = dry_run(load_recipe(RECIPE, [*STOCK, *WARN]))
    assert "checks_never_answered" not in out and not out["would_refuse_at_start"]


def test_warn_mode_says_once_at_start_that_the_checks_are_skipped(capsys):
    recipe = load_recipe(RECIPE, [*STOCK, *WARN[:3], "sync.checks.storage=off"])
    assert note_skipped_checks(recipe, {}) == ["layer_audit", "grid", "self_check"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "answers none of layer_audit, grid, self_check: they are skipped at every sync" in err
    assert note_skipped_checks(recipe, {"MILES_LP_SYNC_CHECK_GRID": "off"}) == ["layer_audit", "self_check"]


def test_recipe_origin_keeps_the_file_lines_under_overrides():
    plain = load_recipe(RECIPE)
    line = _checks_line(RECIPE)
    assert plain.origin("sync.checks.grid") == (f"{RECIPE}:{line}", line)
    assert plain.origin("sync.nope") == (str(RECIPE), None)
    over = load_recipe(RECIPE, ["steps=2", "sync.checks.grid=warn"])
    assert over.origin("sync.checks.storage") == (f"{RECIPE}:{line}", line)  # untouched by any --set
    assert over.origin("sync.checks.grid") == ("--set sync.checks.grid=warn", None)


def test_the_ray_run_refuses_the_same_way_before_any_actor(monkeypatch):
    """The Ray run (``ray.enabled``) builds nothing before the refusal either (no placement group, no actor)."""
    pytest.importorskip("ray")
    from miles_lp.launch import ray_launcher

    def never(*a, **k):
        raise AssertionError("the refusal must come before the model is prepared")
    monkeypatch.setattr("miles_lp.launch.model.prepare_model", never)
    recipe = load_recipe(RECIPE, [*STOCK, "ray.enabled=true"])
    with pytest.raises(ConfigError, match=r"sync\.checks\.layer_audit: raise \(line \d+\).*stock SGLang server"):
        ray_launcher.RayRun(recipe, None, resume=False, start_step=0, loop_state={}, learner_state_dir=None)
