"""`compile_plan(policy, layout)`: the per-tensor precision plan every stage runs.

Per tensor: the format, its options (activation scale scope, 2-D weight scaling, backward mode), the rule that
decided, and the joint-scale group: the shards an engine fuses into one parameter (q/k/v of one attention,
gate+up of one MLP / one expert, DeepSeek's q_a+kv_a) share one format and one NVFP4 global scale. Lookup is a
dict access. ``to_json`` is deterministic (sorted keys) and ``hash`` is the sha256 of it, so every stage can
prove it runs the same plan.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from functools import cached_property
from typing import Any

from miles_lp.errors import ConfigError
from miles_lp.formats.schemes import scheme_for
from miles_lp.formats.spec import BackwardMode, Format
from miles_lp.policy.layouts.base import ModelLayout, Shape
from miles_lp.policy.policy import PrecisionPolicy, Rule
from miles_lp.policy.roles import INVARIANT_ROLES, QUANTIZABLE_ROLES, Role

PLAN_VERSION = 1


@dataclasses.dataclass(frozen=True, slots=True)
class PlanEntry:
    name: str
    format: Format
    rule: str  # "rules[3]", "default", "invariant:router", "rules[3]->bf16:unaligned", ...
    activation_scale: str | None  # "tensor" | "token" (NVFP4), None otherwise
    block_2d: bool
    backward: BackwardMode | None  # None for bf16
    group: str | None
    layer: int | None
    role: Role
    expert: int | None = None
    shape: Shape = ()
    pow2_scales: bool = False  # fp8_block: block scales rounded down to powers of two

    def _row(self) -> list[Any]:
        row = [self.format.value, self.rule, self.activation_scale, self.block_2d,
               self.backward.value if self.backward else None, self.group, self.layer, self.role.value,
               self.expert, list(self.shape)]
        if self.pow2_scales:  # (an 11th column only when set: every other plan's JSON and hash are unchanged)
            row.append(True)
        return row

    @classmethod
    def _from_row(cls, name: str, row: list[Any]) -> PlanEntry:
        f, rule, act, b2d, bw, group, layer, role, expert, shape, *rest = row
        return cls(name, Format(f), rule, act, bool(b2d), BackwardMode(bw) if bw else None, group, layer,
                   Role(role), expert, tuple(shape), bool(rest and rest[0]))


@dataclasses.dataclass
class RuleStats:
    selected: int = 0  # tensors the selectors matched that this rule could decide (invariants excluded)
    won: int = 0  # tensors this rule decided
    blocked: int = 0  # invariant tensors it selected but may not quantize (no allow_unsafe)
    invariant: int = 0  # invariant tensors it selected as bf16: the invariant decides them anyway


class PrecisionPlan:
    def __init__(self, entries: dict[str, PlanEntry], *, model_type: str | None, num_layers: int,
                 num_mtp_layers: int = 0, policy: dict[str, Any] | None = None, warnings: list[str] | None = None,
                 rule_stats: dict[str, RuleStats] | None = None, layout: ModelLayout | None = None):
        self.entries = entries
        self.model_type = model_type
        self.num_layers = num_layers
        self.num_mtp_layers = num_mtp_layers
        self.policy = policy or {}
        self.warnings = warnings or []
        self.rule_stats = rule_stats or {}
        self.layout = layout
        groups: dict[str, list[str]] = {}
        for e in entries.values():
            if e.group is not None:
                groups.setdefault(e.group, []).append(e.name)
        self.groups: dict[str, tuple[str, ...]] = {g: tuple(sorted(v)) for g, v in groups.items()}
        # memo of entries_for_any / format_for_any: Megatron and fused names resolve through the layout once
        self._any: dict[str, tuple[PlanEntry, ...]] = {}
        self._any_fmt: dict[str, Format] = {}

    # ---- lookup ------------------------------------------------------------------------------
    def entry(self, name: str) -> PlanEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise KeyError(f"'{name}' is not in the plan (canonical HF names; use entries_for_any for "
                           "Megatron or fused names)") from None

    def format_for(self, name: str) -> Format:
        return self.entries[name].format

    def entries_for_any(self, name: str) -> tuple[PlanEntry, ...]:
        """Entries of the canonical tensors held by an HF, Megatron or transformers-5 fused name.

        O(1) amortised: the first lookup of a name goes through the layout, later ones are one dict access
        (the plan is immutable once compiled). `prepare_any(names)` fills the memo ahead of a hot loop.
        """
        hit = self._any.get(name)
        if hit is not None:
            return hit
        e = self.entries.get(name)
        if e is not None:
            got: tuple[PlanEntry, ...] = (e,)
        elif self.layout is None:
            raise KeyError(f"'{name}' is not a canonical name and this plan has no layout attached")
        else:
            got = tuple(self.entry(m) for m in self.layout.describe(name).members)
        self._any[name] = got
        return got

    def format_for_any(self, name: str) -> Format:
        hit = self._any_fmt.get(name)
        if hit is not None:
            return hit
        fmts = {e.format for e in self.entries_for_any(name)}
        if len(fmts) != 1:
            raise ConfigError(f"'{name}' holds tensors in several formats {sorted(f.value for f in fmts)}")
        fmt = self._any_fmt[name] = fmts.pop()
        return fmt

    def prepare_any(self, names) -> None:
        """Resolve ``names`` (Megatron / fused / HF) now, so that later `entries_for_any` calls are dict hits."""
        for n in names:
            self.entries_for_any(n)

    def quantized(self) -> dict[str, PlanEntry]:
        return {n: e for n, e in self.entries.items() if e.format.quantized}

    # ---- serialisation ------------------------------------------------------------------------
    def _payload(self) -> dict[str, Any]:
        return {"version": PLAN_VERSION, "model_type": self.model_type, "num_layers": self.num_layers,
                "num_mtp_layers": self.num_mtp_layers, "policy": self.policy,
                "entries": {n: e._row() for n, e in self.entries.items()}}

    def to_json(self) -> str:
        return json.dumps(self._payload(), sort_keys=True, separators=(",", ":"))

    @cached_property
    def hash(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def from_json(cls, text: str, layout: ModelLayout | None = None) -> PrecisionPlan:
        d = json.loads(text)
        if d.get("version") != PLAN_VERSION:
            raise ConfigError(f"plan.json version {d.get('version')} is not supported (expected {PLAN_VERSION})")
        entries = {n: PlanEntry._from_row(n, row) for n, row in d["entries"].items()}
        return cls(entries, model_type=d["model_type"], num_layers=d["num_layers"],
                   num_mtp_layers=d.get("num_mtp_layers", 0), policy=d["policy"], layout=layout)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PrecisionPlan) and self.to_json() == other.to_json()

    def __hash__(self) -> int:  # pragma: no cover - plans are not dict keys, but keep them hashable
        return hash(self.hash)


def _select(rule: Rule, name: str, module: str, layer: int | None, role: Role, layer_sets: dict[int, frozenset]):
    if rule.layers is not None and (layer is None or layer not in layer_sets[rule.index]):
        return False
    if rule.roles is not None and role not in rule.roles:
        return False
    if rule.patterns and not any(p.matches(name, module) for p in rule.patterns):
        return False
    return True


def compile_plan(policy: PrecisionPolicy, layout: ModelLayout, tensors: Mapping[str, Shape] | None = None, *,
                 require_quantized: bool = True) -> PrecisionPlan:
    """Decide every tensor's format. ``tensors`` (HF name -> shape) defaults to ``layout.synthesize()``."""
    if tensors is None:
        tensors = layout.synthesize()
    n_layers, n_mtp = layout.num_layers, layout.num_mtp_layers
    layer_sets: dict[int, frozenset] = {}
    for rule in policy.rules:
        if rule.layers is not None:
            sel = rule.layers
            if sel.kind in ("first", "last") and sel.percent is None and sel.count > n_layers:
                raise rule.error(f"layers {sel.text!r} asks for {sel.count} layers, but the model has {n_layers} "
                                 f"decoder layers; write '{sel.kind} {n_layers}' (or a percentage) if that is meant")
            s = sel.resolve(n_layers, n_mtp)
            bad = sorted(i for i in s if i >= n_layers + n_mtp)
            if bad:
                raise rule.error(f"layers {rule.layers.text!r} names layer {bad[0]}, but the model has "
                                 f"{n_layers} decoder layers (0-{n_layers - 1})"
                                 + (f" and {n_mtp} MTP layer(s)" if n_mtp else ""))
            layer_sets[rule.index] = s
    stats = {r.label: RuleStats() for r in policy.rules}
    entries: dict[str, PlanEntry] = {}
    unaligned: list[tuple[str, Shape, str, Format]] = []
    warnings: list[str] = []
    others: list[str] = []
    rules = policy.rules
    for name, shape in tensors.items():
        shape = tuple(int(x) for x in shape)
        info = layout.describe(name)
        role, layer = info.role, info.layer
        module = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
        invariant = role in INVARIANT_ROLES or len(shape) < 2
        decided: Rule | None = None
        for rule in rules:
            if not _select(rule, name, module, layer, role, layer_sets):
                continue
            st = stats[rule.label]
            # Built-in invariants come before the rules: only a quantizing rule with allow_unsafe can decide an
            # invariant tensor. Other rules that select it neither win it nor count as "selecting" it (so a
            # `layers: last 15%, format: bf16` rule is not credited with that layer's norms, and is not called
            # shadowed because of them).
            if invariant and not (rule.format.quantized and rule.allow_unsafe):
                if rule.format.quantized:
                    st.blocked += 1
                else:
                    st.invariant += 1
                continue
            st.selected += 1
            if decided is not None:
                continue
            decided = rule
            st.won += 1
        if decided is not None:
            fmt, label = decided.format, decided.label
        elif invariant:
            fmt, label = Format.BF16, f"invariant:{role.value if role in INVARIANT_ROLES else '1-d'}"
        elif role in QUANTIZABLE_ROLES:
            fmt, label = policy.default, "default"
        else:
            fmt, label = Format.BF16, "unknown-role"
            others.append(name)
        if fmt.quantized and len(shape) < 2:
            raise decided.error(f"cannot quantize 1-D tensor '{name}' {list(shape)}")  # type: ignore[union-attr]
        act, b2d, bw, pow2 = None, False, None, False
        if fmt.quantized:
            bw = (decided.backward if decided and decided.backward else None) or policy.backward
            scheme = scheme_for(fmt)  # which of the plan's options the format has
            if scheme.pow2_scales:
                rule_pow2 = decided.pow2_scales if decided else None
                pow2 = policy.pow2_scales if rule_pow2 is None else bool(rule_pow2)
            if scheme.activation_scopes:
                scope = (decided.activation_scale if decided else None) or policy.activation_scale
                act = "token" if scope == "per_token" else "tensor"
            if scheme.weight_scale_2d:
                w2d = decided.weight_scale_2d if decided else None
                b2d = policy.weight_scale_2d if w2d is None else bool(w2d)
            block = fmt.block_size
            if block and scheme.aligned and shape[-1] % block:
                unaligned.append((name, shape, label, fmt))
                if policy.on_unaligned == "keep_bf16":
                    fmt, label, act, b2d, bw = Format.BF16, f"{label}->bf16:unaligned", None, False, None
        entries[name] = PlanEntry(name, fmt, label, act, b2d, bw, info.group, layer, role, info.expert, shape,
                                  pow2)

    if unaligned:
        lines = [f"  {n} {list(s)} ({f.value} needs K % {f.block_size} == 0; decided by {lbl})"
                 for n, s, lbl, f in unaligned[:10]]
        more = f"\n  ... and {len(unaligned) - 10} more" if len(unaligned) > 10 else ""
        if policy.on_unaligned == "error":
            raise ConfigError(f"{len(unaligned)} tensor(s) cannot be held in their format, the reduction dim "
                              "(last) is not a multiple of the block:\n" + "\n".join(lines) + more +
                              "\nAdd a bf16 rule for them (e.g. {match: \"<pattern>\", format: bf16}) or set "
                              "'on_unaligned: keep_bf16'.", source=policy.source)
        warnings.append(f"{len(unaligned)} unaligned tensor(s) kept bf16 (on_unaligned: keep_bf16):\n"
                        + "\n".join(lines) + more)
    if others:
        warnings.append(f"{len(others)} tensor(s) of unknown role kept bf16 (no layout entry), e.g. {others[0]}")

    # joint-scale groups (the shards an engine fuses: q/k/v, gate/up, MLA q_a/kv_a) must agree
    by_group: dict[str, list[PlanEntry]] = {}
    for e in entries.values():
        if e.group is not None:
            by_group.setdefault(e.group, []).append(e)
    for group, members in by_group.items():
        first = members[0]
        for e in members[1:]:
            if (e.format, e.activation_scale, e.block_2d, e.backward, e.pow2_scales) != (
                    first.format, first.activation_scale, first.block_2d, first.backward, first.pow2_scales):
                what = "gate and up" if group.endswith("gate_up") else "the fused shards"
                raise ConfigError(
                    f"{what} of '{group}' must share one format and scale (engines run them as one fused GEMM "
                    f"with one NVFP4 global scale): '{first.name}' is {first.format.value} ({first.rule}) but "
                    f"'{e.name}' is {e.format.value} ({e.rule}). Make the rules select all of "
                    f"{sorted(m.name.rsplit('.', 2)[-2] for m in members)} together.", source=policy.source)

    for rule in policy.rules:
        st = stats[rule.label]
        where = f"{rule.where.source}:{rule.where.line}: " if rule.where and rule.where.line else ""
        if st.selected == 0 and st.blocked:
            warnings.append(f"{where}{rule.label} ({rule.text}) selects only invariant tensors "
                            f"({st.blocked}); they stay bf16 without 'allow_unsafe: true' + 'reason'")
        elif st.selected == 0 and st.invariant:
            warnings.append(f"{where}{rule.label} ({rule.text}) has no effect: it selects only invariant tensors "
                            f"({st.invariant}), which are bf16 anyway")
        elif st.selected == 0 and rule.patterns and not rule.format.quantized and rule.where is not None \
                and rule.where.source == "<flags>":
            # a BF16 exception given on the command line that selects nothing: the sampler would quantize what
            # the user asked to keep high precision (Miles' --extra-high-precision-layers-hf matches substrings)
            pats = [p.text for p in rule.patterns]
            hint = [f"'*{t}*'" for t in pats if not any(c in t for c in "*?[") and not t.startswith("re:")]
            raise ConfigError(f"--bf16-pattern {' '.join(pats)} matched no tensor: patterns match whole tensor names "
                              f"(fnmatch, or re: for a regex)" + (f"; did you mean {' '.join(hint)}? (Miles' "
                              "--extra-high-precision-layers-hf matches substrings)" if hint else ""))
        elif st.selected == 0:
            warnings.append(f"{where}{rule.label} ({rule.text}) matched no tensor")
        elif st.won == 0:
            warnings.append(f"{where}{rule.label} ({rule.text}) is shadowed: every tensor it selects "
                            f"({st.selected}) was decided by an earlier rule")

    plan = PrecisionPlan(entries, model_type=layout.model_type, num_layers=n_layers, num_mtp_layers=n_mtp,
                         policy=policy.to_dict(), warnings=warnings, rule_stats=stats, layout=layout)
    if require_quantized and not any(e.format.quantized for e in entries.values()):
        raise ConfigError(f"the plan quantizes nothing ({len(entries)} tensors, all bf16): check 'default' and the "
                          "rules; a bf16 run needs no precision plan", source=policy.source)
    return plan
