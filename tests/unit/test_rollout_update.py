"""Reference engine: update semantics, bad input, fault hooks (each fault is caught by the check it targets)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from miles_lp.errors import CheckpointError
from miles_lp.rollout.engine import EngineError, SamplingParams, WeightUpdateError
from miles_lp.rollout.reference import EngineFaults, ReferenceEngine
from miles_lp.rollout.testing import tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = "policies/qwen3-moe-mxfp8-nvfp4-experts.yaml"
Q = "model.layers.0.self_attn.q_proj."
EXPERT = "model.layers.0.mlp.experts.1.gate_proj."


@pytest.fixture(scope="module")
def ckpts():
    return tiny_checkpoint("qwen3_moe", RECIPE), tiny_checkpoint("qwen3_moe", RECIPE, seed=1)


@pytest.fixture(scope="module")
def new_weights(ckpts):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(ckpts[1].glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture
def engine(ckpts):
    return ReferenceEngine(ckpts[0], device="cpu")


def _full_update(engine, tensors):
    engine.begin_weight_update()
    engine.update_weights(tensors.items())
    return engine.finish_weight_update()


@pytest.mark.parametrize("bad, match", [
    (("model.layers.0.self_attn.q_proj.weight_scale", torch.zeros(128, 2, dtype=torch.uint8)), "unknown parameter"),
    ((Q + "weight", torch.zeros(128, 64, dtype=torch.bfloat16)), "dtype bfloat16, the engine holds float8_e4m3fn"),
    ((Q + "weight_scale_inv", torch.zeros(128, 4, dtype=torch.uint8)), r"shape \[128, 4\], the engine holds \[128, 2\]"),
    ((EXPERT + "weight_scale_2", torch.ones(1)), r"shape \[1\], the engine holds \[\]"),
])
def test_bad_bucket_rejected_whole(engine, new_weights, bad, match):
    """A bad tensor anywhere in a bucket: WeightUpdateError naming it, and not one byte written."""
    good = [(n, t) for n, t in new_weights.items() if n.startswith("model.layers.1.")]
    before = engine.weight_digests()
    engine.begin_weight_update()
    with pytest.raises(WeightUpdateError, match=match):
        engine.update_weights([*good, bad])
    assert engine.weight_digests() == before
    engine.finish_weight_update()  # the previous weights keep serving
    assert engine.weight_digests() == before
    assert engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=0))[0].weight_version == 1


def test_duplicate_and_outside_update(engine, new_weights):
    with pytest.raises(EngineError, match="begin_weight_update first"):
        engine.update_weights([(Q + "weight", new_weights[Q + "weight"])])
    engine.begin_weight_update()
    with pytest.raises(WeightUpdateError, match="appears twice"):
        engine.update_weights([(Q + "weight", new_weights[Q + "weight"])] * 2)
    with pytest.raises(EngineError, match="already in progress"):
        engine.begin_weight_update()
    with pytest.raises(EngineError, match="generation is refused"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    engine.finish_weight_update()
    with pytest.raises(EngineError, match="without begin_weight_update"):
        engine.finish_weight_update()


def test_bad_generate_input(engine):
    with pytest.raises(EngineError, match="prompt 0 has 256 tokens; the context is 256"):
        engine.generate([[1] * 256], SamplingParams(max_new_tokens=1))
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.generate([[1, 999]], SamplingParams(max_new_tokens=1))
    with pytest.raises(EngineError, match="top_p must be in"):
        engine.generate([[1]], SamplingParams(top_p=0.0))
    with pytest.raises(EngineError, match="empty"):
        engine.generate([[]], SamplingParams())
    # a response the context would cut is refused, as SGLang and vLLM do (a cut would read as `length`: L10)
    with pytest.raises(EngineError, match=r"prompt 0 has 250 tokens \+ max_new_tokens 50 = 300, beyond the context 256"):
        engine.generate([[1] * 250], SamplingParams(max_new_tokens=50, seed=0))
    g = engine.generate([[1] * 250], SamplingParams(max_new_tokens=6, seed=0))[0]
    assert len(g.output_ids) == 6 and g.finish_reason == "length"  # its own cap, exactly at the context


def test_sampling_controls(engine):
    p = [[1, 2, 3], [4, 5]]
    a = engine.generate(p, SamplingParams(max_new_tokens=6, seed=7))
    b = engine.generate(p, SamplingParams(max_new_tokens=6, seed=7))
    c = engine.generate(p, SamplingParams(max_new_tokens=6, seed=8))
    assert [x.output_ids for x in a] == [x.output_ids for x in b] != [x.output_ids for x in c]
    greedy = engine.generate(p, SamplingParams(max_new_tokens=6, temperature=0.0))
    top1 = engine.generate(p, SamplingParams(max_new_tokens=6, top_k=1, seed=3))
    assert [x.output_ids for x in greedy] == [x.output_ids for x in top1]
    # raw logprob (temperature 1) vs the processed distribution's: top_k=1 makes the latter exactly 0
    assert all(float(x.logprobs.max()) < 0 for x in top1)
    proc = engine.generate(p, SamplingParams(max_new_tokens=6, top_k=1, seed=3, logprob_mode="processed"))
    assert all(torch.equal(x.logprobs, torch.zeros(6)) for x in proc)
    stop_at = greedy[0].output_ids[2]
    s = engine.generate([p[0]], SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(stop_at,)))[0]
    assert s.output_ids == greedy[0].output_ids[: greedy[0].output_ids.index(stop_at) + 1]
    assert s.finish_reason == "stop"


def test_fp8_kv_cache(ckpts):
    from miles_lp.rollout.kv_cache import fp8_kv_roundtrip

    x = torch.tensor([0.0, 1.0, 1.0625, 500.0, -1e-3])
    assert fp8_kv_roundtrip(x, 1.0).tolist() == [0.0, 1.0, 1.0, 448.0, -0.001953125]  # E4M3's smallest subnormal
    e8 = ReferenceEngine(ckpts[0], device="cpu", kv_cache="fp8_e4m3")
    e16 = ReferenceEngine(ckpts[0], device="cpu")
    p = [[1, 2, 3, 4, 5, 6, 7, 8]]
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    g8, g16 = e8.generate(p, sp)[0], e16.generate(p, sp)[0]
    assert e8.health()["kv_cache_mismatch_source"] is True
    assert 0 < float((g8.logprobs - g16.logprobs).abs().max()) < 0.1  # rounded K/V: a small, nonzero shift


def test_skip_rebuild_fault_is_caught_by_self_check(ckpts, new_weights):
    """Stale derived state (no process_weights_after_loading at finish): self_check's relative error ~1."""
    healthy = ReferenceEngine(ckpts[0], device="cpu")
    _full_update(healthy, new_weights)
    ok = healthy.self_check()
    assert ok["ok"] and all(v["rel_err"] < 0.15 for v in ok["layers"].values())
    stale = ReferenceEngine(ckpts[0], device="cpu", faults=EngineFaults(skip_rebuild=("*",)))
    _full_update(stale, new_weights)
    bad = stale.self_check()
    assert not bad["ok"] and all(v["rel_err"] > 0.8 for v in bad["layers"].values()), bad
    assert stale.weight_digests() == healthy.weight_digests()  # canonical bytes alone cannot show it


