"""WeightSync against a small in-memory engine: the healthy sync is clean, every check can fail, bad updates
are rejected whole, an engine dying mid-sync is reported. (The embedded stack: tests/e2e/test_selftest_sync.py.)"""

import types

import pytest
import torch

from miles_lp.formats import MXFP8Tensor, quantize_mxfp8, quantize_nvfp4_pair
from miles_lp.formats.spec import Format
from miles_lp.rollout.engine import EngineError, WeightUpdateError, tensor_digest
from miles_lp.sync import SyncAbortedError, SyncCheckError, SyncConfig, WeightSync
from miles_lp.sync.faults import DropLastBucket, DyingEngine, RegridEngine, SkipScaleBytes, SplitScalesLearner
from miles_lp.sync.items import engine_items
from miles_lp.sync.transport import InProcessTransport

DOWN, GATE, UP = (f"model.layers.0.mlp.{p}.weight" for p in ("down_proj", "gate_proj", "up_proj"))


def _plan():
    E = types.SimpleNamespace
    entries = {DOWN: E(format=Format.MXFP8), GATE: E(format=Format.NVFP4), UP: E(format=Format.NVFP4),
               "model.norm.weight": E(format=Format.BF16)}
    return E(entries=entries, groups={"g0": (GATE, UP)},
             quantized=lambda: {n: e for n, e in entries.items() if e.format is not Format.BF16})


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    return {DOWN: torch.randn(64, 64, generator=g), GATE: torch.randn(32, 64, generator=g),
            UP: 2 * torch.randn(32, 64, generator=g), "model.norm.weight": torch.randn(64, generator=g)}


class Learner:
    def __init__(self, seed=1, device="cpu"):
        self.plan = _plan()
        self.w = {n: t.to(device) for n, t in _weights(seed).items()}

    def export_weights(self):
        q_gate, q_up = quantize_nvfp4_pair(self.w[GATE], self.w[UP])
        yield DOWN, quantize_mxfp8(self.w[DOWN])
        yield GATE, q_gate
        yield UP, q_up
        yield "model.norm.weight", self.w["model.norm.weight"].to(torch.bfloat16)

    def executed_quantized(self):
        return {n: e.format.value for n, e in self.plan.quantized().items()}


class StubEngine:
    """Canonical tensors + one derived operand (the dequantized MXFP8 down_proj) rebuilt at finish."""

    def __init__(self, *, stale=False, rebind=False, no_version_bump=False, extra_quantized=(), device="cpu"):
        self.t = {it.name: it.tensor.clone() for it in engine_items(Learner(0, device).export_weights(), "sglang")}
        self.q = {DOWN: "mxfp8", GATE: "nvfp4", UP: "nvfp4", **{n: "mxfp8" for n in extra_quantized}}
        self.stale, self.rebind, self.no_bump = stale, rebind, no_version_bump
        self.weight_version = 0
        self.updating = False
        self.writes = 0
        self._rebuild()
        self.served = self.t[DOWN]

    def _rebuild(self):  # in place: the storage a captured graph would read
        op = MXFP8Tensor(self.t[DOWN], self.t[DOWN[:-6] + "weight_scale_inv"]).dequantize(torch.float32)
        if hasattr(self, "operand"):
            self.operand.copy_(op)
        else:
            self.operand = op

    def pause(self): self.paused = True
    def resume(self): self.paused = False
    def flush_cache(self): pass

    def begin_weight_update(self):
        self.updating = True
        if self.rebind:
            self.served = self.t[DOWN].clone()  # the kernel now reads a copy; updates go to the old tensor

    def update_weights(self, named):
        named = list(named)
        for n, x in named:
            if n not in self.t or self.t[n].dtype != x.dtype or self.t[n].shape != x.shape:
                raise WeightUpdateError(f"bad {n}")
        for n, x in named:
            self.t[n].copy_(x)
            self.writes += 1

    def finish_weight_update(self):
        if not self.stale:
            self._rebuild()
        self.updating = False
        self.weight_version += 0 if self.no_bump else 1

    def quantized_params(self): return dict(self.q)
    def weight_digests(self, names=None): return {n: tensor_digest(self.t[n]) for n in (names or self.t)}
    def read_weights(self, names): return {n: self.t[n].clone() for n in names}

    def storage_pointers(self):
        return {**{n: t.data_ptr() for n, t in self.t.items() if n != DOWN}, DOWN: self.served.data_ptr(),
                "down.operand": self.operand.data_ptr()}

    def self_check(self, seed=0):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(seed)).to(self.operand.device)
        ref = x.double() @ MXFP8Tensor(self.t[DOWN], self.t[DOWN[:-6] + "weight_scale_inv"]).dequantize(
            torch.float64).T
        y = (x @ self.operand.T).double()
        return {"layers": {DOWN: float((y - ref).norm() / ref.norm())}}

    def generate(self, *a, **kw): raise NotImplementedError


