"""Reading run folders (``miles_lp.launch.run_dir`` layout) for plots and fits: metrics only, read-only.

    runs = load_runs(["runs/tiny-bf16", "runs/tiny-mxfp8"])   # names from the folders, made unique
    runs[0].series("reward/mean")                              # (steps, values) where the key is present
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
