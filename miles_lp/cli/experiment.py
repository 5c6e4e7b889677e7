"""``miles-lp experiment``: seed 000's controlled experiments as commands (``cost``, ``matching``)."""

from __future__ import annotations

HELP = "seed 000's experiments: the per-stage cost fit and break-even (cost), the sampler matching table (matching)"
DESCRIPTION = HELP + """

  miles-lp experiment cost runs/tiny-bf16 runs/tiny-mxfp8 --out /tmp/cost
      fits t = F + c*T per stage (T = tokens/<stage> per step) across each run's steps, intervals from
      resampling steps, compares every run with the first (--base), prints the break-even tokens per
      micro-batch (added cost per micro-batch / saved cost per token) and plots the fits.
  miles-lp experiment matching recipes/tiny-mxfp8.yaml --out /tmp/matching
      learning rate 0 (weights never change), the same prompts every step, five samplers against one
      MXFP8 learner (plus BF16/BF16); rollout_corr/kl per arm with paired bootstrap intervals over prompts.
"""


COST_DESCRIPTION = """What a low-precision recipe costs and saves per training stage, from runs you already made.

Per stage (tokens/<stage> per step, T), fits t = F + c*T across each run's steps (the first --skip steps left
out), with intervals from resampling steps; compares every run with the base (--base, default the first
RUN_DIR) and prints the break-even tokens per micro-batch: the added fixed cost per micro-batch over the saved
cost per token. Writes cost.json and cost_fit.png to --out.

  miles-lp run recipes/tiny-bf16.yaml --run-name tiny-bf16
  miles-lp run recipes/tiny-mxfp8.yaml --run-name tiny-mxfp8
  miles-lp experiment cost runs/tiny-bf16 runs/tiny-mxfp8 --out /tmp/cost

Where every step has the same tokens (responses that always reach their cap), vary the size across runs instead
and pool them: --pool N takes every N consecutive RUN_DIRs as one arm (e.g. the runs with rl.prompts_per_step 2,
4, 8, or rollout.max_response_len 32, 256), drops each run's first --skip steps, concatenates the rest and fits
those (--names: one per arm); the intervals then resample steps within each run, so every resample keeps every
size. With --out it also writes each pooled arm as a run folder (pooled-NAME/), which `experiment cost --skip 0`
reads again. A stage whose tokens per step are the same in every pooled step is refused (F and c not separable).

  miles-lp experiment cost runs/bf16-p2 runs/bf16-p4 runs/bf16-p8 runs/mxfp8-p2 runs/mxfp8-p4 runs/mxfp8-p8 \
      --pool 3 --names bf16 mxfp8 --out /tmp/cost
"""

MATCHING_DESCRIPTION = """Which sampler matches an MXFP8 learner (seed 000's Table 2), at learning rate 0.

The weights never change and every step generates from the same prompts, so differences are the samplers'
alone. Five arms: a BF16 learner with a BF16 sampler (the control), then an MXFP8 learner with the shared-grid
sampler, one with gate_up kept BF16, a BF16 sampler, and a sampler on a different grid; per arm, rollout_corr/kl
with paired bootstrap intervals over prompts. Writes matching.json, matching.md and matching.png to --out.

  miles-lp experiment matching recipes/tiny-mxfp8.yaml --out /tmp/matching
  miles-lp experiment matching recipes/tiny-mxfp8.yaml --arms "shared grid,bf16 sampler" --steps 3
"""


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    import argparse

    c = sub.add_parser("cost", help="fit t = F + c*T per stage; break-even tokens per micro-batch",
                       formatter_class=argparse.RawDescriptionHelpFormatter, description=COST_DESCRIPTION)
    c.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run folders written by `miles-lp run` (their metrics.jsonl); the first is the base")
    c.add_argument("--base", default=None, help="name of the base (BF16) run; default the first RUN_DIR")
    c.add_argument("--names", nargs="+", default=None, help="display names, one per RUN_DIR (per arm with --pool)")
    c.add_argument("--pool", type=int, default=None, metavar="N",
                   help="every N consecutive RUN_DIRs are one arm (runs differing in batch size or response length), "
                   "pooled after dropping each run's first --skip steps")
    c.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the fit (default 1)")
    c.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples of steps (default 2000)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--fit", choices=("ols", "theil-sen"), default="ols",
                   help="ols: least squares (default); theil-sen: the median pairwise slope, robust to a few steps "
                        "far off the line (a host hiccup); the intervals resample the same estimator")
    c.add_argument("--out", default=None, help="folder for cost_fit.png and cost.json")
    c.add_argument("--micro-batch-sweep", action="store_true",
                   help="train every run's learner on one identical set of trajectories (re-sampled from the first "
                        "run's recipe: runs do not record theirs) at several micro-batch sizes; fit t = F + a*n_mb")
    c.add_argument("--sizes", default="64,128,256,1024,8192",
                   help="micro_batch_tokens of the sweep (default 64,128,256,1024,8192)")
    c.add_argument("--repeats", type=int, default=2, help="timed update passes per size (default 2)")
    m = sub.add_parser("matching", help="seed 000's Table 2: sampler pairings at learning rate 0",
                       formatter_class=argparse.RawDescriptionHelpFormatter, description=MATCHING_DESCRIPTION)
    m.add_argument("recipe", metavar="RECIPE", help="the MXFP8 learner's recipe YAML (e.g. recipes/tiny-mxfp8.yaml)")
    m.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe overrides")
    m.add_argument("--steps", type=int, default=6, help="steps pooled (the same prompts each step; default 6)")
    m.add_argument("--prompts", type=int, default=None, help="prompts per step (default: the recipe's)")
    m.add_argument("--resamples", type=int, default=10_000, help="paired bootstrap resamples of prompts")
    m.add_argument("--arms", default=None, help="comma-separated subset of the arms (default all five)")
    m.add_argument("--workdir", default=None, help="where the tiny model and engine checkpoints are built "
                   "(default a temporary folder)")
    m.add_argument("--out", default=None, help="folder for matching.json, matching.md and matching.png")
    m.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    if args.experiment == "cost":
        return _cost(args)
    return _matching(args)


