"""Tasks with verifiable rewards: a registry of ``Task`` implementations (``typing.Protocol``).

Work in token ids (the tiny models have no tokenizer). Token layout of the built-in toy tasks:
``0`` pad, ``1`` BOS, ``2`` EOS, ``3`` SEP, symbols ``4 .. 4 + alphabet - 1``.

- ``copy``:     ``[BOS, s1..sk, SEP]`` -> ``s1..sk EOS``
- ``reverse``:  ``[BOS, s1..sk, SEP]`` -> ``sk..s1 EOS``
- ``majority``: ``[BOS, s1..sn, SEP]`` (one symbol strictly most frequent) -> ``m EOS``
- ``jsonl``:    prompt/answer pairs from a file (token-id lists, or strings read as UTF-8 bytes, one token per
  byte: a 256-token byte tokenizer that fits the tiny models' vocabulary); reward = exact match, or
  ``task.reward`` (a built-in ``exact`` / ``math``, or ``package.module:function``: ``rl/rewards.py``). A line gives
  ``prompt`` (a string or token ids) or ``messages`` (chat messages); strings go through the model's chat
  template (``rl/chat.py``).
- ``arithmetic``: generated word problems (``rl/arithmetic.py``), chat-templated, scored by the math reward
  (last number / ``\\boxed{}`` / ``#### n``: ``rl/math_answer.py``); ``heldout(n)`` lists problems never trained on.

Toy rewards are shaped so that an untrained policy gets a low but non-zero mean: per answer position 1 for
the right token, ``wrong_symbol_credit`` (default 0.1) for a wrong symbol where a symbol is due, 0 for
anything else (so a symbol never earns credit where EOS is due); the reward is the mean over the answer positions (EOS included). A uniform random policy
over 256 tokens gets about 0.006 on ``copy`` (alphabet 8); the exact answer gets 1.

Prompts are a pure function of ``(seed, step)`` (``prompts(step, n)``), so a resumed run draws the same
prompts as an uninterrupted one: the data position is the step.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from miles_lp.config import Where
from miles_lp.errors import ConfigError
from miles_lp.rl.chat import RenderChat

PAD, BOS, EOS, SEP, FIRST_SYMBOL = 0, 1, 2, 3, 4


@dataclasses.dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    answer: tuple[int, ...]  # the expected response, stop token included
    text: str | None = None  # a text task's expected answer string (what its reward function compares)


@runtime_checkable
class Task(Protocol):
    name: str
    stop_token_ids: tuple[int, ...]
    max_response_len: int  # tokens the exact answer needs (stop token included)
    max_prompt_len: int  # tokens of the longest prompt (with max_response_len: what the context must hold)

    def prompts(self, step: int, n: int) -> list[Prompt]:
        """``n`` prompts for ``step``: the same for the same (seed, step), whatever ran before."""
        ...

    def reward(self, prompt: Prompt, response: Sequence[int]) -> float:
        """The verifiable reward of one response (token ids as sampled, stop token included if emitted)."""
        ...


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The recipe's ``task:`` section."""

    name: str = "copy"  # a key of TASKS
    length: int = 2  # copy/reverse: pattern length; majority: prompt symbols
    alphabet: int = 8  # number of symbols
    wrong_symbol_credit: float = 0.1
    seed: int = 0
    path: str | None = None  # jsonl: the file
    #: jsonl: the stop token appended to every answer; None: the model's own EOS (generation_config.json /
    #: config.json eos_token_id), the toy vocabulary's for a tiny model
    eos_id: int | None = None
    #: jsonl / arithmetic: a built-in reward (exact | math) or 'package.module:function' (rl/rewards.py);
    #: None: exact match of the answer + stop token (jsonl), math (arithmetic)
    reward: str | None = None
    #: jsonl / arithmetic: null = the model's chat template when it has one; true = always; false = never
    chat_template: bool | None = None
    system_prompt: str | None = None  # jsonl / arithmetic: a system message before each prompt (chat template)
    max_value: int = 20  # arithmetic: operands in 1..max_value (products: 2..min(max_value, 12))
    operations: str = "+-"  # arithmetic: any of + - *
    style: str = "word"  # arithmetic: word (problems) | direct ("What is 7 + 5?") | mixed

    def _validate(self, where: Where) -> None:
        if self.name not in TASKS:
            from miles_lp.config import suggest

            raise where.child("name").error(f"unknown task '{self.name}'{suggest(self.name, TASKS)}; "
                                            f"tasks: {', '.join(TASKS)}")
        if self.length < 1:
            raise where.child("length").error(f"must be >= 1, got {self.length}")
        if self.alphabet < 2:
            raise where.child("alphabet").error(f"must be >= 2, got {self.alphabet}")
        if not 0 <= self.wrong_symbol_credit < 1:
            raise where.child("wrong_symbol_credit").error(f"must be in [0, 1), got {self.wrong_symbol_credit}")
        if self.name == "jsonl" and not self.path:
            raise where.child("path").error("task jsonl needs path: FILE.jsonl (lines {\"prompt\": ..., "
                                            "\"answer\": ...})")
        if self.name != "jsonl" and self.path is not None:
            raise where.child("path").error(f"path is for task jsonl; task {self.name} generates its prompts")
        text_keys = {"reward": None, "chat_template": None, "system_prompt": None}
        arith_keys = {"max_value": 20, "operations": "+-", "style": "word"}
        for keys, names in ((text_keys, TEXT_TASKS), (arith_keys, ("arithmetic",))):
            for key, default in keys.items():
                if self.name not in names and getattr(self, key) != default:
                    raise where.child(key).error(f"{key} is for task {' / '.join(names)}, not {self.name}")
        if self.reward is not None:
            from miles_lp.rl.rewards import resolve_reward

            try:
                resolve_reward(self.reward)
            except ConfigError as exc:
                raise where.child("reward").error(str(exc).removeprefix("task.reward: ")) from None
        if self.max_value < 2:
            raise where.child("max_value").error(f"must be >= 2, got {self.max_value}")
        if not self.operations or set(self.operations) - set("+-*") or len(set(self.operations)) != len(
                self.operations):
            raise where.child("operations").error(f"a string of distinct + - * (e.g. '+-'), got {self.operations!r}")
        from miles_lp.rl.arithmetic import STYLES

        if self.style not in STYLES:
            raise where.child("style").error(f"must be one of {', '.join(STYLES)}, got {self.style!r}")
        if self.name == "majority" and self.length < 3:
            raise where.child("length").error("majority needs length >= 3 (a strict majority among >= 3 symbols)")


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63 - 1))


