"""Toy tasks and the JSONL loader: rewards by hand, determinism per (seed, step), bad input."""

from __future__ import annotations

import json

import pytest
import torch

from miles_lp.config import Where, parse_dataclass
from miles_lp.errors import ConfigError
from miles_lp.rl.tasks import BOS, EOS, SEP, Prompt, Task, TaskConfig, make_task


def cfg(**kw):
    return parse_dataclass(TaskConfig, kw, Where("r.yaml", "task", {"task": 2}))


def test_copy_reverse_majority_answers_and_rewards():
    t = make_task(cfg(name="copy", length=3))
    assert isinstance(t, Task) and t.max_response_len == 4 and t.stop_token_ids == (EOS,)
    p = Prompt((BOS, 5, 6, 7, SEP), (5, 6, 7, EOS))
    assert t.reward(p, [5, 6, 7, EOS]) == 1.0
    assert t.reward(p, [5, 6, 4, EOS]) == pytest.approx((3 + 0.1) / 4)  # a wrong symbol earns 0.1
    assert t.reward(p, [5, 200, 7]) == pytest.approx(2 / 4)  # non-symbol 0, missing EOS 0
    assert t.reward(p, [5, 6, 7, 4]) == pytest.approx(3 / 4)  # a symbol where EOS is due earns nothing
    assert t.reward(p, []) == 0.0
    (rp,) = make_task(cfg(name="reverse", length=3)).prompts(0, 1)
    assert rp.answer == tuple(reversed(rp.ids[1:-1])) + (EOS,)
    for mp in make_task(cfg(name="majority", length=5, alphabet=3)).prompts(0, 20):
        syms = list(mp.ids[1:-1])
        m = mp.answer[0]
        assert all(syms.count(m) > syms.count(s) for s in set(syms) - {m}) and mp.answer[1] == EOS


def test_prompts_are_a_function_of_seed_and_step():
    t = make_task(cfg(name="copy", seed=3))
    assert t.prompts(5, 4) == t.prompts(5, 4)
    assert t.prompts(5, 4) != t.prompts(6, 4)
    assert make_task(cfg(name="copy", seed=4)).prompts(5, 4) != t.prompts(5, 4)


def test_random_policy_reward_is_low_but_not_zero():
    t = make_task(cfg(name="copy", length=2, alphabet=8))
    g = torch.Generator().manual_seed(0)
    ps = t.prompts(0, 4000)
    r = [t.reward(p, torch.randint(0, 256, (3,), generator=g).tolist()) for p in ps]
    mean = sum(r) / len(r)
    assert 0.002 < mean < 0.02  # ~ (1 + 0.7) / 256 per position


def test_jsonl_loader(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": [1, 9, 3], "answer": [9]}) + "\n\n" +
                 json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n")
    t = make_task(cfg(name="jsonl", path=str(f), eos_id=10))
    assert [p.answer for p in t.items] == [(9, 10), (ord("4"), 10)]
    assert t.items[1].ids == tuple(b"2+2=")
    assert t.reward(t.items[0], [9, 10]) == 1.0 and t.reward(t.items[0], [9]) == 0.0
    # an epoch visits every item once; the order is deterministic
    assert sorted(p.answer for p in t.prompts(0, 2)) == sorted(p.answer for p in t.items)
    assert t.prompts(3, 2) == t.prompts(3, 2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": [1], "answer": [2]}\n{"prompt": [1], "answr": [2]}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:2: expected"):
        make_task(cfg(name="jsonl", path=str(bad)))
    bad.write_text('{"prompt": [1, -3], "answer": [2]}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1 prompt: expected a string or a list"):
        make_task(cfg(name="jsonl", path=str(bad)))
    bad.write_text('{"prompt": [1, 300], "answer": [2]}\n')
    with pytest.raises(ConfigError, match="up to 300 but the model's vocabulary has 256"):
        make_task(cfg(name="jsonl", path=str(bad)), vocab_size=256)
    with pytest.raises(ConfigError, match="cannot read"):
        make_task(cfg(name="jsonl", path=str(tmp_path / "missing.jsonl")))


def test_task_config_errors():
    with pytest.raises(ConfigError, match="r.yaml: 'task.name': unknown task 'cpy' \\(did you mean 'copy'"):
        cfg(name="cpy")
    with pytest.raises(ConfigError, match="needs path"):
        cfg(name="jsonl")
    with pytest.raises(ConfigError, match="majority needs length >= 3"):
        cfg(name="majority", length=2)
    with pytest.raises(ConfigError, match="unknown key 'lenght'"):
        cfg(lenght=3)


def _real_model_folder(path, with_tokenizer: bool, eos=None):
    """A (non-tiny) model folder: config.json, optionally a word-level tokenizer (tokenizers library)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3", **({"eos_token_id": eos} if eos else {})}))
    if with_tokenizer:
        from tokenizers import Regex, Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {"[UNK]": 0, "2": 5, "+": 6, "=": 7, "4": 8}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")  # one token per character
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(path))
    return path


def test_jsonl_on_a_real_model_uses_its_tokenizer_and_eos(tmp_path):
    """A real model's strings go through its own tokenizer (ids 0-255 of a BPE vocabulary are not the bytes) and
    its eos_token_id ends every answer; without tokenizer files strings are refused; a tiny model keeps bytes."""
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n")
    model = _real_model_folder(tmp_path / "m", True, eos=[9, 10])  # Qwen3 lists two EOS ids
    t = make_task(cfg(name="jsonl", path=str(f)), model_dir=model)
    assert t.items[0].ids == (5, 6, 5, 7) and t.items[0].answer == (8, 9) and t.stop_token_ids == (9, 10)
    assert "tokenizer" in t.encoding
    # the reward reads the decoded text and takes any EOS: the answer written as other ids still counts
    item = t.items[0]
    assert t.reward(item, [8, 9]) == t.reward(item, [8, 10]) == 1.0
    assert t.reward(item, [8]) == 0.0 and t.reward(item, [5, 9]) == 0.0
    t._decode = lambda ids: " 4 " if list(ids) == [0, 0] else "x"  # a tokenization of " 4 " the answer never had
    assert t.reward(item, [0, 0, 9]) == 1.0
    t3 = make_task(cfg(name="jsonl", path=str(f), eos_id=3), model_dir=model)
    assert t3.items[0].answer == (8, 3) and t3.stop_token_ids == (3,)
    bare = _real_model_folder(tmp_path / "bare", False, eos=9)
    with pytest.raises(ConfigError, match="d.jsonl:1 prompt: a string field needs the model's tokenizer"):
        make_task(cfg(name="jsonl", path=str(f)), model_dir=bare)
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"prompt": [5, 6], "answer": [8]}) + "\n")
    assert make_task(cfg(name="jsonl", path=str(ids)), model_dir=bare).items[0].answer == (8, 9)
    no_eos = _real_model_folder(tmp_path / "noeos", False)
    with pytest.raises(ConfigError, match="task.eos_id: the model folder states no eos_token_id"):
        make_task(cfg(name="jsonl", path=str(ids)), model_dir=no_eos)
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "miles_lp_tiny.json").write_text("{}")
    assert make_task(cfg(name="jsonl", path=str(f)), model_dir=tiny).items[0].ids == tuple(b"2+2=")
