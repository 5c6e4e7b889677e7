"""Adapter: Megatron-Core's parallel linears with miles-lp's quantized GEMM (path (a), any GPU, any format).

Why an adapter: Megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` run their GEMM through the
overridable method ``_forward_impl``; the subclasses here override only that method (the tensor-parallel
communication around it stays Megatron's), and ``quant_layer_spec`` substitutes them in Megatron's own
local layer spec (no monkey-patching of library code). A layer without a plan entry, or with a BF16
entry, runs Megatron's original GEMM.

Plan entries: a Megatron weight name is described by the policy layout
(``decoder.layers.3.self_attention.linear_qkv.weight`` -> members q, k, v;
``...mlp.experts.local_experts.5.linear_fc1.weight`` -> gate and up of expert 5, after mapping the local
expert index to the global one under expert parallelism). All members of a fused weight must share one
format. NVFP4 under tensor parallelism: the weight's global amax is all-reduced (MAX) over the layer's
tensor-parallel group, so the global scale equals the unsharded tensor's (gate and up of fc1 included).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from miles_lp.errors import ConfigError
from miles_lp.train.gemm import quantized_linear
from miles_lp.train.grid import WeightGrid
from miles_lp.train.megatron.naming import qkv_row_indices, tp_amax_reduce
from miles_lp.train.operands import select_rows
from miles_lp.train.recipe import LinearRecipe


class QuantParallelMixin:
    """Shared state of the quantized parallel linears: recipe, per-step grid, canonical member names."""

    is_quantized_module = True
    recipe: LinearRecipe | None = None
    grid: WeightGrid | None = None
    members: tuple[str, ...] = ()
    export_rows: list[tuple[str, torch.Tensor]] | None = None  # canonical name -> row index into the weight
    ran_quantized = False  # set by a quantized forward (executed_quantized: C1, recorded, not read from the plan)

    def set_recipe(self, recipe: LinearRecipe | None, members: tuple[str, ...] = ()) -> None:
        self.recipe = recipe
        self.members = members
        self.grid = WeightGrid(recipe) if recipe is not None else None
        # a per-tensor global scale (the format's joint_global_scale): under TP, from the unsharded weight's amax
        if recipe is not None and recipe.scheme.joint_global_scale and self._tp_world() > 1:
            self.grid.amax_reduce = tp_amax_reduce(self.tp_group)

    def _tp_world(self) -> int:
        group = getattr(self, "tp_group", None)
        if group is None or not torch.distributed.is_initialized():
            return 1
        return torch.distributed.get_world_size(group)

    def _quant_forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False,
                            allreduce_dgrad=False, sequence_parallel=False, grad_output_buffer=None,
                            wgrad_deferral_limit=None, tp_group=None, **_unused):
        if gradient_accumulation_fusion:
            raise ConfigError("Megatron's gradient_accumulation_fusion writes wgrad into main_grad with fused "
                              "kernels that bypass QuantLinear; set gradient_accumulation_fusion=False")
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, group=tp_group)  # AG fwd, RS bwd
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)  # identity fwd, AR bwd
        if input.numel() == 0:
            # an expert that the router gave no token (SequentialMLP still calls it): nothing to quantize, an
            # empty output, a zero weight gradient
            return torch.nn.functional.linear(input, weight.to(input.dtype), bias)
        self.ran_quantized = True
        return quantized_linear(input, weight, self.recipe, bias, grid=self.grid)

    def executed_quantized(self) -> dict[str, str]:
        """``{canonical member: format}`` once a forward ran this GEMM quantized (empty before)."""
        if not self.ran_quantized or self.recipe is None:
            return {}
        return dict.fromkeys(self.members, self.recipe.format.value)

    def invalidate_grids(self) -> None:
        """Drop the cached grid: Megatron's optimizers write model params through ``.data`` (no version bump),
        so call ``miles_lp.train.quant_linear.invalidate_grids(model)`` after every optimizer step."""
        if self.grid is not None:
            self.grid.invalidate()

    def learner_weights(self) -> Iterator[tuple[str, Any]]:
        if self.grid is None:
            return
        if self._tp_world() > 1:
            raise ConfigError(f"learner_weights of a tensor-parallel Megatron layer ({self.members[0]}...) would yield "
                              "this rank's shard; export with miles_lp.train.megatron.export.megatron_export_weights("
                              "model, hf_config, tp_group=...), which all-gathers the shards first")
        q = self.grid.rowwise(self.weight)
        for name, rows in self.export_rows or [(self.members[0], None)]:
            yield name, q if rows is None else select_rows(q, rows)


class QuantColumnParallelLinear(QuantParallelMixin, ColumnParallelLinear):
    def _forward_impl(self, input, weight, *args, **kwargs):
        if self.recipe is None:
            return super()._forward_impl(input, weight, *args, **kwargs)
        return self._quant_forward_impl(input, weight, *args, **kwargs)


class QuantRowParallelLinear(QuantParallelMixin, RowParallelLinear):
    def _forward_impl(self, input, weight, *args, **kwargs):
        if self.recipe is None:
            return super()._forward_impl(input, weight, *args, **kwargs)
        return self._quant_forward_impl(input, weight, *args, **kwargs)


class TorchGatingTopKRouter(TopKRouter):
    """``TopKRouter`` whose gating GEMM is a plain ``F.linear`` (same math, router dtype honoured).

    Why: in megatron-core 0.15.3-0.16.1 ``RouterGatingLinearFunction`` tests ``te_general_gemm is not None``,
    a name that is only bound when Transformer Engine imports, so every MoE forward without TE raises
    ``NameError``. The router stays high precision (CONTRACT 7).
    """

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return torch.nn.functional.linear(input.to(dtype), self.weight.to(device=input.device, dtype=dtype), bias)


class MLADotProductAttention(DotProductAttention):
    """Megatron's local ``DotProductAttention`` for MLA: accepts (and checks) ``k_channels`` / ``v_channels``.

    Why: megatron-core 0.16.1's ``MLASelfAttention`` builds its core attention with ``k_channels=q_head_dim,
    v_channels=v_head_dim``, which only TE's attention accepts; the local class raises ``TypeError``. Its forward
    already handles a key head dim different from the value's (the scores GEMM infers it, the context is
    ``kv_channels * heads`` wide), so only the constructor differs: ``kv_channels`` must equal ``v_head_dim``.
    """

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None and v_channels != self.hidden_size_per_attention_head:
            raise ConfigError(f"MLA core attention: v_channels {v_channels} != kv_channels "
                              f"{self.hidden_size_per_attention_head}; build the config with kv_channels=v_head_dim")


_SWAP_QUANT = {ColumnParallelLinear: QuantColumnParallelLinear, RowParallelLinear: QuantRowParallelLinear}
_SWAP_ALWAYS = {TopKRouter: TorchGatingTopKRouter}
# MLASelfAttention accepts only the exact classes (``submodules.linear_q_down_proj in [Linear, TEColumnParallelLinear,
# ColumnParallelLinear]``) for its down projections: the spec keeps ColumnParallelLinear there and
# ``quantize_mla_down_projections`` gives the built modules the quantized class.
_KEEP_IN_SPEC = {"linear_q_down_proj", "linear_kv_down_proj"}


def quant_layer_spec(spec: Any, quantized: bool = True, norm: Any = None) -> Any:
    """A copy of a Megatron layer spec with miles-lp's classes substituted.

    ``quantized``: local parallel linears -> their quantized subclasses (MLA's down projections excepted, see
    ``quantize_mla_down_projections``). Always: ``TopKRouter`` -> ``TorchGatingTopKRouter``, and in MLA specs
    ``DotProductAttention`` -> ``MLADotProductAttention`` (see their docstrings). ``norm``: a class that replaces
    the local spec's ``WrappedTorchNorm`` (``parallel.SequenceParallelNorm`` under sequence parallelism).
    """
    if isinstance(spec, type):
        if norm is not None and spec is WrappedTorchNorm:
            return norm
        spec = _SWAP_ALWAYS.get(spec, spec)
        return _SWAP_QUANT.get(spec, spec) if quantized else spec
    if isinstance(spec, ModuleSpec):
        new = copy.copy(spec)
        new.module = quant_layer_spec(spec.module, quantized, norm)
        new.submodules = quant_layer_spec(spec.submodules, quantized, norm)
        return new
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        mla = type(spec).__name__ == "MLASelfAttentionSubmodules"
        keep = _KEEP_IN_SPEC if mla else set()
        new = dataclasses.replace(spec, **{f.name: quant_layer_spec(getattr(spec, f.name), quantized, norm)
                                           for f in dataclasses.fields(spec) if f.init and f.name not in keep})
        if mla and new.core_attention is DotProductAttention:
            new = dataclasses.replace(new, core_attention=MLADotProductAttention)
        return new
    if isinstance(spec, list | tuple):
        return type(spec)(quant_layer_spec(s, quantized, norm) for s in spec)
    return spec


@contextlib.contextmanager
def mla_without_te() -> Iterator[None]:
    """Let megatron-core 0.16.1 build ``MLASelfAttention`` where Transformer Engine is not installed.

    Why: without TE, ``megatron.core.extensions.transformer_engine`` still imports (``te = MagicMock()``), so
    ``multi_latent_attention`` sets ``HAVE_TE = True`` and ``TELinear`` is a mock; ``MultiLatentAttention.__init__``
    then evaluates ``isinstance(self.linear_proj, TELinear)`` and raises ``TypeError``. Only while the model is
    built, and only when ``TELinear`` is not a class, the module's ``HAVE_TE`` is set to its true value (False);
    construction reads it at that one place, forward does not read it.
    """
    from megatron.core.transformer import multi_latent_attention as mla

    if isinstance(getattr(mla, "TELinear", None), type) or not getattr(mla, "HAVE_TE", False):
        yield
        return
    saved = mla.HAVE_TE
    mla.HAVE_TE = False
    try:
        yield
    finally:
        mla.HAVE_TE = saved


class _GatherRopeGradSummed(torch.autograd.Function):
    """Megatron's ``gather_from_tensor_model_parallel_region`` (all-gather along the last dim; backward: this
    rank's slice) whose backward first SUMS the last ``rope`` columns of the gradient over the TP group."""

    @staticmethod
    def forward(ctx, x, group, rope: int):
        from megatron.core.tensor_parallel.mappings import _gather_along_last_dim

        ctx.group, ctx.rope = group, rope
        return _gather_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist
        from megatron.core.tensor_parallel.mappings import _split_along_last_dim

        grad = grad.clone()
        tail = grad[..., -ctx.rope:].contiguous()
        dist.all_reduce(tail, group=ctx.group)
        grad[..., -ctx.rope:] = tail
        return _split_along_last_dim(grad, ctx.group), None, None


