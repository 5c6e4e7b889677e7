"""The embedded trainer: a transformers model, the precision plan applied by module swap, AdamW.

The default learner backend (CPU or one GPU). One page of straight-line code:

    plan = plan_for_model(load_policy("recipe.yaml"), "/tmp/tiny")   # compiled on the checkpoint's names
    trainer = EmbeddedTrainer("/tmp/tiny", plan, TrainConfig(lr=1e-5, micro_batch_tokens=4096))
    lp, ent = trainer.logprobs([seq0, seq1])            # per sequence: log p(token_t | <t), entropy, [L-1]
    stats = trainer.train_step(samples, loss_fn)        # micro-batches by token budget, grad accumulation
    for name, t in trainer.export_weights(): ...        # every checkpoint tensor; quantized = the forward grid
    trainer.load_state_dict(trainer.state_dict())       # model, AdamW, step, RNG: a bit-identical resume

It implements ``miles_lp.train.learner.Learner``.

``apply_plan`` swaps every ``nn.Linear`` whose plan entry is quantized for a ``QuantLinear`` (parameters
shared, names unchanged) and every transformers-5 fused experts module (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``) for a ``QuantExperts``.

Sequences are packed into one row (``position_ids`` restart per sequence; transformers 5 derives the
block-diagonal causal mask from them) and padded with one filler segment to a multiple of 32 tokens when the
plan has MXFP8 tensors (MXFP8 quantizes backward operands along tokens in blocks of 32).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from miles_lp.errors import ConfigError
from miles_lp.formats.spec import MXFP8_BLOCK, Format
from miles_lp.train.config import TrainConfig
from miles_lp.train.hf_export import DEFAULT_DTYPE, hf_named_tensors
from miles_lp.train.packed_attention import use_packed_attention
from miles_lp.train.quant_linear import (
    LinearRecipe,
    QuantExperts,
    QuantLinear,
    executed_quantized,
    invalidate_grids,
    invalidate_on_step,
    learner_weights,
    share_input_caches,
)
from miles_lp.train.routing_replay import (
    AgreementCounter,
    MoERouter,
    RoutingReplayError,
    check_batch_routes,
    moe_routers,
    pack_routes,
    replay_routes,
    sample_routes,
)
from miles_lp.train.state_io import check_learner_state

# ---------------------------------------------------------------------------------------------------------
# Applying the plan
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SwapReport:
    """What ``apply_plan`` did: module names per outcome (C1: the layer set the learner runs quantized)."""

    quantized: dict[str, str] = dataclasses.field(default_factory=dict)  # module -> "mxfp8/dequantized"
    bf16: list[str] = dataclasses.field(default_factory=list)
    unplanned: list[str] = dataclasses.field(default_factory=list)  # linears the plan does not list
    quantized_names: set[str] = dataclasses.field(default_factory=set)  # canonical names run quantized

    def check_complete(self, plan) -> None:
        """Every tensor the plan quantizes is run quantized by some module (else ``ConfigError``)."""
        missing = sorted(set(plan.quantized()) - self.quantized_names)
        if missing:
            raise ConfigError(f"the plan quantizes {len(missing)} tensor(s) that no module of the model runs "
                              f"quantized, e.g. {missing[:5]}; is the plan compiled for this model?")


def _is_fused_experts(module: torch.nn.Module) -> bool:
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gu, torch.nn.Parameter) and gu.dim() == 3 and isinstance(down, torch.nn.Parameter)
            and down.dim() == 3)


def _uniform_recipe(entries: Sequence[Any], what: str) -> LinearRecipe | None:
    keys = {(e.format, e.backward, e.activation_scale, e.block_2d) for e in entries}
    if len(keys) != 1:
        raise ConfigError(
            f"{what}: transformers-5 fused experts hold every expert in one tensor, so the plan must give all of "
            f"its members one format/backward/activation scale; got {len(keys)} different settings "
            f"(e.g. {entries[0].name}: {entries[0].format.value}). Make the rule uniform over experts or use "
            "the Megatron backend (per-expert linears)")
    return LinearRecipe.from_entry(entries[0], name=what)


def _set_child(root: torch.nn.Module, dotted: str, new: torch.nn.Module) -> None:
    parent_name, _, child = dotted.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def apply_plan(model: torch.nn.Module, plan, layout=None) -> SwapReport:
    """Swap the model's linears and fused experts for quantized ones, as ``plan`` says. In place."""
    if layout is None:
        layout = plan.layout
    if layout is None:
        from miles_lp.policy import get_layout

        layout = get_layout(model.config)

    def entries_of(param_name: str) -> tuple:
        if param_name in plan.entries:
            return (plan.entries[param_name],)
        return tuple(plan.entries[m] for m in layout.describe(param_name).members if m in plan.entries)

    report = SwapReport()
    by_canonical: dict[str, QuantLinear] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and not isinstance(module, QuantLinear):
            entries = entries_of(f"{name}.weight")
            if not entries:
                report.unplanned.append(name)
                continue
            (entry,) = entries
            recipe = LinearRecipe.from_entry(entry, name=entry.name)
            if recipe is None:
                report.bf16.append(name)
                continue
            ql = QuantLinear.from_linear(module, recipe, canonical=entry.name)
            _set_child(model, name, ql)
            by_canonical[entry.name] = ql
            report.quantized[name] = f"{recipe.format.value}/{recipe.backward.value}"
            report.quantized_names.add(entry.name)
        elif _is_fused_experts(module):
            gu = entries_of(f"{name}.gate_up_proj")
            dn = entries_of(f"{name}.down_proj")
            if not gu or not dn:
                report.unplanned.append(name)
                continue
            r_gu = _uniform_recipe(gu, f"{name}.gate_up_proj")
            r_dn = _uniform_recipe(dn, f"{name}.down_proj")
            if r_gu is None and r_dn is None:
                report.bf16.append(name)
                continue
            qe = QuantExperts(module, r_gu, r_dn, [e.name for e in gu], [e.name for e in dn])
            _set_child(model, name, qe)
            report.quantized[name] = qe.extra_repr()
            for recipe, entries in ((r_gu, gu), (r_dn, dn)):
                if recipe is not None:
                    report.quantized_names.update(e.name for e in entries)
    share_input_caches(model)  # q/k/v and gate/up quantize their common input once
    # NVFP4 gate/up in separate modules: one global scale over both (CONTRACT 2, SwiGLU).
    for members in plan.groups.values():
        mods = [by_canonical[m] for m in members if m in by_canonical]
        if len(mods) < 2:
            continue
        if len({(m.recipe.format, m.recipe.block_2d) for m in mods}) != 1:
            raise ConfigError(f"joint-scale group {members} mixes formats; gate and up must share one")
        if mods[0].recipe.format is Format.NVFP4:
            for m in mods:
                m.grid.amax_partners = [o.weight for o in mods if o is not m]
    return report


