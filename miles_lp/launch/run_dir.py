"""Run folders: the effective recipe, the plan, metrics, and atomic checkpoints.

    RUN_DIR/
      recipe.yaml            the effective recipe (file + --set overrides)
      run.json               plan hash, model folder, created, miles-lp version
      plan.json              the compiled precision plan
      metrics.jsonl          one JSON object per step ({"step": N, "reward/mean": ..., ...})
      model/                 the tiny model, when model.path is tiny:<arch>
      checkpoints/step_000020/{learner/ (tensors.safetensors + state.json), loop.json}
      checkpoints/latest.json  {"step": 20, "path": "step_000020"}  (written last, by rename)

A checkpoint folder is written to a temporary name and renamed; ``latest.json`` is replaced only after
that, so a failure (disk full, a kill) keeps the previous checkpoint intact and ``latest.json`` pointing
at it. Tensors go to safetensors, everything else to JSON: never pickle.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from miles_lp.errors import CheckpointError, ConfigError

LATEST = "latest.json"
KEEP = 2  # checkpoints kept (the newest two: one may be mid-write when a failure strikes)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w") as f:  # on disk before the rename: a power loss cannot leave the new name empty
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


class RunDir:
    def __init__(self, path: str | Path):
        # absolute: the run's paths are handed to other processes (the vLLM worker runs in a temp folder, an SGLang
        # server in its own working directory) that would resolve a relative one against their own
        self.path = Path(path).absolute()

    # ---- creation -------------------------------------------------------------------------------------
    @classmethod
    def create(cls, root: str | Path, name: str) -> RunDir:
        """The new run folder ``root/name`` (``root``: ``logging.output_dir``). A path that cannot be a folder (a
        regular file on the way, a parent that refuses new folders) is a ``ConfigError`` naming the blocking path,
        not a traceback."""
        path = Path(root) / name
        from miles_lp.io.atomic import blocking_file

        blocker = blocking_file(path)
        if blocker is not None:
            raise ConfigError(f"logging.output_dir {root}: the run folder {path} cannot be created: {blocker} is a "
                              "file, not a folder; set logging.output_dir to a folder (or move that file away)")
        if path.exists() and any(path.iterdir()):
            if (path / "checkpoints" / LATEST).is_file():
                raise ConfigError(f"run folder {path} exists and holds a run; choose another logging.run_name or "
                                  f"continue it with --resume {path}")
            raise ConfigError(f"run folder {path} exists, is not empty and holds no checkpoint to resume from; "
                              "choose another logging.run_name or remove that folder")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            near = next((p for p in path.parents if p.exists()), None)
            raise ConfigError(f"logging.output_dir {root}: the run folder {path} cannot be created in {near} "
                              f"({exc.strerror or exc}); set logging.output_dir to a folder you can write") from None
        return cls(path)

    def discard_unstarted(self) -> None:
        """Remove this folder if the run never got as far as a metrics row or a checkpoint (it failed to
        start, or was interrupted while starting): no half-made run folder is left behind."""
        started = (self.checkpoints / LATEST).is_file() or (
            self.metrics_path.is_file() and self.metrics_path.stat().st_size > 0)
        if not started:
            shutil.rmtree(self.path, ignore_errors=True)

    def write_header(self, recipe_yaml: str, plan_json: str | None, info: Mapping[str, Any]) -> None:
        """recipe.yaml, plan.json, run.json (``info``). With a ``model_dir`` in ``info``, run.json also gets its
        ``model_id`` (``launch.model.model_id``: config.json's sha256, the weight files' names and sizes), and with a
        ``task.path`` in the recipe its ``task_id`` (``file_id``: sha256 and size), which a resume compares;
        here, so the in-process and the Ray start both record them."""
        info = dict(info)
        if info.get("model_dir") and "model_id" not in info:
            from miles_lp.launch.model import model_id

            info["model_id"] = model_id(info["model_dir"])
        task = (yaml.safe_load(recipe_yaml) or {}).get("task") if "task_id" not in info else None
        if isinstance(task, dict) and isinstance(task.get("path"), str):  # task jsonl: its file's sha256 and size
            from miles_lp.launch.model import file_id

            info["task_id"] = file_id(task["path"])
        _write_atomic(self.path / "recipe.yaml", recipe_yaml)
        if plan_json is not None:
            _write_atomic(self.path / "plan.json", plan_json)
        _write_atomic(self.path / "run.json", json.dumps(dict(info), indent=2, sort_keys=True))

    def record_resume(self, step: int, info: Mapping[str, Any]) -> None:
        """Append ``{"resumed_at_step": step, "time": ..., **info}`` to run.json's ``resumes`` list (a
        resume under another environment changes the effective checks; run.json keeps every session's, not only
        the first's ``sync_check_overrides``)."""
        data = self.info()
        data.setdefault("resumes", []).append({"resumed_at_step": int(step), "time": time.time(), **dict(info)})
        _write_atomic(self.path / "run.json", json.dumps(data, indent=2, sort_keys=True))

    @property
    def recipe_path(self) -> Path:
        return self.path / "recipe.yaml"

    def require_run(self, flag: str = "--resume") -> None:
        """Refuse a folder that ``miles-lp run`` did not make, before anything reads or starts: a run
        folder holds recipe.yaml and run.json from its start (``write_header``). A folder whose sub-folders are run
        folders (``runs/``) gets them named."""
        p = self.path
        if not p.exists():
            raise ConfigError(f"{flag} {p}: no such folder; pass a run folder (logging.output_dir/<run name>, "
                              "printed by `miles-lp run` as run_dir)")
        if not p.is_dir():
            raise ConfigError(f"{flag} {p}: a file, not a run folder; pass the folder that holds it")
        missing = [n for n in ("recipe.yaml", "run.json") if not (p / n).is_file()]
        if not missing:
            return
        runs = sorted(c.name for c in p.iterdir() if c.is_dir() and (c / "run.json").is_file()
                      and (c / "recipe.yaml").is_file())
        hint = ""
        if runs:
            shown = ", ".join(str(p / r) for r in runs[-3:])
            hint = f"; it holds {len(runs)} run folder(s), e.g. {shown}: pass one of them"
        raise ConfigError(f"{flag} {p}: not a miles-lp run folder (no {' and no '.join(missing)}). A run folder is "
                          "what `miles-lp run RECIPE` creates under logging.output_dir: recipe.yaml (the effective "
                          "recipe), run.json, plan.json, metrics.jsonl and checkpoints/ (latest.json names the "
                          f"checkpoint a resume starts from){hint}")

    def info(self) -> dict[str, Any]:
        f = self.path / "run.json"
        if not f.is_file():
            raise CheckpointError(f"{self.path} is not a miles-lp run folder (no run.json)")
        return json.loads(f.read_text())

    # ---- metrics --------------------------------------------------------------------------------------
    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    def append_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read_metrics(self) -> list[dict[str, Any]]:
        """The rows of ``metrics.jsonl``. A last line that does not parse can only be an append that a kill or a
        full disk interrupted: it is dropped, with a warning (a resume re-runs that step). A bad line before
        the last is damage: an error naming the file and line."""
        if not self.metrics_path.is_file():
            return []
        lines = self.metrics_path.read_text().splitlines()
        rows = []
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if i == len(lines) - 1:
                    print(f"miles-lp: {self.metrics_path}:{i + 1}: dropping a torn last line (an interrupted "
                          "append)", file=sys.stderr)
                    break
                raise CheckpointError(f"{self.metrics_path}:{i + 1}: not a JSON metrics row ({exc.msg}); the file "
                                      "is damaged: repair or remove that line") from None
        return rows

    def truncate_metrics(self, before_step: int) -> None:
        """Keep only steps < ``before_step`` (a resume re-runs the steps after its checkpoint)."""
        rows = [r for r in self.read_metrics() if r["step"] < before_step]
        _write_atomic(self.metrics_path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))

    # ---- checkpoints ----------------------------------------------------------------------------------
    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def save_checkpoint(self, step: int, learner_state: Mapping[str, Any], loop: Mapping[str, Any]) -> Path:
        """Write checkpoint ``step`` (the next step to run) atomically, then point ``latest.json`` at it."""
        from miles_lp.io.atomic import atomic_output_dir
        from miles_lp.train.state_io import save_learner_state

        name = f"step_{step:06d}"
        out = self.checkpoints / name
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        try:
            with atomic_output_dir(out, overwrite=True) as tmp:
                save_learner_state(learner_state, tmp / "learner")
                (tmp / "loop.json").write_text(json.dumps({**loop, "step": step, "saved": time.time()},
                                                          sort_keys=True))
        except (OSError, CheckpointError) as exc:  # atomic_output_dir reports OSErrors as CheckpointError
            prev = self.latest()
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise CheckpointError(f"checkpoint at step {step} could not be written to {out}: {why}; "
                                  f"the previous checkpoint is intact ({prev or 'none'})") from None
        _write_atomic(self.checkpoints / LATEST, json.dumps({"step": step, "path": name}))
        self._prune(keep=name)
        return out

    def _prune(self, keep: str) -> None:
        from miles_lp.io.atomic import remove_stale_temps

        done = sorted(p for p in self.checkpoints.glob("step_*") if p.is_dir())
        for old in done[:-KEEP]:
            if old.name != keep:
                shutil.rmtree(old, ignore_errors=True)
        remove_stale_temps(self.checkpoints / keep, any_name=True)  # half-written checkpoints of killed runs

    def latest(self) -> Path | None:
        f = self.checkpoints / LATEST
        if not f.is_file():
            return None
        doc = json.loads(f.read_text())
        path = self.checkpoints / doc["path"]
        return path if path.is_dir() else None

    def load_checkpoint(self, path: Path | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """(learner state, loop state) of ``path`` or the latest checkpoint."""
        from miles_lp.train.state_io import load_learner_state

        path = path or self.latest()
        if path is None:
            raise CheckpointError(f"{self.path}: no checkpoint to resume from (checkpoints/{LATEST} missing); "
                                  "set checkpoint_every > 0 in the recipe")
        loop = json.loads((path / "loop.json").read_text())
        return load_learner_state(path / "learner"), loop


def load_run_checkpoint(run_dir: str | Path, learner) -> dict[str, Any]:
    """Load a run folder's latest checkpoint into ``learner`` (for ``miles-lp export --run-dir``).

    The learner must be built as the run built it: the run's model (``RUN_DIR/model`` for tiny models, see
    ``run.json`` ``model_dir``) and the plan of ``RUN_DIR/recipe.yaml``. Returns the loop state (step, ...).
    """
    rd = RunDir(run_dir)
    state, loop = rd.load_checkpoint()
    learner.load_state_dict(state)
    return loop
