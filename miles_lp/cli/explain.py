"""`miles-lp explain`: which tensor gets which format, and which rule decided."""

from __future__ import annotations

HELP = "show the precision plan of a recipe on a model: formats per layer range and role, totals, warnings"
DESCRIPTION = """\
Compile the recipe's `precision:` section against a model and print, grouped by contiguous layer range and
role, each tensor group's format and the rule that decided it; totals of parameters and bytes per format with
the compression ratio; and warnings (rules that match nothing, rules shadowed by an earlier rule).

  miles-lp explain recipes/policies/deepseek-v3-mxfp8.yaml --model tests/fixtures/deepseek_v3_config.json
  miles-lp explain recipes/policies/qwen3-moe-mxfp8-nvfp4-experts.yaml --model /tmp/tiny --json
  miles-lp explain recipes/policies/deepseek-v3-mxfp8.yaml --model tests/fixtures/deepseek_v3_config.json --mtp --plot plan.png

--model is a directory holding config.json (names and shapes come from its safetensors headers when
present, else from the config) or a config.json path.
"""


def add_arguments(p) -> None:
    p.add_argument("recipe", help="recipe YAML with a `precision:` section")
    p.add_argument("--model", required=True, help="model directory (config.json [+ *.safetensors]) or config.json")
    p.add_argument("--json", action="store_true", help="print the machine-readable report")
    p.add_argument("--mtp", action="store_true",
                   help="include DeepSeek multi-token-prediction layers when synthesizing names from a config")
    p.add_argument("--save-plan", metavar="PATH", help="also write plan.json to PATH")
    p.add_argument("--plot", metavar="PNG", help="also draw the plan as a grid (decoder layer x role, colour = "
                   "format) into the PNG file PNG (needs matplotlib)")


def run(args) -> int:
    import json
    from pathlib import Path

    from miles_lp.io.validate import load_model_layout
    from miles_lp.policy import compile_plan, load_policy
    from miles_lp.policy.explain import explain_plan, format_explain

    _refuse_quantized(Path(args.model))
    policy = load_policy(args.recipe)
    layout, tensors, source = load_model_layout(args.model, include_mtp=args.mtp)
    plan = compile_plan(policy, layout, tensors)
    report = explain_plan(plan)
    if args.save_plan:
        _save_plan(plan, Path(args.save_plan))
    if args.plot:
        _plot(plan, args.plot, args.recipe)
    if args.json:
        print(json.dumps(report, indent=1, sort_keys=True))
    else:
        print(format_explain(report, source))
    return 0


def _refuse_quantized(model) -> None:
    """A converted checkpoint's packed shapes and scale tensors make a plan of it meaningless: refuse
    as convert does, and say where its own plan is."""
    import json

    from miles_lp.errors import ConfigError
    from miles_lp.io.validate import already_quantized

    cfg = model / "config.json" if model.is_dir() else model
    try:
        config = json.loads(cfg.read_text())
        quantized = already_quantized(config) if isinstance(config, dict) else None
    except (OSError, ValueError, AttributeError):
        return  # load_model_layout reports a missing or bad config.json
    if quantized is None:  # not quantized, or DeepSeek-style block FP8, which convert reads (decoded)
        return
    where = model if model.is_dir() else model.parent
    record = where / "miles_lp_plan.json"
    hint = (f"its plan is recorded in {record} (`miles-lp verify {where}` checks it)" if record.exists() else
            "explain the recipe against the BF16 / FP16 / FP32 model it was made from")
    raise ConfigError(f"--model {model}: an already-quantized checkpoint (quant_method={quantized[0]!r}): its packed "
                      f"shapes and scale tensors are not a model to plan; {hint}")


def _plot(plan, png: str, recipe: str) -> None:
    import sys

    from miles_lp.errors import BackendUnavailable

    try:
        import matplotlib  # noqa: F401

        from miles_lp.policy.plot import plot_plan
    except ModuleNotFoundError as exc:
        raise BackendUnavailable(f"--plot needs matplotlib ({exc}); install it or drop --plot") from None
    plot_plan(plan, png, title=f"precision plan of {recipe}")
    print(f"plot written to {png}", file=sys.stderr)  # stderr: keeps --json output parseable


def _save_plan(plan, path) -> None:
    """plan.json through a temporary name and a rename (never a half-written plan)."""
    import os

    from miles_lp.errors import ConfigError

    if not path.parent.is_dir():
        raise ConfigError(f"--save-plan {path}: the folder {path.parent} does not exist; create it or choose another "
                          "path")
    if path.is_dir():
        raise ConfigError(f"--save-plan {path} is a folder; name a file, e.g. {path / 'plan.json'}")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(plan.to_json())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
