"""Held-out accuracy of a policy on a text task: greedy answers to prompts the run never trained on.

    python -m miles_lp.pretrained.evaluate --recipe recipes/smollm2-bf16.yaml             # the recipe's model (before)
    python -m miles_lp.pretrained.evaluate --run-dir runs/smollm2-bf16-...                 # the run's latest checkpoint

``--run-dir`` loads the run's learner (its precision plan applied: an MXFP8 run is evaluated on its MXFP8 forward
grid) from the latest checkpoint; ``--recipe`` builds the learner from the recipe's model, untrained. Answers are
greedy (``transformers.generate``, ``do_sample=False``), scored by the task's reward; the task must list held-out
prompts (``heldout(n)``: the arithmetic task).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from miles_lp.errors import ConfigError, MilesLPError
from miles_lp.pretrained.output import print_json


def greedy_answers(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Sequence[int],
                   pad_id: int, batch: int = 32) -> list[list[int]]:
    """Greedy continuations (stop token kept, nothing after it) of ``prompts`` with a transformers model, in
    left-padded batches."""
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        chunk = [list(p) for p in prompts[i:i + batch]]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=list(stop_ids), pad_token_id=pad_id)
        for row in gen[:, width:].tolist():
            cut = next((j + 1 for j, t in enumerate(row) if t in stop_ids), len(row))
            out.append(row[:cut])
    return out


def heldout_accuracy(model, task, n: int, max_new_tokens: int) -> dict:
    if not hasattr(task, "heldout"):
        raise ConfigError(f"task {task.name} lists no held-out prompts (the arithmetic task does)")
    prompts = task.heldout(n)
    answers = greedy_answers(model, [p.ids for p in prompts], max_new_tokens, task.stop_token_ids, task.eos_id)
    rewards = [task.reward(p, a) for p, a in zip(prompts, answers, strict=True)]
    examples = [{"answer": p.text, "response": task.response_text(a)} for p, a in
                zip(prompts[:4], answers[:4], strict=True)]
    return {"n": len(prompts), "accuracy": sum(rewards) / len(rewards), "max_new_tokens": max_new_tokens,
            "examples": examples}


def _learner(args):
    from miles_lp.launch.model import prepare_model, vocab_size
    from miles_lp.launch.recipe import load_recipe
    from miles_lp.launch.runner import make_learner, plan_for
    from miles_lp.rl.tasks import make_task

    if args.run_dir:
        from miles_lp.launch.run_dir import RunDir, load_run_checkpoint

        rd = RunDir(args.run_dir)
        recipe = load_recipe(rd.recipe_path)
        model_dir = prepare_model(recipe.model, rd.path / "model")
    else:
        recipe = load_recipe(args.recipe)
        model_dir = prepare_model(recipe.model, None)
    learner = make_learner(recipe, model_dir, plan_for(recipe, model_dir))
    if args.run_dir:
        load_run_checkpoint(args.run_dir, learner)
    task = make_task(recipe.task, vocab_size(model_dir), model_dir)
    return learner, task, recipe


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m miles_lp.pretrained.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--recipe", help="evaluate the recipe's model as it starts")
    src.add_argument("--run-dir", help="evaluate a run's latest checkpoint")
    p.add_argument("--n", type=int, default=64, help="held-out prompts (default 64)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the recipe's rollout.max_response_len")
    p.add_argument("--out", default=None, help="also write the result as JSON here")
    args = p.parse_args(argv)
    try:
        learner, task, recipe = _learner(args)
        model = learner.model
        model.eval()
        res = heldout_accuracy(model, task, args.n, args.max_new_tokens or recipe.rollout.max_response_len)
    except MilesLPError as exc:
        print(f"evaluate: error: {exc}", file=sys.stderr)
        return 2
    res["source"] = args.run_dir or args.recipe
    print_json(res, args.out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
