"""The weight sync on the embedded stack: EmbeddedTrainer -> WeightSync -> ReferenceEngine on a converted tiny
MoE (MXFP8 attention, NVFP4 experts). Byte identity of a full sync, bad updates rejected whole, an engine dying
mid-sync, and `miles-lp selftest sync` (a subset by default; every fault under -m slow)."""

import json

import pytest
import torch

from miles_lp.cli import main
from miles_lp.export import naming
from miles_lp.formats.spec import Format
from miles_lp.sync import SyncAbortedError, SyncCheckError, SyncConfig, WeightSync
from miles_lp.sync.faults import DyingEngine
from miles_lp.sync.selftest import Stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core CPU: one thread is ~10x faster than two oversubscribed
    yield Stack("qwen3_moe", None, tmp_path_factory.mktemp("sync-stack"), log=lambda s: None)
    torch.set_num_threads(threads)


def _engine(stack):
    from miles_lp.rollout.reference import ReferenceEngine

    return ReferenceEngine(stack.checkpoint(), device="cpu")


def _sync(stack, engine, **kw):
    cfg = SyncConfig(bucket_mb=0.1).with_modes(all="raise")
    return WeightSync(engine, stack.plan, "sglang", cfg, env={}, log=lambda s: None, **kw)


def test_full_sync_is_byte_identical_on_a_tiny_moe(stack):
    engine = _engine(stack)
    report = _sync(stack, engine).initial_sync(stack.learner)
    assert report.ok and report.buckets > 1 and report.weight_version == 1 == engine.weight_version
    # independently of the sync: encode the learner's export with the naming module, compare every engine tensor
    expected = {}
    for name, obj in stack.learner.export_weights():
        if hasattr(obj, "components"):
            expected.update(naming.encode("sglang", Format(obj.format), name, obj))
        else:
            expected[name] = obj
    engine_names = set(engine.weight_digests())
    assert set(expected) == engine_names
    got = engine.read_weights(sorted(engine_names))
    differing = [n for n in engine_names
                 if got[n].dtype != expected[n].dtype or not torch.equal(got[n].reshape(-1).view(torch.uint8),
                                                                         expected[n].reshape(-1).view(torch.uint8))]
    assert differing == []
    assert any(got[n].dtype == torch.float8_e4m3fn for n in got)  # MXFP8 attention travelled as e4m3
    assert any(n.endswith("weight_scale_2") for n in got)  # NVFP4 experts with their global scales
    # the learner moved: the synced engine is not the checkpoint any more
    assert engine.weight_digests() != _engine(stack).weight_digests()


class _BadLearner:
    """The learner's export with one tensor in the wrong dtype."""

    def __init__(self, inner, name):
        self.inner, self.name, self.plan = inner, name, inner.plan

    def executed_quantized(self):
        return self.inner.executed_quantized()

    def export_weights(self):
        for n, t in self.inner.export_weights():
            yield n, (t.float() if n == self.name else t)


def test_bad_update_is_rejected_whole_and_the_old_weights_keep_serving(stack):
    from miles_lp.rollout.engine import SamplingParams

    engine = _engine(stack)
    before = engine.weight_digests()
    ws = _sync(stack, engine)
    with pytest.raises(SyncCheckError, match=r"refused before any byte.*model.norm.weight \(sent float32\[\d+\], "
                                             r"engine holds bfloat16"):
        ws.sync(_BadLearner(stack.learner, "model.norm.weight"))
    assert engine.weight_digests() == before and engine.weight_version == 0
    gens = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=0))  # still serving
    assert gens[0].weight_version == 0 and len(gens[0].output_ids) == 2


def test_engine_dying_mid_sync_is_reported(stack):
    ws = _sync(stack, DyingEngine(_engine(stack), at=1))
    with pytest.raises(SyncAbortedError, match=r"aborted in 'apply' at bucket 2 of \d+: EngineError: engine process "
                                               r"exited.*full resync") as e:
        ws.sync(stack.learner)
    assert e.value.report.stage == "apply"


def test_selftest_subset_catches_each_fault(tmp_path):
    out = tmp_path / "table.json"
    rc = main(["selftest", "sync", "--only", "stale expert", "--only", "dropped last", "--only", "separate global",
               "--only", "lm_head", "--json", str(out), "--workdir", str(tmp_path / "w")])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 0, rows
    assert rows[0]["fault"] == "healthy sync" and rows[0]["verdict"] == "clean"
    by = {r["fault"]: r for r in rows[1:]}
    assert len(by) == 4 and all(r["verdict"] == "CAUGHT" for r in by.values())
    assert by["stale expert layout only"]["caught_by"] == ["self_check"]
    assert by["stale expert layout only"]["figure"] > 0.25
    assert "completeness" in by["dropped last bucket"]["caught_by"]
    assert by["NVFP4 gate/up with separate global scales"]["caught_by"] == ["grid"]


def test_selftest_fails_when_the_catching_check_is_off(tmp_path, capsys):
    out = tmp_path / "table.json"
    rc = main(["selftest", "sync", "--only", "stale expert", "--off", "self_check", "--json", str(out),
               "--workdir", str(tmp_path / "w")])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 1 and rows[1]["verdict"] == "MISSED" and rows[1]["caught_by"] == []
    assert "selftest sync: FAIL" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["selftest", "sync", "--off"])
    assert main(["selftest", "sync", "--off", "nope"]) == 2


