"""Routing replay (Miles' R3) in Megatron-Core 0.16's ``TopKRouter``: the top-k indices come from the engine.

    with replay_megatron_routes(learner.routers, packed, replayed, counter, sp_group=...):
        logits = model(...)

Where: megatron-core's ``topk_routing_with_score_function`` asks ``router.router_replay.get_replay_topk(scores,
topk, num_groups, group_topk, default_compute_topk)`` for ``(values, indices)`` whenever the router's
``router_replay`` attribute is set (its own ``RouterReplay`` is that hook; it is built only with
``moe_enable_routing_replay`` and keeps a process-wide instance list). ``_Replay`` is a per-forward object in that
slot, on the instance, restored to ``None`` on exit; no Megatron code is patched. It computes the router's own
top-k (``default_compute_topk``: the same call Megatron makes without replay), takes the replayed ids where the
position is replayed, and returns ``scores.gather(ids)``; Megatron then does what it always does with them:

* softmax, ``pre_softmax`` (Qwen3-MoE ``norm_topk_prob=False``): the full softmax gathered at the ids, not
  renormalised; otherwise (``norm_topk_prob``, Mixtral) a softmax over the gathered logits = the renormalised
  gather; sigmoid (DeepSeek): the sigmoid scores WITHOUT the expert bias gathered, ``/ (sum + 1e-20)``; then the
  top-k scaling factor. These are the embedded trainer's replay semantics (``miles_lp.train.routing_replay``),
  written by Megatron's own code, and the router gets gradients through the gathered scores.

Replaying the learner's own routes gives its unreplayed forward bit for bit (same values, same order). Positions
without a replayed row (each sequence's last token, the filler) keep the router's own top-k.

Token alignment: the packed row is one sequence of T tokens (batch 1), so router token i is packed position i;
under sequence parallelism a router sees only its TP rank's slice ``[r * T/tp, (r+1) * T/tp)`` (the routes are
sliced so), and the agreement flags are all-gathered over the TP group so the counter sees all T positions. Under
expert parallelism (no SP) every router sees all T tokens before the dispatcher.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from miles_lp.train.routing_replay import AgreementCounter, RoutingReplayError, same_expert_set


@dataclasses.dataclass(frozen=True)
class RouterInfo:
    """What ``routing_replay.check_batch_routes`` reads of a router."""

    name: str
    module: Any
    top_k: int
    num_experts: int


def megatron_routers(model: torch.nn.Module) -> list[RouterInfo]:
    """The MoE routers of a Megatron GPT model in layer order (dense layers have none)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [RouterInfo(name, m, int(m.topk), int(m.config.num_moe_experts))
            for name, m in model.named_modules() if isinstance(m, TopKRouter)]


class _Replay:
    """The ``router_replay`` object of one router for one forward (see the module docstring)."""

    def __init__(self, name: str, routes: torch.Tensor, replayed: torch.Tensor, flags: list[torch.Tensor],
                 sp_group=None):
        self.name, self.routes, self.replayed, self.flags, self.sp_group = name, routes, replayed, flags, sp_group

    def _slice(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        total = self.routes.shape[0]
        if self.sp_group is None:
            if n != total:
                raise RoutingReplayError(f"routing replay: router {self.name} saw {n} tokens, the packed routes hold "
                                         f"{total} (the forward is not the packed row the routes were laid out for)")
            return self.routes, self.replayed
        import torch.distributed as dist

        size, rank = dist.get_world_size(self.sp_group), dist.get_rank(self.sp_group)
        if n * size != total:
            raise RoutingReplayError(f"routing replay: router {self.name} saw {n} tokens on each of {size} sequence-"
                                     f"parallel ranks, the packed routes hold {total}")
        return self.routes[rank * n:(rank + 1) * n], self.replayed[rank * n:(rank + 1) * n]

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        routes, replayed = self._slice(own.shape[0])
        idx = torch.where(replayed.to(own.device)[:, None], routes.to(own.device, own.dtype), own)
        agree = same_expert_set(own.detach(), idx.detach())
        if self.sp_group is not None:
            import torch.distributed as dist

            parts = [torch.empty_like(agree) for _ in range(dist.get_world_size(self.sp_group))]
            dist.all_gather(parts, agree.contiguous(), group=self.sp_group)
            agree = torch.cat(parts)
        self.flags.append(agree.cpu())
        return torch.gather(scores, 1, idx), idx


@contextlib.contextmanager
def replay_megatron_routes(routers: Sequence[RouterInfo], packed: torch.Tensor, replayed: torch.Tensor,
                           counter: AgreementCounter | None = None, sp_group=None) -> Iterator[None]:
    """Within the block, router ``i`` uses ``packed[:, i]`` at the ``replayed`` positions (``pack_routes``
    layout); ``sp_group``: the TP group when the model runs sequence parallel. The agreement goes to ``counter``."""
    if packed.shape[1] != len(routers):
        raise RoutingReplayError(f"routing replay: routes for {packed.shape[1]} MoE layers, the model has "
                                 f"{len(routers)}")
    flags: list[list[torch.Tensor]] = [[] for _ in routers]
    set_here = []
    try:
        for i, r in enumerate(routers):
            if r.module.router_replay is not None:
                raise RoutingReplayError(f"router {r.name} already has a router_replay object (Megatron's "
                                         "moe_enable_routing_replay?); miles-lp replays through its own")
            r.module.router_replay = _Replay(r.name, packed[:, i], replayed, flags[i], sp_group)
            set_here.append(r.module)
        yield
    finally:
        for m in set_here:
            m.router_replay = None
    if counter is not None:
        for calls in zip(*flags, strict=True):  # one entry per forward, every layer
            counter.add(list(calls), replayed)
