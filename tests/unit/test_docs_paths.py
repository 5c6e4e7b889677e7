"""Every recipe, script and docs file that the README, the docs and the CLI help name exists (a new user runs
them literally: `miles-lp --help`'s workflow once named a recipe that did not), and every relative markdown link
of the README and docs/*.md resolves (a `.txt` under docs/results/ and `](...)` targets were not seen)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATH = re.compile(r"(?<![\w/.-])((?:recipes|scripts)/(?:[\w.-]+/)*[\w.-]+\.(?:yaml|sh|py)"
                  r"|docs/[\w./-]+\.(?:md|txt|json|jsonl|png|log))(?![\w-])")
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target "title"), ![alt](target)
_EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|#|//)", re.IGNORECASE)  # http:, mailto:, an in-page anchor


def _sources():
    yield ROOT / "README.md"
    yield from sorted((ROOT / "docs").glob("*.md"))
    yield from sorted((ROOT / "miles_lp" / "cli").glob("*.py"))


def _markdown():
    yield ROOT / "README.md"
    yield from sorted((ROOT / "docs").glob("*.md"))


def named_paths(text: str) -> set[str]:
    return {m.group(1) for m in PATH.finditer(text)}


def link_targets(text: str) -> list[str]:
    """The relative targets of markdown links and images, without their #anchor (external links left out)."""
    out = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if _EXTERNAL.match(target):
            continue
        target = target.split("#", 1)[0]
        if target:
            out.append(target)
    return out


def test_named_paths_exist():
    missing = []
    for src in _sources():
        for p in sorted(named_paths(src.read_text())):
            if not (ROOT / p).exists():
                missing.append(f"{src.relative_to(ROOT)}: {p}")
    assert not missing, missing


def test_relative_markdown_links_resolve():
    missing = []
    for src in _markdown():
        for target in link_targets(src.read_text()):
            if not (src.parent / target).exists():
                missing.append(f"{src.relative_to(ROOT)}: ]({target})")
    assert not missing, missing


def test_the_pattern_sees_the_cli_workflow():
    text = (ROOT / "miles_lp" / "cli" / "__init__.py").read_text()
    assert "recipes/policies/qwen3-moe-mxfp8-nvfp4-experts.yaml" in named_paths(text)


def test_the_patterns_see_what_review_c4_found():
    """L7's broken `docs/results/h200-2026-11-29/bench_linear_compiled.txt` and link targets, incl. images."""
    text = ("logs in docs/results/h200-2026-11-29/bench_linear_compiled.txt and docs/results/x/run.jsonl;\n"
            "see [the logs](results/convert-cpu/) and ![plot](img/a.png \"title\"), [anchor](#numerics),\n"
            "[web](https://example.com/x.md), [file](converter.md#verify)\n")
    assert named_paths(text) == {"docs/results/h200-2026-11-29/bench_linear_compiled.txt",
                                 "docs/results/x/run.jsonl"}
    assert link_targets(text) == ["results/convert-cpu/", "img/a.png", "converter.md"]
