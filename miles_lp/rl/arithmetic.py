"""A generated arithmetic word-problem task (no download): "Mia has 7 pencils. She buys 5 more. How many pencils
does Mia have now? Answer with only the number." -> ``12``, scored by the math reward (``math_answer``).

Deterministic: the problems of a step are a pure function of ``(task.seed, step)``. A fixed eighth of the problem
space (template, a, b: the numbers and the wording that decide the answer) is held out by a hash and never drawn
for training; ``heldout(n)`` lists ``n`` of those for an accuracy before / after a run. ``max_value`` sets the
difficulty (operands in ``1..max_value``; products use ``2..min(max_value, 12)``); ``style`` the wording: ``word``
problems, ``direct`` questions ("What is 7 + 5?"), or ``mixed``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random

#: (text, operation); {n} name, {p} pronoun, {i} item (plural). The first WORD_TEMPLATES are word problems, the
#: rest ask for the operation directly ("direct" style)
TEMPLATES: tuple[tuple[str, str], ...] = (
    ("{n} has {a} {i}. {P} buys {b} more. How many {i} does {n} have now?", "+"),
    ("There are {a} {i} in a box. {n} puts {b} more {i} in the box. How many {i} are in the box?", "+"),
    ("One shelf holds {a} {i} and another holds {b} {i}. How many {i} are there in total?", "+"),
    ("{n} has {a} {i} and gives {b} of them to a friend. How many {i} does {n} have left?", "-"),
    ("A basket holds {a} {i}. {n} takes {b} {i} out. How many {i} are still in the basket?", "-"),
    ("{n} buys {a} bags with {b} {i} in each bag. How many {i} does {n} have?", "*"),
    ("There are {a} rows of {i} with {b} {i} in each row. How many {i} are there?", "*"),
    ("What is {a} + {b}?", "+"),
    ("What is {a} - {b}?", "-"),
    ("What is {a} times {b}?", "*"),
)
WORD_TEMPLATES = 7
STYLES = ("word", "direct", "mixed")
NAMES = (("Mia", "She"), ("Tom", "He"), ("Ana", "She"), ("Leo", "He"), ("Sara", "She"), ("Ben", "He"))
ITEMS = ("apples", "pencils", "books", "stickers", "marbles", "cookies", "shells", "cards")
INSTRUCTION = "Reply with only the number."
#: 1 in HELD_OUT_EVERY problems (by hash) is held out
HELD_OUT_EVERY = 8


@dataclasses.dataclass(frozen=True)
class Problem:
    template: int
    a: int
    b: int
    name: int
    item: int

    @property
    def answer(self) -> int:
        op = TEMPLATES[self.template][1]
        return self.a + self.b if op == "+" else self.a - self.b if op == "-" else self.a * self.b

    def text(self) -> str:
        name, pronoun = NAMES[self.name]
        body = TEMPLATES[self.template][0].format(n=name, P=pronoun, i=ITEMS[self.item], a=self.a, b=self.b)
        return f"{body} {INSTRUCTION}"

    @property
    def held_out(self) -> bool:
        key = f"{self.template}:{self.a}:{self.b}".encode()
        return hashlib.sha256(key).digest()[0] % HELD_OUT_EVERY == 0


def _templates(operations: str, style: str) -> list[int]:
    span = {"word": range(WORD_TEMPLATES), "direct": range(WORD_TEMPLATES, len(TEMPLATES)),
            "mixed": range(len(TEMPLATES))}[style]
    return [k for k in span if TEMPLATES[k][1] in operations]


def draw(rng: random.Random, max_value: int, operations: str, style: str = "word") -> Problem:
    templates = _templates(operations, style)
    t = rng.choice(templates)
    op = TEMPLATES[t][1]
    if op == "*":
        hi = max(2, min(max_value, 12))
        a, b = rng.randint(2, hi), rng.randint(2, hi)
    else:
        a, b = rng.randint(1, max_value), rng.randint(1, max_value)
        if op == "-" and b > a:
            a, b = b, a
    return Problem(t, a, b, rng.randrange(len(NAMES)), rng.randrange(len(ITEMS)))


def _rng(seed: int, stream: int, step: int) -> random.Random:
    return random.Random(f"miles-lp-arithmetic:{seed}:{stream}:{step}")  # str seeds hash with sha512: stable


def training_problems(seed: int, step: int, n: int, max_value: int, operations: str, style: str = "word"
                      ) -> list[Problem]:
    rng = _rng(seed, 0, step)
    out: list[Problem] = []
    while len(out) < n:
        p = draw(rng, max_value, operations, style)
        if not p.held_out:
            out.append(p)
    return out


def heldout_problems(seed: int, n: int, max_value: int, operations: str, style: str = "word") -> list[Problem]:
    """``n`` distinct held-out problems (fewer when the space holds fewer)."""
    rng = _rng(seed, 1, 0)
    out: list[Problem] = []
    seen: set[tuple[int, int, int]] = set()
    for _ in range(200 * n):
        p = draw(rng, max_value, operations, style)
        if p.held_out and (p.template, p.a, p.b) not in seen:
            seen.add((p.template, p.a, p.b))
            out.append(p)
            if len(out) == n:
                break
    return out


def longest_problems(max_value: int, operations: str, style: str = "word") -> list[Problem]:
    """One problem per template with the widest numbers and the longest name and item (the longest prompts)."""
    name = max(range(len(NAMES)), key=lambda k: len(NAMES[k][0]))
    item = max(range(len(ITEMS)), key=lambda k: len(ITEMS[k]))
    hi = max(2, min(max_value, 12))
    return [Problem(t, max_value if op != "*" else hi, max_value if op != "*" else hi, name, item)
            for t in _templates(operations, style) for op in (TEMPLATES[t][1],)]
