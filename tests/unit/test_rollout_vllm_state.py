"""The pure parts of ``rollout.vllm_state`` (what the vLLM engine process uses for C2/C3), without vLLM:
fused-parameter splitting into checkpoint names, and the shared C3 probe's float64 decodes
(``rollout.self_check``) against the project's codecs."""

from __future__ import annotations

import torch

from miles_lp.formats.mxfp8 import quantize_mxfp8
from miles_lp.formats.nvfp4 import quantize_nvfp4
from miles_lp.rollout.self_check import decode_mxfp8_f64, decode_nvfp4_f64, rel_err
from miles_lp.rollout.vllm_state import split_fused


def test_split_fused_rows_per_shard_scalars_and_plain_modules():
    w = torch.arange(8 * 2).reshape(8, 2)
    parts = split_fused("model.layers.0.self_attn.qkv_proj", "weight", w, [4, 2, 2])
    assert list(parts) == [f"model.layers.0.self_attn.{s}_proj.weight" for s in "qkv"]
    assert torch.equal(torch.cat(list(parts.values())), w)
    assert torch.equal(parts["model.layers.0.self_attn.k_proj.weight"], w[4:6])
    per_shard = split_fused("m.mlp.gate_up_proj", "weight_scale_2", torch.tensor([0.5, 0.25]), [4, 4])
    assert {k: float(v) for k, v in per_shard.items()} == {"m.mlp.gate_proj.weight_scale_2": 0.5,
                                                            "m.mlp.up_proj.weight_scale_2": 0.25}
    assert all(v.shape == () for v in per_shard.values())  # the checkpoint's scalar shape
    plain = split_fused("m.mlp.down_proj", "weight", w, None)
    assert list(plain) == ["m.mlp.down_proj.weight"] and plain["m.mlp.down_proj.weight"] is w


def test_own_decodes_equal_the_codecs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=g) * 3
    mx = quantize_mxfp8(x.to(torch.bfloat16))
    assert torch.equal(decode_mxfp8_f64(mx.data, mx.scale).to(torch.float32), mx.dequantize(torch.float32))
    nv = quantize_nvfp4(x.to(torch.bfloat16))
    ours = decode_nvfp4_f64(nv.data, nv.scale, nv.global_scale)
    assert torch.allclose(ours, nv.dequantize(torch.float32).to(torch.float64), rtol=1e-6, atol=0)
    assert rel_err(ours.to(torch.float32), ours) < 1e-7
    assert rel_err(torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.float64)) == 1.0


# ---- C3 on a fake vLLM module tree: the fixed pair, the rotating layer, every layer ---------------------------
# vLLM's MXFP8 emulation as far as vllm_state sees it: fused qkv / gate_up modules with ``output_sizes``, a quant
# method whose ``process_weights_after_loading`` replaces the E4M3 weight by its BF16 dequantization, and
# ``apply`` a BF16 GEMM on that operand. The loader writes the fused canonical tensors, then post-processes.

class FakeMxfp8LinearMethod:  # the class name is what fmt_of reads ("mxfp8")
    def process_weights_after_loading(self, layer):
        w = decode_mxfp8_f64(layer.weight.data, layer.weight_scale.data).to(torch.float32).to(torch.bfloat16)
        layer.weight = torch.nn.Parameter(w, requires_grad=False)

    def apply(self, layer, x, bias=None):
        return (x.to(torch.float32) @ layer.weight.to(torch.float32).T).to(torch.bfloat16)


HIDDEN, INTER, LAYERS = 64, 96, 3
SHAPES = {"self_attn.qkv_proj": ([64, 32, 32], HIDDEN), "self_attn.o_proj": ([HIDDEN], 64),
          "mlp.gate_up_proj": ([INTER, INTER], HIDDEN), "mlp.down_proj": ([HIDDEN], INTER)}


