"""Reward functions for text tasks: built-in names, or a user function by import path.

    task: {name: jsonl, path: data.jsonl, reward: math}                 # built-in: exact | math
    task: {name: jsonl, path: data.jsonl, reward: my_pkg.scores:score}  # a user function

A reward function takes the decoded response (the stop token removed; special tokens kept, as verl's
``compute_score(data_source, solution_str, ground_truth)`` gets them) and the expected answer string, and returns
a float (``RewardFunction``). It is resolved when the recipe's task is built, so a typo fails before any step
runs; a call that raises or returns something other than a finite number stops the run naming the function.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from miles_lp.errors import ConfigError
from miles_lp.rl.math_answer import math_reward


@runtime_checkable
class RewardFunction(Protocol):
    def __call__(self, response: str, answer: str) -> float:
        """The reward of one decoded ``response`` for the expected ``answer``."""
        ...


def exact_reward(response: str, answer: str) -> float:
    """1.0 for the answer's text exactly (surrounding whitespace ignored), else 0.0."""
    return 1.0 if response.strip() == answer.strip() else 0.0


BUILTIN: dict[str, RewardFunction] = {"exact": exact_reward, "math": math_reward}

_IMPORT_PATH = re.compile(r"[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*")


def resolve_reward(spec: str, key: str = "task.reward") -> Callable[[str, str], float]:
    """``spec``: a built-in name or ``package.module:function`` (``:Class.method`` also works). Refused, naming
    ``key`` and what to do, when the module or function is missing or the function cannot take two arguments."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if not _IMPORT_PATH.fullmatch(spec):
        raise ConfigError(f"{key}: '{spec}' is neither a built-in reward ({', '.join(BUILTIN)}) nor an import path "
                          "'package.module:function'")
    module_name, attr = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"{key}: cannot import module '{module_name}' ({exc}); put it on PYTHONPATH or install "
                          "its package") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing: say so, keep the cause
        raise ConfigError(f"{key}: importing '{module_name}' raised {type(exc).__name__}: {exc}") from exc
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
            from miles_lp.config import suggest

            raise ConfigError(f"{key}: module '{module_name}' has no '{attr}'{suggest(part, names)}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ConfigError(f"{key}: '{spec}' is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind("response", "answer")
    except TypeError:
        raise ConfigError(f"{key}: '{spec}' must take (response: str, answer: str) -> float; its signature is "
                          f"{inspect.signature(fn)}") from None
    except ValueError:  # a builtin without a signature: checked at the first call
        pass
    return fn


def call_reward(fn: Callable[[str, str], float], response: str, answer: str, name: str) -> float:
    """``fn(response, answer)`` as a float; a raise or a non-number names the function and the response."""
    try:
        value = fn(response, answer)
    except Exception as exc:  # noqa: BLE001 - the user's function: report which one and on what
        raise ConfigError(f"task.reward {name} raised {type(exc).__name__}: {exc} (response {response[:80]!r}, "
                          f"answer {answer!r})") from exc
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):  # bool, numpy scalars: fine
        raise ConfigError(f"task.reward {name} returned {value!r} for response {response[:80]!r}; a reward is a "
                          "finite float")
    return float(value)
