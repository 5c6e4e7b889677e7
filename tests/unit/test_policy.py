"""Policy parsing (strict YAML, file:line errors) and plan compilation (invariants, rules, groups, shapes)."""

import json
from pathlib import Path

import pytest

from miles_lp.checkpoint.tiny import ARCHS, tiny_config
from miles_lp.config import load_yaml_text
from miles_lp.errors import ConfigError
from miles_lp.formats.spec import BackwardMode, Format
from miles_lp.policy import (
    PrecisionPlan,
    Role,
    compile_plan,
    get_layout,
    load_policy,
    parse_policy,
    policy_from_flags,
)

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "deepseek_v3_config.json"


def _policy(text: str):
    doc = load_yaml_text(text, "r.yaml")
    return parse_policy(doc.data["precision"], doc.where("precision"))


def _layout(arch):
    return get_layout(tiny_config(arch).to_dict())


ISSUE_RECIPE = """\
precision:
  default: mxfp8
  backward: dequantized
  rules:
    - {layers: first 1, format: bf16}
    - {layers: last 15%, format: bf16}
    - {match: "*.shared_experts.*", format: bf16}
    - {match: "re:.*\\\\.kv_b_proj$", format: bf16}
    - {role: routed_experts, format: nvfp4, activation_scale: per_token}
"""


def test_issue_recipe_on_deepseek():
    plan = compile_plan(_policy(ISSUE_RECIPE), _layout("deepseek_v3"))
    e = plan.entry
    assert e("model.layers.0.self_attn.q_a_proj.weight").format is Format.BF16  # first 1
    assert e("model.layers.3.mlp.experts.0.gate_proj.weight").format is Format.BF16  # last 15% of 4 -> 1 layer
    assert e("model.layers.1.self_attn.kv_b_proj.weight").rule == "rules[3]"
    assert e("model.layers.1.mlp.shared_experts.up_proj.weight").format is Format.BF16
    ex = e("model.layers.2.mlp.experts.1.up_proj.weight")
    assert (ex.format, ex.activation_scale, ex.group) == (Format.NVFP4, "token", "model.layers.2.mlp.experts.1.gate_up")
    q = e("model.layers.2.self_attn.q_b_proj.weight")
    assert (q.format, q.rule, q.backward, q.activation_scale) == (Format.MXFP8, "default", BackwardMode.DEQUANTIZED, None)
    for inv in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.input_layernorm.weight"):
        assert e(inv).format is Format.BF16
    assert plan.warnings == []


@pytest.mark.parametrize("arch", ARCHS)
def test_default_quantizes_linears_only(arch):
    plan = compile_plan(policy_from_flags("mxfp8"), _layout(arch))
    for e in plan.entries.values():
        assert e.format.quantized == (e.role.value in {"attention_qkv", "attention_out", "mla_q_a", "mla_q_b",
                                                       "mla_kv_a", "mla_kv_b", "dense_mlp", "routed_experts",
                                                       "shared_experts"}), e.name


@pytest.mark.parametrize("pattern", ["*.mlp.gate", "*.mlp.gate.*", "re:.*\\.mlp\\.gate", "re:.*mlp\\.gate\\.weight"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "deepseek_v3", "qwen3"])
def test_router_selector_never_matches_gate_proj(arch, pattern):
    """The trap: a router rule `mlp.gate` matched `mlp.gate_up_proj` by substring (56 of 311 wrong)."""
    policy = _policy(f"""precision:
  default: mxfp8
  rules:
    - {{match: '{pattern}', format: bf16}}
""")
    layout = _layout(arch)
    tensors = dict(layout.synthesize())
    tensors["model.layers.1.mlp.gate_up_proj.weight"] = (256, 64)  # a fused dense MLP name in the same model
    plan = compile_plan(policy, layout, tensors)
    for e in plan.entries.values():
        if e.rule == "rules[0]":
            assert e.role in (Role.ROUTER, Role.ROUTER_BIAS), e.name
        if any(s in e.name for s in ("gate_proj", "gate_up_proj", "shared_expert_gate")):
            assert e.rule != "rules[0]", e.name


def test_invariants_need_allow_unsafe_and_reason():
    plan = compile_plan(_policy("precision:\n  default: mxfp8\n  rules:\n    - {match: 'lm_head', format: mxfp8}\n"),
                        _layout("qwen3"))
    assert plan.entry("lm_head.weight").format is Format.BF16
    assert any("selects only invariant tensors" in w for w in plan.warnings)
    with pytest.raises(ConfigError, match=r"r.yaml:4: .*allow_unsafe.*needs a 'reason'"):
        _policy("precision:\n  default: mxfp8\n  rules:\n    - {match: 'lm_head', format: mxfp8, allow_unsafe: true}\n")
    plan = compile_plan(_policy("precision:\n  default: mxfp8\n  rules:\n    - {match: 'lm_head', format: mxfp8, "
                                "allow_unsafe: true, reason: 'measured finite logits'}\n"), _layout("qwen3"))
    assert plan.entry("lm_head.weight").format is Format.MXFP8