def _us(x: float) -> str:
    return f"{x * 1e6:.3g}"


def _cost(args) -> int:
    import json
    import math
    from pathlib import Path

    from miles_lp.errors import ConfigError
    from miles_lp.report.cost import compare, doubts, fit_run
    from miles_lp.report.runs import load_runs

    if args.pool is not None:
        runs, skip = _pooled(args), 0
    else:
        runs, skip = load_runs(args.run_dirs, args.names), args.skip
    if args.micro_batch_sweep:
        return _sweep(args, runs)
    names = [r.name for r in runs]
    base_name = args.base or names[0]
    if base_name not in names:
        raise ConfigError(f"--base {base_name}: no such run; runs are {', '.join(names)}")
    fits = [fit_run(r, skip, args.resamples, args.seed, args.fit) for r in runs]
    out: dict = {"fit": args.fit, "runs": {}, "comparisons": {}}
    how = "least squares" if args.fit == "ols" else "Theil-Sen (median pairwise slope)"
    print(f"t = F + c*T per stage (T = tokens of the stage per step), {how}; 95% intervals from resampling steps")
    print(f"{'run':28s} {'stage':13s} {'n':>3s} {'F s/step':>22s} {'c us/token':>24s} {'r2':>5s} {'T range':>11s}"
          f" {'mb/step':>7s}")
    for r, fit in zip(runs, fits, strict=True):
        out["runs"][r.name] = {}
        for s, f in fit.items():
            print(f"{r.name:28s} {s:13s} {f.n:3d} {f.F:8.3g} [{f.F_ci[0]:.3g}, {f.F_ci[1]:.3g}]"
                  f" {_us(f.c):>8s} [{_us(f.c_ci[0])}, {_us(f.c_ci[1])}] {f.r2:5.2f}"
                  f" {f.tokens[0]:5.0f}-{f.tokens[1]:<5.0f} {f.micro_batches:7.1f}")
            out["runs"][r.name][s] = {"n": f.n, "F": f.F, "F_ci": f.F_ci, "c": f.c, "c_ci": f.c_ci, "r2": f.r2,
                                      "tokens": f.tokens, "micro_batches": f.micro_batches, "doubts": doubts(f)}
            for d in doubts(f):
                print(f"{'':28s}   note: {d}")
    bi = names.index(base_name)
    for r, fit in zip(runs, fits, strict=True):
        if r.name == base_name:
            continue
        print(f"\n{r.name} against {base_name}:")
        out["comparisons"][r.name] = {}
        for s, f in fit.items():
            if s not in fits[bi]:
                continue
            cmp = compare(fits[bi][s], f)
            shaky = bool(doubts(fits[bi][s]) or doubts(f))
            be = "none" if cmp.break_even is None else f"{cmp.break_even:,.0f}"
            ci = "" if math.isnan(cmp.break_even_ci[0]) else \
                f" [{cmp.break_even_ci[0]:,.0f}, {cmp.break_even_ci[1]:,.0f}]"
            print(f"  {s:13s} saved/token {_us(cmp.saved_per_token)} us [{_us(cmp.saved_ci[0])}, "
                  f"{_us(cmp.saved_ci[1])}]  added/micro-batch {cmp.added_per_micro_batch * 1e3:.3g} ms "
                  f"[{cmp.added_ci[0] * 1e3:.3g}, {cmp.added_ci[1] * 1e3:.3g}]  break-even {be}{ci} tokens/mb: "
                  f"{cmp.verdict}" + (" (UNRELIABLE: see the fit notes above)" if shaky else ""))
            out["comparisons"][r.name][s] = {
                "saved_per_token_s": cmp.saved_per_token, "saved_ci": cmp.saved_ci,
                "added_per_micro_batch_s": cmp.added_per_micro_batch, "added_ci": cmp.added_ci,
                "break_even_tokens_per_micro_batch": cmp.break_even, "break_even_ci": cmp.break_even_ci,
                "verdict": cmp.verdict, "reliable": not shaky}
    if args.out:
        import matplotlib.pyplot as plt

        from miles_lp.report.plots import cost_figure, save

        d = Path(args.out)
        fig = cost_figure(runs, fits)
        print(f"\nwrote {save(fig, d / 'cost_fit.png')}")
        plt.close(fig)
        tmp = d / ".cost.json.tmp"
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(d / "cost.json")
        print(f"wrote {d / 'cost.json'}")
    return 0


