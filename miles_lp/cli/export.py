"""``miles-lp export``: a learner's weights -> an engine checkpoint (the same files as ``miles-lp convert``)."""

from __future__ import annotations

import os

HELP = "write an engine checkpoint (sglang / vllm / compressed-tensors) from the learner's weights"
DESCRIPTION = HELP + """

The learner is either a run's (--run-dir RUN: the latest checkpoint of `miles-lp run`, with the run's own
recipe and model: the RL-trained low-precision policy) or the embedded trainer on --hf-checkpoint IN with the
policy from --recipe (its `precision:` section) or from --format and the BF16 flags, as in `miles-lp convert`. Quantized weights are written as the
learner's own forward grid; everything else in the checkpoint's dtype. For the same weights the output equals
`miles-lp convert`'s, tensor for tensor, byte for byte, with the same configs (an engine started from either
starts on the learner's grid). The output folder appears only when complete. Check it with
`miles-lp verify OUT --source IN`; for a --run-dir export of a trained learner, verify checks the files, scales,
configs and that IN is the model it was trained from, and skips the grid/error comparisons (the weights moved
past IN: their grid was checked at every sync by C2).

examples:
  miles-lp export --hf-checkpoint /tmp/tiny --format mxfp8 --target sglang --output /tmp/tiny-mxfp8
  miles-lp export --run-dir runs/tiny-mxfp8-20261201-101737 --target sglang --output /tmp/trained-mxfp8
"""


def add_arguments(p) -> None:
    from miles_lp.cli.convert import FORMATS, TARGETS

    p.add_argument("--hf-checkpoint", metavar="IN", help="HF checkpoint folder the learner loads")
    p.add_argument("--output", required=True, metavar="OUT", help="output folder (written atomically)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", metavar="RUN", help="a `miles-lp run` folder: export its latest checkpoint "
                     "(its recipe and model; no --hf-checkpoint)")
    src.add_argument("--recipe", metavar="R.yaml", help="recipe whose `precision:` section is the policy")
    src.add_argument("--format", choices=FORMATS, help="build the policy from flags (as convert)")
    p.add_argument("--num-layers-at-start-in-bf16", type=int, default=0, metavar="N",
                   help="keep the first N decoder layers BF16 (with --format)")
    p.add_argument("--num-layers-at-end-in-bf16", type=int, default=0, metavar="N",
                   help="keep the last N decoder layers BF16 (with --format)")
    p.add_argument("--bf16-pattern", "--extra-high-precision-layers-hf", dest="bf16_patterns", action="append",
                   default=[], metavar="PAT", help="keep tensors matching PAT BF16 (repeatable; with --format)")
    p.add_argument("--target", choices=TARGETS, default="sglang", help="engine naming and config (default sglang)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the learner runs (default: cpu; with --run-dir, the run's train.device)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT (a checkpoint folder, or an empty one) once the new one "
                   "is complete")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="output shard size limit, e.g. 2GB (default: the largest input shard)")


def run(args) -> int:
    from miles_lp.cli.convert import parse_size
    from miles_lp.errors import ConfigError
    from miles_lp.export.writer import export_learner, preflight

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is available here; use --device cpu")
    max_shard = parse_size(args.max_shard_size) if args.max_shard_size else None
    if args.run_dir is not None:
        if args.hf_checkpoint is not None:
            raise ConfigError("--run-dir exports the run's own model: drop --hf-checkpoint")
        base, load = _run_learner(args)
    else:
        if args.hf_checkpoint is None:
            raise ConfigError("--hf-checkpoint IN is required with --recipe / --format (or export a run with "
                              "--run-dir RUN)")
        base, load = args.hf_checkpoint, lambda: _hf_learner(args)
    preflight(args.output, base, args.target, args.overwrite)  # before loading the model
    learner = load()
    summary = export_learner(learner, args.output, target=args.target, base=base, overwrite=args.overwrite,
                             max_shard_bytes=max_shard)
    print("exported:")
    print(summary.table())
    print(f"next: miles-lp verify {summary.out} --source {base}")
    return 0


def _hf_learner(args):
    from miles_lp.cli.convert import build_policy, check_layer_flags
    check_layer_flags(args)
    return learner_from_hf(args.hf_checkpoint, build_policy(args), device=args.device or "cpu")


def learner_from_hf(hf_checkpoint: str | os.PathLike, policy, *, device: str = "cpu"):
    """The embedded learner on an HF checkpoint, its plan compiled on the checkpoint's names (as convert), for
    ``miles_lp.export.writer.export_learner`` (which takes any ``Learner``).

    Master weights in BF16 when every floating tensor of the checkpoint is BF16 (the same values, half the
    memory of FP32), else FP32.
    """
    import torch

    from miles_lp.train.config import TrainConfig
    from miles_lp.train.embedded import EmbeddedTrainer, SourceInfo, plan_for_model

    info = SourceInfo.from_checkpoint(hf_checkpoint)
    floats = {d for d in info.dtypes.values() if d.is_floating_point}
    master = "bf16" if floats <= {torch.bfloat16} else "fp32"
    plan = plan_for_model(policy, hf_checkpoint)
    return EmbeddedTrainer(hf_checkpoint, plan, TrainConfig(device=device, master_dtype=master))


def _run_learner(args):
    """(the run's model folder, a loader of the learner at the run's latest checkpoint)."""
    from pathlib import Path

    from miles_lp.errors import ConfigError
    from miles_lp.launch.recipe import load_recipe
    from miles_lp.launch.run_dir import RunDir, load_run_checkpoint
    from miles_lp.launch.runner import make_learner, plan_for

    if args.format is not None or args.bf16_patterns or args.num_layers_at_start_in_bf16 or \
            args.num_layers_at_end_in_bf16:
        raise ConfigError("--run-dir uses the run's own precision policy: drop --format and the BF16 flags")
    rd = RunDir(args.run_dir)
    if not rd.recipe_path.is_file():
        raise ConfigError(f"--run-dir {args.run_dir}: no recipe.yaml there; is it a `miles-lp run` folder?")
    recipe = load_recipe(rd.recipe_path)
    if args.device is not None:  # the learner is rebuilt where asked, not where the run trained
        import dataclasses

        recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, device=args.device))
    model_dir = Path(rd.info()["model_dir"])
    if not model_dir.is_dir() and (rd.path / "model").is_dir():  # a relative path recorded by an older run
        model_dir = rd.path / "model"
    if not model_dir.is_dir():
        raise ConfigError(f"--run-dir {args.run_dir}: the run's model folder {model_dir} (run.json model_dir) does "
                          "not exist here; the learner is rebuilt on it before the checkpoint is loaded: restore that folder")

    def load():
        learner = make_learner(recipe, model_dir, plan_for(recipe, model_dir))
        load_run_checkpoint(rd.path, learner)
        return learner

    return model_dir, load
