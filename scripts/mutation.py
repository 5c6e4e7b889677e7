#!/usr/bin/env python
"""Mutation check: apply each one-line change of scripts/mutations.yaml to a COPY of the tree and run the
tests named for it; every mutation must make at least one of them fail.

    python scripts/mutation.py                       # all mutations, a Markdown table on stdout
    python scripts/mutation.py --only M1,M5 --out report.md
    python scripts/mutation.py --keep                # keep the temporary copy (its path is printed)

The working tree is never modified: the files git knows (tracked and untracked-not-ignored) are copied to a
temporary folder, and the tests run there with that folder first on ``PYTHONPATH`` (checked: ``miles_lp``
must import from the copy). First the named tests run unmutated (they must pass: a test that fails anyway
proves nothing); then, per mutation, its edits are applied, its tests run (``pytest -x``), and the file is
restored. Exit code 0 only if every mutation was caught and the baseline passed.

Mutation entry (YAML): ``id``, ``what`` (one line), ``edits`` (a list of ``{file, old, new}``; ``old`` must
occur exactly once in ``file``), ``tests`` (pytest node ids or files). A mutation whose ``old`` text is no
longer in the file is reported ``stale`` (the code moved: update the list), and counts as a failure.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
LIST = Path(__file__).with_name("mutations.yaml")


def load_mutations(path: Path = LIST) -> list[dict]:
    items = yaml.safe_load(path.read_text())
    if not isinstance(items, list):
        raise SystemExit(f"{path}: expected a list of mutations")
    ids = set()
    for i, m in enumerate(items):
        missing = {"id", "what", "edits", "tests"} - set(m)
        if missing:
            raise SystemExit(f"{path}: entry {i} lacks {sorted(missing)}")
        if m["id"] in ids:
            raise SystemExit(f"{path}: duplicate id {m['id']}")
        ids.add(m["id"])
        for e in m["edits"]:
            if set(e) != {"file", "old", "new"} or e["old"] == e["new"]:
                raise SystemExit(f"{path}: {m['id']}: each edit needs file, old, new (old != new)")
    return items


def copy_tree(dst: Path) -> None:
    """Copy the files git lists (tracked + untracked, not ignored) of the working tree to ``dst``."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         check=True, capture_output=True).stdout.decode()
    for rel in filter(None, out.split("\0")):
        src = ROOT / rel
        if not src.is_file():  # deleted but still in the index
            continue
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def run_tests(tree: Path, tests: list[str], timeout: int) -> tuple[int, list[str], str, float]:
    """(pytest exit code, failed node ids, output tail, seconds)."""
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONDONTWRITEBYTECODE="1", MILES_LP_CACHE_DIR=str(tree.parent / "cache"))  # mutated native builds stay here
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rfE", "-p", "no:cacheprovider", "-m", "not gpu",
           "--no-header", *tests]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, [], "timeout", time.perf_counter() - t0
    text = p.stdout + p.stderr
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", text, flags=re.M)))
    return p.returncode, failed, text[-3000:], time.perf_counter() - t0


def check_imports_from(tree: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    where = subprocess.run([sys.executable, "-c", "import miles_lp; print(miles_lp.__file__)"], cwd=tree,
                           env=env, check=True, capture_output=True, text=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"miles_lp imports from {where}, not from the copy {tree}: refusing to run")


def apply(tree: Path, m: dict) -> dict[Path, str] | str:
    """Apply the edits; return {file: original text}, or why an edit does not apply (nothing left changed)."""
    originals: dict[Path, str] = {}
    for e in m["edits"]:
        f = tree / e["file"]
        current = f.read_text() if f.is_file() else None
        n = 0 if current is None else current.count(e["old"])
        if n != 1:
            for g, t in originals.items():
                g.write_text(t)
            where = "does not exist" if current is None else f"has the text to change {n} times (expected once)"
            return f"{e['file']} {where}: {e['old'][:60]!r}"
        originals.setdefault(f, current)
        f.write_text(current.replace(e["old"], e["new"]))
    return originals


def short(node: str) -> str:
    return node.replace("tests/", "").replace(".py::", "::")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated mutation ids")
    ap.add_argument("--list", type=Path, default=LIST, help="the mutation list (YAML)")
    ap.add_argument("--out", type=Path, default=None, help="also write the Markdown report here")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per pytest run")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy")
    args = ap.parse_args(argv)
    muts = load_mutations(args.list)
    if args.only:
        want = set(args.only.split(","))
        muts = [m for m in muts if m["id"] in want]
        if not muts:
            raise SystemExit(f"no mutation with id in {sorted(want)}")
    tmp = Path(tempfile.mkdtemp(prefix="miles-lp-mutation-"))
    tree = tmp / "tree"
    try:
        copy_tree(tree)
        check_imports_from(tree)
        all_tests = list(dict.fromkeys(t for m in muts for t in m["tests"]))
        print(f"copy: {tree}; baseline: {len(all_tests)} test selections", file=sys.stderr)
        rc, failed, tail, secs = run_tests(tree, all_tests, args.timeout)
        lines = [f"Baseline (unmutated copy): {'pass' if rc == 0 else 'FAIL'} ({secs:.0f} s, "
                 f"{len(all_tests)} test selections)", ""]
        ok = rc == 0
        if rc != 0:
            lines += ["```", tail, "```", ""]
        lines += ["| id | mutation | named tests | failed under the mutation | verdict | s |",
                  "|---|---|---|---|---|---|"]
        for m in muts:
            originals = apply(tree, m)
            if isinstance(originals, str):
                verdict, failed, secs = f"stale: {originals}", [], 0.0
            else:
                try:
                    rc, failed, tail, secs = run_tests(tree, m["tests"], args.timeout)
                finally:
                    for f, t in originals.items():
                        f.write_text(t)
                verdict = "caught" if rc == 1 and failed else ("NOT CAUGHT" if rc == 0 else f"error (rc {rc})")
                if rc not in (0, 1):
                    print(f"{m['id']}: pytest rc {rc}\n{tail}", file=sys.stderr)
            ok &= verdict == "caught"
            named = "<br>".join(short(t) for t in m["tests"])
            got = "<br>".join(short(t) for t in failed) or "-"
            lines.append(f"| {m['id']} | {m['what']} | {named} | {got} | {verdict} | {secs:.0f} |")
            print(f"{m['id']}: {verdict} ({secs:.0f} s)", file=sys.stderr)
        report = "\n".join(lines)
        print(report)
        if args.out:
            args.out.write_text(report + "\n")
        return 0 if ok else 1
    finally:
        if args.keep:
            print(f"kept: {tree}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
