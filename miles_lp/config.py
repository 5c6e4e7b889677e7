"""Typed, strict configuration from YAML, with errors that point at the file and line.

Configs are frozen dataclasses. ``parse_dataclass`` refuses unknown keys (with a close-match
suggestion), checks types, and never rewrites the user's values: derived values belong to the
compiled objects (e.g. the precision plan), not to the config.

    doc = load_yaml("recipe.yaml")              # a YamlDoc: data + line numbers per key path
    policy = parse_dataclass(PolicyConfig, doc.get("precision"), doc.where("precision"))

YAML is read with ``yaml.SafeLoader`` only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import json
import os
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


# ---- run-time switches ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """The recipe's ``runtime:`` section: HOW the code runs, never WHAT it computes. Each switch chooses between
    implementations that write the same bytes (each pair is tested equal) or trades speed for memory; turning
    one off is for A/B measurements and for isolating a suspected kernel. A run applies its recipe's section once
    at start (``use_runtime``); library code reads one key with ``switch(name)``.

    Each key has an environment variable (``RUNTIME_ENV``) that overrides it for one process, for debugging only
    (a bisection without editing the recipe; the tests): the variable wins over the recipe while it is set."""

    kernels: typing.Literal["auto", "reference"] = "auto"  # formats: Triton kernels on CUDA tensors | torch codecs
    kernels_fast_launch: bool = True  # formats: call a compiled kernel's launcher directly (else Triton's JIT path)
    kernels_hw: bool = True  # formats: the kernels' hardware conversion instructions (else integer forms); read
    # when the kernels are first loaded in a process (a compile-time constant of them): set it before that
    native: bool = True  # formats: the fused C codecs on CPU (else the torch code)
    linear_bind: bool = True  # train: QuantLinear's bound kernel launches (else the entry points every call)
    fp8_gemm: typing.Literal["auto", "emulated"] = "auto"  # train: block-FP8 GEMM kernel | its emulation
    pipeline_workers: int | None = None  # convert: worker threads (0: sequential; None: the default, <= CPUs)
    sync_kernels: str = "auto"  # sync: "auto" | "reference" | a comma list of the kernels to use (digest,copy,ff)
    sync_graphs: bool = True  # reference engine: C3 as replayed CUDA graphs (else eager every sync)
    sync_shared: bool = True  # sync: C2 and C4 from one read of the engine's tensors (check_state) | two calls
    # reference engine's decode: auto (static KV cache + CUDA graphs on CUDA where it applies, else eager) | eager |
    # static (no graphs) | graph (refused where it cannot apply)
    decode: typing.Literal["auto", "eager", "static", "graph"] = "auto"
    # the static decode's fused elementwise Triton kernels: on | off | interpret (Triton's interpreter, for CPU tests)
    decode_fused: typing.Literal["on", "off", "interpret"] = "on"
    # the static decode's fp8_block GEMM on sm_90: auto (the Triton decode GEMM, activation quantization in its
    # prologue, for at most formats.kernels.fp8_block_decode.MAX_M tokens; cuBLAS's block-scaled scaled_mm above) |
    # triton (every token count) | scaled_mm (never the Triton GEMM). Not byte-equal: both within the native GEMMs'
    # REL_TOL of the emulated GEMM
    fp8_decode_gemm: typing.Literal["auto", "triton", "scaled_mm"] = "auto"
    # the learner's fp8_block wgrad GEMM on sm_90 (1x128 tiles along the tokens on both operands): auto
    # (formats.kernels.fp8_block_mm.WGRAD_AUTO: cuBLAS, the faster on the H200) | triton (miles-lp's Triton GEMM)
    # | scaled_mm (cuBLAS's block-scaled GEMM). Not byte-equal: both within the native GEMMs' tolerance of the
    # emulated GEMM
    fp8_wgrad_gemm: typing.Literal["auto", "triton", "scaled_mm"] = "auto"

    def _validate(self, where: Where) -> None:
        for f in dataclasses.fields(self):
            if f.name in ENV_ONLY and getattr(self, f.name) != f.default:
                raise where.child(f.name).error(
                    f"not read from the config yet: the code it switches reads only the variable "
                    f"{RUNTIME_ENV[f.name]} (set it for one process to change this switch); remove {f.name} here")
        if self.pipeline_workers is not None and self.pipeline_workers < 0:
            raise where.child("pipeline_workers").error(f"must be >= 0, got {self.pipeline_workers}")
        kinds = {"digest", "copy", "ff"}
        if self.sync_kernels not in ("auto", "reference") and not set(self.sync_kernels.split(",")) <= kinds:
            raise where.child("sync_kernels").error(f"must be auto, reference or a comma list of {sorted(kinds)}, got "
                                                    f"{self.sync_kernels!r}")


#: the debugging override of each ``RuntimeConfig`` key
RUNTIME_ENV: dict[str, str] = {
    "kernels": "MILES_LP_KERNELS",
    "kernels_fast_launch": "MILES_LP_KERNELS_FAST_LAUNCH",
    "kernels_hw": "MILES_LP_KERNELS_HW",
    "native": "MILES_LP_NATIVE",
    "linear_bind": "MILES_LP_LINEAR_BIND",
    "fp8_gemm": "MILES_LP_FP8_GEMM",
    "pipeline_workers": "MILES_LP_PIPELINE",
    "sync_kernels": "MILES_LP_SYNC_KERNELS",
    "sync_graphs": "MILES_LP_SYNC_GRAPHS",
    "sync_shared": "MILES_LP_SYNC_SHARED",
    "decode": "MILES_LP_DECODE",
    "decode_fused": "MILES_LP_DECODE_FUSED",
    "fp8_decode_gemm": "MILES_LP_FP8_DECODE_GEMM",
    "fp8_wgrad_gemm": "MILES_LP_FP8_WGRAD_GEMM",
}

#: keys whose code still reads only its variable (``os.environ``: train/fp8_block_gemm.py): a config value other
#: than the default is refused, never silently ignored. ``tests/unit/test_config_environment.py`` keeps it exact: a
#: key leaves this set when its code reads ``switch(key)``.
ENV_ONLY: frozenset[str] = frozenset()

_RUNTIME = RuntimeConfig()
_FORCED: dict[str, Any] = {}  # runtime_override's values: they win over the debugging variables


def use_runtime(cfg: RuntimeConfig) -> None:
    """Make ``cfg`` this process's run-time switches (a run calls it once, from its recipe)."""
    global _RUNTIME
    if not isinstance(cfg, RuntimeConfig):
        raise TypeError(f"use_runtime takes a RuntimeConfig, got {type(cfg).__name__}")
    _RUNTIME = cfg


