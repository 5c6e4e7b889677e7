"""``experiment cost --micro-batch-sweep``: seed 000's controlled sweep (its Table 3). One set of trajectories,
sampled once from the first run's recipe (its engine, step 0's prompts and sampling seed), is trained on by
every run's learner at several ``train.micro_batch_tokens``, so only the micro-batch size changes. Per run the
update time is fitted as ``t = F + a * n_mb`` (``n_mb`` = the micro-batches ``train_step`` reports); the
difference of ``a`` between runs is the added cost per micro-batch, measured directly.

Run folders do not record their sampled trajectories, so they are re-sampled here (deterministically from the
recipe) rather than read back: the same data for every arm, not the data the runs trained on.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_lp.report.cost import bootstrap_fit, fit_line, interval


def trajectories(run_dir: Path, workdir: Path) -> list[dict[str, Any]]:
    """Step 0's rollouts of the run's recipe, with old log-probs and GRPO advantages (the GRPO step's 1-5)."""
    import torch

    from miles_lp.launch.recipe import load_recipe
    from miles_lp.launch.run_dir import RunDir
    from miles_lp.launch.runner import Run
    from miles_lp.rl.advantages import group_advantages
    from miles_lp.rl.batch import make_sample, response_rows
    from miles_lp.rl.step import step_seed

    recipe = load_recipe(run_dir / "recipe.yaml", ["rl.kl_coef=0"])
    run = Run(recipe, RunDir.create(workdir, "sweep-trajectories"))
    try:
        rl = recipe.rl
        prompts = run.task.prompts(0, rl.prompts_per_step)
        inputs = [list(p.ids) for p in prompts for _ in range(rl.group_size)]
        gens = run.engine.generate(inputs, dataclasses.replace(run.parts.sampling, seed=step_seed(recipe.seed, 0)))
        rewards = torch.tensor([run.task.reward(prompts[i // rl.group_size], g.output_ids) for i, g in enumerate(gens)])
        adv = group_advantages(rewards, rl.group_size, norm_by_std=rl.norm_adv_by_std)
        batch = [make_sample(inputs[i], g.output_ids, g.logprobs, i) for i, g in enumerate(gens)]
        full, _ = run.learner.logprobs([s["tokens"] for s in batch])
        for s, o in zip(batch, response_rows(full, batch), strict=True):
            s["old_logprobs"], s["advantage"], s["is_weights"] = o, float(adv[s["index"]]), None
        return batch
    finally:
        run.close()


def sweep_one(run_dir: Path, batch, sizes: Sequence[int], repeats: int, workdir: Path) -> list[tuple[int, int, float]]:
    """``(micro_batch_tokens, n_mb, seconds)`` of ``repeats`` update passes per size (the first pass per size is
    a warm-up and not kept)."""
    from miles_lp.launch.model import prepare_model
    from miles_lp.launch.recipe import load_recipe
    from miles_lp.launch.runner import plan_for
    from miles_lp.rl.batch import GRPOLoss
    from miles_lp.train.embedded import EmbeddedTrainer

    recipe = load_recipe(run_dir / "recipe.yaml")
    model_dir = prepare_model(recipe.model, workdir / f"model-{run_dir.name}")
    plan = plan_for(recipe, model_dir)
    out = []
    for size in sizes:
        learner = EmbeddedTrainer(model_dir, plan, dataclasses.replace(recipe.train, micro_batch_tokens=int(size)))
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            stats = learner.train_step(batch, GRPOLoss(recipe.rl))
            dt = time.perf_counter() - t0
            if r:
                out.append((int(size), int(stats["micro_batches"]), dt))
    return out


def fit_per_micro_batch(points, resamples: int = 2000, seed: int = 0) -> dict[str, Any]:
    n = [p[1] for p in points]
    t = [p[2] for p in points]
    F, a = fit_line(n, t)
    bF, ba = bootstrap_fit(n, t, resamples, seed)
    return {"F": F, "per_micro_batch": a, "per_micro_batch_ci": interval(ba), "F_ci": interval(bF),
            "boot": ba, "points": points}
