"""The Megatron learner under data parallelism (``train.megatron.dp``) on gloo CPU ranks against the one-rank
``MegatronLearner``: same checkpoint, plan, mini-batch and loss; log-probs, one optimizer step (loss, grad norm),
the gathered masters and the export after it.

Each replica runs its share of the mini-batch's packed micro-batches (``data.replica_rounds``); the losses are
normalised by the whole mini-batch's totals, so the step's gradient is the one-rank gradient with the
micro-batches' contributions summed in another order (all-reduce over DP instead of accumulation in ``.grad``).
The batch below packs into 3 micro-batches of 64 tokens: one rank sums ((g0 + g1) + g2), two replicas
(g0 + g2) + g1, so the order really differs.

Tolerances, and why: every micro-batch's forward and backward is the same computation on both sides (the same
packed row, the same weights), so log-probs are equal bit for bit and the only difference is fp32 summation
order: a reordered sum of n fp32 terms differs by at most about (n - 1) * 2^-24 * sum |g_i| per element, here
n <= 4 ranks' or micro-batches' terms, so 1e-6 relative on the grad norm and the loss; the masters after AdamW's
first step (lr * m / (sqrt(v) + eps), about lr * sign(g)) by a few fp32 ulps, more for a gradient near eps, whose
update is not scale-free: 1e-6 absolute. The export (BF16 and MXFP8 bytes of those masters) can flip only where
a master lies within that distance of a rounding boundary: quantized grids are asserted byte-equal, a plain
tensor byte-equal or within MASTER_ATOL + one step of its dtype elementwise (seen: the DeepSeek routers, FP32 in
the checkpoint, at pp 2 and at ep 2, 16-26 of 256 elements per router by <= 3.7e-9, the grad norm there differing
by 2-4e-7 relative, so the clipping coefficient by as much, which moves the AdamW update of near-eps gradients,
``test_train_megatron_pp``).

Measured here (2026-12-02, torch 2.13 CPU, megatron-core 0.16.1, tiny 2-layer models, lr 1e-3, grad clip 1):
qwen3 MXFP8 dp 2: log-probs max |diff| 0.0, loss equal, grad norm relative difference 8e-8, export byte-equal;
qwen3_moe MXFP8 ep 2 x expert-dp 2 (dp 4, 4 ranks): log-probs 0.0, loss equal, export byte-equal; qwen3 MXFP8
tp 2 x dp 2 (4 ranks) against tp 2: see its test.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

mc = pytest.importorskip("megatron.core", reason="megatron-core not installed (extra 'megatron')")

from miles_lp.errors import ConfigError  # noqa: E402
from miles_lp.train.config import MegatronSection, TrainConfig  # noqa: E402
from miles_lp.train.embedded import nll_loss, plan_for_model  # noqa: E402

CFG = TrainConfig(backend="megatron", lr=1e-3, device="cpu", micro_batch_tokens=64, seed=3)
NORM_RTOL, LOSS_RTOL, MASTER_ATOL = 1e-6, 1e-6, 1e-6
LENGTHS = (17, 30, 9, 40, 23, 50)  # -> 3 micro-batches of 64 tokens under MXFP8's 32-token padding


Section = MegatronSection  # train.megatron: dp and the uneven pipeline stages included


def cfg(**megatron) -> TrainConfig:
    return dataclasses.replace(CFG, megatron=Section(**megatron))


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

    root = tmp_path_factory.mktemp("megdp")
    return {a: make_tiny_model(a, root / a, num_layers=2) for a in ("qwen3", "qwen3_moe")}


def seqs():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g) for n in LENGTHS]


def plan_for(d, fmt="mxfp8"):
    from miles_lp.cli.convert import policy_for_format

    return plan_for_model(policy_for_format(fmt), d)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def components(v) -> dict[str, torch.Tensor]:
    return {"": v} if isinstance(v, torch.Tensor) else v.components()


def run(learner) -> dict:
    """log-probs, one step, the gathered masters and the export after it; the learner is closed."""
    try:
        lp = learner.logprobs(seqs())[0]
        stats = learner.train_step([{"tokens": s} for s in seqs()], nll_loss)
        masters = {k: v.cpu() for k, v in learner.gathered_masters().items()}
        export = dict(learner.export_weights())
    finally:
        learner.close()
    return {"lp": lp, "stats": stats, "masters": masters, "export": export}


def one_rank(d, plan) -> dict:
    from miles_lp.train.megatron.learner import MegatronLearner

    return run(MegatronLearner(d, plan, CFG))


def group(d, plan, config, **kw) -> dict:
    from miles_lp.train.megatron.group import MegatronGroup

    return run(MegatronGroup(d, plan, config, **kw))


def assert_equal_to_one_rank(got: dict, ref: dict, master_atol: float = MASTER_ATOL) -> None:
    """``master_atol``: larger under tensor parallelism, whose row-parallel GEMMs sum K in per-rank parts
    (``test_train_megatron_group``: masters up to ~2e-5 from one rank)."""
    assert all(torch.equal(a, b) for a, b in zip(got["lp"], ref["lp"], strict=True))
    g, r = got["stats"], ref["stats"]
    assert g["micro_batches"] == r["micro_batches"] == 3 and g["tokens"] == r["tokens"]
    assert g["loss"] == pytest.approx(r["loss"], rel=LOSS_RTOL)
    assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=NORM_RTOL)
    assert got["masters"].keys() == ref["masters"].keys()
    worst = max(float((got["masters"][k] - v).abs().max()) for k, v in ref["masters"].items())
    assert worst <= master_atol, worst
    assert list(got["export"]) == list(ref["export"])  # the same names in the same order
    bad = [k for k, v in ref["export"].items()
           if not all(same_bytes(x, components(got["export"][k])[n]) for n, x in components(v).items())]
    # a plain (BF16 / FP32) tensor may differ where its masters (within MASTER_ATOL of each other) round to
    # neighbouring values: |a - b| <= MASTER_ATOL + one step of its dtype; quantized grids must be byte-equal
    for k in bad:
        a, b = ref["export"][k], got["export"][k]
        assert isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype == b.dtype, k
        step = torch.finfo(a.dtype).eps
        a, b = a.float(), b.float()
        assert bool(((a - b).abs() <= master_atol + step * torch.maximum(a.abs(), b.abs())).all()), k


def test_dp2_equals_one_rank(ckpts):
    """2 gloo ranks, each training its share of the micro-batches (the CI case)."""
    d = ckpts["qwen3"]
    plan = plan_for(d)
    got = group(d, plan, cfg(dp=2))
    assert got["stats"]["step"] == 1
    assert_equal_to_one_rank(got, one_rank(d, plan))


def test_dp2_with_fewer_micro_batches_than_replicas_equals_one_rank(ckpts):
    """One packed row at dp 2: replica 1 has no micro-batch of its own and runs a filler round (loss zero), so its
    gradients exist and both replicas reduce the same tensors (before, rank 0 waited in an all-reduce that rank 1
    skipped, until the group's timeout). The step equals one rank's."""
    from miles_lp.train.megatron.group import MegatronGroup
    from miles_lp.train.megatron.learner import MegatronLearner

    d = ckpts["qwen3"]
    plan = plan_for(d)
    batch = [{"tokens": seqs()[1]}]  # 30 tokens: one micro-batch
    out = {}
    for name, make in (("one", lambda: MegatronLearner(d, plan, CFG)),
                       ("dp2", lambda: MegatronGroup(d, plan, cfg(dp=2), timeout_s=120))):
        learner = make()
        try:
            out[name] = learner.train_step(batch, nll_loss)
        finally:
            learner.close()
    assert out["dp2"]["micro_batches"] == out["one"]["micro_batches"] == 1
    assert out["dp2"]["loss"] == pytest.approx(out["one"]["loss"], rel=LOSS_RTOL)
    assert out["dp2"]["grad_norm"] == pytest.approx(out["one"]["grad_norm"], rel=NORM_RTOL)
    assert out["dp2"]["step"] == out["one"]["step"] == 1


@pytest.mark.slow  # 4 ranks and a one-rank learner: ~70 s on 2 cores
def test_moe_ep2_expert_dp2_equals_one_rank(ckpts):
    """The 30B-A3B shape: tp 1, ep 2 over dp 4 (expert-dp 2), MXFP8 everywhere: the replicas run equal rounds
    (the all-gather dispatcher's collectives span them), one replica a filler round (3 packs over 4 replicas)."""
    d = ckpts["qwen3_moe"]
    plan = plan_for(d)
    got = group(d, plan, cfg(ep=2, dp=4))
    assert_equal_to_one_rank(got, one_rank(d, plan))


@pytest.mark.slow  # 4 ranks and 2 ranks: ~3 min on 2 cores
def test_dense_tp2_dp2_equals_tp2(ckpts):
    """The 8B shape: tp 2 (sequence parallel) x dp 2, against tp 2 alone (dp 1): what DP adds is held to the
    tolerances above. (TP itself moves the masters by up to ~2e-5 against one rank, the row-parallel GEMMs summing
    K in two halves: tests/unit/test_train_megatron_group.py; measured 2.9e-6 here.)"""
    d = ckpts["qwen3"]
    plan = plan_for(d)
    got = group(d, plan, cfg(tp=2, dp=2, sequence_parallel=True))
    assert_equal_to_one_rank(got, group(d, plan, cfg(tp=2, sequence_parallel=True)))


# ---------------------------------------------------------------------------------------------------------
# no processes: the sizes and the dealing
# ---------------------------------------------------------------------------------------------------------


def test_sizes_tile_or_are_refused():
    from miles_lp.checkpoint.tiny import tiny_config
    from miles_lp.train.megatron.parallel import resolve_parallel

    moe, dense = tiny_config("qwen3_moe"), tiny_config("qwen3")
    s = resolve_parallel(Section(ep=2, dp=4), moe)
    assert (s.world, s.dp, s.edp) == (4, 4, 2)
    s = resolve_parallel(Section(tp=2, dp=2), dense)
    assert (s.world, s.dp, s.edp) == (4, 2, 2)  # etp defaults to tp
    s = resolve_parallel(Section(ep=2), moe)  # dp left out: the smallest that tiles (today's recipes)
    assert (s.world, s.dp, s.edp) == (2, 2, 1)
    s = resolve_parallel(Section(tp=2, ep=4, etp=1, dp=2), moe)  # ep x etp = 4 divides tp x dp = 4
    assert (s.world, s.edp) == (4, 1)
    with pytest.raises(ConfigError, match=r"tp=1 x pp=1 x dp=1 = 1 ranks do not tile the expert grid ep=2 x "
                                          r"etp=1 x pp=1"):
        resolve_parallel(Section(ep=2, dp=1), moe)
    with pytest.raises(ConfigError, match=r"tp=2 x pp=1 x dp=1 = 2 ranks do not tile the expert grid ep=4"):
        resolve_parallel(Section(tp=2, ep=4, etp=1, dp=1), moe)
    with pytest.raises(ConfigError, match=r"train.megatron.dp=0: must be >= 1"):
        resolve_parallel(Section(dp=0), dense)


def test_dealing_and_equal_rounds():
    from miles_lp.train.embedded import pack_sequences
    from miles_lp.train.megatron.data import deal, filler_pack, pad_pack, replica_rounds

    assert deal([64, 32, 96, 32], 2) == [[2, 3], [0, 1]]  # 96 + 32 | 64 + 32
    assert deal([10, 10, 10], 2) == [[0, 2], [1]]
    assert deal([], 3) == [[], [], []]
    a = pack_sequences([torch.arange(5), torch.arange(3)], [0, 1], 4)  # 8 tokens
    b = pack_sequences([torch.arange(20)], [2], 4)  # 20 tokens
    c = pack_sequences([torch.arange(9)], [3], 4)  # 12 tokens
    p = pad_pack(a, 16)
    assert p.tokens == 16 and p.offsets == a.offsets and p.lengths == a.lengths and p.indices == a.indices
    assert torch.equal(p.input_ids[:, :8], a.input_ids) and p.position_ids[0, 8:].tolist() == list(range(8))
    f = filler_pack(12)
    assert f.tokens == 12 and not f.lengths and not f.indices
    with pytest.raises(ValueError):
        pad_pack(b, 4)
    # deal: b (20) -> r0, c (12) -> r1, a (8) -> r1: r0 runs [b, filler], r1 [a, c], each round one length
    r0 = replica_rounds([a, b, c], 2, 0, equal=True)
    r1 = replica_rounds([a, b, c], 2, 1, equal=True)
    assert [x.indices for x in r0] == [[2], []] and [x.indices for x in r1] == [[0, 1], [3]]
    assert [x.tokens for x in r0] == [x.tokens for x in r1] == [20, 12]
    assert [x.tokens for x in replica_rounds([a, b, c], 2, 0, equal=False)] == [20]
    assert replica_rounds([a, b, c], 1, 0, equal=True) == [a, b, c]
