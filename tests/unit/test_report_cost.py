"""The cost fit recovers known F and c from synthetic steps, its bootstrap interval covers them, and the
break-even is added-per-micro-batch / saved-per-token (CONTRACT 8)."""

import json

import numpy as np
import pytest

from miles_lp.errors import ConfigError
from miles_lp.report.cost import bootstrap_fit, compare, doubts, fit_line, fit_run
from miles_lp.report.runs import load_run


def synth_run(tmp_path, name, F, c, n=40, noise=0.002, seed=0, mini_batches=2, budget=8192):
    rng = np.random.default_rng(seed)
    d = tmp_path / name
    d.mkdir()
    rows = []
    for s in range(n):
        T = float(rng.integers(1000, 6000))
        rows.append({"step": s, "tokens/update_actor": T,
                     "timing_s/update_actor": F + c * T + float(rng.normal(0, noise))})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "recipe.yaml").write_text(f"train: {{micro_batch_tokens: {budget}}}\nrl: {{mini_batches: {mini_batches}}}\n")
    return load_run(d)


def test_fit_recovers_known_F_and_c(tmp_path):
    run = synth_run(tmp_path, "a", F=0.8, c=26.7e-6)
    f = fit_run(run, skip=0, resamples=1000)["update_actor"]
    assert f.F == pytest.approx(0.8, abs=0.01) and f.c == pytest.approx(26.7e-6, rel=0.02)
    assert f.F_ci[0] < 0.8 < f.F_ci[1] and f.c_ci[0] < 26.7e-6 < f.c_ci[1]
    assert f.r2 > 0.99 and f.micro_batches == 2 and not doubts(f)
    # exact data: exact fit; the bootstrap of exact data has zero width
    T = [1.0, 2.0, 5.0, 9.0]
    assert fit_line(T, [3 + 2 * x for x in T]) == pytest.approx((3.0, 2.0))
    bF, bc = bootstrap_fit(T, [3 + 2 * x for x in T], 200)
    assert np.allclose(bc, 2.0) and np.allclose(bF, 3.0)


def test_break_even_is_added_over_saved(tmp_path):
    # seed 000's update_actor numbers: 26.7 -> 15.4 us/token, +51.5 ms per micro-batch, 128 micro-batches
    bf = synth_run(tmp_path, "bf16", F=1.0, c=26.7e-6, mini_batches=1, seed=1)
    mx = synth_run(tmp_path, "mxfp8", F=1.0 + 0.0515, c=15.4e-6, mini_batches=1, seed=2)
    cmp = compare(fit_run(bf, 0, 1000)["update_actor"], fit_run(mx, 0, 1000)["update_actor"])
    assert cmp.saved_per_token == pytest.approx(11.3e-6, rel=0.05)
    assert cmp.added_per_micro_batch == pytest.approx(0.0515, rel=0.1)
    assert cmp.break_even == pytest.approx(0.0515 / 11.3e-6, rel=0.15)  # ~4.6k tokens, as seed 000
    assert cmp.break_even_ci[0] < cmp.break_even < cmp.break_even_ci[1]
    assert "faster above" in cmp.verdict
    # slower per token and per micro-batch: no break-even, said so
    slow = synth_run(tmp_path, "slow", F=2.0, c=40e-6, mini_batches=1, seed=3)
    c2 = compare(fit_run(bf, 0, 500)["update_actor"], fit_run(slow, 0, 500)["update_actor"])
    assert c2.break_even is None and "slower at every size" in c2.verdict


def test_fit_refuses_and_doubts(tmp_path):
    with pytest.raises(ConfigError, match="tokens per step never vary"):
        fit_line([5, 5, 5, 5], [1, 2, 3, 4])
    with pytest.raises(ConfigError, match="at least 3 steps"):
        fit_line([1, 2], [1, 2])
    neg = synth_run(tmp_path, "neg", F=-3.0, c=1e-3, noise=0.0)
    assert any("not a physical fixed cost" in d for d in doubts(fit_run(neg, 0, 200)["update_actor"]))


