"""The recipe's ``precision:`` section: one declarative policy for every stage.

    precision:
      default: mxfp8            # quantizable linear weights: bf16 | mxfp8 | nvfp4 | fp8_block
                                # (fp8_block alone, not mixed with mxfp8 / nvfp4 in one checkpoint;
                                #  fp8_tensor: sampler_precision comparison arms only)
      backward: dequantized     # high_precision | dequantized | quantized
      rules:                    # first match wins, after the built-in invariants
        - {layers: first 1, format: bf16}
        - {layers: last 15%, format: bf16}
        - {match: "*.shared_experts.*", format: bf16}
        - {match: "re:.*\\.kv_b_proj", format: bf16}
        - {role: routed_experts, format: nvfp4, activation_scale: per_token}

Selectors (a rule needs at least one; several are ANDed):

- ``match``: a glob, or ``re:`` + a Python regex; a string or a list (any of them). The pattern must match the
  WHOLE tensor name (``model.layers.3.mlp.gate.weight``) or the whole module name (the same without the last
  ``.weight`` / ``.bias`` component); regexes use ``re.fullmatch``. Glob ``*`` matches any run of characters
  (dots included), ``?`` one character. Because the match is whole-name, ``*.mlp.gate`` selects the router
  module and never ``mlp.gate_proj``, ``mlp.gate_up_proj`` or ``mlp.shared_expert_gate``.
- ``layers``: ``first N``, ``last N``, ``first P%``, ``last P%`` (rounded up), ``A-B`` (inclusive), ``mtp``
  (DeepSeek multi-token-prediction layers), or a list of indices and ``A-B`` ranges. ``first``/``last``/``%``
  count decoder layers only (``num_hidden_layers``), as Megatron's ``num_layers_at_end_in_bf16`` does; the MTP
  layer is selected only by ``mtp`` or by its index.
- ``role``: a role (``attention_qkv``, ``routed_experts``, ``mla_kv_b``, ...) or a family (``attention``,
  ``mla``, ``mlp``, ``experts``, ``moe_routing``, ``linear``); a string or a list.

Options: ``format`` (required), ``activation_scale`` (``per_token`` | ``per_tensor``; NVFP4 only),
``weight_scale_2d`` (NVFP4 only), ``pow2_scales`` (fp8_block only), ``backward``, ``allow_unsafe`` + ``reason``
(needed to quantize an invariant tensor: embeddings, lm_head, norms, biases, routers and their gates, MTP
``eh_proj``, any 1-D tensor).

Policy keys besides ``rules``: ``default`` (required), ``backward`` (default ``dequantized``),
``activation_scale`` (default for NVFP4 tensors: ``per_token``), ``weight_scale_2d`` (default false),
``pow2_scales`` (fp8_block: round every block scale down to a power of two, TE Float8BlockScaling's
``force_pow_2_scales``; default false, the FP32 scales DeepSeek-V3 checkpoints carry), ``on_unaligned``
(``error`` | ``keep_bf16``: a tensor whose K is not a multiple of its format's block).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
from pathlib import Path
from typing import Any, Literal

from miles_lp.config import Where, check_keys, load_yaml, parse_dataclass, suggest
from miles_lp.errors import ConfigError
from miles_lp.formats.schemes import scheme_for
from miles_lp.formats.spec import BackwardMode, Format
from miles_lp.policy.roles import Role, resolve_role_selector, role_selector_values

ActivationScale = Literal["per_tensor", "per_token"]
#: formats only a ``sampler_precision:`` comparison arm may use: no learner trains them and no target's checkpoint
#: holds them, so a recipe's ``precision:`` section (the learner's and the converted checkpoint's) refuses them at
#: parse time, naming the key (they would fail later, in convert or run, with no key named).
COMPARISON_ONLY = (Format.FP8_TENSOR,)
COMPARISON_ONLY_NOTE = "fp8_tensor: sampler_precision comparison arms only"
#: formats a learner trains but that no engine checkpoint or live weight sync holds yet (``miles_lp.export.naming``
#: has no parts for them), so a run or a conversion would stop in the converter without naming the key: a recipe's
#: ``precision:`` section refuses them here, naming it. Plans and learners built through the library
#: (``parse_policy(..., comparison_formats=True)``, ``compile_plan``) take them. Empty: fp8_block is held by every
#: target (``weight`` E4M3 + ``weight_scale_inv`` fp32 per 128x128 block) and served by the reference engine.
ENGINE_PENDING: tuple[Format, ...] = ()
_LAYER_WORDS = ("first", "last", "mtp")


@dataclasses.dataclass(frozen=True)
class LayerSelector:
    """A parsed ``layers:`` value. ``resolve`` turns it into layer indices for one model."""

    text: str
    kind: str  # "first" | "last" | "indices" | "mtp"
    count: int = 0
    percent: float | None = None
    indices: tuple[int, ...] = ()

    def resolve(self, num_layers: int, num_mtp: int = 0) -> frozenset[int]:
        if self.kind == "mtp":
            return frozenset(range(num_layers, num_layers + num_mtp))
        if self.kind == "indices":
            return frozenset(self.indices)
        n = self.count if self.percent is None else math.ceil(num_layers * self.percent / 100.0 - 1e-9)
        n = min(n, num_layers)
        return frozenset(range(n)) if self.kind == "first" else frozenset(range(num_layers - n, num_layers))


def _parse_range(item: Any, where: Where) -> list[int]:
    if isinstance(item, bool):
        raise where.error(f"expected a layer index or 'A-B', got {item!r}")
    if isinstance(item, int):
        if item < 0:
            raise where.error(f"layer index must be >= 0, got {item}")
        return [item]
    if isinstance(item, str):
        m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", item)
        if m:
            a, b = int(m.group(1)), int(m.group(2))
            if a > b:
                raise where.error(f"empty layer range '{item}' (start {a} > end {b}); write '{b}-{a}'")
            return list(range(a, b + 1))
        if item.strip().isdigit():
            return [int(item)]
    raise where.error(f"expected a layer index or an inclusive range 'A-B', got {item!r}")


def parse_layers(value: Any, where: Where) -> LayerSelector:
    if isinstance(value, list):
        if not value:
            raise where.error("empty layer list; give indices or ranges like [0, '3-5']")
        idx: list[int] = []
        for i, item in enumerate(value):
            idx += _parse_range(item, where.child(i))
        return LayerSelector(str(value), "indices", indices=tuple(sorted(set(idx))))
    if isinstance(value, int) and not isinstance(value, bool):
        return LayerSelector(str(value), "indices", indices=tuple(_parse_range(value, where)))
    if not isinstance(value, str):
        raise where.error(f"expected 'first N', 'last N', 'last P%', 'A-B', 'mtp' or a list, got {value!r}")
    text = value.strip()
    if text == "mtp":
        return LayerSelector(text, "mtp")
    m = re.fullmatch(r"(\w+)\s+(\S+)", text)
    if m:
        word, num = m.group(1), m.group(2)
        if word not in ("first", "last"):
            raise where.error(f"unknown layer selector word '{word}'{suggest(word, _LAYER_WORDS)}; "
                              "use 'first N', 'last N', 'first P%' or 'last P%'")
        if num.endswith("%"):
            try:
                p = float(num[:-1])
            except ValueError:
                raise where.error(f"bad percentage '{num}' in '{text}'") from None
            if not 0 < p <= 100:
                hint = f"{word} {p / 10:g}%" if 0 < p / 10 <= 100 else f"{word} 100%"
                raise where.error(f"percentage must be in (0, 100], got '{text}' (did you mean '{hint}'?)")
            return LayerSelector(text, word, percent=p)
        if not num.isdigit() or int(num) < 1:
            raise where.error(f"'{text}': the count must be a positive integer (an empty range selects nothing)")
        return LayerSelector(text, word, count=int(num))
    if re.fullmatch(r"[A-Za-z_]+", text):
        raise where.error(f"unknown layer selector '{text}'{suggest(text, _LAYER_WORDS)}; use 'first N', 'last N', "
                          "'first P%', 'last P%', 'A-B', 'mtp' or a list")
    return LayerSelector(text, "indices", indices=tuple(_parse_range(text, where)))


@dataclasses.dataclass(frozen=True)
class NamePattern:
    text: str
    regex: re.Pattern

    def matches(self, name: str, module: str) -> bool:
        return self.regex.fullmatch(name) is not None or self.regex.fullmatch(module) is not None


def compile_pattern(text: str, where: Where) -> NamePattern:
    if not text:
        raise where.error("empty pattern")
    if text.startswith("re:"):
        try:
            return NamePattern(text, re.compile(text[3:]))
        except re.error as exc:
            raise where.error(f"bad regex {text[3:]!r}: {exc}") from None
    return NamePattern(text, re.compile(fnmatch.translate(text)))


@dataclasses.dataclass(frozen=True)
class _RuleYaml:
    format: Format
    match: str | list[str] | None = None
    layers: Any = None
    role: str | list[str] | None = None
    activation_scale: ActivationScale | None = None
    weight_scale_2d: bool | None = None
    pow2_scales: bool | None = None
    backward: BackwardMode | None = None
    allow_unsafe: bool = False
    reason: str | None = None


@dataclasses.dataclass(frozen=True)
class Rule:
    """One compiled rule. ``label`` (``rules[3]``) is how plans and ``explain`` name it."""

    index: int
    format: Format
    patterns: tuple[NamePattern, ...] = ()
    layers: LayerSelector | None = None
    roles: frozenset[Role] | None = None
    activation_scale: ActivationScale | None = None
    weight_scale_2d: bool | None = None
    backward: BackwardMode | None = None
    allow_unsafe: bool = False
    reason: str | None = None
    text: str = ""
    where: Where | None = dataclasses.field(default=None, compare=False, repr=False)
    pow2_scales: bool | None = None

    @property
    def label(self) -> str:
        return f"rules[{self.index}]"

    def error(self, message: str) -> ConfigError:
        if self.where is not None:
            return self.where.error(message)
        return ConfigError(f"{self.label} ({self.text}): {message}")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"format": self.format.value}
        if self.patterns:
            d["match"] = [p.text for p in self.patterns]
        if self.layers is not None:
            d["layers"] = self.layers.text
        if self.roles is not None:
            d["role"] = sorted(r.value for r in self.roles)
        for key in ("activation_scale", "weight_scale_2d", "pow2_scales", "backward", "reason"):
            v = getattr(self, key)
            if v is not None:
                d[key] = v.value if isinstance(v, BackwardMode) else v
        if self.allow_unsafe:
            d["allow_unsafe"] = True
        return d


def _rule_text(raw: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in raw.items() if k in ("match", "layers", "role"))


def _refuse_comparison_only(fmt: Format, where: Where) -> None:
    if fmt in ENGINE_PENDING:
        raise where.error(f"{fmt.value} is not yet a precision: format for a run or a conversion: the learner trains "
                          "it (QuantLinear: emulated on CPU, native FP8 GEMMs on sm_90; `miles-lp bench linear`) but "
                          "no engine checkpoint or live weight sync holds it yet (miles_lp.export.naming has no "
                          f"{fmt.value} parts); use bf16, mxfp8 or nvfp4 here, or {fmt.value} in a sampler_precision: "
                          "comparison arm (recipes/tiny-fp8-blockwise.yaml)")
    if fmt in COMPARISON_ONLY:
        raise where.error(f"{fmt.value} is not a precision: format ({COMPARISON_ONLY_NOTE}: no learner trains it "
                          "and no engine checkpoint holds it); use bf16, mxfp8, nvfp4 or fp8_block here, or compare "
                          "against an FP8 sampler in a sampler_precision: section (recipes/tiny-fp8-tensorwise.yaml)")


def _compile_rule(index: int, raw: Any, where: Where, comparison_formats: bool = True) -> Rule:
    if isinstance(raw, dict):  # clearer than the union's last-branch message ("expected a list, got int")
        for key, what in (("match", "a glob / 're:' pattern"), ("role", "a role or role family")):
            v = raw.get(key)
            if v is not None and not isinstance(v, str | list):
                raise where.child(key).error(f"expected {what} (a string) or a list of them, got "
                                             f"{type(v).__name__}: {v!r}")
    y: _RuleYaml = parse_dataclass(_RuleYaml, raw, where)
    if not comparison_formats:
        _refuse_comparison_only(y.format, where.child("format"))
    if y.match is None and y.layers is None and y.role is None:
        raise where.error("a rule needs at least one selector: match, layers or role")
    patterns: tuple[NamePattern, ...] = ()
    if y.match is not None:
        items = [y.match] if isinstance(y.match, str) else list(y.match)
        if not items:
            raise where.child("match").error("empty match list")
        patterns = tuple(compile_pattern(p, where.child("match")) for p in items)
    layers = parse_layers(y.layers, where.child("layers")) if y.layers is not None else None
    roles = None
    if y.role is not None:
        items = [y.role] if isinstance(y.role, str) else list(y.role)
        if not items:
            raise where.child("role").error("empty role list")
        acc: set[Role] = set()
        for r in items:
            got = resolve_role_selector(r)
            if got is None:
                raise where.child("role").error(f"unknown role '{r}'{suggest(r, role_selector_values())}; "
                                                f"roles: {', '.join(role_selector_values())}")
            acc |= got
        roles = frozenset(acc)
    scheme = scheme_for(y.format)  # which options the format has (miles_lp.formats.schemes)
    if y.activation_scale is not None and not scheme.activation_scopes:
        raise where.child("activation_scale").error(
            f"activation_scale applies to nvfp4 only; {y.format.value} activations are "
            f"{f'block-scaled (1x{scheme.scale_block})' if scheme.aligned else 'scaled by the format'}: remove it")
    if y.weight_scale_2d and not scheme.weight_scale_2d:
        raise where.child("weight_scale_2d").error("weight_scale_2d applies to nvfp4 only")
    if y.pow2_scales is not None and not scheme.pow2_scales:
        raise where.child("pow2_scales").error(f"pow2_scales applies to fp8_block only; {y.format.value} scales are "
                                               "fixed by the format: remove it")
    if y.backward is not None and not y.format.quantized:
        raise where.child("backward").error(f"backward applies to quantized formats only; a {y.format.value} rule "
                                            "has no low-precision backward: remove it")
    if y.allow_unsafe and not (y.reason and y.reason.strip()):
        raise where.child("allow_unsafe").error("allow_unsafe: true needs a 'reason' saying why it is safe here")
    if y.allow_unsafe and not y.format.quantized:
        raise where.child("allow_unsafe").error("allow_unsafe is only needed to quantize; a bf16 rule is always safe")
    return Rule(index, y.format, patterns, layers, roles, y.activation_scale, y.weight_scale_2d, y.backward,
                y.allow_unsafe, y.reason, _rule_text(raw), where, y.pow2_scales)


@dataclasses.dataclass(frozen=True)
class _PolicyYaml:
    default: Format
    backward: BackwardMode = BackwardMode.DEQUANTIZED
    rules: list[Any] = dataclasses.field(default_factory=list)
    activation_scale: ActivationScale = "per_token"
    weight_scale_2d: bool = False
    on_unaligned: Literal["error", "keep_bf16"] = "error"
    pow2_scales: bool = False


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    default: Format
    backward: BackwardMode = BackwardMode.DEQUANTIZED
    rules: tuple[Rule, ...] = ()
    activation_scale: ActivationScale = "per_token"
    weight_scale_2d: bool = False
    on_unaligned: Literal["error", "keep_bf16"] = "error"
    source: str = dataclasses.field(default="<policy>", compare=False)
    pow2_scales: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = {"default": self.default.value, "backward": self.backward.value,
             "activation_scale": self.activation_scale, "weight_scale_2d": self.weight_scale_2d,
             "on_unaligned": self.on_unaligned, "rules": [r.to_dict() for r in self.rules]}
        if self.pow2_scales:  # (only when set: the plans, and plan hashes, of every other policy stay as they were)
            d["pow2_scales"] = True
        return d


def parse_policy(mapping: Any, where: Where, *, comparison_formats: bool | None = None) -> PrecisionPolicy:
    """Parse a ``precision:`` mapping (already loaded) into a `PrecisionPolicy`.

    ``comparison_formats``: accept ``fp8_tensor`` (``COMPARISON_ONLY``) and ``fp8_block`` (``ENGINE_PENDING``).
    None (the default): refused in a recipe's ``precision:`` section (``where.path == "precision"``: the learner's and the
    checkpoint's policy), accepted elsewhere (``sampler_precision``)."""
    if comparison_formats is None:
        comparison_formats = where.path != "precision"
    if mapping is None:
        raise where.error("missing 'precision' section; at least 'default: mxfp8' (or bf16, nvfp4, ...)")
    check_keys(mapping, [f.name for f in dataclasses.fields(_PolicyYaml)], where)
    raw_rules = mapping.get("rules") if isinstance(mapping, dict) else None
    if raw_rules is not None and not isinstance(raw_rules, list):
        raise where.child("rules").error(f"expected a list of rules, got {type(raw_rules).__name__}")
    y: _PolicyYaml = parse_dataclass(_PolicyYaml, {k: v for k, v in mapping.items() if k != "rules"}, where)
    if not comparison_formats:
        _refuse_comparison_only(y.default, where.child("default"))
    rules = tuple(_compile_rule(i, r, where.child("rules").child(i), comparison_formats)
                  for i, r in enumerate(raw_rules or []))
    return PrecisionPolicy(y.default, y.backward, rules, y.activation_scale, y.weight_scale_2d, y.on_unaligned,
                           where.source, y.pow2_scales)


