#!/usr/bin/env python
"""The embedded trainer (the default backend) on one device: tiny Qwen3 (MXFP8) and Qwen3-MoE (MXFP8 attention +
NVFP4 experts, transformers-5 fused experts), a few AdamW steps on a fixed batch.

Prints one line per case: loss per step, grads finite, how many quantized tensors the plan has and
learner_weights() yields, and whether every exported dense MXFP8 weight equals quantize_mxfp8 of its master
parameter byte for byte. Exits 1 on any failure.

    PYTHONPATH=. python scripts/h200_embedded_check.py [--device cuda|cpu] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = [("qwen3", "recipes/policies/qwen3-mxfp8.yaml"), ("qwen3_moe", "recipes/policies/qwen3-moe-mxfp8-nvfp4-experts.yaml")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    import torch
    import transformers

    from miles_lp.checkpoint.tiny import tiny_config
    from miles_lp.formats import quantize_mxfp8
    from miles_lp.formats.spec import Format
    from miles_lp.policy import load_policy
    from miles_lp.train import TrainConfig
    from miles_lp.train.embedded import EmbeddedTrainer, nll_loss, plan_for_model

    print(f"h200_embedded_check: torch {torch.__version__}, transformers {transformers.__version__}, "
          f"device {args.device}" + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    failures = 0
    for arch, recipe in CASES:
        cfg = tiny_config(arch, num_layers=4)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        trainer = EmbeddedTrainer(model, plan_for_model(load_policy(recipe), model),
                                  TrainConfig(lr=1e-3, seed=0, device=args.device, micro_batch_tokens=256))
        g = torch.Generator().manual_seed(1)
        samples = [{"tokens": torch.randint(0, cfg.vocab_size, (n,), generator=g)} for n in (100, 60, 90, 70)]
        losses, finite = [], True
        for _ in range(args.steps):
            stats = trainer.train_step(samples, nll_loss)
            losses.append(stats["loss"])
            finite &= bool(stats["finite"])
        exported = dict(trainer.learner_weights())
        planned = [n for n, e in trainer.plan.entries.items() if Format(e.format).quantized]
        params = dict(trainer.model.named_parameters())
        dense_equal = checked = 0
        for name, q in exported.items():
            if q.format is Format.MXFP8 and name in params:
                ref = quantize_mxfp8(params[name].detach())
                checked += 1
                dense_equal += int(torch.equal(ref.data.view(torch.uint8), q.data.view(torch.uint8))
                                   and torch.equal(ref.scale, q.scale))
        ok = (finite and losses[-1] < losses[0] and set(exported) == set(planned)
              and checked > 0 and dense_equal == checked)
        failures += not ok
        print(f"RAN embedded model={arch} recipe={recipe} device={trainer.device} "
              f"loss={' '.join(f'{x:.4f}' for x in losses)} grads_finite={finite} "
              f"quantized planned={len(planned)} exported={len(exported)} "
              f"mxfp8_dense_bytes_equal={dense_equal}/{checked} {'OK' if ok else 'FAIL'}")
    print(f"h200_embedded_check: {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
