"""Megatron-Core -> HF names: the inverse of ``model.hf_to_megatron``, so the Megatron learner exports under the
canonical HF checkpoint names. Pure tensor code; needs no megatron-core.

Per Megatron tensor (tp = 1, or after ``gather_shards``):

* ``linear_qkv`` (weight, bias): rows interleaved per query group ``[q heads of g | k_g | v_g]`` -> q, k, v;
* ``linear_fc1`` (dense MLP, shared experts, each expert): ``[gate; up]`` -> gate, up;
* ``local_experts.{e}.linear_fc1/fc2`` -> ``experts.{e}.{gate,up,down}`` under the architecture's own names
  (``block_sparse_moe.experts.{e}.w1/w3/w2`` for Mixtral); the router -> ``{moe}.gate.weight`` (+ DeepSeek's
  ``e_score_correction_bias``); ``shared_experts.gate_weight`` -> Qwen2-MoE's ``mlp.shared_expert_gate.weight``;
* MLA: ``linear_q_down_proj`` -> ``q_a_proj``, ``q_layernorm`` -> ``q_a_layernorm``, ``linear_q_up_proj`` ->
  ``q_b_proj`` (or ``linear_q_proj`` -> ``q_proj``), ``linear_kv_down_proj`` -> ``kv_a_proj_with_mqa``,
  ``kv_layernorm`` -> ``kv_a_layernorm``, ``linear_kv_up_proj`` -> ``kv_b_proj``;
* everything else one to one; the output layer is dropped for tied embeddings (HF stores it once).

A value is a ``torch.Tensor`` or a rowwise-quantized grid (``MXFP8Tensor`` / ``NVFP4Tensor``): rows are split
with ``select_rows`` (rowwise blocks lie inside a row, so the rows of a quantized fused weight are the
quantization of the member; an NVFP4 global scale stays the fused weight's, which is what the engines fuse).

Tensor parallelism: ``gather_shards(name, parts)`` rebuilds the full Megatron tensor (or grid) from the
ranks' shards, inverting the split ``hf_to_megatron`` made: column-parallel rows concatenated (``linear_qkv``
holds whole query groups per rank, so that is the full interleaved tensor), ``linear_fc1`` per rank
``[gate_r; up_r]`` -> ``[gate_0..; up_0..]``, row-parallel (``linear_proj``, ``linear_fc2``) along K, replicated
tensors taken once (and checked equal). A quantized grid gathers component by component; its NVFP4 global scale
must already agree across ranks (the amax all-reduced over the TP group, ``tp_amax_reduce``), else the gathered
grid would not be the unsharded tensor's and ``gather_shards`` refuses it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from miles_lp.errors import LayoutError

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_LAYER_PREFIX = re.compile(r"((?:module\.)*decoder\.layers\.)(\d+)(?=\.)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight")
_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_q_down_proj.weight", "linear_q_up_proj.weight",
           "linear_q_proj.weight", "linear_kv_down_proj.weight", "linear_kv_up_proj.weight")
_ROW = ("linear_proj.weight", "linear_fc2.weight")


def shard_kind(name: str) -> str:
    """How ``hf_to_megatron`` split ``name`` over tensor-parallel ranks: ``column`` (dim 0), ``fc1`` (dim 0,
    gate and up each), ``row`` (last dim) or ``replicated``."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "column"
    if name.endswith("linear_fc1.weight"):
        return "fc1"
    if name.endswith(_ROW):
        return "row"
    if name.endswith(_COLUMN):
        return "column"
    return "replicated"


# ---------------------------------------------------------------------------------------------------------
# values: a torch.Tensor or a quantized grid, handled alike
# ---------------------------------------------------------------------------------------------------------
def _is_grid(v: Any) -> bool:
    return not isinstance(v, torch.Tensor)


def _rows(v: Any, idx: torch.Tensor):
    if _is_grid(v):
        from miles_lp.train.operands import select_rows

        return select_rows(v, idx)
    return v.index_select(0, idx.to(v.device))


def _num_rows(v: Any) -> int:
    return int(v.shape[0])


def _map_grid(parts: Sequence[Any], fn: Callable[[str, list[torch.Tensor]], torch.Tensor], shape: tuple) -> Any:
    """A grid built from ``parts`` (same class), each tensor field ``fn(field, [part tensors])``."""
    q0 = parts[0]
    kw = {}
    for f in dataclasses.fields(q0):
        if not f.init:
            continue
        v = getattr(q0, f.name)
        if isinstance(v, torch.Tensor):
            kw[f.name] = fn(f.name, [getattr(p, f.name) for p in parts])
        elif f.name in ("logical_shape", "shape"):
            kw[f.name] = type(v)(shape)
        else:
            kw[f.name] = v
    return type(q0)(**kw)


