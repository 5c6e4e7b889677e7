"""The Megatron learner under pipeline parallelism (``train.megatron.pp``) through Megatron-Core's own 1F1B schedule
(``get_forward_backward_func``), on gloo CPU ranks, against the one-rank ``MegatronLearner``: same checkpoint,
plan, mini-batch and loss; log-probs, one optimizer step (loss, grad norm), the gathered masters and the export
after it (every stage's tensors gathered under HF names, in the one-rank order).

Tolerances as in ``test_train_megatron_dp`` (and why): a stage runs the same layers on the same packed rows, so
log-probs are equal bit for bit; gradients differ at most by fp32 summation order (none here: each stage's
parameters accumulate their micro-batches in the same order; the grad norm's squares are all-reduced over the
stages instead of summed on one rank: 1e-6 relative); the export as ``assert_equal_to_one_rank`` states.

Measured here (2026-12-02, torch 2.13 CPU, megatron-core 0.16.1, 4-layer tiny models, lr 1e-3, grad clip 1): qwen3
MXFP8 pp 2 and pp 2 with an uneven first stage (1 + 3 layers) x dp 2: log-probs 0.0, loss equal, grad norm
relative difference <= 1e-7, export byte-equal; the DeepSeek-shaped tiny model (MLA with q/kv LoRA, a dense first
layer, shared + routed experts with the sigmoid router and its expert bias) at pp 2: log-probs 0.0, loss equal,
grad norm 3.9e-7 relative, every quantized grid byte-equal, the three routers' BF16 weights within one BF16 step
(16-19 of 256 elements each, by <= 1.9e-9: near-eps gradients under a clipping coefficient that moved with the
norm). Multi-token
prediction is not built by the Megatron learner (``model.hf_to_megatron`` skips DeepSeek's MTP layers; the tiny
DeepSeek checkpoint has none), so it is not part of this rehearsal.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

mc = pytest.importorskip("megatron.core", reason="megatron-core not installed (extra 'megatron')")

from test_train_megatron_dp import CFG, Section, assert_equal_to_one_rank, components, seqs  # noqa: E402

from miles_lp.errors import ConfigError  # noqa: E402
from miles_lp.train.config import TrainConfig  # noqa: E402
from miles_lp.train.embedded import nll_loss, plan_for_model  # noqa: E402


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

    root = tmp_path_factory.mktemp("megpp")
    return {a: make_tiny_model(a, root / a, num_layers=4) for a in ("qwen3", "deepseek_v3")}


def plan_for(d, fmt="mxfp8"):
    from miles_lp.cli.convert import policy_for_format

    return plan_for_model(policy_for_format(fmt), d)


def owned(learner):
    """What a weight sync reads on each rank: its stage's owned export, whether it owns, its stage offset (each
    component as dtype, shape and its bytes: float8 storages do not cross a pickle)."""
    def raw(t):
        return (t.dtype, tuple(t.shape), t.detach().contiguous().reshape(-1).view(torch.uint8).clone())

    return {"owner": learner.export_owner(), "offset": learner.layer_offset,
            "tensors": [(n, {k: raw(t) for k, t in components(v).items()}) for n, v in learner.export_owned()]}


def run(learner, with_owned: bool = False) -> dict:
    try:
        lp = learner.logprobs(seqs())[0]
        stats = learner.train_step([{"tokens": s} for s in seqs()], nll_loss)
        masters = {k: v.cpu() for k, v in learner.gathered_masters().items()}
        export = dict(learner.export_weights())
        per_rank = learner.run_on_ranks(owned) if with_owned else None
    finally:
        learner.close()
    return {"lp": lp, "stats": stats, "masters": masters, "export": export, "owned": per_rank}


def one_rank(d, plan) -> dict:
    from miles_lp.train.megatron.learner import MegatronLearner

    return run(MegatronLearner(d, plan, CFG))


def group(d, plan, config, **kw) -> dict:
    from miles_lp.train.megatron.group import MegatronGroup

    return run(MegatronGroup(d, plan, config), **kw)


@pytest.mark.slow  # 2 ranks and a one-rank learner: ~45 s on 2 cores
def test_pp2_equals_one_rank_and_each_stage_owns_its_layers(ckpts):
    d = ckpts["qwen3"]
    plan = plan_for(d)
    got = group(d, plan, cfg(pp=2), with_owned=True)
    assert_equal_to_one_rank(got, one_rank(d, plan))
    # the sync's view: rank 0 owns stage 0 (embedding, layers 0-1), rank 1 stage 1 (layers 2-3, norm, lm_head);
    # together every exported tensor once, the same bytes
    r0, r1 = got["owned"]
    assert (r0["owner"], r0["offset"], r1["owner"], r1["offset"]) == (True, 0, True, 2)
    names0, names1 = [n for n, _ in r0["tensors"]], [n for n, _ in r1["tensors"]]
    assert "model.embed_tokens.weight" in names0 and "model.layers.1.mlp.down_proj.weight" in names0
    assert "lm_head.weight" in names1 and "model.norm.weight" in names1 and "model.layers.2.self_attn.q_proj.weight" \
        in names1 and not any(n.startswith(("model.layers.0.", "model.layers.1.")) for n in names1)
    assert sorted(names0 + names1) == sorted(got["export"])
    for n, comps in r0["tensors"] + r1["tensors"]:
        ref = components(got["export"][n])
        assert ref.keys() == comps.keys(), n
        for k, t in ref.items():
            dtype, shape, data = comps[k]
            assert (dtype, shape) == (t.dtype, tuple(t.shape)) and torch.equal(
                data, t.contiguous().reshape(-1).view(torch.uint8)), (n, k)


@pytest.mark.slow  # 4 ranks and a one-rank learner: ~80 s on 2 cores
def test_uneven_pp2_x_dp2_equals_one_rank(ckpts):
    """Megatron's uneven first stage (1 layer, then 3) and two data-parallel pipelines."""
    d = ckpts["qwen3"]
    plan = plan_for(d)
    got = group(d, plan, cfg(pp=2, dp=2, first_stage_layers=1), with_owned=True)
    assert_equal_to_one_rank(got, one_rank(d, plan))
    # Megatron's rank order (tp, dp, then pp): ranks 0-1 stage 0 (dp 0, 1), ranks 2-3 stage 1; one owner each
    assert [(r["owner"], r["offset"]) for r in got["owned"]] == [(True, 0), (False, 0), (True, 1), (False, 1)]
    assert [len(r["tensors"]) > 0 for r in got["owned"]] == [True, False, True, False]


