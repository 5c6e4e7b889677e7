"""The reference engine and the learner compute one NVFP4 function: on the same tokens in the same shape (one
sequence, teacher-forced), with BF16 and with FP32 activations, their log-probs are equal to the bit. Both take the
GEMM operand dtype from the format's scheme (``operand_dtype`` / ``gemm._recipe_operand_dtype``), decode the weight
with the same codec and quantize activations with a per-token global scale; the log-prob gaps of the real model in
docs/pretrained.md come from the shapes (packed rows, decode steps), not from a second rule."""

from __future__ import annotations

import pytest
import torch

from miles_lp.rollout.reference import ReferenceEngine
from miles_lp.rollout.testing import policy_for, tiny_checkpoint, tiny_hf

pytestmark = pytest.mark.usefixtures("one_thread")

SEQS = ([1, 5, 9, 2, 7, 3, 11, 4, 8], [3, 3, 6, 12, 1, 10], [2, 14, 6, 9, 9, 5, 1])


@pytest.mark.filterwarnings("ignore:train.param_dtype")  # fp32: the learner computes with fp32 weights
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_nvfp4_engine_score_equals_learner_bitwise(dtype):
    from miles_lp.train.config import TrainConfig
    from miles_lp.train.embedded import EmbeddedTrainer, plan_for_model
    from miles_lp.train.gemm import _recipe_operand_dtype
    from miles_lp.train.quant_linear import QuantLinear

    act = torch.bfloat16 if dtype == "bf16" else torch.float32
    engine = ReferenceEngine(tiny_checkpoint("llama", "nvfp4"), device="cpu", dtype=dtype)
    src = tiny_hf("llama")
    trainer = EmbeddedTrainer(src, plan_for_model(policy_for("nvfp4"), src), TrainConfig(device="cpu", param_dtype=dtype))
    trainer.model.eval()
    try:
        quant = [m for m in trainer.model.modules() if isinstance(m, QuantLinear) and m.grid is not None]
        assert quant, "the learner has no quantized linear"
        learner_ops = {_recipe_operand_dtype(torch.empty(0, dtype=act), m.grid.recipe) for m in quant}
        learner_scopes = {m.grid.recipe.nvfp4_row_scope for m in quant}
        nvfp4 = [m for m in engine._linears if m.kernel_format is not None and m.kernel_format.quantized]
        assert len(nvfp4) == len(quant)
        assert {m.op_dtype for m in nvfp4} == learner_ops == {act}
        assert {m.activation_scale for m in nvfp4} == {"token"} and learner_scopes == {"row"}
        for seq in SEQS:
            eng = engine.score([seq])[0]
            lrn = trainer.logprobs([torch.tensor(seq)])[0][0]
            assert torch.equal(eng, lrn.to(eng.dtype)), (dtype, seq, float((eng - lrn).abs().max()))
    finally:
        engine.close()
