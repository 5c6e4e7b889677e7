"""`explain`'s and the engine's header readers follow the index: a shard the index names but the folder
lacks is an error naming both, and a stray extra ``*.safetensors`` next to an indexed checkpoint is not read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.cli import main
from miles_lp.errors import CheckpointError
from miles_lp.io.safetensors_io import INDEX_NAME
from miles_lp.io.validate import load_model_layout, read_safetensors_shapes
from miles_lp.rollout.checkpoint import open_checkpoint as engine_open

RECIPE = "recipes/policies/qwen3-mxfp8.yaml"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("base") / "m", seed=3, max_shard_size="150KB")


@pytest.fixture
def src(base, tmp_path):
    p = tmp_path / "src"
    shutil.copytree(base, p)
    return p


def _index_names(src):
    return set(json.loads((src / INDEX_NAME).read_text())["weight_map"])


def _drop_second_shard(src):
    shards = sorted(src.glob("*.safetensors"))
    assert len(shards) >= 3, "the fixture must be sharded"
    shards[1].unlink()
    return shards[1].name


def test_missing_shard_is_an_error_for_explain(src):
    gone = _drop_second_shard(src)
    with pytest.raises(CheckpointError, match=rf"{INDEX_NAME}: names shard '{gone}' .*which does not exist"):
        read_safetensors_shapes(src)
    with pytest.raises(CheckpointError, match=rf"names shard '{gone}'"):
        load_model_layout(src)


def test_missing_shard_explain_cli_exits_2_naming_the_shard(src, capsys):
    gone = _drop_second_shard(src)
    rc = main(["explain", RECIPE, "--model", str(src)])
    err = capsys.readouterr().err
    assert rc == 2 and INDEX_NAME in err and gone in err


def test_missing_shard_is_an_error_for_the_engine(src):
    gone = _drop_second_shard(src)
    with pytest.raises(CheckpointError, match=rf"names shard '{gone}'"):
        engine_open(src)


def test_stray_safetensors_next_to_an_index_is_not_read(src):
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4, dtype=torch.bfloat16)},
              str(src / "consolidated.safetensors"))  # Mistral repos ship one next to the HF shards
    want = _index_names(src)
    assert set(read_safetensors_shapes(src)) == want
    _, shapes, _ = load_model_layout(src)
    assert set(shapes) == want
    with pytest.warns(UserWarning, match="not serving consolidated.safetensors"):
        assert set(engine_open(src).tensors) == want


def test_stale_index_is_an_error_for_both(src):
    idx = json.loads((src / INDEX_NAME).read_text())
    idx["weight_map"]["model.layers.0.mlp.extra.weight"] = next(iter(idx["weight_map"].values()))
    (src / INDEX_NAME).write_text(json.dumps(idx))
    for read in (read_safetensors_shapes, engine_open):
        with pytest.raises(CheckpointError, match=r"names tensor 'model.layers.0.mlp.extra.weight'.*stale"):
            read(src)


def test_stray_safetensors_next_to_a_single_file_checkpoint_is_not_read(tmp_path):
    src = make_tiny_model("qwen3", tmp_path / "single", seed=3)
    assert not (src / INDEX_NAME).exists() and (src / "model.safetensors").is_file()
    want = set(read_safetensors_shapes(src))
    save_file({"tok_embeddings.weight": torch.zeros(4, 4)}, str(src / "consolidated.safetensors"))
    assert set(read_safetensors_shapes(src)) == want and "tok_embeddings.weight" not in want
    with pytest.warns(UserWarning, match="not serving consolidated.safetensors"):
        assert set(engine_open(src).tensors) == want
