"""The driver loop, the same for every placement (slime's ``train.py`` shape):

    run = Run.start(recipe)                           # build: refusals, model, plan, learner, engines, initial sync
    for step in range(run.step, recipe.steps):
        metrics = run.step_once()                     # generate -> reward -> train -> sync (rl/step.py grpo_step)
        log(metrics); checkpoint every N steps        # runner.record_step

``drive`` is that loop with its progress bar, TensorBoard scalars and the errors a run stops with: a failed
sync names the resume command (``run.sync_failed``); an engine that died is restarted inside ``step_once``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HEADLINE = (("reward/mean", "reward"), ("rollout_corr/kl", "kl"), ("actor/entropy", "ent"),
            ("response_length/mean", "len"), ("timing_s/step", "s/step"))


def drive(run: Any, *, progress: bool | None = None, tensorboard: bool | None = None,
          on_step: Callable[[Any, dict[str, float]], None] | None = None) -> list[dict[str, float]]:
    """Steps of ``run`` until ``run.recipe.steps``; the metrics of the steps run here."""
    from miles_lp.rl.step import RunError
    from miles_lp.sync import SyncError

    recipe = run.recipe
    progress = recipe.logging.progress if progress is None else progress
    on = recipe.logging.tensorboard if tensorboard is None else tensorboard
    tb = tensorboard_writer(run.dir.path) if on else None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=recipe.steps, initial=run.step, desc=run.dir.path.name, file=sys.stderr, dynamic_ncols=True)
    out = []
    try:
        while run.step < recipe.steps:
            step = run.step
            try:
                m = run.step_once()
            except RunError:
                raise
            except SyncError as exc:  # the failure, then how to resume
                raise run.sync_failed(step, exc) from exc
            out.append(m)
            if on_step is not None:
                on_step(run, m)
            if tb is not None:
                for k, v in m.items():
                    if isinstance(v, float) and math.isfinite(v):
                        tb.add_scalar(k, v, step)
            if bar is not None:
                bar.set_postfix_str(" ".join(f"{short}={m[k]:.3g}" for k, short in HEADLINE if k in m))
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        if tb is not None:
            tb.close()
    return out



def tensorboard_writer(path: Path):
    """A TensorBoard writer under ``path/tensorboard``, or None (one line on stderr) without the package."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional; JSONL is always written
        print("miles-lp run: logging.tensorboard is on but the tensorboard package is not installed; metrics go "
              "to metrics.jsonl only (pip install tensorboard)", file=sys.stderr)
        return None
    return SummaryWriter(str(path / "tensorboard"))