@contextlib.contextmanager
def mla_rope_grad_over_tp(config: Any) -> Iterator[None]:
    """While a tensor-parallel MLA model runs forward: the kv down projection's TP gather sums the rope key's
    gradient over the TP group in its backward.

    Why: in megatron-core 0.16's MLA with a ``ColumnParallelLinear`` kv down projection (the local spec), the
    output ``[kv_compressed | k_pos_emb]`` is all-gathered over TP and ``k_pos_emb`` (the rope key, shared by every
    head) is used by this rank's heads only; the gather's backward hands each rank its column slice of the
    gradient, so the rope columns keep only the owning rank's heads' share (the compressed columns are complete:
    their consumer, the column-parallel up projection, reduces over TP). The TE path gathers ``k_pos_emb`` over
    the sequence instead, whose backward sums. Only the module-level name ``multi_latent_attention`` calls is
    swapped, and only for the kv gather (recognised by its width); restored on exit.
    """
    tp = int(getattr(config, "tensor_model_parallel_size", 1))
    if not getattr(config, "multi_latent_attention", False) or tp == 1:
        yield
        return
    from megatron.core.tensor_parallel.mappings import get_tensor_model_parallel_group_if_none
    from megatron.core.transformer import multi_latent_attention as mla

    rope = int(config.qk_pos_emb_head_dim)
    kv = int(config.kv_lora_rank) + rope
    if config.q_lora_rank is not None and int(config.q_lora_rank) == kv:
        raise ConfigError(f"tensor-parallel MLA with q_lora_rank == kv_lora_rank + qk_rope_head_dim ({kv}): the two "
                          "down projections' gathers cannot be told apart; run tp: 1")
    original = mla.gather_from_tensor_model_parallel_region

    def gather(x, group=None):
        if x.shape[-1] * tp == kv:
            return _GatherRopeGradSummed.apply(x, get_tensor_model_parallel_group_if_none(group), rope)
        return original(x, group)

    mla.gather_from_tensor_model_parallel_region = gather
    try:
        yield
    finally:
        mla.gather_from_tensor_model_parallel_region = original