@pytest.mark.parametrize("text, match", [
    ("precision:\n  defualt: mxfp8\n", r"r.yaml:2: 'precision.defualt': unknown key 'defualt' \(did you mean 'default'\?\)"),
    ("precision:\n  default: mxfp9\n", r"r.yaml:2: .*must be one of.*did you mean 'mxfp8'"),
    ("precision:\n  default: mxfp8\n  rules:\n    - {layers: last 150%, format: bf16}\n",
     r"r.yaml:4: 'precision.rules.0.layers': .*\(0, 100\], got 'last 150%' \(did you mean 'last 15%'\?\)"),
    ("precision:\n  default: mxfp8\n  rules:\n    - {layers: mpt, format: bf16}\n",
     r"r.yaml:4: 'precision.rules.0.layers': unknown layer selector 'mpt' \(did you mean 'mtp'\?\)"),
    ("precision:\n  default: mxfp8\n  rules:\n    - {match: 3, format: bf16}\n",
     r"r.yaml:4: 'precision.rules.0.match': expected a glob / 're:' pattern \(a string\) or a list"),
    ("precision:\n  default: mxfp8\n  rules:\n    - {role: 3, format: bf16}\n",
     r"r.yaml:4: 'precision.rules.0.role': expected a role"),
    ("precision:\n  default: mxfp8\n  rules:\n    - {role: attention, format: bf16, backward: quantized}\n",
     r"r.yaml:4: 'precision.rules.0.backward': backward applies to quantized formats only"),
    ("precision:\n  default: mxfp8\n  rules:\n    - {layers: [1, '3-'], format: bf16}\n", r"r.yaml:4: .*'3-'"),
    ("precision:\n  default: mxfp8\n  rules: {a: 1}\n", r"r.yaml:3: .*expected a list of rules"),
    ("precision:\n  default: mxfp8\n  rules:\n    - {match: '', format: bf16}\n", r"r.yaml:4: .*empty pattern"),
    ("precision:\n  default: mxfp8\n  rules:\n    - {layers: first 0, format: bf16}\n", r"r.yaml:4: .*positive"),
    ("precision:\n  default: mxfp8\n  rules:\n    - {layers: '7-3', format: bf16}\n", r"r.yaml:4: .*empty layer range"),
    ("precision:\n  default: mxfp8\n  rules:\n    - {layers: [], format: bf16}\n", r"r.yaml:4: .*empty layer list"),
    ("precision:\n  default: mxfp8\n  rules:\n    - {layers: frist 2, format: bf16}\n", r"did you mean 'first'"),
    ("precision:\n  default: mxfp8\n  rules:\n    - {match: 're:(', format: bf16}\n", r"r.yaml:4: .*bad regex"),
    ("precision:\n  default: mxfp8\n  rules:\n    - {role: routed_expert, format: bf16}\n",
     r"unknown role 'routed_expert' \(did you mean 'routed_experts'\?\)"),
    ("precision:\n  default: mxfp8\n  rules:\n    - {format: bf16}\n", r"r.yaml:4: .*at least one selector"),
    ("precision:\n  default: mxfp8\n  rules:\n    - {role: attention, format: mxfp8, activation_scale: per_token}\n",
     r"activation_scale applies to nvfp4 only"),
    ("precision:\n  default: mxfp8\n  rules:\n    - {role: attention, fromat: bf16}\n", r"did you mean 'format'"),
    ("precision:\n  default: mxfp8\n  backward: 3\n", r"r.yaml:3: .*backward"),
    # PyYAML keeps the last of two equal keys silently; the policy would have run bf16
    ("precision:\n  default: mxfp8\n  default: bf16\n",
     r"r.yaml:3: duplicate key 'precision.default' \(first on line 2\)"),
    ("precision:\n  default: mxfp8\n  rules:\n    - {role: attention, format: bf16, role: mlp}\n",
     r"r.yaml:4: duplicate key 'precision.rules.0.role'"),
])
def test_bad_input_names_file_line_and_fix(text, match):
    with pytest.raises(ConfigError, match=match):
        _policy(text)