class _ToyTask:
    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg
        self.name = cfg.name
        self.stop_token_ids = (EOS,)
        self.symbols = range(FIRST_SYMBOL, FIRST_SYMBOL + cfg.alphabet)
        self.max_response_len = len(self._answer([FIRST_SYMBOL] * cfg.length)) + 1  # + EOS
        self.max_prompt_len = cfg.length + 2  # BOS pattern SEP

    def min_vocab(self) -> int:
        return FIRST_SYMBOL + self.cfg.alphabet

    def _pattern(self, g: torch.Generator) -> list[int]:
        return (torch.randint(0, self.cfg.alphabet, (self.cfg.length,), generator=g) + FIRST_SYMBOL).tolist()

    def _answer(self, pattern: list[int]) -> list[int]:
        raise NotImplementedError

    def prompts(self, step: int, n: int) -> list[Prompt]:
        g = _generator(self.cfg.seed, step)
        out = []
        for _ in range(n):
            pat = self._pattern(g)
            out.append(Prompt((BOS, *pat, SEP), tuple(self._answer(pat)) + (EOS,)))
        return out

    def reward(self, prompt: Prompt, response: Sequence[int]) -> float:
        score = 0.0
        for i, want in enumerate(prompt.answer):
            got = response[i] if i < len(response) else None
            if got == want:
                score += 1.0
            elif want in self.symbols and got in self.symbols:  # partial credit at symbol positions only
                score += self.cfg.wrong_symbol_credit
        return score / len(prompt.answer)


