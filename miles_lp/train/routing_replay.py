"""Rollout routing replay (Miles' R3) for the embedded trainer's transformers MoE blocks.

The engine returns, per sample, the experts every MoE layer chose for every token it fed
(``Generation.routed_experts``: ``[len(prompt) + len(output) - 1, MoE layers, top_k]``, row ``t`` = the
route of token ``t`` as input; the last sampled token is never fed, so it has no row). With replay on, each
MoE layer of the learner uses those expert ids instead of its own top-k, and the gate weights are the
learner's OWN router probabilities gathered at them and renormalised exactly as the architecture's router
does (``norm_topk_prob``, DeepSeek's ``+ 1e-20`` and ``routed_scaling_factor``), so the router still gets
gradients (Miles replaces only the expert-selection top-k and gathers the weights from the scores too).

Semantics, per router class (transformers 5):

* ``Qwen3MoeTopKRouter``, ``Qwen2MoeTopKRouter`` (Qwen2-MoE's shared expert and its sigmoid gate run as usual):
  ``softmax(logits, fp32)``, gathered, divided by their sum when ``norm_topk_prob``, cast to the logits dtype.
* ``MixtralTopKRouter``: softmax, always renormalised, kept in fp32.
* ``DeepseekV3TopkRouter``: ``sigmoid(logits)`` (fp32), gathered (the group-limited selection and the
  ``e_score_correction_bias`` only choose experts; the replayed ids replace that choice), divided by
  ``sum + 1e-20`` when ``norm_topk_prob``, times ``routed_scaling_factor``.

Replaying the learner's own routes reproduces its unreplayed forward bit for bit (tested): the same ops on the
same values in the same order. Positions without a replayed row (each sequence's last token, the MXFP8 filler)
keep the learner's own routing; their outputs feed no log-prob of the sequence (causal attention), as
Miles pads them (it routes them to experts ``0..k-1``).

Layer order: the MoE layers in module order, which is how ``miles_lp.rollout.reference`` records them (one
row per ``EngineExperts``, dense layers such as DeepSeek's ``first_k_dense_replace`` not counted). Miles'
SGLang tensor indexes all decoder layers instead; an adapter for such an engine maps it to MoE layers first.

Token alignment: the embedded trainer packs a micro-batch into one row, so the router sees ``[T, H]`` with
token ``i`` = packed position ``i``; ``pack_routes`` puts sample ``j``'s rows at ``offset_j .. offset_j +
len_j - 2``.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from miles_lp.errors import MilesLPError

#: ``train.backend`` values whose learner replays routes (the recipe refuses ``rl.routing_replay`` with any other):
#: the embedded trainer and ``MegatronLearner`` (``miles_lp.train.megatron.replay``).
REPLAY_BACKENDS = frozenset({"embedded", "megatron"})

#: The sample key the routes travel under (``miles_lp.rl.batch.make_sample``; Miles: ``rollout_routed_experts``).
ROUTES_KEY = "routed_experts"


class RoutingReplayError(MilesLPError, ValueError):
    """Routes that cannot be replayed (shape, expert id, missing, dense model, unsupported router/learner)."""


@dataclasses.dataclass(frozen=True)
class RouterSpec:
    """How an architecture turns router logits into gate weights (what the replay must reproduce)."""

    scoring: str  # "softmax" | "sigmoid"
    norm_attr: str | None  # attribute that switches renormalisation on; None: always renormalised
    eps: float = 0.0  # added to the renormalisation denominator (DeepSeek: 1e-20)
    scale_attr: str | None = None  # multiplier applied after renormalisation (DeepSeek: routed_scaling_factor)


ROUTERS: dict[str, RouterSpec] = {
    "Qwen3MoeTopKRouter": RouterSpec("softmax", "norm_topk_prob"),
    "Qwen2MoeTopKRouter": RouterSpec("softmax", "norm_topk_prob"),
    "MixtralTopKRouter": RouterSpec("softmax", None),
    "DeepseekV3TopkRouter": RouterSpec("sigmoid", "norm_topk_prob", 1e-20, "routed_scaling_factor"),
}


def _is_experts(module: torch.nn.Module) -> bool:
    """transformers-5 fused experts (or ``QuantExperts``, which keeps their parameter names)."""
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gu, torch.nn.Parameter) and gu.dim() == 3 and isinstance(down, torch.nn.Parameter)


@dataclasses.dataclass(frozen=True)
class MoERouter:
    name: str  # module path of the router (e.g. model.layers.0.mlp.gate)
    module: torch.nn.Module
    spec: RouterSpec
    num_experts: int
    top_k: int


def moe_routers(model: torch.nn.Module) -> list[MoERouter]:
    """The routers of the model's MoE layers, in layer (module) order: the parent of every fused experts
    module's ``gate``. Refuses a router class whose weight semantics are not in ``ROUTERS``."""
    out: list[MoERouter] = []
    for name, module in model.named_modules():
        if not _is_experts(module):
            continue
        parent_name = name.rpartition(".")[0]
        parent = model.get_submodule(parent_name) if parent_name else model
        gate = getattr(parent, "gate", None)
        cls = type(gate).__name__
        if gate is None or cls not in ROUTERS:
            raise RoutingReplayError(
                f"routing replay: the MoE block '{parent_name}' has router {cls!r}; replay knows the routers of "
                f"{', '.join(sorted(ROUTERS))} (qwen3_moe, qwen2_moe, mixtral, deepseek_v3). Set rl.routing_replay: "
                "false for this model")
        out.append(MoERouter(f"{parent_name}.gate", gate, ROUTERS[cls], int(gate.num_experts), int(gate.top_k)))
    return out


