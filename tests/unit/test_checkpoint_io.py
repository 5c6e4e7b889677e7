"""Safetensors I/O, atomic output folders and the dry validation pass (no codecs or policy needed)."""

from __future__ import annotations

import errno
import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from miles_lp.errors import CheckpointError
from miles_lp.io.atomic import TMP_TAG, atomic_output_dir, tmp_name
from miles_lp.io.safetensors_io import (
    INDEX_NAME,
    ShardWriter,
    TensorReader,
    open_checkpoint,
    read_header,
    read_tensor,
)
from miles_lp.io.validate import validate_source


def _write(path, tensors):
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
            "b.weight": torch.randn(16, generator=g),
            "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
            "d.weight": torch.randn(8, 32, generator=g).to(torch.float8_e4m3fn)}


# ------------------------------------------------------------------------------------------- headers
def test_header_and_tensor_reads_match_safetensors(tmp_path):
    p = _write(tmp_path / "x.safetensors", _tensors())
    fh = read_header(p)
    assert fh.metadata == {"format": "pt"}
    assert {n: (h.dtype, h.shape) for n, h in fh.tensors.items()} == {
        "a.weight": ("BF16", (64, 32)), "b.weight": ("F32", (16,)), "c": ("I64", (2, 3)),
        "d.weight": ("F8_E4M3", (8, 32))}
    with safe_open(str(p), "pt") as f, TensorReader() as r:
        for name, h in fh.tensors.items():
            ref = f.get_tensor(name)
            for got in (read_tensor(h), r.read(h)):
                assert got.dtype == ref.dtype and got.shape == ref.shape
                assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


def test_truncated_file_names_file_and_tensor(tmp_path):
    p = _write(tmp_path / "model.safetensors", _tensors())
    data = p.read_bytes()
    p.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated: tensor '.*' ends at byte"):
        read_header(p)


@pytest.mark.parametrize("content,match", [
    (b"\x01\x02", "truncated safetensors file"),
    (struct.pack("<Q", 10**6) + b"{}", "corrupt or truncated safetensors header"),
    (struct.pack("<Q", 5) + b"{abc}", "not valid JSON"),
    (struct.pack("<Q", 2) + b"[]", "expected a JSON object"),
])
def test_corrupt_headers(tmp_path, content, match):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(content)
    with pytest.raises(CheckpointError, match=rf"bad\.safetensors.*{match}"):
        read_header(p)


