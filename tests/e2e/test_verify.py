"""`miles-lp verify` passes on good output and fails, naming the problem, on each tampered variant.

The first and the last tensor of every kind (BF16, each quantized format's data, each scale tensor,
global and activation scales), the first and last entries of the config lists and of the index are tampered
and must be named; fused groups with separate global scales fail without and with --source; each error bound
fails just above itself and passes just below.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_lp.checkpoint import disk_layout
from miles_lp.checkpoint import verify as V
from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.cli import main
from miles_lp.formats import Format, oracle
from miles_lp.io.safetensors_io import INDEX_NAME, open_checkpoint


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("v")
    src = make_tiny_model("qwen3_moe", root / "src", seed=4, max_shard_size="200KB")
    outs = {}
    for fmt, target in (("mxfp8", "sglang"), ("nvfp4-experts", "sglang"),
                        ("mxfp8+nvfp4-experts", "compressed-tensors")):
        out = root / f"{fmt}-{target}"
        assert main(["convert", "--hf-checkpoint", str(src), "--output", str(out), "--format", fmt, "--target",
                     target, "--num-layers-at-start-in-bf16", "1", "--max-shard-size", "150KB", "--no-progress"]) == 0
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


# ---------------------------------------------------------------------------------------------------------
# first and last tensor of every kind, config and index entries, fused groups, bounds
# ---------------------------------------------------------------------------------------------------------
OUTPUTS = [("mxfp8", "sglang"), ("nvfp4-experts", "sglang"), ("mxfp8+nvfp4-experts", "compressed-tensors")]
_GLOBAL = ("weight_scale_2", "weight_global_scale")
_INPUT = ("input_scale", "input_global_scale")


def _kind(name: str, dtype: str) -> str:
    """A tensor's kind from its on-disk name and dtype only (CONTRACT 4; independent of verify's table)."""
    suffix = name.rsplit(".", 1)[1]
    if suffix in _GLOBAL:
        return "nvfp4 global scale"
    if suffix in _INPUT:
        return "activation scale"
    if dtype == "F8_E4M3":
        return "nvfp4 block scale (E4M3)" if suffix == "weight_scale" else "mxfp8 data (E4M3)"
    if dtype == "U8":
        return "mxfp8 scale (E8M0)" if suffix in ("weight_scale_inv", "weight_scale") else "nvfp4 data (E2M1)"
    return f"kept {dtype}"


def _first_and_last(src, out) -> dict[str, list[str]]:
    """{kind: names}: the first and last tensor of each kind in the output's storage order and in the source's
    tensor order (the order verify walks), so a loop that skips an end in either order is caught."""
    have = open_checkpoint(out).tensors
    record = json.loads((out / "miles_lp_plan.json").read_text())
    src_order = list(record["source"]["shapes"])
    by_src = {}
    for n in have:  # position of the source tensor an output tensor comes from
        base = n if n in record["source"]["shapes"] else n.rsplit(".", 1)[0] + ".weight"
        by_src[n] = src_order.index(base)
    kinds: dict[str, list[str]] = {}
    for n, h in have.items():
        kinds.setdefault(_kind(n, h.dtype), []).append(n)
    out_ = {}
    for k, names in kinds.items():
        in_src = sorted(names, key=lambda n: by_src[n])
        out_[k] = list(dict.fromkeys([names[0], names[-1], in_src[0], in_src[-1]]))
    return out_


def _tamper(out, names, fn):
    """Apply ``fn(tensor) -> tensor`` to each named tensor, shard by shard (headers and index stay valid)."""
    idx = json.loads((out / INDEX_NAME).read_text())
    for shard in {idx["weight_map"][n] for n in names}:
        t = load_file(out / shard)
        for n in names:
            if idx["weight_map"][n] == shard:
                t[n] = fn(t[n].clone())
        save_file(t, str(out / shard), metadata={"format": "pt"})


def _nudge(t):
    """Change one element by the smallest step of its storage: the low bit of its first byte (for fp32
    scalars: the next float)."""
    if t.dtype == torch.float32:
        return t.view(torch.int32).add(1).view(torch.float32)
    t.reshape(-1).view(torch.uint8)[0] ^= 0x01
    return t


def _details(report) -> dict[str, str]:
    return {c.check: c.detail for c in report.checks if c.verdict == "FAIL"}


def test_every_kind_is_present_in_the_outputs(good):
    src, outs = good
    kinds = set()
    for key in OUTPUTS:
        kinds |= set(_first_and_last(src, outs[key]))
    assert kinds == {"kept BF16", "mxfp8 data (E4M3)", "mxfp8 scale (E8M0)", "nvfp4 data (E2M1)",
                     "nvfp4 block scale (E4M3)", "nvfp4 global scale", "activation scale"}


@pytest.mark.parametrize("key", OUTPUTS, ids=["-".join(k) for k in OUTPUTS])
def test_first_and_last_tensor_of_every_kind_tampered_is_named(copy, key):
    """One step changed in the first and the last tensor of each kind: verify --source fails and names each
    (in `grid`; an activation scale in `scales`, which checks its defined value)."""
    src, out = copy(*key)
    pristine = out.parent / "pristine"
    shutil.copytree(out, pristine)
    for kind, names in _first_and_last(src, out).items():
        shutil.rmtree(out)
        shutil.copytree(pristine, out)
        _tamper(out, names, _nudge)
        report = V.verify_checkpoint(out, source=src)
        fails = _details(report)
        check = "scales" if kind == "activation scale" else "grid"
        assert check in fails, f"{kind}: {names} tampered, verify passed {check}:\n{report.format()}"
        for n in names:
            assert f"'{n}'" in fails[check], f"{kind}: '{n}' tampered but not named:\n{fails[check]}"


@pytest.mark.parametrize("key,fname,path", [
    (("mxfp8", "sglang"), "config.json", ("quantization_config", "modules_to_not_convert")),
    (("nvfp4-experts", "sglang"), "config.json", ("quantization_config", "ignore")),
    (("nvfp4-experts", "sglang"), "hf_quant_config.json", ("quantization", "exclude_modules")),
    (("mxfp8+nvfp4-experts", "compressed-tensors"), "config.json", ("quantization_config", "ignore")),
])
@pytest.mark.parametrize("end", [0, -1], ids=["first", "last"])
def test_first_and_last_config_entry_removed_is_named(copy, capsys, key, fname, path, end):
    src, out = copy(*key)
    cfg = json.loads((out / fname).read_text())
    lst = cfg[path[0]][path[1]]
    assert len(lst) >= 2
    removed = lst.pop(end)
    (out / fname).write_text(json.dumps(cfg))
    rc, text = verify(capsys, out)
    assert rc == 1 and "[FAIL] config" in text and removed in text, text


@pytest.mark.parametrize("end", [0, -1], ids=["first", "last"])
def test_first_and_last_index_entry_removed_or_misplaced_is_named(copy, capsys, end):
    src, out = copy("mxfp8", "sglang")
    idx = json.loads((out / INDEX_NAME).read_text())
    name = list(idx["weight_map"])[end]
    shard = idx["weight_map"].pop(name)
    (out / INDEX_NAME).write_text(json.dumps(idx))
    rc, text = verify(capsys, out)
    assert rc == 1 and "[FAIL] index" in text and f"'{name}'" in text
    others = sorted(set(idx["weight_map"].values()) - {shard})
    assert others, "the fixture must have several shards"
    idx["weight_map"][name] = others[0]  # named, but in the wrong shard
    (out / INDEX_NAME).write_text(json.dumps(idx))
    rc, text = verify(capsys, out)
    assert rc == 1 and "[FAIL] index" in text and f"'{name}'" in text


def _requantize(out, src, weights, target, amax_of):
    """Rewrite NVFP4 weights with the reference codec from the given amax (self-consistent bytes)."""
    from safetensors.torch import load_file as lf

    src_t = {}
    for f in src.glob("*.safetensors"):
        src_t.update(lf(f))
    new = {}
    for w in weights:
        new.update(V.expected_quantized(target, Format.NVFP4, w, src_t[w], amax=amax_of(w, src_t)))
    replacements = iter(new.values())
    _tamper(out, list(new), lambda t: next(replacements))


def _gate_up(out) -> tuple[str, str]:
    names = open_checkpoint(out).tensors
    gate = next(n for n in names if n.endswith("experts.1.gate_proj.weight_scale")).removesuffix("_scale")
    return gate, gate.replace("gate_proj", "up_proj")


@pytest.mark.parametrize("key", OUTPUTS[1:], ids=["sglang", "compressed-tensors"])
def test_gate_and_up_with_separate_global_scales_fail_without_and_with_source(copy, key):
    """The converter giving gate and up their own amax (a mutation): bytes self-consistent, so only
    the fused-group rule can see it: `scales` without --source, `grid` with it."""
    src, out = copy(*key)
    gate, up = _gate_up(out)
    _requantize(out, src, [gate, up], key[1], lambda w, t: oracle.nvfp4_amax(t[w]))
    report = V.verify_checkpoint(out)
    assert "fused group" in _details(report)["scales"] and "different NVFP4 global scales" in \
        _details(report)["scales"], report.format()
    report = V.verify_checkpoint(out, source=src)
    grid = _details(report)["grid"]
    assert "the NVFP4 global scale from its fused group's joint amax" in grid, grid
    assert "error" not in _details(report)  # a separate scale is accurate, just not what the engine fuses


def test_group_scale_from_a_larger_amax_fails_the_448_rule(copy):
    """Both shards share a global scale, but from twice the group amax: the largest block scale is 224, not
    448; without --source `scales` says the global scale is not the scope's amax / 2688."""
    src, out = copy("nvfp4-experts", "sglang")
    gate, up = _gate_up(out)
    _requantize(out, src, [gate, up], "sglang", lambda w, t: 2 * oracle.nvfp4_amax(t[gate], t[up]))
    detail = _details(V.verify_checkpoint(out))["scales"]
    assert "the largest E4M3 block scale is byte 0x76, not 0x7e (448)" in detail and "amax / 2688" in detail


