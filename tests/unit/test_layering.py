"""The package layers of docs/ARCHITECTURE.md, enforced on the source: no package cycle, no upward import.

Every import counts: at file top, inside functions (``from miles_lp.x import y`` in a function body runs at
call time, but it still ties the packages together), and a string that names a module exactly (the lazy
re-export tables of ``miles_lp.export``, ``importlib.import_module("miles_lp.x.y")``).

A package may import only packages of a LOWER layer (packages of one layer do not import each other). The
root modules (``miles_lp/__init__.py``, ``errors.py``, ``config.py``) are the bottom layer.

The edges that still break the order run through modules being reworked elsewhere; they are listed exactly
in ``KNOWN_UPWARD`` and ``KNOWN_MODULE_CYCLES``. The test fails on any new upward edge or module cycle AND on
a listed one that no longer exists, so the lists stay true: remove an entry when its import goes.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "miles_lp"

#: bottom to top; see docs/ARCHITECTURE.md "Layers"
LAYERS: list[set[str]] = [
    {"<root>"},        # miles_lp/__init__.py (version), errors.py, config.py (YAML, typed sections), devices.py
    {"formats"},       # bit-exact codecs and kernels
    {"multitensor"},   # byte-level work over many tensors in place: the C2 fingerprint, packed and strided copies
    {"policy"},        # precision policy -> per-tensor plan, model layouts
    {"io"},            # safetensors shards, atomic output folders, HF folder validation
    {"export"},        # engine tensor names, encodings, configs, plan metadata; learner -> engine checkpoint
    {"checkpoint"},    # the converter and the verifier
    {"train"},         # quantized linears, learners (embedded, Megatron)
    {"rl"},            # GRPO numerics and tasks
    {"rollout"},       # engines: reference, SGLang, vLLM
    {"sync"},          # live weight sync and the C1-C7 checks
    {"launch"},        # recipes, run folders, the training loop, Ray placement
    {"report", "bench", "pretrained"},  # run reports and plots; `miles-lp bench` (side-by-side ratios); real models
    #                                    from packages and the tools that measure them
    {"cli"},           # the miles-lp command
]

#: (importing module, imported module) pairs that break LAYERS, each with the package edge it makes. Exact.
KNOWN_UPWARD: set[tuple[str, str]] = set()

#: module-level cycles (strongly connected sets of modules) that remain, each as a sorted tuple. Exact.
KNOWN_MODULE_CYCLES: set[tuple[str, ...]] = set()


def _package(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or (len(parts) == 2 and (PKG / f"{parts[1]}.py").is_file()):
        return "<root>"
    return parts[1]


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The most specific module of ``name`` (``miles_lp.a.b.attr`` -> ``miles_lp.a.b``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _called(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _strings(node: ast.AST) -> list[str]:
    """A module named by a string: a constant, or the constant head of an f-string (``f"miles_lp.bench.{x}"``
    names the package ``miles_lp.bench``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return [str(node.values[0].value).rstrip(".")]
    return []


def import_edges() -> dict[tuple[str, str], list[int]]:
    """(module, imported module) -> line numbers, for every import of a ``miles_lp`` module."""
    return _import_edges(PKG)


@functools.lru_cache(maxsize=2)
def _import_edges(pkg: Path) -> dict[tuple[str, str], list[int]]:
    modules = _modules()
    edges: dict[tuple[str, str], list[int]] = defaultdict(list)
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                names = [f"{src}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Call) and _called(node).endswith("import_module") and node.args:
                names = _strings(node.args[0])
            elif isinstance(node, ast.Dict):  # lazy re-export tables: {"name": "miles_lp.pkg.module"}
                names = [n for v in node.values for n in _strings(v)]
            for name in names:
                if not name.startswith("miles_lp"):
                    continue
                target = _resolve(name, modules)
                if target and target != mod:
                    edges[(mod, target)].append(node.lineno)
    return edges


def _rank() -> dict[str, int]:
    return {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def test_every_package_has_a_layer():
    packages = {_package(m) for m in _modules()}
    assert packages == set(_rank()), ("a package missing from (or a stale one in) LAYERS: add it at its place "
                                      f"and to docs/ARCHITECTURE.md: {sorted(packages ^ set(_rank()))}")


def upward_edges() -> dict[tuple[str, str], list[int]]:
    rank = _rank()
    out = {}
    for (a, b), lines in import_edges().items():
        pa, pb = _package(a), _package(b)
        if pa != pb and rank[pb] >= rank[pa]:
            out[(a, b)] = lines
    return out


def test_no_upward_import():
    found = upward_edges()
    new = {e: found[e] for e in sorted(set(found) - KNOWN_UPWARD)}
    gone = sorted(KNOWN_UPWARD - set(found))
    assert not new, "imports against the layers of docs/ARCHITECTURE.md (module -> module: lines):\n" + "\n".join(
        f"  {a} -> {b}: {lines}" for (a, b), lines in new.items())
    assert not gone, f"listed in KNOWN_UPWARD but no longer imported (remove them): {gone}"


def test_no_package_cycle():
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in import_edges():
        if _package(a) != _package(b):
            graph[_package(a)].add(_package(b))
    cycles = [c for c in _sccs(graph) if len(c) > 1]
    allowed = {tuple(sorted({_package(a), _package(b)})) for a, b in KNOWN_UPWARD}
    assert all(tuple(c) in allowed for c in cycles), f"package cycles: {cycles}"


def _sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    nodes = sorted(set(graph) | {b for bs in graph.values() for b in bs})
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    out.append(sorted(comp))
    return out


def module_cycles() -> set[tuple[str, ...]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in import_edges():
        # importing ``pkg.mod`` runs ``pkg/__init__.py`` first, but a package's lazy re-exports are not a cycle
        # of the code: count the edge to the module named
        graph[a].add(b)
    return {tuple(c) for c in _sccs(graph) if len(c) > 1}


def test_no_module_cycle():
    found = module_cycles()
    new, gone = sorted(found - KNOWN_MODULE_CYCLES), sorted(KNOWN_MODULE_CYCLES - found)
    assert not new, "module import cycles (break them: move the shared part down, or the caller up):\n" + "\n".join(
        f"  {' <-> '.join(c)}" for c in new)
    assert not gone, f"listed in KNOWN_MODULE_CYCLES but gone (remove them): {gone}"


def test_the_checker_sees_function_local_and_string_imports(tmp_path, monkeypatch):
    """The checker itself can fail: a function-local upward import and a lazy string import are both edges."""
    pkg = tmp_path / "miles_lp"
    for sub in ("formats", "cli"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "formats" / "codec.py").write_text("def f():\n    from miles_lp.cli import main\n")
    (pkg / "formats" / "lazy.py").write_text("import logging\nlogging.getLogger('miles_lp.cli')\n"
                                            "_LAZY = {'x': 'miles_lp.cli.run'}\n")
    (pkg / "cli" / "run.py").write_text("import importlib\nimportlib.import_module(f'miles_lp.formats.{1}')\n"
                                        "from miles_lp.formats import lazy\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["_"]), "ROOT", tmp_path)
    monkeypatch.setattr(__import__(__name__, fromlist=["_"]), "PKG", pkg)
    edges = import_edges()
    assert edges[("miles_lp.formats.codec", "miles_lp.cli")] == [2]
    assert ("miles_lp.formats.lazy", "miles_lp.cli.run") in edges
    assert ("miles_lp.formats.lazy", "miles_lp.cli") not in edges  # a logger's name is not an import
    assert ("miles_lp.cli.run", "miles_lp.formats") in edges  # f-string import_module: the package
    assert ("miles_lp.cli.run", "miles_lp.formats.lazy") in edges
    assert set(upward_edges()) == {("miles_lp.formats.codec", "miles_lp.cli"),
                                   ("miles_lp.formats.lazy", "miles_lp.cli.run")}
    assert module_cycles() == {("miles_lp.cli.run", "miles_lp.formats.lazy")}


def test_the_architecture_page_shows_this_package_graph():
    """docs/ARCHITECTURE.md's "After" graph is the one the imports make (each package's imported packages, in
    layer order), and its Layers table names every package."""
    import re

    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    after = doc.split("After (this tree", 1)[1].split("```", 2)[1]
    shown = {}
    for line in after.strip().splitlines():
        pkg, _, deps = line.partition("->")
        shown[pkg.strip()] = [d.strip() for d in deps.split(",")]
    rank = _rank()
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in import_edges():
        if _package(a) != _package(b):
            graph[_package(a)].add(_package(b))
    want = {p: ["root" if d == "<root>" else d for d in sorted(ds, key=lambda q: (rank[q], q))]
            for p, ds in graph.items()}
    assert shown == want, {p: (shown.get(p), want.get(p)) for p in set(shown) | set(want) if shown.get(p) != want.get(p)}
    table = set(re.findall(r"^\| \d+ \| (.+?) \|", doc, re.M))
    named = {n for cell in table for n in re.findall(r"`(\w+)`", cell)}
    assert {p for p in rank if p != "<root>"} <= named