def test_rebind_fault_moves_storage_and_keeps_old_weights(ckpts, new_weights):
    f = EngineFaults(rebind=(Q + "weight",))
    e = ReferenceEngine(ckpts[0], device="cpu", faults=f)
    ptrs, before = e.storage_pointers(), e.weight_digests([Q + "weight"])
    _full_update(e, new_weights)
    assert e.storage_pointers()[Q + "weight"] != ptrs[Q + "weight"]  # C4 sees the move
    assert e.weight_digests([Q + "weight"]) == before  # C2 sees the module serving the old bytes
    assert e.health()["faults"] == {"rebind": (Q + "weight",)}


def test_drop_updates_and_lm_head_faults(ckpts, new_weights):
    e = ReferenceEngine(ckpts[0], device="cpu", faults=EngineFaults(drop_updates=("*.experts.*",),
                                                                   quantize_lm_head=True))
    assert e.quantized_params()["lm_head.weight"] == "mxfp8"  # C1: the live set differs from the plan's
    report = _full_update(e, new_weights)
    assert report["not_written"] == 4 * 4 * 3 * 3 + 4 * 3  # 3 NVFP4 layers x 4 experts x 3 projs x 4 parts, + bf16
    fresh = ReferenceEngine(ckpts[1], device="cpu")
    mine, theirs = e.weight_digests(), fresh.weight_digests()
    differ = {k for k in mine if mine[k] != theirs[k]}
    assert differ and all(".experts." in k for k in differ)  # exactly the dropped names kept the old bytes
    assert {k for k in mine if ".experts." in k and k.endswith("proj.weight")} <= differ


