"""``miles-lp serve CKPT``: the reference engine behind SGLang's HTTP subset (``miles_lp.rollout.server``)."""

from __future__ import annotations

HELP = "serve a converted (or BF16) checkpoint with the reference engine over SGLang's HTTP API subset"
DESCRIPTION = HELP + """

Endpoints (SGLang's paths and bodies): POST /generate, /update_weights_from_disk, /update_weights_from_tensor
(safetensors body, loopback callers), /pause_generation, /continue_generation, /flush_cache; GET /health,
/get_weight_version; plus miles-lp introspection under /miles_lp/ (quantized_params, weight_digests,
storage_pointers, self_check, read_weights, param_specs, health).

Binds 127.0.0.1 unless --host says otherwise. With MILES_LP_API_KEY (or SGLANG_API_KEY) set, every request but
GET /health needs `Authorization: Bearer <key>`; others get 401.

  miles-lp serve /tmp/tiny-mxfp8 --port 30000
  curl -s localhost:30000/generate -d '{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8},
       "return_logprob": true}'
"""


def add_arguments(p) -> None:
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint folder (`miles-lp convert` output or BF16 HF)")
    p.add_argument("--port", type=int, default=30000, help="TCP port (default 30000, SGLang's; 0 = any free port)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this host only)")
    p.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                   help="activation dtype (auto: fp32 on CPU, bf16 on CUDA, as the learner)")
    p.add_argument("--kv-cache", default="bf16", choices=("bf16", "fp8_e4m3"), help="KV cache precision")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--pause-timeout", type=float, default=600.0,
                   help="seconds a /generate request waits while generation is paused (default 600)")
    p.add_argument("--verbose", action="store_true", help="log every request")


def run(args) -> int:
    import sys

    from miles_lp.rollout.reference import ReferenceEngine
    from miles_lp.rollout.server import EngineServer, api_key_from_env

    engine = ReferenceEngine(args.checkpoint, device=args.device, dtype=args.dtype, kv_cache=args.kv_cache,
                             threads=args.threads, pause_timeout_s=args.pause_timeout)
    key = api_key_from_env()
    server = EngineServer(engine, args.host, args.port, key, verbose=args.verbose)
    h = engine.health()
    print(f"miles-lp serve: {args.checkpoint} ({h['model_type']}, target {h['target']}, quantized "
          f"{h['quantized_layers'] or 'none'}, {h['device']}, kv {h['kv_cache']}) on {server.url}"
          f"{' (API key required)' if key else ''}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        engine.close()
    return 0
