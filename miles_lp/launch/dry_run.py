"""``miles-lp run --dry-run``: validate a recipe against its model without starting anything.

Checks what can be checked here: the schema (already parsed), the model folder's config (a tiny model is not
built: its config is derived from the architecture), the compiled plan, the task against the vocabulary, the
placement. Returns a JSON-able summary.
"""

from __future__ import annotations

from typing import Any

from miles_lp.launch.recipe import Recipe


def dry_run(recipe: Recipe) -> dict[str, Any]:
    from miles_lp.formats.spec import Format
    from miles_lp.policy import compile_plan, get_layout
    from miles_lp.rl.tasks import make_task

    if recipe.model.is_tiny:
        from miles_lp.checkpoint.tiny import tiny_config

        cfg = tiny_config(recipe.model.arch, num_layers=recipe.model.num_layers)
        for k, v in recipe.model.overrides.items():
            setattr(cfg, k, v)
        config = cfg.to_dict()
    else:
        import json
        from pathlib import Path

        from miles_lp.launch.model import prepare_model

        config = json.loads((prepare_model(recipe.model, Path("/nonexistent")) / "config.json").read_text())
    pol = recipe.precision
    plan = None
    if not (pol.default is Format.BF16 and all(r.format is Format.BF16 for r in pol.rules)):
        plan = compile_plan(pol, get_layout(config))
    task = make_task(recipe.task, int(config["vocab_size"]))
    return {
        "recipe": recipe.source, "model": recipe.model.path, "model_type": config.get("model_type"),
        "plan_hash": None if plan is None else plan.hash,
        "quantized_tensors": 0 if plan is None else len(plan.quantized()),
        "plan_warnings": [] if plan is None else list(plan.warnings),
        "task": task.name, "answer_tokens": task.max_response_len,
        "samples_per_step": recipe.rl.prompts_per_step * recipe.rl.group_size, "steps": recipe.steps,
        "train_backend": recipe.train.backend, "rollout_backend": recipe.rollout.backend,
        "ray": {"enabled": recipe.ray.enabled, "address": recipe.ray.address or "local",
                "placement": recipe.ray.placement},
    }
