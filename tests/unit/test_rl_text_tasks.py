"""Text tasks: math answer extraction, reward functions by import path, chat templates, the arithmetic task."""

from __future__ import annotations

import json
import sys

import pytest

from miles_lp.config import Where, parse_dataclass
from miles_lp.errors import ConfigError
from miles_lp.rl import arithmetic
from miles_lp.rl.chat import check_messages, prompt_text
from miles_lp.rl.math_answer import answers_match, extract_answer, last_boxed, math_reward
from miles_lp.rl.rewards import call_reward, resolve_reward
from miles_lp.rl.tasks import TaskConfig, make_task

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def cfg(**kw):
    return parse_dataclass(TaskConfig, kw, Where("r.yaml", "task", {"task": 2}))


# ---- math answers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    ("9 + 6 = 15", "15"),
    ("The answer is 1,234.", "1234"),
    ("so x = -3.5 and then", "-3.5"),
    ("step 1: 4 apples\n#### 72\nI think 80", "72"),          # #### beats the last number
    ("#### $1,000", "1000"),
    ("first \\boxed{3} then \\boxed{\\frac{1}{2}} #### 9", "\\frac{1}{2}"),  # the last box beats ####
    ("\\boxed{{a}+{b}}", "{a}+{b}"),                            # nested braces
    ("\\boxed 42$ done", "42"),
    ("\\fbox{7}", "7"),
    ("no digits here", None),
    ("just a dot .", None),
])
def test_extract_answer(text, want):
    assert extract_answer(text) == want


def test_boxed_unbalanced_and_clip():
    assert last_boxed("\\boxed{12") is None
    assert extract_answer("\\boxed{12") == "12"  # no box: falls back to the last number
    assert extract_answer("7 " + "x" * 400) is None  # only the last 300 characters are read (verl's clip)


def test_answers_match_numbers_and_strings():
    assert answers_match("15.0", "15") and answers_match("1/2", "0.5") and answers_match("1,000", "1000")
    assert not answers_match("16", "15") and not answers_match(None, "15")
    assert answers_match("\\frac{1}{2}", "\\frac{1} {2}") and not answers_match("\\frac{1}{2}", "0.5")
    assert math_reward("9 + 6 = 15", "15") == 1.0 and math_reward("9 + 6 = 14", "15") == 0.0