# ---------------------------------------------------------------------------------------------------------
# Packing and micro-batching
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Pack:
    """Sequences packed into one row: ``input_ids``/``position_ids`` ``[1, T]`` (T padded)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    offsets: list[int]  # start of each sequence in the row
    lengths: list[int]
    indices: list[int]  # the sequences' indices in the caller's batch
    #: routing replay: each sequence's validated routes ``[len - 1, MoE layers, top_k]`` (None: own routing)
    routes: list[torch.Tensor] | None = None

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[1]


def pad_multiple_for(plan) -> int:
    """32 when the plan has any MXFP8 tensor (token-dim blocks of the backward operands), else 1."""
    if plan is not None and any(e.format is Format.MXFP8 for e in plan.entries.values()):
        return MXFP8_BLOCK
    return 1


def pack_sequences(seqs: Sequence[torch.Tensor], indices: Sequence[int], multiple: int, pad_id: int = 0) -> Pack:
    lengths = [int(s.numel()) for s in seqs]
    total = sum(lengths)
    padded = math.ceil(total / multiple) * multiple if multiple > 1 else total
    ids = torch.full((padded,), pad_id, dtype=torch.long)
    pos = torch.empty(padded, dtype=torch.long)
    offsets, o = [], 0
    for s, n in zip(seqs, lengths, strict=True):
        ids[o:o + n] = s.long()
        pos[o:o + n] = torch.arange(n)
        offsets.append(o)
        o += n
    pos[o:] = torch.arange(padded - o)  # the filler is its own segment (positions restart at 0)
    return Pack(ids[None], pos[None], offsets, lengths, list(indices))


def split_by_token_budget(lengths: Sequence[int], budget: int, multiple: int) -> list[list[int]]:
    """Greedy, order-preserving micro-batches whose padded token count stays within ``budget``.

    A sequence longer than the budget gets a micro-batch of its own.
    """
    groups: list[list[int]] = []
    cur: list[int] = []
    cur_tokens = 0
    for i, n in enumerate(lengths):
        grown = math.ceil((cur_tokens + n) / multiple) * multiple
        if cur and grown > budget:
            groups.append(cur)
            cur, cur_tokens = [], 0
        cur.append(i)
        cur_tokens += n
    if cur:
        groups.append(cur)
    return groups


# ---------------------------------------------------------------------------------------------------------
# Log-probs, entropy and losses
# ---------------------------------------------------------------------------------------------------------


def prediction_span(item: Any, length: int) -> tuple[int, int]:
    """The prediction rows ``[lo, hi)`` (of ``0 .. length-2``: row ``t`` scores token ``t + 1``) a caller reads for one
    sequence. A mapping with ``start`` and ``n`` (an RL sample: its response) reads ``[start, start + n)``, widened
    to every row its ``loss_mask`` selects; anything else reads every row."""
    full = (0, max(length - 1, 0))
    if not isinstance(item, Mapping) or "start" not in item or "n" not in item:
        return full
    lo, hi = int(item["start"]), int(item["start"]) + int(item["n"])
    m = item.get("loss_mask")
    if m is not None:
        nz = torch.as_tensor(m).reshape(-1).nonzero()
        if nz.numel():
            lo, hi = min(lo, int(nz[0])), max(hi, int(nz[-1]) + 1)
    lo, hi = max(0, lo), min(full[1], hi)
    return (lo, hi) if lo < hi else full


def _rows_logprobs_and_entropy(logits_rows: torch.Tensor, targets: torch.Tensor, temperature: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[K, V]`` logits rows and ``[K]`` targets -> (log p(target), entropy), fp32 ``[K]`` each, every row at once.

    One autograd node per op over all rows: slicing a ``[K, V]`` tensor per sequence would make each slice's backward
    allocate (and zero) a gradient of the whole ``[K, V]``, once per sequence."""
    x = logits_rows.float()
    logp = F.log_softmax(x if temperature == 1.0 else x / temperature, dim=-1)
    lp = logp.gather(-1, targets[:, None].to(logp.device))[:, 0]
    p = logp.exp()
    ent = -torch.where(p > 0, p * logp, 0.0).sum(-1)  # 0 * log 0 = 0 (masked, -inf logits)
    return lp, ent


