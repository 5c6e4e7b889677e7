"""The matching experiment's statistics: per-arm token means, paired bootstrap intervals over prompts, the %
change against the BF16-sampler arm (refused when that arm's figure is indistinguishable from 0), the order
verdict; and each arm's recipe overrides give the sampler grid the arm names."""

import numpy as np
import pytest

from miles_lp.report.matching import (
    ARMS,
    ArmResult,
    arm_overrides,
    figure,
    markdown,
    order_verdict,
    paired_bootstrap,
)


def arm(name, kl, n=64, tok=50, noise=0.2, seed=0):
    rng = np.random.default_rng(seed)
    t = np.full(n, float(tok))
    d = kl * t * (1 + noise * rng.standard_normal(n))
    return ArmResult(name, d, np.abs(d), np.abs(d) * 10, t, 1.0, "same")


def test_paired_bootstrap_and_pct():
    kls = dict(zip(ARMS, [1e-6, 2e-5, 5e-5, 1e-4, 2e-4], strict=True))
    res = [arm(a, k, seed=i) for i, (a, k) in enumerate(kls.items())]
    tab = paired_bootstrap(res, "bf16 sampler", resamples=2000)
    for a, k in kls.items():
        assert tab[a]["kl"] == pytest.approx(k, rel=0.1)
        lo, hi = tab[a]["kl_ci"]
        assert lo < tab[a]["kl"] < hi
    p = tab["shared grid"]
    assert p["kl_pct_vs_ref"] == pytest.approx(100 * (tab["shared grid"]["kl"] / tab["bf16 sampler"]["kl"] - 1))
    assert p["kl_pct_vs_ref_ci"][0] < p["kl_pct_vs_ref"] < p["kl_pct_vs_ref_ci"][1] < 0
    assert "kl_pct_vs_ref" not in tab["bf16 sampler"]
    v = order_verdict(tab, res, 2000)
    assert v["holds"] and all(x["holds"] and x["share_of_resamples"] > 0.99 for x in v["pairs"])
    md = markdown(tab, [v], {"recipe": "r.yaml", "steps": 1, "prompts": 64, "group_size": 8, "resamples": 2000,
                             "policy_state": "untrained"})
    assert "| shared grid |" in md and "holds here" in md


def test_pairing_cancels_shared_prompt_noise():
    # both arms share a large per-prompt effect (some prompts have many more mismatching tokens): pairing
    # keeps the % change tight although each arm's own interval is wide
    rng = np.random.default_rng(1)
    w = rng.lognormal(0, 1.5, 64)
    t = np.full(64, 50.0)
    a = ArmResult("bf16 sampler", 1e-4 * t * w, 1e-4 * t * w, t, t, 1.0, "s")
    b = ArmResult("shared grid", 0.8e-4 * t * w, 0.8e-4 * t * w, t, t, 1.0, "s")
    tab = paired_bootstrap([a, b], "bf16 sampler", resamples=2000)
    lo, hi = tab["shared grid"]["kl_pct_vs_ref_ci"]
    assert lo == pytest.approx(-20, abs=1e-6) and hi == pytest.approx(-20, abs=1e-6)
    assert tab["shared grid"]["kl_ci"][1] / tab["shared grid"]["kl_ci"][0] > 1.3  # unpaired: wide


def test_pct_refused_when_reference_contains_zero():
    t = np.full(32, 10.0)
    d = np.tile([1.0, -1.0], 16)
    ref = ArmResult("bf16 sampler", d, np.abs(d), np.abs(d), t, 1.0, "s")
    other = arm("shared grid", 1e-3, n=32)
    tab = paired_bootstrap([ref, other], "bf16 sampler", resamples=500)
    assert tab["shared grid"]["kl_pct_vs_ref"] is None
    assert "contains 0" in tab["shared grid"]["kl_pct_vs_ref_note"]
    assert tab["shared grid"]["k3_kl_pct_vs_ref"] is not None


def test_order_verdict_detects_a_swap():
    res = [arm(a, k, noise=0.01, seed=i) for i, (a, k) in
           enumerate(zip(ARMS, [1e-6, 5e-5, 2e-5, 1e-4, 2e-4], strict=True))]
    tab = paired_bootstrap(res, "bf16 sampler", resamples=500)
    v = order_verdict(tab, res, 500)
    assert not v["holds"]
    bad = [p for p in v["pairs"] if not p["holds"]]
    assert [(p["lower"], p["higher"]) for p in bad] == [("shared grid", "partial (gate_up bf16)")]


def test_figure_bars_are_the_table():
    res = [arm(a, k, seed=i) for i, (a, k) in enumerate(zip(ARMS, [1, 2, 3, 4, 5], strict=True))]
    tab = paired_bootstrap(res, "bf16 sampler", resamples=300)
    fig = figure(tab)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == list(ARMS)
    assert [b.get_height() for b in ax.patches] == pytest.approx([tab[a]["kl"] for a in ARMS])
    k3 = fig.axes[1]
    if k3.get_yscale() == "log":  # the log axis starts near the data, not decades below at the bars' base
        low = min(x for a in ARMS for x in (tab[a]["k3_kl"], tab[a]["k3_kl_ci"][0]) if x > 0)
        assert k3.get_ylim()[0] == pytest.approx(low / 3)


def test_arm_overrides_give_the_named_sampler_grids():
    from miles_lp.checkpoint.tiny import tiny_config
    from miles_lp.formats.spec import Format
    from miles_lp.launch.recipe import load_recipe
    from miles_lp.policy import compile_plan, get_layout

    base = load_recipe("recipes/tiny-mxfp8.yaml")
    pol = base.precision.to_dict()
    layout = get_layout(tiny_config("qwen3", num_layers=2).to_dict())
    seen = {}
    for a in ARMS:
        r = load_recipe("recipes/tiny-mxfp8.yaml", arm_overrides(a, pol))
        seen[a] = r
    assert seen["bf16/bf16"].precision.default is Format.BF16 and seen["bf16/bf16"].sampler_precision is None
    assert seen["shared grid"].sampler_precision is None
    assert seen["bf16 sampler"].sampler_precision.default is Format.BF16
    part = compile_plan(seen["partial (gate_up bf16)"].sampler_precision, layout)
    assert part.format_for("model.layers.0.mlp.gate_proj.weight") is Format.BF16
    assert part.format_for("model.layers.0.mlp.up_proj.weight") is Format.BF16
    assert part.format_for("model.layers.0.mlp.down_proj.weight") is Format.MXFP8
    assert part.format_for("model.layers.0.self_attn.q_proj.weight") is Format.MXFP8
    diff = compile_plan(seen["different grid"].sampler_precision, layout)
    assert diff.format_for("model.layers.0.mlp.gate_proj.weight") is Format.FP8_BLOCK
    with pytest.raises(Exception, match="unknown arm"):
        arm_overrides("nope", pol)