def configured_runtime() -> RuntimeConfig:
    """This process's configured switches (``use_runtime``'s, no debugging variable applied): what a process this
    one starts receives (a Ray actor, a Megatron rank, an engine process), so that every process of a run runs
    under the recipe's ``runtime:`` section."""
    return _RUNTIME


#: the variable that hands the configured switches to an engine process a run starts with its own interpreter
#: (the vLLM worker, the SGLang server): JSON of the keys set away from their defaults (``child_runtime_env``)
RUNTIME_CHILD_ENV = "MILES_LP_RUNTIME"


def child_runtime_env() -> dict[str, str]:
    """The environment entry that gives a child process this process's configured switches (read there by
    ``use_runtime_from_env`` at its start). Only the keys away from their defaults are written."""
    changed = {f.name: getattr(_RUNTIME, f.name) for f in dataclasses.fields(_RUNTIME)
               if getattr(_RUNTIME, f.name) != f.default}
    return {RUNTIME_CHILD_ENV: json.dumps(changed, sort_keys=True)}


def use_runtime_from_env() -> RuntimeConfig:
    """At the start of a process a run started (``child_runtime_env``): make the switches it was handed this
    process's; none handed: the defaults stay. Validated as the recipe's section is (an unknown key is refused)."""
    raw = os.environ.get(RUNTIME_CHILD_ENV)
    if raw:
        try:
            mapping = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{RUNTIME_CHILD_ENV}: not JSON ({exc}); it is set by miles-lp for the processes a "
                              "run starts: unset it") from None
        use_runtime(parse_dataclass(RuntimeConfig, mapping, Where(RUNTIME_CHILD_ENV, "runtime")))
    return _RUNTIME


def runtime() -> RuntimeConfig:
    """This process's run-time switches with every debugging override that is set applied."""
    return dataclasses.replace(_RUNTIME, **{k: switch(k) for k in RUNTIME_ENV})


@contextlib.contextmanager
def runtime_override(**changes: Any):
    """Switches forced for the duration of a ``with`` block, over the recipe's and the debugging variables' (a
    self-check or a benchmark that compares two paths), instead of writing the environment. Process-wide: not for
    code that runs while other threads read the same switch."""
    unknown = sorted(set(changes) - set(RUNTIME_ENV))
    if unknown:
        raise TypeError(f"runtime_override: no run-time switch {unknown}; known: {sorted(RUNTIME_ENV)}")
    dataclasses.replace(_RUNTIME, **changes)._validate(Where("runtime_override", "runtime"))
    old = dict(_FORCED)
    _FORCED.update(changes)
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(old)


