"""The Markdown summary table of ``miles-lp report``: last-N means per run, per-stage time, tokens per second.

Tokens per second: generated tokens per second of step time (the window's ``sum(tokens/generate) /
sum(timing_s/step)``), and per stage ``sum(tokens/<stage>) / sum(timing_s/<stage>)`` (the stage's own throughput)
for the stages that count tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from miles_lp.report.runs import RunData

HEADLINE = (("reward/mean", "reward"), ("rollout_corr/kl", "rollout_corr/kl"), ("rollout_corr/k3_kl", "k3_kl"),
            ("actor/entropy", "entropy"), ("response_length/mean", "resp len"), ("timing_s/step", "step s"))
TOKEN_STAGES = ("generate", "old_log_prob", "ref", "update_actor")


def last_mean(run: RunData, key: str, last: int) -> float:
    ys = run.series(key)[1][-last:]
    return sum(ys) / len(ys) if ys else math.nan


def rate(run: RunData, tokens_key: str, time_key: str, last: int) -> float:
    """Tokens over time across the last ``last`` steps with both keys (and a positive time): ``sum(n) / sum(t)``,
    not the mean of per-step ratios, which overstates throughput when step times vary."""
    tokens = seconds = 0.0
    for r in run.rows[-last:]:
        t, n = r.get(time_key), r.get(tokens_key)
        if isinstance(t, int | float) and isinstance(n, int | float) and t > 0:
            tokens += n
            seconds += t
    return tokens / seconds if seconds > 0 else math.nan


def fmt(v: float) -> str:
    if not math.isfinite(v):
        return "-"
    if v == 0:
        return "0"
    a = abs(v)
    return f"{v:.3g}" if 1e-3 <= a < 1e5 else f"{v:.2e}"


def table(runs: Sequence[RunData], last: int = 10) -> str:
    stages = [s for s in ("generate", "reward", "old_log_prob", "ref", "update_actor", "sync", "checks")
              if any(s in r.stages() for r in runs)]
    head = (["run", "steps"] + [h for _, h in HEADLINE] + [f"{s} s" for s in stages]
            + ["gen tok/s (step)"] + [f"{s} tok/s" for s in TOKEN_STAGES if s in stages])
    lines = [f"Means over the last {last} steps of each run.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        cells = [r.name, str(len(r.rows))]
        cells += [fmt(last_mean(r, k, last)) for k, _ in HEADLINE]
        cells += [fmt(last_mean(r, f"timing_s/{s}", last)) for s in stages]
        cells.append(fmt(rate(r, "tokens/generate", "timing_s/step", last)))
        cells += [fmt(rate(r, f"tokens/{s}", f"timing_s/{s}", last)) for s in TOKEN_STAGES if s in stages]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
