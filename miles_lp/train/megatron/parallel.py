"""Tensor / pipeline / data / expert parallelism for the Megatron learner: the sizes, the norm that supports
sequence parallelism, the gradient reductions Megatron's DDP would do, the global gradient norm, and the NVFP4
activation-partition rule.

    sizes = resolve_parallel(config.megatron, hf_config)    # tp, pp, dp, ep, etp, sequence_parallel, world
    finalize_grads(model, sizes)                             # after backward, before the norm / optimizer step
    norm = clip_grads(params, sizes, max_norm)               # the norm of the whole (unsharded) gradient

The grid is Megatron's: ``world = tp x pp x dp``; the expert grid is ``etp x ep x edp x pp`` over the same ranks,
so ``edp = world / (ep x etp x pp)`` (``initialize_model_parallel``'s rule); a layout that does not tile is
refused naming the sizes. ``dp`` left out (``None``) is the smallest data-parallel size that tiles both grids.

Data parallelism (``data.py``): every DP replica trains on its own share of each mini-batch's micro-batches, and
the loss functions normalise by the WHOLE mini-batch's totals (tokens, sequences). The step's gradient is then the
SUM of the replicas' gradients, which is Megatron DDP's ``calculate_per_token_loss`` semantics (gradient scaling
factor 1, the loss already divided by the global count). The rules that give the one-rank gradient:

* tensor-parallel shards (``tensor_model_parallel``): each rank's gradient is its shard's, nothing to reduce;
* sequence parallelism (``tp > 1``; Megatron's MoE layer refuses TP without it in training): a replicated
  parameter that sees only this rank's sequence slice (the norms, the router, the shared-expert gate: Megatron
  marks them ``sequence_parallel``) holds a partial gradient: SUM over the TP group (Megatron's
  ``finalize_model_grads``). The q/k layernorms (Qwen3) see this rank's heads only: SUM over TP whatever SP says;
* dense parameters: SUM over the DP group; expert parameters: SUM over the expert-DP group (an expert under EP
  already received, through the all-gather dispatcher, the tokens of every rank of its tp x ep group);
* pipeline stages hold disjoint layers: nothing to reduce between them (tied embeddings are refused at pp > 1).

Sequence parallelism and the norm: megatron-core 0.16's local spec uses ``WrappedTorchNorm``, which asserts
``not sequence_parallel``; Megatron's own SP-capable norms are TE's ``TENorm`` and Apex's ``FusedLayerNorm``, neither
installed here. ``SequenceParallelNorm`` builds the same ``torch.nn.RMSNorm`` (the same math as the TP-1 model) and
marks its weight ``sequence_parallel`` as those do, so ``finalize_grads`` reduces it.

NVFP4 per-token activation scales and the partition (CONTRACT 2: "computed on the same partition on both sides"):
the per-token global amax of a GEMM's input is taken over the K columns the rank holds. Column-parallel GEMMs
(q/k/v, gate/up, every expert's fc1) see the whole hidden (all-gathered input): any partition gives the same
scale. Row-parallel GEMMs see a 1/p slice of K: p = TP for o_proj / a dense or shared-expert down_proj, p = the
expert-tensor-parallel size (ETP) for a routed expert's down_proj. The rule: the learner's p for such a GEMM must
be the engine's (its TP, its MoE TP for experts), so ``check_activation_partition`` refuses a plan whose NVFP4
per-token row-parallel GEMMs would be quantized on another partition than the engine's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from miles_lp.errors import ConfigError
from miles_lp.train.megatron.hf_config import MLA_TYPES, expert_count
from miles_lp.train.megatron.hf_config import config_value as _get


@dataclasses.dataclass(frozen=True)
class ParallelSizes:
    tp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    pp: int = 1
    #: data-parallel size; None: the smallest that tiles both grids (``lcm(tp, ep * etp) / tp``)
    dp_size: int | None = None
    #: Megatron's uneven pipeline stages (None: the layers split evenly over the stages)
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    @property
    def dp(self) -> int:
        if self.dp_size is not None:
            return self.dp_size
        return math.lcm(self.tp, self.ep * self.etp) // self.tp

    @property
    def world(self) -> int:
        """Ranks the group runs: ``tp x pp x dp`` (Megatron's rule)."""
        return self.tp * self.pp * self.dp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: ``world / (ep x etp x pp)``."""
        return self.world // (self.ep * self.etp * self.pp)

    def describe(self) -> str:
        return (f"tp={self.tp} pp={self.pp} dp={self.dp} ep={self.ep} etp={self.etp} (world {self.world}, "
                f"expert-dp {self.edp})")


def stage_layers(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[range]:
    """The global decoder-layer indices each pipeline stage holds (Megatron's ``get_transformer_layer_offset`` /
    ``get_num_layers_to_build`` rule without virtual stages), or ``ConfigError`` naming the sizes."""
    where = "train.megatron"
    if pp == 1:
        if first is not None or last is not None:
            raise ConfigError(f"{where}: first/last_stage_layers need pp > 1 (pp=1)")
        return [range(num_layers)]
    for key, v in (("first_stage_layers", first), ("last_stage_layers", last)):
        if v is not None and v < 1:
            raise ConfigError(f"{where}.{key}={v}: must be >= 1")
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_layers < 0 or (middle_stages == 0 and middle_layers != 0) or (
            middle_stages > 0 and (middle_layers <= 0 or middle_layers % middle_stages)):
        raise ConfigError(f"{where}: pp={pp} with first_stage_layers={first} last_stage_layers={last} does not split "
                          f"the {num_layers} decoder layers (the layers between the first and last stage must fill "
                          f"the {middle_stages} middle stage(s) evenly, at least one each)")
    per = middle_layers // middle_stages if middle_stages else 0
    sizes = [per] * pp
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    out, o = [], 0
    for n in sizes:
        out.append(range(o, o + n))
        o += n
    return out


def resolve_parallel(section: Any, hf_config: Any) -> ParallelSizes:
    """``train.megatron`` -> the sizes the learner runs, or ``ConfigError`` naming the key.

    ``etp: null`` is Megatron's default (= tp). Sequence parallelism is switched on for an MoE model at tp > 1
    (Megatron's MoE layer refuses TP without it in training); a dense model uses it when asked.
    """
    tp, ep, pp = int(section.tp), int(section.ep), int(section.pp)
    etp = tp if section.etp is None else int(section.etp)
    dp = _get(section, "dp")
    dp = None if dp is None else int(dp)
    first, last = _get(section, "first_stage_layers"), _get(section, "last_stage_layers")
    where = "train.megatron"
    if dp is not None and dp < 1:
        raise ConfigError(f"{where}.dp={dp}: must be >= 1 (or null: the smallest that tiles the expert grid)")
    if dp is not None and (tp * pp * dp) % (ep * etp * pp):
        raise ConfigError(f"{where}: tp={tp} x pp={pp} x dp={dp} = {tp * pp * dp} ranks do not tile the expert grid "
                          f"ep={ep} x etp={etp} x pp={pp} (world / (ep x etp x pp) must be whole); choose dp so that "
                          f"ep x etp = {ep * etp} divides tp x dp = {tp * dp}")
    if section.impl != "local":
        raise ConfigError(f"{where}.impl={section.impl}: only the local path (miles-lp GEMMs in Megatron's linears) "
                          "runs here; the Transformer Engine path needs Blackwell + TE")
    n_exp = expert_count(hf_config)
    if not n_exp and (ep != 1 or section.etp not in (None, tp)):
        raise ConfigError(f"{where}: ep={ep} etp={section.etp} on a dense model ({_get(hf_config, 'model_type')}); "
                          "set ep: 1 and etp: null")
    if pp > 1:
        if _get(hf_config, "tie_word_embeddings", False):
            raise ConfigError(f"{where}.pp={pp}: tied input / output embeddings across pipeline stages are not "
                              "mapped here (the last stage would need its own copy and an embedding-group "
                              "all-reduce); run pp: 1 for this model")
        stage_layers(int(_get(hf_config, "num_hidden_layers")), pp, first, last)
    elif first is not None or last is not None:
        raise ConfigError(f"{where}: first_stage_layers / last_stage_layers need pp > 1")
    if tp > 1 or ep > 1 or etp > 1:
        mt = _get(hf_config, "model_type")
        if mt in MLA_TYPES and tp > 1:
            # Megatron's local MLA: the q / kv down projections are column-parallel (outputs all-gathered over TP,
            # then scattered back to the sequence slices under SP); the rope key's gradient is summed over TP by
            # layers.mla_rope_grad_over_tp (the learner's forward)
            for what, n in (("q_lora_rank", _get(hf_config, "q_lora_rank")),
                            ("kv_lora_rank + qk_rope_head_dim", int(_get(hf_config, "kv_lora_rank"))
                             + int(_get(hf_config, "qk_rope_head_dim")))):
                if n is not None and int(n) % tp:
                    raise ConfigError(f"{where}.tp={tp} does not divide {what}={n} (MLA's column-parallel down "
                                      "projections)")
        heads = int(_get(hf_config, "num_attention_heads"))
        groups = int(_get(hf_config, "num_key_value_heads") or heads)
        for what, n, p in (("num_attention_heads", heads, tp), ("num_key_value_heads", groups, tp),
                           ("vocab_size", int(_get(hf_config, "vocab_size")), tp),
                           ("intermediate_size", int(_get(hf_config, "intermediate_size")), tp)):
            if n % p:
                raise ConfigError(f"{where}.tp={tp} does not divide {what}={n}")
        if n_exp:
            if n_exp % ep:
                raise ConfigError(f"{where}.ep={ep} does not divide the {n_exp} experts")
            inter = int(_get(hf_config, "moe_intermediate_size") or _get(hf_config, "intermediate_size"))
            if inter % etp:
                raise ConfigError(f"{where}.etp={etp} does not divide moe_intermediate_size={inter}")
    sp = bool(section.sequence_parallel) or (bool(n_exp) and tp > 1)
    return ParallelSizes(tp=tp, ep=ep, etp=etp, sequence_parallel=sp, pp=pp, dp_size=dp,
                         first_stage_layers=None if first is None else int(first),
                         last_stage_layers=None if last is None else int(last))


# ---------------------------------------------------------------------------------------------------------
# The norm
# ---------------------------------------------------------------------------------------------------------


class SequenceParallelNorm:
    """``WrappedTorchNorm`` without its ``not sequence_parallel`` assertion: the same ``torch.nn.RMSNorm`` /
    ``LayerNorm``, its weight (and bias) marked ``sequence_parallel`` as TE's ``TENorm`` and Apex's
    ``FusedLayerNorm`` mark theirs, so ``finalize_grads`` sums the partial gradients over the TP group."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        if config.layernorm_zero_centered_gamma or config.persist_layer_norm or config.memory_efficient_layer_norm:
            raise ConfigError("SequenceParallelNorm: zero-centred gamma, persist_layer_norm and memory-efficient "
                              "norms are not supported (the local torch norm has none of them)")
        norm_cls = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}.get(config.normalization)
        if norm_cls is None:
            raise ConfigError(f"SequenceParallelNorm: normalization {config.normalization!r} (RMSNorm or LayerNorm)")
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


# ---------------------------------------------------------------------------------------------------------
# Gradient reductions, norm, clipping
# ---------------------------------------------------------------------------------------------------------


def is_expert_param(name: str) -> bool:
    return ".experts." in name


def _tp_partial(name: str, p: torch.Tensor, sizes: ParallelSizes) -> bool:
    """A replicated (not TP-sharded) parameter whose gradient on each TP rank is a partial sum."""
    if sizes.tp == 1 or is_expert_param(name):
        return False
    if getattr(p, "sequence_parallel", False):
        return True
    return name.endswith(("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"))


def _groups():
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_group(), "dp": ps.get_data_parallel_group(),
            "edp": ps.get_expert_data_parallel_group()}