class CopyTask(_ToyTask):
    def _answer(self, pattern):
        return list(pattern)


class ReverseTask(_ToyTask):
    def _answer(self, pattern):
        return list(reversed(pattern))


class MajorityTask(_ToyTask):
    def _pattern(self, g):
        while True:  # rejection-sample patterns with a strict majority symbol
            pat = super()._pattern(g)
            counts = sorted(((pat.count(s), s) for s in set(pat)), reverse=True)
            if len(counts) == 1 or counts[0][0] > counts[1][0]:
                return pat

    def _answer(self, pattern):
        return [max(set(pattern), key=pattern.count)]


def utf8_bytes(text: str, where: str) -> tuple[int, ...]:
    """A tiny model's string encoding: one token id per UTF-8 byte (the tiny vocabularies have no tokenizer)."""
    return tuple(text.encode("utf-8"))


def encode(value: Any, where: str, text_encoder: Callable[[str, str], tuple[int, ...]] = utf8_bytes
           ) -> tuple[int, ...]:
    """A JSONL field: a list of token ids, or a string (``text_encoder``: the model's tokenizer; UTF-8 bytes for a
    tiny model)."""
    if isinstance(value, str):
        return text_encoder(value, where)
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return tuple(value)
    raise ConfigError(f"{where}: expected a string or a list of non-negative token ids, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TextCodec:
    """How a jsonl task turns strings into token ids for its model, and back (for the reward)."""

    encode: Callable[[str, str], tuple[int, ...]] = utf8_bytes
    decode: Callable[[Sequence[int]], str] | None = None  # None: answers are compared as token ids
    eos_ids: tuple[int, ...] = (EOS,)
    description: str = "UTF-8 bytes (tiny model)"
    render_chat: RenderChat | None = None  # the model's chat template (rl/chat.py); None: it has none


def utf8_text(ids: Sequence[int]) -> str:
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def model_text_encoding(model_dir: Path) -> TextCodec:
    """A real (non-tiny) model folder's codec: its own tokenizer (ids 0-255 of a byte-level BPE vocabulary are not
    the bytes 0-255) and its EOS ids (every one a stop token); without tokenizer files a string field is refused."""
    eos: tuple[int, ...] = ()
    for name in ("generation_config.json", "config.json"):
        f = model_dir / name
        if not eos and f.is_file():
            v = json.loads(f.read_text()).get("eos_token_id")
            eos = tuple(int(x) for x in v) if isinstance(v, list) else (int(v),) if isinstance(v, int) else ()
    files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
    try:
        if not any((model_dir / n).is_file() for n in files) and not any(model_dir.glob("*.tiktoken")):
            raise FileNotFoundError(f"none of {', '.join(files)}, *.tiktoken")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - no tokenizer files, or one transformers cannot read
        why = f"{type(exc).__name__}: {str(exc)[:160]}"

        def refuse(text: str, where: str) -> tuple[int, ...]:
            raise ConfigError(f"{where}: a string field needs the model's tokenizer, and {model_dir} has none that "
                              f"loads ({why}); give token-id lists, or add the tokenizer files to the model folder")
        return TextCodec(refuse, None, eos, "token-id lists only (no tokenizer)")

    def tokenize(text: str, where: str) -> tuple[int, ...]:
        return tuple(tok.encode(text, add_special_tokens=False))

    def detokenize(ids: Sequence[int]) -> str:
        return tok.decode(list(ids), skip_special_tokens=False)
    from miles_lp.rl.chat import template_renderer

    return TextCodec(tokenize, detokenize, eos, f"the tokenizer of {model_dir}", template_renderer(tok))


class _TextTask:
    """What the text tasks share: the stop tokens (the model's EOS), prompt strings through the chat template, and
    the reward of a decoded response (``task.reward``)."""

    def __init__(self, cfg: TaskConfig, codec: TextCodec | None):
        codec = codec or TextCodec()
        self.cfg, self.codec = cfg, codec
        eos = (cfg.eos_id,) if cfg.eos_id is not None else codec.eos_ids
        if not eos:
            raise ConfigError("task.eos_id: the model folder states no eos_token_id (generation_config.json / "
                              "config.json); set task.eos_id to the token every answer ends with")
        self.eos_id, self.encoding = int(eos[0]), codec.description
        self.stop_token_ids = tuple(int(e) for e in eos)  # every EOS the model may end with stops generation
        self._decode = codec.decode if codec.decode is not None else (utf8_text if codec.encode is utf8_bytes
                                                                      else None)
        self.reward_name = cfg.reward
        self._reward_fn = None
        if cfg.reward is not None:
            from miles_lp.rl.rewards import resolve_reward

            self._reward_fn = resolve_reward(cfg.reward)

    def encode_prompt(self, item: str | list, where: str) -> tuple[int, ...]:
        from miles_lp.rl.chat import prompt_text

        text = prompt_text(item, self.codec.render_chat, chat_template=self.cfg.chat_template,
                           system_prompt=self.cfg.system_prompt, where=where)
        return self.codec.encode(text, where)

    def response_text(self, response: Sequence[int]) -> str:
        """The decoded response, a trailing stop token removed (the text a reward function sees)."""
        ids = list(response)
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return self._decode(ids)

    def scored(self, prompt: Prompt, response: Sequence[int]) -> float:
        from miles_lp.rl.rewards import call_reward

        return call_reward(self._reward_fn, self.response_text(response), prompt.text, self.reward_name)


class JsonlTask(_TextTask):
    """Prompt/answer pairs from a JSONL file; reward 1 for an exact match of the answer + stop token, or
    ``task.reward`` on the decoded response."""

    def __init__(self, cfg: TaskConfig, codec: TextCodec | None = None):
        super().__init__(cfg, codec)
        self.name = "jsonl"
        if self._reward_fn is not None and self._decode is None:
            raise ConfigError("task.reward scores decoded text, and the model has no tokenizer to decode with")
        path = Path(cfg.path)
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"task jsonl: cannot read {path}: {exc.strerror}") from None
        self.items: list[Prompt] = []
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{i}: invalid JSON: {exc.msg}") from None
            if not isinstance(obj, dict) or set(obj) not in ({"prompt", "answer"}, {"messages", "answer"}):
                raise ConfigError(f"{path}:{i}: expected {{\"prompt\": ..., \"answer\": ...}} or "
                                  f"{{\"messages\": [...], \"answer\": ...}} and nothing else")
            if "messages" in obj:
                from miles_lp.rl.chat import check_messages

                p = self.encode_prompt(check_messages(obj["messages"], f"{path}:{i} messages"), f"{path}:{i}")
            elif isinstance(obj["prompt"], str):
                p = self.encode_prompt(obj["prompt"], f"{path}:{i} prompt")
            else:
                p = encode(obj["prompt"], f"{path}:{i} prompt", self.codec.encode)
            a = encode(obj["answer"], f"{path}:{i} answer", self.codec.encode)
            if not p:
                raise ConfigError(f"{path}:{i}: empty prompt")
            if self._reward_fn is not None and not isinstance(obj["answer"], str):
                raise ConfigError(f"{path}:{i}: task.reward {cfg.reward} compares text: the answer must be a string")
            # a string answer on a tokenizer-encoded model is compared as text (see reward)
            text = obj["answer"] if isinstance(obj["answer"], str) and (
                self._reward_fn is not None or self.codec.decode is not None) else None
            self.items.append(Prompt(p, a + (self.eos_id,), text))
        if not self.items:
            raise ConfigError(f"{path}: no prompt/answer lines")
        self.max_response_len = max(len(p.answer) for p in self.items)
        self.max_prompt_len = max(len(p.ids) for p in self.items)

    def min_vocab(self) -> int:
        return 1 + max(max(p.ids + p.answer) for p in self.items)

    def prompts(self, step: int, n: int) -> list[Prompt]:
        # epoch e visits the items in a permutation seeded by (seed, e): position step*n + j
        out = []
        for j in range(n):
            pos = step * n + j
            epoch, idx = divmod(pos, len(self.items))
            perm = torch.randperm(len(self.items), generator=_generator(self.cfg.seed, epoch))
            out.append(self.items[int(perm[idx])])
        return out

    def reward(self, prompt: Prompt, response: Sequence[int]) -> float:
        """``task.reward`` on the decoded response when set. Else 1 for the answer followed by any of the stop
        tokens; a string answer on a tokenizer-encoded model is compared as decoded text (stripped): in context the
        model writes the same text as other ids (a merged leading space, another split), as verl / slime rewards
        compare text."""
        if self._reward_fn is not None:
            return self.scored(prompt, response)
        response = tuple(response)
        if not response or response[-1] not in self.stop_token_ids:
            return 0.0
        if prompt.text is not None:
            return 1.0 if self._decode(response[:-1]).strip() == prompt.text.strip() else 0.0
        return 1.0 if response[:-1] == prompt.answer[:-1] else 0.0


