"""Which ``*.safetensors`` files of a folder are the model: one rule for every reader (second half).

``safetensors_io.select_weight_files``, as transformers and vLLM pick them: an index -> exactly its shards; no
index -> ``model.safetensors`` alone; neither -> the one ``*.safetensors``; several with neither -> an error
naming the folder and the files. Files not read are named (``CheckpointFiles.ignored``), never silent. Every
reader goes through it: the converter's ``validate_source``, ``explain``'s ``read_safetensors_shapes`` /
``load_model_layout``, the reference engine's ``rollout.checkpoint.open_checkpoint``.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings

import pytest
import torch
from safetensors.torch import save_file

from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.cli import main
from miles_lp.errors import CheckpointError
from miles_lp.io.safetensors_io import INDEX_NAME, SINGLE_NAME, open_checkpoint, select_weight_files
from miles_lp.io.validate import load_model_layout, read_safetensors_shapes, validate_source
from miles_lp.rollout.checkpoint import open_checkpoint as engine_open

RECIPE = "recipes/policies/qwen3-mxfp8.yaml"
# Mistral's native names, as consolidated.safetensors holds them next to the HF shards (Mistral-7B-v0.3)
FOREIGN = {"tok_embeddings.weight": torch.zeros(256, 64, dtype=torch.bfloat16),
           "layers.0.attention.wq.weight": torch.zeros(64, 64, dtype=torch.bfloat16)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("wf")
    return (make_tiny_model("qwen3", root / "single", seed=5),
            make_tiny_model("qwen3", root / "sharded", seed=5, max_shard_size="150KB"))


@pytest.fixture
def single(built, tmp_path):
    shutil.copytree(built[0], tmp_path / "single")
    return tmp_path / "single"


@pytest.fixture
def sharded(built, tmp_path):
    shutil.copytree(built[1], tmp_path / "sharded")
    return tmp_path / "sharded"


def _stray(folder, name="consolidated.safetensors"):
    save_file(FOREIGN, str(folder / name))
    return folder / name


def _every_reader(folder):
    """The tensor names each reader sees; the engine warns exactly when a file is left out."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = set(engine_open(folder).tensors)
    left_out = open_checkpoint(folder).ignored
    assert [str(w.message) for w in caught] == ([f"{folder}: not serving {open_checkpoint(folder).ignored_note()}"]
                                                if left_out else [])
    return {"converter": set(validate_source(folder).tensors), "explain": set(read_safetensors_shapes(folder)),
            "explain --model": set(load_model_layout(folder)[1]), "engine": engine}


def test_index_reads_exactly_its_shards_and_names_the_stray_file(sharded):
    want = set(json.loads((sharded / INDEX_NAME).read_text())["weight_map"])
    stray = _stray(sharded)
    files, ignored, index = select_weight_files(sharded)
    assert index is not None and stray not in files and len(files) >= 3
    assert ignored == {stray: f"weights not read: {INDEX_NAME} does not name them"}
    assert all(names == want for names in _every_reader(sharded).values())


def test_no_index_model_safetensors_alone_and_the_other_file_named(single):
    want = set(read_safetensors_shapes(single))
    stray = _stray(single)
    files, ignored, index = select_weight_files(single)
    assert (files, index) == ([single / SINGLE_NAME], None)
    assert list(ignored) == [stray] and "model.safetensors alone, as transformers loads it" in ignored[stray]
    seen = _every_reader(single)
    assert all(names == want for names in seen.values()) and not set(FOREIGN) & want
    assert "consolidated.safetensors (weights not read" in load_model_layout(single)[2]  # explain's "from" line


def test_no_index_no_model_safetensors_one_file_is_read(single):
    want = set(read_safetensors_shapes(single))
    (single / SINGLE_NAME).rename(single / "weights.safetensors")
    assert select_weight_files(single) == ([single / "weights.safetensors"], {}, None)
    assert all(names == want for names in _every_reader(single).values())


def test_hidden_safetensors_are_never_candidates(single):
    (single / SINGLE_NAME).rename(single / "weights.safetensors")
    _stray(single, "._weights.safetensors")  # a macOS AppleDouble copy
    assert select_weight_files(single) == ([single / "weights.safetensors"], {}, None)


def _several_error(folder, names):
    return re.escape(f"{folder}: {len(names)} *.safetensors files ({', '.join(names)}) and neither {INDEX_NAME} nor "
                     f"{SINGLE_NAME}: cannot tell which files are the model")


def test_several_files_without_index_or_model_safetensors_is_an_error_for_every_reader(sharded):
    (sharded / INDEX_NAME).unlink()  # an index lost in a copy: the shards alone
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) >= 3
    match = _several_error(sharded, shards) + re.escape(f". Add the {INDEX_NAME} that names the shards (save_pretrained "
                                                        "writes it), or remove the files that are not part of the model")
    for read in (select_weight_files, open_checkpoint, validate_source, read_safetensors_shapes, load_model_layout,
                 engine_open):
        with pytest.raises(CheckpointError, match=match):
            read(sharded)


def test_stray_consolidated_next_to_unindexed_shards_is_an_error_with_the_mistral_hint(single):
    (single / SINGLE_NAME).rename(single / "model-00001-of-00001.safetensors")
    _stray(single)
    match = _several_error(single, ["consolidated.safetensors", "model-00001-of-00001.safetensors"]) + \
        r" \(consolidated\.safetensors is Mistral's native format.*vLLM reads it instead of the HF shards"
    with pytest.raises(CheckpointError, match=match):
        validate_source(single)
    with pytest.raises(CheckpointError, match=match):
        engine_open(single)


def test_explain_cli_exits_2_naming_the_files(sharded, capsys):
    (sharded / INDEX_NAME).unlink()
    assert main(["explain", RECIPE, "--model", str(sharded)]) == 2
    err = capsys.readouterr().err
    assert "model-00001-of-" in err and f"neither {INDEX_NAME} nor {SINGLE_NAME}" in err


def test_explain_cli_names_the_file_it_did_not_read(single, capsys):
    _stray(single)
    assert main(["explain", RECIPE, "--model", str(single)]) == 0
    out = capsys.readouterr().out
    assert "other files: consolidated.safetensors (weights not read" in out
    assert "tok_embeddings" not in out and "attention.wq" not in out


def test_engine_warns_naming_the_file_it_does_not_serve(sharded):
    _stray(sharded)
    with pytest.warns(UserWarning, match=r"not serving consolidated\.safetensors \(weights not read: "
                                         rf"{INDEX_NAME} does not name them\)"):
        engine_open(sharded)


def test_index_and_an_unindexed_model_safetensors_is_an_error(sharded, single):
    # transformers checks model.safetensors before the index and would load it; vLLM loads the index's shards
    shutil.copy(single / SINGLE_NAME, sharded / SINGLE_NAME)
    match = (rf"{sharded}: holds both {INDEX_NAME} \(naming model-00001-of-.*\) and {SINGLE_NAME}, which the index "
             rf"does not name: transformers would load {SINGLE_NAME}, vLLM and miles-lp the index's shards")
    for read in (validate_source, read_safetensors_shapes, engine_open):
        with pytest.raises(CheckpointError, match=match):
            read(sharded)


def test_an_index_naming_model_safetensors_is_fine(single):
    names = read_safetensors_shapes(single)
    (single / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": {n: SINGLE_NAME for n in names}}))
    _stray(single)
    files, ignored, index = select_weight_files(single)
    assert files == [single / SINGLE_NAME] and index is not None and list(ignored) == [single / "consolidated.safetensors"]
    assert set(validate_source(single).tensors) == set(names)