def finalize_grads(model: torch.nn.Module, sizes: ParallelSizes) -> None:
    """Megatron's gradient reductions when each DP replica ran its own share of the mini-batch and the losses
    were normalised by the whole mini-batch's totals (module docstring): sums, no 1/dp."""
    if sizes.world == 1:
        return
    import torch.distributed as dist

    g = _groups()
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if _tp_partial(name, p, sizes):
            dist.all_reduce(p.grad, group=g["tp"])
        if is_expert_param(name):
            if sizes.edp > 1:
                dist.all_reduce(p.grad, group=g["edp"])
        elif sizes.dp > 1:
            dist.all_reduce(p.grad, group=g["dp"])


def sharded_params(model: torch.nn.Module) -> set[str]:
    """Names of the parameters split over a tensor-parallel group: the weights of Megatron's column / row
    parallel linears and vocab-parallel embedding, and a column-parallel bias. (Megatron marks them
    ``tensor_model_parallel`` only in its init functions, which ``perform_initialization=False`` skips.)"""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    out = set()
    for mname, module in model.named_modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding):
            for pname, _ in module.named_parameters(recurse=False):
                if pname == "weight" or (pname == "bias" and isinstance(module, ColumnParallelLinear)):
                    out.add(f"{mname}.{pname}" if mname else pname)
    return out