def test_optional_field_error_keeps_file_and_line():
    # an Optional field (str | None) goes through the union branch of the parser: its error must keep the
    # location as attributes too (the CLI and callers read .source / .line), not only in the message
    with pytest.raises(ConfigError, match=r"r.yaml:4: .*did you mean 'per_token'") as exc:
        _policy("precision:\n  default: mxfp8\n  rules:\n"
                "    - {role: routed_experts, format: nvfp4, activation_scale: per_tokn}\n")
    assert (exc.value.source, exc.value.line) == ("r.yaml", 4)


def test_out_of_range_layer_at_compile():
    policy = _policy("precision:\n  default: mxfp8\n  rules:\n    - {layers: [2, 9], format: bf16}\n")
    with pytest.raises(ConfigError, match=r"r.yaml:4: .*layer 9.*4 decoder layers"):
        compile_plan(policy, _layout("qwen3"))


def test_first_n_beyond_the_model_is_an_error():
    policy = _policy("precision:\n  default: mxfp8\n  rules:\n    - {layers: first 100, format: bf16}\n")
    with pytest.raises(ConfigError, match=r"r.yaml:4: .*'first 100' asks for 100 layers.*4 decoder layers"):
        compile_plan(policy, _layout("qwen3"))


def test_invariants_are_attributed_before_rules(tmp_path):
    """First match wins AFTER the built-in invariants: a bf16 layer rule does not claim that layer's norms or
    router, and its shadowed / matched-nothing bookkeeping counts only tensors it could decide."""
    plan = compile_plan(load_policy(ROOT / "recipes" / "policies/qwen3-moe-mxfp8-nvfp4-experts.yaml"), _layout("qwen3_moe"))
    last = plan.num_layers - 1
    for e in plan.entries.values():
        if e.role in (Role.NORM, Role.ROUTER, Role.EMBEDDING, Role.LM_HEAD):
            assert e.rule == f"invariant:{e.role.value}" and e.format is Format.BF16, (e.name, e.rule)
    assert plan.entry(f"model.layers.{last}.input_layernorm.weight").rule == "invariant:norm"
    assert plan.entry(f"model.layers.{last}.mlp.gate.weight").rule == "invariant:router"
    assert plan.entry(f"model.layers.{last}.self_attn.o_proj.weight").rule == "rules[0]"
    st = plan.rule_stats["rules[0]"]
    assert st.won == st.selected and st.invariant > 0
    assert plan.warnings == []
    # a bf16 rule that only selects invariants has no effect, and says so (not "matched no tensor")
    p = _policy("precision:\n  default: mxfp8\n  rules:\n    - {match: '*.mlp.gate', format: bf16}\n"
                "    - {role: norm, format: mxfp8}\n")
    plan = compile_plan(p, _layout("qwen3_moe"))
    text = "\n".join(plan.warnings)
    assert "rules[0]" in text and "has no effect" in text and "matched no tensor" not in text
    assert "rules[1]" in text and "selects only invariant tensors" in text
    # a later rule is not "shadowed" by an earlier rule that only touched invariant tensors
    p = _policy("precision:\n  default: mxfp8\n  rules:\n    - {layers: last 1, format: bf16}\n"
                "    - {match: '*.input_layernorm', format: bf16}\n    - {layers: last 1, role: attention, "
                "format: mxfp8}\n")
    plan = compile_plan(p, _layout("qwen3_moe"))
    text = "\n".join(plan.warnings)
    assert "rules[1]" in text and "has no effect" in text
    assert "rules[2]" in text and "shadowed" in text and "(4)" in text  # q, k, v, o of the last layer
    # allow_unsafe rules do decide invariant tensors
    p = _policy("precision:\n  default: mxfp8\n  rules:\n    - {layers: last 1, format: bf16}\n"
                "    - {match: lm_head, format: mxfp8, allow_unsafe: true, reason: measured}\n")
    plan = compile_plan(p, _layout("qwen3_moe"))
    assert plan.entry("lm_head.weight").rule == "rules[1]" and plan.entry("lm_head.weight").format is Format.MXFP8


def test_any_lookup_is_memoised(monkeypatch):
    plan = compile_plan(_policy(ISSUE_RECIPE), _layout("deepseek_v3"))
    names = ["decoder.layers.2.mlp.experts.linear_fc1.weight1", "model.layers.2.mlp.experts.gate_up_proj",
             "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", "model.layers.1.mlp.gate.weight"]
    first = {n: plan.entries_for_any(n) for n in names}
    fmts = {n: plan.format_for_any(n) for n in names}
    calls = []
    monkeypatch.setattr(plan.layout, "describe", lambda n: calls.append(n))
    for n in names:
        assert plan.entries_for_any(n) is first[n] and plan.format_for_any(n) is fmts[n]
    assert calls == []
    assert fmts["model.layers.2.mlp.experts.gate_up_proj"] is Format.NVFP4
    monkeypatch.undo()
    plan.prepare_any(["decoder.layers.0.mlp.linear_fc1.weight"])
    assert "decoder.layers.0.mlp.linear_fc1.weight" in plan._any
    with pytest.raises(KeyError):
        PrecisionPlan.from_json(plan.to_json()).entries_for_any("decoder.layers.0.mlp.linear_fc1.weight")


