"""`convert` and `verify` on a folder with a stray ``consolidated.safetensors`` (second half).

Mistral's repos ship ``consolidated.safetensors`` (Mistral's own tensor names) next to the HF shards. The
conversion must read the model's files only (``safetensors_io.select_weight_files``): the output equals the
conversion of the clean folder byte for byte, holds none of the foreign names, and the summary names the file it
did not read. Without an index or ``model.safetensors``, several files are refused, naming them; nothing is
written.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.cli import main
from miles_lp.io.safetensors_io import INDEX_NAME, SINGLE_NAME, open_checkpoint

FOREIGN = {"tok_embeddings.weight": torch.ones(256, 64, dtype=torch.bfloat16),
           "layers.0.attention.wq.weight": torch.ones(64, 64, dtype=torch.bfloat16)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("stray")
    return {"sharded": make_tiny_model("qwen3", root / "sharded", seed=7, max_shard_size="150KB"),
            "single": make_tiny_model("qwen3", root / "single", seed=7)}


def _convert(src, out, capsys):
    rc = main(["convert", "--hf-checkpoint", str(src), "--output", str(out), "--format", "mxfp8",
               "--max-shard-size", "150KB", "--no-progress"])
    return rc, capsys.readouterr()


def _tree(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_stray_consolidated_is_not_converted_and_the_output_is_the_clean_one(built, layout, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(built[layout], src)
    assert (src / INDEX_NAME).exists() == (layout == "sharded")
    rc, _ = _convert(src, tmp_path / "clean", capsys)
    assert rc == 0
    save_file(FOREIGN, str(src / "consolidated.safetensors"))  # the same folder: the record's source path is equal
    rc, io = _convert(src, tmp_path / "stray", capsys)
    assert rc == 0
    clean, stray = _tree(tmp_path / "clean"), _tree(tmp_path / "stray")
    assert list(stray) == list(clean) and all(stray[n] == clean[n] for n in clean)  # byte for byte
    assert "consolidated.safetensors" not in stray
    out_names = set(open_checkpoint(tmp_path / "stray").tensors)
    assert not {n.rsplit("_scale", 1)[0] for n in out_names} & set(FOREIGN)
    assert not [n for n in out_names if n.startswith(("layers.", "tok_embeddings"))]
    line = next(ln for ln in io.out.splitlines() if ln.strip().startswith("not copied"))
    why = f"{INDEX_NAME} does not name them" if layout == "sharded" else f"the model is {SINGLE_NAME} alone"
    assert "consolidated.safetensors (weights not read" in line and why in line.split("consolidated.safetensors")[1]

    rc = main(["verify", str(tmp_path / "stray"), "--source", str(src)])
    out = capsys.readouterr().out
    assert rc == 0 and "result: OK" in out
    assert "source files match the recorded sha256 (other files, as convert read it: consolidated.safetensors" in out


def test_several_files_without_index_refused_naming_them_and_nothing_written(built, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(built["sharded"], src)
    (src / INDEX_NAME).unlink()
    save_file(FOREIGN, str(src / "consolidated.safetensors"))
    out = tmp_path / "out"
    rc, io = _convert(src, out, capsys)
    assert rc == 2 and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    assert f"{src}: 5 *.safetensors files (consolidated.safetensors, model-00001-of-00004.safetensors" in io.err
    assert f"neither {INDEX_NAME} nor {SINGLE_NAME}" in io.err and "Mistral's native format" in io.err
    assert f"Add the {INDEX_NAME} that names the shards" in io.err


def test_verify_fails_on_a_consolidated_file_in_the_output_and_notes_other_strays(built, tmp_path, capsys):
    out = tmp_path / "out"
    rc, _ = _convert(built["single"], out, capsys)
    assert rc == 0
    save_file(FOREIGN, str(out / "extra.safetensors"))  # the index rules for vLLM too: only named
    assert main(["verify", str(out)]) == 0
    text = capsys.readouterr().out
    assert "other files: extra.safetensors (weights not read: model.safetensors.index.json does not name them)" in text
    (out / "extra.safetensors").rename(out / "consolidated.safetensors")  # vLLM's auto format would load this one
    assert main(["verify", str(out)]) == 1
    row = next(ln for ln in capsys.readouterr().out.splitlines() if "] index" in ln)
    assert "FAIL" in row and "vLLM then loads Mistral's consolidated*.safetensors instead of the index's" in row
    assert json.loads((out / INDEX_NAME).read_text())  # the output itself untouched