def test_ct_w4a4_needs_input_global_scale(copy):
    """A compressed-tensors NVFP4 group declaring input_activations (W4A4) needs `input_global_scale`; verify
    fails when it is absent."""
    src, out = copy("mxfp8+nvfp4-experts", "compressed-tensors")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert disk_layout.ct_needs_input_scale(qc)
    present = [n for n in open_checkpoint(out).tensors if n.endswith(".input_global_scale")]
    if present:  # the converter writes it : remove the first one
        _tamper_remove(out, present[:1])
    detail = _details(V.verify_checkpoint(out))["tensors"]
    assert re.search(r"missing tensor '[a-z0-9_.]+\.input_global_scale' \(F32 \[1\]\): the declared scheme", detail)
    assert "torch.empty" in detail
    w4a16 = json.loads(json.dumps(qc))
    for g in w4a16["config_groups"].values():
        g["input_activations"] = None
    assert not disk_layout.ct_needs_input_scale(w4a16)
    assert [p.suffix for p in V.required_parts("compressed-tensors", Format.NVFP4, w4a16)] == [
        "weight_packed", "weight_scale", "weight_global_scale"]


def _tamper_remove(out, names):
    idx = json.loads((out / INDEX_NAME).read_text())
    for n in names:
        shard = out / idx["weight_map"].pop(n)
        t = load_file(shard)
        t.pop(n)
        save_file(t, str(shard), metadata={"format": "pt"})
    (out / INDEX_NAME).write_text(json.dumps(idx))