def _sync(engine=None, mode="raise", **kw):
    engine = engine or StubEngine()
    lines = []
    cfg = SyncConfig(bucket_mb=kw.pop("bucket_mb", 0.004),
                     c2_learner_side=kw.pop("c2_learner_side", "export")).with_modes(all=mode)
    return engine, WeightSync(engine, _plan(), "sglang", cfg, env={}, log=lines.append, **kw), lines


def test_healthy_sync_is_clean_and_byte_identical():
    engine, ws, lines = _sync()
    learner = Learner()
    r = ws.initial_sync(learner)
    assert r.ok and r.full_compare and r.buckets > 1 and r.weight_version == 1
    for it in engine_items(learner.export_weights(), "sglang"):  # byte identity, every tensor
        assert torch.equal(engine.t[it.name].reshape(-1).view(torch.uint8), it.tensor.reshape(-1).view(torch.uint8))
    r2 = ws.sync(learner)
    assert r2.ok and not r2.full_compare and r2.weight_version == 2 and engine.weight_version == 2
    m = r2.metrics
    for k in ("perf/sync_seconds", "perf/sync_check_seconds", "sync/bytes", "sync/buckets", "sync/weight_version"):
        assert k in m
    assert m["sync/check/layer_audit"] == 1.0 and m["sync/check/sentinel"] == -1.0  # no RL step fed it yet
    assert m["sync/bytes"] == sum(it.nbytes for it in engine_items(learner.export_weights(), "sglang"))
    assert len(lines) == 2 and lines[1].startswith("sync v2 [done]") and "grid=ok(0)" in lines[1]
    assert r2.verdict("self_check").figure < 1e-6


def test_c1_engine_quantizes_a_layer_the_learner_does_not():
    engine, ws, _ = _sync(StubEngine(extra_quantized=("lm_head.weight",)))
    with pytest.raises(SyncCheckError, match=r"refused before any byte.*layer_audit.*lm_head.weight \(engine mxfp8"):
        ws.sync(Learner())
    assert engine.writes == 0 and engine.weight_version == 0


def test_c2_a_different_grid_in_the_engine():
    engine, ws, _ = _sync(RegridEngine(StubEngine(), "floor"))
    with pytest.raises(SyncCheckError, match=r"grid: failed \[2\].*full compare") as e:
        ws.initial_sync(Learner())
    assert e.value.verdicts[0].name == "grid"
    _, ws2, _ = _sync(RegridEngine(StubEngine(), "block128"))
    with pytest.raises(SyncCheckError, match="grid: failed"):
        ws2.sync(Learner(), full_compare=False)  # the digest path catches it too


def test_c2_separate_nvfp4_global_scales():
    _, ws, _ = _sync()
    with pytest.raises(SyncCheckError, match="NVFP4 gate/up groups hold separate global scales"):
        ws.sync(SplitScalesLearner(Learner()))


def test_c3_stale_derived_state():
    _, ws, _ = _sync(StubEngine(stale=True))
    with pytest.raises(SyncCheckError, match="self_check: failed") as e:
        ws.sync(Learner())
    assert e.value.verdicts[0].figure > 0.25


def test_c4_rebound_parameter():
    _, ws, _ = _sync(StubEngine(rebind=True))
    with pytest.raises(SyncCheckError, match=r"storage: failed \[1\].*re-bound.*down_proj.weight"):
        ws.sync(Learner())


def test_c5_dropped_last_bucket_and_unwritten_scales():
    engine = StubEngine()
    _, ws, _ = _sync(engine, transport=DropLastBucket(InProcessTransport()))
    with pytest.raises(SyncCheckError, match=r"completeness: failed.*buckets never arrived") as e:
        ws.sync(Learner())
    assert any("never written" in x for x in e.value.verdicts[0].examples)
    _, ws, _ = _sync(transport=SkipScaleBytes(InProcessTransport()))
    with pytest.raises(SyncCheckError, match="staged scale bytes not written: NaN code"):
        ws.sync(Learner())


