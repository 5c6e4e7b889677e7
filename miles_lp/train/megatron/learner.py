"""The Megatron-Core learner: ``Learner`` over a Megatron ``GPTModel`` (one rank's shards and stage), the embedded
semantics.

    learner = MegatronLearner("/tmp/tiny", plan, TrainConfig(backend="megatron", lr=1e-5))
    lp, ent = learner.logprobs([seq0, seq1])       # per sequence: log p(x_t | x_<t), entropy, [L-1], fp32 CPU
    stats = learner.train_step(samples, loss_fn)   # token-budget micro-batches, grad clip, AdamW, grids dropped
    for name, t in learner.export_weights(): ...   # megatron_export_weights: forward grids + checkpoint dtypes
    learner.load_state_dict(learner.state_dict())  # model, AdamW, step, RNG: a bit-identical resume

Same contract as ``miles_lp.train.embedded.EmbeddedTrainer`` (``Learner`` protocol), same helpers for what does
not depend on the model (``split_by_token_budget``, ``pack_sequences``, ``token_logprobs_and_entropy``; loss
functions take ``(logprobs, entropy, samples, totals)``):

* Packing: the sequences of a micro-batch are packed into ONE row, padded with one filler segment to a multiple
  of 32 tokens under MXFP8 (``pad_multiple_for``), exactly the embedded trainer's row, so MXFP8's token-dim
  blocks (``quantized`` backward) group the same tokens. Megatron's local attention takes the block-diagonal
  causal mask explicitly (``attention_mask`` ``[1, 1, T, T]``, True = masked); Megatron's RoPE is computed for
  positions 0..T-1, so ``_PackedRotary`` indexes it with the row's ``position_ids`` (restart at 0 per sequence),
  giving each token the angle the embedded trainer and the engines give it. (MLA computes its rope inside the
  attention from absolute positions; with the block mask that is the same math, RoPE being relative.)
* The model: ``build_gpt_model`` (local spec, miles-lp's quantized parallel linears) + ``load_hf_weights`` +
  ``attach_plan``; masters in ``config.master_dtype``; ``torch.optim.AdamW`` over the Megatron parameters, with
  ``invalidate_on_step`` (Megatron layers hold the per-step grid like ``QuantLinear``).
* Distributed: a world of one is created when ``torch.distributed`` is not initialised (gloo on CPU, nccl on
  CUDA) and Megatron's model-parallel state at tp = pp = dp = ep = 1; larger sizes need the ranks' group
  already initialised (``group.MegatronGroup`` does it) and then: each data-parallel replica runs its share of
  the micro-batches (``data``), pipeline stages run Megatron's 1F1B schedule (``pipeline``), and the gradients
  are reduced as Megatron's DDP would (``parallel.finalize_grads``).
* CPU: megatron-core 0.16.1 calls ``torch.cuda.current_device()`` (RoPE, router, attention buffers) and forks the
  CUDA RNG tracker around attention dropout (0 here); for a CPU learner, on a CPU-only host or one with CUDA,
  ``cpu_redirect.cpu_megatron`` answers those names for the CPU in the learner's thread while it builds or runs the
  model (other threads, e.g. CUDA engines in the driver process, keep the real ones; nothing left behind).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from miles_lp.errors import ConfigError
from miles_lp.train.config import TrainConfig
from miles_lp.train.embedded import (
    Pack,
    PackedLearnerSteps,
    SourceInfo,
    pad_multiple_for,
    resolve_train_device,
    restore_rng,
    rng_state,
    token_logprobs_and_entropy,
)
from miles_lp.train.megatron.cpu_redirect import cpu_megatron as _cpu_megatron
from miles_lp.train.quant_linear import executed_quantized, invalidate_grids, invalidate_on_step
from miles_lp.train.state_io import check_learner_state

KIND = "megatron"


# ---------------------------------------------------------------------------------------------------------
# Process groups and the CPU redirections
# ---------------------------------------------------------------------------------------------------------


def ensure_model_parallel(device: torch.device, config: TrainConfig, sizes=None) -> tuple[bool, bool]:
    """The process group (a world of one is created if none exists) and Megatron's model-parallel state at
    ``sizes`` (``parallel.ParallelSizes``; default tp = pp = ep = 1).

    Returns (whether the process group, whether the model-parallel state was created here). A multi-rank size
    needs the group already initialised with ``sizes.world`` ranks (``miles_lp.train.megatron.group`` does it).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from miles_lp.train.megatron.parallel import ParallelSizes

    sizes = sizes or ParallelSizes()
    m = config.megatron
    if m.impl != "local":
        raise ConfigError(f"MegatronLearner runs train.megatron impl=local; got impl={m.impl}")
    if sizes.world > 1 and not (dist.is_initialized() and dist.get_world_size() == sizes.world):
        raise ConfigError(f"train.megatron {sizes.describe()} runs in {sizes.world} "
                          "processes: build the learner with miles_lp.train.megatron.group.MegatronGroup (which "
                          "spawns the ranks), not MegatronLearner in one process")
    created, created_mp = False, False
    if not dist.is_initialized():
        from miles_lp.ports import free_port

        port = free_port("127.0.0.1")
        # an explicit address (not MASTER_ADDR/MASTER_PORT): a stale port left in the environment cannot collide
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=0, world_size=1)
        created = True
    if dist.get_world_size() != sizes.world:
        raise ConfigError(f"MegatronLearner at {sizes.describe()} needs a world of "
                          f"{sizes.world} process(es); torch.distributed has {dist.get_world_size()} ranks")
    want = (sizes.tp, sizes.pp, sizes.ep, sizes.etp)
    if not ps.model_parallel_is_initialized():
        # Megatron's default rank order (tp fastest, then cp, ep, dp, pp): rank 0 is tp 0, dp 0 of the first stage
        ps.initialize_model_parallel(sizes.tp, sizes.pp, expert_model_parallel_size=sizes.ep,
                                     expert_tensor_parallel_size=sizes.etp)
        created_mp = True
    elif (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
          ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()) != want:
        raise ConfigError(f"Megatron's model-parallel state is already initialised with other sizes; this learner "
                          f"runs {sizes.describe()}")
    return created, created_mp


