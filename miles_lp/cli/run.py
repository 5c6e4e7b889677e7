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
  miles-lp run recipes/tiny-mxfp8.yaml --prepare-engine /tmp/eng   # rollout.backend sglang: what to serve first
"""


def add_arguments(p) -> None:
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe value (dotted key, YAML value), e.g. --set rl.kl_coef=0.01; repeatable")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint (same recipe; "
                   "steps may be raised)")
    p.add_argument("--run-name", help="run folder name under logging.output_dir (default <recipe>-<UTC time>)")
    p.add_argument("--dry-run", action="store_true", help="validate the recipe, model and plan; start nothing")
    p.add_argument("--prepare-engine", metavar="DIR", help="write the checkpoint the rollout engine starts from "
                   "(the recipe's model converted with its plan, for rollout.target) into DIR, print how to serve "
                   "it, and exit: the first step for rollout.backend sglang, whose server must run before the run")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    import json
    import sys

    from miles_lp.errors import ConfigError
    from miles_lp.launch.recipe import load_recipe

    if args.resume and args.run_name:
        raise ConfigError("--run-name names a new run; --resume continues RUN_DIR under its own name: pass one of them")
    if args.resume and args.dry_run:
        raise ConfigError("--dry-run checks a recipe before a new run; to check a resume, run --dry-run on the run's "
                          "recipe.yaml (RUN_DIR/recipe.yaml)")
    if args.prepare_engine and (args.resume or args.dry_run or args.run_name):
        raise ConfigError("--prepare-engine only writes the engine's checkpoint: pass it without --resume, "
                          "--dry-run and --run-name")
    if args.resume:  # before the recipe is parsed or a Ray cluster starts: a folder that is no run is refused first
        from miles_lp.launch.run_dir import RunDir

        RunDir(args.resume).require_run()
    recipe = load_recipe(args.recipe, args.overrides)  # everything is validated before anything starts
    if args.prepare_engine:
        return _prepare_engine(recipe, args.recipe, args.prepare_engine, args.overrides)
    if args.dry_run:
        from miles_lp.launch.dry_run import dry_run

        print(json.dumps(dry_run(recipe), indent=2))
        return 0
    from miles_lp.config import use_runtime
    from miles_lp.launch.runner import RunInterrupted, check_transport, interrupted_note, resumed_recipe

    use_runtime(recipe.runtime)  # this process's run-time switches (Ray actors and engine processes apply them too)

    # refusals that need no model, before a Ray cluster starts or anything is built (Run and the Ray launcher make
    # them again): the transport, a resume's model folder and steps
    check_transport(recipe)
    if args.resume:
        from miles_lp.launch.run_dir import RunDir

        resumed_recipe(RunDir(args.resume), recipe)

    # Ctrl-C: while starting, the folder is removed (nothing recorded); in the loop, the note says
    # where the last checkpoint is and the exact resume command, or that there is nothing to resume
    try:
        if recipe.ray.enabled:
            from miles_lp.launch.ray_launcher import run_with_ray

            summary = run_with_ray(recipe, resume=args.resume, run_name=args.run_name,
                                   progress=not args.no_progress)
        else:
            from miles_lp.launch.runner import Run
            from miles_lp.launch.runner import summary as summarize

            run_ = Run.resume(args.resume, recipe) if args.resume else Run.start(recipe, args.run_name)
            try:
                rows = run_.train(progress=False if args.no_progress else None)
            except KeyboardInterrupt:
                raise RunInterrupted(run_.dir, run_.step, run_.recipe.steps) from None
            finally:
                run_.close()  # before the note: an engine process must not write into a folder being removed
            summary = {"run_dir": str(run_.dir.path), "steps": run_.step, **summarize(rows)}
    except RunInterrupted as exc:
        print(interrupted_note(exc.run_dir, exc.step, exc.steps), file=sys.stderr, flush=True)
        return 130
    except KeyboardInterrupt:
        print("miles-lp run: interrupted while starting: nothing was recorded"
              + (f"; {args.resume} is as it was (resume it again)" if args.resume else " (no run folder is left)"),
              file=sys.stderr, flush=True)
        return 130
    print(json.dumps(summary, indent=2), file=sys.stdout)
    return 0


def _prepare_engine(recipe, recipe_path: str, out: str, overrides: list[str]) -> int:
    """The engine's initial checkpoint (what ``Run.start`` writes as RUN_DIR/engine_init), for a server started
    by hand before the run (``rollout.backend: sglang``)."""
    import shlex
    import shutil
    from pathlib import Path

    from miles_lp.errors import ConfigError
    from miles_lp.io.atomic import check_output_target
    from miles_lp.launch.model import prepare_model
    from miles_lp.launch.runner import engine_side, plan_for

    if Path(out).exists():
        raise ConfigError(f"--prepare-engine {out} already exists: name a new folder")
    out_dir = check_output_target(out, overwrite=False)
    out_dir.mkdir(parents=True)
    try:
        model = prepare_model(recipe.model, out_dir / "model")
        ckpt, _, _ = engine_side(recipe, model, plan_for(recipe, model), out_dir / "engine")
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)  # no half-prepared folder
        raise
    ckpt = Path(ckpt).absolute()
    # the same overrides (the served checkpoint's plan is this recipe's), the sglang backend's own keys, and the
    # reference-engine keys the sglang backend refuses reset to their defaults
    engine_keys = (("device", "auto"), ("dtype", "auto"), ("kv_cache", "bf16"))
    sets = [o for o in overrides if not o.startswith(("rollout.backend=", "rollout.url=",
                                                      *(f"rollout.{k}=" for k, _ in engine_keys)))]
    ro = recipe.raw.get("rollout") or {}
    sets += [f"rollout.{k}={v}" for k, v in engine_keys if k in ro]
    sets += ["rollout.backend=sglang", "rollout.url=http://127.0.0.1:30000"]
    cmd = " ".join(["miles-lp", "run", shlex.quote(recipe_path), *(f"--set {shlex.quote(o)}" for o in sets)])
    print(f"engine checkpoint: {ckpt}\nserve it, then run against it:\n"
          f"  miles-lp serve {shlex.quote(str(ckpt))} --port 30000\n  {cmd}")
    return 0
