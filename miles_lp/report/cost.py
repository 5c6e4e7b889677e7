"""Seed 000's cost model (CONTRACT 8): fit each stage's time per step as ``t = F + c*T`` across the steps of
one run (``T`` = the stage's tokens per step, ``tokens/<stage>``), with intervals from resampling steps.

FP8 training saves a cost per token and adds a cost per micro-batch, so comparing a quantized arm ``q`` with
a base arm ``b``:

    saved per token        s = c_b - c_q
    added per micro-batch  a = (F_q - F_b) / n_mb       (n_mb: micro-batches per step of that stage)
    break-even             a / s  tokens per micro-batch (above it the quantized arm is faster)

The break-even exists only where ``s > 0`` and ``a > 0``; otherwise the quantized arm is slower (or faster)
at every micro-batch size, and that is what is reported. Pure functions on numbers; numpy only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from miles_lp.errors import ConfigError
from miles_lp.report.runs import RunData

#: stages whose time scales with a token count the step records (sync and checks do not: weights, not tokens)
TOKEN_STAGES = ("generate", "old_log_prob", "ref", "update_actor")


@dataclasses.dataclass(frozen=True)
class Fit:
    stage: str
    n: int                      # steps used
    F: float                    # seconds per step
    c: float                    # seconds per token
    F_ci: tuple[float, float]
    c_ci: tuple[float, float]
    r2: float
    tokens: tuple[float, float]  # min, max tokens per step (how well T varied)
    micro_batches: float        # mean micro-batches per step of this stage (from the recipe's budget)
    boot_F: np.ndarray = dataclasses.field(repr=False, compare=False, default=None)
    boot_c: np.ndarray = dataclasses.field(repr=False, compare=False, default=None)


#: ``ols``: least squares; ``theil-sen``: the median of the slopes between every two steps of different ``T`` and
#: the median intercept at that slope (robust: a few steps far off the line, a hiccup of the host or a collector,
#: move it little; least squares follows them)
METHODS = ("ols", "theil-sen")


def _theil_sen(T: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    i, j = np.triu_indices(len(T), 1)
    dT = T[j] - T[i]
    ok = dT != 0
    c = float(np.median((t[j] - t[i])[ok] / dT[ok]))
    return float(np.median(t - c * T)), c


def fit_line(T: Sequence[float], t: Sequence[float], method: str = "ols") -> tuple[float, float]:
    """``t = F + c*T`` by ``method`` (``METHODS``); ``(F, c)``. Refuses a constant ``T`` (``c`` is not
    identified)."""
    if method not in METHODS:
        raise ConfigError(f"fit method {method!r}: one of {', '.join(METHODS)}")
    T, t = np.asarray(T, float), np.asarray(t, float)
    if len(T) < 3:
        raise ConfigError(f"the fit needs at least 3 steps, got {len(T)}")
    if np.ptp(T) == 0:
        raise ConfigError(f"tokens per step never vary ({T[0]:g} every step): t = F + c*T cannot separate F from "
                          "c; run with more steps or a task whose response length varies, or pool runs of "
                          "different sizes (`experiment cost --pool`)")
    if method == "theil-sen":
        return _theil_sen(T, t)
    A = np.stack([np.ones_like(T), T], 1)
    (F, c), *_ = np.linalg.lstsq(A, t, rcond=None)
    return float(F), float(c)


def bootstrap_fit(T, t, resamples: int = 2000, seed: int = 0,
                  groups: Sequence[object] | None = None, method: str = "ols") -> tuple[np.ndarray, np.ndarray]:
    """``(F, c)`` of ``resamples`` fits to steps drawn with replacement (draws with constant ``T`` skipped).
    With ``groups`` (one label per step: the run a pooled step came from), each group's steps are drawn from that
    group only, as many as it has: a pooled experiment's sizes are its design, so every resample keeps them all."""
    T, t = np.asarray(T, float), np.asarray(t, float)
    rng = np.random.default_rng(seed)
    if groups is None:
        idx = rng.integers(0, len(T), size=(resamples, len(T)))
    else:
        if len(groups) != len(T):
            raise ValueError(f"bootstrap_fit: {len(groups)} group labels for {len(T)} steps")
        labels = list(dict.fromkeys(groups))
        members = [np.flatnonzero([g == lab for g in groups]) for lab in labels]
        idx = np.concatenate([m[rng.integers(0, len(m), size=(resamples, len(m)))] for m in members], axis=1)
    Tb, tb = T[idx], t[idx]
    if method == "theil-sen":
        fits = [_theil_sen(a, b) for a, b in zip(Tb, tb, strict=True) if np.ptp(a) > 0]
        return np.array([f[0] for f in fits]), np.array([f[1] for f in fits])
    mT, mt = Tb.mean(1, keepdims=True), tb.mean(1, keepdims=True)
    var = ((Tb - mT) ** 2).sum(1)
    ok = var > 0
    c = ((Tb - mT) * (tb - mt)).sum(1)[ok] / var[ok]
    F = mt[ok, 0] - c * mT[ok, 0]
    return F, c