def _pooled(args) -> list:
    """``--pool N``: every N consecutive RUN_DIRs pooled into one run per arm (written to --out/pooled-NAME)."""
    from miles_lp.errors import ConfigError
    from miles_lp.report.runs import load_runs, pool_runs, write_run

    n = args.pool
    if n < 1 or len(args.run_dirs) % n:
        raise ConfigError(f"--pool {n}: {len(args.run_dirs)} RUN_DIRs do not split into arms of {n} runs each")
    arms = len(args.run_dirs) // n
    if args.names is not None and len(args.names) != arms:
        raise ConfigError(f"--names: {len(args.names)} names for {arms} pooled arms (--pool {n}); give one per arm")
    srcs = load_runs(args.run_dirs)
    names = args.names or [srcs[i * n].name for i in range(arms)]
    runs = []
    for i, name in enumerate(names):
        group = srcs[i * n:(i + 1) * n]
        runs.append(pool_runs(group, args.skip, name))
        print(f"{name}: {len(runs[-1].rows)} steps pooled from "
              + ", ".join(f"{s.name} ({max(len(s.rows) - args.skip, 0)})" for s in group))
        if args.out:
            from pathlib import Path

            print(f"wrote {write_run(runs[-1], Path(args.out) / ('pooled-' + name.replace('/', '_')))}")
    return runs


def _sweep(args, runs) -> int:
    import json
    import tempfile
    from pathlib import Path

    import numpy as np

    from miles_lp.errors import ConfigError
    from miles_lp.report.sweep import fit_per_micro_batch, sweep_one, trajectories

    try:
        sizes = [int(x) for x in args.sizes.split(",")]
    except ValueError:
        raise ConfigError(f"--sizes {args.sizes}: comma-separated integers (micro_batch_tokens)") from None
    if len(sizes) < 2 or min(sizes) < 1 or args.repeats < 1:
        raise ConfigError(f"--sizes {args.sizes} needs >= 2 sizes >= 1 and --repeats >= 1")
    for r in runs:
        if not (r.path / "recipe.yaml").is_file():
            raise ConfigError(f"{r.path}: no recipe.yaml; the sweep rebuilds the run's learner from it")
    with tempfile.TemporaryDirectory(prefix="miles-lp-sweep-") as tmp:
        work = Path(tmp)
        batch = trajectories(runs[0].path, work)
        ntok = sum(int(s["tokens"].numel()) for s in batch)
        print(f"trajectories: {len(batch)} sequences, {ntok} tokens (step 0 of {runs[0].name}), the same for every run")
        fits = {}
        for r in runs:
            fits[r.name] = fit_per_micro_batch(sweep_one(r.path, batch, sizes, args.repeats, work), args.resamples,
                                               args.seed)
    base = args.base or runs[0].name
    out = {"tokens": ntok, "sizes": sizes, "runs": {}}
    print(f"{'run':28s} {'n_mb -> s per update pass':40s} per micro-batch (ms) [95%]")
    for name, f in fits.items():
        pts = {}
        for _, n, t in f["points"]:
            pts.setdefault(n, []).append(t)
        desc = " ".join(f"{n}:{np.mean(v):.2f}" for n, v in sorted(pts.items()))
        lo, hi = f["per_micro_batch_ci"]
        print(f"{name:28s} {desc:40s} {f['per_micro_batch'] * 1e3:.3g} [{lo * 1e3:.3g}, {hi * 1e3:.3g}]")
        out["runs"][name] = {k: v for k, v in f.items() if k != "boot"}
    if base in fits:
        for name, f in fits.items():
            if name == base:
                continue
            n = min(len(f["boot"]), len(fits[base]["boot"]))
            d = f["boot"][:n] - fits[base]["boot"][:n]
            delta = f["per_micro_batch"] - fits[base]["per_micro_batch"]
            lo, hi = np.quantile(d, [0.025, 0.975])
            print(f"{name} - {base}: added per micro-batch {delta * 1e3:.3g} ms [{lo * 1e3:.3g}, {hi * 1e3:.3g}]")
            out["runs"][name]["added_per_micro_batch_vs_base"] = [delta, [float(lo), float(hi)]]
    if args.out:
        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "sweep.json").write_text(json.dumps(out, indent=1))
        print(f"wrote {d / 'sweep.json'}")
    return 0


def _matching(args) -> int:
    from miles_lp.report.matching import main

    return main(args)
