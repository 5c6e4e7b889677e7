"""Overlay plots of several runs (matplotlib, Agg; imported lazily). Every figure's axes are titled with the
metric key and carry one line per run, labelled with the run's name, holding the raw per-step values
(``smooth > 1`` adds a trailing mean instead), so tests read the plotted data back from the figure.

Figures: ``training`` (reward, rollout_corr/kl, entropy, response length), ``stages`` (step time per stage),
``sync`` (sync and check seconds).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from miles_lp.report.runs import RunData

TRAINING_KEYS = ("reward/mean", "rollout_corr/kl", "actor/entropy", "response_length/mean")
SYNC_KEYS = ("perf/sync_seconds", "perf/sync_check_seconds")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def trailing_mean(values: Sequence[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1):i + 1]
        out.append(sum(part) / len(part))
    return out


def overlay(runs: Sequence[RunData], keys: Sequence[str], title: str, smooth: int = 1, ncols: int = 2):
    """One subplot per key (titled with it), one line per run that has the key."""
    plt = _plt()
    keys = list(keys)
    ncols = max(1, min(ncols, len(keys)))
    nrows = (len(keys) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.4 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        for run in runs:
            xs, ys = run.series(key)
            if xs:
                ax.plot(xs, trailing_mean(ys, smooth) if smooth > 1 else ys, label=run.name, lw=1.3)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def figures(runs: Sequence[RunData], smooth: int = 1) -> dict:
    stages = [s for s in ("generate", "reward", "old_log_prob", "ref", "update_actor", "sync", "checks")
              if any(s in r.stages() for r in runs)]
    return {
        "training": overlay(runs, TRAINING_KEYS, "training", smooth),
        "stages": overlay(runs, [f"timing_s/{s}" for s in stages] + ["timing_s/step"], "time per step by stage (s)",
                          smooth, ncols=3),
        "sync": overlay(runs, SYNC_KEYS, "weight sync (s)", smooth),
    }


def save(fig, path: Path, dpi: int = 90) -> Path:
    """Written to a temporary name and renamed (a partial PNG is never left under the final name)."""
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.png")
    try:
        fig.savefig(tmp, dpi=dpi)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def cost_figure(runs: Sequence[RunData], fits: Sequence[dict]):
    """Per stage: each run's (tokens, seconds) points (label ``<run>``) and its fitted line (``<run> fit``)."""
    plt = _plt()
    stages = [s for s in ("generate", "old_log_prob", "ref", "update_actor") if any(s in f for f in fits)]
    fig, axes = plt.subplots(1, max(1, len(stages)), figsize=(4.6 * max(1, len(stages)), 3.6), squeeze=False)
    for ax, stage in zip(axes.flat, stages, strict=False):
        for k, (run, fit) in enumerate(zip(runs, fits, strict=True)):
            if stage not in fit:
                continue
            f = fit[stage]
            T, t = [], []
            for r in run.rows:
                n, s = r.get(f"tokens/{stage}"), r.get(f"timing_s/{stage}")
                if isinstance(n, int | float) and isinstance(s, int | float) and n > 0:
                    T.append(n)
                    t.append(s)
            color = f"C{k}"
            ax.plot(T, t, "o", ms=3, alpha=0.5, color=color, label=run.name)
            lo, hi = f.tokens
            ax.plot([lo, hi], [f.F + f.c * lo, f.F + f.c * hi], "-", color=color,
                    label=f"{run.name} fit: F={f.F:.3g}s c={f.c * 1e6:.3g}us/tok")
        ax.set_title(f"timing_s/{stage}")
        ax.set_xlabel(f"tokens/{stage} per step")
        ax.set_ylabel("s per step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("t = F + c*T per stage")
    fig.tight_layout()
    return fig