def switch(name: str) -> Any:
    """One run-time switch: a ``runtime_override`` in force, else its debugging variable when set
    (``RUNTIME_ENV``), else the configured value. Read at each call (one environment lookup), so a test or a shell
    that sets the variable is obeyed at once."""
    if _FORCED and name in _FORCED:
        return _FORCED[name]
    var = RUNTIME_ENV[name]
    raw = os.environ.get(var)
    if raw is None:
        return getattr(_RUNTIME, name)
    return _env_value(name, var, raw)


def _env_value(name: str, var: str, raw: str) -> Any:
    """A debugging variable's value, read as the code read it before the key existed: a bool is off only for
    ``0``; ``kernels`` / ``fp8_gemm`` switch only for their one other value; ``pipeline_workers`` is a count of
    digits (anything else: the default)."""
    if name == "kernels":
        return "reference" if raw == "reference" else "auto"
    if name == "fp8_gemm":
        return "emulated" if raw == "emulated" else "auto"
    if name == "pipeline_workers":
        return int(raw) if raw.strip().isdigit() else None
    if name in ("sync_kernels", "decode", "fp8_decode_gemm", "fp8_wgrad_gemm"):
        return raw  # (checked where it is read)
    if name == "decode_fused":
        return {"0": "off", "interpret": "interpret"}.get(raw, "on")
    return raw != "0"


@dataclasses.dataclass(frozen=True)
class EnvVar:
    """One ``MILES_LP_*`` environment variable: what kind it is and why it is a variable, not a config key."""

    kind: typing.Literal["location", "credential", "process", "debug", "ci"]
    what: str


#: every ``MILES_LP_*`` variable the code reads (``tests/unit/test_config_environment.py`` keeps this list exact;
#: docs/configuration.md tabulates it). ``location``: where something is on this machine; ``credential``: a
#: secret that must not be written into a recipe; ``process``: set by miles-lp for a child process it starts;
#: ``debug``: a debugging override of a config key (``RUNTIME_ENV``, the sync's checks) or a test-only switch;
#: ``ci``: read by .ci/run and the tests only.
ENVIRONMENT: dict[str, EnvVar] = {
    "MILES_LP_API_KEY": EnvVar("credential", "the API key of `miles-lp serve` and of the SGLang servers it talks to"),
    "MILES_LP_CACHE_DIR": EnvVar("location", "the cache folder (compiled native codecs, pretrained models)"),
    "MILES_LP_VLLM_PYTHON": EnvVar("location", "the interpreter of the vLLM venv"),
    "MILES_LP_VLLM_VENV": EnvVar("location", "the vLLM venv folder (its bin/python)"),
    "MILES_LP_SGLANG_PYTHON": EnvVar("location", "the interpreter of the SGLang venv"),
    "MILES_LP_SGLANG_VENV": EnvVar("location", "the SGLang venv folder (its bin/python)"),
    "MILES_LP_VLLM_WORKER": EnvVar("process", "the vLLM engine process's settings (JSON), from its parent"),
    "MILES_LP_VLLM_AUTHKEY": EnvVar("process", "the vLLM engine process's socket key, from its parent"),
    "MILES_LP_SGLANG_INTROSPECT_PORT": EnvVar("process", "the SGLang process's introspection port, from its parent"),
    "MILES_LP_SGLANG_INTROSPECT_KEY": EnvVar("process", "the SGLang process's introspection key, from its parent"),
    "MILES_LP_RUNTIME": EnvVar("process", "the recipe's runtime: section (JSON), for the vLLM / SGLang engine process "
                                          "a run starts"),
    "MILES_LP_SGLANG_FAULTS": EnvVar("debug", "allows the fault-injection endpoint of a launched SGLang server "
                                              "(tests, `miles-lp selftest`); off unless 1"),
    "MILES_LP_SYNC_CHECKS": EnvVar("debug", "overrides every sync.checks.<check> mode for one process"),
    "MILES_LP_SYNC_CHECK_": EnvVar("debug", "MILES_LP_SYNC_CHECK_<CHECK>: overrides sync.checks.<check>"),
    "MILES_LP_SYNC_CHECK": EnvVar("debug", "the prefix of MILES_LP_SYNC_CHECK_<CHECK> (named in messages)"),
    "MILES_LP_COMMIT": EnvVar("debug", "`miles-lp bench quantize_cuda`: the commit recorded with its figures"),
    "MILES_LP_SWEEP": EnvVar("debug", "`miles-lp bench quantize_cuda`: sweep only these CONFIG keys' launch shapes"),
    **{var: EnvVar("debug", f"overrides runtime.{key}") for key, var in RUNTIME_ENV.items()},
}
