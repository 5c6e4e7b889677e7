"""The real model, converted per format, served by every engine that runs here, against the learner.

    miles-lp pretrained compare --formats bf16 mxfp8 nvfp4 --engines reference transformers vllm sglang --out c.json
    python -m miles_lp.pretrained.engines ...                                                    # the same tool

For each format: ``miles-lp convert`` of the materialized model for the engine's target (NVFP4: the last 15% of
the layers BF16, as recipes/smollm2-nvfp4.yaml), the learner on the same policy (the embedded trainer, BF16
compute on FP32 masters, ``train.param_dtype: bf16``, as every smollm2 recipe), and each engine loading the
converted folder:

- ``reference``: our engine (``--target sglang`` folder), BF16 activations;
- ``transformers``: ``AutoModelForCausalLM`` on the ``--target compressed-tensors`` folder (compressed-tensors'
  default path: weights kept compressed, activations fake-quantized as the config declares), bf16;
- ``vllm``: vLLM 0.32 CPU in its own venv (``MILES_LP_VLLM_PYTHON``) on the ``--target vllm`` folder, through the
  miles_lp plugin (MXFP8 emulated as W8A16: activations not quantized; NVFP4 with the static input scale);
- ``sglang``: real SGLang 0.5.23 on its CPU platform started by the client (``rollout.server: launch``;
  ``MILES_LP_SGLANG_PYTHON``) on the ``--target sglang`` folder, MXFP8 / NVFP4 through our CPU linear method.

On a fixed set of held-out arithmetic prompts (never drawn in training), each engine answers greedily. Figures:

- ``max_abs_logprob_diff`` / ``mean_abs_logprob_diff``: the engine's own log-prob of each token of its greedy
  answers (raw: the policy at temperature 1, what a rollout reports) against the format's learner's
  teacher-forced log-prob of the same tokens (what ``rollout_corr/*`` compares in a run); transformers' figure is
  its teacher-forced forward of its own answers;
- ``greedy_agreement_with_bf16``: the share of prompts whose greedy answer (token ids, the stop token left out)
  equals the BF16 learner's; ``heldout_accuracy``: the task's reward of the engine's answers.

An engine that cannot start here is reported ``skipped`` with the reason; one that fails on a format is reported
``failed`` with the error. Nothing is left out silently.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_lp.errors import BackendUnavailable, MilesLPError
from miles_lp.pretrained.output import print_json

if TYPE_CHECKING:
    import torch

NVFP4_BF16_RULE = [{"layers": "last 15%", "format": "bf16"}]
FORMATS = ("bf16", "mxfp8", "nvfp4")
ENGINES = ("reference", "transformers", "vllm", "sglang")
#: the converter target each engine reads
TARGET = {"reference": "sglang", "sglang": "sglang", "vllm": "vllm", "transformers": "compressed-tensors"}


def policy_for(fmt: str):
    from miles_lp.config import Where
    from miles_lp.policy.policy import parse_policy

    doc = {"default": fmt, "backward": "dequantized"} if fmt != "bf16" else {"default": "bf16"}
    if fmt == "nvfp4":
        doc.update(activation_scale="per_token", rules=NVFP4_BF16_RULE)
    return parse_policy(doc, Where("<engines>", "precision"))


def strip_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """The answer up to its first stop token (left out): engines differ in whether they return it."""
    out = []
    for t in ids:
        if t in stop_ids:
            break
        out.append(int(t))
    return out


def agreement(answers: Sequence[Sequence[int]], reference: Sequence[Sequence[int]], stop_ids: Sequence[int]) -> int:
    """How many answers equal the reference's (token ids up to the first stop token)."""
    return sum(strip_stop(a, stop_ids) == strip_stop(b, stop_ids) for a, b in zip(answers, reference, strict=True))


def logprob_gap(engine_lp: Sequence[torch.Tensor], learner_full: Sequence[torch.Tensor],
                prompt_lens: Sequence[int]) -> torch.Tensor:
    """Per answer token: engine log-prob - learner log-prob. ``learner_full[i]`` holds the learner's log-probs of
    tokens 1..L-1 of prompt + answer, so the answer's start at ``prompt_len - 1``."""
    import torch

    diffs = []
    for e, lr, n in zip(engine_lp, learner_full, prompt_lens, strict=True):
        e = torch.as_tensor(e, dtype=torch.float64).flatten()
        lr = lr.double()[n - 1:]
        if len(e) != len(lr):
            raise MilesLPError(f"engine returned {len(e)} log-probs for an answer of {len(lr)} tokens")
        diffs.append(e - lr)
    return torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)