def test_cli_cost(tmp_path, capsys):
    from miles_lp.cli import main

    synth_run(tmp_path, "bf16", F=1.0, c=26.7e-6, mini_batches=1, seed=1)
    synth_run(tmp_path, "mxfp8", F=1.0515, c=15.4e-6, mini_batches=1, seed=2)
    assert main(["experiment", "cost", str(tmp_path / "bf16"), str(tmp_path / "mxfp8"), "--out",
                 str(tmp_path / "o"), "--resamples", "300", "--skip", "0"]) == 0
    out = json.loads((tmp_path / "o" / "cost.json").read_text())
    be = out["comparisons"]["mxfp8"]["update_actor"]["break_even_tokens_per_micro_batch"]
    assert 3500 < be < 6000
    assert "break-even" in capsys.readouterr().out
    assert main(["experiment", "cost", str(tmp_path / "bf16"), "--micro-batch-sweep", "--sizes", "64"]) != 0
    assert "needs >= 2 sizes" in capsys.readouterr().err
    assert main(["experiment", "cost", str(tmp_path / "bf16"), "--micro-batch-sweep", "--sizes", "a,b"]) != 0
    assert "comma-separated integers" in capsys.readouterr().err


def test_sweep_fit_per_micro_batch():
    from miles_lp.report.sweep import fit_per_micro_batch

    pts = [(s, n, 0.3 + 0.0515 * n) for s, n in ((8192, 1), (1024, 4), (256, 16), (64, 64)) for _ in range(2)]
    f = fit_per_micro_batch(pts, 300)
    assert f["per_micro_batch"] == pytest.approx(0.0515) and f["F"] == pytest.approx(0.3)
    assert f["per_micro_batch_ci"][0] == pytest.approx(0.0515)


def test_cost_plot_holds_points_and_fit(tmp_path):
    from miles_lp.report.plots import cost_figure

    run = synth_run(tmp_path, "a", F=0.5, c=1e-4, noise=0.0)
    fit = fit_run(run, 0, 100)
    fig = cost_figure([run], [fit])
    ax = [a for a in fig.axes if a.get_title() == "timing_s/update_actor"][0]
    pts = [ln for ln in ax.lines if ln.get_label() == "a"][0]
    line = [ln for ln in ax.lines if ln.get_label().startswith("a fit")][0]
    assert list(pts.get_xdata()) == [r["tokens/update_actor"] for r in run.rows]
    x0, x1 = line.get_xdata()
    assert line.get_ydata()[1] == pytest.approx(0.5 + 1e-4 * x1)


def const_run(tmp_path, name, F, c, T, n=4, warmup=5.0, budget=8192):
    """A run whose every step has ``T`` generate tokens (responses at their cap); the first step a slow warm-up."""
    d = tmp_path / name
    d.mkdir()
    rows = [{"step": s + 1, "tokens/generate": T, "timing_s/generate": F + c * T + (warmup if s == 0 else 0.0)
             + 1e-4 * s} for s in range(n)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "recipe.yaml").write_text(f"train: {{micro_batch_tokens: {budget}}}\nrl: {{prompts_per_step: {T // 512}}}\n")
    return d


