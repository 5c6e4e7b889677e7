"""`miles-lp bench linear`: table parsing, --json / --from-json round trip and the --plot writer (no GPU).

The parser is checked against a second, whitespace-token parse of the committed H200 table and against
numbers read by hand from it; the plot against the data it draws (bar heights, panels, titles), read back
from the figure.
"""

from __future__ import annotations

import json

import pytest

from miles_lp.bench.linear import format_table, load_rows, parse_table, plot_linear
from miles_lp.cli import main
from miles_lp.errors import ConfigError


def _rows():
    rows = []
    for shape, base in (("8192x8192x8192", 4.2), ("2048x4096x4096", 0.4)):
        rows.append(dict(shape=shape, mode="bf16 F.linear", kernel="-", ms_fresh=base, ms_cached=base,
                         ratio_fresh=1.0, ratio_cached=1.0, peak_mib=128.0))
        for i, mode in enumerate(("mxfp8/high_precision", "mxfp8/dequantized", "nvfp4/dequantized")):
            for kernel, f in (("reference", 2.5), ("compiled", 1.1)):
                ms = base * f * (1 + i / 10)
                rows.append(dict(shape=shape, mode=mode, kernel=kernel, ms_fresh=ms, ms_cached=ms * 0.9,
                                 ratio_fresh=round(ms / base, 2), ratio_cached=round(0.9 * ms / base, 2),
                                 peak_mib=None if kernel == "compiled" else 300.0))
    return rows


def test_parse_table_reads_back_the_printed_rows():
    rows = _rows()
    text = "bench linear: banner line\n" + format_table(rows)
    got = parse_table(text)
    assert [(r["shape"], r["mode"], r["kernel"], r["peak_mib"]) for r in got] == [
        (r["shape"], r["mode"], r["kernel"], r["peak_mib"]) for r in rows]
    assert got[1]["ratio_fresh"] == rows[1]["ratio_fresh"] and got[0]["mode"] == "bf16 F.linear"


def test_graphed_row_prints_its_back_to_back_times_and_parses_back():
    row = dict(shape="2048x4096x4096", mode="fp8_block/quantized", kernel="graphed", ms_fresh=0.35, ms_cached=0.35,
               ratio_fresh=0.95, ratio_cached=0.95, peak_mib=None, graph_bf16_ms=0.37, identical=True,
               pipelined_ms=0.24, pipelined_bf16_ms=0.3, ratio_pipelined=0.8)
    line = format_table([row]).splitlines()[-1]
    assert "back to back 0.80x, 0.240 vs 0.300 ms" in line and "bit-equal to eager: True" in line
    got = parse_table(line)
    assert len(got) == 1 and got[0]["kernel"] == "graphed" and got[0]["ratio_cached"] == 0.95
    older = {k: v for k, v in row.items() if "pipelined" not in k}  # rows written before the column existed
    assert "back to back" not in format_table([older])
    cached = dict(row, ms_cached=0.3, ratio_cached=0.81, pipelined_cached_ms=0.21, ratio_pipelined_cached=0.7)
    line = format_table([cached]).splitlines()[-1]
    assert "back to back 0.80x, 0.240 / cached 0.70x, 0.210 vs 0.300 ms" in line
    got = parse_table(line)
    assert got[0]["ms_cached"] == 0.3 and got[0]["ratio_cached"] == 0.81 and got[0]["ratio_fresh"] == 0.95