class TransformersEngine:
    """transformers as a sampler for this comparison: greedy ``generate`` and a teacher-forced forward for the
    log-probs of its own answers (``generate``'s scores would be the same logits)."""

    def __init__(self, path: Path, stop_ids: Sequence[int], pad_id: int):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
        self.model.eval()
        self.stop_ids, self.pad_id = list(stop_ids), pad_id

    def greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> tuple[list[list[int]], list[torch.Tensor]]:
        import torch

        from miles_lp.pretrained.evaluate import greedy_answers

        answers = greedy_answers(self.model, prompts, max_new_tokens, self.stop_ids, self.pad_id)
        lps = []
        with torch.no_grad():
            for p, a in zip(prompts, answers, strict=True):
                ids = torch.tensor([list(p) + list(a)])
                logits = self.model(input_ids=ids).logits[0, :-1].float()
                lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
                lps.append(lp[len(p) - 1:])
        return answers, lps

    def close(self) -> None:
        del self.model


def start_engine(name: str, ckpt: Path, workdir: Path, max_len: int):
    """One engine on ``ckpt``; raises ``BackendUnavailable`` where it cannot run here."""
    if name == "vllm":
        from miles_lp.rollout.vllm import VLLMEngine

        return VLLMEngine(ckpt, dtype="bfloat16", max_model_len=max_len, log_path=workdir / f"vllm-{ckpt.name}.log")
    if name == "sglang":
        from miles_lp.rollout.sglang import SGLangHTTPEngine
        from miles_lp.rollout.sglang_cpu.launch import sglang_python

        if sglang_python() is None:
            from miles_lp.rollout.sglang_cpu.launch import sglang_missing

            raise BackendUnavailable(sglang_missing())
        upd = workdir / f"sglang-{ckpt.name}" / "updates"
        upd.parent.mkdir(parents=True, exist_ok=True)
        return SGLangHTTPEngine(None, flavor="launch", checkpoint=ckpt, update_dir=upd)
    from miles_lp.rollout.reference import ReferenceEngine

    return ReferenceEngine(ckpt, device="cpu", dtype="bf16")


def engine_greedy(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  stop_ids: Sequence[int]) -> tuple[list[list[int]], list[torch.Tensor]]:
    from miles_lp.rollout.engine import SamplingParams

    if isinstance(engine, TransformersEngine):
        return engine.greedy(prompts, max_new_tokens)
    sp = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=tuple(stop_ids))
    gens = engine.generate([list(p) for p in prompts], sp)
    return [list(g.output_ids) for g in gens], [g.logprobs for g in gens]


