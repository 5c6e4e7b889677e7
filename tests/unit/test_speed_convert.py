"""The fast converter writes the bytes of the plain one: every output file identical, file for file.

"Plain" is the converter as it was before its pipeline: one thread (``MILES_LP_PIPELINE=0``) and the eager
torch codecs (``formats.native.disabled()``). "Fast" is the default: the read/quantize/write pipeline and
the fused CPU kernels. Compared: every output file's bytes (shards, index, configs, the plan record), on
tiny multi-shard checkpoints, per format and target, with gate/up split across shards (the pre-pass), a
block-FP8 input, NaN/inf allowed, and a failure in the middle (nothing written, the first error raised).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_lp.checkpoint import pipeline
from miles_lp.checkpoint.convert import convert_checkpoint
from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.cli.convert import policy_for_format
from miles_lp.errors import CheckpointError
from miles_lp.formats import native
from miles_lp.io.safetensors_io import INDEX_NAME


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("speed-tiny")
    return {a: make_tiny_model(a, root / a, seed=3, max_shard_size="150KB") for a in ("qwen3_moe", "deepseek_v3")}


def _convert(src, out, fmt, target, *, fast: bool, monkeypatch, **kw):
    monkeypatch.setenv("MILES_LP_PIPELINE", "2" if fast else "0")
    if fast:
        return convert_checkpoint(src, out, policy_for_format(fmt), target=target, progress=False,
                                  log=lambda m: None, **kw)
    with native.disabled():
        return convert_checkpoint(src, out, policy_for_format(fmt), target=target, progress=False,
                                  log=lambda m: None, **kw)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _assert_same_output(a: Path, b: Path) -> None:
    fa, fb = _files(a), _files(b)
    assert fa.keys() == fb.keys()
    rec_a, rec_b = json.loads(fa.pop("miles_lp_plan.json")), json.loads(fb.pop("miles_lp_plan.json"))
    assert rec_a == rec_b  # same plan, digests, dtypes, non-finite list (the source path is the same)
    differ = [n for n in fa if fa[n] != fb[n]]
    assert not differ, f"files differ: {differ}"


CASES = [("qwen3_moe", "mxfp8", "sglang"), ("qwen3_moe", "mxfp8+nvfp4-experts", "sglang"),
         ("qwen3_moe", "nvfp4-experts", "compressed-tensors"), ("deepseek_v3", "mxfp8+nvfp4-experts", "vllm")]


@pytest.mark.parametrize("arch,fmt,target", CASES)
def test_fast_converter_writes_the_plain_converters_bytes(tiny, tmp_path, monkeypatch, arch, fmt, target):
    if fmt == "mxfp8+nvfp4-experts" and target == "vllm":
        fmt = "nvfp4-experts"  # vLLM's modelopt config holds one format
    fast, plain = tmp_path / "fast", tmp_path / "plain"
    s_fast = _convert(tiny[arch], fast, fmt, target, fast=True, monkeypatch=monkeypatch, max_shard_bytes=120_000)
    clock = pipeline.last_clock()
    _convert(tiny[arch], plain, fmt, target, fast=False, monkeypatch=monkeypatch, max_shard_bytes=120_000)
    assert clock is not None and clock.workers == 2 and clock.seconds["quantize"] > 0  # the fast run piped
    assert pipeline.last_clock().workers == 0
    assert s_fast.num_shards >= 3
    _assert_same_output(fast, plain)


def test_gate_up_split_across_shards_and_nonfinite(tiny, tmp_path, monkeypatch):
    """Shard boundary between a gate and its up projection (the pre-pass amax), NaN/inf allowed."""
    src = tmp_path / "src"
    src.mkdir()
    for p in Path(tiny["qwen3_moe"]).iterdir():
        if not p.name.endswith(".safetensors") and p.name != INDEX_NAME:
            (src / p.name).write_bytes(p.read_bytes())
    tensors = {}
    for p in sorted(Path(tiny["qwen3_moe"]).glob("*.safetensors")):
        tensors.update(load_file(p))
    names = sorted(tensors)
    gate = next(n for n in names if n.endswith("experts.0.gate_proj.weight"))
    tensors[gate] = tensors[gate].clone()
    tensors[gate][0, 0] = math.nan
    tensors[gate][1, 3] = -math.inf
    cut = names.index(gate) + 1  # gate in shard 1, its up projection in shard 2
    parts = [dict((n, tensors[n].contiguous()) for n in names[:cut]), dict((n, tensors[n].contiguous()) for n in names[cut:])]
    weight_map = {}
    for i, part in enumerate(parts, 1):
        fname = f"model-{i:05d}-of-00002.safetensors"
        save_file(part, str(src / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    (src / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    fast, plain = tmp_path / "fast", tmp_path / "plain"
    for out, is_fast in ((fast, True), (plain, False)):
        with pytest.warns(UserWarning, match="non-finite"):
            s = _convert(src, out, "nvfp4-experts", "sglang", fast=is_fast, monkeypatch=monkeypatch,
                         allow_nonfinite=True, max_shard_bytes=100_000)
        assert s.nonfinite == [gate]
    _assert_same_output(fast, plain)


def test_failure_mid_way_raises_the_error_and_writes_nothing(tiny, tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    for p in Path(tiny["qwen3_moe"]).iterdir():
        src.joinpath(p.name).write_bytes(p.read_bytes())
    shard = sorted(src.glob("*.safetensors"))[1]
    tensors = load_file(shard)
    bad = sorted(n for n in tensors if n.endswith("proj.weight"))[0]
    tensors[bad] = tensors[bad].clone()
    tensors[bad].view(-1)[7] = math.nan
    save_file(tensors, str(shard), metadata={"format": "pt"})
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=rf"tensor '{bad}' has 1 non-finite values"):
        _convert(src, out, "mxfp8", "sglang", fast=True, monkeypatch=monkeypatch)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_block_fp8_input(tiny, tmp_path, monkeypatch):
    """DeepSeek-style block-FP8 input (weight + weight_scale_inv read in one job): same bytes."""
    src = tiny["deepseek_v3"]
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    from miles_lp.formats import quantize_fp8_blockwise

    weight_map = {}
    for p in sorted(Path(src).glob("*.safetensors")):
        out = {}
        for n, t in load_file(p).items():
            if n.endswith("proj.weight") and t.dim() == 2 and "mlp.gate." not in n:
                q = quantize_fp8_blockwise(t.to(torch.float32), block=(128, 128))
                out[n], out[n + "_scale_inv"] = q.data, q.scale_inv
            else:
                out[n] = t
        save_file(out, str(fp8 / p.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, p.name))
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    (fp8 / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    fast, plain = tmp_path / "fast", tmp_path / "plain"
    _convert(fp8, fast, "mxfp8+nvfp4-experts", "compressed-tensors", fast=True, monkeypatch=monkeypatch)
    _convert(fp8, plain, "mxfp8+nvfp4-experts", "compressed-tensors", fast=False, monkeypatch=monkeypatch)
    assert any(n.endswith("_scale_inv") for n in weight_map)
    written = json.loads((fast / INDEX_NAME).read_text())["weight_map"]
    assert not [n for n in written if n.endswith("weight_scale_inv")]  # read with their weights, decoded
    _assert_same_output(fast, plain)