@pytest.mark.slow
def test_selftest_every_fault_caught_in_raise_mode(tmp_path, capsys):
    out = tmp_path / "table.json"
    assert main(["selftest", "sync", "--json", str(out), "--workdir", str(tmp_path / "w")]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["verdict"] == "clean" and len(rows) >= 12
    # the default recipe (MXFP8 + NVFP4 experts) has no fp8_block tensor: its one fault is answered N/A here and
    # caught on an fp8_block recipe in tests/e2e/test_run_fp8_block.py
    fp8_only = "different grid: FP8 block scales rounded to powers of two"
    assert {r["fault"]: r["verdict"] for r in rows}.get(fp8_only) == "N/A"
    assert all(r["verdict"] == "CAUGHT" for r in rows[1:] if r["fault"] != fp8_only), \
        [r for r in rows if r["verdict"] != "CAUGHT"]
    assert "selftest sync: PASS" in capsys.readouterr().out


@pytest.mark.gpu
def test_bench_sync_runs_on_cuda(capsys):
    assert main(["bench", "sync", "--device", "cuda", "--params", "2e7", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert "mxfp8+nvfp4-experts" in out and "targets: sync <= 3x the copy" in out


@pytest.mark.slow
def test_bench_sync_runs_on_cpu(capsys):
    assert main(["bench", "sync", "--device", "cpu", "--params", "2e6", "--iters", "1", "--format", "mxfp8"]) == 0
    out = capsys.readouterr().out
    assert "tensor-copy" in out and "checks %" in out


def test_a_fault_the_model_cannot_have_is_not_applicable_not_missed(tmp_path):
    out = tmp_path / "t.json"
    rc = main(["selftest", "sync", "--arch", "qwen3", "--only", "separate global", "--only", "stale expert",
               "--json", str(out), "--workdir", str(tmp_path / "w")])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 0 and [r["verdict"] for r in rows] == ["clean", "N/A", "N/A"]
    assert all("has no" in r["detail"] for r in rows[1:])


def test_selftest_engine_vllm_refusal_says_what_is_and_is_not_mapped(capsys):
    from miles_lp.cli import main

    assert main(["selftest", "sync", "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "not mapped onto the vLLM backend" in err and "tests/e2e/test_run_vllm.py" in err


def test_storage_through_the_shared_engine_call_sees_a_data_swap_and_a_reregistered_buffer(stack):
    """C4 from ``check_state`` (one read for C2 and C4): healthy syncs clean; after the engine's storage moves
    under a module whose Parameter object is kept (``.data`` swapped) or under a derived buffer re-registered
    from outside, the next sync's ``storage`` fails naming that tensor (C2 still equal: the bytes are right)."""
    engine = _engine(stack)
    ws = _sync(stack, engine)
    assert ws._shared and ws.initial_sync(stack.learner).ok and ws.sync(stack.learner).ok
    lin = next(m for m in engine._linears if m.kernel_format is not None and m.kernel_format.quantized)
    lin.weight.data = lin.weight.data.clone()  # the same object, new storage: not what a captured graph reads
    with pytest.raises(SyncCheckError) as err:
        ws.sync(stack.learner)
    v = err.value.report.verdict("storage")
    assert v.failed and any(e.startswith(f"{lin.prefix}weight") for e in v.examples)
    engine2 = _engine(stack)
    ws2 = _sync(stack, engine2)
    assert ws2.initial_sync(stack.learner).ok
    lin2 = next(m for m in engine2._linears if m.kernel_format is not None and m.kernel_format.quantized)
    lin2.register_buffer("operand", lin2.operand.clone(), persistent=False)
    with pytest.raises(SyncCheckError) as err:
        ws2.sync(stack.learner)
    v = err.value.report.verdict("storage")
    assert v.failed and f"{lin2.prefix}operand" in v.examples


def test_only_that_matches_no_fault_is_refused_not_a_pass(capsys):
    """A typo in --only used to test nothing and print PASS with exit code 0."""
    assert main(["selftest", "sync", "--arch", "qwen3", "--only", "typo"]) == 2
    err = capsys.readouterr().err
    assert "--only 'typo' matches no fault" in err and "re-bound parameter" in err


def test_a_reused_workdir_runs_again(tmp_path, capsys):
    """The second run in the same --workdir used to fail on its own ckpt0 ('pass --overwrite')."""
    argv = ["selftest", "sync", "--arch", "qwen3", "--only", "lm_head", "--workdir", str(tmp_path / "w")]
    assert main(argv) == 0
    assert main(argv) == 0
    assert capsys.readouterr().out.count("selftest sync: PASS") == 2
    # a workdir whose hf/ someone else made is never written into
    other = tmp_path / "mine"
    (other / "hf").mkdir(parents=True)
    (other / "hf" / "config.json").write_text("{}")
    assert main(["selftest", "sync", "--arch", "qwen3", "--only", "lm_head", "--workdir", str(other)]) == 2
    assert "was not made by selftest sync" in capsys.readouterr().err
    assert (other / "hf" / "config.json").read_text() == "{}"
