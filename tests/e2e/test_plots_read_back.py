"""The plots draw their data (the plot tests checked only the PNG magic bytes). Each figure is
captured at ``savefig`` and read back: bar heights, reference lines, tick labels, and for ``explain --plot``
the colour of every (role, layer) cell against the recipe's stated plan (written here by hand)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from miles_lp.cli import main

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "deepseek_v3_config.json"


@pytest.fixture
def figures(monkeypatch):
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


def _bars(ax) -> list[float]:
    from matplotlib.patches import Rectangle

    return [p.get_height() for p in ax.patches if isinstance(p, Rectangle)]


def _hlines(ax) -> list[float]:
    return sorted(float(line.get_ydata()[0]) for line in ax.get_lines())


def test_convert_plot_draws_the_summary(tmp_path, figures):
    from miles_lp.bench.convert import plot_convert

    summary = {"bytes": 2.1e9, "copy_s": 1.0, "copy_gbs": 2.1, "baseline_rss": 3.0e8, "largest_shard": 5.0e8,
               "target": "sglang", "formats": {
                   "mxfp8": {"convert_gbs": 1.2, "peak_rss": 1.1e9},
                   "mxfp8+nvfp4-experts": {"convert_gbs": 0.9, "peak_rss": 1.3e9}}}
    plot_convert(summary, tmp_path / "convert.png")
    (fig,) = figures
    a1, a2 = fig.axes[:2]
    # one round: the ratio of the conversion's GB/s to the copy's; several: their median
    assert _bars(a1) == pytest.approx([1.2 / 2.1, 0.9 / 2.1])
    assert [t.get_text() for t in a1.get_xticklabels()] == ["mxfp8", "mxfp8+nvfp4-experts"]
    # the targets over each conversion's bar, as fractions of the copy: MXFP8 0.7 (stretch 0.9),
    # MXFP8 + NVFP4 experts 0.6
    assert _hlines(a1) == pytest.approx([0.6, 0.7, 0.9])
    assert _bars(a2) == pytest.approx([0.5, 1.1, 1.3])  # GB: largest shard, then each conversion's peak RSS
    assert _hlines(a2) == pytest.approx([0.3, 1.5])  # import-only RSS, the 3x-largest-shard target
    assert "2.10 GB checkpoint -> sglang" in a1.get_title()
    summary["formats"]["mxfp8"]["ratios"] = [0.5, 0.9, 0.8]
    plot_convert(summary, tmp_path / "convert2.png")
    assert _bars(figures[-1].axes[0]) == pytest.approx([0.8, 0.9 / 2.1])


def _expected_deepseek(role: str, layer: int) -> str:
    """recipes/policies/deepseek-v3-mxfp8.yaml: last 15% of decoder layers (ceil(61 * 0.15) = 10: 51-60) BF16, shared
    experts BF16, MLA kv_b BF16; other GEMMs MXFP8; norms, routers, embeddings BF16 (invariants)."""
    if layer >= 51 or role in ("shared_experts", "mla_kv_b", "norm", "router", "router_bias"):
        return "bf16"
    return "mxfp8"


def test_explain_plot_colours_every_cell_by_the_plan(capsys, tmp_path, figures):
    from matplotlib.colors import to_hex
    from matplotlib.patches import Rectangle

    from miles_lp.policy.plot import FORMAT_COLOURS

    png = tmp_path / "plan.png"
    assert main(["explain", str(ROOT / "recipes" / "policies/deepseek-v3-mxfp8.yaml"), "--model", str(FIXTURE),
                 "--plot", str(png)]) == 0
    capsys.readouterr()
    (fig,) = figures
    ax = fig.axes[0]
    roles = [t.get_text() for t in ax.get_yticklabels()]
    colour_of = {to_hex(c): f.value for f, c in FORMAT_COLOURS.items()}
    cells: dict[tuple[str, float], list[str]] = {}
    for p in ax.patches:
        if isinstance(p, Rectangle) and p.get_fill():
            x, y = p.get_x() + p.get_width() / 2, p.get_y() + 0.42
            cells.setdefault((roles[round(y)], round(x, 3)), []).append(colour_of[to_hex(p.get_facecolor())])
    xs = sorted({x for _, x in cells})
    model_x, layer_xs = xs[0], xs[1:]  # the "model" column (embedding, final norm, lm_head), then 61 layers
    assert len(layer_xs) == 61
    checked = 0
    for (role, x), fmts in cells.items():
        if x == model_x:
            assert fmts == ["bf16"], (role, fmts)
            continue
        layer = layer_xs.index(x)
        assert fmts == [_expected_deepseek(role, layer)], (role, layer, fmts)
        checked += 1
    assert checked > 61 * 5
    routed = [x for (r, x) in cells if r == "routed_experts"]
    assert len(routed) == 61 - 3  # first_k_dense_replace = 3: no routed experts in layers 0-2
    assert math.isclose(min(routed), layer_xs[3])