def test_version_not_bumped_is_reported():
    _, ws, _ = _sync(StubEngine(no_version_bump=True))
    with pytest.raises(SyncCheckError, match="expected weight version 1: engine reports 0"):
        ws.sync(Learner())


def test_bad_update_is_rejected_whole_in_every_mode_but_off():
    engine = StubEngine()
    engine.t["model.norm.weight"] = engine.t["model.norm.weight"].float()  # the engine holds fp32: dtype mismatch
    before = {n: t.clone() for n, t in engine.t.items()}
    _, ws, _ = _sync(engine, mode="warn")
    with pytest.raises(SyncCheckError, match=r"sent bfloat16\[64\], engine holds float32\[64\]"):
        ws.sync(Learner())
    assert engine.writes == 0 and all(torch.equal(before[n], t) for n, t in engine.t.items())
    # off: no pre-check, the engine refuses the bucket itself: an abort, reported with its bucket
    _, ws, _ = _sync(engine, mode="off")
    with pytest.raises(SyncAbortedError, match="aborted in 'apply' at bucket") as e:
        ws.sync(Learner())
    assert isinstance(e.value.__cause__, WeightUpdateError)


def test_a_refused_update_is_aborted_and_the_engine_resumed():
    """A bucket the engine refuses before writing (its own whole-bucket check): the sync aborts the open update
    where the engine can and resumes it, so the previous weights serve on (a server is not left paused)."""

    class AbortingEngine(StubEngine):
        aborted = 0
        refuse_after = 0  # buckets accepted before the refusal

        def update_weights(self, named):
            if self.refuse_after == 0:
                raise WeightUpdateError("refused whole")
            self.refuse_after -= 1
            super().update_weights(named)

        def abort_weight_update(self):  # as the engines: only an update that wrote nothing can be dropped
            if self.writes:
                raise EngineError(f"{self.writes} tensors were already written")
            self.aborted += 1

    engine = AbortingEngine()
    _, ws, _ = _sync(engine, mode="off")
    with pytest.raises(SyncAbortedError, match="dropped before any byte was written and the engine serves its "
                                               "previous weights again"):
        ws.sync(Learner())
    assert engine.aborted == 1 and engine.paused is False and engine.writes == 0
    late = AbortingEngine()  # refused after a written bucket: cannot be dropped; paused, restart advised
    late.refuse_after = 1
    _, ws, _ = _sync(late, mode="off")  # several buckets at 4 KB
    with pytest.raises(SyncAbortedError, match="restart it"):
        ws.sync(Learner())
    assert late.writes > 0 and late.aborted == 0 and late.paused is True


def test_a_finish_refused_whole_resumes_the_engine():
    """A stock-SGLang disk update refused by the server (400 before any load: WeightUpdateError in finish): the
    server is resumed, not left paused for its other clients; any other finish failure leaves it paused."""

    class RefusingFinish(StubEngine):
        def __init__(self, exc):
            super().__init__()
            self.exc = exc

        def finish_weight_update(self):
            raise self.exc

        def health(self):
            return {"status": "paused" if self.paused else "ok"}

    for exc, resumed in ((WeightUpdateError("update_weights_from_disk: 400 not a checkpoint folder"), True),
                         (EngineError("engine process died"), False)):
        engine = RefusingFinish(exc)
        _, ws, _ = _sync(engine, mode="off")
        with pytest.raises(SyncAbortedError, match="aborted in 'finish'") as e:
            ws.sync(Learner())
        assert engine.paused is (not resumed), exc
        assert ("serves its previous weights again" in str(e.value)) is resumed

    partial = RefusingFinish(WeightUpdateError("failed after 10 tensor(s) were written"))
    partial.health = lambda: {"status": "updating"}  # the engine refuses generation: no "previous weights" advice
    _, ws, _ = _sync(partial, mode="off")
    with pytest.raises(SyncAbortedError, match="restart it"):
        ws.sync(Learner())


