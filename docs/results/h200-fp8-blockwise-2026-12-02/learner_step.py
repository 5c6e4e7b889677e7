"""Train-stage time of the embedded learner on a random Qwen3 0.5B (Qwen2.5-0.5B's shape) on the H200: BF16,
MXFP8 (dequantized), fp8_block (quantized: native FP8 GEMMs), first and last layer BF16; 32 sequences x 512 tokens
per step (two 8192-token micro-batches); median of 5 steps after 2."""
import json
import os
import statistics
import tempfile
import time

import torch

from miles_lp.bench.rollout import _model
from miles_lp.config import Where
from miles_lp.policy import parse_policy
from miles_lp.train.config import TrainConfig
from miles_lp.train.embedded import EmbeddedTrainer, plan_for_model
from miles_lp.train.quant_linear import QuantLinear

root = tempfile.mkdtemp()
src = _model("0.5b", "cuda", root)
rules = [{"layers": "first 1", "format": "bf16"}, {"layers": "last 1", "format": "bf16"}]
arms = {"fp8_block+pow2/quantized": {"default": "fp8_block", "backward": "quantized", "pow2_scales": True, "rules": rules},
        "bf16": None,
        "fp8_block/quantized": {"default": "fp8_block", "backward": "quantized", "rules": rules},
        "mxfp8/dequantized": {"default": "mxfp8", "backward": "dequantized", "rules": rules}}
g = torch.Generator().manual_seed(0)
samples = [{"tokens": torch.randint(0, 151936, (512,), generator=g)} for _ in range(32)]
cfg = TrainConfig(device="cuda", lr=1e-5, master_dtype="fp32", param_dtype="bf16", micro_batch_tokens=8192)
out = {}
for name, raw in arms.items():
    plan = None if raw is None else plan_for_model(parse_policy(raw, Where("<bench>", "precision"), comparison_formats=True), src)
    tr = EmbeddedTrainer(src, plan, cfg)
    times, losses = [], []
    for i in range(12):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        st = tr.train_step(samples)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        losses.append(float(st["loss"]))
        if i >= 2:
            times.append(dt)
    native = sum(1 for m in tr.model.modules() if isinstance(m, QuantLinear) and m.recipe.format.value == "fp8_block"
                 and m.grid.quantize_calls > 0 and m.grid._t is None and m.grid._row is None)  # (grids dropped after the step)
    quant = sum(1 for m in tr.model.modules() if isinstance(m, QuantLinear))
    out[name] = {"step_s": statistics.median(times), "loss_first": losses[0], "loss_last": losses[-1],
                 "quant_linears": quant, "native_fp8_linears": native, "executed_quantized": len(tr.executed_quantized())}
    print(name, json.dumps(out[name]), flush=True)
    del tr
    torch.cuda.empty_cache()
base = out["bf16"]["step_s"]
for name, r in out.items():
    print(f"{name:26s} train step {r['step_s']*1000:8.1f} ms  x bf16 {r['step_s']/base:5.2f}  loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}  native {r['native_fp8_linears']}/{r['quant_linears']}")
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "learner_step.json"), "w"), indent=1)
