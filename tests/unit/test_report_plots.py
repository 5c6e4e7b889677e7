"""miles-lp report: the figures hold each run's per-step values under the metric's title, named by the run;
the table's last-N means are the means of the last N recorded values."""

import json
import math

import pytest

from miles_lp.errors import ConfigError
from miles_lp.report.plots import figures
from miles_lp.report.runs import load_runs
from miles_lp.report.summary import table


def write_run(path, rows):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows_for(k, n=12):
    out = []
    for s in range(n):
        out.append({"step": s, "reward/mean": 0.1 * s + k, "rollout_corr/kl": 1e-4 * (k + 1), "actor/entropy": 5.0 - s,
                    "response_length/mean": 3.0, "timing_s/generate": 1.0 + k, "timing_s/update_actor": 2.0 * (k + 1),
                    "timing_s/step": 3.0 + 3 * k, "tokens/generate": 100.0, "tokens/update_actor": 400.0,
                    "perf/sync_seconds": 0.5, "perf/sync_check_seconds": 0.25 * (k + 1)})
    return out


def lines_of(fig, title):
    ax = [a for a in fig.axes if a.get_title() == title]
    assert len(ax) == 1, title
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax[0].lines}


def test_figures_hold_every_arm(tmp_path):
    paths = [write_run(tmp_path / f"arm{k}", rows_for(k)) for k in range(3)]
    runs = load_runs(paths)
    figs = figures(runs)
    rew = lines_of(figs["training"], "reward/mean")
    assert sorted(rew) == ["arm0", "arm1", "arm2"]
    assert rew["arm2"][0] == list(range(12))
    assert rew["arm2"][1] == pytest.approx([0.1 * s + 2 for s in range(12)])
    kl = lines_of(figs["training"], "rollout_corr/kl")
    assert kl["arm1"][1] == pytest.approx([2e-4] * 12)
    upd = lines_of(figs["stages"], "timing_s/update_actor")
    assert upd["arm0"][1] == pytest.approx([2.0] * 12) and upd["arm2"][1] == pytest.approx([6.0] * 12)
    chk = lines_of(figs["sync"], "perf/sync_check_seconds")
    assert chk["arm2"][1] == pytest.approx([0.75] * 12)
    # stages never timed (ref, checks here) get no panel
    titles = {a.get_title() for a in figs["stages"].axes}
    assert "timing_s/ref" not in titles and "timing_s/generate" in titles


def test_table_last_n_and_rates(tmp_path):
    runs = load_runs([write_run(tmp_path / "a", rows_for(0))])
    md = table(runs, last=4)
    row = [ln for ln in md.splitlines() if ln.startswith("| a |")][0].split("|")[1:-1]
    head = [ln for ln in md.splitlines() if ln.startswith("| run |")][0].split("|")[1:-1]
    cell = dict(zip([h.strip() for h in head], [c.strip() for c in row], strict=True))
    assert float(cell["reward"]) == pytest.approx(sum(0.1 * s for s in range(8, 12)) / 4, rel=1e-3)
    assert float(cell["gen tok/s (step)"]) == pytest.approx(100 / 3, rel=3e-3)
    assert float(cell["update_actor tok/s"]) == pytest.approx(200, rel=1e-3)


def test_duplicate_names_and_bad_input(tmp_path):
    a = write_run(tmp_path / "x" / "run", rows_for(0, 2))
    b = write_run(tmp_path / "y" / "run", rows_for(1, 2))
    assert [r.name for r in load_runs([a, b])] == ["x/run", "y/run"]
    with pytest.raises(ConfigError, match="no metrics.jsonl"):
        load_runs([tmp_path / "nothing"])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step": 0}\n{oops\n')
    with pytest.raises(ConfigError, match=r"metrics.jsonl:2: not a JSON line"):
        load_runs([bad])
    with pytest.raises(ConfigError, match="2 names for 1 runs"):
        load_runs([a], ["p", "q"])


def test_cli_writes_pngs_and_table(tmp_path, capsys):
    from miles_lp.cli import main

    a = write_run(tmp_path / "bf16", rows_for(0, 5))
    b = write_run(tmp_path / "mxfp8", rows_for(1, 5))
    assert main(["report", str(a), str(b), "--out", str(tmp_path / "out"), "--last", "3"]) == 0
    for n in ("report_training.png", "report_stages.png", "report_sync.png", "report.md"):
        assert (tmp_path / "out" / n).stat().st_size > 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| bf16 | 5 |" in md and "| mxfp8 | 5 |" in md
    assert not math.isnan(float(md.split("| bf16 | 5 | ")[1].split(" |")[0]))


def test_cli_out_under_a_file_is_a_clear_error_and_writes_nothing(tmp_path, capsys):
    """``--out`` under a regular file was a NotADirectoryError traceback."""
    from miles_lp.cli import main

    a = write_run(tmp_path / "bf16", rows_for(0, 5))
    (tmp_path / "afile").write_text("x")
    assert main(["report", str(a), "--out", str(tmp_path / "afile" / "r")]) == 2
    err = capsys.readouterr().err
    assert "cannot create the folder" in err and "afile is a file, not a folder" in err