class ArithmeticTask(_TextTask):
    """Generated word problems (``rl/arithmetic.py``) with the math reward (or ``task.reward``); the response is
    scored whether or not it reached the stop token (verl's math rewards score the decoded text as it is)."""

    def __init__(self, cfg: TaskConfig, codec: TextCodec | None = None):
        super().__init__(cfg, codec)
        from miles_lp.rl import arithmetic
        from miles_lp.rl.math_answer import math_reward

        self.name = "arithmetic"
        self._arith = arithmetic
        if self._reward_fn is None:
            self._reward_fn, self.reward_name = math_reward, "math"
        longest = [self._prompt(p) for p in arithmetic.longest_problems(cfg.max_value, cfg.operations, cfg.style)]
        self.max_prompt_len = max(len(p.ids) for p in longest)
        self.max_response_len = max(len(p.answer) for p in longest)

    def _prompt(self, problem) -> Prompt:
        ids = self.encode_prompt(problem.text(), "task arithmetic")
        answer = str(problem.answer)
        return Prompt(ids, self.codec.encode(answer, "task arithmetic answer") + (self.eos_id,), answer)

    def min_vocab(self) -> int:
        return 1 + max(max(p.ids + p.answer) for p in self.prompts(0, 8))

    def prompts(self, step: int, n: int) -> list[Prompt]:
        c = self.cfg
        return [self._prompt(p) for p in self._arith.training_problems(c.seed, step, n, c.max_value, c.operations,
                                                                            c.style)]

    def heldout(self, n: int) -> list[Prompt]:
        """``n`` problems that ``prompts`` never draws, for any seed and step."""
        c = self.cfg
        return [self._prompt(p) for p in self._arith.heldout_problems(c.seed, n, c.max_value, c.operations, c.style)]

    def reward(self, prompt: Prompt, response: Sequence[int]) -> float:
        return self.scored(prompt, response)


