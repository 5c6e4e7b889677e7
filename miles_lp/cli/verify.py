"""``miles-lp verify``: check a converted checkpoint against its plan (and, with --source, its input)."""

from __future__ import annotations

HELP = "verify a converted checkpoint: tensors, engine config (C1), scales, and with --source the grid (C2)"
DESCRIPTION = HELP + """

Checks (each reports pass, FAIL, or skip with the reason):
  record   miles_lp_plan.json present, plan hash intact
  index    shard headers valid, index names exactly the stored tensors
  tensors  every tensor the plan and the declared scheme imply (e.g. compressed-tensors W4A4
           input_global_scale), with the target's dtype and shape, nothing else
  config   quantization_config / hf_quant_config.json equal the plan's emitters' output, the engine's
           own skip-matching selects exactly the plan's quantized weights, and every scheme field the
           engine's reader uses (group_size, num_bits, strategy, weight_block_size, scale_fmt, ...) has
           the plan's value (C1, offline)
  scales   finite and in range (E8M0 != 0xFF, E4M3 finite and >= 0, global scales > 0, the static
           activation scale 1.0); every fused group (q/k/v, gate/up) stores ONE NVFP4 global scale and
           its largest block scale is 448 (global scale = group amax / 2688)
  source   (--source) the input files are the ones converted (sha256)
  grid     (--source) quantized bytes equal a second, independent reference codec's quantization of the
           source (fused groups from their joint amax); other tensors equal the source (C2)
  error    (--source) decoded weights within each format's element-wise bound
Exit code 0 only if no check fails.

A checkpoint without our record (miles_lp_plan.json: another tool wrote it, or the record was lost): give the
policy and the target, and the plan is compiled here, as `miles-lp convert --recipe` compiles it, on the
--source's names and shapes (or, without --source, on those the checkpoint's tensors imply for the target):
  miles-lp verify OUT --recipe R.yaml --target sglang [--source IN] [--fp8-decode bf16|fp32]
Then `record` is skipped, `config` fails only where the engine would read the config differently from the
plan (C1: a format or a scheme field; other differences from our emitters' text are notes), `source` is
skipped (no recorded sha256) and `grid` /
`error` run against --source as given (a block-FP8 IN decoded per --fp8-decode, default bf16 as convert).
"""


def add_arguments(p) -> None:
    p.add_argument("out", metavar="OUT", help="converted checkpoint folder")
    p.add_argument("--source", metavar="IN", default=None, help="the input HF checkpoint, to compare against")
    p.add_argument("--recipe", metavar="R.yaml", default=None,
                   help="compile the plan from this recipe's precision: section instead of reading OUT's "
                        "miles_lp_plan.json (a checkpoint another tool wrote); needs --target")
    p.add_argument("--target", choices=("sglang", "vllm", "compressed-tensors"), default=None,
                   help="with --recipe: the engine format OUT was written for")
    p.add_argument("--fp8-decode", choices=("bf16", "fp32"), default=None,
                   help="with --recipe and a block-FP8 --source: how the source is decoded (default bf16, as "
                        "convert); with a record, the recorded mode is used")


def run(args) -> int:
    from miles_lp.checkpoint.verify import verify_checkpoint
    from miles_lp.errors import ConfigError

    if args.recipe is None:
        given = [f for f, v in (("--target", args.target), ("--fp8-decode", args.fp8_decode)) if v is not None]
        if given:
            raise ConfigError(f"{given[0]} goes with --recipe (a checkpoint without miles_lp_plan.json); with a "
                              "record, the recorded target and decode are used: drop it")
        report = verify_checkpoint(args.out, source=args.source)
    else:
        from miles_lp.policy import load_policy

        if args.target is None:
            raise ConfigError("--recipe needs --target (sglang, vllm or compressed-tensors): the engine format OUT "
                              "was written for")
        report = verify_checkpoint(args.out, source=args.source, policy=load_policy(args.recipe),
                                   target=args.target, recipe_name=args.recipe, fp8_decode=args.fp8_decode or "bf16")
    print(report.format())
    return 0 if report.ok else 1