def compare(formats: Sequence[str], engines: Sequence[str], n: int, max_new_tokens: int, workdir: Path,
            log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> dict[str, Any]:
    import torch

    from miles_lp.checkpoint.convert import convert_checkpoint
    from miles_lp.pretrained import materialize
    from miles_lp.pretrained.evaluate import greedy_answers
    from miles_lp.rl.tasks import TaskConfig, make_task
    from miles_lp.train.config import TrainConfig
    from miles_lp.train.embedded import EmbeddedTrainer, plan_for_model

    model_dir = materialize(log=log)
    task = make_task(TaskConfig(name="arithmetic", max_value=10, style="direct",
                                system_prompt="You are a careful calculator."), None, model_dir)
    held = task.heldout(n)
    prompts = [list(q.ids) for q in held]
    stop = list(task.stop_token_ids)
    train_cfg = TrainConfig(device="cpu", param_dtype="bf16")
    result: dict[str, Any] = {
        "model": str(model_dir), "prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "task": "arithmetic direct, max_value 10, held-out problems", "load_average_start": os.getloadavg(),
        "formats": {}}
    t0 = time.perf_counter()
    bf16 = EmbeddedTrainer(model_dir, None, train_cfg)
    bf16.model.eval()
    ref_answers = greedy_answers(bf16.model, prompts, max_new_tokens, stop, task.eos_id)
    del bf16
    result["bf16_learner"] = {
        "heldout_accuracy": sum(task.reward(q, a) for q, a in zip(held, ref_answers, strict=True)) / len(held),
        "examples": [task.response_text(a) for a in ref_answers[:4]], "seconds": time.perf_counter() - t0}
    log(f"bf16 learner greedy: {result['bf16_learner']}")
    for fmt in formats:
        policy = policy_for(fmt)
        plan = plan_for_model(policy, model_dir) if fmt != "bf16" else None
        learner = EmbeddedTrainer(model_dir, plan, train_cfg)
        learner.model.eval()
        own = greedy_answers(learner.model, prompts, max_new_tokens, stop, task.eos_id)
        row: dict[str, Any] = {"learner": {
            "greedy_agreement_with_bf16": agreement(own, ref_answers, stop) / len(prompts),
            "heldout_accuracy": sum(task.reward(q, a) for q, a in zip(held, own, strict=True)) / len(held),
            "quantized_tensors": 0 if plan is None else len(plan.quantized())}}
        for name in engines:
            t1 = time.perf_counter()
            ckpt = model_dir
            if fmt != "bf16":
                ckpt = workdir / f"{fmt}-{TARGET[name]}"
                if not (ckpt / "config.json").is_file():
                    convert_checkpoint(model_dir, ckpt, policy, target=TARGET[name], overwrite=True, progress=False)
            try:
                engine = (TransformersEngine(ckpt, stop, task.eos_id) if name == "transformers"
                          else start_engine(name, ckpt, workdir, max_len=256))
            except BackendUnavailable as exc:
                row[name] = {"skipped": str(exc)[:300]}
                log(f"{fmt} {name}: skipped: {exc}")
                continue
            except Exception as exc:  # an engine that refuses a format is a result here, not a crash
                row[name] = {"failed": f"{type(exc).__name__}: {str(exc)[-400:]}"}
                log(f"{fmt} {name}: failed to start: {exc}")
                continue
            try:
                t_load = time.perf_counter() - t1
                answers, lps = engine_greedy(engine, prompts, max_new_tokens, stop)
            except Exception as exc:
                row[name] = {"failed": f"{type(exc).__name__}: {str(exc)[-400:]}"}
                log(f"{fmt} {name}: failed: {exc}")
                continue
            finally:
                engine.close()
            full, _ = learner.logprobs([torch.tensor(list(p) + list(a)) for p, a in zip(prompts, answers, strict=True)])
            d = logprob_gap(lps, full, [len(p) for p in prompts])
            agree = agreement(answers, ref_answers, stop)
            row[name] = {
                "max_abs_logprob_diff": float(d.abs().max()) if len(d) else None,
                "mean_abs_logprob_diff": float(d.abs().mean()) if len(d) else None, "tokens": int(len(d)),
                "greedy_agreement_with_bf16": agree / len(prompts), "agree": agree, "n": len(prompts),
                "heldout_accuracy": sum(task.reward(q, a) for q, a in zip(held, answers, strict=True)) / len(held),
                "examples": [task.response_text(a) for a in answers[:4]],
                "load_seconds": t_load, "seconds": time.perf_counter() - t1, "load_average": os.getloadavg()[0]}
            log(f"{fmt} {name}: {json.dumps(row[name])}")
        del learner
        result["formats"][fmt] = row
    result["seconds"] = time.perf_counter() - t0
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--n", type=int, default=16, help="held-out prompts (default 16; max_value 10 has 18)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--workdir", default=None, help="where the converted folders go (default a temporary folder)")


def run(args) -> int:
    try:
        if args.n < 1 or args.max_new_tokens < 1:
            raise MilesLPError(f"--n {args.n} and --max-new-tokens {args.max_new_tokens} must be >= 1")
        if args.workdir:
            work = Path(args.workdir)
            work.mkdir(parents=True, exist_ok=True)
            result = compare(args.formats, args.engines, args.n, args.max_new_tokens, work)
        else:
            with tempfile.TemporaryDirectory(prefix="miles-lp-compare-") as tmp:
                result = compare(args.formats, args.engines, args.n, args.max_new_tokens, Path(tmp))
    except MilesLPError as exc:
        print(f"compare: error: {exc}", file=sys.stderr)
        return 2
    print_json(result, args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m miles_lp.pretrained.engines", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--out", default=None, help="also write the result as JSON here")
    return run(p.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
