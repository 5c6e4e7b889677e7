"""``miles-lp bench rollout``: generated tokens per second at batch 32, side by side in one run.

Rows, all on the same random model and prompts (every row generates exactly ``--new-tokens`` per sequence:
no stop tokens, sampling at temperature 1):

* ``transformers generate``: ``model.generate(do_sample=True)`` on the BF16 checkpoint (the anchor), in the
  dtype the reference engine computes in (fp32 on CPU, bf16 on CUDA);
* ``reference <precision>``: the embedded reference engine serving the BF16 checkpoint and the converted ones
  (``--precisions``, e.g. ``bf16,mxfp8``: MXFP8 adds the emulated activation quantization);
* ``vllm bf16`` (CPU, where the vLLM venv exists): vLLM's offline engine on the same BF16 checkpoint.

``--decode auto,eager`` adds each reference row once per decode path (``MILES_LP_DECODE``; ``auto``: the static
KV cache with CUDA-graph replay of ``rollout.cuda_decode`` where it applies, ``eager``: transformers' forward per
step). ``--fp8-decode-gemm auto,scaled_mm`` adds each ``fp8_block`` row once per decode GEMM
(``runtime.fp8_decode_gemm``). Each row reports the graphs it captured and its ratio to the reference engine's first BF16 row.
Targets on the H200 (0.5B, batch 32, 128 new tokens): BF16 >= 5x ``generate``, fp8_block >= 1.2x and MXFP8
>= 0.8x our BF16.

Models (``--model``; ``--num-layers`` overrides the layer count of any, e.g. a 1-layer smoke run on CPU):

* ``tiny``: the 4-layer tiny Qwen3 of the tests;
* ``0.5b``: a random Qwen3 of Qwen2.5-0.5B's shape (24 layers, hidden 896, intermediate 4864, 14 heads / 2 KV
  heads, vocab 151936, tied embeddings; ~0.5B parameters). Every decode GEMM is latency-bound here (3.5-7 us in
  BF16 for 0.4-9 MB of weights), so FP8 weights cannot win at this size;
* ``8b``: a random Qwen3 of Qwen3-8B's widths (36 layers, hidden 4096, intermediate 12288, 32 heads / 8 KV heads of
  128, vocab 151936, untied lm_head, rope theta 1e6; ~8.2B parameters, 16 GB in bf16; ``--num-layers 8``: ~3B).
  Its decode GEMMs read 34-201 MB of BF16 weight each (385 MB per layer): bandwidth-bound, where FP8's half the
  bytes can show.

The random weights are initialised on ``--device`` in bf16 and saved as safetensors (on CUDA the 8B build takes
seconds; on CPU use ``--num-layers 1``). Targets: the reference engine at least matches ``transformers generate``
(ratio >= 1); fp8_block >= 1.2x our BF16 (H200, batch 32) on the 8b model.
"""

from __future__ import annotations

import json
import time

from miles_lp import devices as cli_args
from miles_lp.config import runtime_override

HELP = "generated tokens/s at batch 32: reference engine vs transformers generate (and vLLM CPU where installed)"
DESCRIPTION = HELP + """

  miles-lp bench rollout                                  # tiny Qwen3 on CPU, bf16 + mxfp8, vLLM if installed
  miles-lp bench rollout --model 0.5b --device cuda --new-tokens 128
  miles-lp bench rollout --model 8b --num-layers 8 --device cuda --precisions bf16,fp8_block --vllm off
"""


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", choices=("tiny", *MODELS),
                   help="tiny (default), 0.5b or 8b (random Qwen3s of Qwen2.5-0.5B's / Qwen3-8B's widths)")
    p.add_argument("--device", type=cli_args.torch_device, default="cpu", help="cpu (default) | cuda")
    p.add_argument("--num-layers", type=int, default=None,
                   help="override the model's decoder layers (e.g. a 1-layer 8b smoke run on CPU, 8 on one H200 "
                   "call)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--precisions", default="bf16,mxfp8",
                   help="reference engine rows (bf16, mxfp8, nvfp4, fp8_block, fp8_block+pow2)")
    p.add_argument("--decode", default="auto", help="decode paths per reference row, comma-separated: auto, eager, "
                   "static (MILES_LP_DECODE)")
    p.add_argument("--fp8-decode-gemm", default="auto",
                   help="fp8_block rows once per decode GEMM, comma-separated: auto, triton, scaled_mm "
                   "(runtime.fp8_decode_gemm: the Triton decode GEMM or cuBLAS's block-scaled GEMM)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU; default: torch's)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row (the best is reported)")
    p.add_argument("--vllm", default="auto", choices=("auto", "off"), help="add the vLLM CPU row when available")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows to this JSON file")


