"""Final-answer extraction and comparison for math rewards, the rules verl's and slime's math rewards use.

``extract_answer(text)`` tries, in order:

1. the last ``\\boxed{...}`` (balanced braces; also ``\\boxed 5`` and ``\\fbox{...}``), as verl's
   ``math.last_boxed_only_string`` / slime's ``math_utils`` do;
2. the last ``#### n`` (GSM8K's answer line: verl ``gsm8k.extract_solution(method="strict")``);
3. the last number in the text (verl ``gsm8k`` ``method="flexible"``: the last match that is not empty or ``.``).

Numbers lose thousands separators (``1,234``), a leading ``$`` and a trailing ``.``; ``answers_match`` compares two
answers as numbers when both read as numbers (``15 == 15.0``, ``1/2 == 0.5``), else as whitespace-free strings
(``\\frac{1}{2}`` stays a string: no symbolic algebra here).
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_HASHES = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")
#: verl clips to the text's end before the regex (long generations): the answer is at the end
CLIP_CHARS = 300


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced), or of ``\\boxed x``."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    rest = rest[len("\\boxed"):] if rest.startswith("\\boxed") else rest[len("\\fbox"):]
    if rest.startswith(" "):  # "\boxed 5": up to the next "$" or whitespace
        token = rest.strip().split("$")[0].split()
        return token[0] if token else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None  # unbalanced: no answer


def _clean_number(s: str) -> str:
    return s.replace(",", "").replace("$", "").strip().rstrip(".")


def last_number(text: str) -> str | None:
    found = [m for m in _NUMBER.findall(text) if m not in ("", ".")]
    return _clean_number(found[-1]) if found else None


def extract_answer(text: str) -> str | None:
    """The final answer written in ``text`` (rules in the module docstring); None when there is none."""
    text = text[-CLIP_CHARS:]
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    hashes = _HASHES.findall(text)
    if hashes:
        return _clean_number(hashes[-1])
    return last_number(text)


def as_number(s: str) -> Fraction | None:
    s = _clean_number(s)
    try:
        return Fraction(s)  # "15", "-2.5", "1/2"
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(got: str | None, want: str) -> bool:
    if got is None:
        return False
    a, b = as_number(got), as_number(want)
    if a is not None and b is not None:
        return a == b
    return "".join(got.split()) == "".join(want.split())


def math_reward(response: str, answer: str) -> float:
    """1.0 when the final answer in ``response`` equals ``answer`` (see ``extract_answer``), else 0.0."""
    return 1.0 if answers_match(extract_answer(response), answer) else 0.0
