"""`miles-lp bench linear`: table parsing, --json / --from-json round trip and the --plot writer (no GPU)."""

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


def test_h200_results_parse():
    from pathlib import Path

    txt = Path(__file__).parents[2] / "docs/results/h200-2026-11-29/run2/bench_linear.txt"
    rows = parse_table(txt.read_text())
    assert len(rows) == 22 and {r["shape"] for r in rows} == {"8192x8192x8192", "2048x4096x4096"}
    r = next(r for r in rows if r["mode"] == "mxfp8/dequantized" and r["kernel"] == "compiled"
             and r["shape"] == "8192x8192x8192")
    assert (r["ms_fresh"], r["ratio_fresh"], r["peak_mib"]) == (4.591, 1.08, 322.0)
    saved = json.loads((txt.parent / "bench_linear.json").read_text())
    assert saved == rows  # the committed JSON is this parse


def test_plot_from_json_without_gpu(tmp_path, capsys):
    js, png = tmp_path / "rows.json", tmp_path / "linear.png"
    js.write_text(json.dumps(_rows()))
    assert main(["bench", "linear", "--from-json", str(js), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "mxfp8/dequantized" in out and f"plot: {png}" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_plot_writer_direct(tmp_path):
    png = tmp_path / "p.png"
    plot_linear(_rows()[:7], png, title="one shape")
    assert png.stat().st_size > 10_000


def test_from_json_refuses_other_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(ConfigError, match=r"--from-json .*bad.json: not a list of bench linear rows"):
        load_rows(str(bad))
    with pytest.raises(ConfigError, match=r"--from-json .*missing.json: cannot read it"):
        load_rows(str(tmp_path / "missing.json"))