def gather_shards(name: str, parts: Sequence[Any]) -> Any:
    """The full Megatron tensor (or rowwise grid) ``name`` from its tensor-parallel shards, rank order."""
    if len(parts) == 1:
        return parts[0]
    kind = shard_kind(name)
    if kind == "replicated":
        first = parts[0]
        if not _is_grid(first) and any(not torch.equal(p, first) for p in parts[1:]):
            raise LayoutError(f"'{name}' should be replicated over tensor-parallel ranks but the ranks disagree")
        return first
    rows, cols = int(parts[0].shape[0]), int(parts[0].shape[-1])
    tp = len(parts)

    def cat_rows(ts: list[torch.Tensor]) -> torch.Tensor:
        if kind == "fc1":  # each rank: [gate_r; up_r] -> [gate_0; gate_1; ...; up_0; up_1; ...]
            halves = [t.chunk(2, dim=-2) for t in ts]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=-2)
        return torch.cat(ts, dim=-2)

    if not _is_grid(parts[0]):
        if kind == "row":
            return torch.cat(list(parts), dim=-1)
        if parts[0].dim() == 1:  # a column-parallel bias
            return torch.cat(list(parts), dim=0)
        return cat_rows(list(parts))

    def field(fname: str, ts: list[torch.Tensor]) -> torch.Tensor:
        if ts[0].dim() < 2 or ts[0].shape[-2] != rows:  # global scale / amax: per matrix, must agree
            if any(not torch.equal(t, ts[0]) for t in ts[1:]):
                raise LayoutError(f"'{name}': the NVFP4 {fname} differs between tensor-parallel ranks; the weight's "
                                  "global amax must be all-reduced (MAX) over the TP group (tp_amax_reduce) so that "
                                  "the gathered grid is the unsharded weight's")
            return ts[0]
        return torch.cat(ts, dim=-1) if kind == "row" else cat_rows(ts)

    shape = (rows, cols * tp) if kind == "row" else (rows * tp, cols)
    return _map_grid(parts, field, shape)


def tp_amax_reduce(group) -> Callable[[torch.Tensor], torch.Tensor]:
    """``WeightGrid.amax_reduce`` under tensor parallelism: a shard's NVFP4 global amax all-reduced (MAX) over
    ``group``, i.e. the unsharded tensor's (with a joint-scale partner's folded in first: gate with up).

    What TE does with ``NVFP4Quantizer(with_amax_reduction=True, amax_reduction_group=<TP group>)`` (set by
    ``te.autocast(amax_reduction_group=...)``; Megatron passes its amax-reduction group, the TP group alone with
    ``tp_only_amax_red``). Not run against TE here (no TE on these machines): a fact from TE's source."""

    def reduce(amax: torch.Tensor) -> torch.Tensor:
        a = amax.clone()
        torch.distributed.all_reduce(a, op=torch.distributed.ReduceOp.MAX, group=group)
        return a

    return reduce


# ---------------------------------------------------------------------------------------------------------
# Megatron -> HF names
# ---------------------------------------------------------------------------------------------------------
def qkv_row_indices(num_rows: int, num_query_groups: int, q_rows_per_group: int) -> tuple[torch.Tensor, ...]:
    """Row indices of q, k, v in Megatron's ``linear_qkv`` (per query group: q heads, k, v)."""
    ng = num_query_groups
    block = num_rows // ng
    hn = (block - q_rows_per_group) // 2
    q = torch.cat([torch.arange(g * block, g * block + q_rows_per_group) for g in range(ng)])
    k = torch.cat([torch.arange(g * block + q_rows_per_group, g * block + q_rows_per_group + hn) for g in range(ng)])
    v = torch.cat([torch.arange(g * block + q_rows_per_group + hn, (g + 1) * block) for g in range(ng)])
    return q, k, v


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    return cfg.get(key, default) if isinstance(cfg, Mapping) else getattr(cfg, key, default)


def layer_global(name: str, offset: int) -> str:
    """A pipeline stage's module name -> the whole model's (``decoder.layers.{local}`` + ``offset``)."""
    if not offset:
        return name
    m = _LAYER_PREFIX.match(name)
    return name if m is None else f"{m.group(1)}{int(m.group(2)) + offset}{name[m.end():]}"


def stage_state(state: Mapping[str, Any], offset: int, n_layers: int, *, first: bool, last: bool) -> dict[str, Any]:
    """The tensors of a whole-model Megatron state (global layer indices) that a pipeline stage holds, under the
    stage's module names (``decoder.layers.{global - offset}``; the embedding on the first stage, the final norm
    and output layer on the last)."""
    out = {}
    for name, v in state.items():
        m = _LAYER_PREFIX.match(name)
        if m is not None:
            i = int(m.group(2)) - offset
            if 0 <= i < n_layers:
                out[f"{m.group(1)}{i}{name[m.end():]}"] = v
        elif name.startswith("embedding."):
            if first:
                out[name] = v
        elif last:  # decoder.final_layernorm, output_layer
            out[name] = v
    return out


