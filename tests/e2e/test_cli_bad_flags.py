"""Bad flag values of the smaller commands: exit 2 with one line naming the flag, nothing half-written."""

from __future__ import annotations

from pathlib import Path

from miles_lp.cli import main

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "deepseek_v3_config.json"


def test_make_tiny_model_bad_shard_size(tmp_path, capsys):
    assert main(["make-tiny-model", "--arch", "qwen3", "--out", str(tmp_path / "m"), "--max-shard-size", "banana"]) == 2
    err = capsys.readouterr().err
    assert "--max-shard-size: cannot read 'banana'" in err and "Traceback" not in err
    assert not (tmp_path / "m").exists()


def test_explain_save_plan_needs_a_folder_that_exists(tmp_path, capsys):
    recipe = str(ROOT / "recipes" / "policies/deepseek-v3-mxfp8.yaml")
    assert main(["explain", recipe, "--model", str(FIXTURE), "--save-plan", str(tmp_path / "no" / "plan.json")]) == 2
    assert "the folder" in capsys.readouterr().err and not (tmp_path / "no").exists()
    assert main(["explain", recipe, "--model", str(FIXTURE), "--save-plan", str(tmp_path)]) == 2
    assert "is a folder; name a file" in capsys.readouterr().err
    assert main(["explain", recipe, "--model", str(FIXTURE), "--save-plan", str(tmp_path / "plan.json")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no temporary left


def test_report_out_is_a_file(tmp_path, capsys):
    f = tmp_path / "x.json"
    f.write_text("{}")
    assert main(["report", str(tmp_path), "--out", str(f)]) == 2
    assert f"--out {f} is a file" in capsys.readouterr().err and f.read_text() == "{}"


def test_an_output_under_a_regular_file_is_one_line_naming_it(tmp_path, capsys):
    """Convert / make-tiny-model output under a regular file was a FileExistsError traceback."""
    (tmp_path / "afile").write_text("x")
    assert main(["make-tiny-model", "--arch", "qwen3", "--out", str(tmp_path / "afile" / "m")]) == 2
    err = capsys.readouterr().err
    assert "afile is a file, not a folder" in err and "--out" in err and "Traceback" not in err
    src = tmp_path / "tiny"
    assert main(["make-tiny-model", "--arch", "qwen3", "--num-layers", "1", "--out", str(src)]) == 0
    capsys.readouterr()
    assert main(["convert", "--hf-checkpoint", str(src), "--output", str(tmp_path / "afile" / "c"),
                 "--format", "mxfp8"]) == 2
    assert "afile is a file, not a folder" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "x"


def test_make_tiny_model_one_byte_shards(tmp_path):
    """``--max-shard-size 1`` (one byte: every tensor its own shard) reached transformers as the text '1'."""
    out = tmp_path / "m"
    assert main(["make-tiny-model", "--arch", "qwen3", "--num-layers", "1", "--out", str(out), "--max-shard-size",
                 "1"]) == 0
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()


def test_convert_layer_flags_beyond_the_model_name_the_flag(tmp_path, capsys):
    """The plan's error described a 'first 10' rule the user never wrote."""
    src = tmp_path / "tiny"
    assert main(["make-tiny-model", "--arch", "qwen3", "--num-layers", "2", "--out", str(src)]) == 0
    capsys.readouterr()
    assert main(["convert", "--hf-checkpoint", str(src), "--output", str(tmp_path / "c"), "--format", "mxfp8",
                 "--num-layers-at-end-in-bf16", "3"]) == 2
    err = capsys.readouterr().err
    assert "--num-layers-at-end-in-bf16 3:" in err and "has 2 layers; pass at most 2" in err
    assert not (tmp_path / "c").exists()