def _when_in_flight(e) -> None:
    """Wait until a generation is running, and keep it running until ``pause()`` is called: its forwards after
    the first wait for the pause flag, so a fast (or descheduled) test cannot see the generation finish first."""
    forward, calls, seen_pause = e._forward, [], []

    def held(*a, **kw):
        calls.append(1)
        if len(calls) > 1 and not seen_pause:  # hold once, until the first pause; then run freely
            deadline = time.monotonic() + 30
            while not e._paused and time.monotonic() < deadline:
                time.sleep(0.001)
            seen_pause.append(1)
        return forward(*a, **kw)

    e._forward = held
    deadline = time.monotonic() + 30
    while e.health()["in_flight"] == 0 or len(calls) < 2:
        assert time.monotonic() < deadline, "the generation never started"
        time.sleep(0.005)


def test_pause_retract_resumes_with_new_weights(ckpts, new_weights):
    """An in-flight generation parks at pause(retract); after an update it recomputes its KV with the new weights."""
    e = ReferenceEngine(ckpts[0], device="cpu")
    out = {}

    def run():
        out["g"] = e.generate([[1, 2, 3]], SamplingParams(max_new_tokens=250, seed=0, temperature=1.0))[0]

    th = threading.Thread(target=run)
    th.start()
    _when_in_flight(e)
    e.pause("retract")
    assert e.health()["status"] == "paused"
    # pause() returns once no step runs; the generation parks when it reaches its next step boundary. Wait for
    # that, or a descheduled generation thread could reach the boundary only after the update and the resume
    deadline = time.monotonic() + 30
    while e.parked == 0:
        assert time.monotonic() < deadline, "the in-flight generation never parked"
        time.sleep(0.001)
    _full_update(e, new_weights)
    e.resume()
    th.join(60)
    g = out["g"]
    assert g.weight_version == 1 and len(g.output_ids) == 250 and g.finish_reason == "length"
    assert e.parked == 1  # it was in flight and parked once


def test_pause_abort_and_paused_refusal(ckpts):
    e = ReferenceEngine(ckpts[0], device="cpu")
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("g", e.generate([[1, 2]], SamplingParams(
        max_new_tokens=250, seed=0))[0]))
    th.start()
    _when_in_flight(e)
    e.pause("abort")
    th.join(60)
    assert out["g"].finish_reason == "abort" and len(out["g"].output_ids) < 250
    with pytest.raises(EngineError, match="paused"):
        e.generate([[1]], SamplingParams(max_new_tokens=1))
    e.resume()
    assert e.generate([[1]], SamplingParams(max_new_tokens=1))[0].finish_reason == "length"


def test_checkpoint_errors(tmp_path, ckpts):
    import shutil

    bad = tmp_path / "ck"
    shutil.copytree(ckpts[0], bad)
    (bad / "miles_lp_plan.json").unlink()
    with pytest.raises(CheckpointError, match="no miles_lp_plan.json"):
        ReferenceEngine(bad, device="cpu")
    with pytest.raises(CheckpointError, match="config.json is missing"):
        ReferenceEngine(tmp_path, device="cpu")


def test_abort_drops_an_update_that_wrote_nothing(engine, new_weights):
    sp = SamplingParams(max_new_tokens=3, seed=0)
    before, gen = engine.weight_digests(), engine.generate([[1, 2, 3]], sp)[0]
    engine.begin_weight_update()
    with pytest.raises(WeightUpdateError, match="unknown parameter"):
        engine.update_weights([("nope.weight", torch.zeros(1))])
    engine.abort_weight_update()  # nothing written: the previous weights serve on, same version
    again = engine.generate([[1, 2, 3]], sp)[0]
    assert again.output_ids == gen.output_ids and again.weight_version == gen.weight_version
    engine.abort_weight_update()  # outside an update: a no-op
    engine.begin_weight_update()
    engine.update_weights([(Q + "weight", new_weights[Q + "weight"])])
    with pytest.raises(EngineError, match="1 tensor\\(s\\) were already written"):
        engine.abort_weight_update()
    with pytest.raises(EngineError, match="partial state"):
        engine.generate([[1, 2, 3]], sp)
    assert engine.weight_digests() != before
    _full_update(engine, new_weights)  # a full update serves again
    assert engine.generate([[1, 2, 3]], sp)[0].weight_version == gen.weight_version + 1