def test_quantizes_nothing_is_an_error():
    with pytest.raises(ConfigError, match="quantizes nothing"):
        compile_plan(_policy("precision:\n  default: bf16\n"), _layout("llama"))


def test_unaligned_k_error_and_keep_bf16():
    layout = _layout("qwen3")
    tensors = dict(layout.synthesize())
    tensors["model.layers.1.mlp.down_proj.weight"] = (64, 120)  # K = 120 not a multiple of 32
    with pytest.raises(ConfigError, match=r"(?s)model.layers.1.mlp.down_proj.weight \[64, 120\].*K % 32.*keep_bf16"):
        compile_plan(policy_from_flags("mxfp8"), layout, tensors)
    plan = compile_plan(_policy("precision:\n  default: mxfp8\n  on_unaligned: keep_bf16\n"), layout, tensors)
    assert plan.entry("model.layers.1.mlp.down_proj.weight").format is Format.BF16
    assert plan.entry("model.layers.1.mlp.down_proj.weight").rule == "default->bf16:unaligned"
    assert any("unaligned" in w for w in plan.warnings)


def test_gate_up_split_is_an_error_naming_both():
    policy = _policy("precision:\n  default: mxfp8\n  rules:\n    - {match: '*.up_proj.weight', format: bf16}\n")
    with pytest.raises(ConfigError, match=r"gate and up of 'model.layers.0.mlp.gate_up'.*gate_proj.*up_proj"):
        compile_plan(policy, _layout("qwen3"))


def test_warnings_unmatched_and_shadowed():
    plan = compile_plan(_policy("""precision:
  default: mxfp8
  rules:
    - {role: attention, format: bf16}
    - {match: "*.self_attn.o_proj", format: bf16}
    - {match: "*.nonexistent.*", format: bf16}
"""), _layout("llama"))
    text = "\n".join(plan.warnings)
    assert "r.yaml:5: rules[1]" in text and "shadowed" in text
    assert "r.yaml:6: rules[2]" in text and "matched no tensor" in text


def test_percent_and_mtp_layers():
    layout = get_layout(json.loads(FIXTURE.read_text()))
    policy = load_policy(ROOT / "recipes" / "policies/deepseek-v3-mxfp8.yaml")
    plan = compile_plan(policy, layout, layout.synthesize(include_mtp=True))
    bf16 = {e.layer for e in plan.entries.values() if e.rule == "rules[0]"}
    assert bf16 == set(range(51, 61))  # ceil(61 * 0.15) = 10 decoder layers; the MTP layer is not counted
    assert plan.entry("model.layers.61.mlp.experts.0.gate_proj.weight").format is Format.MXFP8
    assert plan.entry("model.layers.61.eh_proj.weight").format is Format.BF16


def test_plan_json_roundtrip_and_hash():
    layout = _layout("qwen2_moe")
    plan = compile_plan(_policy(ISSUE_RECIPE.replace("shared_experts", "shared_expert")), layout)
    text = plan.to_json()
    again = PrecisionPlan.from_json(text, layout=layout)
    assert again == plan and again.hash == plan.hash and again.to_json() == text
    assert json.loads(text) == json.loads(json.dumps(json.loads(text), sort_keys=True))
    other = compile_plan(policy_from_flags("mxfp8"), layout)
    assert other.hash != plan.hash


def test_lookup_by_megatron_and_fused_names():
    plan = compile_plan(_policy(ISSUE_RECIPE), _layout("deepseek_v3"))
    assert plan.format_for_any("decoder.layers.2.mlp.experts.linear_fc1.weight1") is Format.NVFP4
    assert plan.format_for_any("model.layers.2.mlp.experts.gate_up_proj") is Format.NVFP4
    assert plan.format_for_any("decoder.layers.2.self_attention.linear_kv_up_proj.weight") is Format.BF16


def test_load_policy_ignores_other_sections(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("train:\n  lr: 1.0e-6\nprecision:\n  default: nvfp4\nrollout: {n: 8}\n")
    assert load_policy(p).default is Format.NVFP4
    p.write_text("train: {}\n")
    with pytest.raises(ConfigError, match="no 'precision:' section"):
        load_policy(p)
