"""``miles-lp bench NAME``: benchmarks, measured side by side with their anchor and reported as ratios.

Each benchmark lives in ``miles_lp.bench.<name>`` with ``HELP``, ``add_arguments(p)`` and ``run(args)``.
Speed and memory targets live here, never in unit tests.
"""

from __future__ import annotations

import argparse
import importlib

HELP = ("run a benchmark (plan, convert, linear, quantize, rollout, sync, rl-step, fp8-decode) and report ratios "
        "against its anchor")
DESCRIPTION = HELP + """

Each benchmark prints its measurement next to an anchor (a plain copy, bf16 F.linear, torchao, a dict lookup)
and the ratio; `miles-lp bench NAME --help` says what it measures and its options.

  miles-lp bench plan                     # < 1 s compile, < 1 us lookup on the DeepSeek-V3 name set
  miles-lp bench quantize --rows 4096 --cols 4096 --no-compile
  miles-lp bench convert
  miles-lp bench rl-step                  # one RL step per precision arm (smollm2 recipes), ratios to BF16
"""

BENCHES = ["plan", "convert", "linear", "quantize", "rollout", "sync", "rl-step", "fp8-decode"]


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name in BENCHES:
        try:
            module = importlib.import_module(f"miles_lp.bench.{name.replace('-', '_')}")
        except ModuleNotFoundError as exc:
            if exc.name == f"miles_lp.bench.{name.replace('-', '_')}":
                continue
            raise
        bp = sub.add_parser(name, help=module.HELP, description=getattr(module, "DESCRIPTION", module.HELP),
                            formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
        module.add_arguments(bp)
        bp.set_defaults(_bench_run=module.run)


def run(args) -> int:
    return int(args._bench_run(args) or 0)