def quantize_mla_down_projections(model: torch.nn.Module) -> int:
    """Give MLA's ``linear_q_down_proj`` / ``linear_kv_down_proj`` (built as plain ``ColumnParallelLinear``, see
    ``_KEEP_IN_SPEC``) the quantized class. The subclass adds methods and class attributes only (no ``__init__``
    state), so switching the instance's class is exact. Returns the number of modules switched."""
    n = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in _KEEP_IN_SPEC and type(module) is ColumnParallelLinear:
            module.__class__ = QuantColumnParallelLinear
            n += 1
    return n


def _global_expert_name(name: str, module: Any) -> str:
    """``local_experts.{l}`` -> ``local_experts.{global}`` under expert parallelism."""
    if ".local_experts." not in name:
        return name
    from megatron.core import parallel_state

    head, tail = name.split(".local_experts.", 1)
    local, rest = tail.split(".", 1)
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    per_rank = module.config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
    return f"{head}.local_experts.{ep_rank * per_rank + int(local)}.{rest}"


def qkv_rows(config: Any, members: tuple[str, ...]) -> list[tuple[str, torch.Tensor]]:
    """Row indices of q, k, v inside Megatron's interleaved ``linear_qkv`` (per query group: q heads, k, v)."""
    ng, nh, hn = config.num_query_groups, config.num_attention_heads, config.kv_channels
    rows = qkv_row_indices((nh + 2 * ng) * hn, ng, nh // ng * hn)
    return list(zip(members, rows, strict=True))


def attach_plan(model: torch.nn.Module, plan, layout, *, layer_offset: int = 0) -> dict[str, str]:
    """Give every quantized parallel linear of ``model`` its recipe from ``plan``. Returns name -> recipe text.

    ``layout`` is the policy layout of the HF model the Megatron model was built from; ``layer_offset``: the
    global index of this pipeline stage's first decoder layer (``model.stage_offset``).
    """
    from miles_lp.train.megatron.naming import layer_global

    report: dict[str, str] = {}
    holder: dict[str, Any] = {}  # canonical member -> the quantized module that runs it
    for name, module in model.named_modules():
        if not isinstance(module, QuantParallelMixin):
            continue
        pname = _global_expert_name(f"{name}.weight", module)
        while pname.startswith("module."):
            pname = pname[len("module."):]
        pname = layer_global(pname, layer_offset)
        members = layout.describe(pname).members
        entries = [plan.entries[m] for m in members if m in plan.entries]
        if len(entries) != len(members) or not entries:
            raise ConfigError(f"{pname}: the plan has no entry for {sorted(set(members) - set(plan.entries))}; "
                              "compile the plan for the HF model this Megatron model was built from")
        keys = {(e.format, e.backward, e.activation_scale, e.block_2d) for e in entries}
        if len(keys) != 1:
            raise ConfigError(f"{pname} fuses {list(members)}, which the plan gives different formats or "
                              "backward modes; one fused GEMM runs one format: make the rule agree")
        recipe = LinearRecipe.from_entry(entries[0], name=pname)
        module.set_recipe(recipe, tuple(members))
        if recipe is None:
            continue
        if len(members) == 3 and pname.endswith("linear_qkv.weight"):
            module.export_rows = qkv_rows(module.config, tuple(members))
        elif len(members) == 2:  # fc1 = [gate; up]
            half = module.weight.shape[0] // 2
            module.export_rows = [(members[0], torch.arange(0, half)), (members[1], torch.arange(half, 2 * half))]
        report[pname] = f"{recipe.format.value}/{recipe.backward.value}"
        for m in members:
            holder[m] = module
    # A joint-scale group spread over several Megatron linears (DeepSeek's q_a + kv_a: two column-parallel
    # linears, one NVFP4 global scale in the plan and in the engines' fused_qkv_a_proj_with_mqa): each grid folds
    # in the others' amax (then, under TP, the MAX over the group), as the embedded trainer's apply_plan does.
    for group in plan.groups.values():
        mods = list({id(holder[m]): holder[m] for m in group if m in holder}.values())
        if len(mods) > 1 and all(m.recipe.scheme.joint_global_scale for m in mods):
            for m in mods:
                m.grid.amax_partners = [o.weight for o in mods if o is not m]
    return report
