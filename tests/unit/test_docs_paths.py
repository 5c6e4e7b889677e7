"""Every recipe, script and docs file that the README, the docs and the CLI help name exists (a new user runs
them literally: `miles-lp --help`'s workflow once named a recipe that did not)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATH = re.compile(r"(?<![\w/.-])((?:recipes|scripts)/[\w.-]+\.(?:yaml|sh|py)|docs/[\w./-]+\.md)")


def _sources():
    yield ROOT / "README.md"
    yield from sorted((ROOT / "docs").glob("*.md"))
    yield from sorted((ROOT / "miles_lp" / "cli").glob("*.py"))


def test_named_paths_exist():
    missing = []
    for src in _sources():
        for m in PATH.finditer(src.read_text()):
            if not (ROOT / m.group(1)).exists():
                missing.append(f"{src.relative_to(ROOT)}: {m.group(1)}")
    assert not missing, missing


def test_the_pattern_sees_the_cli_workflow():
    text = (ROOT / "miles_lp" / "cli" / "__init__.py").read_text()
    assert "recipes/qwen3_moe_mxfp8_nvfp4_experts.yaml" in {m.group(1) for m in PATH.finditer(text)}