def token_logprobs_and_entropy(logits: torch.Tensor, pack: Pack, temperature: float = 1.0
                               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence: log p(x_t | x_<t) for t = 1..L-1 and the entropy of that distribution (fp32), p =
    softmax(logits / temperature)."""
    rows = torch.cat([torch.arange(o, o + n - 1) for o, n in zip(pack.offsets, pack.lengths, strict=True)])
    targets = pack.input_ids[0, rows + 1]
    lp, ent = _rows_logprobs_and_entropy(logits[0, rows.to(logits.device)], targets, temperature)  # (no filler rows)
    sizes = [n - 1 for n in pack.lengths]
    return list(lp.split(sizes)), list(ent.split(sizes))


def span_logprobs_and_entropy(logits: torch.Tensor, pack: Pack, spans: Sequence[tuple[int, int]],
                              temperature: float = 1.0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``token_logprobs_and_entropy`` from the logits of the span rows only: ``logits`` ``[1, K, V]`` holds, in
    pack order, the rows ``offset + lo .. offset + hi - 1`` of each sequence (``span_positions``). Each
    sequence's tensors are still ``[L-1]``: rows outside its span are NaN (never computed), so a loss that reads
    one turns non-finite instead of silently using a placeholder. Per computed row, the same fp32 log-softmax."""
    targets = span_positions(pack, spans) + 1
    lp_all, ent_all = _rows_logprobs_and_entropy(logits[0], pack.input_ids[0, targets], temperature)
    sizes = [hi - lo for lo, hi in spans]
    lps, ents = [], []
    for n, (lo, hi), lp, ent in zip(pack.lengths, spans, lp_all.split(sizes), ent_all.split(sizes), strict=True):
        if (lo, hi) != (0, n - 1):
            lp, ent = (torch.cat([t.new_full((lo,), math.nan), t, t.new_full((n - 1 - hi,), math.nan)])
                       for t in (lp, ent))
        lps.append(lp)
        ents.append(ent)
    return lps, ents


def span_positions(pack: Pack, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The packed positions whose logits ``span_logprobs_and_entropy`` reads (``logits_to_keep``), in pack order."""
    return torch.cat([torch.arange(o + lo, o + hi) for o, (lo, hi) in zip(pack.offsets, spans, strict=True)])


#: loss_fn(logprobs, entropy, samples, totals) -> scalar. ``logprobs``/``entropy``: one [L-1] tensor per
#: sample of the micro-batch; ``samples``: those samples (dicts); ``totals``: {"tokens": loss tokens of the
#: whole step, "sequences": samples of the whole step}. Normalize by the totals: the step's gradient is
#: then the sum over micro-batches and does not depend on how the batch was split.
LossFn = Callable[[list[torch.Tensor], list[torch.Tensor], list[Mapping[str, Any]], Mapping[str, int]], torch.Tensor]


def loss_mask_of(sample: Mapping[str, Any]) -> torch.Tensor:
    n = int(sample["tokens"].numel()) - 1
    m = sample.get("loss_mask")
    return torch.ones(n) if m is None else torch.as_tensor(m, dtype=torch.float32)


def nll_loss(logprobs, entropy, samples, totals) -> torch.Tensor:
    """Token-mean negative log-likelihood over ``loss_mask`` (SFT; also a smoke-test loss)."""
    total = sum(-_masked(lp, loss_mask_of(s)).sum() for lp, s in zip(logprobs, samples, strict=True))
    return total / max(1, totals["tokens"])


def _masked(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``t * mask`` where rows outside the mask count 0 even when not computed (NaN: ``span_logprobs_and_entropy``)."""
    mask = mask.to(t.device)
    return torch.where(mask != 0, t * mask, 0.0)


def policy_gradient_loss(logprobs, entropy, samples, totals, clip: float = 0.2) -> torch.Tensor:
    """PPO/GRPO clipped surrogate, token mean. Samples carry ``advantages`` and ``old_logprobs`` ([L-1])."""
    total = 0.0
    for lp, s in zip(logprobs, samples, strict=True):
        adv = torch.as_tensor(s["advantages"], dtype=torch.float32, device=lp.device)
        old = torch.as_tensor(s["old_logprobs"], dtype=torch.float32, device=lp.device)
        ratio = torch.exp(lp - old)
        surr = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
        total = total - _masked(surr, loss_mask_of(s)).sum()
    return total / max(1, totals["tokens"])


# ---------------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------------


def resolve_train_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def rng_state(device: torch.device) -> dict[str, Any]:
    """The RNG states a bit-identical resume needs (torch CPU, Python, and the device's on CUDA)."""
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def restore_rng(rng: Mapping[str, Any], device: torch.device) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)


class PackedLearnerSteps:
    """``logprobs`` and ``train_step`` on packed micro-batches, shared by the learners (embedded, Megatron).

    The learner provides ``config`` (``TrainConfig``), ``pad_multiple``, ``optimizer``, ``step`` and
    ``_forward(pack) -> logits [1, T, V]``; everything else about batching, losses and the step is here once.

    Routing replay (Miles R3, ``miles_lp.train.routing_replay``): batch items that carry ``routed_experts``
    are replayed by a learner with ``supports_routing_replay = True`` (its ``_forward`` reads ``pack.routes``
    and adds to ``self._routing_counter``); any other learner refuses them (``RoutingReplayError``), so routes
    are never silently ignored. After ``logprobs`` / ``train_step``, ``routing_stats`` holds the agreement of
    that call's forwards (``{}`` without replay).
    """

    #: set by a learner whose ``_forward`` replays ``pack.routes`` (the embedded trainer)
    supports_routing_replay = False
    routing_stats: dict[str, float] = {}  # noqa: RUF012 (replaced per call, never mutated)
    _routing_counter: AgreementCounter | None = None

    def micro_batches(self, seqs: Sequence[torch.Tensor], routes: Sequence[torch.Tensor] | None = None) -> list[Pack]:
        groups = split_by_token_budget([int(s.numel()) for s in seqs], self.config.micro_batch_tokens,
                                       self.pad_multiple)
        packs = [pack_sequences([seqs[i] for i in g], g, self.pad_multiple) for g in groups]
        if routes is not None:
            for pack in packs:
                pack.routes = [routes[i] for i in pack.indices]
        return packs

    def _batch_routes(self, batch: Sequence[Any]) -> list[torch.Tensor] | None:
        """The batch's routes, validated for this learner's model (``None``: no item carries any)."""
        self._routing_counter = AgreementCounter()
        routes = sample_routes(batch)
        if routes is None:
            return None
        if not self.supports_routing_replay:
            raise RoutingReplayError(
                f"{type(self).__name__} cannot replay routed experts yet (Miles R3: its MoE routers have no replay "
                "hook, supports_routing_replay is False); use train.backend: embedded or megatron, or set "
                "rl.routing_replay: false")
        return self._check_routes(batch, routes)

    def _check_routes(self, batch: Sequence[Any], routes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError  # a learner with supports_routing_replay validates against its model

    def _pack_logprobs(self, pack: Pack, spans: Sequence[tuple[int, int]]
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Log-probs and entropies of one micro-batch; ``spans``: the prediction rows read per sequence
        (``prediction_span``). This learner computes every row; one whose ``_forward`` takes ``keep`` (the embedded
        trainer) computes the lm_head and the log-softmax on the span rows only."""
        return token_logprobs_and_entropy(self._forward(pack), pack, self.config.logits_temperature)

    def _after_backward(self) -> None:
        """After each micro-batch's backward (mixed precision: gradients into the fp32 masters)."""

    def _after_step(self) -> None:
        """After the optimizer step (mixed precision: the masters rounded into the compute copies)."""

    def _finish_routing(self) -> dict[str, float]:
        counter, self._routing_counter = self._routing_counter, None
        self.routing_stats = counter.metrics() if counter is not None else {}
        return self.routing_stats

    @torch.no_grad()
    def logprobs(self, batch: Sequence[torch.Tensor | Mapping[str, Any]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per sequence (in order): log-probs of tokens 1..L-1 and entropies, fp32 on CPU. Items that are
        mappings with ``routed_experts`` are computed with those routes replayed."""
        seqs = [b["tokens"] if isinstance(b, Mapping) else b for b in batch]
        routes = self._batch_routes(batch)
        lps: list[torch.Tensor | None] = [None] * len(seqs)
        ents: list[torch.Tensor | None] = [None] * len(seqs)
        spans = [prediction_span(b, int(s.numel())) for b, s in zip(batch, seqs, strict=True)]
        for pack in self.micro_batches(seqs, routes):
            lp, ent = self._pack_logprobs(pack, [spans[i] for i in pack.indices])
            for i, a, b in zip(pack.indices, lp, ent, strict=True):
                lps[i], ents[i] = a.cpu(), b.cpu()
        self._finish_routing()
        return lps, ents  # type: ignore[return-value]

    def accumulate_grads(self, samples: Sequence[Mapping[str, Any]], loss_fn: LossFn = nll_loss
                         ) -> tuple[float, list[Pack]]:
        """Forward/backward every micro-batch of ``samples``, accumulating ``.grad``. Returns (loss, packs)."""
        seqs = [s["tokens"] for s in samples]
        routes = self._batch_routes(samples)
        totals = {"tokens": int(sum(float(loss_mask_of(s).sum()) for s in samples)), "sequences": len(samples)}
        spans = [prediction_span(s, int(s["tokens"].numel())) for s in samples]
        loss_sum, packs = 0.0, self.micro_batches(seqs, routes)
        for pack in packs:
            lp, ent = self._pack_logprobs(pack, [spans[i] for i in pack.indices])
            loss = loss_fn(lp, ent, [samples[i] for i in pack.indices], totals)
            loss.backward()
            self._after_backward()
            loss_sum += float(loss.detach())
        self._finish_routing()
        return loss_sum, packs

    def train_step(self, samples: Sequence[Mapping[str, Any]], loss_fn: LossFn = nll_loss) -> dict[str, Any]:
        """Forward/backward over micro-batches (token budget), clip, AdamW step. Returns step statistics.

        A non-finite gradient norm or loss skips the optimizer step (reported as ``skipped``).
        """
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, packs = self.accumulate_grads(samples, loss_fn)
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if self.config.grad_clip is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in params])))
        finite = math.isfinite(norm) and math.isfinite(loss_sum)  # (a loss reading rows never computed is NaN)
        if finite:
            self.optimizer.step()
            self._after_step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss_sum, "grad_norm": norm, "finite": finite, "skipped": not finite,
                "micro_batches": len(packs), "tokens": sum(int(s["tokens"].numel()) for s in samples),
                "padded_tokens": sum(p.tokens for p in packs), "step": self.step, **self.routing_stats}



class EmbeddedTrainer(PackedLearnerSteps):
    """A transformers causal LM under a precision plan, trained with AdamW (see the module docstring)."""

    supports_routing_replay = True

    def __init__(self, model: torch.nn.Module | str | Path, plan=None, config: TrainConfig | None = None):
        """``model``: an HF checkpoint folder or a transformers model; ``plan``: a compiled ``PrecisionPlan``
        for it (``plan_for_model(policy, model)``) or ``None`` (everything BF16)."""
        from miles_lp.policy.plan import PrecisionPlan

        if plan is not None and not isinstance(plan, PrecisionPlan):
            raise ConfigError(f"EmbeddedTrainer takes a compiled PrecisionPlan (or None: all BF16), got a "
                              f"{type(plan).__name__}; compile one for this model with "
                              "miles_lp.train.embedded.plan_for_model(policy, model)")
        self.config = config or TrainConfig()
        cfg = self.config
        torch.manual_seed(cfg.seed)
        self.device = resolve_train_device(cfg.device)
        dtype = cfg.torch_master_dtype
        if isinstance(model, str | Path):
            import transformers

            self.source = SourceInfo.from_checkpoint(model)
            model = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype)
        else:
            self.source = SourceInfo.from_module(model)
        self.model = model.to(device=self.device, dtype=dtype)
        self.model.train()
        # per-sequence causal attention over the packed row instead of one [T, T] block-diagonal mask: the same
        # softmax over the same keys (CPU: measured 2-5x on a 64-sequence row of SmolLM2-135M; CUDA not measured)
        self.packed_attention = self.device.type == "cpu" and use_packed_attention(self.model)
        self.masters = self._split_masters() if cfg.mixed_precision else None
        self.plan = plan
        if plan is not None and plan.layout is not None:
            self.layout = plan.layout
        else:
            from miles_lp.policy import get_layout

            self.layout = get_layout(self.model.config)
        self.swap = apply_plan(self.model, plan, self.layout) if plan is not None else SwapReport()
        if plan is not None:
            self.swap.check_complete(plan)
        check_rounded_export(rounded_exports(self.model, self.layout, self.swap.quantized_names, self.source),
                             cfg.rounded_export)
        self.pad_multiple = pad_multiple_for(plan)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.masters is not None:
            params = [m for _, m in self.masters.values()]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                           weight_decay=cfg.weight_decay, foreach=False)
        invalidate_on_step(self.model, self.optimizer)  # the next forward / export re-quantizes once
        self.step = 0

    # ---- mixed precision (train.param_dtype: bf16 with an fp32 master) ---------------------------------
    def _split_masters(self) -> dict[str, tuple[torch.nn.Parameter, torch.Tensor]]:
        """Megatron-style mixed precision: every trainable parameter becomes a compute copy in ``param_dtype``
        (the model's forward, the export and the quantized grids read it), its fp32 master moves to the optimizer.
        Buffers keep their dtype (e.g. DeepSeek's fp32 ``e_score_correction_bias``). Tied parameters once."""
        pdtype = self.config.torch_param_dtype
        masters: dict[str, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        for name, prm in self.model.named_parameters():  # tied weights appear once
            if not prm.requires_grad:
                continue
            master = prm.detach().clone()
            prm.data = prm.data.to(pdtype)
            masters[name] = (prm, master.requires_grad_(True))
        invalidate_grids(self.model)
        return masters

    def _after_backward(self) -> None:
        if self.masters is None:
            return
        for prm, master in self.masters.values():  # accumulate in fp32, as Megatron's main_grad
            if prm.grad is None:
                continue
            g = prm.grad.to(master.dtype)
            master.grad = g if master.grad is None else master.grad.add_(g)
            prm.grad = None

    def _after_step(self) -> None:
        if self.masters is None:
            return
        with torch.no_grad():
            for prm, master in self.masters.values():
                prm.copy_(master)  # rounded to the compute dtype (round to nearest even)
        invalidate_grids(self.model)

    # ---- forward ------------------------------------------------------------------------------------
    def _pack_logprobs(self, pack: Pack, spans: Sequence[tuple[int, int]]
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The lm_head, the fp32 log-softmax and the entropy on the span rows only (``logits_to_keep``): an RL
        sample's prompt rows are never projected onto the vocabulary (no ``[T, V]`` fp32 logits kept)."""
        if all(lo == 0 and hi == n - 1 for (lo, hi), n in zip(spans, pack.lengths, strict=True)):
            return token_logprobs_and_entropy(self._forward(pack), pack, self.config.logits_temperature)
        keep = span_positions(pack, spans)
        return span_logprobs_and_entropy(self._forward(pack, keep), pack, spans, self.config.logits_temperature)

    def _forward(self, pack: Pack, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[1, T, V]``; with ``keep`` (packed positions), only those rows ``[1, len(keep), V]``."""
        extra = {} if keep is None else {"logits_to_keep": keep.to(self.device)}

        def run():
            return self.model(input_ids=pack.input_ids.to(self.device),
                              position_ids=pack.position_ids.to(self.device), use_cache=False, **extra).logits

        if pack.routes is None:
            return run()
        routers = self.moe_routers()
        packed, replayed = pack_routes(pack.routes, pack.offsets, pack.lengths, pack.tokens, len(routers),
                                       routers[0].top_k)
        with replay_routes(routers, packed, replayed, self._routing_counter):
            return run()

    def moe_routers(self) -> list[MoERouter]:
        """The model's MoE routers in layer order (routing replay); ``[]`` for a dense model."""
        if getattr(self, "_moe_routers", None) is None:
            self._moe_routers = moe_routers(self.model)
        return self._moe_routers

    def _check_routes(self, batch, routes):
        return check_batch_routes(batch, routes, self.moe_routers(), str(getattr(self.model.config, "model_type",
                                                                                  "?")))

    # ---- export -------------------------------------------------------------------------------------
    def learner_weights(self) -> Iterator[tuple[str, Any]]:
        """``(canonical name, quantized tensor)``: the grid the next forward computes with."""
        return learner_weights(self.model)

    def export_weights(self) -> Iterator[tuple[str, Any]]:
        """Every tensor of the HF checkpoint, once, under its canonical name (``Learner.export_weights``):
        quantized weights as the forward grid, the others in the source checkpoint's dtype
        (``miles_lp.train.hf_export``). With a checkpoint folder as source, exactly its tensor names."""
        quantized = dict(learner_weights(self.model))
        yield from hf_named_tensors(self.model, self.layout, quantized, dtypes=self.source.dtypes,
                                    default_dtype=self.source.default_dtype, names=self.source.names)

    def executed_quantized(self) -> dict[str, str]:
        """``{canonical: format}`` the forwards so far ran quantized, as the modules recorded it (C1)."""
        return executed_quantized(self.model)

    # ---- resume -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Model (master weights, in-memory names), AdamW state, step and RNG states: a bit-identical resume.

        Tensors are references, as torch's ``state_dict``: save them (``miles_lp.train.state_io``) or copy
        them before training on.
        """
        rng = rng_state(self.device)
        state = {"kind": "embedded", "plan_hash": None if self.plan is None else self.plan.hash,
                 "step": self.step, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "rng": rng}
        if self.masters is not None:  # mixed precision: the fp32 masters the optimizer updates
            state["master"] = {name: m for name, (_, m) in self.masters.items()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned (refuses another backend's state or another plan's)."""
        check_learner_state(state, kind="embedded", plan_hash=None if self.plan is None else self.plan.hash,
                            learner="the embedded trainer")
        if (self.masters is None) != ("master" not in state):
            raise ConfigError("learner state was saved with train.param_dtype " +
                              ("different from" if "master" in state else "equal to") + " master_dtype, this trainer "
                              "runs the other mode; resume with the recipe the run started with")
        self.model.load_state_dict(state["model"], strict=True)
        if self.masters is not None:
            saved = state["master"]
            if set(saved) != set(self.masters):
                raise ConfigError(f"learner state: master weights for {sorted(set(saved) ^ set(self.masters))[:3]} "
                                  "do not match this model's parameters")
            with torch.no_grad():
                for name, (_, m) in self.masters.items():
                    m.copy_(saved[name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        restore_rng(state["rng"], self.device)
        invalidate_grids(self.model)  # the loaded master weights get a fresh grid


def rounded_exports(model: torch.nn.Module, layout, quantized: Collection[str], source: SourceInfo
                    ) -> list[tuple[str, torch.dtype, torch.dtype]]:
    """``(canonical name, dtype the forward computes with, dtype the export sends)`` of every trainable tensor that
    is exported as a plain tensor (not a quantized grid) in a dtype with fewer mantissa bits than the forward's: the
    engine then serves a rounding of what the learner computes with, and an update smaller than half an ulp of the
    sent dtype never reaches it (the checks compare sent with held: they pass)."""
    out = []
    for name, p in model.named_parameters():  # tied weights once
        if not p.requires_grad or not p.is_floating_point():
            continue
        for member in layout.describe(name).members:
            if member in quantized:
                continue
            sent = source.dtypes.get(member, source.default_dtype)
            if sent.is_floating_point and torch.finfo(sent).eps > torch.finfo(p.dtype).eps:
                out.append((member, p.dtype, sent))
    return out


def check_rounded_export(gap: Sequence[tuple[str, torch.dtype, torch.dtype]], mode: str) -> None:
    """``train.rounded_export``: ``warn`` / ``raise`` (``ConfigError``) when ``gap`` (``rounded_exports``) is not
    empty; ``allow``: nothing."""
    if not gap or mode == "allow":
        return
    name, compute, sent = gap[0]
    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    msg = (f"train.param_dtype: the learner computes with {short.get(compute, compute)} weights but exports {len(gap)} "
           f"tensor(s) as {short.get(sent, sent)} (the checkpoint's dtype, e.g. '{name}'): an optimizer step smaller "
           f"than half a {short.get(sent, sent)} ulp never reaches the engine while the learner moves on, and the sync "
           f"checks (sent == held) still pass. Set train.param_dtype: {short.get(sent, sent)} (compute with what is "
           "sent; FP32 masters stay in the optimizer), or train.rounded_export: allow to keep this")
    if mode == "raise":
        raise ConfigError(msg)
    import warnings

    warnings.warn(msg, UserWarning, stacklevel=3)


@dataclasses.dataclass(frozen=True)
class SourceInfo:
    """What the export needs to know about the checkpoint the model came from."""

    names: tuple[str, ...] | None  # the tensor names it stores (None: unknown, in-memory model)
    dtypes: dict[str, torch.dtype]  # its dtype per tensor name
    default_dtype: torch.dtype  # for names without a recorded dtype

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> SourceInfo:
        """Names and dtypes from the safetensors headers. A DeepSeek-style block-FP8 checkpoint is refused: the
        trainer loads BF16 / FP16 / FP32 weights (``miles-lp convert`` decodes block-FP8, by default to the BF16
        values DeepSeek's ``fp8_cast_bf16`` writes)."""
        from miles_lp.errors import CheckpointError
        from miles_lp.io.safetensors_io import torch_dtype
        from miles_lp.io.validate import validate_source

        src = validate_source(path)
        if src.is_fp8_block:
            raise CheckpointError(f"{src.root} holds block-FP8 weights (e.g. '{next(iter(src.fp8_scale_of))}' with "
                                  "weight_scale_inv); the embedded learner loads BF16 / FP16 / FP32 checkpoints: use "
                                  "`miles-lp convert`, which decodes block-FP8 (to the BF16 values DeepSeek's "
                                  "fp8_cast_bf16 writes), or a BF16 copy of the model")
        dtypes = {n: torch_dtype(src.tensors[n].dtype) for n in src.logical}
        cfg_dtype = src.config.get("dtype") or src.config.get("torch_dtype")
        default = getattr(torch, cfg_dtype) if isinstance(cfg_dtype, str) and hasattr(torch, cfg_dtype) else None
        return cls(tuple(src.logical), dtypes, default if isinstance(default, torch.dtype) else DEFAULT_DTYPE)

    @classmethod
    def from_module(cls, model: torch.nn.Module) -> SourceInfo:
        """An in-memory model: its own floating dtype before the master cast (BF16 if it has none)."""
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), DEFAULT_DTYPE)
        return cls(None, {}, dtype)


def plan_for_model(policy, model: torch.nn.Module | str | Path):
    """Compile ``policy`` for a model: a checkpoint folder (its safetensors names and shapes, exactly as
    ``miles-lp convert`` compiles it, so both run the same plan) or an in-memory transformers model (its
    tensors under canonical names; fused experts per expert; tied weights once)."""
    from miles_lp.policy import compile_plan, get_layout

    if isinstance(model, str | Path):
        from miles_lp.io.validate import validate_source

        src = validate_source(model)
        return compile_plan(policy, get_layout(src.config), src.logical)
    layout = get_layout(model.config)
    shapes: dict[str, tuple[int, ...]] = {}
    seen: set[tuple] = set()
    for n, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if t.numel() and key in seen:  # tied: the first name only
            continue
        seen.add(key)
        shapes[n] = tuple(t.shape)
    return compile_plan(policy, layout, _canonical_shapes(layout, shapes))


def _canonical_shapes(layout, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """In-memory parameter shapes -> canonical HF names (fused experts expand to per-expert shapes)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        info = layout.describe(name)
        if info.kind == "fused" and len(shape) == 3:
            e, n, k = shape
            per = n // (len(info.members) // e)
            for m in info.members:
                out[m] = (per, k)
        else:
            for m in info.members:
                out.setdefault(m, tuple(shape))
    return out
