"""Run checkpoints through vLLM's CPU build and report what it served. Runs in the vLLM venv, not in pytest.

    build/venv-vllm/bin/python tests/readers/vllm_runner.py JOBS.json OUT.json

``JOBS.json``: ``{"prompts": [[token ids], ...], "jobs": [{"name": str, "model": dir}, ...]}``. For each job
(one process, engines built one after the other: the imports are paid once) ``OUT.json`` gets either
``{"error": "<type>: <first line>"}`` or ``{"prompt_logprobs": [[lp of token t given tokens < t, t >= 1]],
"kernels": {layer class/kernel: count}, "warnings": [...], "seconds": float}``.

``__main__`` guard: vLLM may spawn worker processes that re-import the main module.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time


def _kernels(model) -> dict[str, int]:
    """Which quant method / scheme / kernel each linear layer of the live model runs (C1: read the engine)."""
    out: dict[str, int] = {}
    for _, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if qm is None:
            continue
        scheme = getattr(mod, "scheme", None)
        kernel = getattr(scheme, "kernel", None) or getattr(qm, "kernel", None)
        key = "/".join(x for x in (type(mod).__name__, type(qm).__name__,
                                   type(scheme).__name__ if scheme is not None else "",
                                   type(kernel).__name__ if kernel is not None else "") if x)
        out[key] = out.get(key, 0) + 1
    return out


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage().splitlines()[0][:300])


def run(jobs_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model(_kernels) below
    from vllm import LLM, SamplingParams

    spec = json.load(open(jobs_path))
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    results = {}
    collect = _Collect()
    logging.getLogger("vllm").addHandler(collect)
    for job in spec["jobs"]:
        t0 = time.perf_counter()
        collect.messages = []
        llm = None
        try:
            llm = LLM(model=job["model"], skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                      max_model_len=256, max_num_seqs=8, seed=0, distributed_executor_backend="uni")
            kernels = llm.apply_model(_kernels)[0]
            outs = llm.generate(prompts, sp, use_tqdm=False)
            lps = []
            for p, o in zip(spec["prompts"], outs, strict=True):
                row = []
                for t, d in zip(p[1:], o.prompt_logprobs[1:], strict=True):
                    row.append(float(d[t].logprob))
                lps.append(row)
            results[job["name"]] = {"prompt_logprobs": lps, "kernels": kernels,
                                    "seconds": time.perf_counter() - t0,
                                    "warnings": sorted(set(collect.messages))}
        except Exception as exc:  # report, go on with the next job
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            results[job["name"]] = {"error": f"{type(exc).__name__}: {first}"[:500],
                                    "seconds": time.perf_counter() - t0,
                                    "warnings": sorted(set(collect.messages))}
        finally:
            del llm
            gc.collect()
        print(f"[vllm_runner] {job['name']}: {json.dumps(results[job['name']])[:300]}", file=sys.stderr,
              flush=True)
        with open(out_path, "w") as f:  # after every job: a crash later keeps the earlier results
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2])
