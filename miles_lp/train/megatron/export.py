"""The Megatron learner's whole-model export under canonical HF names (``Learner.export_weights`` semantics).

    for name, value in megatron_export_weights(model, hf_config, tp_group=group): ...

Per Megatron tensor: the forward grid of a quantized linear (its ``WeightGrid``, the very bytes the forward
used) or the parameter / router expert-bias buffer; under tensor parallelism every rank all-gathers the shards
over the TP group (``all_gather_value``: byte views, so any dtype crosses gloo or NCCL) and rebuilds the full
tensor (``naming.gather_shards``); then ``naming.megatron_to_hf`` names it. Plain tensors are cast to the
checkpoint's dtype (``dtypes``, BF16 by default). All ranks must call it (collectives); all get the result.

The grid equals the converter's (C2): MXFP8 has no global scale; an NVFP4 fused Megatron weight (``linear_qkv``,
``linear_fc1``) has one global scale over its members, which the plan's joint-scale groups (q/k/v, gate/up)
give the converter too, and DeepSeek's q_a / kv_a (two Megatron linears, one plan group) share theirs through
``attach_plan``'s amax partners. Expert parallelism: every rank's local experts are all-gathered over the EP
group and renamed to their global index (after the expert-TP gather).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from miles_lp.train.megatron.naming import gather_shards, megatron_to_hf

DEFAULT_DTYPE = torch.bfloat16


def _world(group) -> int:
    if group is None or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group)


def _gather_tensor(t: torch.Tensor, group) -> list[torch.Tensor]:
    """``t`` from every rank of ``group`` (same shape and dtype on each), as byte views across the wire."""
    t = t.detach().contiguous()
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)
    bufs = [torch.empty_like(flat) for _ in range(_world(group))]
    torch.distributed.all_gather(bufs, flat, group=group)
    return [b.view(t.dtype).reshape(t.shape) if t.numel() else t.clone() for b in bufs]


def all_gather_value(v: Any, group) -> list[Any]:
    """A tensor or a quantized grid from every rank of ``group`` (rank order); ``[v]`` without a group."""
    if _world(group) == 1:
        return [v]
    if isinstance(v, torch.Tensor):
        return _gather_tensor(v, group)
    per_field: dict[str, list[torch.Tensor]] = {}
    static: dict[str, Any] = {}
    for f in dataclasses.fields(v):
        if not f.init:
            continue
        x = getattr(v, f.name)
        if isinstance(x, torch.Tensor):
            per_field[f.name] = _gather_tensor(x, group)
        else:
            static[f.name] = x
    n = _world(group)
    return [type(v)(**static, **{k: parts[r] for k, parts in per_field.items()}) for r in range(n)]


def gather_stages(state: Mapping[str, Any], pp_group) -> dict[str, Any]:
    """Every pipeline stage's ``{name: tensor | grid}`` on every rank of ``pp_group``, stage order.

    The layout (names, each value's class, its non-tensor fields, its tensors' shapes and dtypes) goes round with
    ``all_gather_object`` (our own ranks' metadata, never tensors); each tensor then crosses as bytes in a
    ``broadcast`` from the stage that holds it.
    """
    import torch.distributed as dist

    def layout(v: Any) -> tuple:
        if isinstance(v, torch.Tensor):
            return (None, {}, [("", tuple(v.shape), v.dtype)])
        static, fields = {}, []
        for f in dataclasses.fields(v):
            if not f.init:
                continue
            x = getattr(v, f.name)
            if isinstance(x, torch.Tensor):
                fields.append((f.name, tuple(x.shape), x.dtype))
            else:
                static[f.name] = x
        return (type(v), static, fields)

    mine = [(name, *layout(v)) for name, v in state.items()]
    every: list[Any] = [None] * _world(pp_group)
    dist.all_gather_object(every, mine, group=pp_group)
    me = dist.get_rank(pp_group)
    device = next((v.device for v in state.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    out: dict[str, Any] = {}
    for stage, entries in enumerate(every):
        src = dist.get_global_rank(pp_group, stage)
        for name, cls, static, fields in entries:
            v = state[name] if stage == me else None
            got = {}
            for fname, shape, dtype in fields:
                if stage == me:
                    t = (v if cls is None else getattr(v, fname)).detach().contiguous()
                else:
                    t = torch.empty(shape, dtype=dtype, device=device)
                if t.numel():
                    dist.broadcast(t.reshape(-1).view(torch.uint8), src=src, group=pp_group)
                got[fname] = t
            out[name] = got[""] if cls is None else cls(**static, **got)
    return out


def quantized_grids(model: torch.nn.Module) -> dict[str, Any]:
    """``{Megatron weight name: forward grid}`` of the quantized parallel linears (``module.`` prefixes off)."""
    from miles_lp.train.megatron.layers import QuantParallelMixin

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantParallelMixin) and module.grid is not None:
            while name.startswith("module."):
                name = name[len("module."):]
            out[f"{name}.weight"] = (module.grid.rowwise(module.weight), module.recipe)
    return out


_LOCAL_EXPERT = re.compile(r"(.*\.local_experts\.)(\d+)(\..*)")


def megatron_export_weights(model: torch.nn.Module, hf_config: Any, *, tp_group=None, ep_group=None,
                            etp_group=None, dtypes: Mapping[str, torch.dtype] | None = None,
                            default_dtype: torch.dtype = DEFAULT_DTYPE, grids: bool = True,
                            cast: bool = True, pp_group=None, layer_offset: int = 0,
                            stage_only: bool = False) -> Iterator[tuple[str, Any]]:
    """``(canonical HF name, grid | tensor)`` for every tensor of the HF checkpoint the model was built from.

    ``tp_group``: the tensor-parallel group (dense weights); ``etp_group``: the expert tensor-parallel group
    (default: ``tp_group``, Megatron's default ``etp = tp``); ``ep_group``: the expert-parallel group: each rank's
    local experts ``local_experts.{l}`` are gathered and renamed to the global index ``ep_rank * E/ep + l``.
    ``grids=False, cast=False``: the gathered master tensors themselves (tests compare the grids to them).
    Pipeline parallelism: ``layer_offset`` renames this stage's layers to their global index; ``pp_group``: the
    stages' tensors are gathered (``gather_stages``) so every rank gets the whole model, unless ``stage_only``
    (this stage's tensors only, for a sync that sends from every stage).
    """
    from miles_lp.train.megatron.model import megatron_targets
    from miles_lp.train.megatron.naming import layer_global

    dtypes = dtypes or {}
    etp_group = tp_group if etp_group is None else etp_group
    grids = quantized_grids(model) if grids else {}
    state: dict[str, Any] = {}
    targets = {}
    grids = {layer_global(k, layer_offset): v for k, v in grids.items()}
    for name, p in megatron_targets(model).items():
        while name.startswith("module."):
            name = name[len("module."):]
        targets[layer_global(name, layer_offset)] = p
    per_rank = len({m.group(2) for n in targets if (m := _LOCAL_EXPERT.fullmatch(n))})
    for name, p in targets.items():
        value = grids[name][0] if name in grids else p.detach()
        m = _LOCAL_EXPERT.fullmatch(name)
        if m is None:
            state[name] = gather_shards(name, all_gather_value(value, tp_group))
            continue
        full = gather_shards(name, all_gather_value(value, etp_group))
        for ep_rank, v in enumerate(all_gather_value(full, ep_group)):
            state[f"{m.group(1)}{ep_rank * per_rank + int(m.group(2))}{m.group(3)}"] = v
    partial = False
    if _world(pp_group) > 1:
        if stage_only:
            partial = True
        else:
            state = gather_stages(state, pp_group)
    for hf_name, v in megatron_to_hf(state, hf_config, partial=partial).items():
        if cast and isinstance(v, torch.Tensor) and v.is_floating_point():
            v = v.to(dtypes.get(hf_name, default_dtype))
        yield hf_name, v