def interval(x: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    x = np.asarray(x, float)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return (math.nan, math.nan)
    lo, hi = np.quantile(x, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def micro_batches_per_step(run: RunData, stage: str, tokens: float) -> float:
    """Micro-batches of ``stage`` in a step of ``tokens`` tokens, from the recipe: ``update_actor`` runs
    ``rl.mini_batches`` passes, the log-prob passes one; each pass splits by ``train.micro_batch_tokens``
    (an estimate: the learner packs whole sequences, so a pass may take one more)."""
    budget = float((run.recipe.get("train") or {}).get("micro_batch_tokens", 8192))
    passes = int((run.recipe.get("rl") or {}).get("mini_batches", 1)) if stage == "update_actor" else 1
    return passes * max(1.0, math.ceil(tokens / passes / budget))


def fit_stage(run: RunData, stage: str, skip: int = 1, resamples: int = 2000, seed: int = 0,
              method: str = "ols") -> Fit | None:
    """The fit of one stage over the run's steps after the first ``skip`` (warm-up); None if never timed. A pooled
    run (``runs.pool_runs``: steps carry ``pooled_from``) is resampled within each source run."""
    T, t, src = [], [], []
    for r in run.rows[skip:]:
        n, s = r.get(f"tokens/{stage}"), r.get(f"timing_s/{stage}")
        if isinstance(n, int | float) and isinstance(s, int | float) and n > 0 and math.isfinite(s):
            T.append(float(n))
            t.append(float(s))
            src.append(r.get("pooled_from"))
    if not T:
        return None
    try:
        F, c = fit_line(T, t, method)
    except ConfigError as exc:
        raise ConfigError(f"{run.name} ({run.path}), stage {stage}: {exc}") from None
    pred = F + c * np.asarray(T)
    ss = float(((np.asarray(t) - np.mean(t)) ** 2).sum())
    r2 = 1 - float(((np.asarray(t) - pred) ** 2).sum()) / ss if ss > 0 else math.nan
    bF, bc = bootstrap_fit(T, t, resamples, seed, groups=src if any(g is not None for g in src) else None,
                           method=method)
    nmb = float(np.mean([micro_batches_per_step(run, stage, x) for x in T]))
    return Fit(stage, len(T), F, c, interval(bF), interval(bc), r2, (min(T), max(T)), nmb, bF, bc)


def fit_run(run: RunData, skip: int = 1, resamples: int = 2000, seed: int = 0, method: str = "ols"
            ) -> dict[str, Fit]:
    out = {}
    for s in TOKEN_STAGES:
        f = fit_stage(run, s, skip, resamples, seed, method)
        if f is not None:
            out[s] = f
    return out


@dataclasses.dataclass(frozen=True)
class Comparison:
    stage: str
    saved_per_token: float          # s = c_base - c_quant (seconds per token)
    saved_ci: tuple[float, float]
    added_per_micro_batch: float    # a = (F_quant - F_base) / n_mb (seconds)
    added_ci: tuple[float, float]
    break_even: float | None        # a / s tokens per micro-batch, None where it does not exist
    break_even_ci: tuple[float, float]
    verdict: str


def compare(base: Fit, quant: Fit) -> Comparison:
    """Quantized arm against the base arm for one stage; intervals pair independent resamples of each run."""
    n = min(len(base.boot_c), len(quant.boot_c))
    nmb = quant.micro_batches
    s = base.c - quant.c
    a = (quant.F - base.F) / nmb
    bs = base.boot_c[:n] - quant.boot_c[:n]
    ba = (quant.boot_F[:n] - base.boot_F[:n]) / nmb
    with np.errstate(divide="ignore", invalid="ignore"):
        be_boot = np.where((bs > 0) & (ba > 0), ba / bs, np.nan)
    if s > 0 and a > 0:
        be, verdict = a / s, f"faster above {a / s:,.0f} tokens per micro-batch"
    elif s > 0:
        be, verdict = None, "faster at every micro-batch size (no added per-micro-batch cost)"
    elif a < 0:
        be, verdict = None, "slower per token but cheaper per micro-batch: faster only BELOW some size"
    else:
        be, verdict = None, "slower at every size: the quantized arm costs more per token and per micro-batch"
    unresolved = [what for what, (lo, hi) in (("saved per token", interval(bs)), ("added per micro-batch",
                                                                                   interval(ba))) if lo < 0 < hi]
    if unresolved:
        verdict += f"; the sign of {' and '.join(unresolved)} is not resolved (its interval spans 0)"
    frac = float(np.isfinite(be_boot).mean()) if n else 0.0
    be_ci = interval(be_boot) if frac >= 0.5 else (math.nan, math.nan)
    if be is not None and frac < 0.975:
        verdict += f" (a break-even exists in only {frac:.0%} of resamples)"
    return Comparison(base.stage, s, interval(bs), a, interval(ba), be, be_ci, verdict)


def doubts(fit: Fit) -> list[str]:
    """Why a fit should not be trusted: a negative fixed cost, a negative cost per token, little explained
    variance, T barely varying."""
    out = []
    if fit.F_ci[1] < 0:
        out.append(f"F < 0 (interval {fit.F_ci[0]:.3g}..{fit.F_ci[1]:.3g} s): not a physical fixed cost; the step "
                   "times follow something other than T (other load on the host, warm-up)")
    if fit.c_ci[1] < 0:
        out.append(f"c < 0 (interval {fit.c_ci[0] * 1e6:.3g}..{fit.c_ci[1] * 1e6:.3g} us/token): more tokens took less "
                   "time, not a cost per token; the step times follow something other than T (warm-up in the "
                   "first runs, run order)")
    if math.isfinite(fit.r2) and fit.r2 < 0.2:
        out.append(f"r2 {fit.r2:.2f}: T explains little of the time variation")
    lo, hi = fit.tokens
    if hi < 1.5 * lo:
        out.append(f"T varied only {lo:.0f}..{hi:.0f} tokens per step: F and c are poorly separated")
    return out
