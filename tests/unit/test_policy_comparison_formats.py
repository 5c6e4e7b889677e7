"""fp8_tensor is a sampler_precision comparison-arm format only: a recipe's `precision:` section refuses it at parse
time with the key's file:line; the comparison arms still parse. fp8_block is a learner format
(tests/unit/test_policy_fp8_block.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from miles_lp.errors import ConfigError
from miles_lp.policy import load_policy
from miles_lp.policy.policy import COMPARISON_ONLY_NOTE

ROOT = Path(__file__).resolve().parents[2]
NOTE = re.escape(COMPARISON_ONLY_NOTE)
RECIPE_RUN = """\
model: {path: "tiny:qwen3", num_layers: 2, seed: 0}
precision:
  default: %s
steps: 1
"""


@pytest.mark.parametrize("fmt", ["fp8_tensor"])
def test_precision_default_refused_with_file_and_line(tmp_path, fmt):
    r = tmp_path / "r.yaml"
    r.write_text(f"precision:\n  backward: dequantized\n  default: {fmt}\n")
    with pytest.raises(ConfigError, match=rf"r.yaml:3: 'precision.default': {fmt} is not a precision: format "
                                          rf"\({NOTE}"):
        load_policy(r)


def test_precision_rule_refused_with_file_and_line(tmp_path):
    r = tmp_path / "r.yaml"
    r.write_text("precision:\n  default: mxfp8\n  rules:\n    - {role: attention, format: fp8_tensor}\n")
    with pytest.raises(ConfigError, match=rf"r.yaml:4: 'precision.rules.0.format': fp8_tensor is not a precision: "
                                          rf"format \({NOTE}"):
        load_policy(r)


def test_convert_recipe_refuses_fp8_naming_the_key(tmp_path, capsys):
    from miles_lp.checkpoint.tiny import make_tiny_model
    from miles_lp.cli import main

    src = make_tiny_model("qwen3", tmp_path / "m", seed=0)
    r = tmp_path / "r.yaml"
    r.write_text("precision:\n  default: fp8_tensor\n")
    rc = main(["convert", "--hf-checkpoint", str(src), "--output", str(tmp_path / "out"), "--recipe", str(r),
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "r.yaml:2: 'precision.default': fp8_tensor is not a precision: format" in err
    assert COMPARISON_ONLY_NOTE in err and not (tmp_path / "out").exists()


def test_run_recipe_and_set_override_refuse_fp8(tmp_path):
    from miles_lp.launch.recipe import load_recipe

    r = tmp_path / "run.yaml"
    r.write_text(RECIPE_RUN % "fp8_tensor")
    with pytest.raises(ConfigError, match=rf"run.yaml:3: 'precision.default': fp8_tensor .*{NOTE}"):
        load_recipe(r)
    r.write_text(RECIPE_RUN % "mxfp8")
    load_recipe(r)
    with pytest.raises(ConfigError, match=rf"--set precision.default=fp8_tensor: 'precision.default': fp8_tensor "
                                          rf"is not a precision: format \({NOTE}"):
        load_recipe(r, ["precision.default=fp8_tensor"])


@pytest.mark.parametrize("name", ["tiny-fp8-blockwise.yaml", "tiny-fp8-tensorwise.yaml"])
def test_comparison_arms_still_parse(name):
    from miles_lp.formats.spec import Format
    from miles_lp.launch.recipe import load_recipe

    recipe = load_recipe(ROOT / "recipes" / name)
    assert recipe.sampler_precision.default in (Format.FP8_BLOCK, Format.FP8_TENSOR)


@pytest.mark.parametrize("doc", ["README.md", "docs/precision_policy.md"])
def test_docs_say_comparison_arms_only(doc):
    lines = [ln for ln in (ROOT / doc).read_text().splitlines() if re.match(r"\s+default: mxfp8\s+#", ln)]
    assert lines and all(COMPARISON_ONLY_NOTE in ln for ln in lines), lines
