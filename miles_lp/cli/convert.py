"""``miles-lp convert``: a Hugging Face checkpoint -> a quantized checkpoint an engine loads."""

from __future__ import annotations

import re

from miles_lp.policy.presets import policy_for_format  # the --format flags as a policy

HELP = "convert a HF checkpoint to MXFP8 / NVFP4 for SGLang, vLLM or compressed-tensors (streaming, atomic)"
DESCRIPTION = HELP + """

The precision policy comes from a recipe (--recipe R.yaml, its `precision:` section) or from flags
(--format plus the BF16 exceptions); the two are exclusive. The effective plan's summary is printed
before any work. The output folder appears only when complete; an existing one is replaced only with
--overwrite. Inputs: bf16 / fp16 / fp32, or DeepSeek-style block-FP8 (weight_scale_inv 128x128, decoded
with --fp8-decode and re-quantized: bf16, the default, is the BF16 checkpoint DeepSeek's fp8_cast_bf16 writes,
the one the recipes train from; fp32 keeps the fp32 product). Check the result with `miles-lp verify OUT --source IN`.

formats:
  mxfp8                  every linear layer MXFP8 (E4M3 + E8M0 per 32)
  nvfp4-experts          MoE expert GEMMs NVFP4, the rest BF16
  mxfp8+nvfp4-experts    experts NVFP4, other linear layers MXFP8
targets (CONTRACT 4):
  sglang                 `mxfp8` config / ModelOpt NVFP4 (+ hf_quant_config.json) / modelopt_mixed
  vllm                   ModelOpt MXFP8 / NVFP4 / MIXED_PRECISION (mixed plans) with ModelOpt names
                         (MXFP8 scale named weight_scale); vLLM CPU needs the miles_lp plugin (docs/converter.md)
  compressed-tensors     config_groups (mxfp8-quantized, nvfp4-pack-quantized, mixed-precision),
                         quantization_status "compressed"; NVFP4 W4A4 with input_global_scale
"""

FORMATS = ("mxfp8", "nvfp4-experts", "mxfp8+nvfp4-experts")
TARGETS = ("sglang", "vllm", "compressed-tensors")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'500MB' -> 500_000_000 (decimal units as Hugging Face; KiB/MiB/GiB binary)."""
    from miles_lp.errors import ConfigError

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, flags=re.IGNORECASE)
    n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()]) if m else 0
    if n < 1:  # "0.5B" parses but is no byte at all
        raise ConfigError(f"--max-shard-size: cannot read '{text}' as a size of at least one byte; use e.g. 500MB, "
                          "5GB or 2GiB")
    return n


def add_arguments(p) -> None:
    p.add_argument("--hf-checkpoint", required=True, metavar="IN", help="input HF checkpoint folder")
    p.add_argument("--output", required=True, metavar="OUT", help="output folder (written atomically)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--recipe", metavar="R.yaml", help="recipe whose `precision:` section is the policy")
    src.add_argument("--format", choices=FORMATS, help="build the policy from flags: which tensors get which format")
    p.add_argument("--num-layers-at-start-in-bf16", type=int, default=0, metavar="N",
                   help="keep the first N decoder layers BF16 (with --format)")
    p.add_argument("--num-layers-at-end-in-bf16", type=int, default=0, metavar="N",
                   help="keep the last N decoder layers BF16 (with --format)")
    p.add_argument("--bf16-pattern", "--extra-high-precision-layers-hf", dest="bf16_patterns", action="append",
                   default=[], metavar="PAT",
                   help="keep tensors matching PAT BF16 (repeatable; with --format). PAT is a glob or re: regex "
                        "over the WHOLE tensor or module name (Miles' substrings: write '*SUBSTR*'). "
                        "--extra-high-precision-layers-hf is Miles' name for the same option")
    p.add_argument("--target", choices=TARGETS, default="sglang", help="engine naming and config (default sglang)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to quantize (default cpu)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT (a checkpoint folder, or an empty one) once the new one "
                   "is complete")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="convert tensors holding NaN/inf instead of refusing (they are listed)")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="output shard size limit, e.g. 2GB (default: the largest input shard)")
    p.add_argument("--fp8-decode", choices=("bf16", "fp32"), default="bf16",
                   help="block-FP8 inputs only: decode to bf16(fp32(q) * s) (default: equals converting the BF16 "
                        "checkpoint DeepSeek's fp8_cast_bf16 writes, which the learner starts from) or to fp32(q) * s "
                        "(one rounding per element; another MXFP8 grid). Recorded; verify follows it")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_policy(args):
    """The policy from --recipe or from the flags (never both)."""
    from miles_lp.errors import ConfigError
    from miles_lp.policy import load_policy

    if args.recipe:
        given = [flag for flag, value in (("--num-layers-at-start-in-bf16", args.num_layers_at_start_in_bf16),
                                          ("--num-layers-at-end-in-bf16", args.num_layers_at_end_in_bf16),
                                          ("--bf16-pattern", args.bf16_patterns)) if value]
        if given:
            raise ConfigError(f"{given[0]} builds a policy from flags and cannot be combined with --recipe; "
                              "put the exception in the recipe's precision: section instead")
        return load_policy(args.recipe, section="precision")
    for flag, value in (("--num-layers-at-start-in-bf16", args.num_layers_at_start_in_bf16),
                        ("--num-layers-at-end-in-bf16", args.num_layers_at_end_in_bf16)):
        if value < 0:
            raise ConfigError(f"{flag} must be >= 0, got {value}")
    return policy_for_format(args.format, args.num_layers_at_start_in_bf16, args.num_layers_at_end_in_bf16,
                             tuple(args.bf16_patterns))


def check_layer_flags(args) -> None:
    """``--num-layers-at-*-in-bf16`` against the model's layer count, named by flag (the plan's error
    described a ``first N`` rule the user never wrote)."""
    from miles_lp.errors import CheckpointError, ConfigError
    from miles_lp.io.validate import read_config

    start, end = args.num_layers_at_start_in_bf16, args.num_layers_at_end_in_bf16
    if args.recipe or not (start or end):
        return
    try:
        n = int(read_config(args.hf_checkpoint)["num_hidden_layers"])
    except (CheckpointError, KeyError, TypeError, ValueError):
        return  # the converter's own checks name a missing or odd config.json
    for flag, value in (("--num-layers-at-start-in-bf16", start), ("--num-layers-at-end-in-bf16", end)):
        if value > n:
            raise ConfigError(f"{flag} {value}: {args.hf_checkpoint} has {n} layers; pass at most {n}")


def run(args) -> int:
    from miles_lp.checkpoint.convert import convert_checkpoint

    check_layer_flags(args)
    policy = build_policy(args)
    max_shard = parse_size(args.max_shard_size) if args.max_shard_size else None
    summary = convert_checkpoint(args.hf_checkpoint, args.output, policy, target=args.target, device=args.device,
                                 overwrite=args.overwrite, allow_nonfinite=args.allow_nonfinite,
                                 max_shard_bytes=max_shard, progress=not args.no_progress,
                                 fp8_decode=args.fp8_decode)
    print("converted:")
    print(summary.table())
    print(f"next: miles-lp verify {summary.out} --source {args.hf_checkpoint}")
    return 0
