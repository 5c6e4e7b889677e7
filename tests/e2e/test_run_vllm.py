"""``rollout.backend: vllm`` in ``miles-lp run`` (vLLM 0.32 CPU in its own venv and process), and the sync checks
C1-C4 answered by the live vLLM model, each shown able to fail there by fault injection.

Default suite: one 2-step RL smoke of ``recipes/tiny-mxfp8-vllm.yaml`` (every check in raise mode; ~40 s idle, one
vLLM start). Slow (``pytest -m slow tests/e2e/test_run_vllm.py``): the fault-injection tests (one vLLM start for
all), the BF16 recipe, and the Ray launcher on vLLM. Skipped with the reason without a vLLM interpreter
(``MILES_LP_VLLM_PYTHON`` or ``build/venv-vllm``; ``.ci/run`` builds it).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from miles_lp.launch.recipe import load_recipe
from miles_lp.rollout.vllm import vllm_python

pytestmark = pytest.mark.skipif(vllm_python() is None, reason="no vLLM interpreter: set MILES_LP_VLLM_PYTHON or "
                                "create build/venv-vllm (.ci/run)")
REPO = Path(__file__).resolve().parents[2]
CHECKS = ("layer_audit", "grid", "self_check", "storage", "completeness", "version")


def _run(recipe_name: str, tmp: Path, *sets: str, inspect=None):
    from miles_lp.launch.runner import Run

    recipe = load_recipe(REPO / "recipes" / recipe_name, [f"logging.output_dir={tmp / 'runs'}", "checkpoint_every=0",
                                                          "logging.progress=false", *sets])
    run = Run.start(recipe)
    try:
        rows = run.train(progress=False)
        if inspect is not None:
            inspect(run)
        return run, rows
    finally:
        run.close()


def _group_sampling(run) -> None:
    """Copies of one prompt in one call (a GRPO group) get different samples (vLLM seeds each request; one seed
    for all would make every group identical and every advantage 0), and the same call is reproducible."""
    from miles_lp.rollout.engine import SamplingParams

    sp = SamplingParams(max_new_tokens=4, temperature=1.0, seed=7)
    a = [g.output_ids for g in run.engine.generate([[1, 5, 3]] * 8, sp)]
    assert len({tuple(x) for x in a}) > 1
    assert a == [g.output_ids for g in run.engine.generate([[1, 5, 3]] * 8, sp)]


def test_rl_smoke_on_vllm(tmp_path, monkeypatch):
    """2 GRPO steps, vLLM sampling and receiving every sync, every check in raise mode and answered (not skipped).
    From a relative output folder, as the shipped recipes' `runs` (the vLLM worker runs in a temp folder)."""
    monkeypatch.chdir(tmp_path)
    run, rows = _run("tiny-mxfp8-vllm.yaml", Path("."), "steps=2", "rl.prompts_per_step=4", "rl.group_size=4",
                     inspect=_group_sampling)
    assert len(rows) == 2
    init = run.initial
    assert init.verdict("grid").ok and "full compare" in init.verdict("grid").reason
    for i, m in enumerate(rows):
        for c in CHECKS:
            assert m[f"sync/check/{c}"] == 1.0, (i, c)
        assert m["rollout/weight_version"] == i + 1
        assert 0 < m["sync/check/self_check/figure"] < 0.01  # vLLM's bf16 GEMM vs float64: bf16 rounding only
        # a different activation grid (vLLM CPU: bf16, MXFP8 activations unquantized) -> small but nonzero
        assert math.isfinite(m["rollout_corr/kl"]) and 0 < m["rollout_corr/logprob_abs_diff_mean"] < 0.1
    assert (run.dir.path / "vllm-engine.log").stat().st_size > 0


@pytest.mark.slow
def test_fp8_block_run_on_vllm_every_check_raise(tmp_path):
    """FP8 blockwise on one grid: vLLM's Fp8LinearMethod reads the checkpoint, miles-lp's CPU block kernel
    (``vllm_plugin``) quantizes activations in 1x128 tiles as the learner does; every check in raise mode."""
    run, rows = _run("tiny-fp8-blockwise-e2e-vllm.yaml", tmp_path, "steps=2", "rl.prompts_per_step=4",
                     "rl.group_size=4")
    assert len(rows) == 2 and run.initial.verdict("self_check").ok
    for i, m in enumerate(rows):
        for c in CHECKS:
            assert m[f"sync/check/{c}"] == 1.0, (i, c)
        assert m["rollout/weight_version"] == i + 1
        assert 0 < m["sync/check/self_check/figure"] < 0.1  # the 1x128 activation grid's error (0.026 measured)
        assert math.isfinite(m["rollout_corr/kl"]) and m["rollout_corr/logprob_abs_diff_max"] < 0.05


