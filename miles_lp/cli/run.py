"""``miles-lp run``: the main job (GRPO with shared-grid sync) from one recipe file."""

from __future__ import annotations

HELP = "run RL (GRPO) from a recipe: rollout, reward, update, shared-grid sync, checks, checkpoints"
DESCRIPTION = HELP + """

The recipe (recipes/tiny-*.yaml; docs/rl.md) is validated whole before anything starts: unknown sections or
keys are refused with file:line. --set overrides use the same validation. Metrics go to
RUN_DIR/metrics.jsonl (TensorBoard with logging.tensorboard: true), checkpoints to RUN_DIR/checkpoints.
ray.enabled: true runs the same step through Ray actors (a local cluster unless ray.address is set).

examples:
  miles-lp run recipes/tiny-mxfp8.yaml
  miles-lp run recipes/tiny-mxfp8.yaml --set steps=10 --set rl.kl_coef=0.01
  miles-lp run recipes/tiny-mxfp8.yaml --resume runs/tiny-mxfp8-20261201-101500
  miles-lp run recipes/tiny-mxfp8.yaml --dry-run
"""


def add_arguments(p) -> None:
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe value (dotted key, YAML value), e.g. --set rl.kl_coef=0.01; repeatable")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint (same recipe; "
                   "steps may be raised)")
    p.add_argument("--run-name", help="run folder name under logging.output_dir (default <recipe>-<UTC time>)")
    p.add_argument("--dry-run", action="store_true", help="validate the recipe, model and plan; start nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    import json
    import sys

    from miles_lp.launch.recipe import load_recipe

    from miles_lp.errors import ConfigError

    if args.resume and args.run_name:
        raise ConfigError("--run-name names a new run; --resume continues RUN_DIR under its own name: pass one of them")
    if args.resume and args.dry_run:
        raise ConfigError("--dry-run checks a recipe before a new run; to check a resume, run --dry-run on the run's "
                          "recipe.yaml (RUN_DIR/recipe.yaml)")
    recipe = load_recipe(args.recipe, args.overrides)  # everything is validated before anything starts
    if args.dry_run:
        from miles_lp.launch.dry_run import dry_run

        print(json.dumps(dry_run(recipe), indent=2))
        return 0
    if recipe.ray.enabled:
        from miles_lp.launch.ray_launcher import run_with_ray

        summary = run_with_ray(recipe, resume=args.resume, run_name=args.run_name, progress=not args.no_progress)
    else:
        from miles_lp.launch.runner import Run
        from miles_lp.launch.runner import summary as summarize

        run_ = Run.resume(args.resume, recipe) if args.resume else Run.start(recipe, args.run_name)
        try:
            rows = run_.train(progress=False if args.no_progress else None)
        finally:
            run_.close()
        summary = {"run_dir": str(run_.dir.path), "steps": run_.step, **summarize(rows)}
    print(json.dumps(summary, indent=2), file=sys.stdout)
    return 0
