"""C1-C5 check functions and the C6 sentinel: each passes on healthy input and fails on its fault."""

import math

import pytest
import torch

from miles_lp.formats import quantize_mxfp8, quantize_nvfp4, quantize_nvfp4_pair
from miles_lp.formats.spec import Format
from miles_lp.multitensor.digest import fingerprint
from miles_lp.rollout.engine import tensor_digest
from miles_lp.sync import checks
from miles_lp.sync.buckets import Ledger
from miles_lp.sync.config import SentinelConfig
from miles_lp.sync.items import engine_items
from miles_lp.sync.sentinel import Sentinel, rollout_kl


def test_layer_audit_compares_learner_engine_and_plan_by_name():
    plan = {"a.weight": Format.MXFP8, "b.weight": Format.MXFP8}
    assert checks.layer_audit(plan, dict(plan), plan).ok
    v = checks.layer_audit(plan, {**plan, "lm_head.weight": "mxfp8"}, plan)
    assert v.failed and v.figure == 1 and "lm_head.weight (engine mxfp8, plan bf16, learner bf16)" in v.examples
    v = checks.layer_audit({"a.weight": "mxfp8"}, plan, plan)  # the learner ran b in bf16: the plan is not enough
    assert v.failed and v.examples == ("b.weight (engine mxfp8, plan mxfp8, learner bf16)",)
    v = checks.layer_audit(None, {"a.weight": "mxfp8"}, plan)
    assert v.failed and "has not run a forward" in v.reason
    assert checks.layer_audit({}, plan, plan).ok


def test_grid_digest_and_full_compare_find_one_flipped_byte():
    t = torch.randn(64, 64).to(torch.bfloat16)
    u = t.clone()
    u.view(torch.uint8).reshape(-1)[77] ^= 1
    assert checks.grid_digests({"t": tensor_digest(t)}, {"t": tensor_digest(t)}).ok
    assert checks.grid_digests({"t": tensor_digest(t)}, {"t": tensor_digest(u)}).failed
    assert checks.grid_digests({"t": fingerprint(t)}, {"t": fingerprint(u)}).failed
    v = checks.grid_full({"t": t}, {"t": u})
    assert v.failed and "1 of 8192 bytes" in v.reason
    assert checks.grid_full({"t": t}, {"t": t.clone()}).ok
    assert checks.grid_full({"t": t}, {}).failed


def test_fingerprint_is_position_sensitive_and_dtype_aware():
    t = torch.arange(4096, dtype=torch.int32)
    swapped = t.clone()
    swapped[[3, 1029]] = swapped[[1029, 3]]
    assert fingerprint(t) != fingerprint(swapped)
    same_row = t.clone()
    same_row[[3, 5]] = same_row[[5, 3]]
    assert fingerprint(t) != fingerprint(same_row)
    assert fingerprint(t) == fingerprint(t.clone())
    assert fingerprint(t) != fingerprint(t.view(torch.float32))
    assert fingerprint(torch.tensor(1.5)) == fingerprint(torch.tensor(1.5))


def test_joint_scale_check_catches_separate_nvfp4_global_scales():
    g, u = torch.randn(32, 64), 3 * torch.randn(32, 64)
    groups = checks.global_scale_names("sglang", {"grp": ("m.gate_proj.weight", "m.up_proj.weight")},
                                       {"m.gate_proj.weight": Format.NVFP4, "m.up_proj.weight": Format.NVFP4})
    assert groups == [("grp", ["m.gate_proj.weight_scale_2", "m.up_proj.weight_scale_2"])]
    qg, qu = quantize_nvfp4_pair(g, u)
    joint = {it.name: it.tensor for it in engine_items([("m.gate_proj.weight", qg), ("m.up_proj.weight", qu)],
                                                       "sglang")}
    split = {it.name: it.tensor for it in engine_items(
        [("m.gate_proj.weight", quantize_nvfp4(g)), ("m.up_proj.weight", quantize_nvfp4(u))], "sglang")}
    assert checks.joint_scales(groups, joint).ok
    v = checks.joint_scales(groups, split)
    assert v.failed and v.figure == 1
    assert checks.joint_scales([], {}).status == "skipped"