# ---- fault injection: each check answered by vLLM can fail ---------------------------------------------------

@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A vLLM engine serving model A (MXFP8, vLLM target) and learners on A's and B's weights (same shapes)."""
    from miles_lp.checkpoint.convert import convert_checkpoint
    from miles_lp.checkpoint.tiny import make_tiny_model
    from miles_lp.config import Where
    from miles_lp.policy import parse_policy
    from miles_lp.rollout.vllm import VLLMEngine
    from miles_lp.train.config import TrainConfig
    from miles_lp.train.embedded import EmbeddedTrainer, plan_for_model

    tmp = tmp_path_factory.mktemp("vllm-faults")
    pol = parse_policy({"default": "mxfp8"}, Where("<test>", "precision"))
    a = make_tiny_model("qwen3", tmp / "a", seed=0, num_layers=2)
    b = make_tiny_model("qwen3", tmp / "b", seed=1, num_layers=2)
    plan = plan_for_model(pol, a)
    ck = tmp / "a-vllm"
    convert_checkpoint(a, ck, pol, target="vllm", progress=False, log=lambda s: None)
    cfg = TrainConfig(device="cpu")
    la, lb = EmbeddedTrainer(a, plan, cfg), EmbeddedTrainer(b, plan, cfg)
    eng = VLLMEngine(ck, log_path=tmp / "vllm.log")
    yield {"engine": eng, "plan": plan, "a": la, "b": lb, "tmp": tmp, "model": a}
    eng.close()


def _sync(stack, full_compare: str = "off"):
    """Every check raise (C6 off: no RL loop here); the per-sync digest path unless ``full_compare``."""
    import dataclasses

    from miles_lp.sync import SyncConfig, WeightSync

    config = dataclasses.replace(SyncConfig().with_modes(all="raise", sentinel="off"), full_compare=full_compare)
    return WeightSync(stack["engine"], stack["plan"], "vllm", config, env={})


def _healthy(stack) -> None:
    eng = stack["engine"]
    eng.set_faults()
    eng.resume()
    rep = _sync(stack, "initial").initial_sync(stack["a"])
    assert rep.ok, rep.log_line


def _fails(stack, fault: dict, check: str, learner: str = "b"):
    from miles_lp.sync import SyncCheckError

    _healthy(stack)
    ws = _sync(stack)
    stack["engine"].set_faults(**fault)
    with pytest.raises(SyncCheckError) as ei:
        ws.sync(stack[learner])
    rep = ei.value.report
    failed = {v.name for v in rep.failed}
    assert check in failed, rep.log_line
    return rep


@pytest.mark.slow
def test_grid_fails_when_vllm_loader_skips_names(stack):
    """C2: the update reaches vLLM without layer 1's down_proj (a loader that skips names): the engine's bytes
    (captured as vLLM's loaders placed them) are A's for that module while the learner exported B's."""
    rep = _fails(stack, {"drop": ["model.layers.1.mlp.down_proj.*"]}, "grid")
    v = rep.verdict("grid")
    assert "(digest)" in v.reason and "groups" in v.reason  # the group fingerprints, then the members named
    assert sorted(v.examples) == ["model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight_scale"]
    assert rep.verdict("self_check").ok  # the layers C3 looks at were rebuilt: only C2 sees this


@pytest.mark.slow
def test_self_check_fails_on_stale_vllm_derived_state(stack):
    """C3: qkv_proj's served BF16 operand left as it was (not rebuilt from the new bytes): the canonical bytes
    are B's (C2 passes), the serving kernel computes A."""
    rep = _fails(stack, {"stale": ["model.layers.0.self_attn.qkv_proj"]}, "self_check")
    assert rep.verdict("grid").ok
    v = rep.verdict("self_check")
    assert v.figure > 0.25  # ~1.4 measured: A's weights vs B's
    assert any("fresh derivation" in e for e in v.examples)


@pytest.mark.slow
def test_self_check_catches_stale_vllm_state_after_a_small_update(stack):
    """C3's exact half: after an RL-sized change (A's weights x (1 + 1e-3 noise)) a stale qkv_proj stays inside
    the 0.25 tolerance (the weights barely moved), but its served operand differs from the synced bytes
    dequantized again, so ``fresh_diff`` > 0 fails the check (docs/sync.md: the tolerance alone misses this)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from miles_lp.train.config import TrainConfig
    from miles_lp.train.embedded import EmbeddedTrainer

    src, dst = stack["model"], stack["tmp"] / "a-nudged"
    if not dst.exists():
        shutil.copytree(src, dst)
        g = torch.Generator().manual_seed(5)
        for f in dst.glob("*.safetensors"):
            t = load_file(f)
            save_file({k: (v * (1 + 1e-3 * torch.randn(v.shape, generator=g))).to(v.dtype)
                       if v.is_floating_point() else v for k, v in t.items()}, f, metadata={"format": "pt"})
    nudged = EmbeddedTrainer(dst, stack["plan"], TrainConfig(device="cpu"))
    stack["nudged"] = nudged
    rep = _fails(stack, {"stale": ["model.layers.0.self_attn.qkv_proj"]}, "self_check", learner="nudged")
    v = rep.verdict("self_check")
    assert v.figure < 0.25  # the tolerance alone would pass it
    assert any("model.layers.0.self_attn.qkv_proj.weight (serving differs from a fresh derivation" in e
               for e in v.examples)


STALE_MIDDLE = "model.layers.1.self_attn.o_proj"  # neither the first nor the last quantized linear


def _rotation(stack) -> list[str]:
    """The engine's C3 rotation, read back from its answers: the module probed at each position."""
    eng = stack["engine"]
    length = eng.self_check()["rotation"]["length"]
    out = [""] * length
    for _ in range(length):
        r = eng.self_check()["rotation"]
        out[r["position"]] = r["module"]
        eng.weight_version += 1  # the client's version picks the position: walk it without syncing
    eng.weight_version -= length
    return out


@pytest.mark.slow
def test_self_check_rotation_catches_a_stale_vllm_layer_outside_the_fixed_pair(stack):
    """C3's rotating probe on vLLM: a stale o_proj of layer 1 (served state left as A's after every update to B;
    C2 clean) passes the fixed pair (first and last linear) but fails the sync in raise mode when the rotation
    (one more layer per sync, by weight version) reaches it: within len(rotation) syncs, never before."""
    from miles_lp.sync import SyncCheckError

    rot = _rotation(stack)
    assert STALE_MIDDLE in rot and rot.index(STALE_MIDDLE) not in (0, len(rot) - 1)
    assert len(set(rot)) == len(rot) == 8  # 2 layers x (qkv, o, gate_up, down)
    _healthy(stack)
    stack["engine"].set_faults(stale=[STALE_MIDDLE])
    ws = _sync(stack)
    caught = None
    for i in range(1, len(rot) + 1):
        try:
            rep = ws.sync(stack["b"])
        except SyncCheckError as exc:
            caught, rep = i, exc.report
            break
        sc = rep.verdict("self_check")
        assert sc.ok and rep.ok, rep.log_line  # the stale layer not probed yet: every check passes
    assert caught is not None, "the rotation never reached the stale layer"
    v = rep.verdict("self_check")
    assert {x.name for x in rep.failed} == {"self_check"} and rep.verdict("grid").ok, rep.log_line
    assert [e.split(" (")[0] for e in v.examples] == [f"{STALE_MIDDLE}.weight"] * 2  # rel_err and fresh_diff
    assert stack["engine"].weight_version % len(rot) == rot.index(STALE_MIDDLE)
    r = stack["engine"].self_check()
    e = r["layers"][f"{STALE_MIDDLE}.weight"]
    assert e["kind"] == "rotating" and e["rel_err"] > 0.25 and e["fresh_diff"] > 0 and not r["ok"]
    assert all(x["rel_err"] < 0.01 and x["fresh_diff"] == 0.0 for x in r["layers"].values() if x["kind"] == "dense")
    print(f"\nvLLM C3 rotation: stale {STALE_MIDDLE} caught at sync {caught} of at most {len(rot)}: "
          f"rel_err {e['rel_err']:.4g}, fresh_diff {e['fresh_diff']:.4g}; fixed pair "
          + ", ".join(f"{n} {x['rel_err']:.4g}" for n, x in r["layers"].items() if x["kind"] == "dense"))


@pytest.mark.slow
def test_self_check_every_layer_catches_a_stale_vllm_layer_at_once(stack):
    """On a full-compare sync WeightSync adds ``self_check_every_layer()``: the same stale o_proj fails C3 in raise
    mode on the first sync, whatever the rotation's position; healthy, every layer is clean."""
    from miles_lp.sync import SyncCheckError

    _healthy(stack)  # a full-compare sync: every layer probed, and clean
    every = stack["engine"].self_check_every_layer()
    assert len(every) == 8 and all(e["kind"] == "every" and e["format"] == "mxfp8" for e in every.values())
    assert all(0 < e["rel_err"] < 0.01 and e["fresh_diff"] == 0.0 for e in every.values()), every
    healthy = max(e["rel_err"] for e in every.values())
    stack["engine"].set_faults(stale=[STALE_MIDDLE])
    with pytest.raises(SyncCheckError) as ei:
        _sync(stack, "initial").initial_sync(stack["b"])
    rep = ei.value.report
    v = rep.verdict("self_check")
    assert {x.name for x in rep.failed} == {"self_check"}, rep.log_line
    assert [e.split(" (")[0] for e in v.examples] == [f"{STALE_MIDDLE}.weight"] * 2
    every = stack["engine"].self_check_every_layer()
    bad = {n: e for n, e in every.items() if not (e["rel_err"] <= 0.25 and e["fresh_diff"] == 0.0)}
    assert list(bad) == [f"{STALE_MIDDLE}.weight"], every
    e = bad[f"{STALE_MIDDLE}.weight"]
    print(f"\nvLLM C3 every layer: healthy max rel_err {healthy:.4g}; stale {STALE_MIDDLE} rel_err "
          f"{e['rel_err']:.4g}, fresh_diff {e['fresh_diff']:.4g}")


@pytest.mark.slow
def test_storage_fails_on_rebound_vllm_parameter(stack):
    """C4: a parameter re-bound to a fresh tensor after the load (what CUDA graphs captured is no longer served)."""
    rep = _fails(stack, {"rebind": ["model.layers.1.self_attn.o_proj"]}, "storage")
    assert sorted(rep.verdict("storage").examples) == ["model.layers.1.self_attn.o_proj.weight",
                                                       "model.layers.1.self_attn.o_proj.weight_scale"]


@pytest.mark.slow
def test_layer_audit_fails_when_vllm_serves_another_layer_set(stack):
    """C1 from vLLM's live quant methods: a learner whose plan keeps layer 0's attention in BF16 against the
    vLLM engine that serves it MXFP8; refused before any byte is written."""
    from miles_lp.config import Where
    from miles_lp.policy import parse_policy
    from miles_lp.sync import SyncCheckError, SyncConfig, WeightSync
    from miles_lp.train.config import TrainConfig
    from miles_lp.train.embedded import EmbeddedTrainer, plan_for_model

    _healthy(stack)
    pol = parse_policy({"default": "mxfp8", "rules": [{"match": "model.layers.0.self_attn.*", "format": "bf16"}]},
                       Where("<test>", "precision"))
    plan = plan_for_model(pol, stack["model"])
    learner = EmbeddedTrainer(stack["model"], plan, TrainConfig(device="cpu"))
    ws = WeightSync(stack["engine"], plan, "vllm", SyncConfig().with_modes(all="raise", sentinel="off"), env={})
    v_before = stack["engine"].weight_version
    with pytest.raises(SyncCheckError, match="before any byte was written") as ei:
        ws.sync(learner)
    v = ei.value.report.verdict("layer_audit")
    assert v.failed and v.figure == 4  # q, k, v, o of layer 0: engine mxfp8, plan bf16
    assert all("engine mxfp8" in e and "plan bf16" in e for e in v.examples)
    assert stack["engine"].weight_version == v_before


@pytest.mark.slow
def test_healthy_vllm_sync_is_clean_and_byte_identical(stack):
    """Every check answered by vLLM and clean for a real update (A -> B), full byte compare of every tensor."""
    _healthy(stack)
    rep = _sync(stack, "initial").initial_sync(stack["b"])
    assert rep.ok, rep.log_line
    assert {v.name for v in rep.verdicts if v.ok} >= set(CHECKS)
    assert "full compare" in rep.verdict("grid").reason
    again = _sync(stack).sync(stack["a"])  # the per-sync path: one fingerprint per atomic group, from vLLM
    assert again.ok and "(group digest)" in again.verdict("grid").reason, again.log_line
    _healthy(stack)
    _sync(stack, "initial").initial_sync(stack["b"])
    sc = stack["engine"].self_check()
    assert all(e["fresh_diff"] == 0.0 for e in sc["layers"].values())
    got = stack["engine"].read_weights(["model.layers.0.self_attn.k_proj.weight"])
    from miles_lp.sync.items import engine_items

    exp = {it.name: it.tensor for it in engine_items(stack["b"].export_weights(), "vllm", None)}
    k = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(got[k].view(torch.uint8), exp[k].view(torch.uint8))


# ---- slow: the BF16 recipe and Ray ---------------------------------------------------------------------------

@pytest.mark.slow
def test_bf16_recipe_on_vllm(tmp_path):
    run, rows = _run("tiny-bf16-vllm.yaml", tmp_path, "steps=2", "rl.prompts_per_step=4", "rl.group_size=4")
    for m in rows:
        for c in ("grid", "storage", "completeness", "version", "layer_audit"):
            assert m[f"sync/check/{c}"] == 1.0, c
        assert m["sync/check/self_check"] == -1.0  # no quantized layer to self-check in a BF16 model


@pytest.mark.slow
def test_ray_launcher_on_vllm(tmp_path):
    from miles_lp.launch.ray_launcher import run_with_ray

    recipe = load_recipe(REPO / "recipes" / "tiny-mxfp8-vllm.yaml",
                         [f"logging.output_dir={tmp_path / 'runs'}", "checkpoint_every=0", "logging.progress=false",
                          "steps=2", "rl.prompts_per_step=4", "rl.group_size=4", "ray.enabled=true",
                          "ray.num_cpus=2"])
    rows = []
    out = run_with_ray(recipe, progress=False, on_step=lambda run, m: rows.append(m))
    assert out["steps"] == 2 and len(rows) == 2
    for m in rows:
        for c in CHECKS:
            assert m[f"sync/check/{c}"] == 1.0, c


@pytest.mark.slow
def test_vllm_process_killed_between_steps_is_restarted_and_resynced(tmp_path):
    """The vLLM engine process dies: the next step's generate fails, a fresh engine is started from the same
    checkpoint, fully resynced (full compare) and the step re-run; versions keep counting."""
    import os
    import signal

    from miles_lp.launch.runner import Run

    recipe = load_recipe(REPO / "recipes" / "tiny-mxfp8-vllm.yaml",
                         [f"logging.output_dir={tmp_path / 'runs'}", "checkpoint_every=0", "logging.progress=false",
                          "steps=3", "rl.prompts_per_step=4", "rl.group_size=4"])
    run = Run.start(recipe)
    try:
        first = run.step_once()
        old = run.engine
        os.kill(old._proc.pid, signal.SIGKILL)
        old._proc.wait(30)
        rows = [first] + run.train(progress=False)
    finally:
        run.close()
    assert run.restarts == 1 and run.engine is not old
    assert "full compare" in run.initial.verdict("grid").reason and run.initial.ok
    assert [m["rollout/weight_version"] for m in rows] == [1.0, 2.0, 3.0]
    assert rows[-1]["rollout/engine_restarts"] == 1.0
    for m in rows:
        for c in CHECKS:
            assert m[f"sync/check/{c}"] == 1.0, c


@pytest.mark.slow
def test_resume_on_vllm_continues_bit_identically(tmp_path):
    """4 steps straight vs 2 + --resume 2, both on vLLM: a fresh vLLM engine, the full initial sync from the
    restored learner, then every deterministic metric of every step equal (vLLM CPU sampling is reproducible
    given the weights and the per-request seeds) and the same final weights."""
    from miles_lp.launch.runner import Run, deterministic_metrics

    def recipe(steps):
        return load_recipe(REPO / "recipes" / "tiny-mxfp8-vllm.yaml",
                           [f"logging.output_dir={tmp_path / 'runs'}", "checkpoint_every=2", "logging.progress=false",
                            f"steps={steps}", "rl.prompts_per_step=4", "rl.group_size=4"])

    runs = []
    try:
        a = Run.start(recipe(4), "straight")
        runs.append(a)
        a.train(progress=False)
        a.close()
        two = Run.start(recipe(2), "resumed")
        runs.append(two)
        two.train(progress=False)
        two.close()
        b = Run.resume(two.dir.path, recipe(4))
        runs.append(b)
        assert b.step == 2
        b.train(progress=False)
    finally:
        for r in runs:
            r.close()
    ra, rb = deterministic_metrics(a.dir.read_metrics()), deterministic_metrics(b.dir.read_metrics())
    assert len(ra) == len(rb) == 4
    # C3's rotating layer follows the run's sync count (the runner sets the fresh engine's c3_rotation_base), so
    # the resumed run probes the layer the straight one did: its figure is compared exactly with the rest
    assert all(0 < r["sync/check/self_check/figure"] < 0.01 for r in ra + rb)
    assert ra == rb
    sa, sb = a.learner.state_dict()["model"], b.learner.state_dict()["model"]
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
