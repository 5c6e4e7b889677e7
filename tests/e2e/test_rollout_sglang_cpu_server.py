"""Real SGLang (0.5.23, its CPU platform, in its own venv) serving a tiny BF16 Qwen3, driven by miles-lp: started by
the client (``flavor="launch"``: loopback, a free port, stopped at the end), sampled with log-probs, updated live from
disk, and asked the checks through the introspection that runs inside SGLang's own process. A fault written into the
real server's model after an update is caught by the sync's checks (C2 a changed byte, C4 a re-bound parameter, C3
a derived GEMM operand in the wrong layout). ``bf16``: every linear BF16 (default CI); ``mxfp8`` / ``nvfp4`` /
``fp8_block`` (slow): our ``--target sglang`` MXFP8 / ModelOpt NVFP4 / FP8 blockwise checkpoint through SGLang's own
config parsing and loader, with miles-lp's CPU linear method (``fp8_block``: tiny ``qwen3_wide``, one block scale
doubled in SGLang's storage caught by C2).

One server for the module (its start is most of the time: ~30 s on an idle 2-core machine). Skipped, saying why,
without SGLang's venv (``MILES_LP_SGLANG_PYTHON`` or ``.ci/sglang_venv.sh``'s default folder) or with
``MILES_LP_CI_SKIP_SGLANG=1``."""

from __future__ import annotations

import time

import pytest
import torch

from tests.sglang_env import record, sglang_python_or_skip

PROMPTS = [[3, 17, 99, 4, 250, 7, 1, 2], [5, 6, 9, 11], [40, 41, 42, 43, 44, 45]]
KEY = "sglang-cpu-test-key"
GAP = {"bf16": 0.02, "mxfp8": 0.05, "nvfp4": 0.2, "fp8_block": 0.05}  # bounds on max |logprob SGLang - learner| (measured: see below)


@pytest.fixture(scope="module", params=["bf16", pytest.param("mxfp8", marks=pytest.mark.slow),
                                        pytest.param("nvfp4", marks=pytest.mark.slow),
                                        pytest.param("fp8_block", marks=pytest.mark.slow)])
def fmt(request):
    return request.param


def _arch(fmt):
    """FP8 blockwise: SGLang's block-FP8 linear wants every fused shard a whole number of 128-row blocks."""
    return "qwen3_wide" if fmt == "fp8_block" else "qwen3"


@pytest.fixture(scope="module")
def hf(fmt):
    from miles_lp.rollout.testing import tiny_hf

    return tiny_hf(_arch(fmt), 0, 2)


@pytest.fixture(scope="module")
def ckpt(fmt):
    """What SGLang serves: the BF16 model itself, or its conversion (``--target sglang``)."""
    from miles_lp.rollout.testing import tiny_checkpoint

    return tiny_checkpoint(_arch(fmt), None if fmt == "bf16" else fmt, num_layers=2)


@pytest.fixture(scope="module")
def plan(fmt, hf):
    from miles_lp.rollout.testing import policy_for
    from miles_lp.train.embedded import plan_for_model

    return None if fmt == "bf16" else plan_for_model(policy_for(fmt), hf)


@pytest.fixture(scope="module")
def engine(ckpt, tmp_path_factory):
    from miles_lp.rollout.sglang import SGLangHTTPEngine

    python = sglang_python_or_skip()
    tmp = tmp_path_factory.mktemp("sglang-cpu")
    t0 = time.monotonic()
    eng = SGLangHTTPEngine(None, api_key=KEY, flavor="launch", checkpoint=ckpt, update_dir=tmp / "updates",
                           server_options={"python": python, "threads": 1,
                                           "extra_env": {"MILES_LP_SGLANG_FAULTS": "1"}})
    record(what="sglang-cpu start", seconds=round(time.monotonic() - t0, 1))
    try:
        yield eng
    finally:
        eng.close()
    assert not eng.server.running


@pytest.fixture(scope="module")
def learner(hf, plan):
    from miles_lp.train.config import TrainConfig
    from miles_lp.train.embedded import EmbeddedTrainer

    return EmbeddedTrainer(hf, plan, TrainConfig(device="cpu"))


def _max_gap(engine, learner, prompts=PROMPTS, n=8):
    from miles_lp.rollout.engine import SamplingParams

    gens = engine.generate(prompts, SamplingParams(max_new_tokens=n, seed=0))
    seqs = [torch.tensor(p + g.output_ids) for p, g in zip(prompts, gens, strict=True)]
    lps, _ = learner.logprobs(seqs)
    gaps = [(g.logprobs - lp[len(p) - 1:].float()).abs().max() for g, lp, p in zip(gens, lps, prompts, strict=True)]
    return gens, float(max(gaps))


def test_server_binds_loopback_and_answers_with_the_key(engine):
    import urllib.error
    import urllib.request

    assert engine.url.startswith("http://127.0.0.1:")
    with pytest.raises(urllib.error.HTTPError) as e:  # SGLang's own key check, on our introspection route too
        urllib.request.urlopen(engine.url + "/miles_lp/quantized_params", timeout=30)
    assert e.value.code == 401
    assert engine.health()["status"] == "ok" and engine.weight_version == 0


