"""`verify`'s config check compares the scheme fields each engine's reader uses, not only the format per weight:
a compressed-tensors group with ``group_size: 64`` / ``num_bits: 8`` or ModelOpt NVFP4 experts with
``group_size: 32`` select the plan's formats, but the reader then lays the scales out differently (the
compressed-tensors package fails to decompress them). Each edit FAILs ``config``, with our record and without it
(``--recipe``); fields the readers do not use, or leave at their defaults, stay a note without a record."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.checkpoint.verify import verify_checkpoint
from miles_lp.cli import main
from miles_lp.policy import load_policy, policy_from_flags

ROOT = Path(__file__).resolve().parents[2]
MIXED = str(ROOT / "recipes" / "policies/qwen3-moe-mxfp8-nvfp4-experts.yaml")
NVFP4_ONLY = str(ROOT / "recipes" / "policies/qwen3-moe-nvfp4-experts.yaml")  # SGLang: modelopt NVFP4 + hf_quant_config
PLAN = "miles_lp_plan.json"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("vs")
    src = make_tiny_model("qwen3_moe", root / "src", seed=6)
    outs = {}
    for key, target, policy in (("ct", "compressed-tensors", ["--recipe", MIXED]),
                                ("sglang-mixed", "sglang", ["--recipe", MIXED]),
                                ("vllm-mixed", "vllm", ["--recipe", MIXED]),
                                ("sglang-nvfp4", "sglang", ["--recipe", NVFP4_ONLY]),
                                ("vllm-nvfp4", "vllm", ["--recipe", NVFP4_ONLY]),
                                ("sglang-mxfp8", "sglang", ["--format", "mxfp8"])):
        out = root / key
        assert main(["convert", "--hf-checkpoint", str(src), "--output", str(out), *policy, "--target", target,
                     "--no-progress"]) == 0
        outs[key] = (out, target, policy)
    return src, outs


def _config_check(out: Path, target: str, policy: list[str], with_record: bool):
    if with_record:
        report = verify_checkpoint(out)
    else:
        (out / PLAN).unlink(missing_ok=True)
        if policy[0] == "--recipe":
            pol, name = load_policy(policy[1]), policy[1]
        else:  # --format mxfp8: the policy convert builds from the flag
            pol, name = policy_from_flags(policy[1]), "--format " + policy[1]
        report = verify_checkpoint(out, policy=pol, target=target, recipe_name=name)
    return report, next(c for c in report.checks if c.check == "config")


def _edited(made, tmp_path, key, edit, fname="config.json"):
    _, outs = made
    out, target, policy = outs[key]
    dst = tmp_path / key
    shutil.copytree(out, dst)
    doc = json.loads((dst / fname).read_text())
    edit(doc.get("quantization_config", doc))
    (dst / fname).write_text(json.dumps(doc, indent=2))
    return dst, target, policy


def _groups(qc, fmt):
    return [g for g in qc["config_groups"].values() if g["format"] == fmt]


def _ct_reviewer_edit(qc):
    for g in qc["config_groups"].values():
        g["weights"]["group_size"] = 64
    _groups(qc, "nvfp4-pack-quantized")[0]["weights"]["num_bits"] = 8


def _mixed_nvfp4_group(size):
    def edit(qc):
        for entry in qc["quantized_layers"].values():
            if entry["quant_algo"] == "NVFP4":
                entry["group_size"] = size
    return edit


def _set(path, value, fmt=None):
    """Set ``a.b.c`` in the config (or, with ``fmt``, in that format's compressed-tensors group); None: delete."""
    def edit(qc):
        node = _groups(qc, fmt)[0] if fmt else qc
        *parents, last = path.split(".")
        for p in parents:
            node = node[p]
        if value is None:
            del node[last]
        else:
            node[last] = value
    return edit


def _mxfp8_entry_group(qc):
    next(e for e in qc["quantized_layers"].values() if e["quant_algo"] == "MXFP8")["group_size"] = 16


FAILING = [
    # compressed-tensors: a user's edit, then one field each of what vLLM's scheme selection and the
    # package's compressors read
    ("ct", _ct_reviewer_edit, "config.json",
     [r"C1: config_groups\.group_\d\.weights\.num_bits is 8, the plan's nvfp4 scheme has 4: the engine would read "
      r"36 weight\(s\)", r"config_groups\.group_\d\.weights\.group_size is 64, the plan's nvfp4 scheme has 16",
      r"config_groups\.group_\d\.weights\.group_size is 64, the plan's mxfp8 scheme has 32"]),
    ("ct", _set("weights.strategy", "group", "nvfp4-pack-quantized"), "config.json",
     [r"weights\.strategy is \"group\", the plan's nvfp4 scheme has \"tensor_group\""]),
    ("ct", _set("input_activations", None, "nvfp4-pack-quantized"), "config.json",  # W4A16 instead of W4A4
     [r"input_activations is \(null\), the plan's nvfp4 scheme has \(set\)"]),
    ("ct", _set("weights.scale_dtype", None, "mxfp8-quantized"), "config.json",  # vLLM's _is_mxfp8 needs uint8
     [r"weights\.scale_dtype is null, the plan's mxfp8 scheme has \"uint8\""]),
    ("ct", _set("weights.symmetric", False, "mxfp8-quantized"), "config.json",
     [r"weights\.symmetric is false"]),
    ("ct", _set("format", "float-quantized", "mxfp8-quantized"), "config.json",
     [r"format 'float-quantized' is not mxfp8-quantized / nvfp4-pack-quantized"]),
    ("ct", _set("quantization_status", None), "config.json",  # transformers: weights still to be quantized
     [r"quantization_status is \"initialized\", the plan's \w+ scheme has \"compressed\""]),
    # ModelOpt: quant_algo + group_size
    ("sglang-mixed", _mixed_nvfp4_group(32), "config.json",
     [r"quantized_layers\['model\.layers\.\d\.mlp\.experts\.\d\.\w+'\]\.group_size \(and 35 more such entries\) is "
      r"32, the plan's nvfp4 scheme has 16: the engine would read 36 weight\(s\)"]),
    ("sglang-mixed", _mxfp8_entry_group, "config.json", [r"group_size is 16, the plan's mxfp8 scheme has 32"]),
    ("vllm-mixed", _mixed_nvfp4_group(32), "config.json",
     [r"the first NVFP4 entry: vLLM sizes every NVFP4 module with it\) is 32"]),
    ("vllm-mixed", _set("group_size", 32), "config.json",
     [r"C1: group_size \(vLLM sizes every NVFP4 module with it\) is 32, the plan's nvfp4 scheme has 16"]),
    ("sglang-nvfp4", _set("group_size", 32), "config.json",
     [r"C1: group_size is 32, the plan's nvfp4 scheme has 16"]),
    ("sglang-nvfp4", _set("group_size", None), "config.json",  # SGLang's ModelOptFp4Config raises without it
     [r"C1: group_size is \(absent\), the plan's nvfp4 scheme has 16"]),
    ("vllm-nvfp4", _set("group_size", 64), "config.json", [r"C1: group_size is 64, the plan's nvfp4 scheme has 16"]),
    ("sglang-nvfp4", _set("quantization.group_size", 32), "hf_quant_config.json",
     [r"C1: hf_quant_config\.json quantization\.group_size is 32, the plan's nvfp4 scheme has 16"]),
    # SGLang mxfp8: weight_block_size, scale_fmt, fmt, activation_scheme
    ("sglang-mxfp8", _set("weight_block_size", [128, 128]), "config.json",
     [r"C1: weight_block_size is \[128, 128\], the plan's mxfp8 scheme has \[1, 32\]"]),
    ("sglang-mxfp8", _set("scale_fmt", None), "config.json",
     [r"C1: scale_fmt is \(absent\), the plan's mxfp8 scheme has \"ue8m0\""]),
    ("sglang-mxfp8", _set("fmt", "e5m2"), "config.json", [r"C1: fmt is \"e5m2\", the plan's mxfp8 scheme has \"e4m3\""]),
    ("sglang-mxfp8", _set("activation_scheme", "static"), "config.json",
     [r"C1: activation_scheme is \"static\", the plan's mxfp8 scheme has \"dynamic\""]),
]


@pytest.mark.parametrize("with_record", [True, False], ids=["record", "recipe"])
@pytest.mark.parametrize("key,edit,fname,patterns", FAILING,
                         ids=[f"{k}-{i}" for i, (k, *_) in enumerate(FAILING)])
def test_a_scheme_field_the_engine_reads_differently_fails(made, tmp_path, key, edit, fname, patterns, with_record):
    out, target, policy = _edited(made, tmp_path, key, edit, fname)
    report, config = _config_check(out, target, policy, with_record)
    assert not report.ok and config.verdict == "FAIL", config.detail
    for pat in patterns:
        assert re.search(pat, config.detail), (pat, config.detail)


NEUTRAL = [  # what the readers do not use, or leave at their defaults: the engine reads the plan's scheme
    ("ct", _set("weights.strategy", None, "mxfp8-quantized")),  # inferred from group_size 32 -> group
    ("ct", _set("weights.symmetric", None, "nvfp4-pack-quantized")),  # default True
    ("ct", _set("weights.zp_dtype", None, "nvfp4-pack-quantized")),  # symmetric: no zero point
    ("ct", _set("weights.scale_dtype", "uint8", "mxfp8-quantized")),  # the package parses it as torch.uint8
    ("sglang-mxfp8", _set("weight_block_size", None)),  # SGLang's default [1, 32]
    ("sglang-mxfp8", _set("fmt", None)),  # not read by SGLang's Fp8Config
    ("vllm-nvfp4", _set("group_size", None)),  # vLLM's default 16
]


@pytest.mark.parametrize("key,edit", NEUTRAL, ids=[f"{k}-{i}" for i, (k, _) in enumerate(NEUTRAL)])
def test_fields_the_engine_reads_the_same_are_notes_without_a_record(made, tmp_path, key, edit):
    out, target, policy = _edited(made, tmp_path, key, edit)
    report, config = _config_check(out, target, policy, with_record=False)
    assert report.ok and config.verdict == "pass", config.detail
    assert "notes (not failures without a record)" in config.detail and "C1:" not in config.detail, config.detail


@pytest.mark.parametrize("key", ["ct", "sglang-mixed", "vllm-mixed", "sglang-nvfp4", "vllm-nvfp4", "sglang-mxfp8"])
def test_healthy_conversions_pass_both_ways(made, tmp_path, key):
    out, target, policy = _edited(made, tmp_path, key, lambda qc: None)
    for with_record in (True, False):
        report, config = _config_check(out, target, policy, with_record)
        assert report.ok and config.verdict == "pass", config.detail
        assert "notes" not in config.detail


def test_cli_exit_code_and_message(made, tmp_path, capsys):
    out, _, _ = _edited(made, tmp_path, "ct", _ct_reviewer_edit)
    assert main(["verify", str(out)]) == 1
    text = capsys.readouterr().out
    assert "[FAIL] config" in text and "weights.num_bits is 8, the plan's nvfp4 scheme has 4" in text
    (out / PLAN).unlink()
    assert main(["verify", str(out), "--recipe", MIXED, "--target", "compressed-tensors"]) == 1
    text = capsys.readouterr().out
    assert "[FAIL] config" in text and "result: FAILED" in text and "weights.group_size is 64" in text
