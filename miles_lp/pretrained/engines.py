"""The real model, converted per format, served by the engines that run here, against the learner.

    python -m miles_lp.pretrained.engines --formats bf16 mxfp8 nvfp4 --engines reference vllm --out engines.json

For each format: ``miles-lp convert`` of the materialized model (NVFP4: the last 15% of the layers BF16, as
recipes/smollm2-nvfp4.yaml), the learner on the same policy (the embedded trainer, BF16 compute on FP32 masters:
what vLLM's bf16 emulation computes in), and each engine loading the converted folder. On held-out arithmetic
prompts: teacher-forced log-probs of the BF16 greedy answers (engine ``score`` vs learner ``logprobs``: max and
mean |diff|), and the engine's own greedy answers against the BF16 learner's (agreement rate).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from miles_lp.errors import BackendUnavailable, MilesLPError
from miles_lp.pretrained.output import print_json

NVFP4_BF16_RULE = [{"layers": "last 15%", "format": "bf16"}]


def policy_for(fmt: str):
    from miles_lp.config import Where
    from miles_lp.policy.policy import parse_policy

    doc = {"default": fmt, "backward": "dequantized"} if fmt != "bf16" else {"default": "bf16"}
    if fmt == "nvfp4":
        doc.update(activation_scale="per_token", rules=NVFP4_BF16_RULE)
    return parse_policy(doc, Where("<engines>", "precision"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m miles_lp.pretrained.engines", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", nargs="+", default=["bf16", "mxfp8", "nvfp4"])
    p.add_argument("--engines", nargs="+", default=["reference", "vllm"], choices=["reference", "vllm"])
    p.add_argument("--n", type=int, default=16, help="held-out prompts")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from miles_lp.checkpoint.convert import convert_checkpoint
    from miles_lp.pretrained import materialize
    from miles_lp.pretrained.evaluate import greedy_answers
    from miles_lp.rl.tasks import TaskConfig, make_task
    from miles_lp.rollout.engine import SamplingParams
    from miles_lp.train.config import TrainConfig
    from miles_lp.train.embedded import EmbeddedTrainer, plan_for_model

    result: dict = {"formats": {}}
    try:
        model_dir = materialize(log=lambda m: print(m, file=sys.stderr))
        task = make_task(TaskConfig(name="arithmetic", max_value=10, style="direct",
                                    system_prompt="You are a careful calculator."), None, model_dir)
        prompts = [list(q.ids) for q in task.heldout(args.n)]
        train_cfg = TrainConfig(device="cpu", param_dtype="bf16")
        bf16 = EmbeddedTrainer(model_dir, None, train_cfg)
        bf16.model.eval()
        ref_answers = greedy_answers(bf16.model, prompts, args.max_new_tokens, task.stop_token_ids, task.eos_id)
        seqs = [q + a for q, a in zip(prompts, ref_answers, strict=True)]
        starts = [len(q) - 1 for q in prompts]
        result["bf16_greedy_examples"] = [task.response_text(a) for a in ref_answers[:4]]
        del bf16
        tmp = Path(tempfile.mkdtemp(prefix="miles-lp-engines-"))
        for fmt in args.formats:
            policy = policy_for(fmt)
            plan = plan_for_model(policy, model_dir) if fmt != "bf16" else None
            learner = EmbeddedTrainer(model_dir, plan, train_cfg)
            lp_learner, _ = learner.logprobs([torch.tensor(s) for s in seqs])
            del learner
            row: dict = {}
            for engine_name in args.engines:
                target = "vllm" if engine_name == "vllm" else "sglang"
                ckpt = model_dir
                if fmt != "bf16":
                    ckpt = tmp / f"{fmt}-{target}"
                    if not ckpt.exists():
                        convert_checkpoint(model_dir, ckpt, policy, target=target, progress=False)
                try:
                    if engine_name == "vllm":
                        from miles_lp.rollout.vllm import VLLMEngine

                        engine = VLLMEngine(ckpt, dtype="bfloat16", max_model_len=256,
                                            log_path=tmp / f"vllm-{fmt}.log")
                    else:
                        from miles_lp.rollout.reference import ReferenceEngine

                        engine = ReferenceEngine(ckpt, device="cpu", dtype="bf16")
                except BackendUnavailable as exc:
                    row[engine_name] = {"skipped": str(exc)[:200]}
                    continue
                try:
                    lp_engine = engine.score(seqs)
                    d = torch.cat([(e - lr)[s:] for e, lr, s in zip(lp_engine, lp_learner, starts, strict=True)])
                    sp = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens,
                                        stop_token_ids=tuple(task.stop_token_ids))
                    greedy = [list(g.output_ids) for g in engine.generate(prompts, sp)]
                finally:
                    engine.close()
                agree = sum(a == b for a, b in zip(greedy, ref_answers, strict=True)) / len(prompts)
                correct = sum(task.reward(q, g) for q, g in zip(task.heldout(args.n), greedy, strict=True)) / len(prompts)
                row[engine_name] = {"max_abs_logprob_diff": float(d.abs().max()),
                                    "mean_abs_logprob_diff": float(d.abs().mean()),
                                    "greedy_agreement_with_bf16": agree, "heldout_accuracy": correct,
                                    "greedy_examples": [task.response_text(g) for g in greedy[:4]]}
                print(fmt, engine_name, json.dumps(row[engine_name]), file=sys.stderr, flush=True)
            result["formats"][fmt] = row
    except MilesLPError as exc:
        print(f"engines: error: {exc}", file=sys.stderr)
        return 2
    print_json(result, args.out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