class _PackedRotary(torch.nn.Module):
    """Megatron's ``RotaryEmbedding`` indexed by the packed row's position ids (restarting per sequence).

    ``GPTModel`` asks its rotary module for the embedding of positions 0..T-1; this returns, for token t, the
    embedding of ``positions[t]``, so a packed sequence sees the angles it would see alone.
    """

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.positions: torch.Tensor | None = None

    def get_rotary_seq_len(self, *args, **kwargs):
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, *args, **kwargs) -> torch.Tensor:
        if self.positions is None:
            return self.inner(max_seq_len, *args, **kwargs)
        if self.positions.numel() != max_seq_len:
            raise ConfigError(f"packed rotary: {self.positions.numel()} position ids for a row of {max_seq_len}")
        emb = self.inner(int(self.positions.max()) + 1, *args, **kwargs)  # [P, 1, 1, dim]
        return emb[self.positions.to(emb.device)]


def block_causal_mask(pack: Pack, device) -> torch.Tensor:
    """``[1, 1, T, T]`` bool, True = masked: causal within each sequence and within the filler, nothing across."""
    T = pack.tokens
    seg = torch.empty(T, dtype=torch.long)
    o = 0
    for i, (off, n) in enumerate(zip(pack.offsets, pack.lengths, strict=True)):
        seg[off:off + n] = i
        o = off + n
    seg[o:] = len(pack.lengths)  # the filler is its own segment
    idx = torch.arange(T)
    allowed = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    return (~allowed)[None, None].to(device)


# ---------------------------------------------------------------------------------------------------------
# The learner
# ---------------------------------------------------------------------------------------------------------