# each branch of each bound: (fmt, x, block scale values, S_dec, the bound's value)
BOUNDS = [
    (Format.MXFP8, 3.0, 1.0, None, 3.0 / 16),  # normal: |x| / 16
    (Format.MXFP8, 1e-4, 1.0, None, 1 / 1024),  # subnormal spacing: s / 1024
    (Format.NVFP4, 5.0, 1.0, 1.0, 5.0 / 4),  # |x| / 4
    (Format.NVFP4, 0.1, 2.0, 1.0, 2.0 / 4),  # the block scale s / 4
    (Format.NVFP4, 1e-6, 0.0, 0.5, 6 * 2.0**-10 * 0.5),  # E4M3-underflow floor
]


@pytest.mark.parametrize("fmt,x,s,s_dec,bound", BOUNDS, ids=[f"{f.value}-{x:g}" for f, x, *_ in BOUNDS])
def test_error_bound_fails_just_above_and_passes_just_below(fmt, x, s, s_dec, bound):
    block = 32 if fmt is Format.MXFP8 else 16
    xs = torch.full((1, block), x, dtype=torch.float64)
    b = V.error_bound(fmt, xs, torch.tensor([[s]], dtype=torch.float64), s_dec)
    assert b[0, 0].item() == pytest.approx(bound, rel=1e-12)
    for sign in (1, -1):
        above, below = xs.clone(), xs.clone()
        above[0, 3] += sign * bound * (1 + 1e-4)
        below[0, 3] += sign * bound * (1 - 1e-4)
        assert V.error_violations(xs, above, b).sum().item() == 1
        assert V.error_violations(xs, below, b).sum().item() == 0