#: The registry: task name -> factory. Add a task by adding an entry (SGLang-style explicit registry).
TASKS: dict[str, Callable[[TaskConfig], Task]] = {
    "copy": CopyTask, "reverse": ReverseTask, "majority": MajorityTask, "jsonl": JsonlTask,
    "arithmetic": ArithmeticTask}
#: the tasks whose prompts and answers are text (the model's tokenizer and chat template, task.reward)
TEXT_TASKS = ("jsonl", "arithmetic")


def make_task(cfg: TaskConfig, vocab_size: int | None = None, model_dir: Path | None = None) -> Task:
    """The recipe's task. ``model_dir``: the model folder; a real (non-tiny) model's text-task strings go through its
    tokenizer and chat template, and its EOS ends every answer (a tiny model: UTF-8 bytes and the toy EOS)."""
    if cfg.name in TEXT_TASKS and model_dir is not None and not (Path(model_dir) / "miles_lp_tiny.json").is_file():
        task = TASKS[cfg.name](cfg, model_text_encoding(Path(model_dir)))
    else:
        task = TASKS[cfg.name](cfg)
    if vocab_size is not None and task.min_vocab() > vocab_size:
        raise ConfigError(f"task {cfg.name} uses token ids up to {task.min_vocab() - 1} but the model's vocabulary "
                          f"has {vocab_size} tokens; lower task.alphabet or use a larger model")
    return task
