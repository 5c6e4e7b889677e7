#!/usr/bin/env python
"""Where the NVFP4 reference engine's log-prob gap to the learner on SmolLM2-135M comes from (CPU).

The 16 held-out prompts of ``miles-lp pretrained compare`` (``--formats nvfp4 --engines reference``): the engine's
greedy answers with their decode-step log-probs, then the same tokens teacher-forced four ways: the learner on the
packed batch (what ``compare`` reports), the learner one sequence at a time, the engine one sequence at a time
(``ReferenceEngine.score``), and both models' plain forward on the worst sequence. Prints one JSON object.

    PYTHONPATH=. python scripts/smollm2_nvfp4_gap.py [--dtype bf16|fp32] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    import torch

    from miles_lp.checkpoint.convert import convert_checkpoint
    from miles_lp.pretrained import materialize
    from miles_lp.pretrained.engines import logprob_gap, policy_for
    from miles_lp.rl.tasks import TaskConfig, make_task
    from miles_lp.rollout.engine import SamplingParams
    from miles_lp.rollout.reference import ReferenceEngine
    from miles_lp.train.config import TrainConfig
    from miles_lp.train.embedded import EmbeddedTrainer, plan_for_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--workdir", default="/tmp/smollm2-nvfp4-gap")
    args = ap.parse_args()
    t0 = time.perf_counter()
    md = materialize(log=lambda m: None)
    task = make_task(TaskConfig(name="arithmetic", max_value=10, style="direct",
                                system_prompt="You are a careful calculator."), None, md)
    prompts = [list(q.ids) for q in task.heldout(16)]
    lens = [len(p) for p in prompts]
    policy = policy_for("nvfp4")
    learner = EmbeddedTrainer(md, plan_for_model(policy, md), TrainConfig(device="cpu", param_dtype=args.dtype))
    learner.model.eval()
    ckpt = Path(args.workdir) / "nvfp4-sglang"
    if not (ckpt / "config.json").is_file():
        convert_checkpoint(md, ckpt, policy, target="sglang", overwrite=True, progress=False)
    engine = ReferenceEngine(ckpt, device="cpu", dtype=args.dtype)
    sp = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=tuple(task.stop_token_ids))
    gens = engine.generate(prompts, sp)
    seqs = [p + list(g.output_ids) for p, g in zip(prompts, gens, strict=True)]
    decode = [g.logprobs for g in gens]
    packed, _ = learner.logprobs([torch.tensor(s) for s in seqs])
    alone = [learner.logprobs([torch.tensor(s)])[0][0] for s in seqs]
    score = engine.score(seqs)

    def gap(a, b):  # a: per answer token (decode) or full; b: full
        a = [x if len(x) == len(s) - n else x[n - 1:] for x, s, n in zip(a, seqs, lens, strict=True)]
        d = logprob_gap(a, b, lens).abs()
        return {"max": round(float(d.max()), 4), "mean": round(float(d.mean()), 4), "over_1_nat": int((d > 1).sum()),
                "tokens": len(d)}

    out = {"dtype": args.dtype,
           "engine_operand_dtypes": sorted({str(m.op_dtype) for m in engine._linears}),
           "engine_activation_scopes": sorted({m.activation_scale for m in engine._linears}),
           "engine_decode_vs_learner_packed": gap(decode, packed),
           "engine_decode_vs_engine_score": gap(decode, score),
           "learner_alone_vs_learner_packed": gap(alone, packed),
           "engine_score_vs_learner_alone": gap(score, alone)}
    d = logprob_gap(decode, packed, lens).abs()
    i, acc, k, j = int(d.argmax()), 0, 0, 0
    for n, g in enumerate(gens):
        if i < acc + len(g.output_ids):
            k, j = n, i - acc
            break
        acc += len(g.output_ids)
    pos = lens[k] - 1 + j
    ids = torch.tensor([seqs[k]])
    with torch.no_grad():
        lf = learner.model(input_ids=ids).logits[0].float()
        ef = engine.model(input_ids=ids).logits[0].float()
    top = lf[pos].log_softmax(-1).topk(2)
    out["worst_token"] = {
        "prompt": k, "answer_token": j, "text": task.response_text(seqs[k][lens[k]:lens[k] + j + 1]),
        "engine_decode": round(float(decode[k][j]), 3), "engine_score": round(float(score[k][pos]), 3),
        "learner_alone": round(float(alone[k][pos]), 3), "learner_packed": round(float(packed[k][pos]), 3),
        "learner_top2_at_position": [round(float(v), 3) for v in top.values],
        "forward_logits_equal_engine_learner": bool(torch.equal(lf, ef))}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    engine.close()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