def test_error_check_fails_an_injected_error_just_above_the_bound(copy, capsys):
    """End to end: the source weight moved so that the (unchanged) decoded value is just outside the bound of
    one element; the `error` check names the weight."""
    src_root, out = copy()
    src = out.parent / "src2"
    shutil.copytree(src_root, src)
    name = "model.layers.2.self_attn.q_proj.weight"
    shard = next(f for f in src.glob("*.safetensors") if name in load_file(f))
    t = load_file(shard)
    x = t[name].float()
    q = oracle.mxfp8_quantize(x)
    dq = oracle.mxfp8_decode(*q)
    s = torch.pow(2.0, q[1].double() - 127)
    b = V.error_bound(Format.MXFP8, x, s)
    i, j = 0, 5
    # put x where the decoded value is 1.02 bounds away (bf16 has room: the bound is |x|/16 >> bf16's ulp)
    target = (dq[i, j] - 1.02 * b[i, j] * torch.sign(dq[i, j])).item()
    t[name] = t[name].clone()
    t[name][i, j] = target
    save_file(t, str(shard), metadata={"format": "pt"})
    rc, text = verify(capsys, out, src)
    assert rc == 1 and "[FAIL] error" in text and f"'{name}': 1 elements outside the mxfp8 bound" in text


def test_error_check_fails_an_nvfp4_error_just_above_the_bound(copy, capsys):
    """NVFP4: an element decoded as 0 whose source value is moved to 1.05x the bound s / 4 (s = sf * S_dec,
    the block's effective scale; the element stays below s, so the bound is s / 4, not |x| / 4)."""
    src_root, out = copy("nvfp4-experts", "sglang")
    src = out.parent / "src2"
    shutil.copytree(src_root, src)
    name = "model.layers.2.mlp.experts.1.down_proj.weight"  # not in a fused group: its own amax
    shard = next(f for f in src.glob("*.safetensors") if name in load_file(f))
    t = load_file(shard)
    x = t[name].float()
    data, scale, s_dec = oracle.nvfp4_quantize(x)
    dq = oracle.nvfp4_decode(data, scale, s_dec)
    s = oracle.e4m3_decode(scale).repeat_interleave(16, dim=-1) * s_dec
    i, j = map(int, ((dq == 0) & (s > 0)).nonzero()[0])
    value = 1.05 * float(s[i, j]) / 4
    t[name] = t[name].clone()
    t[name][i, j] = value
    assert abs(float(t[name][i, j]) - value) < 0.01 * value  # bf16 keeps the 5% margin
    save_file(t, str(shard), metadata={"format": "pt"})
    rc, text = verify(capsys, out, src)
    assert rc == 1 and "[FAIL] error" in text and f"'{name}': 1 elements outside the nvfp4 bound" in text
