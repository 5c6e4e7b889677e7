"""Curves of one or more runs from their ``metrics.jsonl`` (matplotlib, Agg; imported lazily).

    plot_runs(["runs/tiny-mxfp8", "runs/tiny-bf16"], "reward.png", keys=("reward/mean", "rollout_corr/kl"))

The richer overlay and tables are ``miles-lp report``; this is the small plot the docs embed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from miles_lp.launch.run_dir import RunDir


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` steps (the first points average what exists)."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1):i + 1]
        out.append(sum(part) / len(part))
    return out


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path, keys: Sequence[str] = ("reward/mean",),
              labels: Sequence[str] | None = None, window: int = 5, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(5.2 * len(keys), 3.6), squeeze=False)
    for j, key in enumerate(keys):
        ax = axes[0][j]
        for i, d in enumerate(run_dirs):
            rows = [r for r in RunDir(d).read_metrics() if key in r]
            label = labels[i] if labels else Path(d).name
            xs, ys = [r["step"] for r in rows], [r[key] for r in rows]
            line, = ax.plot(xs, ys, alpha=0.3, lw=1)
            ax.plot(xs, smooth(ys, window), color=line.get_color(), lw=2, label=f"{label} ({window}-step mean)")
        ax.set_xlabel("RL step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
