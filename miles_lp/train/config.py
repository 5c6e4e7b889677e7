"""The recipe's ``train:`` section: optimizer, batching, seed, master weights and the backend.

Parsed like the precision policy (``miles_lp.config.parse_dataclass``): unknown keys are refused with a
close-match suggestion and the YAML ``file:line``; values are never rewritten (the padding multiple a
plan implies, e.g. 32 tokens under MXFP8, is derived by the trainer, not stored here).

    train:
      backend: embedded          # embedded (transformers model, CPU or one GPU) | megatron
      lr: 1.0e-6
      betas: [0.9, 0.98]
      weight_decay: 0.01
      grad_clip: 1.0             # max global grad norm; null disables clipping
      micro_batch_tokens: 8192   # token budget of one micro-batch (after padding)
      seed: 1234
      master_dtype: fp32         # fp32 | bf16: dtype of the parameters the optimizer updates
      param_dtype: null          # null (= master_dtype) | bf16: the model computes with BF16 copies of the
                                 # FP32 masters (Megatron-style mixed precision; embedded backend)
      rounded_export: warn       # warn | raise | allow: the learner computes in a wider dtype than it exports
      megatron: {tp: 2, pp: 1, ep: 1}
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from miles_lp.config import Where, load_yaml, parse_dataclass


@dataclasses.dataclass(frozen=True)
class MegatronSection:
    """Parallel sizes and layer implementation for the Megatron-Core backend."""

    tp: int = 1  # tensor model parallel size
    pp: int = 1  # pipeline model parallel size
    ep: int = 1  # expert model parallel size
    etp: int | None = None  # expert tensor parallel size (None: Megatron's default, = tp)
    dp: int | None = None  # data-parallel replicas (None: the smallest that tiles the expert grid, lcm(tp, ep*etp)/tp)
    first_stage_layers: int | None = None  # Megatron's num_layers_in_first_pipeline_stage (pp > 1)
    last_stage_layers: int | None = None  # Megatron's num_layers_in_last_pipeline_stage (pp > 1)
    sequence_parallel: bool = False
    # local: Megatron's own linears with miles-lp QuantLinear GEMMs (any GPU, every format);
    # transformer_engine: TE layers configured from the plan (Blackwell + TE only).
    impl: Literal["local", "transformer_engine"] = "local"
    # Megatron-Core's DistributedOptimizer (AdamW state sharded over DP); false: every rank keeps the AdamW state of
    # its shards (torch.optim.AdamW)
    distributed_optimizer: bool = False

    def _validate(self, where: Where) -> None:
        if self.distributed_optimizer:
            raise where.child("distributed_optimizer").error(
                "Megatron-Core's DistributedOptimizer is not built: the learner steps torch.optim.AdamW on each "
                "rank's shards; megatron-core 0.16's DistributedOptimizer needs Megatron's DDP parameter and gradient "
                "buffers, which it allocates on torch.cuda.current_device() and accepts as torch.cuda tensors only, "
                "so the CPU ranks the learner's data-parallel equality is tested on cannot run it; set "
                "distributed_optimizer: false (each rank keeps the AdamW state of its own shards)")
        for key in ("tp", "pp", "ep"):
            if getattr(self, key) < 1:
                raise where.child(key).error(f"must be >= 1, got {getattr(self, key)}")
        for key in ("etp", "dp", "first_stage_layers", "last_stage_layers"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise where.child(key).error(f"must be >= 1 or null, got {getattr(self, key)}")
        if self.sequence_parallel and self.tp == 1:
            raise where.child("sequence_parallel").error("needs tp > 1; set tp or drop sequence_parallel")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimizer (AdamW), batching and determinism of the learner."""

    backend: Literal["embedded", "megatron"] = "embedded"
    lr: float = 1e-6
    betas: tuple[float, ...] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    micro_batch_tokens: int = 8192
    seed: int = 0
    master_dtype: Literal["fp32", "bf16"] = "fp32"
    #: the dtype the model's parameters (hence its forward) have; None = master_dtype. ``bf16`` with an fp32
    #: master: the optimizer keeps fp32 masters, the model BF16 copies (gradients accumulated in fp32)
    param_dtype: Literal["fp32", "bf16"] | None = None
    device: str = "auto"  # embedded backend: auto (cuda if available) | cpu | cuda | cuda:N
    #: the learner's log-probs are those of softmax(logits / logits_temperature) (verl's actor temperature): an RL
    #: recipe sets it from rollout.sampling.temperature, so the ratio and the corrections score a token under the
    #: distribution it was drawn from
    logits_temperature: float = 1.0
    #: the learner computes with a weight in a wider dtype than the export sends it (FP32 masters computing, the
    #: checkpoint BF16): an update below half an ulp of the sent dtype never reaches the engine, and the sync checks
    #: (sent == held) still pass. ``warn`` (default) / ``raise`` at start, naming ``train.param_dtype``; ``allow``
    rounded_export: Literal["warn", "raise", "allow"] = "warn"
    megatron: MegatronSection = dataclasses.field(default_factory=MegatronSection)

    def _validate(self, where: Where) -> None:
        if not self.lr > 0:
            raise where.child("lr").error(f"must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise where.child("betas").error(f"must be two numbers in [0, 1), got {list(self.betas)}")
        if not self.eps > 0:
            raise where.child("eps").error(f"must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise where.child("weight_decay").error(f"must be >= 0, got {self.weight_decay}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise where.child("grad_clip").error(
                f"must be > 0 (or null to disable clipping), got {self.grad_clip}")
        if not self.logits_temperature > 0:
            raise where.child("logits_temperature").error(f"must be > 0, got {self.logits_temperature}")
        if self.micro_batch_tokens < 1:
            raise where.child("micro_batch_tokens").error(f"must be >= 1, got {self.micro_batch_tokens}")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise where.child("device").error(f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.param_dtype == "fp32" and self.master_dtype == "bf16":
            raise where.child("param_dtype").error("fp32 compute copies of a bf16 master hold nothing the master "
                                                   "does not; use master_dtype: fp32 (optionally param_dtype: bf16)")
        if self.mixed_precision and self.backend != "embedded":
            raise where.child("param_dtype").error(
                f"param_dtype {self.param_dtype} with master_dtype {self.master_dtype} is implemented by the "
                f"embedded learner only; the {self.backend} learner computes in its master dtype (drop param_dtype)")

    @property
    def torch_master_dtype(self):
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16}[self.master_dtype]

    @property
    def compute_dtype(self) -> str:
        """The dtype the learner's forward computes in (``param_dtype``, else ``master_dtype``): what an engine
        must compute in to match it (``rollout.dtype: auto``)."""
        return self.param_dtype or self.master_dtype

    @property
    def torch_param_dtype(self):
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16}[self.compute_dtype]

    @property
    def mixed_precision(self) -> bool:
        """BF16 compute copies of FP32 masters (``param_dtype`` set and different from ``master_dtype``)."""
        return self.compute_dtype != self.master_dtype


def parse_train_config(mapping: Any, where: Where | None = None) -> TrainConfig:
    """Build a ``TrainConfig`` from the mapping under ``train:`` (``None`` gives the defaults)."""
    return parse_dataclass(TrainConfig, mapping, where or Where("<train>", "train"))


def load_train_config(path: str | Path, section: str = "train") -> TrainConfig:
    """Read the ``section`` of a recipe YAML file (missing section: defaults)."""
    doc = load_yaml(path)
    data = doc.data or {}
    if not isinstance(data, dict):
        raise doc.where().error(f"expected a mapping at the top of the recipe, got {type(data).__name__}")
    return parse_train_config(data.get(section), doc.where(section))