def test_sglang_logprobs_match_the_learner(engine, learner, fmt):
    """SGLang's served log-probs of its own samples vs the learner's (fp32 master) on the same weights (the same
    MXFP8 grid for mxfp8: SGLang's loader, our CPU linear method)."""
    gens, gap = _max_gap(engine, learner)
    assert all(len(g.output_ids) == 8 and g.finish_reason == "length" and g.weight_version == 0 for g in gens)
    record(what="sglang-cpu max |logprob - learner|", format=fmt, value=gap)
    # measured 0.0024 (bf16), 0.012-0.017 (mxfp8), 0.047-0.104 (nvfp4): SGLang's bf16 activations between layers
    # differ slightly from the fp32 learner's, and a coarser activation grid turns that into whole rounding steps
    assert gap < GAP[fmt]


def test_checks_are_answered_by_sglangs_own_model(engine, ckpt, fmt):
    from safetensors.torch import load_file

    from miles_lp.rollout.engine import tensor_digest

    disk = {n: t for f in sorted(ckpt.glob("*.safetensors")) for n, t in load_file(f).items()}
    held = engine.weight_digests(list(disk))
    assert held == {n: tensor_digest(t) for n, t in disk.items()}  # q/k/v and gate/up read back out of SGLang's fusion
    assert set(engine.storage_pointers()) >= set(disk)
    live = engine.quantized_params()
    c3 = engine.self_check()
    if fmt == "bf16":
        assert live == {} and "every linear serves BF16" in c3["reason"]
        return
    linears = {n for n in disk if n.endswith("_proj.weight")}
    assert live == dict.fromkeys(linears, fmt)  # every projection, from SGLang's live quant methods
    assert [v["kind"] for v in c3["layers"].values()] == ["dense", "rotating"]
    for name, entry in c3["layers"].items():
        record(what="sglang-cpu self_check rel_err", format=fmt, layer=name, value=entry["rel_err"])
        # the activation grid's error alone when healthy: measured 0.028 (mxfp8), 0.098 (nvfp4); a stale layout ~1
        assert 0 < entry["rel_err"] < 0.2
    assert c3["ok"]


class _FaultAfterFinish:
    """The real server's update, then a fault written into its live model (what a broken loader would leave)."""

    def __init__(self, inner, kind, name):
        self.inner, self.kind, self.name = inner, kind, name

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def finish_weight_update(self, *a, **kw):
        out = self.inner.finish_weight_update(*a, **kw)
        self.inner.inject_fault(self.kind, self.name)
        return out


def test_live_update_from_disk_checked_by_sglang_and_faults_caught(engine, learner, plan, fmt):
    from miles_lp.sync.config import parse_sync_config
    from miles_lp.sync.verdict import SyncCheckError
    from miles_lp.sync.weight_sync import WeightSync

    raise_all = parse_sync_config({"checks": {"layer_audit": "raise", "grid": "raise", "storage": "raise",
                                              "completeness": "raise", "version": "raise", "self_check": "warn",
                                              "sentinel": "warn"}})
    if fmt != "bf16":
        raise_all = parse_sync_config({"checks": {c: "raise" for c in ("layer_audit", "grid", "storage", "completeness",
                                                                        "version", "self_check")} | {"sentinel": "warn"}})
    sync = WeightSync(engine, plan, "sglang", raise_all)
    first = sync.initial_sync(learner)
    assert first.ok and "(full compare)" in first.verdict("grid").reason
    gens0, _ = _max_gap(engine, learner)
    g = torch.Generator().manual_seed(0)  # one change every run (unseeded, fp8_block's C3 once read 0.062 > 0.05)
    with torch.no_grad():  # a learner step's worth of change, on every weight
        for p in learner.model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    t0 = time.monotonic()
    rep = sync.sync(learner)
    record(what="sglang-cpu sync seconds (disk path, whole model)", format=fmt, value=round(rep.seconds, 3),
           wall=round(time.monotonic() - t0, 3), bytes=rep.bytes)
    assert rep.ok, [str(v) for v in rep.failed]
    for c in ("grid", "storage", "completeness", "version") + (("layer_audit", "self_check") if plan else ()):
        assert rep.verdict(c).ok, rep.verdict(c)
    assert engine.weight_version == first.weight_version + 1
    gens1, gap = _max_gap(engine, learner)
    assert [g.output_ids for g in gens1] != [g.output_ids for g in gens0] or not torch.equal(
        gens1[0].logprobs, gens0[0].logprobs)
    assert gap < GAP[fmt]
    assert all(g.weight_version == engine.weight_version for g in gens1)

    name = "model.layers.1.mlp.up_proj.weight"
    # C3 probes the first quantized linear (layer 0's fused q/k/v): the stale layout is put there
    # (the re-bound storage stays moved for later syncs: that fault comes last)
    # FP8 blockwise: one fp32 block scale of a fused shard doubled in SGLang's live storage (C2)
    scale = [("double_scale", "grid", "model.layers.1.mlp.up_proj.weight_scale_inv")] if fmt == "fp8_block" else []
    faults = [("perturb", "grid", name)] + scale + (
        [("stale_layout", "self_check", "model.layers.0.self_attn.k_proj.weight")] if plan else []) + [
        ("rebind", "storage", name)]
    for kind, check, name in faults:
        bad = WeightSync(_FaultAfterFinish(engine, kind, name), plan, "sglang", raise_all)
        bad.pointers = sync.pointers  # the pointers recorded at load, before any fault
        with pytest.raises(SyncCheckError) as e:
            bad.sync(learner)
        failed = {v.name for v in e.value.verdicts}
        assert check in failed, (kind, failed)
        engine.resume()  # raise mode leaves the engine paused
        record(what="sglang-cpu fault caught", format=fmt, fault=kind, check=check)