def _copies(name: str, sharded: bool, sizes: ParallelSizes) -> int:
    """How many ranks hold this very gradient (so the global norm counts it once): the ranks of its pipeline
    stage (``world / pp``) over the distinct shards among them."""
    if is_expert_param(name):
        distinct = sizes.ep * (sizes.etp if sharded else 1)
    else:
        distinct = sizes.tp if sharded else 1
    return sizes.world // (sizes.pp * distinct)


def clip_grads(model: torch.nn.Module, sizes: ParallelSizes, max_norm: float | None) -> float:
    """The L2 norm of the whole model's gradient (each distinct shard once, all-reduced over the world), then
    ``torch.nn.utils.clip_grad_norm_``'s scaling (``max_norm / (norm + 1e-6)``, at most 1). Same value on every
    rank."""
    import torch.distributed as dist

    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    if not named:
        return 0.0
    sharded = sharded_params(model)
    dev = named[0][1].grad.device
    sq = torch.zeros((), dtype=torch.float32, device=dev)
    for name, p in named:
        sq += p.grad.detach().float().pow(2).sum() / _copies(name, name in sharded, sizes)
    if sizes.world > 1:
        dist.all_reduce(sq)
    norm = sq.sqrt()
    if max_norm is not None:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for _, p in named:
            p.grad.detach().mul_(coef.to(p.grad.dtype))
    return float(norm)


