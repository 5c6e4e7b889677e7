"""Quantized modules for the learner (drop-ins that keep parameter names) and the walkers over a model.

* ``QuantLinear``: an ``nn.Linear`` whose GEMM runs on the plan's grid (``miles_lp.train.gemm``);
* ``QuantExperts``: transformers-5 fused experts (``[E, N, K]``), one grid for all experts of a projection;
* ``learner_weights(model)``: the one walker over quantized modules (embedded and Megatron: any module that
  sets ``is_quantized_module``) yielding ``(canonical name, forward grid)``; ``executed_quantized(model)``: what
  the forwards ran quantized (C1); ``invalidate_grids`` / ``invalidate_on_step``: drop the per-step grids.

The pieces: ``miles_lp.train.recipe`` (``LinearRecipe``), ``.operands`` (operand quantizers, quantized-tensor
views), ``.grid`` (``WeightGrid``: the per-step cache), ``.gemm`` (the autograd GEMM, ``quantized_linear``).
``learner_weights`` yields the grid cache, so weight export reads the very bytes the forward used.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from miles_lp.errors import ConfigError
from miles_lp.train.gemm import FUNCTION_APPLY, QuantLinearFn, functorch_active, quantized_linear
from miles_lp.train.grid import WeightGrid
from miles_lp.train.operands import select_expert, select_expert_rows, select_experts
from miles_lp.train.recipe import LinearRecipe

__all__ = ["LinearRecipe", "QuantExperts", "QuantLinear", "WeightGrid", "executed_quantized", "invalidate_grids",
           "invalidate_on_step", "learner_weights", "quantized_linear", "share_input_caches"]


class QuantLinear(torch.nn.Module):
    """A drop-in ``nn.Linear`` whose GEMM runs on the plan's grid. Keeps ``weight`` / ``bias`` names.

    ``canonical`` is the canonical HF name of the weight (what ``learner_weights`` yields).
    """

    is_quantized_module = True  # learner_weights(model) collects modules that set this
    ran_quantized = False  # set by forward: the C1 record (executed_quantized), not read from the plan

    def __init__(self, in_features: int, out_features: int, recipe: LinearRecipe, *, bias: bool = False,
                 canonical: str | None = None, kernel: str = "auto", device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        self.recipe = recipe
        self.canonical = canonical or recipe.name
        self.grid = WeightGrid(recipe, kernel=kernel)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, recipe: LinearRecipe, canonical: str | None = None,
                    *, kernel: str = "auto") -> QuantLinear:
        """Wrap an existing ``nn.Linear``, sharing (not copying) its parameters.

        ``kernel``: ``auto`` | ``reference`` | ``compiled`` (see ``WeightGrid``).
        """
        q = cls.__new__(cls)
        torch.nn.Module.__init__(q)
        q.in_features, q.out_features = linear.in_features, linear.out_features
        q.weight = linear.weight
        q.bias = linear.bias
        q.recipe = recipe
        q.canonical = canonical or recipe.name
        q.grid = WeightGrid(recipe, kernel=kernel)
        return q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.ran_quantized:  # (nn.Module.__setattr__ costs ~5-10 us per call: set it once)
            self.ran_quantized = True
        p = self._parameters  # (what self.weight / self.bias read, without nn.Module.__getattr__ per call)
        w = p["weight"] if "weight" in p else self.weight
        b = p["bias"] if "bias" in p else self.bias
        return quantized_linear(x, w, self.recipe, b, grid=self.grid)

    def executed_quantized(self) -> dict[str, str]:
        """``{canonical: format}`` once a forward ran this GEMM quantized (empty before)."""
        return {self.canonical: self.recipe.format.value} if self.ran_quantized else {}

    def invalidate_grids(self) -> None:
        self.grid.invalidate()

    def learner_weights(self) -> Iterator[tuple[str, Any]]:
        yield self.canonical, self.grid.rowwise(self.weight)

    def extra_repr(self) -> str:
        r = self.recipe
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={r.format.value}, backward={r.backward.value}"
                + (f", activation_scale={r.activation_scale}" if r.activation_scale else ""))


#: sibling linears that read one input tensor, by leaf name (as ``rollout.layers.SIBLINGS``)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"))


def share_input_caches(model: torch.nn.Module) -> int:
    """Give each group of sibling ``QuantLinear`` (same parent, names in ``SIBLINGS``) one ``gemm.InputCache``: the
    reference path quantizes their common input once (the same bytes). Returns the number of groups."""
    from miles_lp.train.gemm import InputCache

    n = 0
    for _, parent in model.named_modules():
        for group in SIBLINGS:
            mods = [m for m in (getattr(parent, g, None) for g in group) if isinstance(m, QuantLinear)]
            if len(mods) > 1:
                cache = InputCache()
                for m in mods:
                    m.grid.input_cache = cache
                n += 1
    return n


class QuantExperts(torch.nn.Module):
    """Drop-in for transformers-5 fused experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``).

    Same parameter names and forward signature ``(hidden_states, top_k_index, top_k_weights)`` as the
    eager implementation of Qwen3-MoE / Qwen2-MoE / Mixtral / DeepSeek-V3 in transformers 5. Each
    projection is quantized for all experts at once (NVFP4: one global scale per expert matrix, so gate
    and up of an expert share it); every expert's GEMM is a ``quantized_linear`` on its slice of the grid.
    ``gate_up_members`` / ``down_members`` are the canonical names (``(e0.gate, e0.up, e1.gate, ...)`` and
    ``(e0.down, e1.down, ...)``, as ``ModelLayout.describe(...).members`` lists them).
    """

    is_quantized_module = True

    def __init__(self, experts: torch.nn.Module, gate_up: LinearRecipe | None, down: LinearRecipe | None,
                 gate_up_members: Sequence[str], down_members: Sequence[str]):
        super().__init__()
        self.num_experts = experts.gate_up_proj.shape[0]
        self.gate_up_proj = experts.gate_up_proj
        self.down_proj = experts.down_proj
        self.act_fn = experts.act_fn
        self.gate_up_recipe, self.down_recipe = gate_up, down
        self.gate_up_grid = WeightGrid(gate_up) if gate_up else None
        self.down_grid = WeightGrid(down) if down else None
        if len(gate_up_members) != 2 * self.num_experts or len(down_members) != self.num_experts:
            raise ConfigError(f"QuantExperts: expected {2 * self.num_experts} gate/up and {self.num_experts} "
                              f"down member names, got {len(gate_up_members)} and {len(down_members)}")
        self.gate_up_members, self.down_members = tuple(gate_up_members), tuple(down_members)
        self.ran_gate_up = self.ran_down = False  # set by forward (executed_quantized)
        if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False) or not getattr(
                experts, "has_gate", True) or not getattr(experts, "is_concatenated", True) or getattr(
                experts, "has_post_expert_norm", False):
            raise ConfigError(f"QuantExperts: unsupported experts module {type(experts).__name__} (transposed, "
                              "biased, gateless, post-expert-normed or interleaved gate/up weights); keep its "
                              "experts bf16 in the policy or use the Megatron backend")
        # The architecture's own gating (transformers-5 ``_apply_gate``: act(gate) * up for every supported
        # MoE), so an architecture that overrides it keeps its semantics.
        self._apply_gate = getattr(experts, "_apply_gate", None)

    def _proj(self, x: torch.Tensor, weight: torch.Tensor, e: int, recipe, grid) -> torch.Tensor:
        if recipe is None:
            return F.linear(x, weight[e].to(x.dtype))
        if grid is self.gate_up_grid:
            self.ran_gate_up = True
        else:
            self.ran_down = True
        return _expert_linear(x, weight, e, grid)

    def executed_quantized(self) -> dict[str, str]:
        """``{canonical: format}`` of the projections a forward ran quantized. All experts of a projection at
        once: one grid quantizes every expert matrix, whichever experts the tokens were routed to."""
        out: dict[str, str] = {}
        for ran, recipe, members in ((self.ran_gate_up, self.gate_up_recipe, self.gate_up_members),
                                     (self.ran_down, self.down_recipe, self.down_members)):
            if ran and recipe is not None:
                out.update(dict.fromkeys(members, recipe.format.value))
        return out

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            if e == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[e])
            state = hidden_states[token_idx]
            gate_up = self._proj(state, self.gate_up_proj, e, self.gate_up_recipe, self.gate_up_grid)
            if self._apply_gate is not None:
                h = self._apply_gate(gate_up)
            else:
                gate, up = gate_up.chunk(2, -1)
                h = self.act_fn(gate) * up
            h = self._proj(h, self.down_proj, e, self.down_recipe, self.down_grid)
            h = h * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, h.to(final.dtype))
        return final

    def invalidate_grids(self) -> None:
        for grid in (self.gate_up_grid, self.down_grid):
            if grid is not None:
                grid.invalidate()

    def learner_weights(self) -> Iterator[tuple[str, Any]]:
        if self.gate_up_grid is not None:
            q = self.gate_up_grid.rowwise(self.gate_up_proj)
            # (gate rows [0, I) then up rows [I, 2I) of each expert: the member order, e0.gate, e0.up, e1.gate, ...)
            yield from zip(self.gate_up_members, select_expert_rows(q, 2), strict=True)
        if self.down_grid is not None:
            q = self.down_grid.rowwise(self.down_proj)
            for e, qe in enumerate(select_experts(q)):
                yield self.down_members[e], qe

    def extra_repr(self) -> str:
        def fmt(r):
            return "bf16" if r is None else f"{r.format.value}/{r.backward.value}"
        return (f"num_experts={self.num_experts}, gate_up={fmt(self.gate_up_recipe)}, "
                f"down={fmt(self.down_recipe)}")


class _ExpertView(WeightGrid):
    """Serves expert ``e``'s slice of the fused grid of ``parent`` (quantized once for all experts)."""

    def __init__(self, parent: WeightGrid, fused_weight: torch.Tensor, e: int):
        super().__init__(parent.recipe, kernel=parent.kernel, cache_dequantized=parent.cache_dequantized)
        self.parent, self.fused_weight, self.e = parent, fused_weight, e

    def rowwise(self, weight_e: torch.Tensor):
        return select_expert(self.parent.rowwise(self.fused_weight), self.e)

    def rowwise_dequantized(self, weight_e: torch.Tensor, dtype: torch.dtype):
        q, deq = self.parent.rowwise_dequantized(self.fused_weight, dtype)
        return select_expert(q, self.e), deq[self.e]

    def columnwise(self, weight_e: torch.Tensor):
        return select_expert(self.parent.columnwise(self.fused_weight), self.e)

    def both_dequantized(self, weight_e: torch.Tensor, dtype: torch.dtype):
        q, deq, col = self.parent.both_dequantized(self.fused_weight, dtype)
        return select_expert(q, self.e), deq[self.e], select_expert(col, self.e)


