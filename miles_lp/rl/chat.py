"""Prompts through the model's chat template, as verl / slime build them (``apply_chat_template`` with
``add_generation_prompt=True``, then the tokenizer without added special tokens: the template writes them).

A task item gives either ``messages`` (a list of ``{"role": ..., "content": ...}``) or ``prompt`` (a string: one
user message); ``task.system_prompt`` puts a system message first. ``task.chat_template`` decides:

* ``null`` (default): the model's template when it has one (``messages`` need one), a plain ``prompt`` string
  otherwise;
* ``true``: the template always (refused when the model has none);
* ``false``: never; the ``prompt`` string is tokenized as written (``messages`` refused).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from miles_lp.errors import ConfigError

ROLES = ("system", "user", "assistant")

#: messages -> the prompt text (the template applied, generation prompt added)
RenderChat = Callable[[list[dict[str, str]]], str]


def check_messages(value: Any, where: str) -> list[dict[str, str]]:
    """``value`` as a list of chat messages, refused naming ``where`` unless each is ``{role, content}``."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: messages must be a non-empty list of {{\"role\": ..., \"content\": ...}}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise ConfigError(f"{where}[{i}]: expected {{\"role\": ..., \"content\": ...}}, got {m!r}")
        if m["role"] not in ROLES:
            raise ConfigError(f"{where}[{i}]: role '{m['role']}' is not one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ConfigError(f"{where}[{i}]: content must be a string, got {type(m['content']).__name__}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def template_renderer(tokenizer) -> RenderChat | None:
    """The tokenizer's chat template as a function; None when it has none."""
    if not getattr(tokenizer, "chat_template", None):
        return None

    def render(messages: list[dict[str, str]]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return render


def prompt_text(item: str | Sequence[dict[str, str]], render: RenderChat | None, *, chat_template: bool | None,
                system_prompt: str | None, where: str) -> str:
    """The text a prompt item becomes (then tokenized without added special tokens)."""
    is_messages = not isinstance(item, str)
    use = (render is not None) if chat_template is None else chat_template
    if use and render is None:
        raise ConfigError(f"{where}: task.chat_template is true but the model's tokenizer has no chat template; "
                          "set task.chat_template: false and give prompt strings written in the model's format")
    if not use:
        if is_messages:
            raise ConfigError(f"{where}: messages need a chat template (the model has none, or task.chat_template "
                              "is false); give a prompt string instead")
        if system_prompt is not None:
            raise ConfigError(f"{where}: task.system_prompt needs a chat template; put it into the prompt string")
        return item
    messages = [{"role": "user", "content": item}] if not is_messages else list(item)
    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return render(messages)
