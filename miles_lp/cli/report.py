"""``miles-lp report``: overlay plots and a Markdown summary table of one or more run folders."""

from __future__ import annotations

HELP = "plot and tabulate run folders (reward, rollout_corr/kl, entropy, length, per-stage and sync time)"
DESCRIPTION = HELP + """

Reads RUN_DIR/metrics.jsonl of each run (names from the folders, or --names) and writes into --out:
  report_training.png   reward/mean, rollout_corr/kl, actor/entropy, response_length/mean per step
  report_stages.png     timing_s/<stage> per step (generate, old_log_prob, ref, update_actor, sync, checks)
  report_sync.png       perf/sync_seconds, perf/sync_check_seconds
  report.md             last-N means, per-stage time, tokens per second

  miles-lp report runs/tiny-bf16 runs/tiny-mxfp8 --out /tmp/report
  miles-lp report runs/* --out docs/img --prefix report_tiny_ --last 10 --smooth 5
"""


def add_arguments(p) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders written by `miles-lp run`")
    p.add_argument("--out", required=True, help="output folder for the PNGs and report.md")
    p.add_argument("--names", nargs="+", default=None, help="one display name per RUN_DIR (default: folder names)")
    p.add_argument("--last", type=int, default=10, help="steps averaged in the table (default 10)")
    p.add_argument("--smooth", type=int, default=1, help="trailing-mean window of the curves (default 1: raw)")
    p.add_argument("--prefix", default="report_", help="file name prefix of the PNGs (default report_)")


def run(args) -> int:
    from pathlib import Path

    from miles_lp.errors import ConfigError
    from miles_lp.report.plots import figures, save
    from miles_lp.report.runs import load_runs
    from miles_lp.report.summary import table

    if args.last < 1 or args.smooth < 1:
        raise ConfigError(f"--last {args.last} / --smooth {args.smooth}: both must be >= 1")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; name a folder (created if missing)")
    runs = load_runs(args.run_dirs, args.names)
    try:  # before any figure: a path under a file or an unwritable place is a clear error, not a traceback
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        from miles_lp.io.atomic import blocking_file

        blocker = blocking_file(out.parent)
        why = f"{blocker} is a file, not a folder" if blocker else (exc.strerror or type(exc).__name__)
        raise ConfigError(f"--out {out}: cannot create the folder ({why}); name a folder that can be created") from exc
    written = []
    import matplotlib.pyplot as plt

    for name, fig in figures(runs, args.smooth).items():
        written.append(save(fig, out / f"{args.prefix}{name}.png"))
        plt.close(fig)
    md = table(runs, args.last)
    tmp = out / ".report.md.tmp"
    tmp.write_text(f"# Runs: {', '.join(r.name for r in runs)}\n\n" + md)
    tmp.replace(out / "report.md")
    written.append(out / "report.md")
    print(md)
    for w in written:
        print(f"wrote {w}")
    return 0