@pytest.mark.slow  # 2 ranks and a one-rank learner: ~60 s on 2 cores
def test_deepseek_shaped_pp2_equals_one_rank(ckpts):
    """MLA (q / kv LoRA), a dense first layer, shared + routed experts (sigmoid router, expert bias) at pp 2."""
    d = ckpts["deepseek_v3"]
    plan = plan_for(d)
    got = group(d, plan, cfg(pp=2))
    assert_equal_to_one_rank(got, one_rank(d, plan))
    assert any(".self_attn.kv_a_proj_with_mqa." in n for n in got["export"])
    assert any(".mlp.shared_experts." in n for n in got["export"])


@pytest.mark.slow  # 2 ranks and a one-rank learner: ~60 s on 2 cores
def test_deepseek_shaped_ep2_equals_one_rank(ckpts):
    """The same model with its routed experts over ep 2 (expert-dp 1, dp 2): MLA under expert parallelism."""
    d = ckpts["deepseek_v3"]
    plan = plan_for(d)
    assert_equal_to_one_rank(group(d, plan, cfg(ep=2)), one_rank(d, plan))


@pytest.mark.slow  # 2 ranks and a one-rank learner: ~60 s on 2 cores
def test_deepseek_shaped_tp2_equals_one_rank(ckpts):
    """Tensor-parallel MLA (tp 2, sequence parallel). Without ``layers.mla_rope_grad_over_tp`` (the rope key's
    gradient summed over TP) this measured log-probs still equal, but the grad norm 1.3e-5 relative off and
    kv_a_proj's MXFP8 grid after the step differing in 454 of 6144 codes; with it: the tolerances above, the
    masters within TP's 1e-4 (3.7e-6 measured: the row-parallel GEMMs sum K in two halves)."""
    d = ckpts["deepseek_v3"]
    plan = plan_for(d)
    assert_equal_to_one_rank(group(d, plan, cfg(tp=2)), one_rank(d, plan), master_atol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# no processes: the stage split and the refusals
# ---------------------------------------------------------------------------------------------------------


def test_stage_layers_follow_megatron_and_refuse_what_does_not_split():
    from miles_lp.checkpoint.tiny import tiny_config
    from miles_lp.train.megatron.parallel import resolve_parallel, stage_layers

    assert stage_layers(4, 1) == [range(4)]
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(4, 2, first=1) == [range(0, 1), range(1, 4)]
    assert stage_layers(5, 3, first=1, last=2) == [range(0, 1), range(1, 3), range(3, 5)]
    assert stage_layers(61, 8, first=5, last=2) == [range(0, 5)] + [range(5 + 9 * i, 14 + 9 * i) for i in range(6)] \
        + [range(59, 61)]  # DeepSeek-V3's 61 layers on 8 stages
    for args, msg in (((4, 3), "does not split the 4 decoder layers"), ((4, 2, 4), "does not split"),
                      ((4, 2, 0), "first_stage_layers=0: must be >= 1"), ((4, 1, 1), "need pp > 1")):
        with pytest.raises(ConfigError, match=msg):
            stage_layers(*args)
    tied = tiny_config("qwen3")
    tied.tie_word_embeddings = True
    with pytest.raises(ConfigError, match="tied input / output embeddings across pipeline stages"):
        resolve_parallel(Section(pp=2), tied)
    with pytest.raises(ConfigError, match="first_stage_layers / last_stage_layers need pp > 1"):
        resolve_parallel(Section(first_stage_layers=1), tiny_config("qwen3"))
    s = resolve_parallel(Section(pp=2, dp=2), tiny_config("deepseek_v3"))  # MLA under PP / DP: no TP mapping
    assert (s.world, s.pp, s.dp, s.edp) == (4, 2, 2, 2)


def test_stage_offsets_match_megatron():
    """``stage_layers`` is Megatron's ``get_transformer_layer_offset`` / ``get_num_layers_to_build``."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from miles_lp.train.megatron.parallel import stage_layers

    for n, pp, first, last in ((4, 2, None, None), (4, 2, 1, None), (5, 3, 1, 2), (7, 3, None, 3), (61, 8, 5, 2)):
        c = TransformerConfig(num_layers=n, hidden_size=8, num_attention_heads=1, pipeline_model_parallel_size=pp,
                              pipeline_dtype=torch.float32, num_layers_in_first_pipeline_stage=first,
                              num_layers_in_last_pipeline_stage=last)
        want = [range(get_transformer_layer_offset(c, pp_rank=r),
                      get_transformer_layer_offset(c, pp_rank=r) + get_num_layers_to_build(c, pp_rank=r))
                for r in range(pp)]
        assert stage_layers(n, pp, first, last) == want, (n, pp, first, last)