def test_warn_mode_reports_but_does_not_raise():
    engine, ws, lines = _sync(StubEngine(stale=True), mode="warn")
    r = ws.sync(Learner())
    assert not r.ok and [v.name for v in r.failed] == ["self_check"] and r.metrics["sync/check/self_check"] == 0.0
    assert "FAILED: C3 self_check" in lines[-1] and engine.paused is False


def test_env_override_turns_warn_into_raise():
    engine = StubEngine(stale=True)
    ws = WeightSync(engine, _plan(), "sglang", SyncConfig(), env={"MILES_LP_SYNC_CHECK_SELF_CHECK": "raise"},
                    log=lambda s: None)
    with pytest.raises(SyncCheckError):
        ws.sync(Learner())
    assert engine.paused is True  # a raise-mode failure leaves the engine paused


def test_a_check_the_environment_turned_off_names_the_variable():
    """The skip reason names the variable and what the recipe said, not a recipe key saying off."""
    cfg = SyncConfig(bucket_mb=0.004).with_modes(all="raise")
    for env, var in (({"MILES_LP_SYNC_CHECK_GRID": "off"}, "MILES_LP_SYNC_CHECK_GRID=off"),
                     ({"MILES_LP_SYNC_CHECKS": "off"}, "MILES_LP_SYNC_CHECKS=off")):
        ws = WeightSync(StubEngine(), _plan(), "sglang", cfg, env=env, log=lambda s: None)
        v = ws.sync(Learner()).verdict("grid")
        assert v.status == "skipped" and f"check turned off by the environment ({var}; the recipe says sync.checks.grid: " \
            "raise)" in v.reason, v.reason
    ws = WeightSync(StubEngine(), _plan(), "sglang", cfg.with_modes(grid="off"), env={}, log=lambda s: None)
    assert ws.sync(Learner()).verdict("grid").reason == "check turned off (sync.checks.grid: off)"


def test_engine_dying_mid_sync_is_reported_with_stage_and_bucket():
    engine, ws, lines = _sync(DyingEngine(StubEngine(), at=1))
    with pytest.raises(SyncAbortedError, match=r"aborted in 'apply' at bucket 2 of \d+.*restart it") as e:
        ws.sync(Learner())
    assert e.value.stage == "apply" and e.value.bucket == 1 and isinstance(e.value.__cause__, EngineError)
    assert e.value.report.stage == "apply" and all(v.status == "skipped" for v in e.value.report.verdicts
                                                   if v.name in ("grid", "self_check"))
    assert "[apply]" in lines[-1]


class FingerprintEngine(StubEngine):
    """An engine that offers the device-side C2 digest (``weight_fingerprints``)."""

    def weight_fingerprints(self, names=None):
        from miles_lp.multitensor.digest import fingerprint

        self.fingerprinted = True
        return {n: fingerprint(self.t[n]) for n in (names or self.t)}


def test_c2_uses_engine_fingerprints_when_offered():
    engine, ws, _ = _sync(FingerprintEngine())
    assert ws.sync(Learner(), full_compare=False).ok and engine.fingerprinted
    _, ws, _ = _sync(RegridEngine(FingerprintEngine(), "floor"))
    with pytest.raises(SyncCheckError, match="grid: failed.*digest"):
        ws.sync(Learner(), full_compare=False)


@pytest.mark.gpu
def test_sync_on_cuda_tensors_with_fingerprints_and_a_caught_fault():
    engine = FingerprintEngine(device="cuda")
    ws = WeightSync(engine, _plan(), "sglang", SyncConfig(bucket_mb=0.004).with_modes(all="raise"),
                    transport=InProcessTransport("cuda"), env={}, log=lambda s: None)
    assert ws.initial_sync(Learner(device="cuda")).ok
    assert ws.sync(Learner(device="cuda")).ok and engine.fingerprinted
    ws = WeightSync(StubEngine(device="cuda"), _plan(), "sglang", SyncConfig(bucket_mb=0.004).with_modes(all="raise"),
                    transport=SkipScaleBytes(InProcessTransport("cuda")), env={}, log=lambda s: None)
    with pytest.raises(SyncCheckError, match="staged scale bytes not written"):
        ws.sync(Learner(device="cuda"))


