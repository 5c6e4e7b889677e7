"""The learner: quantized linears with selectable backward, the embedded trainer, the Megatron backend.

Modules, one idea each: ``recipe`` (LinearRecipe), ``operands`` (operand quantizers, quantized-tensor views),
``grid`` (WeightGrid, the per-step cache), ``gemm`` (the autograd GEMM), ``quant_linear`` (QuantLinear,
QuantExperts and the walkers), ``embedded`` (the trainer), ``hf_export`` (whole-model export under HF names),
``state_io`` (learner state on disk), ``learner`` (the Learner protocol), ``megatron`` (the Megatron backend).

    from miles_lp.train import QuantLinear, QuantExperts, quantized_linear, learner_weights
    from miles_lp.train import EmbeddedTrainer, TrainConfig, load_train_config

See docs/training.md.
"""

from miles_lp.train.config import MegatronSection, TrainConfig, load_train_config, parse_train_config
from miles_lp.train.gemm import quantized_linear
from miles_lp.train.grid import WeightGrid
from miles_lp.train.quant_linear import (
    QuantExperts,
    QuantLinear,
    executed_quantized,
    invalidate_grids,
    invalidate_on_step,
    learner_weights,
)
from miles_lp.train.recipe import LinearRecipe


def __getattr__(name: str):  # the trainer pulls in transformers: import it on first use
    if name in ("EmbeddedTrainer", "apply_plan", "plan_for_model"):
        from miles_lp.train import embedded

        return getattr(embedded, name)
    raise AttributeError(name)


__all__ = ["EmbeddedTrainer", "LinearRecipe", "MegatronSection", "QuantExperts", "QuantLinear", "TrainConfig",
           "WeightGrid", "apply_plan", "executed_quantized", "invalidate_grids", "invalidate_on_step",
           "learner_weights", "load_train_config", "parse_train_config", "plan_for_model", "quantized_linear"]
