"""The CLI teaches: `miles-lp` alone prints help; each command's --help has a description (and, for explain,
bench and version, example command lines); `version` names miles-lp and its backends."""

from __future__ import annotations

import argparse
import importlib
import re

import pytest

from miles_lp import __version__
from miles_lp.cli import COMMANDS, build_parser, main


def _help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_no_arguments_prints_the_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: miles-lp") and "typical workflow:" in out
    for name, _ in COMMANDS:
        assert re.search(rf"^    {re.escape(name)}\s", out, re.M), name


@pytest.mark.parametrize("name", [n for n, _ in COMMANDS])
def test_every_command_help_has_a_description(capsys, name):
    module = importlib.import_module(dict(COMMANDS)[name])
    out = _help(capsys, [name])
    assert out.startswith(f"usage: miles-lp {name}")
    assert module.DESCRIPTION.strip() != module.HELP.strip()  # more than the one-line summary
    assert module.DESCRIPTION.splitlines()[-1].strip() in out


@pytest.mark.parametrize("argv", [["explain"], ["bench"], ["bench", "plan"], ["bench", "quantize"], ["version"]])
def test_help_shows_examples(capsys, argv):
    out = _help(capsys, argv)
    assert re.search(rf"^  miles-lp {' '.join(argv)}\b", out, re.M), out
    parser = build_parser()
    for word in argv:  # walk down to the subcommand's parser
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    undocumented = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
    assert not undocumented, undocumented


def test_version_output(capsys):
    assert main(["version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"miles-lp {__version__}"
    found = dict(line.split(None, 1) for line in lines[1:])
    assert found["python"].startswith("3.") and found["torch"][0].isdigit()
    assert set(found) >= {"transformer_engine", "sglang", "torchao"}