def megatron_to_hf(state: Mapping[str, Any], hf_config: Any, *, partial: bool = False) -> dict[str, Any]:
    """Canonical HF checkpoint names for a full (tp = 1 or gathered, ep = 1) Megatron state; the inverse of
    ``hf_to_megatron``. Every Megatron tensor is consumed exactly once (``LayoutError`` otherwise).
    ``partial``: a pipeline stage's share (global layer indices; embedding / final norm only where present)."""
    from miles_lp.policy import get_layout

    layout = get_layout(hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config))
    spec = layout.spec
    heads = int(_get(hf_config, "num_attention_heads"))
    ng = int(_get(hf_config, "num_key_value_heads") or heads)
    hidden = int(_get(hf_config, "hidden_size"))
    head_dim = int(_get(hf_config, "head_dim") or hidden // heads)
    used: set[str] = set()

    def take(name: str) -> Any:
        if name not in state:
            raise LayoutError(f"Megatron -> HF: the Megatron state has no '{name}'")
        used.add(name)
        return state[name]

    def halves(v: Any) -> tuple[Any, Any]:
        n = _num_rows(v) // 2
        return _rows(v, torch.arange(0, n)), _rows(v, torch.arange(n, 2 * n))

    out: dict[str, Any] = {}
    for mname, hname in (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                         ("decoder.final_layernorm.weight", "model.norm.weight")):
        if not partial or mname in state:
            out[hname] = take(mname)
    if "output_layer.weight" in state:
        lm = take("output_layer.weight")
        if not _get(hf_config, "tie_word_embeddings", False):
            out["lm_head.weight"] = lm
    layers = sorted({int(m.group(1)) for n in state if (m := _LAYER.fullmatch(n))})
    for i in layers:
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        s, a = m + "self_attention.", h + "self_attn."
        out[h + "input_layernorm.weight"] = take(m + "input_layernorm.weight")
        out[h + "post_attention_layernorm.weight"] = take(m + "pre_mlp_layernorm.weight")
        if s + "linear_kv_down_proj.weight" in state:  # MLA
            if s + "linear_q_down_proj.weight" in state:
                out[a + "q_a_proj.weight"] = take(s + "linear_q_down_proj.weight")
                out[a + "q_a_layernorm.weight"] = take(s + "q_layernorm.weight")
                out[a + "q_b_proj.weight"] = take(s + "linear_q_up_proj.weight")
            else:
                out[a + "q_proj.weight"] = take(s + "linear_q_proj.weight")
            out[a + "kv_a_proj_with_mqa.weight"] = take(s + "linear_kv_down_proj.weight")
            out[a + "kv_a_layernorm.weight"] = take(s + "kv_layernorm.weight")
            out[a + "kv_b_proj.weight"] = take(s + "linear_kv_up_proj.weight")
        else:
            for suffix in ("weight", "bias"):
                key = s + f"linear_qkv.{suffix}"
                if key not in state:
                    continue
                v = take(key)
                idx = qkv_row_indices(_num_rows(v), ng, heads // ng * head_dim)
                for p, rows in zip(("q_proj", "k_proj", "v_proj"), idx, strict=True):
                    out[a + f"{p}.{suffix}"] = _rows(v, rows)
            if s + "q_layernorm.weight" in state:
                out[a + "q_norm.weight"] = take(s + "q_layernorm.weight")
                out[a + "k_norm.weight"] = take(s + "k_layernorm.weight")
        out[a + "o_proj.weight"] = take(s + "linear_proj.weight")
        if m + "mlp.router.weight" not in state:  # dense MLP
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = halves(take(m + "mlp.linear_fc1.weight"))
            out[h + "mlp.down_proj.weight"] = take(m + "mlp.linear_fc2.weight")
            continue
        moe = f"{h}{spec.moe_module}."
        out[moe + "gate.weight"] = take(m + "mlp.router.weight")
        if m + "mlp.router.expert_bias" in state:
            out[moe + "gate.e_score_correction_bias"] = take(m + "mlp.router.expert_bias")
        experts = sorted({int(x.group(1)) for n in state if n.startswith(m) and (x := _EXPERT.fullmatch(n[len(m):]))})
        for e in experts:
            gate, up, down = layout.expert_names(i, e)
            out[gate], out[up] = halves(take(f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"))
            out[down] = take(f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight")
        if m + "mlp.shared_experts.linear_fc1.weight" in state:
            sh = f"{h}mlp.{spec.shared}."
            out[sh + "gate_proj.weight"], out[sh + "up_proj.weight"] = halves(
                take(m + "mlp.shared_experts.linear_fc1.weight"))
            out[sh + "down_proj.weight"] = take(m + "mlp.shared_experts.linear_fc2.weight")
        if m + "mlp.shared_experts.gate_weight" in state:
            out[h + "mlp.shared_expert_gate.weight"] = take(m + "mlp.shared_experts.gate_weight")
    unused = sorted(set(state) - used)
    if unused:
        raise LayoutError(f"Megatron -> HF name map: Megatron tensors not consumed {unused[:6]}")
    return out