@pytest.mark.slow  # ray.init: ~10 s on 2 cores
def test_sync_through_the_ray_object_store():
    ray = pytest.importorskip("ray")
    from miles_lp.sync.transport import RayTransport

    if not ray.is_initialized():
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        engine = StubEngine()
        ws = WeightSync(engine, _plan(), "sglang", SyncConfig(bucket_mb=0.004, transport="ray").with_modes(all="raise"),
                        env={}, log=lambda s: None)
        assert isinstance(ws.transport, RayTransport)
        assert ws.initial_sync(Learner()).ok and ws.syncs == 1
        ws = WeightSync(StubEngine(), _plan(), "sglang", SyncConfig(bucket_mb=0.004).with_modes(all="raise"),
                        transport=SkipScaleBytes(RayTransport()), env={}, log=lambda s: None)
        with pytest.raises(SyncCheckError, match="staged scale bytes not written"):
            ws.sync(Learner())
    finally:
        ray.shutdown()


def test_an_engine_that_cannot_answer_a_check_fails_it_and_one_dead_before_the_sync_aborts():
    class NoSelfCheck(StubEngine):
        def self_check(self, seed=0):
            raise EngineError("self_check: connection refused")

    _, ws, _ = _sync(NoSelfCheck(), mode="warn")
    v = ws.sync(Learner()).verdict("self_check")
    assert v.failed and "could not run: the engine failed" in v.reason

    class Dead(StubEngine):
        def quantized_params(self):
            raise EngineError("connection refused")

    engine = Dead()
    ws = WeightSync(engine, _plan(), "sglang", SyncConfig(), env={}, log=lambda s: None)
    with pytest.raises(SyncAbortedError, match="before any byte was written.*quantized_params") as e:
        ws.sync(Learner())
    assert e.value.stage == "pre-checks" and engine.writes == 0


def test_a_backend_that_cannot_answer_digests_or_self_checks_gets_skip_verdicts_with_reasons():
    from miles_lp.errors import BackendUnavailable

    class NoCanonical(StubEngine):  # vLLM-like: canonical tensors do not exist after load
        def param_specs(self):
            return {n: (t.dtype, tuple(t.shape)) for n, t in self.t.items()}

        def weight_digests(self, names=None):
            raise BackendUnavailable("vLLM dequantizes at load: no canonical tensors")

        def self_check(self, seed=0):
            raise BackendUnavailable("no serving kernel access")

    _, ws, lines = _sync(NoCanonical(), mode="raise")
    r = ws.sync(Learner(), full_compare=False)
    assert r.ok and r.verdict("grid").status == "skipped" and "no canonical tensors" in r.verdict("grid").reason
    assert r.verdict("self_check").status == "skipped" and "no serving kernel" in r.verdict("self_check").reason
    assert r.verdict("completeness").ok and r.verdict("storage").ok
    # raise mode guards nothing there: said once per check in the sync's line, not again
    assert "SKIPPED IN RAISE MODE" in lines[-1] and "no serving kernel" in lines[-1] and "no canonical" in lines[-1]
    ws.sync(Learner(), full_compare=False)
    assert "SKIPPED IN RAISE MODE" not in lines[-1]


def test_a_bf16_gate_up_sampler_arm_skips_the_joint_scale_check_instead_of_failing_it():
    class BF16GateUp(Learner):  # a comparison arm: the sampler's own plan keeps gate/up BF16
        def export_weights(self):
            for n, q in super().export_weights():
                yield n, (self.w[n].to(torch.bfloat16) if n in (GATE, UP) else q)

    class Engine(StubEngine):
        def __init__(self):
            super().__init__()
            self.t = {it.name: it.tensor.clone() for it in engine_items(BF16GateUp(0).export_weights(), "sglang")}
            self.q = {DOWN: "mxfp8"}
            self._rebuild()

    _, ws, _ = _sync(Engine(), mode="warn")
    r = ws.sync(BF16GateUp())
    assert [v.name for v in r.failed] == ["layer_audit"]  # the learner runs gate/up NVFP4: C1 says so
    assert r.verdict("grid").ok and "NVFP4 gate/up" not in r.verdict("grid").reason


class NoLiveFormats(StubEngine):
    """A backend that cannot report its live quantized parameters (a stock SGLang server)."""

    def quantized_params(self):
        from miles_lp.errors import BackendUnavailable

        raise BackendUnavailable("stock server: no live quantization state")


