"""The ``Learner`` protocol: what the RL loop and the weight sync need from a training backend.

Implemented by the embedded trainer (``miles_lp.train.embedded.EmbeddedTrainer``) and the Megatron-Core
backend (``miles_lp.train.megatron``). The loop never reaches past this interface, so a backend is
swappable from the recipe (``train.backend``).

``export_weights()`` is the one path from the learner to every consumer (``miles-lp export``, the live
sync): it yields EVERY tensor an engine needs under canonical HF names, once each:

* a weight the plan quantizes -> the learner's own forward grid (an ``MXFP8Tensor`` / ``NVFP4Tensor`` from
  ``miles_lp.formats``: the very bytes the last forward, or the next one, computes with; never a
  re-quantization of a BF16 copy);
* every other parameter and buffer the checkpoint holds -> a ``torch.Tensor`` in the checkpoint's dtype
  (BF16 for a BF16 model, whatever the master dtype);
* tied weights (``lm_head.weight`` tied to ``model.embed_tokens.weight``) once, under the name the HF
  checkpoint stores.

Engine naming and encoding (``weight_scale_inv`` vs ``weight_scale``, packed NVFP4, ...) is not the
learner's business: ``miles_lp.export`` maps ``(name, tensor)`` to a target's on-disk tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

#: One training sample: ``{"tokens": LongTensor [L], "loss_mask": [L-1] (optional), ...}``; the loss
#: function reads whatever else it needs (``advantages``, ``old_logprobs``, ``ref_logprobs``,
#: ``rollout_logprobs``, ``routed_experts``).
Sample = Mapping[str, Any]


@runtime_checkable
class Learner(Protocol):
    #: the compiled ``PrecisionPlan`` the learner runs (``None``: everything BF16)
    plan: Any
    #: optimizer steps taken
    step: int

    def logprobs(self, batch: Sequence[torch.Tensor | Sample]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per sequence, in order: log p(x_t | x_<t) for t = 1..L-1 and the entropy there (fp32, CPU)."""
        ...

    def train_step(self, samples: Sequence[Sample], loss_fn: Any) -> dict[str, Any]:
        """Micro-batched forward/backward with ``loss_fn``, clip, one optimizer step; step statistics."""
        ...

    def export_weights(self) -> Iterator[tuple[str, Any]]:
        """Every tensor an engine needs: ``(canonical HF name, quantized tensor | torch.Tensor)``."""
        ...

    def executed_quantized(self) -> Mapping[str, str]:
        """``{canonical weight: "mxfp8" | "nvfp4"}``: what the forwards so far actually ran quantized (C1:
        recorded by the quantized modules while computing, not read from the plan; a module's record is set by
        its first quantized forward and kept, since its recipe is fixed). Empty before the first forward."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a bit-identical resume needs: model, optimizer, step, RNG states (tensors by reference, as
        torch's; ``miles_lp.train.state_io.save_learner_state`` writes it as safetensors + JSON)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        ...
