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


def test_element_outside_error_bound(capsys, copy):
    """A data byte pushed far from its value: both the grid and the independent error bound fail."""
    src, out = copy()
    name = "model.layers.2.self_attn.q_proj.weight"

    def bump(t):
        t[name] = t[name].clone()
        b = t[name].view(torch.uint8).view(-1)
        b[7] = 0x7E  # E4M3 448: the block's maximum, far above any element of this random weight's block
    _edit_tensor(out, name, bump)
    rc, text = verify(capsys, out, src)
    assert rc == 1 and "[FAIL] error" in text and f"'{name}': 1 elements outside the mxfp8 bound" in text
    assert "[FAIL] grid" in text


@pytest.mark.parametrize("fmt,name,value,what", [
    ("mxfp8", "model.layers.1.self_attn.o_proj.weight_scale_inv", 0xFE, "E8M0 scale bytes above 247"),
    ("nvfp4-experts", "model.layers.1.mlp.experts.0.gate_proj.weight_scale", -1.0, "E4M3 scales are negative"),
    ("nvfp4-experts", "model.layers.1.mlp.experts.0.gate_proj.weight_scale_2", 0.0, "global scale must be finite and > 0"),
    ("nvfp4-experts", "model.layers.1.mlp.experts.0.gate_proj.input_scale", 2.0, "must be 1.0"),
])
def test_scale_out_of_range(capsys, copy, fmt, name, value, what):
    src, out = copy(fmt)

    def poison(t):
        t[name] = t[name].clone()
        if t[name].dtype == torch.uint8:
            t[name].view(-1)[0] = value
        else:
            t[name].view(-1)[0] = value  # float8 / fp32 assignment converts
    _edit_tensor(out, name, poison)
    rc, text = verify(capsys, out)
    assert rc == 1 and "[FAIL] scales" in text and f"'{name}': " in text and what in text


def test_unexpected_tensor(capsys, copy):
    src, out = copy()
    name = "model.layers.2.self_attn.q_proj.weight_scale_inv"
    extra = "model.layers.2.self_attn.q_proj.bias"
    idx, shard, _ = _edit_tensor(out, name, lambda t: t.__setitem__(extra, torch.zeros(4)))
    idx["weight_map"][extra] = shard.name
    (out / INDEX_NAME).write_text(json.dumps(idx))
    rc, text = verify(capsys, out)
    assert rc == 1 and "[FAIL] tensors" in text and f"unexpected tensor '{extra}' (not in the plan)" in text


def test_kept_bf16_tensor_changed(capsys, copy):
    """A tensor the plan keeps BF16 (embedding) edited: only the byte comparison with --source sees it."""
    src, out = copy()
    name = "model.embed_tokens.weight"

    def nudge(t):
        t[name] = t[name].clone()
        t[name].view(torch.int16).view(-1)[5] ^= 1
    _edit_tensor(out, name, nudge)
    rc, text = verify(capsys, out)
    assert rc == 0  # headers, configs and scales cannot see it
    rc, text = verify(capsys, out, src)
    assert rc == 1 and "[FAIL] grid" in text and f"'{name}' (kept torch.bfloat16) differs from the source" in text


def test_unreadable_record(capsys, copy):
    src, out = copy()
    (out / "miles_lp_plan.json").write_text("{not json")
    rc, text = verify(capsys, out)
    assert rc == 1 and "[FAIL] record" in text and "miles_lp_plan.json or config.json is unreadable" in text
    assert "[skip] tensors" in text and "[skip] config" in text and "[skip] scales" in text


def test_allow_nonfinite_output_verifies_and_says_what_it_skipped(capsys, tmp_path):
    src = make_tiny_model("qwen3", tmp_path / "src", seed=3)
    name = "model.layers.2.mlp.up_proj.weight"
    shard = next(src.glob("*.safetensors"))
    t = load_file(shard)
    t[name] = t[name].clone()
    t[name][0, :32] = float("inf")  # a whole block of inf: E8M0 byte 0xFE
    save_file(t, str(shard), metadata={"format": "pt"})
    out = tmp_path / "out"
    with pytest.warns(UserWarning, match=name):
        assert main(["convert", "--hf-checkpoint", str(src), "--output", str(out), "--format", "mxfp8",
                     "--allow-nonfinite", "--no-progress"]) == 0
    capsys.readouterr()
    assert int(load_file(out / json.loads((out / INDEX_NAME).read_text())["weight_map"][
        name + "_scale_inv"])[name + "_scale_inv"][0, 0]) == 0xFE
    rc, text = verify(capsys, out, src)
    assert rc == 0, text
    assert "1 weights converted with --allow-nonfinite not checked" in text
    assert f"not checked (1, converted with --allow-nonfinite): {name}" in text
