"""`convert --fp8-decode`: a block-FP8 input decoded to bf16 (the default) converts to exactly what the
BF16 checkpoint DeepSeek's fp8_cast_bf16 writes converts to (the checkpoint the recipes train from: the learner's
initial grid); decoded to fp32 it is another grid. `verify` follows the mode the record names."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.checkpoint.verify import verify_checkpoint
from miles_lp.cli import main
from miles_lp.io.safetensors_io import INDEX_NAME
from tests.e2e.test_convert import _to_block_fp8

PLAN = "miles_lp_plan.json"


def fp8_cast_bf16(src, dst):
    """DeepSeek's inference/fp8_cast_bf16.py, written out: y = bf16(fp32(q) * s) per 128x128 tile; the scales
    dropped; quantization_config removed."""
    dst.mkdir()
    wm = {}
    for f in sorted(src.glob("*.safetensors")):
        sd = load_file(f)
        out = {}
        for name, t in sd.items():
            if name.endswith("_scale_inv"):
                continue
            if t.dtype == torch.float8_e4m3fn:
                s = sd[name + "_scale_inv"].float().repeat_interleave(128, 0).repeat_interleave(128, 1)
                t = (t.float() * s[: t.shape[0], : t.shape[1]]).to(torch.bfloat16)
            out[name] = t
        save_file(out, str(dst / f.name), metadata={"format": "pt"})
        wm.update({k: f.name for k in out})
    (dst / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg))


def _tensors(out):
    sd = {}
    for f in sorted(out.glob("*.safetensors")):
        sd.update(load_file(f))
    return sd


def _n_diff(a, b):
    return int((a.reshape(-1).view(torch.uint8) != b.reshape(-1).view(torch.uint8)).sum())


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8dec")
    base = make_tiny_model("deepseek_v3", root / "base", seed=4)
    _to_block_fp8(base, root / "fp8")
    fp8_cast_bf16(root / "fp8", root / "bf16")
    outs = {}
    for key, src, flags in (("bf16_ckpt", "bf16", []), ("default", "fp8", []),
                            ("fp32", "fp8", ["--fp8-decode", "fp32"])):
        outs[key] = root / f"out-{key}"
        assert main(["convert", "--hf-checkpoint", str(root / src), "--output", str(outs[key]), "--format",
                     "mxfp8", "--no-progress", *flags]) == 0
    return root, outs


def test_default_bf16_decode_equals_converting_the_bf16_checkpoint(ckpts):
    _, outs = ckpts
    a, b = _tensors(outs["default"]), _tensors(outs["bf16_ckpt"])
    assert a.keys() == b.keys()
    bad = [n for n in a if a[n].dtype != b[n].dtype or _n_diff(a[n], b[n])]
    assert not bad, bad[:5]
    assert json.loads((outs["default"] / PLAN).read_text())["source"]["fp8_decode"] == "bf16"
    for key in ("default", "bf16_ckpt"):
        assert (json.loads((outs[key] / "config.json").read_text())["quantization_config"]
                == json.loads((outs["bf16_ckpt"] / "config.json").read_text())["quantization_config"])


def test_fp32_decode_is_another_grid_and_both_verify(ckpts):
    root, outs = ckpts
    a, b = _tensors(outs["fp32"]), _tensors(outs["default"])
    diff = sum(_n_diff(a[n], b[n]) for n in a if n.endswith(".weight") and a[n].dtype == torch.float8_e4m3fn)
    assert diff > 0  # MXFP8 of fp32(q) * s is not MXFP8 of its bf16 rounding
    assert json.loads((outs["fp32"] / PLAN).read_text())["source"]["fp8_decode"] == "fp32"
    for key in ("default", "fp32"):
        report = verify_checkpoint(outs[key], source=root / "fp8")
        assert report.ok, report.format()


def test_verify_follows_the_recorded_decode(ckpts, tmp_path):
    import shutil

    root, outs = ckpts
    out = tmp_path / "o"
    shutil.copytree(outs["default"], out)
    rec = json.loads((out / PLAN).read_text())
    rec["source"]["fp8_decode"] = "fp32"  # a record that lies about the decode: the grid no longer matches
    (out / PLAN).write_text(json.dumps(rec))
    report = verify_checkpoint(out, source=root / "fp8")
    grid = next(c for c in report.checks if c.check == "grid")
    assert not report.ok and grid.verdict == "FAIL" and "bytes differ" in grid.detail
    rec["source"]["fp8_decode"] = "fp16"
    (out / PLAN).write_text(json.dumps(rec))
    record = verify_checkpoint(out).checks[0]
    assert record.verdict == "FAIL" and "fp8_decode 'fp16' is not bf16 or fp32" in record.detail


def test_bad_fp8_decode_value_is_refused(ckpts, tmp_path):
    from miles_lp.checkpoint.convert import convert_checkpoint
    from miles_lp.errors import ConfigError
    from miles_lp.policy import policy_from_flags

    root, _ = ckpts
    with pytest.raises(ConfigError, match=r"--fp8-decode must be one of bf16, fp32, got 'fp16'"):
        convert_checkpoint(root / "fp8", tmp_path / "x", policy_from_flags("mxfp8"), fp8_decode="fp16",
                           progress=False)
    assert not (tmp_path / "x").exists()


def test_verify_recipe_mode_decodes_a_block_fp8_source_per_flag(ckpts, tmp_path):
    """Without a record (verify --recipe), --fp8-decode says how the source is decoded: the default (bf16, as
    convert) passes the default conversion, fp32 names its grid as off."""
    import shutil

    root, outs = ckpts
    out = tmp_path / "o"
    shutil.copytree(outs["default"], out)
    (out / PLAN).unlink()
    recipe = tmp_path / "r.yaml"
    recipe.write_text("precision:\n  default: mxfp8\n")
    base = ["verify", str(out), "--recipe", str(recipe), "--target", "sglang", "--source", str(root / "fp8")]
    assert main(base) == 0
    assert main([*base, "--fp8-decode", "fp32"]) == 1
    from miles_lp.policy import load_policy

    report = verify_checkpoint(out, source=root / "fp8", policy=load_policy(recipe), target="sglang",
                               fp8_decode="fp32")
    assert {c.check: c.verdict for c in report.checks if c.verdict == "FAIL"} == {"grid": "FAIL"}, report.format()