def _fake_model() -> torch.nn.Module:
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList()
    for _ in range(LAYERS):
        layer = torch.nn.Module()
        layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
        for path, (sizes, k) in SHAPES.items():
            parent, leaf = path.split(".")
            m = torch.nn.Module()
            m.quant_method = FakeMxfp8LinearMethod()  # one instance per module (vLLM may share one)
            if len(sizes) > 1:
                m.output_sizes = sizes
            m.weight = torch.nn.Parameter(torch.zeros(sum(sizes), k, dtype=torch.bfloat16), requires_grad=False)
            m.weight_scale = torch.nn.Parameter(torch.zeros(sum(sizes), k // 32, dtype=torch.uint8),
                                                requires_grad=False)
            setattr(getattr(layer, parent), leaf, m)
        root.model.layers.append(layer)
    root.lm_head = torch.nn.Linear(HIDDEN, 8, bias=False)  # no quant method: not a C3 candidate
    return root


def _weights(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per vLLM module, fused E4M3 weight rows and E8M0 scales (each shard quantized on its own, as on disk)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(LAYERS):
        for path, (sizes, k) in SHAPES.items():
            qs = [quantize_mxfp8(torch.randn(n, k, generator=g).to(torch.bfloat16)) for n in sizes]
            out[f"model.layers.{i}.{path}"] = (torch.cat([q.data for q in qs]), torch.cat([q.scale for q in qs]))
    return out


def _load(model, state, weights) -> None:
    """vLLM's reload as the worker runs it: the stale fault's snapshot, load + post-process, its restore."""
    snap = state.snapshot_stale()
    mods = dict(model.named_modules())
    for name, (w, s) in weights.items():
        mod = mods[name]
        mod.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
        mod.weight_scale.data.copy_(s)
        mod.quant_method.process_weights_after_loading(mod)
    state.restore_stale(snap)


def _state(stale: str | None = None):
    from miles_lp.rollout.vllm_state import Canonical

    model = _fake_model()
    st = Canonical(model)
    assert st.install() == LAYERS * len(SHAPES)
    _load(model, st, _weights(0))  # the served checkpoint, A
    st.faults = {"stale": [stale]} if stale else {}
    _load(model, st, _weights(1))  # an update to B: a stale module keeps A's served operand
    return st


def test_rotation_interleaves_families_and_reaches_every_module():
    from miles_lp.rollout.vllm_state import family, rotation_order

    st = _state()
    mods = st.quantized_modules()
    assert len(mods) == LAYERS * len(SHAPES) and all(f == "mxfp8" for _, f in mods)
    rot = rotation_order(mods)
    assert sorted(rot) == sorted(mods)  # every quantized module once
    fams = [family(n) for n, _ in rot]
    assert len(set(fams)) == len(SHAPES)
    for i in range(len(rot) - len(SHAPES) + 1):  # any len(SHAPES) consecutive syncs see every family
        assert len(set(fams[i:i + len(SHAPES)])) == len(SHAPES)
    assert family("model.layers.12.mlp.experts.3.down_proj") == "model.layers.*.mlp.experts.*.down_proj"


def test_healthy_self_check_fixed_pair_rotating_and_every_layer_are_clean():
    from miles_lp.sync.checks import self_check

    st = _state()
    mods = st.quantized_modules()
    first, last = f"{mods[0][0]}.weight", f"{mods[-1][0]}.weight"
    plain = st.self_check(seed=3)
    assert list(plain["layers"]) == [first, last] and "rotation" not in plain
    seen = set()
    for v in range(len(mods)):
        r = st.self_check(seed=3, version=v)
        assert r["layers"][first] == plain["layers"][first] and r["layers"][last] == plain["layers"][last]
        assert r["rotation"]["position"] == v and r["rotation"]["length"] == len(mods)
        rot = {n: e for n, e in r["layers"].items() if e["kind"] == "rotating"}
        assert len(rot) == (0 if f"{r['rotation']['module']}.weight" in (first, last) else 1)
        seen.update(rot)
        for e in r["layers"].values():
            assert 0 < e["rel_err"] < 0.01 and e["fresh_diff"] == 0.0, r  # bf16 rounding of the output only
        assert self_check(r, 0.25).ok
    assert seen == {f"{n}.weight" for n, _ in mods} - {first, last}
    every = st.every_layer()
    assert set(every) == {f"{n}.weight" for n, _ in mods}
    assert all(e["kind"] == "every" and 0 < e["rel_err"] < 0.01 and e["fresh_diff"] == 0.0 for e in every.values())


def test_stale_module_outside_the_fixed_pair_fails_the_rotation_and_every_layer():
    """A stale module neither first nor last: the fixed pair passes at every version, the rotating probe fails
    exactly when the rotation reaches it (within len(rotation) syncs), every_layer fails it, and only it, at once."""
    from miles_lp.rollout.vllm_state import rotation_order
    from miles_lp.sync.checks import self_check

    target = "model.layers.1.mlp.gate_up_proj"
    st = _state(stale=target)
    rot = rotation_order(st.quantized_modules())
    caught = []
    for v in range(len(rot)):
        r = st.self_check(version=v)
        verdict = self_check(r, 0.25)
        if verdict.failed:
            caught.append(v)
            e = r["layers"][f"{target}.weight"]
            assert e["kind"] == "rotating" and e["rel_err"] > 0.25 and e["fresh_diff"] > 0, e
            assert [x.split(" (")[0] for x in verdict.examples] == [f"{target}.weight"] * 2
        assert all(e["rel_err"] < 0.01 for e in r["layers"].values() if e["kind"] == "dense")
    assert caught == [rot.index((target, "mxfp8"))]
    every = st.every_layer()
    bad = {n: e for n, e in every.items() if not (e["rel_err"] <= 0.25 and e["fresh_diff"] == 0)}
    assert list(bad) == [f"{target}.weight"] and bad[f"{target}.weight"]["rel_err"] > 1.0
    merged = {**st.self_check(version=0), "layers": {**st.self_check(version=0)["layers"], **every}}
    assert self_check(merged, 0.25).failed  # what WeightSync's full-compare sync builds


def test_client_ok_needs_every_rel_err_within_tolerance_and_fresh_diff_zero():
    from miles_lp.rollout.self_check import passes

    def _c3_ok(entry, tol):
        return passes([entry], tol)

    assert _c3_ok({"rel_err": 0.0017, "fresh_diff": 0.0}, 0.25) and _c3_ok({"rel_err": 0.089}, 0.25)
    assert not _c3_ok({"rel_err": 0.0017, "fresh_diff": 0.1055}, 0.25)  # stale after a small step
    assert not _c3_ok({"rel_err": 1.4}, 0.25) and not _c3_ok({"rel_err": float("nan")}, 0.25)
    assert not _c3_ok({"rel_err": float("inf"), "reason": "no captured canonical tensor"}, 0.25)


# ---- NVFP4 on vLLM's emulation kernel: fresh_diff re-derives its post-processing -------------------------------

class EmulationNvFp4LinearKernel:
    """Stands in for vLLM's kernel class of that name: vllm_state gates the NVFP4 re-derivation on the name."""


class FakeModelOptLinearMethod:
    """vLLM's ModelOpt NVFP4 on CPU as vllm_state sees it: packed weight and block scales kept as loaded, one
    global weight / input scale per fused module (their max), the inverse and alpha derived, per-shard ones dropped."""

    def __init__(self):
        self.kernel = EmulationNvFp4LinearKernel()

    def process_weights_after_loading(self, layer):
        P = torch.nn.Parameter  # noqa: N806
        layer.weight_global_scale = P(layer.weight_scale_2.max().to(torch.float32), requires_grad=False)
        layer.input_global_scale = P(layer.input_scale.max().to(torch.float32), requires_grad=False)
        layer.input_global_scale_inv = P((1.0 / layer.input_global_scale).to(torch.float32), requires_grad=False)
        layer.alpha = P(layer.input_global_scale * layer.weight_global_scale, requires_grad=False)
        del layer.weight_scale_2, layer.input_scale

    def apply(self, layer, x, bias=None):
        w = decode_nvfp4_f64(layer.weight, layer.weight_scale, layer.weight_global_scale).to(torch.float32)
        return (x.to(torch.float32) @ w.T).to(torch.bfloat16)


NV_SHAPES = {"self_attn.o_proj": ([64], 64), "mlp.gate_up_proj": ([96, 96], 64)}


def _nv_model() -> torch.nn.Module:
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList()
    for _ in range(2):
        layer = torch.nn.Module()
        layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
        for path, (sizes, _k) in NV_SHAPES.items():
            parent, leaf = path.split(".")
            m = torch.nn.Module()
            m.quant_method = FakeModelOptLinearMethod()
            if len(sizes) > 1:
                m.output_sizes = sizes
            m.weight = torch.nn.Parameter(torch.zeros(1), requires_grad=False)  # replaced by each load
            setattr(getattr(layer, parent), leaf, m)
        root.model.layers.append(layer)
    return root


def _nv_weights(nudge_from=None):
    """Per vLLM module: packed weight, block scales, per-shard global and input scales (gate and up share one
    global scale, as the learner's export). ``nudge_from``: those weights with 1% of the packed bytes' low code
    moved by one step (an RL-sized change)."""
    if nudge_from is not None:
        g = torch.Generator().manual_seed(1)
        out = {}
        for n, (w, s, s2, i) in nudge_from.items():
            flip = torch.rand(w.shape, generator=g) < 0.01
            out[n] = (torch.where(flip, w ^ 1, w), s, s2, i)
        return out
    g = torch.Generator().manual_seed(0)
    out = {}
    for li in range(2):
        for path, (sizes, k) in NV_SHAPES.items():
            x = torch.randn(sum(sizes), k, generator=g).to(torch.bfloat16)
            q = quantize_nvfp4(x)  # one global scale for the fused module's shards
            n = len(sizes)
            out[f"model.layers.{li}.{path}"] = (q.data, q.scale, q.global_scale.reshape(1).repeat(n),
                                                torch.full((n,), 0.01))
    return out


def _nv_load(model, state, weights) -> None:
    snap = state.snapshot_stale()
    mods = dict(model.named_modules())
    P = torch.nn.Parameter  # noqa: N806
    for name, (w, s, s2, i) in weights.items():
        mod = mods[name]
        mod.weight, mod.weight_scale = P(w.clone(), requires_grad=False), P(s.clone(), requires_grad=False)
        mod.weight_scale_2, mod.input_scale = P(s2.clone(), requires_grad=False), P(i.clone(), requires_grad=False)
        mod.quant_method.process_weights_after_loading(mod)
    state.restore_stale(snap)


def test_nvfp4_fresh_diff_sees_a_stale_layer_after_a_small_update():
    from miles_lp.rollout.vllm_state import Canonical
    from miles_lp.sync.checks import self_check

    target = "model.layers.0.mlp.gate_up_proj"  # neither the first nor the last
    model = _nv_model()
    st = Canonical(model)
    st.install()
    a = _nv_weights()
    _nv_load(model, st, a)
    healthy = st.every_layer()
    assert [f for _, f in st.quantized_modules()] == ["nvfp4"] * 4
    assert all(e["fresh_diff"] == 0.0 and 0 < e["rel_err"] < 0.01 for e in healthy.values()), healthy
    st.faults = {"stale": [target]}
    _nv_load(model, st, _nv_weights(nudge_from=a))
    every = st.every_layer()
    bad = {n: e for n, e in every.items() if e["fresh_diff"] != 0.0}
    assert list(bad) == [f"{target}.weight"]
    assert bad[f"{target}.weight"]["rel_err"] < 0.25 < 1  # the tolerance alone passes it
    assert self_check({"layers": every}, 0.25).failed
    fixed = st.self_check()["layers"]
    assert f"{target}.weight" not in fixed and all(e["fresh_diff"] == 0.0 for e in fixed.values())


# ---- tensor-parallel ranks: one checkpoint tensor from every rank's copy, and the merged answers ----------------

def test_assemble_concatenates_shards_along_the_cut_dimension_exactly():
    from miles_lp.rollout.vllm_state import assemble

    w = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6).to(torch.bfloat16)
    t, why = assemble([(w[:4], 1), (w[4:], 1)], (8, 6))  # column-parallel rows
    assert why is None and torch.equal(t, w)
    t, why = assemble([(w[:, :3], 1), (w[:, 3:], 1)], (8, 6))  # row-parallel columns
    assert why is None and torch.equal(t, w)
    pad = torch.cat([w, torch.zeros(2, 6, dtype=w.dtype)])  # vocab padded to 10 rows: 5 per rank, 2 padding at the end
    t, why = assemble([(pad[:5], 1), (pad[5:], 1)], (8, 6))
    assert why is None and torch.equal(t, w)
    assert assemble([(w, 1)], (8, 6))[0] is w  # tp 1: the one copy as it is
    assert assemble([(None, 1), (None, 1)], (8, 6)) == (None, None)  # held by no rank


def test_assemble_kv_heads_held_by_several_ranks_and_whole_tensors_must_agree_byte_for_byte():
    from miles_lp.rollout.vllm_state import assemble

    k = torch.randn(4, 6).to(torch.bfloat16)
    h0, h1 = k[:2], k[2:]
    t, why = assemble([(h0, 2), (h0.clone(), 2), (h1, 2), (h1.clone(), 2)], (4, 6))  # 2 KV heads on 4 ranks
    assert why is None and torch.equal(t, k)
    other = h1.clone()
    other[0, 0] = other[0, 0] + 1
    t, why = assemble([(h0, 2), (h0.clone(), 2), (h1, 2), (other, 2)], (4, 6))
    assert t is None and why == "TP ranks 2 and 3 hold the same shard with different bytes"
    norm = torch.ones(6, dtype=torch.bfloat16)
    t, why = assemble([(norm, 1), (norm.clone(), 1)], (6,))
    assert why is None and torch.equal(t, norm)
    off = norm.clone()
    off[5] = 2
    assert assemble([(norm, 1), (off, 1)], (6,)) == (None, "held whole by every TP rank, but rank 1 differs from rank 0")
    neg_zero = torch.tensor([-0.0], dtype=torch.bfloat16)  # equal as numbers, not as bytes
    assert assemble([(torch.tensor([0.0], dtype=torch.bfloat16), 1), (neg_zero, 1)], (1,))[0] is None
    assert assemble([(norm, 1), (None, 1)], (6,)) == (None, "absent on TP rank(s) [1]")
    assert "do not cut" in assemble([(k[:2, :3], 1), (k[2:, 3:], 1)], (4, 6))[1]
    assert "cover 2 of 4" in assemble([(k[:1], 1), (k[1:2], 1)], (4, 6))[1]


def test_merged_answers_cover_every_rank():
    from miles_lp.rollout.vllm_state import merge_introspection, merge_layers, merge_parts, merge_pointers

    assert merge_pointers([{"a.weight": 1}, {"a.weight": 1}]) == {"a.weight": 1, "a.weight@tp1": 1}
    worst = merge_layers([{"m.weight": {"rel_err": 0.001, "fresh_diff": 0.0, "kind": "dense", "format": "mxfp8"}},
                          {"m.weight": {"rel_err": 0.002, "fresh_diff": 0.5, "kind": "dense", "format": "mxfp8"}}])
    assert worst == {"m.weight": {"rel_err": 0.002, "fresh_diff": 0.5, "kind": "dense", "format": "mxfp8",
                                  "tp_ranks": 2}}
    missing = merge_layers([{"m.weight": {"rel_err": 0.001, "kind": "dense", "format": "mxfp8"}}, {}])
    assert missing["m.weight"]["rel_err"] == float("inf") and "TP rank(s) [1]" in missing["m.weight"]["reason"]
    info = {"classes": ["ModelOptMxFp8LinearMethod"], "format": "mxfp8", "params": {}}
    assert merge_introspection([{"q": info}, {"q": info}]) == {"q": info}
    differ = merge_introspection([{"q": info}, {"q": {**info, "classes": ["UnquantizedLinearMethod"], "format": None}}])
    assert differ["q"]["format"] == "TP ranks differ: rank 0 mxfp8, rank 1 None"
    w = torch.zeros(4, 2)
    got, bad = merge_parts([{"x": (w[:2], 1), "n": (torch.ones(2), 1)}, {"x": (w[2:], 1), "n": (torch.zeros(2), 1)}],
                           ["x", "n"], {"x": (4, 2), "n": (2,)})
    assert torch.equal(got["x"], w) and got["n"] is None and list(bad) == ["n"]