# ---------------------------------------------------------------------------------------------------------
# Validation and packing (pure functions)
# ---------------------------------------------------------------------------------------------------------


def validate_routes(routes: Any, *, positions: int, layers: int, top_k: int, num_experts: int,
                    what: str) -> torch.Tensor:
    """``routes`` as a ``[positions, layers, top_k]`` int64 tensor, or ``RoutingReplayError`` naming ``what``
    (the sample) and the first bad entry: wrong shape or dtype, an expert id outside ``[0, num_experts)``, or one
    expert twice in a token's top-k."""
    if not isinstance(routes, torch.Tensor):
        raise RoutingReplayError(f"{what}: routed_experts must be a tensor [positions, MoE layers, top_k], got "
                                 f"{type(routes).__name__}")
    if routes.is_floating_point() or routes.is_complex() or routes.dtype == torch.bool:
        raise RoutingReplayError(f"{what}: routed_experts must hold integer expert ids, got dtype {routes.dtype}")
    want = (positions, layers, top_k)
    if tuple(routes.shape) != want:
        raise RoutingReplayError(
            f"{what}: routed_experts has shape {tuple(routes.shape)}, the learner needs {want} (len(tokens) - 1 "
            f"positions = prompt + response - 1, {layers} MoE layers, top_k {top_k}); was it recorded by this model "
            "for exactly these tokens?")
    r = routes.to(torch.long)
    if r.numel():
        bad = (r < 0) | (r >= num_experts)
        if bool(bad.any()):
            p, layer, k = (int(v) for v in bad.nonzero()[0])
            raise RoutingReplayError(f"{what}: routed_experts[{p}, {layer}, {k}] = {int(r[p, layer, k])} is not an "
                                     f"expert id of this model (0 .. {num_experts - 1})")
        s = r.sort(dim=-1).values
        dup = (s[..., 1:] == s[..., :-1]).any(-1)
        if bool(dup.any()):
            p, layer = (int(v) for v in dup.nonzero()[0])
            raise RoutingReplayError(f"{what}: routed_experts[{p}, {layer}] = {r[p, layer].tolist()} names an expert "
                                     "twice; a top-k route holds distinct experts")
    return r


def pack_routes(routes: Sequence[torch.Tensor], offsets: Sequence[int], lengths: Sequence[int], total: int,
                layers: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample routes (``[len - 1, layers, top_k]``) into the packed row's layout: ``(packed [total, layers,
    top_k] int64, replayed [total] bool)``. Sample ``j`` occupies positions ``offsets[j] .. offsets[j] +
    lengths[j] - 1``; its last position and the filler are not replayed."""
    packed = torch.zeros(total, layers, top_k, dtype=torch.long)
    replayed = torch.zeros(total, dtype=torch.bool)
    for r, o, n in zip(routes, offsets, lengths, strict=True):
        packed[o:o + n - 1] = r
        replayed[o:o + n - 1] = True
    return packed, replayed


def same_expert_set(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row (last dim = top_k): do ``a`` and ``b`` choose the same set of experts (order ignored)?"""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(-1)


# ---------------------------------------------------------------------------------------------------------
# The hook
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class AgreementCounter:
    """Routing agreement over the replayed positions: a (token, layer) pair agrees when the learner's own top-k
    SET equals the replayed one; a token agrees when every MoE layer does."""

    pairs: int = 0
    pairs_agree: int = 0
    tokens: int = 0
    tokens_agree: int = 0

    def add(self, per_layer: Sequence[torch.Tensor], replayed: torch.Tensor) -> None:
        """``per_layer``: one ``[T]`` bool per MoE layer (own set == replayed set); ``replayed`` ``[T]``."""
        if not per_layer:
            return
        m = replayed.to(per_layer[0].device)
        agree = torch.stack(per_layer, 0)[:, m]  # [layers, replayed tokens]
        self.pairs += agree.numel()
        self.pairs_agree += int(agree.sum())
        self.tokens += int(m.sum())
        self.tokens_agree += int(agree.all(0).sum())

    def metrics(self) -> dict[str, float]:
        if not self.pairs:
            return {}
        return {"routing_agreement": self.pairs_agree / self.pairs,
                "routing_agreement_token": self.tokens_agree / max(1, self.tokens),
                "routing_replayed_tokens": float(self.tokens)}


