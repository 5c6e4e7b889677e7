"""Device names as command-line argument types, shared by the subcommands and the benchmarks (validated at parse
time, before any work: a bad value is argparse's usage error, exit code 2, naming the flag)."""

from __future__ import annotations

import argparse
import re

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def device(value: str) -> str:
    """``--device``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (what torch and the configs' ``device`` accept)."""
    if not _DEVICE.fullmatch(value):
        raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got '{value}'")
    return value


def torch_device(value: str) -> str:
    """``--device`` of a command that needs a concrete device: ``cpu``, ``cuda`` or ``cuda:N``."""
    if value == "auto" or not _DEVICE.fullmatch(value):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got '{value}'")
    return value
