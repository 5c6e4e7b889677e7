"""The tools around the real model, on a tiny one: greedy held-out evaluation and the learner/engine mismatch
probe (``miles_lp.pretrained.evaluate`` / ``.mismatch``)."""

from __future__ import annotations

import json

import pytest
import torch

from miles_lp.pretrained.evaluate import greedy_answers, heldout_accuracy
from miles_lp.rl.tasks import TaskConfig, make_task

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_llama():
    import transformers

    from miles_lp.checkpoint.tiny import tiny_config

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config("llama", num_layers=1)).eval()


def test_greedy_answers_match_one_by_one_generation(tiny_llama):
    """Left-padded batches give each prompt the answer it gets alone; the stop token ends it."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    batched = greedy_answers(tiny_llama, prompts, 4, stop_ids=(2,), pad_id=0, batch=3)
    alone = [greedy_answers(tiny_llama, [p], 4, stop_ids=(2,), pad_id=0)[0] for p in prompts]
    assert batched == alone and all(1 <= len(a) <= 4 for a in batched)
    for a in batched:
        assert 2 not in a[:-1]


def test_heldout_accuracy_scores_with_the_task(tiny_llama):
    task = make_task(TaskConfig(name="arithmetic"))
    res = heldout_accuracy(tiny_llama, task, 4, 3)
    assert res["n"] == 4 and 0.0 <= res["accuracy"] <= 1.0 and len(res["examples"]) == 4
    assert all(e["answer"].isdigit() for e in res["examples"])
    json.dumps(res)
    with pytest.raises(Exception, match="lists no held-out prompts"):
        heldout_accuracy(tiny_llama, make_task(TaskConfig(name="copy")), 4, 3)


@pytest.mark.slow
def test_mismatch_probe_on_a_tiny_mxfp8_run(tmp_path):
    """The probe runs end to end on the tiny MXFP8 recipe; a shared grid keeps the quantized weights equal."""
    from miles_lp.pretrained.mismatch import main

    out = tmp_path / "m.json"
    assert main(["recipes/tiny-mxfp8.yaml", "--steps", "1", "--prompts", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["steps"]) == 2 and res["steps"][0]["weights_max_abs"]["quantized"] == 0.0
    assert len(res["per_layer_rel_l2"]) == 2