# ---------------------------------------------------------------------------------------------------------
# NVFP4 per-token activation scales: the partition rule
# ---------------------------------------------------------------------------------------------------------


_ROW_PARALLEL = ("self_attn.o_proj.weight", ".down_proj.weight")


def activation_partition(name: str, *, tp: int, etp: int) -> int:
    """Into how many K slices the input of the GEMM of HF weight ``name`` is cut on a rank (1: the whole K)."""
    if not name.endswith(_ROW_PARALLEL):
        return 1  # column-parallel: the input is the whole hidden (all-gathered)
    return etp if ".experts." in name and ".shared_expert" not in name else tp


def check_activation_partition(plan, *, tp: int, etp: int, engine_tp: int = 1, engine_etp: int | None = None
                               ) -> None:
    """Refuse NVFP4 GEMMs whose activation global scale (per token, or per tensor) would be computed on another
    K partition than the engine's.

    ``engine_tp`` / ``engine_etp``: the engine's tensor-parallel and MoE tensor-parallel sizes (the reference
    engine: 1 / 1; ``engine_etp`` None: = engine_tp, SGLang's and vLLM's default without expert parallelism).
    """
    if plan is None:
        return
    from miles_lp.formats.spec import Format

    engine_etp = engine_tp if engine_etp is None else engine_etp
    bad = []
    for name, entry in plan.quantized().items():
        if entry.format is not Format.NVFP4:  # per-token (the RL recipe) or per-tensor: both take an amax over K
            continue
        mine = activation_partition(name, tp=tp, etp=etp)
        theirs = activation_partition(name, tp=engine_tp, etp=engine_etp)
        if mine != theirs:
            bad.append((name, mine, theirs))
    if bad:
        n, mine, theirs = bad[0]
        raise ConfigError(
            f"NVFP4 per-token activation scales: {len(bad)} row-parallel GEMM(s), e.g. {n}, would compute each "
            f"token's amax over 1/{mine} of K on the learner and over 1/{theirs} on the engine (learner tp={tp} "
            f"etp={etp}, engine tp={engine_tp} etp={engine_etp}); the scale must come from the same partition "
            "(CONTRACT 2): set train.megatron.etp (experts) / tp (dense) to the engine's, or tell the learner the "
            "engine's sizes")
