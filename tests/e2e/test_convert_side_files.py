"""`convert` and `export` carry every top-level side file of the input and say what they leave out.

DeepSeek-V3's HF repo ships ``configuration_deepseek.py`` / ``modeling_deepseek.py`` named by config.json's
``auto_map``; Kimi-K2 ships ``tiktoken.model`` + ``tokenization_kimi.py``; VL models ``preprocessor_config.json``.
Dropping them gave conversions whose config.json names files that are not there, and nothing was printed.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.cli import main

SIDE = {
    "configuration_deepseek.py": "class DeepseekV3Config: ...\n",
    "modeling_deepseek.py": "class DeepseekV3ForCausalLM: ...\n",
    "tokenization_kimi.py": "class TikTokenTokenizer: ...\n",
    "tiktoken.model": "aGVsbG8= 0\n",
    "preprocessor_config.json": '{"image_size": 224}\n',
    "tokenizer_config.json": '{"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", '
                             '"tokenization_kimi_fast.Fast"]}}\n',  # the fast one is absent
    "README.md": "# tiny\n",
}
NOT_COPIED = {"pytorch_model.bin": "pickle weights", "extra/": "a folder", "consolidated.safetensors": "weights",
              ".gitattributes": "a hidden file", "configuration_missing.py": "named by config.json auto_map",
              "tokenization_kimi_fast.py": "named by tokenizer_config.json auto_map, absent from"}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    p = make_tiny_model("deepseek_v3", tmp_path_factory.mktemp("ds") / "m", seed=1)
    cfg = json.loads((p / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                       "AutoModel": "modeling_deepseek.DeepseekV3Model",
                       "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
                       "AutoProcessor": "configuration_missing.Processor",  # named, but not in the folder
                       "AutoTokenizer": ["other/repo--tokenization_x.Tok", None]}  # another repo: not ours to check
    (p / "config.json").write_text(json.dumps(cfg))
    for name, text in SIDE.items():
        (p / name).write_text(text)
    (p / "pytorch_model.bin").write_bytes(b"\x80\x02 not unpickled")
    (p / "extra").mkdir()
    (p / "extra" / "readme").write_text("in a subfolder\n")
    (p / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    save_file({"tok_embeddings.weight": torch.zeros(4, 4)}, str(p / "consolidated.safetensors"))
    return p


def _check(out, src, stdout):
    for name, text in SIDE.items():
        assert (out / name).read_text() == text, name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_deepseek.DeepseekV3ForCausalLM"
    assert "quantization_config" in cfg
    for name in ("pytorch_model.bin", "extra", "consolidated.safetensors", ".gitattributes"):
        assert not (out / name).exists(), name
    line = next(ln for ln in stdout.splitlines() if ln.strip().startswith("not copied"))
    for name, why in NOT_COPIED.items():
        assert name in line and why in line.split(name, 1)[1], (name, line)
    assert "other/repo--tokenization_x" not in line
    copied = next(ln for ln in stdout.splitlines() if ln.strip().startswith("copied files"))
    assert all(name in copied for name in SIDE)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]  # atomic: no temp left


def test_convert_copies_side_files_and_lists_the_rest(src, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["convert", "--hf-checkpoint", str(src), "--output", str(out), "--format", "mxfp8", "--no-progress"])
    assert rc == 0
    _check(out, src, capsys.readouterr().out)


def test_export_copies_side_files_and_lists_the_rest(src, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["export", "--hf-checkpoint", str(src), "--output", str(out), "--format", "mxfp8"])
    assert rc == 0
    _check(out, src, capsys.readouterr().out)


def test_a_source_hf_quant_config_is_never_carried(src, tmp_path, capsys):
    s = tmp_path / "s"
    shutil.copytree(src, s)
    (s / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "FP8"}}')
    out = tmp_path / "out"
    assert main(["convert", "--hf-checkpoint", str(s), "--output", str(out), "--format", "mxfp8",
                 "--no-progress"]) == 0
    assert not (out / "hf_quant_config.json").exists()  # sglang MXFP8 writes none: the input's would mislead SGLang
    assert "hf_quant_config.json (the input's quantization metadata: the output's own" in capsys.readouterr().out