class MegatronLearner(PackedLearnerSteps):
    """A Megatron-Core GPT model under a precision plan, trained with AdamW (see the module docstring)."""

    #: routing replay through the routers' ``router_replay`` slot (``miles_lp.train.megatron.replay``)
    supports_routing_replay = True

    def __init__(self, hf_folder_or_model: torch.nn.Module | str | Path, plan=None,
                 config: TrainConfig | None = None, *, engine_tp: int = 1, engine_etp: int | None = None):
        """``hf_folder_or_model``: an HF checkpoint folder or an in-memory transformers model (its weights are
        copied into the Megatron model); ``plan``: a compiled ``PrecisionPlan`` for that model or ``None``;
        ``engine_tp`` / ``engine_etp``: the engine's tensor / MoE tensor parallel sizes, for the NVFP4
        activation-partition rule (``parallel.check_activation_partition``; the reference engine: 1)."""
        from miles_lp.policy.plan import PrecisionPlan

        if plan is not None and not isinstance(plan, PrecisionPlan):
            raise ConfigError(f"MegatronLearner takes a compiled PrecisionPlan (or None: all BF16), got a "
                              f"{type(plan).__name__}; compile one with miles_lp.train.embedded.plan_for_model")
        from miles_lp.train.megatron import megatron_available

        reason = megatron_available()
        if reason is not None:
            from miles_lp.errors import BackendUnavailable

            raise BackendUnavailable(f"train.backend: megatron: {reason}")
        from miles_lp.train.megatron.layers import attach_plan
        from miles_lp.train.megatron.model import build_gpt_model, load_hf_weights

        self.config = cfg = config or TrainConfig(backend="megatron")
        torch.manual_seed(cfg.seed)
        self.device = resolve_train_device(cfg.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # "cuda" without an index: the current device
        if isinstance(hf_folder_or_model, str | Path):
            import transformers

            self.source = SourceInfo.from_checkpoint(hf_folder_or_model)
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_folder_or_model), dtype=torch.float32)
        else:
            self.source = SourceInfo.from_module(hf_folder_or_model)
            hf = hf_folder_or_model
        self.hf_config = hf.config
        from miles_lp.train.megatron.parallel import check_activation_partition, resolve_parallel

        self.parallel = sizes = resolve_parallel(cfg.megatron, self.hf_config)
        check_activation_partition(plan, tp=sizes.tp, etp=sizes.etp, engine_tp=engine_tp, engine_etp=engine_etp)
        self._created_group, self._created_mp = ensure_model_parallel(self.device, cfg, sizes)
        if self.device.type == "cuda":
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(cfg.seed)
        self.plan = plan
        if plan is not None and plan.layout is not None:
            self.layout = plan.layout
        else:
            from miles_lp.policy import get_layout

            self.layout = get_layout(self.hf_config)
        with _cpu_megatron(self.device):
            model = build_gpt_model(self.hf_config, quantized=plan is not None, params_dtype=cfg.torch_master_dtype,
                                    tp=sizes.tp, ep=sizes.ep, etp=sizes.etp,
                                    sequence_parallel=sizes.sequence_parallel, parallel_output=False,
                                    pp=sizes.pp, first_stage_layers=sizes.first_stage_layers,
                                    last_stage_layers=sizes.last_stage_layers)
            load_hf_weights(model, hf.state_dict(), self.hf_config)
        from miles_lp.train.megatron.model import stage_offset

        self.layer_offset = stage_offset(model)  # global index of this pipeline stage's first decoder layer
        del hf
        self.model = model.to(self.device)
        self.model.train()
        if getattr(self.model, "rotary_pos_emb", None) is not None and not getattr(
                self.model.config, "multi_latent_attention", False):
            self.model.rotary_pos_emb = _PackedRotary(self.model.rotary_pos_emb)
        self.attached = (attach_plan(self.model, plan, self.layout, layer_offset=self.layer_offset)
                         if plan is not None else {})
        if plan is not None:
            self._check_complete()
        self.pad_multiple = pad_multiple_for(plan)
        if sizes.sequence_parallel:  # the packed row is cut into tp sequence slices
            self.pad_multiple = math.lcm(self.pad_multiple, sizes.tp)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                           weight_decay=cfg.weight_decay, foreach=False)
        invalidate_on_step(self.model, self.optimizer)  # the next forward / export re-quantizes once
        self.step = 0

    @property
    def world(self) -> int:
        return self.parallel.world

    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if self.world > 1 else 0

    def close(self) -> None:
        """Tear down the model-parallel state and process group this learner created (so another Megatron user
        in the same process, e.g. the next test or a second learner, can initialise its own)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if self._created_mp and ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if self._created_group and dist.is_initialized():
            dist.destroy_process_group()
        self._created_mp = self._created_group = False

    def _check_complete(self) -> None:
        from miles_lp.train.megatron.layers import QuantParallelMixin

        held = {m for mod in self.model.modules() if isinstance(mod, QuantParallelMixin) and mod.recipe is not None
                for m in mod.members}
        if self.world > 1:  # under expert parallelism each rank holds its own experts: the union over ranks
            import torch.distributed as dist

            every: list[Any] = [None] * self.world
            dist.all_gather_object(every, held)
            held = set().union(*every)
        missing = sorted(set(self.plan.quantized()) - held)
        if missing:
            raise ConfigError(f"the plan quantizes {len(missing)} tensor(s) that no Megatron linear runs quantized, "
                              f"e.g. {missing[:5]}; is the plan compiled for this model?")

    # ---- forward ------------------------------------------------------------------------------------
    def _forward(self, pack: Pack) -> torch.Tensor:
        ids = pack.input_ids.to(self.device)
        pos = pack.position_ids.to(self.device)
        rot = self.model.rotary_pos_emb if isinstance(getattr(self.model, "rotary_pos_emb", None),
                                                        _PackedRotary) else None
        from miles_lp.train.megatron.layers import mla_rope_grad_over_tp

        with _cpu_megatron(self.device), self._replaying(pack), mla_rope_grad_over_tp(self.model.config):
            if rot is not None:
                rot.positions = pos[0]
            try:
                return self.model(ids, pos, attention_mask=block_causal_mask(pack, self.device))  # [1, T, V]
            finally:
                if rot is not None:
                    rot.positions = None

    # ---- routing replay (Miles R3: megatron.replay) ---------------------------------------------------
    def moe_routers(self):
        """The Megatron MoE routers in layer order (``[]`` for a dense model)."""
        if getattr(self, "_moe_routers", None) is None:
            from miles_lp.train.megatron.replay import megatron_routers

            self._moe_routers = megatron_routers(self.model)
        return self._moe_routers

    def _check_routes(self, batch, routes):
        from miles_lp.train.routing_replay import check_batch_routes

        return check_batch_routes(batch, routes, self.moe_routers(), str(getattr(self.hf_config, "model_type", "?")))

    def _replaying(self, pack: Pack):
        if pack.routes is None:
            return contextlib.nullcontext()
        from miles_lp.train.megatron.replay import replay_megatron_routes
        from miles_lp.train.routing_replay import pack_routes

        routers = self.moe_routers()
        packed, replayed = pack_routes(pack.routes, pack.offsets, pack.lengths, pack.tokens, len(routers),
                                       routers[0].top_k)
        sp_group = None
        if self.parallel.sequence_parallel:
            from megatron.core import parallel_state as ps

            sp_group = ps.get_tensor_model_parallel_group()
        return replay_megatron_routes(routers, packed, replayed, self._routing_counter, sp_group=sp_group)

    # ---- several ranks: data-parallel shares, pipeline stages ----------------------------------------
    def _ps(self):
        from megatron.core import parallel_state as ps

        return ps

    def _rounds(self, packs: list[Pack]) -> list[Pack]:
        """This data-parallel replica's micro-batches (``data.replica_rounds``; equal rounds under EP, whose
        dispatcher's collectives span replicas, and when there are fewer micro-batches than replicas: a replica
        without one runs a filler round (loss zero) so that its gradients exist, and ``finalize_grads`` reduces
        the same tensors on every replica; without it rank 0 waited in an all-reduce the empty replica skipped)."""
        from miles_lp.train.megatron.data import replica_rounds

        p = self.parallel
        if p.dp == 1:
            return list(packs)
        return replica_rounds(packs, p.dp, self._ps().get_data_parallel_rank(), equal=p.ep > 1 or len(packs) < p.dp)

    def _batch_routes(self, batch):
        routes = super()._batch_routes(batch)
        if routes is not None and self.parallel.pp > 1:
            from miles_lp.train.routing_replay import RoutingReplayError

            raise RoutingReplayError("routing replay under pipeline parallelism (pp > 1) is not mapped (each stage "
                                     "holds a slice of the MoE layers); run pp: 1 or rl.routing_replay: false")
        return routes

    def _finish_routing(self) -> dict[str, float]:
        """One counter for the whole mini-batch: the TP-rank-0 counters of every replica summed (a TP rank's
        counter already sees every position of its rows: the flags are all-gathered under SP)."""
        if self.world == 1 or self.parallel.dp == 1:
            return super()._finish_routing()
        import torch.distributed as dist

        from miles_lp.train.routing_replay import AgreementCounter

        c = self._routing_counter or AgreementCounter()
        mine = torch.tensor([c.pairs, c.pairs_agree, c.tokens, c.tokens_agree], dtype=torch.float64)
        if self._ps().get_tensor_model_parallel_rank() != 0:
            mine.zero_()
        mine = mine.to(self.device)
        dist.all_reduce(mine)
        c.pairs, c.pairs_agree, c.tokens, c.tokens_agree = (int(x) for x in mine.tolist())
        self._routing_counter = c
        return super()._finish_routing()

    def pack_loss(self, logits, pack: Pack, samples, loss_fn, totals) -> torch.Tensor:
        if not pack.lengths:  # a filler round: the collectives pair up, the gradient is zero
            return logits.sum() * 0.0
        lp, ent = token_logprobs_and_entropy(logits, pack, self.config.logits_temperature)
        return loss_fn(lp, ent, [samples[i] for i in pack.indices], totals)

    def _is_output_rank(self) -> bool:
        """The ranks whose loss / log-probs count once: tensor-parallel rank 0 of each replica's last stage."""
        ps = self._ps()
        return ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_last_stage()

    @torch.no_grad()
    def logprobs(self, batch):
        """``PackedLearnerSteps.logprobs``; on several ranks each replica computes its micro-batches (through the
        pipeline schedule at pp > 1) and every rank returns the whole batch's (all ranks must call it)."""
        if self.world == 1:
            return super().logprobs(batch)
        import torch.distributed as dist

        seqs = [b["tokens"] if isinstance(b, Mapping) else b for b in batch]
        routes = self._batch_routes(batch)
        rounds = self._rounds(self.micro_batches(seqs, routes))
        found: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        temp = self.config.logits_temperature
        with _cpu_megatron(self.device):
            if self.parallel.pp == 1:
                for pack in rounds:
                    logits = self._forward(pack)
                    if pack.lengths:
                        lp, ent = token_logprobs_and_entropy(logits, pack, temp)
                        found.update({i: (a.cpu(), b.cpu()) for i, a, b in zip(pack.indices, lp, ent, strict=True)})
            else:
                from miles_lp.train.megatron.pipeline import pipeline_logprobs

                found = pipeline_logprobs(self, rounds, temp)
        self._finish_routing()
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, found if self._is_output_rank() else {})
        merged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for d in every:
            merged.update(d)
        if len(merged) != len(seqs):
            raise RuntimeError(f"Megatron logprobs: {len(merged)} of {len(seqs)} sequences came back from the ranks")
        return [merged[i][0] for i in range(len(seqs))], [merged[i][1] for i in range(len(seqs))]

    def train_step(self, samples, loss_fn=None) -> dict[str, Any]:
        """``PackedLearnerSteps.train_step`` at world 1. On several ranks (every rank receives the whole
        mini-batch): each data-parallel replica forward/backwards its share of the micro-batches (through
        Megatron's pipeline schedule at pp > 1), the losses normalised by the whole mini-batch's totals; then
        Megatron's gradient reductions (``parallel.finalize_grads``), the global gradient norm and clipping over
        all shards (``parallel.clip_grads``), AdamW on each rank's shards."""
        from miles_lp.train.embedded import loss_mask_of, nll_loss

        loss_fn = loss_fn or nll_loss
        if self.world == 1:
            with _cpu_megatron(self.device):  # the backward runs Megatron code too (SP's gather buffers)
                return super().train_step(samples, loss_fn)
        import torch.distributed as dist

        from miles_lp.train.megatron.parallel import clip_grads, finalize_grads

        self.optimizer.zero_grad(set_to_none=True)
        seqs = [s["tokens"] for s in samples]
        routes = self._batch_routes(samples)
        totals = {"tokens": int(sum(float(loss_mask_of(s).sum()) for s in samples)), "sequences": len(samples)}
        packs = self.micro_batches(seqs, routes)
        rounds = self._rounds(packs)
        with _cpu_megatron(self.device):
            if self.parallel.pp == 1:
                loss_sum = 0.0
                for pack in rounds:
                    loss = self.pack_loss(self._forward(pack), pack, samples, loss_fn, totals)
                    loss.backward()
                    loss_sum += float(loss.detach())
            else:
                from miles_lp.train.megatron.pipeline import pipeline_train

                loss_sum = pipeline_train(self, rounds, samples, loss_fn, totals)
        self._finish_routing()
        total = torch.tensor([loss_sum if self._is_output_rank() else 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        finalize_grads(self.model, self.parallel)
        norm = clip_grads(self.model, self.parallel, self.config.grad_clip)
        finite = math.isfinite(norm)
        if finite:
            self.optimizer.step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": float(total), "grad_norm": norm, "finite": finite, "skipped": not finite,
                "micro_batches": len(packs), "tokens": sum(int(s["tokens"].numel()) for s in samples),
                "padded_tokens": sum(p.tokens for p in packs), "step": self.step, **self.routing_stats}

    # ---- export -------------------------------------------------------------------------------------
    def _groups(self) -> dict[str, Any]:
        if self.world == 1:
            return {}
        ps = self._ps()
        return {"tp_group": ps.get_tensor_model_parallel_group(), "ep_group": ps.get_expert_model_parallel_group(),
                "etp_group": ps.get_expert_tensor_parallel_group(),
                "pp_group": ps.get_pipeline_model_parallel_group() if self.parallel.pp > 1 else None}

    def export_weights(self) -> Iterator[tuple[str, Any]]:
        """Every tensor of the HF checkpoint once, under its canonical name: quantized weights as the forward
        grid, the others in the source checkpoint's dtype (``megatron_export_weights``). On several ranks every
        rank must call it (the shards are all-gathered over TP / ETP / EP, the stages over PP); every rank gets
        the whole model."""
        from miles_lp.train.megatron.export import megatron_export_weights

        with _cpu_megatron(self.device):
            yield from megatron_export_weights(self.model, self.hf_config, dtypes=self.source.dtypes,
                                               default_dtype=self.source.default_dtype,
                                               layer_offset=self.layer_offset, **self._groups())

    def export_owned(self) -> Iterator[tuple[str, Any]]:
        """What a weight sync sends from this rank: this pipeline stage's tensors under their HF names
        (gathered over TP / ETP / EP within the stage, as ``export_weights`` does), yielded only on the stage's
        owner rank (``export_owner()``); the other ranks of the stage take part in the gathers and yield
        nothing. Every rank of the group must call it (collectives); no pipeline-stage gather."""
        from miles_lp.train.megatron.export import megatron_export_weights

        owner = self.export_owner()
        with _cpu_megatron(self.device):
            for name, value in megatron_export_weights(self.model, self.hf_config, dtypes=self.source.dtypes,
                                                       default_dtype=self.source.default_dtype,
                                                       layer_offset=self.layer_offset, stage_only=True,
                                                       **self._groups()):
                if owner:
                    yield name, value

    def export_owner(self) -> bool:
        """Whether this rank sends its pipeline stage's weights in a sync: tensor-parallel rank 0 of data-parallel
        replica 0 (after the gathers every rank of the stage holds the same tensors; one sends)."""
        if self.world == 1:
            return True
        ps = self._ps()
        return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0

    def gathered_masters(self) -> dict[str, torch.Tensor]:
        """The master weights, gathered over every parallel group, under HF names in the master dtype (what a
        TP-1 learner holds; all ranks must call it). For tests and debugging: the export's source of truth."""
        from miles_lp.train.megatron.export import megatron_export_weights

        with _cpu_megatron(self.device):
            return dict(megatron_export_weights(self.model, self.hf_config, grids=False, cast=False,
                                                layer_offset=self.layer_offset, **self._groups()))

    def executed_quantized(self) -> dict[str, str]:
        """``{canonical: format}`` the forwards so far ran quantized, as the Megatron linears recorded it (C1);
        on several ranks the union over all ranks (each holds its experts' records; all ranks must call it)."""
        mine = executed_quantized(self.model)
        if self.world == 1:
            return mine
        import torch.distributed as dist

        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, mine)
        out: dict[str, str] = {}
        for d in every:
            out.update(d)
        return dict(sorted(out.items()))

    # ---- resume -------------------------------------------------------------------------------------
    def _targets(self) -> dict[str, torch.Tensor]:
        from miles_lp.train.megatron.model import megatron_targets

        return megatron_targets(self.model)

    def state_dict(self) -> dict[str, Any]:
        """Model (Megatron parameter names + the router expert-bias buffers), AdamW state, step, RNG states.

        Tensors are references: save them (``miles_lp.train.state_io``) or copy them before training on.
        """
        rng = rng_state(self.device)
        out = {"kind": KIND, "plan_hash": None if self.plan is None else self.plan.hash, "step": self.step,
               "model": dict(self._targets()), "optimizer": self.optimizer.state_dict(), "rng": rng}
        if self.world > 1:  # this rank's shards: a resume needs the same sizes and rank
            p = self.parallel
            out["parallel"] = {"tp": p.tp, "pp": p.pp, "dp": p.dp, "ep": p.ep, "etp": p.etp,
                               "sp": p.sequence_parallel, "rank": self.rank()}
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned (refuses another backend's state, another plan's or another
        model's tensor names / shapes)."""
        check_learner_state(state, kind=KIND, plan_hash=None if self.plan is None else self.plan.hash,
                            learner="the Megatron learner")
        if self.world > 1 or "parallel" in state:
            p = self.parallel
            mine = {"tp": p.tp, "pp": p.pp, "dp": p.dp, "ep": p.ep, "etp": p.etp, "sp": p.sequence_parallel,
                    "rank": self.rank()}
            if state.get("parallel") != mine:
                raise ConfigError(f"learner state was saved by rank/sizes {state.get('parallel')}, this learner is "
                                  f"{mine}; resume with the same train.megatron sizes")
        targets, saved = self._targets(), state["model"]
        if set(targets) != set(saved):
            raise ConfigError(f"learner state model tensors differ from this Megatron model's: missing "
                              f"{sorted(set(targets) - set(saved))[:4]}, unexpected {sorted(set(saved) - set(targets))[:4]}")
        with torch.no_grad():
            for name, t in targets.items():
                src = saved[name]
                if tuple(src.shape) != tuple(t.shape) or src.dtype != t.dtype:
                    raise ConfigError(f"learner state '{name}': {tuple(src.shape)} {src.dtype}, the model has "
                                      f"{tuple(t.shape)} {t.dtype}")
                t.copy_(src)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        restore_rng(state["rng"], self.device)
        invalidate_grids(self.model)  # the loaded master weights get a fresh grid