# ---- rewards by import path -----------------------------------------------------------------------------------
@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_scores.py").write_text(
        "def score(response, answer):\n    return float(answer in response)\n"
        "def one_arg(response):\n    return 1.0\n"
        "def bad(response, answer):\n    return 'yes'\n"
        "def boom(response, answer):\n    raise KeyError('k')\n"
        "class Scorer:\n    @staticmethod\n    def score(response, answer, weight=2.0):\n        return weight\n"
        "NOT_CALLABLE = 3\n")
    (tmp_path / "broken_mod.py").write_text("raise RuntimeError('import failed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for m in ("my_scores", "broken_mod"):
        sys.modules.pop(m, None)


def test_resolve_reward_builtin_and_import_path(user_module):
    assert resolve_reward("math") is math_reward
    assert resolve_reward("exact")(" 4 ", "4") == 1.0
    fn = resolve_reward("my_scores:score")
    assert call_reward(fn, "it is 12", "12", "my_scores:score") == 1.0
    assert call_reward(resolve_reward("my_scores:Scorer.score"), "x", "y", "s") == 2.0


@pytest.mark.parametrize("spec, match", [
    ("nope", "neither a built-in reward"),
    ("my_scores.score", "neither a built-in reward"),
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("broken_mod:f", "importing 'broken_mod' raised RuntimeError: import failed"),
    ("my_scores:scor", "has no 'scor' \\(did you mean 'score'\\?\\)"),
    ("my_scores:NOT_CALLABLE", "is a int, not a function"),
    ("my_scores:one_arg", "must take \\(response: str, answer: str\\) -> float"),
])
def test_resolve_reward_errors(user_module, spec, match):
    with pytest.raises(ConfigError, match="task.reward: .*" + match):
        resolve_reward(spec)


def test_call_reward_errors_name_the_function(user_module):
    with pytest.raises(ConfigError, match="task.reward my_scores:bad returned 'yes'"):
        call_reward(resolve_reward("my_scores:bad"), "r", "a", "my_scores:bad")
    with pytest.raises(ConfigError, match="task.reward my_scores:boom raised KeyError"):
        call_reward(resolve_reward("my_scores:boom"), "r", "a", "my_scores:boom")
    assert call_reward(lambda r, a: True, "r", "a", "b") == 1.0


def test_task_config_reward_and_keys(user_module):
    assert cfg(name="jsonl", path="x", reward="my_scores:score").reward == "my_scores:score"
    with pytest.raises(ConfigError, match=r"r.yaml.*'task.reward': module 'my_scores' has no 'nope'"):
        cfg(name="jsonl", path="x", reward="my_scores:nope")
    with pytest.raises(ConfigError, match="'task.reward': reward is for task jsonl / arithmetic, not copy"):
        cfg(name="copy", reward="math")
    with pytest.raises(ConfigError, match="'task.max_value': max_value is for task arithmetic, not jsonl"):
        cfg(name="jsonl", path="x", max_value=50)
    with pytest.raises(ConfigError, match="'task.operations': a string of distinct"):
        cfg(name="arithmetic", operations="+/")
    with pytest.raises(ConfigError, match="'task.max_value': must be >= 2"):
        cfg(name="arithmetic", max_value=1)


# ---- chat templates -------------------------------------------------------------------------------------------
def _chat_model(path, template: str | None):
    """A (non-tiny) model folder with a one-token-per-character tokenizer, ChatML specials, eos <|im_end|>."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path.mkdir()
    chars = sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,?+-=\n"))
    vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(str(path))
    return path, fast


def test_prompt_text_rules():
    render = lambda msgs: "|".join(f"{m['role']}:{m['content']}" for m in msgs) + "|assistant:"  # noqa: E731
    assert prompt_text("hi", render, chat_template=None, system_prompt=None, where="w") == "user:hi|assistant:"
    assert prompt_text("hi", render, chat_template=None, system_prompt="be brief", where="w") == \
        "system:be brief|user:hi|assistant:"
    assert prompt_text("hi", render, chat_template=False, system_prompt=None, where="w") == "hi"
    assert prompt_text("hi", None, chat_template=None, system_prompt=None, where="w") == "hi"
    with pytest.raises(ConfigError, match="w: task.chat_template is true but the model's tokenizer has no chat"):
        prompt_text("hi", None, chat_template=True, system_prompt=None, where="w")
    with pytest.raises(ConfigError, match="w: messages need a chat template"):
        prompt_text([{"role": "user", "content": "x"}], None, chat_template=None, system_prompt=None, where="w")
    with pytest.raises(ConfigError, match="w: task.system_prompt needs a chat template"):
        prompt_text("hi", None, chat_template=None, system_prompt="s", where="w")
    with pytest.raises(ConfigError, match=r"m\[0\]: role 'bot' is not one of"):
        check_messages([{"role": "bot", "content": "x"}], "m")
    with pytest.raises(ConfigError, match=r"m\[1\]: expected"):
        check_messages([{"role": "user", "content": "x"}, {"role": "user"}], "m")


def test_jsonl_messages_and_prompt_through_the_template(tmp_path, user_module):
    model, tok = _chat_model(tmp_path / "m", CHATML)
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}) + "\n"
                 + json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n")
    t = make_task(cfg(name="jsonl", path=str(f)), model_dir=model)
    want = tok.encode("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert t.items[0].ids == t.items[1].ids == tuple(want)
    assert want[0] == 1 and want.count(2) == 1  # the special tokens are single ids, not characters
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n")
    raw = make_task(cfg(name="jsonl", path=str(p), chat_template=False), model_dir=model)
    assert raw.items[0].ids == tuple(tok.encode("2+2?", add_special_tokens=False))
    m = make_task(cfg(name="jsonl", path=str(f), reward="math"), model_dir=model)
    four = tok.encode("so 4", add_special_tokens=False)
    assert m.reward(m.items[0], four + [2]) == 1.0 and m.reward(m.items[0], four) == 1.0  # no stop needed
    u = make_task(cfg(name="jsonl", path=str(f), reward="my_scores:score"), model_dir=model)
    assert u.reward(u.items[0], tok.encode("x4x", add_special_tokens=False)) == 1.0
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"prompt": [5, 6], "answer": [8]}) + "\n")
    with pytest.raises(ConfigError, match="ids.jsonl:1: task.reward math compares text"):
        make_task(cfg(name="jsonl", path=str(ids), reward="math"), model_dir=model)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}], "prompt": "y", "answer": "4"}) + "\n")
    with pytest.raises(ConfigError, match="bad.jsonl:1: expected"):
        make_task(cfg(name="jsonl", path=str(bad)), model_dir=model)
    plain, _ = _chat_model(tmp_path / "plain", None)
    with pytest.raises(ConfigError, match="d.jsonl:1: messages need a chat template"):
        make_task(cfg(name="jsonl", path=str(f)), model_dir=plain)


# ---- arithmetic -----------------------------------------------------------------------------------------------
def test_arithmetic_problems_are_deterministic_and_right():
    a = arithmetic.training_problems(0, 3, 16, 20, "+-*")
    assert a == arithmetic.training_problems(0, 3, 16, 20, "+-*")
    assert a != arithmetic.training_problems(0, 4, 16, 20, "+-*")
    assert a != arithmetic.training_problems(1, 3, 16, 20, "+-*")
    for p in a:
        op = arithmetic.TEMPLATES[p.template][1]
        assert p.answer == eval(f"{p.a}{op}{p.b}") and p.answer >= 0  # noqa: S307 - our own digits
        assert p.text().endswith(arithmetic.INSTRUCTION) and str(p.a) in p.text()
    assert {arithmetic.TEMPLATES[p.template][1] for p in arithmetic.training_problems(0, 0, 64, 20, "+")} == {"+"}


def test_arithmetic_heldout_is_never_trained_on():
    held = arithmetic.heldout_problems(0, 64, 20, "+-")
    assert len(held) == 64 and len({(p.template, p.a, p.b) for p in held}) == 64
    keys = {(p.template, p.a, p.b) for p in held}
    trained = {(p.template, p.a, p.b) for s in range(200) for p in arithmetic.training_problems(0, s, 16, 20, "+-")}
    assert not keys & trained and len(trained) > 500
    frac = sum(p.held_out for s in range(50) for p in
               (arithmetic.draw(arithmetic._rng(9, 0, s), 20, "+-") for _ in range(20))) / 1000
    assert 0.08 < frac < 0.18  # about one in HELD_OUT_EVERY = 8 problems


def test_arithmetic_task_on_a_chat_model(tmp_path):
    model, tok = _chat_model(tmp_path / "m", CHATML)
    t = make_task(cfg(name="arithmetic", seed=3, system_prompt="Be brief."), model_dir=model)
    ps = t.prompts(0, 4)
    assert [p.ids for p in ps] == [p.ids for p in t.prompts(0, 4)]
    text = "".join(tok.convert_ids_to_tokens(list(ps[0].ids)))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    ans = tok.encode(f"It is {ps[0].text}.", add_special_tokens=False)
    assert t.reward(ps[0], ans + [2]) == 1.0 and t.reward(ps[0], ans) == 1.0
    assert t.reward(ps[0], tok.encode("It is 999", add_special_tokens=False)) == 0.0
    assert t.max_prompt_len >= max(len(p.ids) for p in ps) and t.stop_token_ids == (2,)
    assert t.max_response_len == len(tok.encode("40", add_special_tokens=False)) + 1  # 20 + 20, then EOS
    held = t.heldout(8)
    assert len(held) == 8 and not {p.ids for p in held} & {p.ids for s in range(20) for p in t.prompts(s, 8)}


def test_arithmetic_on_a_tiny_model_uses_bytes():
    t = make_task(cfg(name="arithmetic"))
    p = t.prompts(0, 1)[0]
    assert bytes(p.ids).decode().endswith(arithmetic.INSTRUCTION)
    assert t.reward(p, list(f"= {p.text}".encode())) == 1.0


def test_arithmetic_styles():
    direct = arithmetic.training_problems(0, 0, 32, 10, "+-", "direct")
    assert all(p.template >= arithmetic.WORD_TEMPLATES for p in direct)
    assert direct[0].text().startswith("What is ") and direct[0].text().endswith(arithmetic.INSTRUCTION)
    word = arithmetic.training_problems(0, 0, 32, 10, "+-", "word")
    assert all(p.template < arithmetic.WORD_TEMPLATES for p in word)
    mixed = {p.template < arithmetic.WORD_TEMPLATES for p in arithmetic.training_problems(0, 0, 64, 10, "+-", "mixed")}
    assert mixed == {True, False}
    held = arithmetic.heldout_problems(0, 16, 10, "+-", "direct")
    assert len(held) == 16 and all(p.held_out and p.template >= arithmetic.WORD_TEMPLATES for p in held)
    with pytest.raises(ConfigError, match="'task.style': must be one of word, direct, mixed"):
        cfg(name="arithmetic", style="story")
    with pytest.raises(ConfigError, match="'task.style': style is for task arithmetic, not copy"):
        cfg(name="copy", style="direct")
