"""``miles-lp make-tiny-model``: a small random-weight Hugging Face checkpoint, built locally."""

from __future__ import annotations

from miles_lp.checkpoint.tiny import ARCHS

HELP = "write a tiny random-weight HF checkpoint (no hub access) for smoke tests"
DESCRIPTION = HELP + (
    "\n\nEvery reduction dimension is a multiple of 32, so every format can hold every linear layer. "
    "Use --max-shard-size to get a multi-shard checkpoint (e.g. 200KB). The folder is written atomically: "
    "an interrupted run leaves nothing behind."
)


def add_arguments(p) -> None:
    p.add_argument("--arch", required=True, choices=ARCHS, help="model architecture (HF model_type)")
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty, unless --overwrite)")
    p.add_argument("--seed", type=int, default=0, help="torch seed for the random weights (default 0)")
    p.add_argument("--num-layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="weight dtype (default bfloat16)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="shard size limit passed to save_pretrained, e.g. 200KB (default 5GB: one shard)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --out")


def run(args) -> int:
    from pathlib import Path

    from miles_lp.checkpoint.tiny import make_tiny_model
    from miles_lp.errors import ConfigError
    from miles_lp.io.atomic import atomic_output_dir

    if args.num_layers < 1:
        raise ConfigError(f"--num-layers must be >= 1, got {args.num_layers}")
    from miles_lp.cli.convert import parse_size

    # "banana": one line naming the flag, not transformers' ValueError; the bytes, not the text, go to
    # save_pretrained (it reads "1" as an unknown unit where we read one byte)
    shard_bytes = parse_size(args.max_shard_size)
    out = Path(args.out)
    empty_dir = out.is_dir() and not any(out.iterdir())
    with atomic_output_dir(out, overwrite=args.overwrite or empty_dir, flag="--out") as tmp:
        make_tiny_model(args.arch, tmp, seed=args.seed, num_layers=args.num_layers, dtype=args.dtype,
                        max_shard_size=shard_bytes)
    files = sorted(p.name for p in out.iterdir())
    print(f"wrote tiny {args.arch} ({args.num_layers} layers, {args.dtype}, seed {args.seed}) to {out}: "
          f"{', '.join(files)}")
    return 0
