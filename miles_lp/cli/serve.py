"""``miles-lp serve CKPT``: the reference engine behind SGLang's HTTP subset (``miles_lp.rollout.server``)."""

from __future__ import annotations

HELP = "serve a converted (or BF16) checkpoint with the reference engine over SGLang's HTTP API subset"
DESCRIPTION = HELP + """

Endpoints (SGLang's paths and bodies): POST /generate, /update_weights_from_disk, /update_weights_from_tensor
(safetensors body, loopback callers), /pause_generation, /continue_generation, /flush_cache; GET /health,
/get_weight_version; plus miles-lp introspection under /miles_lp/ (quantized_params, weight_digests,
storage_pointers, self_check, read_weights, param_specs, health).

As SGLang: /pause_generation without a mode aborts the in-flight requests (finish_reason abort); send
{"mode": "retract"} (what `miles-lp run` sends) to park them until /continue_generation, or "in_place". A
/generate whose prompt + max_new_tokens exceeds the model's context (max_position_embeddings) is answered 400.

Binds 127.0.0.1 unless --host says otherwise. With MILES_LP_API_KEY (or SGLANG_API_KEY) set, every request but
GET /health needs `Authorization: Bearer <key>`; others get 401. A --host other than loopback without a key is
refused (anyone who reaches the port could load weights from any path on this machine) unless
--no-auth-on-network says that is intended.

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
    p.add_argument("--no-auth-on-network", action="store_true",
                   help="allow a non-loopback --host without an API key (refused otherwise)")


def run(args) -> int:
    import errno
    import ipaddress
    import re
    import sys

    from miles_lp.errors import ConfigError
    from miles_lp.rollout.reference import ReferenceEngine
    from miles_lp.rollout.server import EngineServer, api_key_from_env

    key = api_key_from_env()
    try:
        loopback = args.host == "localhost" or ipaddress.ip_address(args.host).is_loopback
    except ValueError:  # a host name: only localhost is known to be loopback
        loopback = False
    if not loopback and key is None and not args.no_auth_on_network:
        raise ConfigError(f"--host {args.host}: serving beyond this host without an API key lets anyone who reaches "
                          "the port generate and load weights from any path here; set MILES_LP_API_KEY, or pass "
                          "--no-auth-on-network if that is intended")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be 0-65535 (0: any free port), got {args.port}")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device):
        raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N, got '{args.device}'")
    if args.pause_timeout < 0:
        raise ConfigError(f"--pause-timeout must be >= 0 seconds, got {args.pause_timeout}")
    engine = ReferenceEngine(args.checkpoint, device=args.device, dtype=args.dtype, kv_cache=args.kv_cache,
                             threads=args.threads, pause_timeout_s=args.pause_timeout)
    try:
        server = EngineServer(engine, args.host, args.port, key, verbose=args.verbose)
    except OSError as exc:
        engine.close()
        raise ConfigError(f"cannot listen on {args.host}:{args.port} (--host / --port): {exc.strerror or exc}"
                          + ("; another process holds the port: choose another --port, or 0 for any free one"
                             if exc.errno == errno.EADDRINUSE else "")) from None
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