def test_pooled_runs_separate_F_and_c(tmp_path, capsys):
    from miles_lp.cli import main
    from miles_lp.report.runs import load_runs, pool_runs

    dirs = [const_run(tmp_path, f"{arm}-p{p}", F, c, 512 * p) for arm, F, c in (("bf16", 0.05, 80e-6),
                                                                                 ("fp8", 0.08, 50e-6))
            for p in (2, 4, 8)]
    with pytest.raises(ConfigError, match="tokens per step never vary"):
        fit_run(load_runs(dirs[:1])[0], 1, 100)
    pooled = pool_runs(load_runs(dirs[:3]), skip=1, name="bf16")
    assert [r["step"] for r in pooled.rows] == list(range(1, 10))
    assert [r["pooled_from"] for r in pooled.rows] == ["bf16-p2"] * 3 + ["bf16-p4"] * 3 + ["bf16-p8"] * 3
    assert all(r["timing_s/generate"] < 1 for r in pooled.rows)  # every warm-up step dropped
    f = fit_run(pooled, 0, 300)["generate"]
    assert f.F == pytest.approx(0.05, abs=1e-3) and f.c == pytest.approx(80e-6, rel=1e-2)
    # the command: --pool 3, one name per arm; the pooled folders are run folders again
    out = tmp_path / "o"
    assert main(["experiment", "cost", *map(str, dirs), "--pool", "3", "--names", "bf16", "fp8", "--out", str(out),
                 "--resamples", "200"]) == 0
    got = json.loads((out / "cost.json").read_text())
    assert got["runs"]["fp8"]["generate"]["c"] == pytest.approx(50e-6, rel=1e-2)
    assert got["runs"]["fp8"]["generate"]["n"] == 9
    assert "fp8: 9 steps pooled from fp8-p2 (3), fp8-p4 (3), fp8-p8 (3)" in capsys.readouterr().out
    assert main(["experiment", "cost", str(out / "pooled-bf16"), str(out / "pooled-fp8"), "--skip", "0",
                 "--resamples", "200", "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "cost.json").read_text())
    assert again["runs"]["pooled-fp8"]["generate"]["c"] == pytest.approx(got["runs"]["fp8"]["generate"]["c"])
    # refusals: arms of unequal size, a name count per RUN_DIR, runs that differ in micro-batch budget
    assert main(["experiment", "cost", *map(str, dirs[:4]), "--pool", "3"]) != 0
    assert "do not split into arms of 3" in capsys.readouterr().err
    assert main(["experiment", "cost", *map(str, dirs), "--pool", "3", "--names", *"abcdef"]) != 0
    assert "6 names for 2 pooled arms" in capsys.readouterr().err
    odd = const_run(tmp_path, "odd", 0.05, 80e-6, 1024, budget=4096)
    with pytest.raises(ConfigError, match="differ in train.micro_batch_tokens"):
        pool_runs(load_runs([dirs[0], odd]), 1, "x")
    with pytest.raises(ConfigError, match="none left after dropping the first 4"):
        pool_runs(load_runs(dirs[:2]), 4, "x")


def test_pooled_resampling_keeps_every_size_and_refusal_names_the_stage(tmp_path):
    from miles_lp.report.runs import load_runs, pool_runs

    # two sizes, 3 steps each: a plain resample of 6 steps draws one size only in 2 * 0.5**6 of the draws (skipped,
    # so fewer fits); within-run resampling keeps both sizes in every draw
    T = [100.0] * 3 + [800.0] * 3
    t = [1.0, 1.1, 0.9, 2.0, 2.2, 1.8]
    bF, bc = bootstrap_fit(T, t, 2000, groups=["a"] * 3 + ["b"] * 3)
    assert len(bc) == 2000
    # each draw's slope is (mean of b's draw - mean of a's draw) / 700: within the extreme draws
    assert bc.min() >= (1.8 - 1.1) / 700 - 1e-12 and bc.max() <= (2.2 - 0.9) / 700 + 1e-12
    _, plain = bootstrap_fit(T, t, 2000)
    assert len(plain) < 2000
    with pytest.raises(ValueError, match="5 group labels for 6 steps"):
        bootstrap_fit(T, t, 10, groups=["a"] * 5)
    # a pooled run is resampled per source run: its fit's interval is the grouped one
    dirs = [const_run(tmp_path, f"x-l{n}", 0.05, 80e-6, T) for n, T in ((32, 1024), (256, 8192))]
    f = fit_run(pool_runs(load_runs(dirs), 1, "x"), 0, 500)["generate"]
    Tp = [1024.0] * 3 + [8192.0] * 3
    tp = [0.05 + 80e-6 * x + 1e-4 * s for x in (1024, 8192) for s in (1, 2, 3)]
    _, ref = bootstrap_fit(Tp, tp, 500, groups=["x-l32"] * 3 + ["x-l256"] * 3)
    assert f.c_ci == pytest.approx(tuple(np.quantile(ref, [0.025, 0.975])))
    # the command drops --skip steps of each pooled run: 2 of 4 here, so 2 + 2 steps fitted
    from miles_lp.cli import main

    out = tmp_path / "o"
    assert main(["experiment", "cost", *map(str, dirs), "--pool", "2", "--skip", "2", "--names", "x", "--out", str(out),
                 "--resamples", "100"]) == 0
    got = json.loads((out / "cost.json").read_text())["runs"]["x"]["generate"]
    assert got["n"] == 4 and got["c"] == pytest.approx(80e-6, rel=1e-2)
    # pooled runs of one size only: refused, naming the arm and the stage
    same = [const_run(tmp_path, f"y-{i}", 0.05, 80e-6, 2048) for i in range(2)]
    with pytest.raises(ConfigError, match=r"y \(.*\), stage generate: tokens per step never vary .* --pool"):
        fit_run(pool_runs(load_runs(same), 1, "y"), 0, 100)


def test_negative_cost_per_token_is_doubted(tmp_path):
    # time falling as tokens grow (a warm-up in the big run's first steps, say) is not a cost per token
    neg = synth_run(tmp_path, "neg", F=1.0, c=-50e-6, noise=0.001)
    f = fit_run(neg, 0, 300)["update_actor"]
    assert f.c_ci[1] < 0 and f.r2 > 0.9
    assert any(d.startswith("c < 0") for d in doubts(f))
    pos = synth_run(tmp_path, "pos", F=1.0, c=50e-6, noise=0.001)
    assert not doubts(fit_run(pos, 0, 300)["update_actor"])


def test_theil_sen_resists_a_spike_least_squares_follows(tmp_path, capsys):
    """Two sizes of 4 steps each on an exact line, one step of the large size 3x slow (a host hiccup): Theil-Sen
    recovers F and c, least squares does not; its bootstrap interval covers c; the CLI takes --fit."""
    T = [1000.0] * 4 + [8000.0] * 4
    t = [0.1 + 50e-6 * x for x in T]
    t[5] *= 3
    F_ols, c_ols = fit_line(T, t)
    F_ts, c_ts = fit_line(T, t, "theil-sen")
    assert c_ts == pytest.approx(50e-6) and F_ts == pytest.approx(0.1)
    assert abs(c_ols - 50e-6) > 10e-6
    _, bc = bootstrap_fit(T, t, 500, groups=["s"] * 4 + ["l"] * 4, method="theil-sen")
    lo, hi = np.quantile(bc, [0.025, 0.975])
    assert lo <= 50e-6 <= hi
    with pytest.raises(ConfigError, match="fit method 'median': one of ols, theil-sen"):
        fit_line(T, t, "median")
    from miles_lp.cli import main

    for name, F, c in (("bf16", 0.8, 26.7e-6), ("mxfp8", 0.9, 20e-6)):
        synth_run(tmp_path, name, F=F, c=c)
    out = tmp_path / "out"
    assert main(["experiment", "cost", str(tmp_path / "bf16"), str(tmp_path / "mxfp8"), "--fit", "theil-sen",
                 "--out", str(out), "--resamples", "200"]) == 0
    assert "Theil-Sen" in capsys.readouterr().out
    res = json.loads((out / "cost.json").read_text())
    assert res["fit"] == "theil-sen"
    assert res["runs"]["bf16"]["update_actor"]["c"] == pytest.approx(26.7e-6, rel=0.05)