def qwen3_05b_config(num_layers: int = 24):
    """A Qwen3 of Qwen2.5-0.5B's widths (tied embeddings)."""
    import transformers

    return transformers.Qwen3Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                    num_hidden_layers=num_layers,
                                    num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                                    max_position_embeddings=4096, tie_word_embeddings=True)


def qwen3_8b_config(num_layers: int = 36):
    """A Qwen3 of Qwen3-8B's widths (untied lm_head, rope theta 1e6)."""
    import transformers

    return transformers.Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                    num_hidden_layers=num_layers,
                                    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                    max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=1e6,
                                    rms_norm_eps=1e-6)


#: ``--model`` name -> (config builder, default layers, checkpoint folder name)
MODELS = {"0.5b": (qwen3_05b_config, 24, "qwen3-0.5b-random"), "8b": (qwen3_8b_config, 36, "qwen3-8b-random")}


def _model(kind: str, device: str, root, num_layers: int | None = None):
    """The BF16 HF checkpoint folder of the benchmark model (random weights built on ``device``)."""
    from pathlib import Path

    if kind == "tiny":
        from miles_lp.rollout.testing import tiny_hf

        return tiny_hf("qwen3", num_layers=num_layers or 4)
    import torch
    import transformers

    config, layers, name = MODELS[kind]
    out = Path(root) / name
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config(num_layers or layers), dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    del model
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def _policy(precision: str):
    """``fp8_block+pow2``: fp8_block with power-of-two scales; any other name: the format's policy default."""
    from miles_lp.config import Where
    from miles_lp.policy import parse_policy
    from miles_lp.rollout.testing import policy_for

    if precision == "fp8_block+pow2":
        return parse_policy({"default": "fp8_block", "backward": "dequantized", "pow2_scales": True},
                            Where("<bench>", "precision"))
    return policy_for(precision)


