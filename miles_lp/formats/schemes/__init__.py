"""The format schemes, one module per format, and the registry ``scheme_for`` (the protocol:
``miles_lp.formats.scheme.FormatScheme``). Importing this package imports no torch."""

from __future__ import annotations

import importlib

from miles_lp.errors import FormatError
from miles_lp.formats.scheme import FormatScheme
from miles_lp.formats.spec import Format

#: Format -> the module holding its ``SCHEME``. A new format: its scheme module and one line here.
_REGISTRY: dict[Format, str] = {
    Format.BF16: "miles_lp.formats.schemes.bf16",
    Format.MXFP8: "miles_lp.formats.schemes.mxfp8",
    Format.NVFP4: "miles_lp.formats.schemes.nvfp4",
    Format.FP8_BLOCK: "miles_lp.formats.schemes.fp8_block",
    Format.FP8_TENSOR: "miles_lp.formats.schemes.fp8_tensor",
}


def _as_format(fmt: Format | str) -> Format:
    try:
        return Format(fmt)
    except ValueError as exc:
        raise FormatError(f"unknown format {fmt!r}; known: {[f.value for f in Format]}") from exc


def has_scheme(fmt: Format | str) -> bool:
    """Whether ``fmt`` has a scheme."""
    return _as_format(fmt) in _REGISTRY


_LOADED: dict[Format, FormatScheme] = {}


def scheme_for(fmt: Format | str) -> FormatScheme:
    """The scheme of ``fmt`` (a ``Format`` or its value). Raises ``FormatError`` for a format without one."""
    got = _LOADED.get(fmt)  # (the hot path: a Format already asked for; a str hashes equal to its member)
    if got is not None:
        return got
    fmt = _as_format(fmt)
    module = _REGISTRY.get(fmt)
    if module is None:
        raise FormatError(f"format {fmt.value} has no scheme (formats with one: "
                          f"{', '.join(f.value for f in _REGISTRY)}); keep the tensor bf16 or use one of those")
    got = _LOADED[fmt] = importlib.import_module(module).SCHEME
    return got


def find_scheme(fmt: object) -> FormatScheme | None:
    """The scheme of ``fmt`` (a ``Format``, its value, or anything with a ``value``), ``None`` for a format
    without one or a value that names no format."""
    try:
        fmt = Format(str(getattr(fmt, "value", fmt)).lower())
    except ValueError:
        return None
    return scheme_for(fmt) if fmt in _REGISTRY else None


def trainable_formats() -> tuple[Format, ...]:
    """The formats QuantLinear trains, in registry order."""
    return tuple(f for f in _REGISTRY if scheme_for(f).trainable)