def test_an_engine_without_live_formats_skips_c1_with_the_reason_and_still_validates_the_update():
    engine, ws, _ = _sync(NoLiveFormats())
    r = ws.sync(Learner())
    v = r.verdict("layer_audit")
    assert r.ok and v.status == "skipped" and "cannot report its live quantized parameters" in v.reason
    assert r.verdict("grid").ok and r.verdict("completeness").ok
    # the update is still checked against the plan's formats before any byte is written
    from tests.e2e.test_selftest_sync import _BadLearner

    writes = engine.writes
    with pytest.raises(SyncCheckError, match="refused before any byte"):
        ws.sync(_BadLearner(Learner(), "model.norm.weight"))
    assert engine.writes == writes


def test_a_repeated_layout_reuses_its_host_work_and_a_changed_one_is_validated_again():
    """WeightSync._layout: the buckets' slots, C2 groups and the C5 validation verdict are reused while the export's
    layout repeats (byte identity every sync); an export that differs in a dtype is validated again and refused."""
    engine, ws, _ = _sync()
    learner = Learner()
    ws.initial_sync(learner)
    r2 = ws.sync(learner)
    lay = ws._layout_cache
    learner.w = {n: t + 0.25 for n, t in learner.w.items()}  # new bytes, same layout
    r3 = ws.sync(learner)
    assert r2.ok and r3.ok and ws._layout_cache is lay and lay.validation is not None
    for it in engine_items(learner.export_weights(), "sglang"):
        assert torch.equal(engine.t[it.name].reshape(-1).view(torch.uint8), it.tensor.reshape(-1).view(torch.uint8))

    class Float32Norm(Learner):
        def export_weights(self):
            for n, t in super().export_weights():
                yield n, (t.float() if n == "model.norm.weight" else t)

    bad = Float32Norm()
    bad.w = learner.w
    with pytest.raises(SyncCheckError, match="model.norm.weight.*float32"):
        ws.sync(bad)
    assert ws._layout_cache is not lay


class _ProbeEngine(StubEngine):
    """StubEngine that also generates (the C6 probe): log-probs -1, or NaN with ``nan_probe``."""

    nan_probe = False

    def generate(self, prompts, sampling):
        from miles_lp.rollout.engine import Generation

        lp = torch.tensor([float("nan") if self.nan_probe else -1.0, -1.0])
        return [Generation([5, 6], lp, "stop", self.weight_version) for _ in prompts]


class _ProbeLearner(Learner):
    def logprobs(self, seqs):
        return [torch.full((len(s) - 1,), -1.0) for s in seqs], None


def _probe_sync():
    cfg = SyncConfig(bucket_mb=0.004, probe_tokens=2).with_modes(all="raise")
    eng = _ProbeEngine()
    ws = WeightSync(eng, _plan(), "sglang", cfg, env={}, log=lambda s: None)
    ws.initial_sync(_ProbeLearner())
    return eng, ws


def test_sentinel_probe_does_not_hide_the_rl_steps_own_failure():
    """With ``probe_tokens > 0`` the RL step's verdict (here NaN rollout log-probs) still fails the sync
    in raise mode; the probe is judged on its own and is not a step of the run's streaks."""
    eng, ws = _probe_sync()
    ws.sentinel.update(rollout_logprobs=[torch.tensor([float("nan"), -1.0])], kl=0.0, finish_reasons=["stop"])
    steps = ws.sentinel.steps
    with pytest.raises(SyncCheckError, match=r"sentinel: failed.*not finite.*the RL step's rollouts; the probe: ok"):
        ws.sync(_ProbeLearner())
    assert ws.sentinel.steps == steps  # the probe did not count as a step
    # a healthy step next: ok, both named; no step since the last sync: the probe alone
    ws.expected_version = eng.weight_version
    ws.sentinel.update(rollout_logprobs=[torch.tensor([-1.0])], kl=0.0, finish_reasons=["stop"])
    eng.resume()
    v = ws.sync(_ProbeLearner()).verdict("sentinel")
    assert v.ok and "probe generation" in v.reason and "the RL step" in v.reason
    v = ws.sync(_ProbeLearner()).verdict("sentinel")
    assert v.ok and "the RL step" not in v.reason
    # the probe's own failure still fails
    eng.nan_probe = True
    with pytest.raises(SyncCheckError, match=r"sentinel: failed.*probe generation: 1 of 2 rollout log-probs"):
        ws.sync(_ProbeLearner())
