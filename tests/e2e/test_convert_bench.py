"""`miles-lp bench convert --plot`: the plot writer on synthetic figures (no 2 GB run in the test suite)."""

from __future__ import annotations

from miles_lp.bench.convert import plot_convert


def test_plot_convert_writes_a_png(tmp_path):
    summary = {"bytes": 2.1e9, "copy_s": 1.0, "copy_gbs": 2.1, "baseline_rss": 3.0e8, "largest_shard": 5.0e8,
               "target": "sglang", "formats": {
                   "mxfp8": {"convert_gbs": 1.2, "peak_rss": 1.1e9},
                   "mxfp8+nvfp4-experts": {"convert_gbs": 0.9, "peak_rss": 1.3e9}}}
    path = tmp_path / "convert.png"
    plot_convert(summary, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # two panels of bars, labels, lines
