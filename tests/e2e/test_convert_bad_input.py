"""Bad input to `miles-lp convert`: a clear message, exit code 2, no OUT and no temporary folder left."""

from __future__ import annotations

import errno
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.cli import main
from miles_lp.io.safetensors_io import INDEX_NAME


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("base") / "m", seed=2, max_shard_size="150KB")


@pytest.fixture
def src(base, tmp_path):
    p = tmp_path / "src"
    shutil.copytree(base, p)
    return p


def run(capsys, src, out, *flags):
    rc = main(["convert", "--hf-checkpoint", str(src), "--output", str(out), "--no-progress",
               *(flags or ("--format", "mxfp8"))])
    return rc, capsys.readouterr().err


def nothing_left(out):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


def _shards(src):
    return sorted(src.glob("*.safetensors"))


def test_missing_folder(capsys, tmp_path):
    rc, err = run(capsys, tmp_path / "nope", tmp_path / "out")
    assert rc == 2 and "does not exist" in err
    nothing_left(tmp_path / "out")


def test_missing_config(capsys, src, tmp_path):
    (src / "config.json").unlink()
    rc, err = run(capsys, src, tmp_path / "out")
    assert rc == 2 and "has no config.json" in err
    nothing_left(tmp_path / "out")


def test_unknown_architecture(capsys, src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (src / "config.json").write_text(json.dumps(cfg))
    rc, err = run(capsys, src, tmp_path / "out")
    assert rc == 2 and "no layout for model_type 'gpt_neox'" in err and "qwen3_moe" in err and "Adding one" in err
    nothing_left(tmp_path / "out")


def test_truncated_shard(capsys, src, tmp_path):
    shard = _shards(src)[-1]
    shard.write_bytes(shard.read_bytes()[:-1000])
    rc, err = run(capsys, src, tmp_path / "out")
    assert rc == 2 and shard.name in err and "truncated" in err
    nothing_left(tmp_path / "out")


def test_corrupt_header(capsys, src, tmp_path):
    shard = _shards(src)[0]
    data = bytearray(shard.read_bytes())
    data[8:12] = b"#!?x"
    shard.write_bytes(bytes(data))
    rc, err = run(capsys, src, tmp_path / "out")
    assert rc == 2 and shard.name in err and "not valid JSON" in err
    nothing_left(tmp_path / "out")


def test_index_naming_missing_tensor(capsys, src, tmp_path):
    idx = json.loads((src / INDEX_NAME).read_text())
    idx["weight_map"]["model.layers.9.mlp.down_proj.weight"] = _shards(src)[0].name
    (src / INDEX_NAME).write_text(json.dumps(idx))
    rc, err = run(capsys, src, tmp_path / "out")
    assert rc == 2 and "names tensor 'model.layers.9.mlp.down_proj.weight'" in err
    nothing_left(tmp_path / "out")


def _poison(src, name, value):
    for shard in _shards(src):
        t = load_file(shard)
        if name in t:
            t[name] = t[name].clone()
            t[name].view(-1)[5] = value
            save_file(t, str(shard), metadata={"format": "pt"})
            return
    raise AssertionError(name)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_weight(capsys, src, tmp_path, value):
    name = "model.layers.2.mlp.up_proj.weight"
    _poison(src, name, value)
    out = tmp_path / "out"
    rc, err = run(capsys, src, out)
    assert rc == 2 and f"tensor '{name}' has 1 non-finite values" in err and "--allow-nonfinite" in err
    nothing_left(out)
    with pytest.warns(UserWarning, match=name):
        rc, err = run(capsys, src, out, "--format", "mxfp8", "--allow-nonfinite")
    assert rc == 0 and out.exists()
    assert json.loads((out / "miles_lp_plan.json").read_text())["nonfinite_allowed"] == [name]


def test_unaligned_shape(capsys, tmp_path):
    """K not a multiple of 32: refused by default naming the tensors; on_unaligned: keep_bf16 keeps them."""
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, intermediate_size=80, head_dim=32,
                                   tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    src = tmp_path / "src"
    model.save_pretrained(src)
    out = tmp_path / "out"
    rc, err = run(capsys, src, out)
    assert rc == 2 and "model.layers.0.mlp.down_proj.weight [64, 80]" in err and "keep_bf16" in err
    nothing_left(out)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("precision:\n  default: mxfp8\n  on_unaligned: keep_bf16\n")
    rc, err = run(capsys, src, out, "--recipe", str(recipe))
    assert rc == 0 and "unaligned tensor(s) kept bf16" in err and "down_proj" in err
    shutil.rmtree(out)


@pytest.mark.parametrize("exc,match", [
    (OSError(errno.ENOSPC, "No space left on device"), "no space left on the device"),
    (PermissionError(errno.EACCES, "Permission denied"), "permission denied"),
])
def test_disk_full_or_permission_denied(capsys, src, tmp_path, monkeypatch, exc, match):
    """Root ignores chmod, so the writer is made to fail the way a full disk / denied write fails."""
    import miles_lp.io.safetensors_io as io

    calls = []

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:  # the first shard was written: fail mid-way
            raise exc
        from safetensors.torch import save_file as real

        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(io.ShardWriter, "flush", _flush_with(failing_save))
    out = tmp_path / "out"
    rc, err = run(capsys, src, out, "--format", "mxfp8", "--max-shard-size", "60KB")
    assert rc == 2 and match in err and "Nothing was written" in err
    assert len(calls) == 2
    nothing_left(out)


def _flush_with(save):
    from miles_lp.io.safetensors_io import ShardWriter

    real = ShardWriter.flush

    def flush(self):
        self._save = save
        return real(self)

    return flush


def test_existing_output_and_overwrite(capsys, src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("x")  # an earlier checkpoint
    (out / "model.safetensors").write_bytes(b"")
    rc, err = run(capsys, src, out)
    assert rc == 2 and "already exists; pass --overwrite" in err and (out / "config.json").read_text() == "x"
    rc, err = run(capsys, src, out, "--format", "mxfp8", "--overwrite")
    assert rc == 0 and (out / "config.json").read_text() != "x" and (out / "miles_lp_plan.json").exists()


def _tree(folder):
    return sorted((str(p.relative_to(folder)), p.read_bytes() if p.is_file() else b"") for p in folder.rglob("*"))


@pytest.mark.parametrize("where, match", [
    ("parent", "contains the input"),      # --output the folder that holds the source: the replace would delete it
    ("dotdot", "is the input folder"),     # the source itself, spelled with '..'
    ("inside", "lies inside the input"),
    ("symlink", "is the input folder"),    # a link to the source
])
def test_overwrite_never_replaces_or_nests_the_source(capsys, tmp_path, base, where, match):
    holder = tmp_path / "holder"
    src = holder / "src"
    shutil.copytree(base, src)
    (holder / "precious.txt").write_text("keep")
    out = {"parent": holder, "dotdot": holder / "x" / ".." / "src", "inside": src / "sub",
           "symlink": tmp_path / "link"}[where]
    if where == "symlink":
        out.symlink_to(src)
    before = _tree(holder)
    rc, err = run(capsys, src, out, "--format", "mxfp8", "--overwrite")
    assert rc == 2 and match in err, err
    assert _tree(holder) == before  # the source and its neighbours untouched, nothing added


def test_overwrite_replaces_only_a_checkpoint_folder(capsys, src, tmp_path):
    out = tmp_path / "home"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    rc, err = run(capsys, src, out, "--format", "mxfp8", "--overwrite")
    assert rc == 2 and "is not a checkpoint" in err and "--overwrite replaces checkpoints only" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    # a project folder with a config.json and a stray .safetensors at its top, and a subfolder: kept
    (out / "config.json").write_text("{}")
    (out / "w.safetensors").write_bytes(b"")
    (out / "src").mkdir()
    (out / "src" / "main.py").write_text("code")
    rc, err = run(capsys, src, out, "--format", "mxfp8", "--overwrite")
    assert rc == 2 and "is not a checkpoint" in err and (out / "src" / "main.py").read_text() == "code"
    (out / "state.json").write_text("{}")  # a common application file name is no miles-lp record
    rc, err = run(capsys, src, out, "--format", "mxfp8", "--overwrite")
    assert rc == 2 and (out / "src" / "main.py").read_text() == "code"
    (out / "state.json").unlink()
    shutil.rmtree(out / "src")  # now an HF checkpoint's files only (config.json + *.safetensors + a note): replaced
    assert run(capsys, src, out, "--format", "mxfp8", "--overwrite")[0] == 0
    assert (out / "miles_lp_plan.json").is_file() and not (out / "notes.txt").exists()
    shutil.rmtree(out)
    out.mkdir()  # an empty folder is replaced
    assert run(capsys, src, out, "--format", "mxfp8", "--overwrite")[0] == 0
    assert (out / "config.json").is_file()


def test_interrupted_run_leaves_nothing(capsys, src, tmp_path, monkeypatch):
    import miles_lp.checkpoint.convert as conv

    real = conv.quantize
    n = []

    def interrupt(*a, **k):
        n.append(1)
        if len(n) == 5:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(conv, "quantize", interrupt)
    out = tmp_path / "out"
    rc, err = run(capsys, src, out)
    assert rc == 130 and "interrupted" in err
    nothing_left(out)


@pytest.mark.parametrize("argv,match", [
    (["--format", "mxfp8", "--num-layers-at-start-in-bf", "1"], "unrecognized arguments"),  # no abbreviations
    (["--format", "mxfp8", "--targte", "vllm"], "unrecognized arguments"),
    (["--format", "mxfp9"], "invalid choice"),
    (["--format", "mxfp8", "--recipe", "r.yaml"], "not allowed with argument"),
    ([], "one of the arguments --recipe --format is required"),
])
def test_cli_typos_are_errors(capsys, src, tmp_path, argv, match):
    with pytest.raises(SystemExit) as e:
        main(["convert", "--hf-checkpoint", str(src), "--output", str(tmp_path / "out"), *argv])
    assert e.value.code == 2 and match in capsys.readouterr().err
    nothing_left(tmp_path / "out")


def test_recipe_with_flag_exceptions_refused(capsys, src, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("precision:\n  default: mxfp8\n")
    rc, err = run(capsys, src, tmp_path / "out", "--recipe", str(recipe), "--bf16-pattern", "*.o_proj")
    assert rc == 2 and "--bf16-pattern builds a policy from flags and cannot be combined with --recipe" in err


def test_mixed_plan_for_vllm_is_modelopt_mixed_precision(capsys, tmp_path):
    """vLLM used to be refused mixed MXFP8 + NVFP4 plans; it reads them as ModelOpt
    MIXED_PRECISION (tests/unit/test_emit.py re-reads it, tests/readers with vLLM's own class)."""
    src = make_tiny_model("qwen3_moe", tmp_path / "moe", seed=0)
    rc, err = run(capsys, src, tmp_path / "out", "--format", "mxfp8+nvfp4-experts", "--target", "vllm")
    assert rc == 0, err
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_algo"] == "MIXED_PRECISION"
    assert {v["quant_algo"] for v in cfg["quantized_layers"].values()} == {"MXFP8", "NVFP4"}


def _tree(path):
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("failure", ["interrupt", "disk_full"])
def test_failed_overwrite_keeps_the_previous_output_intact(capsys, src, tmp_path, monkeypatch, failure):
    """--overwrite onto a good OUT, then the new run dies mid-shard: OUT keeps every byte of the old run."""
    import miles_lp.checkpoint.convert as conv
    import miles_lp.io.safetensors_io as io

    out = tmp_path / "out"
    rc, _ = run(capsys, src, out, "--format", "mxfp8")
    assert rc == 0
    before = _tree(out)
    if failure == "interrupt":
        real, n = conv.quantize, []

        def interrupt(*a, **k):
            n.append(1)
            if len(n) == 7:
                raise KeyboardInterrupt
            return real(*a, **k)
        monkeypatch.setattr(conv, "quantize", interrupt)
        expect_rc, expect = 130, "interrupted"
    else:
        calls = []

        def failing_save(tensors, path, metadata=None):
            calls.append(path)
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            from safetensors.torch import save_file as real_save

            real_save(tensors, path, metadata=metadata)
        monkeypatch.setattr(io.ShardWriter, "flush", _flush_with(failing_save))
        expect_rc, expect = 2, "no space left on the device"
    rc, err = run(capsys, src, out, "--format", "mxfp8", "--overwrite",
                  "--num-layers-at-start-in-bf16", "1", "--max-shard-size", "60KB")
    assert rc == expect_rc and expect in err
    assert _tree(out) == before  # same files, same bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no temp / old sibling left


@pytest.mark.parametrize("size", ["0.5B", "0", "abc"])
def test_max_shard_size_below_one_byte_is_a_clear_error(size):
    from miles_lp.cli.convert import parse_size
    from miles_lp.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"--max-shard-size: cannot read '{size}' as a size of at least one byte"):
        parse_size(size)


def test_engine_checkpoint_record_without_plan_names_the_file(tmp_path):
    from miles_lp.errors import CheckpointError
    from miles_lp.rollout.checkpoint import PLAN_FILE, open_checkpoint
    from miles_lp.rollout.testing import tiny_checkpoint

    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint("qwen3", "mxfp8"), ck)
    rec = json.loads((ck / PLAN_FILE).read_text())
    (ck / PLAN_FILE).write_text(json.dumps({k: v for k, v in rec.items() if k != "plan"}))
    with pytest.raises(CheckpointError, match=rf"{PLAN_FILE}: no plan recorded; .* re-run `miles-lp convert`"):
        open_checkpoint(ck)


def test_a_cli_bf16_pattern_that_matches_nothing_is_an_error(capsys, src, tmp_path):
    """Miles' --extra-high-precision-layers-hf matches substrings; ours match whole names: 'self_attn' alone would
    keep nothing BF16 (every attention layer quantized, exit 0). Refused, with the whole-name pattern suggested."""
    rc, err = run(capsys, src, tmp_path / "out", "--format", "mxfp8", "--extra-high-precision-layers-hf", "self_attn")
    assert rc == 2 and "--bf16-pattern self_attn matched no tensor" in err and "did you mean '*self_attn*'" in err
    nothing_left(tmp_path / "out")
    assert run(capsys, src, tmp_path / "out", "--format", "mxfp8", "--bf16-pattern", "*self_attn*")[0] == 0