def _convert(src, precision: str, device: str, root):
    from pathlib import Path

    from miles_lp.checkpoint.convert import convert_checkpoint

    out = Path(root) / f"{Path(src).name}-{precision.replace('+', '_')}"
    convert_checkpoint(src, out, _policy(precision), target="sglang", device=device, progress=False,
                       log=lambda s: None)
    return out


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(args) -> int:
    import tempfile

    import torch
    import transformers

    from miles_lp.rollout.engine import SamplingParams
    from miles_lp.rollout.reference import ReferenceEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    rows = []
    with tempfile.TemporaryDirectory(prefix="miles-lp-bench-rollout-") as root:
        src = _model(args.model, device, root, args.num_layers)
        cfg = transformers.AutoConfig.from_pretrained(src)
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=g)
        n_tokens = args.batch * args.new_tokens
        sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=0)

        # anchor: transformers generate on the BF16 checkpoint, in the engine's compute dtype
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dtype).to(device).eval()
        ids = prompts.to(device)
        mask = torch.ones_like(ids)

        def hf_generate(n=args.new_tokens, hf=hf):
            with torch.inference_mode():
                hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                            max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
            _sync(device)

        hf_generate(2)
        t = _best(hf_generate, args.repeats)
        rows.append({"backend": "transformers generate", "precision": "bf16", "seconds": t, "tokens_per_s": n_tokens / t})
        del hf, hf_generate  # the default argument holds the model too


        from miles_lp.rollout import cuda_decode

        decodes = [d.strip() for d in args.decode.split(",") if d.strip()]
        bad = [d for d in decodes if d not in cuda_decode.MODES]
        if bad:
            raise SystemExit(f"bench rollout: --decode {bad[0]!r}: choose from {', '.join(cuda_decode.MODES)}")
        gemms = [d.strip() for d in args.fp8_decode_gemm.split(",") if d.strip()]
        bad = [d for d in gemms if d not in cuda_decode.FP8_GEMMS]
        if bad or not gemms:
            raise SystemExit(f"bench rollout: --fp8-decode-gemm {(bad or [''])[0]!r}: choose from "
                             f"{', '.join(cuda_decode.FP8_GEMMS)}")
        for prec in [p.strip() for p in args.precisions.split(",") if p.strip()]:
            ck = src if prec == "bf16" else _convert(src, prec, device, root)
            eng = ReferenceEngine(ck, device=device)
            batch = prompts.tolist()
            for dec, gemm in [(d, m) for d in decodes for m in (gemms if prec.startswith("fp8_block") else gemms[:1])]:
                with runtime_override(decode=dec, fp8_decode_gemm=gemm):
                    eng.generate(batch, SamplingParams(max_new_tokens=2, seed=0))  # captures this batch's graph

                    def ref_generate(eng=eng, batch=batch):
                        eng.generate(batch, sp)
                        _sync(device)

                    t = _best(ref_generate, args.repeats)
                st = cuda_decode.stats(eng)
                row = {"backend": "reference engine", "decode": dec, "precision": prec, "seconds": t,
                       "tokens_per_s": n_tokens / t, "quantized_layers": eng.health()["quantized_layers"],
                       "graphs_captured": st.get("captures", 0) if st.get("graphs") else 0}
                if prec.startswith("fp8_block"):
                    row["fp8_decode_gemm"] = gemm
                rows.append(row)
            eng.close()
            del eng

        if args.vllm == "auto" and not device.startswith("cuda"):
            from miles_lp.rollout.vllm import VLLMEngine, vllm_python

            if vllm_python() is None:
                rows.append({"backend": "vllm", "precision": "bf16", "skipped": "no vLLM interpreter "
                             "(MILES_LP_VLLM_PYTHON / build/venv-vllm)"})
            else:
                v = VLLMEngine(src, max_num_seqs=max(64, args.batch), max_model_len=args.prompt_len + args.new_tokens + 8)
                try:
                    batch = prompts.tolist()
                    v.generate(batch[:2], SamplingParams(max_new_tokens=2, seed=0))
                    t = _best(lambda: v.generate(batch, sp), args.repeats)
                    rows.append({"backend": "vllm (CPU, offline LLM)", "precision": "bf16", "seconds": t,
                                 "tokens_per_s": n_tokens / t})
                finally:
                    v.close()

    anchor = rows[0]["tokens_per_s"]
    ours = next((r["tokens_per_s"] for r in rows if r["backend"] == "reference engine" and r["precision"] == "bf16"
                 and "skipped" not in r), None)
    layers = f" ({args.num_layers} layers)" if args.num_layers else ""
    print(f"bench rollout: model {args.model}{layers}, device {device}, batch {args.batch}, prompt {args.prompt_len}, "
          f"new tokens {args.new_tokens}, torch threads {torch.get_num_threads()}")
    print(f"  {'backend':<38} {'precision':<15} {'tokens/s':>10} {'vs generate':>12} {'vs our bf16':>12} {'graphs':>7}")
    for r in rows:
        if "skipped" in r:
            print(f"  {r['backend']:<38} {r['precision']:<15} {'skipped: ' + r['skipped']}")
            continue
        r["ratio_vs_generate"] = r["tokens_per_s"] / anchor
        mine = r["backend"] == "reference engine" and ours
        name = f"{r['backend']} ({r['decode']})" if "decode" in r else r["backend"]
        if "fp8_decode_gemm" in r:
            name = f"{r['backend']} ({r['decode']}, {r['fp8_decode_gemm']})"
        if mine:
            r["ratio_vs_reference_bf16"] = r["tokens_per_s"] / ours
        vs = f"{r['ratio_vs_reference_bf16']:>11.2f}x" if mine else f"{'':>12}"
        print(f"  {name:<38} {r['precision']:<15} {r['tokens_per_s']:>10.1f} {r['ratio_vs_generate']:>11.2f}x "
              f"{vs} {r.get('graphs_captured', ''):>7}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "rows": rows}, f,
                      indent=1, default=str)
    return 0