def test_disk_update_that_fails_midway_bumps_no_version_and_refuses_generation(ckpts, tmp_path, monkeypatch):
    import shutil

    import safetensors

    engine = ReferenceEngine(ckpts[0], device="cpu")
    sp = SamplingParams(max_new_tokens=2, seed=0)
    v0 = engine.generate([[1, 2]], sp)[0].weight_version
    two = tmp_path / "two"
    shutil.copytree(ckpts[1], two)
    real, calls = safetensors.safe_open, []

    def failing_open(path, *a, **k):  # the headers read fine; the tensor read fails on the first file
        calls.append(path)
        if len(calls) > 1:  # the first call is the header pass (rollout.checkpoint.tensor_headers)
            raise OSError(5, "Input/output error", path)
        return real(path, *a, **k)

    monkeypatch.setattr(safetensors, "safe_open", failing_open)
    with pytest.raises(OSError, match="Input/output error"):
        engine.update_from_disk(two)  # nothing written yet: the previous weights serve on
    monkeypatch.setattr(safetensors, "safe_open", real)
    assert engine.weight_version == v0 and engine.generate([[1, 2]], sp)[0].weight_version == v0

    orig = engine.update_weights

    def half(named):  # the first file's tensors land, then the read breaks
        named = list(named)
        orig(named[: len(named) // 2])
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(engine, "update_weights", half)
    with pytest.raises(WeightUpdateError, match="failed after .* tensor\\(s\\) were written"):
        engine.update_from_disk(two)
    monkeypatch.setattr(engine, "update_weights", orig)
    assert engine.weight_version == v0  # no new version for a mix of old and new weights
    with pytest.raises(EngineError, match="partial state"):
        engine.generate([[1, 2]], sp)
    engine.update_from_disk(two)  # a full update
    assert engine.generate([[1, 2]], sp)[0].weight_version == v0 + 1


def test_stale_derived_state_of_a_layer_outside_the_fixed_pair_is_caught_by_rotation(ckpts, new_weights):
    """C3's fixed pair is the first dense layer and the first expert; one more layer per sync rotates through
    every quantized layer (by weight version), so a stale layer elsewhere fails C3 within len(rotation) syncs."""
    target = "model.layers.1.mlp.experts.2.down_proj"  # neither of the fixed pair
    eng = ReferenceEngine(ckpts[0], device="cpu", faults=EngineFaults(skip_rebuild=(target + ".*",)))
    rotation = eng._c3_rotation()
    assert target in {m.prefix.rstrip(".") for m in rotation} and len(rotation) > 2
    caught_at = None
    for i in range(len(rotation) + 1):
        _full_update(eng, new_weights)  # the target keeps the state derived from the weights at load
        r = eng.self_check()
        fixed = [n for n, v in r["layers"].items() if v["kind"] != "rotating"]
        assert not any(n.startswith(target) for n in fixed)
        if not r["ok"]:
            caught_at = i
            bad = [n for n, v in r["layers"].items() if v["fresh_diff"] != 0]
            assert bad == [f"{target}.weight"], r
            break
    assert caught_at is not None, "the stale layer was never probed"


def test_a_partial_state_ends_only_with_a_complete_update(engine, new_weights):
    sp = SamplingParams(max_new_tokens=2, seed=0)
    engine.begin_weight_update()
    engine.update_weights([(Q + "weight", new_weights[Q + "weight"])])
    with pytest.raises(EngineError, match="already written"):
        engine.abort_weight_update()
    engine.begin_weight_update()  # a small update does not re-open generation on a mix of old and new weights
    engine.update_weights([(Q + "weight", new_weights[Q + "weight"])])
    assert engine.finish_weight_update()["not_written"] > 0
    with pytest.raises(EngineError, match="partial state"):
        engine.generate([[1, 2]], sp)
    _full_update(engine, new_weights)
    assert engine.generate([[1, 2]], sp)[0].output_ids


def test_a_full_compare_sync_checks_every_layers_derived_state(ckpts, new_weights):
    """The initial (full-compare) sync probes every quantized layer against a fresh derivation: one stale layer
    anywhere fails C3 at once, not only when the rotation reaches it."""
    from miles_lp.sync import SyncConfig, WeightSync
    from miles_lp.sync.checks import self_check

    target = "model.layers.1.mlp.experts.3.up_proj"
    eng = ReferenceEngine(ckpts[0], device="cpu", faults=EngineFaults(skip_rebuild=(target + ".*",)))
    _full_update(eng, new_weights)
    every = eng.self_check_every_layer()
    assert len(every) == len(eng._c3_rotation())
    assert [n for n, v in every.items() if v["fresh_diff"] != 0] == [f"{target}.weight"]
    ws = WeightSync(eng, None, "sglang", SyncConfig(), env={}, log=lambda s: None)
    full = ws._self_check(full_compare=True)
    assert not self_check(full, 0.25).ok and f"{target}.weight" in full["layers"]
    assert len(ws._self_check(full_compare=False)["layers"]) <= 3  # a normal sync: the pair + one rotating layer