def test_joint_scale_check_paths_agree():
    """The healthy shortcuts (the same memory: views of one scale; else two stacks and one comparison) give the
    general path's verdicts: equal values in separate tensors pass; a different value, another dtype (also at
    the same address) or a missing member fail."""
    base = torch.rand(40)
    groups = [(f"g{i}", [f"a{i}", f"b{i}"]) for i in range(40)]
    views = {**{f"a{i}": base[i] for i in range(40)}, **{f"b{i}": base[i] for i in range(40)}}
    v = checks.joint_scales(groups, views)
    assert v.ok and "one tensor each" in v.reason
    copies = {**views, **{f"b{i}": base[i].clone() for i in range(40)}}
    v = checks.joint_scales(groups, copies)
    assert v.ok and "one tensor each" not in v.reason
    bad = {**copies, "b7": base[7] + 1}
    v = checks.joint_scales(groups, bad)
    assert v.failed and v.examples[0].startswith("g7 ")
    reint = {**views, "b9": base.view(torch.int32)[9]}  # the same address, another dtype: not one scale
    assert checks.joint_scales(groups, reint).failed
    assert checks.joint_scales(groups, {**views, "b3": base[3].to(torch.float16)}).failed
    missing = dict(views)
    del missing["b5"]
    v = checks.joint_scales(groups, missing)
    assert v.failed and "missing" in v.examples[0]


def test_self_check_tolerance_nan_and_skip():
    assert checks.self_check({"layers": {"a.weight": 0.03, "e.weight": {"rel_err": 0.05}}}, 0.25).ok
    v = checks.self_check({"layers": {"a.weight": 0.03, "e.weight": {"rel_err": 1.4}}}, 0.25)
    assert v.failed and v.figure == 1.4
    assert checks.self_check({"layers": {"a.weight": float("nan")}}, 0.25).failed
    # an exact fresh-derivation comparison, when the engine offers it, catches stale state within tolerance
    assert checks.self_check({"layers": {"a.weight": {"rel_err": 0.03, "fresh_diff": 0.0}}}, 0.25).ok
    v = checks.self_check({"layers": {"a.weight": {"rel_err": 0.031, "fresh_diff": 2e-4}}}, 0.25)
    assert v.failed and "fresh derivation" in v.examples[0]
    v = checks.self_check({"layers": {}, "skipped": ["no quantized expert layer"]}, 0.25)
    assert v.status == "skipped" and "no quantized expert" in v.reason
    # a layer entry nothing measured is no evidence: neither figure, or a figure that is not a number
    v = checks.self_check({"layers": {"m.layers.0.mlp.down_proj.weight": {"kind": "rotating", "format": "mxfp8"}}},
                          0.25)
    assert v.failed and "no figure reported" in v.examples[0]
    v = checks.self_check({"layers": {"a.weight": 0.03, "b.weight": {"rel_err": None}}}, 0.25)
    assert v.failed and v.examples == ("b.weight (rel_err is not a number: None)",)
    v = checks.self_check({"layers": {"a.weight": {"fresh_diff": "0"}}}, 0.25)
    assert v.failed and "fresh_diff is not a number" in v.examples[0]
    v = checks.self_check({"layers": {"a.weight": 0.03, "r.weight": {"fresh_diff": 0.0}}}, 0.25)
    assert v.ok and "(+1 checked against a fresh derivation)" in v.reason


def test_storage_identity():
    assert checks.storage_identity({"a": 1, "b": 2}, {"a": 1, "b": 2}).ok
    v = checks.storage_identity({"a": 1, "b": 2}, {"a": 1, "b": 3})
    assert v.failed and v.examples == ("b",)
    assert checks.storage_identity(None, {"a": 1}).status == "skipped"


def _items():
    return engine_items([("m.down_proj.weight", quantize_mxfp8(torch.randn(32, 64))),
                         ("m.norm.weight", torch.ones(64, dtype=torch.bfloat16))], "sglang")


def _spec(items):
    return {it.name: checks.parse_digest(tensor_digest(it.tensor)) for it in items}


def test_validate_update_refuses_unknown_shape_dtype_and_precision_mismatches():
    items = _items()
    spec = _spec(items)
    engine_q = {"m.down_proj.weight": "mxfp8"}
    assert checks.parse_digest("float8_e4m3fn[32, 64]:ab") == ("float8_e4m3fn", (32, 64))
    assert checks.parse_digest("float32[]:ab") == ("float32", ())
    assert checks.validate_update(items, spec, engine_q).ok
    v = checks.validate_update(items, {**spec, "m.extra": ("bfloat16", (2,))}, engine_q)
    assert v.failed and "m.extra (not in the learner's export)" in v.examples
    v = checks.validate_update(items, {**spec, "m.norm.weight": ("float32", (64,))}, engine_q)
    assert v.failed and "sent bfloat16[64], engine holds float32[64]" in v.examples[0]
    # the engine holds down_proj in BF16 (its rule excluded it): the learner's e4m3 grid must not be sent
    bf16_spec = {n: s for n, s in spec.items() if "scale" not in n}
    bf16_spec["m.down_proj.weight"] = ("bfloat16", (32, 64))
    v = checks.validate_update(items, bf16_spec, {})
    assert v.failed and any("mxfp8 weight sent to a bf16 parameter" in e for e in v.examples)
    assert any("weight_scale_inv (unknown to the engine)" in e for e in v.examples)


