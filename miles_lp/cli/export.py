"""``miles-lp export``: a learner's weights -> an engine checkpoint (the same files as ``miles-lp convert``)."""

from __future__ import annotations

HELP = "write an engine checkpoint (sglang / vllm / compressed-tensors) from the learner's weights"
DESCRIPTION = HELP + """

The learner is the embedded trainer on --hf-checkpoint IN with the policy from --recipe (its `precision:`
section) or from --format and the BF16 flags, as in `miles-lp convert`. Quantized weights are written as the
learner's own forward grid; everything else in the checkpoint's dtype. For the same weights the output equals
`miles-lp convert`'s, tensor for tensor, byte for byte, with the same configs (an engine started from either
starts on the learner's grid). The output folder appears only when complete. Check it with
`miles-lp verify OUT --source IN`.

example:
  miles-lp export --hf-checkpoint /tmp/tiny --format mxfp8 --target sglang --output /tmp/tiny-mxfp8
"""


def add_arguments(p) -> None:
    from miles_lp.cli.convert import FORMATS, TARGETS

    p.add_argument("--hf-checkpoint", required=True, metavar="IN", help="HF checkpoint folder the learner loads")
    p.add_argument("--output", required=True, metavar="OUT", help="output folder (written atomically)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--recipe", metavar="R.yaml", help="recipe whose `precision:` section is the policy")
    src.add_argument("--format", choices=FORMATS, help="build the policy from flags (as convert)")
    p.add_argument("--num-layers-at-start-in-bf16", type=int, default=0, metavar="N",
                   help="keep the first N decoder layers BF16 (with --format)")
    p.add_argument("--num-layers-at-end-in-bf16", type=int, default=0, metavar="N",
                   help="keep the last N decoder layers BF16 (with --format)")
    p.add_argument("--bf16-pattern", "--extra-high-precision-layers-hf", dest="bf16_patterns", action="append",
                   default=[], metavar="PAT", help="keep tensors matching PAT BF16 (repeatable; with --format)")
    p.add_argument("--target", choices=TARGETS, default="sglang", help="engine naming and config (default sglang)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the learner runs (default cpu)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT once the new one is complete")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="output shard size limit, e.g. 2GB (default: the largest input shard)")


def run(args) -> int:
    from miles_lp.cli.convert import build_policy, parse_size
    from miles_lp.errors import ConfigError
    from miles_lp.export.writer import export_learner, learner_from_hf, preflight

    policy = build_policy(args)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is available here; use --device cpu")
    max_shard = parse_size(args.max_shard_size) if args.max_shard_size else None
    preflight(args.output, args.hf_checkpoint, args.target, args.overwrite)  # before loading the model
    learner = learner_from_hf(args.hf_checkpoint, policy, device=args.device)
    summary = export_learner(learner, args.output, target=args.target, base=args.hf_checkpoint,
                             overwrite=args.overwrite, max_shard_bytes=max_shard)
    print("exported:")
    print(summary.table())
    print(f"next: miles-lp verify {summary.out} --source {args.hf_checkpoint}")
    return 0
