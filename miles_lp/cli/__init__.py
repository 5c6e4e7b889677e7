"""The ``miles-lp`` command line.

Each subcommand lives in its own module ``miles_lp.cli.<name>`` exposing

    HELP: str                         one line for ``miles-lp --help``
    DESCRIPTION: str                  the longer text for ``miles-lp <name> --help``
    def add_arguments(p): ...         argparse options (no heavy imports here)
    def run(args) -> int: ...         the work; heavy imports (torch) happen inside

so that ``miles-lp --help`` stays fast and a broken optional backend cannot break the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from miles_lp import __version__
from miles_lp.errors import MilesLPError

# (name, module). Order is the order shown in --help.
COMMANDS: list[tuple[str, str]] = [
    ("convert", "miles_lp.cli.convert"),
    ("verify", "miles_lp.cli.verify"),
    ("export", "miles_lp.cli.export"),
    ("explain", "miles_lp.cli.explain"),
    ("run", "miles_lp.cli.run"),
    ("report", "miles_lp.cli.report"),
    ("experiment", "miles_lp.cli.experiment"),
    ("bench", "miles_lp.cli.bench"),
    ("selftest", "miles_lp.cli.selftest"),
    ("serve", "miles_lp.cli.serve"),
    ("make-tiny-model", "miles_lp.cli.make_tiny_model"),
    ("pretrained", "miles_lp.cli.pretrained"),
    ("version", "miles_lp.cli.version"),
]

EPILOG = """\
typical workflow:
  miles-lp make-tiny-model --arch qwen3_moe --out /tmp/tiny      # a local random HF checkpoint
  miles-lp explain recipes/policies/qwen3-moe-mxfp8-nvfp4-experts.yaml --model /tmp/tiny  # which format per tensor, and why
  miles-lp convert --hf-checkpoint /tmp/tiny --output /tmp/tiny-mxfp8 --format mxfp8 --target sglang
  miles-lp verify /tmp/tiny-mxfp8 --source /tmp/tiny              # prove the checkpoint keeps the contract

Run `miles-lp <command> --help` for each command's options.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles-lp",
        description="Low-precision RL for LLMs (MXFP8 end to end, NVFP4 for MoE experts): one precision "
        "policy drives checkpoint conversion, training, rollout and live weight export.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"miles-lp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS:
        module = importlib.import_module(module_name)
        p = sub.add_parser(
            name,
            help=module.HELP,
            description=getattr(module, "DESCRIPTION", module.HELP),
            formatter_class=argparse.RawDescriptionHelpFormatter,
            allow_abbrev=False,
        )
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    try:
        return int(args._run(args) or 0)
    except MilesLPError as exc:
        print(f"miles-lp {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"miles-lp {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