def load_policy(path: str | Path, section: str = "precision") -> PrecisionPolicy:
    """Read ``section`` of a recipe YAML; other sections (``train:``, ``rollout:``) are ignored here."""
    doc = load_yaml(path)
    if not isinstance(doc.data, dict):
        raise ConfigError("a recipe must be a mapping with a 'precision:' section", source=str(path), line=1)
    if section not in doc.data:
        raise ConfigError(f"no '{section}:' section{suggest(section, [str(k) for k in doc.data])}",
                          source=str(path), line=1)
    return parse_policy(doc.data[section], doc.where(section))


def policy_from_flags(fmt: Format | str, start_bf16: int = 0, end_bf16: int = 0, bf16_patterns=(),
                      backward: BackwardMode | str = BackwardMode.DEQUANTIZED) -> PrecisionPolicy:
    """The converter's flags (``--format``, ``--num-layers-at-start/end-in-bf16``, ``--bf16-pattern``) as a policy."""
    rules: list[dict[str, Any]] = []
    if start_bf16:
        rules.append({"layers": f"first {int(start_bf16)}", "format": "bf16"})
    if end_bf16:
        rules.append({"layers": f"last {int(end_bf16)}", "format": "bf16"})
    for p in bf16_patterns:
        rules.append({"match": p, "format": "bf16"})
    fmt = Format(fmt).value
    backward = BackwardMode(backward).value
    # a library helper over any Format (the converter's --format choices never name an FP8 one)
    return parse_policy({"default": fmt, "backward": backward, "rules": rules}, Where("<flags>", "precision"),
                        comparison_formats=True)