def test_completeness_needs_every_tensor_once_and_every_bucket():
    ledger = Ledger(frozenset({"a", "b"}))
    ledger.received(0, [("a", torch.zeros(1)), ("b", torch.zeros(1))], {})
    assert checks.completeness(ledger, 1).ok
    v = checks.completeness(ledger, 2)
    assert v.failed and "1 of 2 buckets never arrived" in v.examples[0]
    ledger2 = Ledger(frozenset({"a", "b"}))
    ledger2.received(0, [("a", torch.zeros(1))], {})
    assert checks.completeness(ledger2, 1).examples == ("b (never written)",)


def test_version_check():
    assert checks.version(3, 3, 3).ok
    assert checks.version(3, 2).failed
    assert checks.version(3, 3, 2).failed


def test_rollout_kl_is_k1_mean_over_tokens():
    assert rollout_kl([torch.tensor([-1.0, -2.0])], [torch.tensor([-1.5, -2.5])]) == pytest.approx(0.5)
    assert math.isnan(rollout_kl([], []))


def test_sentinel_trips_on_each_condition():
    s = Sentinel(SentinelConfig())
    assert s.update(rollout_logprobs=[torch.tensor([-1.0, -0.5])], kl=0.01).ok
    v = s.update(rollout_logprobs=[torch.tensor([-1.0, float("nan")])], kl=0.01)
    assert v.failed and v.figure == 1 and "not finite" in v.reason
    assert s.update(kl=1.5).failed
    v = s.update(kl=-5.0)  # a sampler's log-probs far below the learner's: k1 negative, k3 ~ e^5 - 6
    assert v.failed and "|rollout_corr/kl| = 5 > 1" in v.reason
    assert s.update(kl=-0.5).ok
    assert s.update(kl=float("inf")).failed
    s = Sentinel()
    assert s.update(clip_ratio=1.0).ok  # one step is not enough
    assert s.update(clip_ratio=0.995).failed  # two in a row
    assert s.update(clip_ratio=0.2).ok  # the streak resets
    s = Sentinel()
    assert s.update(finish_reasons=["length", "length"]).ok
    assert s.update(finish_reasons=["length", "stop"]).ok
    assert s.update(finish_reasons=["length"]).ok
    v = s.update(finish_reasons=["length", "length"])
    assert v.failed and "length cap for 2 steps" in v.reason
    assert Sentinel().update().status == "skipped"


def test_sentinel_for_answers_that_fill_the_cap_still_trips_on_real_faults():
    """``at_length_cap: expected`` (a task whose answers fill max_response_len): all-at-cap steps pass, the
    step says so; non-finite log-probs, a large |kl| and a clip-ratio streak still trip."""
    s = Sentinel(SentinelConfig(at_length_cap="expected"))
    for _ in range(4):
        v = s.update(rollout_logprobs=[torch.tensor([-1.0, -0.5])], kl=0.01, finish_reasons=["length", "length"])
        assert v.ok
    assert "all at the length cap 4 steps (expected)" in v.reason
    v = s.update(rollout_logprobs=[torch.tensor([float("nan")])], kl=0.01, finish_reasons=["length"])
    assert v.failed and "not finite" in v.reason
    assert s.update(kl=2.0, finish_reasons=["length"]).failed
    assert s.update(clip_ratio=1.0, finish_reasons=["length"]).ok
    assert s.update(clip_ratio=1.0, finish_reasons=["length"]).failed
    tripping = Sentinel(SentinelConfig(at_length_cap="trip"))
    tripping.update(finish_reasons=["length"])
    assert tripping.update(finish_reasons=["length"]).failed  # the default rule, unchanged


def test_sentinel_at_length_cap_is_a_checked_key():
    from miles_lp.errors import ConfigError
    from miles_lp.sync.config import parse_sync_config

    assert parse_sync_config({"sentinel": {"at_length_cap": "expected"}}).sentinel.at_length_cap == "expected"
    with pytest.raises(ConfigError, match="at_length_cap"):
        parse_sync_config({"sentinel": {"at_length_cap": "ignore"}})


def test_batched_fingerprints_equal_single_ones():
    from miles_lp.multitensor.digest import fingerprints

    ts = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.uint8), "c": torch.tensor(2.0)}
    assert fingerprints(ts) == {n: fingerprint(t) for n, t in ts.items()}


def test_sentinel_state_round_trips_the_streaks():
    s = Sentinel()
    s.update(clip_ratio=1.0)
    resumed = Sentinel()
    resumed.load_state_dict(s.state_dict())
    assert resumed.update(clip_ratio=1.0).failed  # the second step in a row, across the resume