def _replay_forward(router: MoERouter, original, routes: torch.Tensor, replayed: torch.Tensor,
                    agreement: list[torch.Tensor]):
    spec, mod = router.spec, router.module

    def forward(self, hidden_states):
        logits, scores, own = original(hidden_states)
        if own.shape[0] != routes.shape[0]:
            raise RoutingReplayError(f"routing replay: router {router.name} saw {own.shape[0]} tokens, the packed "
                                     f"routes hold {routes.shape[0]} (the forward is not the packed row the routes "
                                     "were laid out for)")
        r = routes.to(own.device, own.dtype)
        m = replayed.to(own.device)[:, None]
        idx = torch.where(m, r, own)
        probs = F.softmax(logits, dim=-1, dtype=torch.float) if spec.scoring == "softmax" else logits.sigmoid()
        weights = probs.gather(-1, idx)
        if spec.norm_attr is None or getattr(mod, spec.norm_attr):
            denom = weights.sum(dim=-1, keepdim=True)
            if spec.eps:
                denom = denom + spec.eps
            weights = weights / denom
        if spec.scale_attr is not None:
            weights = weights * getattr(mod, spec.scale_attr)
        agreement.append(same_expert_set(own.detach(), idx.detach()))
        return logits, weights.to(scores.dtype), idx

    return types.MethodType(forward, mod)


@contextmanager
def replay_routes(routers: Sequence[MoERouter], packed: torch.Tensor, replayed: torch.Tensor,
                  counter: AgreementCounter | None = None) -> Iterator[None]:
    """Within the block, router ``i`` uses ``packed[:, i]`` at the ``replayed`` positions (``pack_routes``).

    The router modules' ``forward`` is overridden on the instance and restored on exit; outside the block the
    model is untouched. The agreement of the forwards run inside is added to ``counter``.
    """
    if packed.shape[1] != len(routers):
        raise RoutingReplayError(f"routing replay: routes for {packed.shape[1]} MoE layers, the model has "
                                 f"{len(routers)}")
    per_layer: list[list[torch.Tensor]] = [[] for _ in routers]
    patched = []
    try:
        for i, router in enumerate(routers):
            mod = router.module
            original = mod.forward
            mod.forward = _replay_forward(router, original, packed[:, i], replayed, per_layer[i])
            patched.append(mod)
        yield
    finally:
        for mod in patched:
            del mod.forward  # back to the class's forward
    if counter is not None:
        for calls in zip(*per_layer, strict=True):  # one entry per forward, every layer
            counter.add(list(calls), replayed)


def sample_routes(batch: Sequence[Any]) -> list[torch.Tensor | None] | None:
    """The routes the batch items carry (``None`` when none does). Mixed batches are refused."""
    routes = [b.get(ROUTES_KEY) if isinstance(b, Mapping) else None for b in batch]
    have = [r is not None for r in routes]
    if not any(have):
        return None
    if not all(have):
        i = have.index(False)
        raise RoutingReplayError(f"batch item {_label(batch[i], i)} has no routed_experts while others do: with "
                                 "routing replay every sample carries the engine's routes")
    return routes


def _label(item: Any, i: int) -> str:
    idx = item.get("index") if isinstance(item, Mapping) else None
    return f"{i}" if idx is None or idx == i else f"{i} (sample index {idx})"


def check_batch_routes(batch: Sequence[Any], routes: Sequence[torch.Tensor], routers: Sequence[MoERouter],
                       model_type: str) -> list[torch.Tensor]:
    """Every item's routes validated against the model (``validate_routes``); a dense model is refused."""
    if not routers:
        raise RoutingReplayError(f"routing replay: the learner's model ({model_type}) has no MoE layers, so there "
                                 "is nothing to replay; set rl.routing_replay: false for a dense model")
    k, e = routers[0].top_k, routers[0].num_experts
    out = []
    for i, (b, r) in enumerate(zip(batch, routes, strict=True)):
        n = int((b["tokens"] if isinstance(b, Mapping) else b).numel())
        out.append(validate_routes(r, positions=n - 1, layers=len(routers), top_k=k, num_experts=e,
                                   what=f"batch item {_label(b, i)}"))
    return out
