"""Reading run folders (``miles_lp.launch.run_dir`` layout) for plots and fits: metrics only, read-only.

    runs = load_runs(["runs/tiny-bf16", "runs/tiny-mxfp8"])   # names from the folders, made unique
    runs[0].series("reward/mean")                              # (steps, values) where the key is present
    pooled = pool_runs(runs_of_one_arm, skip=1, name="bf16")    # one arm's runs at different sizes as one run
    write_run(pooled, "cost/pooled-bf16")                       # metrics.jsonl + recipe.yaml: a run folder again
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_lp.errors import ConfigError

#: the stages ``miles_lp.rl.step.grpo_step`` times (``timing_s/<stage>``), in step order
STAGES = ("generate", "reward", "old_log_prob", "ref", "update_actor", "sync", "checks")


@dataclasses.dataclass(frozen=True)
class RunData:
    name: str
    path: Path
    rows: tuple[dict[str, Any], ...]
    recipe: dict[str, Any]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """Steps and finite values of ``key`` (steps where it is absent or non-finite are skipped)."""
        xs, ys = [], []
        for i, r in enumerate(self.rows):
            v = r.get(key)
            if isinstance(v, int | float) and math.isfinite(float(v)):
                xs.append(int(r.get("step", i)))
                ys.append(float(v))
        return xs, ys

    def has(self, key: str) -> bool:
        return bool(self.series(key)[0])

    def stages(self) -> list[str]:
        """Stages with a nonzero time in some step (``ref`` is absent when ``kl_coef`` is 0)."""
        return [s for s in STAGES if any(v > 0 for v in self.series(f"timing_s/{s}")[1])]


def load_run(path: str | Path, name: str | None = None) -> RunData:
    p = Path(path)
    mf = p / "metrics.jsonl"
    if not mf.is_file():
        raise ConfigError(f"{p}: not a run folder (no metrics.jsonl); pass a folder that `miles-lp run` wrote")
    rows = []
    for n, line in enumerate(mf.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{mf}:{n}: not a JSON line ({exc.msg}); the run's metrics file is damaged") from None
    if not rows:
        raise ConfigError(f"{mf}: no steps recorded yet")
    recipe: dict[str, Any] = {}
    rf = p / "recipe.yaml"
    if rf.is_file():
        import yaml

        recipe = yaml.safe_load(rf.read_text()) or {}
    return RunData(name or p.name, p, tuple(rows), recipe)


def unique_names(paths: Sequence[Path]) -> list[str]:
    """Folder names; where two runs share one, the parent folder is prefixed (``a/run``, ``b/run``)."""
    base = [p.name for p in paths]
    names = list(base)
    for i, n in enumerate(base):
        if base.count(n) > 1:
            names[i] = f"{paths[i].parent.name}/{n}"
    for i, n in enumerate(names):
        if names.count(n) > 1:
            names[i] = f"{n}#{i}"
    return names


def load_runs(paths: Sequence[str | Path], names: Sequence[str] | None = None) -> list[RunData]:
    if not paths:
        raise ConfigError("no run folder given; pass one or more RUN_DIRs")
    ps = [Path(p).resolve() for p in paths]
    if names is not None and len(names) != len(ps):
        raise ConfigError(f"--names: {len(names)} names for {len(ps)} runs; give one name per RUN_DIR")
    return [load_run(p, n) for p, n in zip(ps, list(names) if names else unique_names(ps), strict=True)]


#: recipe keys that decide a stage's micro-batches (``report.cost``): pooled runs must agree on them
_POOL_SAME = (("train", "micro_batch_tokens"), ("rl", "mini_batches"))


def pool_runs(runs: Sequence[RunData], skip: int, name: str) -> RunData:
    """One arm's runs (e.g. ``rl.prompts_per_step`` 2, 4, 8, so tokens per step vary) as one run: each run's first
    ``skip`` steps dropped (warm-up), the rest concatenated in order, steps renumbered from 1 and ``pooled_from``
    naming the source run. The recipe is the last run's; the runs must agree on the keys that decide micro-batches
    (``train.micro_batch_tokens``, ``rl.mini_batches``). Fit the result with ``skip=0``."""
    if not runs:
        raise ConfigError(f"pool {name}: no runs to pool")
    if skip < 0:
        raise ConfigError(f"pool {name}: skip must be >= 0, got {skip}")
    for sect, key in _POOL_SAME:
        vals = {r.name: (r.recipe.get(sect) or {}).get(key) for r in runs}
        if len(set(map(repr, vals.values()))) > 1:
            raise ConfigError(f"pool {name}: the runs differ in {sect}.{key} ({vals}); pool only runs of one arm "
                              "that differ in batch size (rl.prompts_per_step)")
    rows = []
    for r in runs:
        kept = r.rows[skip:]
        if not kept:
            raise ConfigError(f"pool {name}: {r.path} has {len(r.rows)} step(s), none left after dropping the first "
                              f"{skip}; run it with more steps")
        for row in kept:
            rows.append({**row, "pooled_from": r.name, "pooled_step": row.get("step"), "step": len(rows) + 1})
    return RunData(name, runs[-1].path, tuple(rows), runs[-1].recipe)


def write_run(run: RunData, folder: str | Path) -> Path:
    """``run`` as a run folder (``metrics.jsonl``, ``recipe.yaml``) that ``load_run`` reads back."""
    import yaml

    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    for fname, text in (("metrics.jsonl", "".join(json.dumps(r) + "\n" for r in run.rows)),
                        ("recipe.yaml", yaml.safe_dump(run.recipe, sort_keys=False))):
        tmp = d / f".{fname}.tmp"
        tmp.write_text(text)
        tmp.replace(d / fname)
    return d
