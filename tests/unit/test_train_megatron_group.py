"""The Megatron learner at tensor parallel 2 and expert parallel 2 on 2 gloo CPU ranks (``MegatronGroup``
items 1-2) against the TP-1 ``MegatronLearner`` on the same checkpoint, plan, batch and loss.

Per case: logprobs before the step, one optimizer step (loss, grad norm), the gathered masters after it, and the
export after it (and, in the fast case, the export before the step: byte-equal to the TP-1 learner's): every quantized tensor byte-equal to the codecs applied to the gathered masters AND to
``miles-lp convert`` of those masters (saved as an HF checkpoint); every other tensor the master in the checkpoint
dtype.

Measured here (2026-12-01, torch 2.13 CPU, megatron-core 0.16.1, tiny 2-layer models, lr 1e-3, grad clip 1), TP 2
or EP 2 vs TP 1: logprobs max |diff| 0.0 in every quantized case (qwen3 MXFP8 TP 2 with and without sequence
parallelism; qwen3_moe MXFP8 and MXFP8 + NVFP4 experts at TP 2 / ETP 1, at EP 2, at TP 2 x EP 2 / ETP 1 (2 ranks), and MXFP8 at TP 2 / ETP 2 and at TP 2 x EP 2 x ETP 2 on 4 ranks), 4.8e-7
for qwen3 without a plan; grad norm relative difference <= 1.3e-7; gathered masters after the step max |diff|
0.7e-6 .. 1.8e-5 (AdamW's first step is lr * g / (|g| + eps): gradient summation order moves tiny-gradient
elements). Tolerances below: logprobs 1e-5, masters 1e-4, grad norm 1e-5 relative.

NVFP4 activation partition (``parallel.check_activation_partition``): at TP 2 with Megatron's default ETP = TP, the
experts' down_proj quantizes each token over half of K: refused against a TP-1 engine; forced through (telling the
learner the engine runs ETP 2), its logprobs move away from TP 1's (while its export, NVFP4 expert weights sharded
over ETP 2 with the amax MAX-reduced, is still the codecs of the gathered masters): measured 6.2e-3 (grad norm 3.9e-5 relative,
masters 2.0e-3 after the step), against 0.0 for the same sizes under all-MXFP8 (slow tests).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings

import pytest
import torch

mc = pytest.importorskip("megatron.core", reason="megatron-core not installed (extra 'megatron')")

from miles_lp.errors import ConfigError  # noqa: E402
from miles_lp.train.config import MegatronSection, TrainConfig  # noqa: E402
from miles_lp.train.embedded import nll_loss, plan_for_model  # noqa: E402

#: MILES_LP_MEGATRON_DEVICE=cuda runs the same cases on NCCL, rank r on cuda:r (scripts/h200_megatron.sh)
DEVICE = os.environ.get("MILES_LP_MEGATRON_DEVICE", "cpu")
CFG = TrainConfig(backend="megatron", lr=1e-3, device=DEVICE, micro_batch_tokens=64, seed=3)
LP_TOL, MASTER_TOL, NORM_RTOL = 1e-5, 1e-4, 1e-5


@pytest.fixture(scope="module", autouse=True)
def quiet():
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    assert not dist.is_initialized(), "another test module left a torch.distributed group behind"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from miles_lp.checkpoint.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("megg")
    return {a: make_tiny_model(a, root / a, num_layers=2) for a in ("qwen3", "qwen3_moe")}


def _policy(fmt):
    from miles_lp.cli.convert import policy_for_format

    return None if fmt is None else policy_for_format(fmt)


def _seqs():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g) for n in (17, 30, 9, 40)]


def _cfg(**megatron):
    return dataclasses.replace(CFG, megatron=MegatronSection(**megatron))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _run(learner, with_export=True, export_before=False):
    """logprobs, one step, the gathered masters (and the export) after it; the learner is closed.
    ``export_before``: the export before the step too."""
    seqs = _seqs()
    try:
        before = [(n, _cpu(v)) for n, v in learner.export_weights()] if export_before else None
        lp = learner.logprobs(seqs)[0]
        stats = learner.train_step([{"tokens": s} for s in seqs], nll_loss)
        masters = {k: v.cpu() for k, v in learner.gathered_masters().items()}
        exported = [(n, _cpu(v)) for n, v in learner.export_weights()] if with_export else None
        executed = learner.executed_quantized()
    finally:
        learner.close()
    return {"lp": lp, "stats": stats, "masters": masters, "export": exported, "executed": executed,
            "before": before}


def _cpu(v):
    if isinstance(v, torch.Tensor):
        return v.cpu()
    return dataclasses.replace(v, **{f.name: getattr(v, f.name).cpu() for f in dataclasses.fields(v)
                                     if f.init and isinstance(getattr(v, f.name), torch.Tensor)})


def _tp1(d, plan, export_before=False):
    from miles_lp.train.megatron.learner import MegatronLearner

    return _run(MegatronLearner(d, plan, CFG), with_export=False, export_before=export_before)


def _group(d, plan, cfg, export_before=False, **kw):
    from miles_lp.train.megatron.group import MegatronGroup

    return _run(MegatronGroup(d, plan, cfg, **kw), export_before=export_before)


def _same_export(a, b) -> list[str]:
    """Names whose tensors / grid components are not byte-equal (both exports must hold the same names)."""
    a, b = dict(a), dict(b)
    assert a.keys() == b.keys()
    bad = []
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor):
            ok = isinstance(w, torch.Tensor) and same_bytes(v, w)
        else:
            ok = not isinstance(w, torch.Tensor) and all(same_bytes(x, w.components()[n])
                                                         for n, x in v.components().items())
        if not ok:
            bad.append(k)
    return bad


def _codec_of_masters(plan, masters):
    """The codecs applied to the gathered masters, per quantized tensor (NVFP4 gate/up: one global scale)."""
    from miles_lp import formats
    from miles_lp.formats import Format

    out = {}
    for name, entry in plan.quantized().items():
        if entry.format is Format.MXFP8:
            out[name] = formats.quantize_mxfp8(masters[name])
        elif name.endswith("gate_proj.weight"):
            up = name.replace("gate_proj", "up_proj")
            out[name], out[up] = formats.quantize_nvfp4_pair(masters[name], masters[up])
        elif not name.endswith("up_proj.weight"):
            out[name] = formats.quantize_nvfp4(masters[name])
    assert set(out) == set(plan.quantized())
    return out


def _check_export(d, plan, policy, res, tmp_path):
    """Export after the step == codecs(gathered masters) == convert(gathered masters); the rest = masters in BF16."""
    from safetensors.torch import save_file

    from miles_lp.checkpoint.convert import convert_checkpoint
    from miles_lp.export import engine_tensors
    from miles_lp.export.tensors import is_quantized
    from miles_lp.io.safetensors_io import open_checkpoint, read_tensor
    from miles_lp.train.embedded import SourceInfo

    exported, masters = dict(res["export"]), res["masters"]
    assert len(exported) == len(res["export"]) and set(exported) == set(open_checkpoint(d).tensors) == set(masters)
    codec = _codec_of_masters(plan, masters)
    dtypes = SourceInfo.from_checkpoint(d).dtypes
    checked = 0
    for name, v in exported.items():
        if name in codec:
            assert is_quantized(v), name
            a, b = v.components(), codec[name].components()
            assert a.keys() == b.keys() and all(same_bytes(a[k], b[k]) for k in a), name
            checked += 1
        else:
            assert same_bytes(v, masters[name].to(dtypes.get(name, torch.bfloat16))), name
    assert checked == len(plan.quantized()) > 0
    # the same weights through `miles-lp convert`
    src = tmp_path / "masters"
    src.mkdir()
    for f in ("config.json", "generation_config.json"):
        if (d / f).exists():
            shutil.copy(d / f, src / f)
    save_file({k: v.contiguous() for k, v in masters.items()}, str(src / "model.safetensors"))
    conv = tmp_path / "convert"
    convert_checkpoint(src, conv, policy, progress=False, log=lambda s: None)
    disk = {n: read_tensor(h) for n, h in open_checkpoint(conv).tensors.items()}
    assert plan_for_model(policy, src).hash == plan.hash
    ours = dict(engine_tensors(res["export"], plan, "sglang"))
    assert ours.keys() == disk.keys()
    qparts = 0
    for k, t in ours.items():
        if t.dtype == torch.bfloat16 and disk[k].dtype == torch.float32:  # convert keeps an FP32 source's dtype
            assert same_bytes(t, disk[k].to(torch.bfloat16)), k
            continue
        assert same_bytes(t, disk[k]), k
        qparts += t.dtype not in (torch.bfloat16, torch.float32)
    assert qparts >= len(plan.quantized())
    return checked


def _compare(ref, got):
    lp = max(float((a - b).abs().max()) for a, b in zip(ref["lp"], got["lp"], strict=True))
    assert lp <= LP_TOL, lp
    s1, s2 = ref["stats"], got["stats"]
    assert s2["step"] == 1 and s2["micro_batches"] == s1["micro_batches"] and abs(s2["loss"] - s1["loss"]) < 1e-5
    assert abs(s2["grad_norm"] - s1["grad_norm"]) <= NORM_RTOL * s1["grad_norm"], (s1, s2)
    assert ref["masters"].keys() == got["masters"].keys()
    worst = max(float((ref["masters"][k] - got["masters"][k]).abs().max()) for k in ref["masters"])
    assert worst <= MASTER_TOL, worst
    # the step moved the masters (the comparison is not of two untouched models)
    assert ref["executed"] == got["executed"]
    return lp, worst


def test_tp2_moe_mxfp8_nvfp4_experts_equals_tp1_and_exports_the_codecs(ckpts, tmp_path):
    """qwen3_moe, MXFP8 attention + NVFP4 experts, TP 2 (sequence parallel, ETP 1 = the reference engine's): the
    one fast multi-rank test of the default suite (~15 s on 2 cores)."""
    d, policy = ckpts["qwen3_moe"], _policy("mxfp8+nvfp4-experts")
    plan = plan_for_model(policy, d)
    ref = _tp1(d, plan, export_before=True)
    got = _group(d, plan, _cfg(tp=2, etp=1), export_before=True)
    assert not _same_export(ref["before"], got["before"])  # the same weights: the TP-1 export, byte for byte
    _compare(ref, got)
    assert len(got["executed"]) == len(plan.quantized())
    _check_export(d, plan, policy, got, tmp_path)
    moved = sum(not torch.equal(got["masters"][k], v) for k, v in _initial(d).items())
    assert moved > len(got["masters"]) // 2


def _initial(d):
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(str(d / "model.safetensors")).items()}


SLOW_CASES = [
    ("qwen3", "mxfp8", {"tp": 2}),
    ("qwen3", "mxfp8", {"tp": 2, "sequence_parallel": True}),
    ("qwen3", None, {"tp": 2}),
    ("qwen3_moe", "mxfp8", {"tp": 2, "etp": 1}),
    ("qwen3_moe", "mxfp8+nvfp4-experts", {"ep": 2}),
    ("qwen3_moe", "mxfp8", {"ep": 2}),
    ("qwen3_moe", "mxfp8", {"tp": 2}),  # ETP 2: MXFP8 has no per-token global scale, the partition is free
    ("qwen3_moe", "mxfp8+nvfp4-experts", {"tp": 2, "ep": 2, "etp": 1}),  # EP over the TP ranks: still 2 ranks
    ("qwen3_moe", "mxfp8", {"tp": 2, "ep": 2, "etp": 2}),  # 4 ranks (dp 2): ~50 s on 2 cores
]


@pytest.mark.slow  # a TP-1 learner and a 2-rank group per case: ~12 s each on 2 cores
@pytest.mark.parametrize("arch,fmt,sizes", SLOW_CASES,
                         ids=["qwen3-mxfp8-tp2", "qwen3-mxfp8-tp2-sp", "qwen3-noplan-tp2", "moe-mxfp8-tp2-etp1",
                              "moe-nvfp4experts-ep2", "moe-mxfp8-ep2", "moe-mxfp8-tp2-etp2", "moe-nvfp4experts-tp2-ep2",
                                  "moe-mxfp8-tp2-ep2-etp2-4ranks"])
def test_parallel_cases_equal_tp1_and_export_the_codecs(ckpts, tmp_path, arch, fmt, sizes):
    d, policy = ckpts[arch], _policy(fmt)
    plan = None if policy is None else plan_for_model(policy, d)
    ref = _tp1(d, plan)
    got = _group(d, plan, _cfg(**sizes))
    _compare(ref, got)
    if plan is not None:
        _check_export(d, plan, policy, got, tmp_path)


@pytest.mark.slow  # two groups
def test_nvfp4_activation_partition_mismatch_is_detected_numerically(ckpts, tmp_path):
    """TP 2 with ETP 2 and NVFP4 experts: refused against a TP-1 engine (the check); forced through by telling the
    learner the engine runs ETP 2, each token's down_proj amax comes from half of K and the logprobs leave TP 1's
    tolerance (while the same sizes with all-MXFP8 stay within it: test above, case moe-mxfp8-tp2-etp2)."""
    from miles_lp.train.megatron.group import MegatronGroup

    d, policy = ckpts["qwen3_moe"], _policy("mxfp8+nvfp4-experts")
    plan = plan_for_model(policy, d)
    with pytest.raises(ConfigError, match=r"experts.0.down_proj.weight, would compute each token's amax over 1/2 "
                                          r"of K on the learner and over 1/1 on the engine"):
        MegatronGroup(d, plan, _cfg(tp=2))
    ref = _tp1(d, plan)
    got = _group(d, plan, _cfg(tp=2), engine_etp=2)
    lp = max(float((a - b).abs().max()) for a, b in zip(ref["lp"], got["lp"], strict=True))
    assert lp > 100 * LP_TOL, lp
    # the experts' NVFP4 weights are sharded over ETP 2 here: their global scale is the MAX-reduced amax, so the
    # gathered grids are still the codecs (and convert) of the whole masters
    _check_export(d, plan, policy, got, tmp_path)


@pytest.mark.slow
def test_group_resume_is_bit_identical_and_a_failing_rank_is_named(ckpts, tmp_path):
    """TP 2: save after one step (state_io), a fresh group loads it, both step again: same stats, masters and
    export bytes. A rank that fails (a loss function that raises on rank 1 only) is reported with its traceback,
    and the group refuses further calls; a rank that fails while starting is reported before the rendezvous."""
    from miles_lp.train.megatron.group import GroupError, MegatronGroup
    from miles_lp.train.state_io import load_learner_state, save_learner_state

    d = ckpts["qwen3_moe"]
    plan = plan_for_model(_policy("mxfp8+nvfp4-experts"), d)
    samples = [{"tokens": s} for s in _seqs()]
    a = MegatronGroup(d, plan, _cfg(tp=2, etp=1))
    try:
        a.train_step(samples, nll_loss)
        save_learner_state(a.state_dict(), tmp_path / "state")
        state = load_learner_state(tmp_path / "state")
        assert state["group"] == {"world": 2, "tp": 2, "pp": 1, "dp": 1, "ep": 1, "etp": 1} and len(state["ranks"]) == 2
        a.train_step(samples, nll_loss)
        ma, ea = a.gathered_masters(), dict(a.export_weights())
    finally:
        a.close()
    b = MegatronGroup(d, plan, _cfg(tp=2, etp=1))
    try:
        with pytest.raises(ConfigError, match="cannot be loaded into a Megatron group"):
            b.load_state_dict({**state, "group": {"world": 2, "tp": 1, "ep": 2, "etp": 1}})
        b.load_state_dict(state)
        assert b.step == 1
        b.train_step(samples, nll_loss)
        mb, eb = b.gathered_masters(), dict(b.export_weights())
        assert all(torch.equal(ma[k], mb[k]) for k in ma)
        for k, v in ea.items():
            if isinstance(v, torch.Tensor):
                assert same_bytes(v, eb[k]), k
            else:
                assert all(same_bytes(x, eb[k].components()[n]) for n, x in v.components().items()), k

        def rank1_fails(lp, ent, samples, totals):
            import torch.distributed as dist

            if dist.get_rank() == 1:
                raise RuntimeError("boom on rank 1")
            return nll_loss(lp, ent, samples, totals)

        with pytest.raises(GroupError, match=r"(?s)Megatron rank 1 failed during train_step.*boom on rank 1"):
            b.train_step(samples, rank1_fails)
        with pytest.raises(GroupError, match="the Megatron group is stopped"):
            b.logprobs(_seqs())
    finally:
        b.close()

    class _PlanThatFailsInTheWorker:  # rank 0 reads it; unpickling it on rank 1 raises (int("not a plan"))
        def quantized(self):
            return {}

        def __reduce__(self):
            return (int, ("not a plan",))

    import time

    t0 = time.monotonic()
    with pytest.raises(GroupError, match=r"(?s)Megatron rank 1 failed while starting:.*invalid literal for int"):
        MegatronGroup(d, _PlanThatFailsInTheWorker(), _cfg(tp=2, etp=1))
    assert time.monotonic() - t0 < 60  # reported at once, not after the rendezvous timeout
    import torch.distributed as dist

    assert not dist.is_initialized()


# ---------------------------------------------------------------------------------------------------------
# no processes: the rules
# ---------------------------------------------------------------------------------------------------------


def test_activation_partition_rule_and_refusals(ckpts):
    """The rule (parallel.activation_partition): row-parallel GEMMs are cut into tp (dense, shared experts) or etp
    (routed experts) K slices, column-parallel ones see the whole hidden; the check refuses a learner / engine
    mismatch for NVFP4 only; and numerically, a per-token NVFP4 scale over half of K is another grid."""
    from miles_lp import formats
    from miles_lp.train.megatron.parallel import activation_partition, check_activation_partition

    ap = activation_partition
    assert ap("model.layers.0.mlp.experts.3.down_proj.weight", tp=2, etp=1) == 1
    assert ap("model.layers.0.mlp.experts.3.down_proj.weight", tp=2, etp=2) == 2
    assert ap("model.layers.0.mlp.experts.3.gate_proj.weight", tp=2, etp=2) == 1
    assert ap("model.layers.0.self_attn.o_proj.weight", tp=2, etp=1) == 2
    assert ap("model.layers.0.self_attn.q_proj.weight", tp=2, etp=1) == 1
    assert ap("model.layers.0.mlp.shared_expert.down_proj.weight", tp=2, etp=1) == 2
    d = ckpts["qwen3_moe"]
    nv = plan_for_model(_policy("mxfp8+nvfp4-experts"), d)
    check_activation_partition(nv, tp=2, etp=1)  # the experts' K whole, as the TP-1 engine's
    check_activation_partition(nv, tp=2, etp=2, engine_tp=2)  # an engine at TP 2 (MoE TP 2) cuts K the same way
    check_activation_partition(plan_for_model(_policy("mxfp8"), d), tp=2, etp=2)  # MXFP8: no global scale
    with pytest.raises(ConfigError, match=r"8 row-parallel GEMM\(s\).*learner tp=2 etp=2, engine tp=1 etp=1"):
        check_activation_partition(nv, tp=2, etp=2)
    with pytest.raises(ConfigError, match=r"over 1/1 of K on the learner and over 1/2 on the engine"):
        check_activation_partition(nv, tp=1, etp=1, engine_tp=2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g) * torch.linspace(0.1, 4, 64)  # the halves have different amax
    whole = formats.quantize_nvfp4(x, scale_scope="row")
    halves = [formats.quantize_nvfp4(h.contiguous(), scale_scope="row") for h in x.split(32, dim=1)]
    deq = torch.cat([h.dequantize(torch.float32) for h in halves], dim=1)
    assert not torch.equal(deq, whole.dequantize(torch.float32))


def test_resolve_parallel_and_group_refusals(ckpts):
    from miles_lp.checkpoint.tiny import tiny_config
    from miles_lp.train.megatron.group import MegatronGroup, make_megatron_learner
    from miles_lp.train.megatron.parallel import ParallelSizes, resolve_parallel

    moe, dense = tiny_config("qwen3_moe"), tiny_config("qwen3")
    assert resolve_parallel(MegatronSection(tp=2), moe) == ParallelSizes(2, 1, 2, True)  # SP on for MoE + TP
    assert resolve_parallel(MegatronSection(tp=2), dense) == ParallelSizes(2, 1, 2, False)
    s = resolve_parallel(MegatronSection(tp=2, ep=2, etp=1), moe)
    assert (s.world, s.dp, s.edp) == (2, 1, 1)
    s = resolve_parallel(MegatronSection(ep=2), moe)
    assert (s.world, s.dp, s.edp) == (2, 2, 1)
    with pytest.raises(ConfigError, match="ep=2 etp=None on a dense model"):
        resolve_parallel(MegatronSection(ep=2), dense)
    with pytest.raises(ConfigError, match="tp=3 does not divide num_attention_heads=4"):
        resolve_parallel(MegatronSection(tp=3), dense)
    s = resolve_parallel(MegatronSection(pp=2), dense)  # 4 layers: 2 + 2
    assert (s.world, s.pp, s.dp) == (2, 2, 1)
    with pytest.raises(ConfigError, match="pp=3 with first_stage_layers=None last_stage_layers=None does not split "
                                          "the 4 decoder layers"):
        resolve_parallel(MegatronSection(pp=3), dense)
    ds = tiny_config("deepseek_v3")
    assert resolve_parallel(MegatronSection(tp=2), ds).world == 2  # MLA under TP (and EP): mapped
    ds.kv_lora_rank = 62  # + qk_rope_head_dim 32 = 94
    with pytest.raises(ConfigError, match=r"tp=4 does not divide kv_lora_rank \+ qk_rope_head_dim=94"):
        resolve_parallel(MegatronSection(tp=4), ds)
    with pytest.raises(ConfigError, match="MegatronGroup is for tp \\* ep > 1"):
        MegatronGroup(ckpts["qwen3"], None, CFG)
    with pytest.raises(ConfigError, match="from an HF checkpoint folder"):
        MegatronGroup(str(ckpts["qwen3"] / "nope"), None, _cfg(tp=2))
    if torch.cuda.device_count() < 2:
        with pytest.raises(ConfigError, match="needs 2 GPUs"):
            MegatronGroup(ckpts["qwen3"], None, dataclasses.replace(_cfg(tp=2), device="cuda"))
    one = make_megatron_learner(ckpts["qwen3"], None, CFG)
    try:
        assert type(one).__name__ == "MegatronLearner"
    finally:
        one.close()
    assert json.loads((ckpts["qwen3"] / "config.json").read_text())["model_type"] == "qwen3"


@pytest.mark.slow  # the main job on a 2-rank group and on the TP-1 learner: ~60 s on 2 cores
def test_the_main_job_runs_on_a_tp2_group(tmp_path, monkeypatch):
    """`miles-lp run` with `train.megatron.tp: 2` on a tiny MoE, every sync check in raise mode (the runner's
    make_learner calls make_megatron_learner; wrapped here to record which learner it built): the loop uses the
    group unchanged, every sync's grid check passes, step 0 equals the TP-1 learner's run."""
    import miles_lp.launch.runner as runner
    from miles_lp.cli import main
    from miles_lp.launch.run_dir import RunDir
    from miles_lp.train.megatron.group import make_megatron_learner

    made = []

    def make_learner(recipe, model_dir, plan):
        learner = make_megatron_learner(model_dir, plan, recipe.train)
        made.append(type(learner).__name__)
        return learner

    monkeypatch.setattr(runner, "make_learner", make_learner)
    p = tmp_path / "r.yaml"
    p.write_text(f"""\
model: {{path: "tiny:qwen3_moe", num_layers: 1}}
precision: {{default: mxfp8, backward: dequantized, rules: [{{role: routed_experts, format: nvfp4}}]}}
train: {{backend: megatron, lr: 3.0e-3, device: cpu, megatron: {{tp: 2, etp: 1}}}}
rollout: {{device: cpu, max_response_len: 3}}
sync:
  checks: {{layer_audit: raise, grid: raise, storage: raise, completeness: raise, version: raise}}
rl: {{prompts_per_step: 2, group_size: 4, mini_batches: 2}}
task: {{name: copy, length: 1, alphabet: 4}}
logging: {{output_dir: {tmp_path / "runs"}, progress: false}}
steps: 2
seed: 0
""")
    assert main(["run", str(p), "--run-name", "tp2", "--no-progress"]) == 0
    p1 = tmp_path / "r1.yaml"
    p1.write_text(p.read_text().replace("megatron: {tp: 2, etp: 1}", "megatron: {tp: 1}"))
    assert main(["run", str(p1), "--run-name", "tp1", "--no-progress"]) == 0
    assert made == ["MegatronGroup", "MegatronLearner"]
    rows = RunDir(tmp_path / "runs" / "tp2").read_metrics()
    ref = RunDir(tmp_path / "runs" / "tp1").read_metrics()
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["sync/check/grid"] == 1.0 and r["sync/check/layer_audit"] == 1.0 for r in rows)
    assert rows[-1]["actor/step"] == 4.0
    # step 0: the same rollouts (the engine starts on the same grid) and the TP-1 learner's kl (measured 2.0e-8
    # for both: Megatron's probability-scaled fc2 input under NVFP4 experts, docs/training.md)
    assert rows[0]["reward/mean"] == ref[0]["reward/mean"]
    assert abs(rows[0]["rollout_corr/kl"] - ref[0]["rollout_corr/kl"]) < 1e-9 and rows[0]["rollout_corr/kl"] < 1e-6
