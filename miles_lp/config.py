"""Typed, strict configuration from YAML, with errors that point at the file and line.

Configs are frozen dataclasses. ``parse_dataclass`` refuses unknown keys (with a close-match
suggestion), checks types, and never rewrites the user's values: derived values belong to the
compiled objects (e.g. the precision plan), not to the config.

    doc = load_yaml("recipe.yaml")              # a YamlDoc: data + line numbers per key path
    policy = parse_dataclass(PolicyConfig, doc.get("precision"), doc.where("precision"))

YAML is read with ``yaml.SafeLoader`` only.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from miles_lp.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Where:
    """A location in a YAML document: the file, a dotted key path, and the 1-based line if known."""

    source: str
    path: str = ""
    lines: dict[str, int] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def line(self) -> int | None:
        return self.lines.get(self.path)

    def child(self, key: str | int) -> Where:
        path = f"{self.path}.{key}" if self.path else str(key)
        return Where(self.source, path, self.lines)

    def error(self, message: str) -> ConfigError:
        key = f"'{self.path}': " if self.path else ""
        return ConfigError(key + message, source=self.source, line=self.line)


class YamlDoc:
    """Parsed YAML plus the line of every key path (``a.b.0.c``)."""

    def __init__(self, data: Any, lines: dict[str, int], source: str):
        self.data = data
        self.lines = lines
        self.source = source

    def where(self, path: str = "") -> Where:
        return Where(self.source, path, self.lines)


def _record_lines(node: yaml.Node, path: str, lines: dict[str, int], source: str) -> None:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            child = f"{path}.{key_node.value}" if path else str(key_node.value)
            line = key_node.start_mark.line + 1
            # PyYAML keeps the last of two equal keys without a word: a recipe saying `default:` twice would
            # silently run the second value. A strict config refuses it.
            if isinstance(key_node, yaml.ScalarNode) and key_node.value in seen:
                raise ConfigError(f"duplicate key '{child}' (first on line {seen[key_node.value]}); keep one",
                                  source=source, line=line)
            if isinstance(key_node, yaml.ScalarNode):
                seen[key_node.value] = line
            lines[child] = line
            _record_lines(value_node, child, lines, source)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            child = f"{path}.{i}" if path else str(i)
            lines[child] = item.start_mark.line + 1
            _record_lines(item, child, lines, source)


def load_yaml_text(text: str, source: str = "<string>") -> YamlDoc:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise ConfigError(f"invalid YAML: {exc}", source=source,
                          line=mark.line + 1 if mark is not None else None) from exc
    lines: dict[str, int] = {}
    if node is not None:
        _record_lines(node, "", lines, source)
    return YamlDoc(data, lines, source)


def load_yaml(path: str | Path) -> YamlDoc:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    return load_yaml_text(text, str(path))


def suggest(key: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def check_keys(mapping: Any, allowed: typing.Iterable[str], where: Where, what: str = "key") -> None:
    if not isinstance(mapping, dict):
        raise where.error(f"expected a mapping, got {type(mapping).__name__}: {mapping!r}")
    allowed = list(allowed)
    for key in mapping:
        if key not in allowed:
            raise where.child(key).error(
                f"unknown {what} '{key}'{suggest(str(key), allowed)}; allowed: {', '.join(allowed)}")


_DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def _convert(value: Any, tp: Any, where: Where) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors: list[ConfigError] = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, where)
            except ConfigError as exc:
                errors.append(exc)
        if errors:  # the last alternative's error, as raised: it keeps its file, line and key
            raise errors[-1]
        raise where.error(f"invalid value {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise where.error(f"must be one of {', '.join(map(repr, args))}, got {value!r}"
                              f"{suggest(str(value), [str(a) for a in args])}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise where.error(f"expected a list, got {type(value).__name__}: {value!r}")
        item_tp = args[0] if args else Any
        items = [_convert(v, item_tp, where.child(i)) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise where.error(f"expected a mapping, got {type(value).__name__}")
        kt, vt = args if args else (Any, Any)
        return {_convert(k, kt, where): _convert(v, vt, where.child(k)) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return parse_dataclass(tp, value, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            options = [m.value for m in tp]
            raise where.error(f"must be one of {', '.join(map(str, options))}, got {value!r}"
                              f"{suggest(str(value), map(str, options))}") from None
    if tp is float:
        # PyYAML follows YAML 1.1, which reads `1e-5` (no dot) as a string: accept a string that is a plain
        # decimal number (digits, optional dot and exponent); "nan", "inf" or "1_000" stay refused.
        if isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
            return float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise where.error(f"expected a number, got {type(value).__name__}: {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise where.error(f"expected an integer, got {type(value).__name__}: {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise where.error(f"expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise where.error(f"expected a string, got {type(value).__name__}: {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise where.error(f"expected {tp.__name__}, got {type(value).__name__}: {value!r}")
    return value


def parse_dataclass(cls: type, mapping: Any, where: Where):
    """Build frozen dataclass ``cls`` from a YAML mapping; unknown keys and wrong types are errors.

    A dataclass may define ``_validate(self, where)`` for cross-field rules; it is called last.
    """
    if mapping is None:
        mapping = {}
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}
    check_keys(mapping, fields, where)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, f in fields.items():
        if name in mapping:
            kwargs[name] = _convert(mapping[name], hints[name], where.child(name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise where.error(f"missing required key '{name}'")
    obj = cls(**kwargs)
    validate = getattr(obj, "_validate", None)
    if validate is not None:
        validate(where)
    return obj
