"""`miles-lp verify` passes on good output and fails, naming the problem, on each tampered variant."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_lp.checkpoint.safetensors_io import INDEX_NAME
from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.cli import main


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("v")
    src = make_tiny_model("qwen3_moe", root / "src", seed=4, max_shard_size="200KB")
    outs = {}
    for fmt, target in (("mxfp8", "sglang"), ("nvfp4-experts", "sglang"),
                        ("mxfp8+nvfp4-experts", "compressed-tensors")):
        out = root / f"{fmt}-{target}"
        assert main(["convert", "--hf-checkpoint", str(src), "--output", str(out), "--format", fmt, "--target",
                     target, "--num-layers-at-start-in-bf16", "1", "--no-progress"]) == 0
        outs[(fmt, target)] = out
    return src, outs


@pytest.fixture
def copy(good, tmp_path):
    src, outs = good

    def make(fmt="mxfp8", target="sglang"):
        dst = tmp_path / "out"
        shutil.copytree(outs[(fmt, target)], dst)
        return src, dst
    return make


def verify(capsys, out, src=None):
    rc = main(["verify", str(out), *(["--source", str(src)] if src else [])])
    return rc, capsys.readouterr().out


def _edit_tensor(out, name, fn):
    idx = json.loads((out / INDEX_NAME).read_text())
    shard = out / idx["weight_map"][name]
    t = load_file(shard)
    fn(t)
    save_file(t, str(shard), metadata={"format": "pt"})
    return idx, shard, t


@pytest.mark.parametrize("key", [("mxfp8", "sglang"), ("nvfp4-experts", "sglang"),
                                 ("mxfp8+nvfp4-experts", "compressed-tensors")])
def test_good_output_passes(capsys, good, key):
    src, outs = good
    rc, text = verify(capsys, outs[key], src)
    assert rc == 0 and "result: OK" in text and "FAIL" not in text
    rc, text = verify(capsys, outs[key])  # without --source: the source checks say why they skip
    assert rc == 0 and text.count("[skip]") == 3 and "no --source given" in text


@pytest.mark.parametrize("fmt,name", [("mxfp8", "model.layers.2.self_attn.q_proj.weight_scale_inv"),  # E8M0
                                      ("nvfp4-experts", "model.layers.2.mlp.experts.1.up_proj.weight_scale")])
def test_flipped_scale_byte(capsys, copy, fmt, name):
    src, out = copy(fmt)

    def flip(t):
        t[name] = t[name].clone()
        b = t[name].view(torch.uint8).view(-1)
        b[3] ^= 0x01
    _edit_tensor(out, name, flip)
    rc, text = verify(capsys, out, src)
    assert rc == 1 and "[FAIL] grid" in text and f"'{name}': 1 bytes differ" in text


def test_missing_tensor(capsys, copy):
    src, out = copy()
    name = "model.layers.3.mlp.experts.0.down_proj.weight_scale_inv"
    idx, shard, _ = _edit_tensor(out, name, lambda t: t.pop(name))
    del idx["weight_map"][name]
    (out / INDEX_NAME).write_text(json.dumps(idx))
    rc, text = verify(capsys, out)
    assert rc == 1 and "[FAIL] tensors" in text and f"missing tensor '{name}'" in text


def test_index_out_of_sync(capsys, copy):
    src, out = copy()
    name = "model.layers.3.mlp.experts.0.down_proj.weight_scale_inv"
    _edit_tensor(out, name, lambda t: t.pop(name))  # index still names it
    rc, text = verify(capsys, out)
    assert rc == 1 and "[FAIL] index" in text and name in text and "[skip] tensors" in text


def test_wrong_skip_list(capsys, copy):
    """Drop the BF16 layer 0 from modules_to_not_convert: SGLang would quantize it (C1)."""
    src, out = copy()
    cfg = json.loads((out / "config.json").read_text())
    skip = cfg["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.0." in skip
    skip.remove("model.layers.0.")
    (out / "config.json").write_text(json.dumps(cfg))
    rc, text = verify(capsys, out)
    assert rc == 1 and "[FAIL] config" in text
    assert re.search(r"C1: the engine would load 'model\.layers\.0\.[a-z_.0-9]+\.weight' as mxfp8, the plan says bf16",
                     text)


def test_wrong_modelopt_exclude_in_hf_quant_config(capsys, copy):
    src, out = copy("nvfp4-experts")
    hf = json.loads((out / "hf_quant_config.json").read_text())
    hf["quantization"]["exclude_modules"] = [m for m in hf["quantization"]["exclude_modules"]
                                             if "layers.0." not in m]
    (out / "hf_quant_config.json").write_text(json.dumps(hf))
    rc, text = verify(capsys, out)
    assert rc == 1 and "[FAIL] config" in text and "hf_quant_config.json" in text


@pytest.mark.parametrize("fmt,name,what", [
    ("mxfp8", "model.layers.1.self_attn.o_proj.weight_scale_inv", "E8M0 scale bytes are 0xFF (NaN)"),
    ("nvfp4-experts", "model.layers.1.mlp.experts.0.gate_proj.weight_scale", "E4M3 scales are NaN"),
    ("nvfp4-experts", "model.layers.1.mlp.experts.0.gate_proj.weight_scale_2", "global scale must be finite"),
])
def test_nan_in_scale(capsys, copy, fmt, name, what):
    src, out = copy(fmt)

    def poison(t):
        t[name] = t[name].clone()
        if t[name].dtype == torch.uint8:
            t[name].view(-1)[0] = 0xFF
        elif t[name].dtype == torch.float8_e4m3fn:
            t[name].view(torch.uint8).view(-1)[0] = 0x7F
        else:
            t[name].fill_(float("nan"))
    _edit_tensor(out, name, poison)
    rc, text = verify(capsys, out)
    assert rc == 1 and "[FAIL] scales" in text and f"'{name}': " in text and what in text


def test_wrong_dtype_and_edited_plan(capsys, copy):
    src, out = copy()
    name = "model.layers.2.self_attn.k_proj.weight"
    _edit_tensor(out, name, lambda t: t.__setitem__(name, t[name].to(torch.bfloat16)))
    rc, text = verify(capsys, out)
    assert rc == 1 and f"'{name}' is BF16" in text and "needs F8_E4M3" in text
    rec = json.loads((out / "miles_lp_plan.json").read_text())
    rec["plan_hash"] = "0" * 64
    (out / "miles_lp_plan.json").write_text(json.dumps(rec))
    rc, text = verify(capsys, out)
    assert rc == 1 and "[FAIL] record" in text and "was edited" in text


def test_wrong_source(capsys, copy, tmp_path):
    src, out = copy()
    other = make_tiny_model("qwen3_moe", tmp_path / "other", seed=99)
    rc, text = verify(capsys, out, other)
    assert rc == 1 and "[FAIL] source" in text and "is not the checkpoint that was converted" in text
    assert "[FAIL] grid" in text


def test_not_a_converted_checkpoint(capsys, good):
    src, _ = good
    rc, text = verify(capsys, src)
    assert rc == 1 and "no miles_lp_plan.json" in text and "[skip] tensors" in text
