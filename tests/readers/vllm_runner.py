"""Run checkpoints through vLLM's CPU build and report what it served. Runs in the vLLM venv, not in pytest.

    build/venv-vllm/bin/python tests/readers/vllm_runner.py JOBS.json OUT.json

``JOBS.json``: ``{"prompts": [[token ids], ...], "jobs": [{"name": str, "model": dir}, ...]}``. For each job
(one process, engines built one after the other: the imports are paid once) ``OUT.json`` gets either
``{"error": "<type>: <first line>"}`` or ``{"prompt_logprobs": [[lp of token t given tokens < t, t >= 1]],
"kernels": {layer class/quant method/scheme/kernel: count}, "seconds": float}``; with ``"weights_out": path``
the engine's effective linear weights (`_engine_weights`) are saved there. A job with ``"resolve":
{prefix: is_moe}`` builds no engine: it reports vLLM's own reading of a ModelOpt MIXED_PRECISION config.

``__main__`` guard: vLLM may spawn worker processes that re-import the main module.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time


def _resolve(model_dir: str, prefixes: dict[str, bool]) -> dict[str, str | None]:
    """vLLM's own reading of a ModelOpt MIXED_PRECISION config, without building an engine (quantized MoE
    experts cannot be built on CPU): ``is_layer_excluded``, ``_resolve_quant_algo``, then the dispatch tables
    of ``get_quant_method`` (vllm/model_executor/layers/quantization/modelopt.py)."""
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.layers.quantization.modelopt import LINEAR_ALGOS

    qc = json.load(open(os.path.join(model_dir, "config.json")))["quantization_config"]
    cfg = get_quantization_config("modelopt_mixed").from_config(qc)
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    moe_algos = {"FP8", "NVFP4", "W4A16_NVFP4", "MXFP8"}
    out = {}
    for prefix, moe in prefixes.items():
        algo = None if cfg.is_layer_excluded(prefix) else cfg._resolve_quant_algo(prefix)
        out[prefix] = algo if algo in (moe_algos if moe else LINEAR_ALGOS) else None
    return out


def _engine_weights(model) -> dict:
    """Every linear's weight AS THE LIVE ENGINE WILL MULTIPLY IT, in BF16, under vLLM's module names: the
    MXFP8 emulation's load-time dequantization; the NVFP4 emulation's inputs dequantized with vLLM's own
    ``dequantize_to_dtype`` (packed E2M1, E4M3 block scales, the ONE global scale it kept for a fused module);
    BF16 weights as they are. Compared with our dequantization in the test (C2 against the engine)."""
    import torch
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

    out = {}
    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        w = getattr(mod, "weight", None)
        if qm is None or not isinstance(w, torch.Tensor) or w.dim() != 2 or "Embedding" in type(mod).__name__:
            continue
        kernel = getattr(getattr(mod, "scheme", None), "kernel", None) or getattr(qm, "kernel", None)
        kname = type(kernel).__name__ if kernel is not None else ""
        if kname == "EmulationNvFp4LinearKernel":
            w = dequantize_to_dtype(w.data.view(torch.uint8), mod.weight_scale.data, mod.weight_global_scale,
                                    torch.bfloat16, 16, swizzle=False)
        elif w.element_size() < 2:  # an MXFP8 weight left undequantized: vLLM's own decode
            from vllm.model_executor.layers.quantization.utils.mxfp8_utils import dequant_mxfp8_to_bf16

            w = dequant_mxfp8_to_bf16(w.data, mod.weight_scale.data)
        out[name] = w.detach().to(torch.bfloat16).contiguous().clone()
    return out


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


def run(jobs_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model(_kernels) below
    from vllm import LLM, SamplingParams

    spec = json.load(open(jobs_path))
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    results = {}
    for job in spec["jobs"]:
        t0 = time.perf_counter()
        llm = None
        try:
            if "resolve" in job:
                results[job["name"]] = {"resolved": _resolve(job["model"], job["resolve"]),
                                        "seconds": time.perf_counter() - t0}
            else:
                llm = LLM(model=job["model"], skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                          max_model_len=256, max_num_seqs=8, seed=0, distributed_executor_backend="uni")
                kernels = llm.apply_model(_kernels)[0]
                if job.get("weights_out"):
                    from safetensors.torch import save_file

                    save_file(llm.apply_model(_engine_weights)[0], job["weights_out"])
                outs = llm.generate(prompts, sp, use_tqdm=False)
                lps = [[float(d[t].logprob) for t, d in zip(p[1:], o.prompt_logprobs[1:], strict=True)]
                       for p, o in zip(spec["prompts"], outs, strict=True)]
                results[job["name"]] = {"prompt_logprobs": lps, "kernels": kernels,
                                        "seconds": time.perf_counter() - t0}
        except Exception as exc:  # report, go on with the next job
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            results[job["name"]] = {"error": f"{type(exc).__name__}: {first}"[:500],
                                    "seconds": time.perf_counter() - t0}
        finally:
            del llm
            gc.collect()
        print(f"[vllm_runner] {job['name']}: {json.dumps(results[job['name']])[:300]}", file=sys.stderr,
              flush=True)
        with open(out_path, "w") as f:  # after every job: a crash later keeps the earlier results
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2])