def _token_parse(text: str) -> list[tuple]:
    """A second parse: data lines are the ones after the dashes; the last six tokens are the numbers."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("----")) + 1
    out = []
    for ln in lines[start:]:
        t = ln.split()
        if not t:
            continue
        kernel, msf, rf, msc, rc, peak = t[-6:]
        out.append((t[0], " ".join(t[1:-6]), kernel, float(msf), float(rf.rstrip("x")), float(msc),
                    float(rc.rstrip("x")), None if peak == "-" else float(peak)))
    return out


_KEYS = ("shape", "mode", "kernel", "ms_fresh", "ratio_fresh", "ms_cached", "ratio_cached", "peak_mib")


def test_h200_results_parse():
    from pathlib import Path

    txt = Path(__file__).parents[2] / "docs/results/h200-2026-11-29/run2/bench_linear.txt"
    text = txt.read_text()
    rows = parse_table(text)
    assert [tuple(r[k] for k in _KEYS) for r in rows] == _token_parse(text)
    assert len(rows) == 22 and {r["shape"] for r in rows} == {"8192x8192x8192", "2048x4096x4096"}
    # read by hand from the file: its first row, a middle one and its last
    assert tuple(rows[0][k] for k in _KEYS) == ("8192x8192x8192", "bf16 F.linear", "-", 4.269, 1.0, 4.269, 1.0,
                                                128.0)
    r = next(r for r in rows if r["mode"] == "mxfp8/dequantized" and r["kernel"] == "compiled"
             and r["shape"] == "8192x8192x8192")
    assert (r["ms_fresh"], r["ratio_fresh"], r["ms_cached"], r["ratio_cached"], r["peak_mib"]) == (
        4.591, 1.08, 4.886, 1.14, 322.0)
    assert tuple(rows[-1][k] for k in _KEYS) == ("2048x4096x4096", "nvfp4/dequantized", "compiled", 2.103, 5.02,
                                                 1.645, 3.93, 37.0)
    saved = json.loads((txt.parent / "bench_linear.json").read_text())
    assert [tuple(r[k] for k in _KEYS) for r in saved] == _token_parse(text)  # the committed JSON is the table


@pytest.fixture
def figures(monkeypatch):
    """The matplotlib figures saved during the test (captured at savefig, then saved as usual)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    seen = []
    orig = Figure.savefig

    def savefig(self, *a, **kw):
        seen.append(self)
        return orig(self, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return seen


def _drawn(fig) -> dict[str, list[float]]:
    """{panel title: sorted bar heights} of a saved figure."""
    from matplotlib.patches import Rectangle

    out = {}
    for ax in fig.axes:
        if not ax.get_title():
            continue
        bars = [p.get_height() for p in ax.patches if isinstance(p, Rectangle)]
        out[ax.get_title()] = sorted(bars)
    return out


def _expected_bars(rows, shape) -> list[float]:
    return sorted(r[k] for r in rows if r["shape"] == shape and r["kernel"] != "-"
                  for k in ("ratio_fresh", "ratio_cached"))


def test_plot_from_json_without_gpu(tmp_path, capsys, figures):
    js, png = tmp_path / "rows.json", tmp_path / "linear.png"
    rows = _rows()
    js.write_text(json.dumps(rows))
    assert main(["bench", "linear", "--from-json", str(js), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "mxfp8/dequantized" in out and f"plot: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    drawn = _drawn(fig)
    assert list(drawn) == ["8192x8192x8192 (tokens x out x in) (bf16 fwd+bwd 4.200 ms)",
                           "2048x4096x4096 (tokens x out x in) (bf16 fwd+bwd 0.400 ms)"]
    for title, bars in drawn.items():
        assert bars == pytest.approx(_expected_bars(rows, title.split()[0]))  # every ratio drawn, once
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["mxfp8/high_precision", "mxfp8/dequantized",
                                                            "nvfp4/dequantized"]
    assert any(line.get_ydata()[0] == 1.0 for line in ax.get_lines())  # the bf16 = 1 reference line


def test_plot_writer_direct(tmp_path, figures):
    png = tmp_path / "p.png"
    rows = _rows()[:7]
    plot_linear(rows, png, title="one shape")
    assert png.stat().st_size > 10_000
    (fig,) = figures
    assert fig._suptitle.get_text() == "one shape"
    (bars,) = _drawn(fig).values()
    assert bars == pytest.approx(_expected_bars(rows, "8192x8192x8192"))


def test_from_json_refuses_other_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(ConfigError, match=r"--from-json .*bad.json: not a list of bench linear rows"):
        load_rows(str(bad))
    with pytest.raises(ConfigError, match=r"--from-json .*missing.json: cannot read it"):
        load_rows(str(tmp_path / "missing.json"))


def test_h200_graphed_results_parse():
    """The 2026-12-01b run 4 table (with `graphed` rows and their note) reads back as its saved JSON; every
    graph replay there was bit-equal to the eager step."""
    from pathlib import Path

    run = Path(__file__).parents[2] / "docs/results/h200-2026-12-01b/kernels/run4"
    rows = parse_table((run / "bench_linear.txt").read_text())
    saved = json.loads((run / "bench_linear.json").read_text())
    key = ("shape", "mode", "kernel")
    assert len(rows) == len(saved) == 22 and sum(r["kernel"] == "graphed" for r in rows) == 10
    by_key = {tuple(r[k] for k in key): r for r in saved}
    for r in rows:
        s = by_key[tuple(r[k] for k in key)]
        assert r["ms_fresh"] == round(s["ms_fresh"], 3) and r["ratio_fresh"] == round(s["ratio_fresh"], 2)
    assert all(s["identical"] is True for s in saved if s["kernel"] == "graphed")
    # read by hand from the file: the small-shape dequantized replay
    r = next(r for r in rows if r["shape"] == "2048x4096x4096" and r["mode"] == "mxfp8/dequantized"
             and r["kernel"] == "graphed")
    assert (r["ms_fresh"], r["ratio_fresh"]) == (0.413, 1.01)
