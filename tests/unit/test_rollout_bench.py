"""`miles-lp bench rollout` runs end to end on the tiny model (a smoke run: the figures come from the full run)."""

from __future__ import annotations

import json

import torch

from miles_lp.cli import main


def test_bench_rollout_smoke(tmp_path, capsys):
    n = torch.get_num_threads()
    try:
        out = tmp_path / "rows.json"
        assert main(["bench", "rollout", "--batch", "4", "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1",
                     "--threads", "1", "--vllm", "off", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(n)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["precision"]) for r in rows] == [
        ("transformers generate", "bf16"), ("reference engine", "bf16"), ("reference engine", "mxfp8")]
    assert all(r["tokens_per_s"] > 0 and r["ratio_vs_generate"] > 0 for r in rows)
    assert rows[2]["quantized_layers"] == {"mxfp8": 28}
    assert "vs generate" in capsys.readouterr().out