def test_inconsistent_offsets(tmp_path):
    header = json.dumps({"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 6]}}).encode()
    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"tensor 'w' header is inconsistent"):
        read_header(p)


# ------------------------------------------------------------------------------------------- index
def _sharded(tmp_path):
    t = _tensors()
    _write(tmp_path / "s1.safetensors", {k: t[k] for k in ("a.weight", "b.weight")})
    _write(tmp_path / "s2.safetensors", {k: t[k] for k in ("c", "d.weight")})
    wm = {"a.weight": "s1.safetensors", "b.weight": "s1.safetensors", "c": "s2.safetensors",
          "d.weight": "s2.safetensors"}
    (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return wm


def test_open_sharded_checkpoint(tmp_path):
    _sharded(tmp_path)
    ck = open_checkpoint(tmp_path)
    assert set(ck.tensors) == set(_tensors())
    assert [f.name for f in ck.files] == ["s1.safetensors", "s2.safetensors"]


def test_index_naming_missing_tensor(tmp_path):
    wm = _sharded(tmp_path)
    wm["ghost.weight"] = "s2.safetensors"
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(CheckpointError, match=r"names tensor 'ghost\.weight' in 's2\.safetensors'"):
        open_checkpoint(tmp_path)


def test_index_naming_missing_shard(tmp_path):
    _sharded(tmp_path)
    (tmp_path / "s2.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"names shard 's2\.safetensors'.*does not exist"):
        open_checkpoint(tmp_path)


def test_stale_index(tmp_path):
    wm = _sharded(tmp_path)
    del wm["c"]
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(CheckpointError, match=r"does not name.*'c'"):
        open_checkpoint(tmp_path)


# ------------------------------------------------------------------------------------------- writer
def test_shard_writer_rolls_over_and_indexes(tmp_path):
    w = ShardWriter(tmp_path, max_shard_bytes=5000)
    tensors = {f"t{i}": torch.full((1000,), float(i), dtype=torch.bfloat16) for i in range(7)}  # 2000 B each
    w.add_many(tensors)
    index = w.finish()
    assert w.num_shards == 4  # 2 + 2 + 2 + 1
    assert index["metadata"]["total_size"] == 7 * 2000
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    ck = open_checkpoint(tmp_path)
    with TensorReader() as r:
        for n, t in tensors.items():
            assert torch.equal(r.read(ck.tensors[n]), t)
    with pytest.raises(CheckpointError, match="written twice"):
        w.add("t0", tensors["t0"])


# ------------------------------------------------------------------------------------------- atomic
def test_atomic_success_and_refusal(tmp_path):
    out = tmp_path / "out"
    with atomic_output_dir(out) as tmp:
        assert tmp.name == f".out{TMP_TAG}{os.getpid()}"
        (tmp / "f").write_text("1")
        assert not out.exists()
    assert (out / "f").read_text() == "1"
    with pytest.raises(CheckpointError, match="already exists; pass --overwrite"):
        with atomic_output_dir(out):
            pass


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_atomic_failure_leaves_nothing(tmp_path, exc):
    out = tmp_path / "out"
    with pytest.raises(type(exc)):
        with atomic_output_dir(out) as tmp:
            (tmp / "half").write_text("x")
            raise exc
    assert sorted(os.listdir(tmp_path)) == []


def test_overwrite_replaces_only_when_complete(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "miles_lp_plan.json").write_text("old")  # a checkpoint of ours: --overwrite replaces only those
    with pytest.raises(RuntimeError):
        with atomic_output_dir(out, overwrite=True) as tmp:
            (tmp / "new").write_text("new")
            raise RuntimeError("fail mid-way")
    assert sorted(os.listdir(out)) == ["miles_lp_plan.json"]  # the previous checkpoint survives a failed run
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "new").write_text("new")
        assert (out / "miles_lp_plan.json").exists()
    assert sorted(os.listdir(out)) == ["new"]
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_stale_temp_from_killed_run_is_removed(tmp_path):
    out = tmp_path / "out"
    stale = tmp_name(out, pid=2**22 + 12345)  # no such process
    stale.mkdir()
    (stale / "junk").write_text("x")
    with atomic_output_dir(out) as tmp:
        (tmp / "f").write_text("1")
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("err,match", [
    (OSError(errno.ENOSPC, "No space left on device"), "no space left on the device"),
    (PermissionError(errno.EACCES, "Permission denied"), "permission denied"),
])
def test_disk_errors_become_clear_messages(tmp_path, err, match):
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=rf"cannot write output folder .*{match}.*Nothing was written"):
        with atomic_output_dir(out) as tmp:
            (tmp / "part").write_text("x")
            raise err
    assert sorted(os.listdir(tmp_path)) == []


# ------------------------------------------------------------------------------------------- validate
def test_validate_missing_folder_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        validate_source(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="has no config.json"):
        validate_source(tmp_path)


def _ckpt(tmp_path, tensors, config=None):
    (tmp_path / "config.json").write_text(json.dumps(config or {"model_type": "qwen3"}))
    _write(tmp_path / "model.safetensors", tensors)
    return tmp_path


def test_validate_block_fp8(tmp_path):
    w = torch.randn(200, 300).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3)
    src = validate_source(_ckpt(tmp_path, {"m.weight": w, "m.weight_scale_inv": s, "n.weight": torch.randn(4)},
                                {"model_type": "deepseek_v3", "quantization_config": {
                                    "quant_method": "fp8", "weight_block_size": [128, 128]}}))
    assert src.fp8_scale_of == {"m.weight": "m.weight_scale_inv"}
    assert set(src.logical) == {"m.weight", "n.weight"}


def test_validate_refuses_fp8_without_scale_and_other_quantization(tmp_path):
    with pytest.raises(CheckpointError, match=r"FP8 tensor 'm\.weight'.*has no 'm\.weight_scale_inv'"):
        validate_source(_ckpt(tmp_path, {"m.weight": torch.randn(8, 32).to(torch.float8_e4m3fn)}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3",
                                                      "quantization_config": {"quant_method": "mxfp8"}}))
    with pytest.raises(CheckpointError, match="already quantized"):
        validate_source(tmp_path)