def _expert_linear(x: torch.Tensor, fused_weight: torch.Tensor, e: int, grid: WeightGrid) -> torch.Tensor:
    """``x @ fused_weight[e].T`` on the fused grid; the gradient lands in row ``e`` of the fused weight.

    The per-expert views are kept on the fused grid (one per expert, rebuilt if the fused weight object is
    replaced): a view holds no tensors of its own, it reads the parent grid's per-step cache every call."""
    views = grid.__dict__.setdefault("_expert_views", {})
    view = views.get(e)
    if (view is None or view.fused_weight is not fused_weight or view.recipe is not grid.recipe
            or view.kernel != grid.kernel or view.cache_dequantized != grid.cache_dequantized):
        view = views[e] = _ExpertView(grid, fused_weight, e)
    if functorch_active():
        return QuantLinearFn.apply(x, fused_weight[e], None, view)
    return FUNCTION_APPLY(x, fused_weight[e], None, view)



def learner_weights(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """``(canonical_name, quantized tensor)`` for every quantized weight of ``model``: the forward grid.

    The grid is the per-step cache: after ``optimizer.step()`` the first forward (or this call, whichever
    comes first) quantizes the new master once and both read that one result. BF16 parameters are not
    yielded (read them from ``named_parameters``).
    """
    for module in model.modules():
        if getattr(module, "is_quantized_module", False):
            yield from module.learner_weights()


def executed_quantized(model: torch.nn.Module) -> dict[str, str]:
    """``{canonical name: format}`` of every weight a forward of ``model`` has run quantized (C1: what the
    modules recorded while computing, not what the plan says)."""
    out: dict[str, str] = {}
    for module in model.modules():
        fn = getattr(module, "executed_quantized", None)
        if getattr(module, "is_quantized_module", False) and callable(fn):
            out.update(fn())
    return out


def invalidate_grids(model: torch.nn.Module) -> int:
    """Drop every cached weight grid of ``model`` (call after each optimizer step); returns how many modules.

    Needed because not every weight update bumps the version counter the cache is keyed on
    (``AdamW(fused=True)``, writes through ``p.data``); after this the next forward or ``learner_weights``
    quantizes the new master once.
    """
    n = 0
    for module in model.modules():
        fn = getattr(module, "invalidate_grids", None)
        if getattr(module, "is_quantized_module", False) and callable(fn):
            fn()
            n += 1
    return n


def invalidate_on_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """Register ``invalidate_grids(model)`` as a step post-hook of ``optimizer``; returns the hook handle."""
    return optimizer.register_step_post_hook(lambda *_: invalidate_grids(model))
