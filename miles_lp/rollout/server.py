"""``miles-lp serve``: an engine behind the subset of SGLang's HTTP API that RL uses (stdlib ``http.server``).

SGLang endpoints (same paths, bodies and answers as SGLang's ``http_server.py``, the parts RL reads)::

    POST /generate                     {"input_ids": [[...], ...] | [...], "sampling_params": {...},
                                        "return_logprob": bool, "return_routed_experts": bool}
                                       -> {"output_ids", "text": null, "meta_info": {"finish_reason": {"type":
                                       "stop"|"length"|"abort", ...}, "weight_version", "prompt_tokens",
                                       "completion_tokens", "output_token_logprobs": [[logprob, token_id, null]],
                                       "routed_experts"}} (a list for a batch)
    POST /update_weights_from_disk     {"model_path": DIR, "weight_version"?}
    POST /update_weights_from_tensor   body: one safetensors file (never pickle); query: finish=true|false,
                                       weight_version=N. finish=false keeps the update open for more buckets
                                       (generation is refused until a call with finish=true). Loopback callers only.
    POST /pause_generation {"mode": "abort"|"retract"|"in_place"} (default abort, as SGLang's), POST
    /continue_generation, POST /flush_cache
    A /generate whose prompt + max_new_tokens exceeds the context is a 400 with SGLang's message (``check_context``).
    GET  /health, GET /get_weight_version

miles-lp introspection (the sync checks ask the engine, not the config): ``GET /miles_lp/quantized_params``,
``/miles_lp/param_specs``, ``/miles_lp/storage_pointers``, ``/miles_lp/health``, ``POST /miles_lp/self_check``
``{"seed"}``, ``/miles_lp/weight_digests`` ``{"names": [...] | null}``, ``/miles_lp/read_weights`` ``{"names"}``
(answer: safetensors bytes), ``/miles_lp/abort_update`` ``{}`` (drop an open multi-bucket update where the engine
can: nothing written yet). A refused one-shot update (``finish=true`` on an engine not updating) is aborted at once.

Security: binds 127.0.0.1 unless told otherwise; with an API key (``MILES_LP_API_KEY`` or ``SGLANG_API_KEY``)
every request but ``GET /health`` needs ``Authorization: Bearer <key>`` (401 otherwise, compared in constant
time); request bodies are JSON or safetensors, with a size cap.
"""

from __future__ import annotations

import hmac
import json
import os
import socket
import threading
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from miles_lp.errors import MilesLPError
from miles_lp.rollout.engine import EngineBusy, SamplingParams

API_KEY_ENVS = ("MILES_LP_API_KEY", "SGLANG_API_KEY")
MAX_JSON_BYTES = 64 << 20
MAX_TENSOR_BYTES = 16 << 30
LOOPBACK = ("127.0.0.1", "::1", "localhost")

#: SGLang ``sampling_params`` keys we honour -> SamplingParams field
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "max_new_tokens": "max_new_tokens", "stop_token_ids": "stop_token_ids",
                 "sampling_seed": "seed", "seed": "seed", "logprob_mode": "logprob_mode"}
#: SGLang keys accepted when they mean "no change" (RL clients send them)
NEUTRAL = {"skip_special_tokens": None, "spaces_between_special_tokens": None, "no_stop_trim": None,
           "ignore_eos": None, "n": 1, "min_new_tokens": 0, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
           "presence_penalty": 0.0, "min_p": 0.0}


def api_key_from_env() -> str | None:
    for env in API_KEY_ENVS:
        v = os.environ.get(env)
        if v:
            return v
    return None


class BadRequest(MilesLPError, ValueError):
    pass


def _int_field(value, what: str) -> int | None:
    """An optional integer request field (``weight_version``, ``seed``) or ``BadRequest`` naming it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise BadRequest(f"'{what}' must be an integer, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise BadRequest(f"'{what}' must be an integer, got {value!r}") from None


def sampling_from_json(sp: Any, return_routed: bool) -> SamplingParams:
    """SGLang ``sampling_params`` -> ``SamplingParams``; unknown keys and non-neutral unsupported values refused."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be an object")
    kw: dict[str, Any] = {}
    for k, v in sp.items():
        if k in SAMPLING_KEYS:
            if k == "stop_token_ids":
                v = tuple(int(t) for t in (v or ()))
            kw[SAMPLING_KEYS[k]] = v
        elif k in NEUTRAL:
            neutral = NEUTRAL[k]
            if neutral is not None and v != neutral and v is not None:
                raise BadRequest(f"sampling_params.{k}={v!r} is not supported by this engine (only {neutral!r})")
        else:
            raise BadRequest(f"unknown sampling_params key '{k}'; supported: "
                             f"{', '.join(sorted(set(SAMPLING_KEYS) | set(NEUTRAL)))}")
    for k in ("temperature", "top_p"):
        if k in kw and not isinstance(kw[k], int | float):
            raise BadRequest(f"sampling_params.{k} must be a number, got {kw[k]!r}")
    for k in ("top_k", "max_new_tokens"):
        if k in kw and (not isinstance(kw[k], int) or isinstance(kw[k], bool)):
            raise BadRequest(f"sampling_params.{k} must be an integer, got {kw[k]!r}")
    s = SamplingParams(**kw, return_routed_experts=bool(return_routed))
    s.validate()
    return s


def check_context(batch: list[list[int]], max_new_tokens: int | None, context_len: int | None) -> None:
    """A request whose prompt + ``max_new_tokens`` (when it names one) exceeds the model's context is refused with
    SGLang's message (its tokenizer manager's ``_validate_one_request``; the server answers 400) before the engine
    sees it (a response cut at the context would read as ``length``). The ReferenceEngine refuses the
    same condition itself (00ced2b) with its own message; here a client written against SGLang gets SGLang's words.
    prompt + max_new_tokens == context fits. A prompt that alone fills the context is the engine's own refusal (also
    a 400); without max_new_tokens the engine's default (64) is what it checks."""
    if not context_len:
        return
    for p in batch:
        if len(p) >= context_len:
            continue  # ReferenceEngine.validate_prompts names it
        if max_new_tokens is not None and len(p) + max_new_tokens > context_len:
            raise BadRequest(f"Requested token count exceeds the model's maximum context length of {context_len} "
                             f"tokens. You requested a total of {len(p) + max_new_tokens} tokens: {len(p)} tokens "
                             f"from the input messages and {max_new_tokens} tokens for the completion. Please reduce "
                             "the number of tokens in the input messages or the completion to fit within the limit.")


def generation_json(g, prompt_len: int, return_logprob: bool) -> dict[str, Any]:
    if g.finish_reason == "stop":
        reason = {"type": "stop", "matched": g.output_ids[-1]}
    elif g.finish_reason == "length":
        reason = {"type": "length", "length": len(g.output_ids)}
    else:
        reason = {"type": "abort", "message": "paused with mode=abort"}
    meta: dict[str, Any] = {"finish_reason": reason, "weight_version": str(g.weight_version),
                            "prompt_tokens": prompt_len, "completion_tokens": len(g.output_ids)}
    if return_logprob:
        meta["output_token_logprobs"] = [[float(lp), int(t), None] for lp, t in
                                         zip(g.logprobs.tolist(), g.output_ids, strict=True)]
    if g.routed_experts is not None:
        meta["routed_experts"] = g.routed_experts.tolist()
    return {"text": None, "output_ids": list(g.output_ids), "meta_info": meta}


class EngineServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, engine, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 verbose: bool = False):
        self.engine = engine
        self.api_key = api_key
        self.verbose = verbose
        self.update_lock = threading.Lock()  # one open tensor update at a time
        if ":" in host:  # an IPv6 address (``::1``): the socket's family follows it
            self.address_family = socket.AF_INET6
        super().__init__((host, port), RequestHandler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class RequestHandler(BaseHTTPRequestHandler):
    timeout = 300  # seconds a client may stall mid-request before its handler thread is freed (socket timeout)
    server: EngineServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet unless asked
        if self.server.verbose:
            super().log_message(fmt, *args)

    # ---- plumbing ------------------------------------------------------------------------------
    def _send(self, code: int, body: Any, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str) -> None:
        self._send(code, {"error": {"message": message, "code": code}, "success": False, "message": message})

    def _authorized(self, path: str) -> bool:
        key = self.server.api_key
        if key is None or (self.command == "GET" and path == "/health"):
            return True
        got = self.headers.get("Authorization", "")
        return got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), key.encode())

    def _content_length(self) -> int | None:
        """The request's Content-Length, or None if absent; anything but a decimal count is a bad request (a
        negative one would make ``rfile.read`` wait for the client to hang up)."""
        n = self.headers.get("Content-Length")
        if n is None:
            return None
        if not n.strip().isdigit():
            self.close_connection = True  # the body's end is unknown: this connection cannot be reused
            raise BadRequest(f"Content-Length {n!r} is not a byte count")
        return int(n)

    def _body(self, limit: int) -> bytes:
        n = self._content_length()
        if n is None:
            raise BadRequest("Content-Length is required")
        if n > limit:
            self.close_connection = True  # the body is not read: the next bytes are not a request
            raise BadRequest(f"request body of {n} bytes is over the limit of {limit}")
        return self.rfile.read(n)

    def _json(self) -> dict:
        raw = self._body(MAX_JSON_BYTES)
        if not raw:
            return {}
        try:
            d = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise BadRequest(f"body is not JSON: {exc}") from None
        if not isinstance(d, dict):
            raise BadRequest("body must be a JSON object")
        return d

    def _dispatch(self, table: dict) -> None:
        url = urllib.parse.urlsplit(self.path)
        if not self._authorized(url.path):
            # drain a small body so the connection stays usable; otherwise close it
            n = self.headers.get("Content-Length", "0").strip()
            if n.isdigit() and int(n) <= MAX_JSON_BYTES:
                self.rfile.read(int(n))
            else:
                self.close_connection = True
            self._error(HTTPStatus.UNAUTHORIZED, "missing or wrong API key (Authorization: Bearer ...)")
            return
        fn = table.get(url.path)
        if fn is None:
            self._error(HTTPStatus.NOT_FOUND, f"no endpoint {self.command} {url.path}")
            return
        try:
            fn(self, urllib.parse.parse_qs(url.query))
        except EngineBusy as exc:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(exc))
        except MilesLPError as exc:  # bad input: sampling values, prompts, update buckets, paths
            self._error(HTTPStatus.BAD_REQUEST, str(exc))
        except Exception as exc:  # a bug: answer 500 and keep serving
            import traceback

            traceback.print_exc()
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")

    def do_GET(self):
        self._dispatch(GET)

    def do_POST(self):
        self._dispatch(POST)

    # ---- SGLang endpoints --------------------------------------------------------------------------
    def health(self, q):
        self._send(200, {"status": "ok"} if self.server.engine.health()["status"] != "closed" else {"status": "closed"})

    def weight_version(self, q):
        self._send(200, {"weight_version": str(self.server.engine.weight_version)})

    def generate(self, q):
        d = self._json()
        ids = d.get("input_ids")
        if ids is None:
            raise BadRequest("this server takes token ids: 'input_ids' is required (no tokenizer, 'text' unsupported)")
        single = isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)
        batch = [ids] if single else ids
        if not isinstance(batch, list) or not all(isinstance(p, list) and all(isinstance(t, int) for t in p)
                                                  for p in batch):
            raise BadRequest("input_ids must be a list of token ids or a list of such lists")
        unknown = set(d) - {"input_ids", "sampling_params", "return_logprob", "return_routed_experts", "stream",
                            "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "rid",
                            "weight_version"}
        if unknown:
            raise BadRequest(f"unknown /generate field(s) {sorted(unknown)}")
        if d.get("stream"):
            raise BadRequest("stream=true is not supported")
        sp = sampling_from_json(d.get("sampling_params"), d.get("return_routed_experts", False))
        check_context(batch, sp.max_new_tokens if "max_new_tokens" in (d.get("sampling_params") or {}) else None,
                      getattr(self.server.engine, "context_len", None))
        gens = self.server.engine.generate(batch, sp)
        out = [generation_json(g, len(p), bool(d.get("return_logprob"))) for g, p in zip(gens, batch, strict=True)]
        self._send(200, out[0] if single else out)

    def update_from_disk(self, q):
        d = self._json()
        path = d.get("model_path")
        if not isinstance(path, str):
            raise BadRequest("'model_path' (a checkpoint folder on this host) is required")
        wv = _int_field(d.get("weight_version"), "weight_version")
        report = self.server.engine.update_from_disk(path, wv)
        self._send(200, {"success": True, "message": f"updated from {path}", **report})

    def update_from_tensor(self, q):
        from safetensors.torch import load as st_load

        if self.client_address[0] not in LOOPBACK:
            raise BadRequest("update_weights_from_tensor is for callers on the same host; use update_weights_from_disk")
        raw = self._body(MAX_TENSOR_BYTES)
        finish = (q.get("finish", ["true"])[0]).lower() != "false"
        wv = _int_field(q.get("weight_version", [None])[0], "weight_version")
        eng = self.server.engine
        try:
            tensors = st_load(raw) if raw else {}
        except Exception as exc:  # safetensors raises its own error types
            raise BadRequest(f"body is not a safetensors file: {exc}") from None
        with self.server.update_lock:
            opened = eng.health()["status"] != "updating"
            if opened:
                eng.begin_weight_update()
            try:
                eng.update_weights(tensors.items())
            except MilesLPError:
                # a bucket is checked whole before any byte is written: a one-shot update (opened and finished by
                # this request) leaves nothing behind, so the engine goes back to serving its previous weights (as
                # SGLang answers success=false and keeps serving); a multi-bucket client aborts with
                # /miles_lp/abort_update
                abort = getattr(eng, "abort_weight_update", None)
                if opened and finish and abort is not None:
                    abort()
                raise
            report = eng.finish_weight_update(wv) if finish else {"open": True}
        self._send(200, {"success": True, "message": f"{len(tensors)} tensors", **report})

    def pause(self, q):
        d = self._json()
        # SGLang's PauseGenerationReqInput.mode defaults to abort: a client written against SGLang
        # that posts {} expects its in-flight requests ended with finish abort, not parked. miles-lp's own client
        # (SGLangHTTPEngine, pause_mode retract as Miles) always sends its mode
        self.server.engine.pause(d.get("mode", "abort"))
        self._send(200, {"success": True})

    def resume(self, q):
        self._json()
        self.server.engine.resume()
        self._send(200, {"success": True})

    def flush(self, q):
        self._body(MAX_JSON_BYTES) if self.command == "POST" else None
        self.server.engine.flush_cache()
        self._send(200, {"success": True})

    # ---- miles-lp introspection --------------------------------------------------------------------
    def m_health(self, q):
        self._send(200, self.server.engine.health())

    def m_quantized(self, q):
        self._send(200, self.server.engine.quantized_params())

    def m_specs(self, q):
        self._send(200, {k: [d, list(s)] for k, (d, s) in self.server.engine.param_specs().items()})

    def m_pointers(self, q):
        self._send(200, self.server.engine.storage_pointers())

    def m_self_check(self, q):
        seed = _int_field(self._json().get("seed", 0), "seed")
        self._send(200, self.server.engine.self_check(seed))

    def m_abort_update(self, q):
        self._json()
        abort = getattr(self.server.engine, "abort_weight_update", None)
        if abort is None:
            raise BadRequest("this engine cannot abort an update; finish it with a full update")
        with self.server.update_lock:
            abort()
        self._send(200, {"success": True})

    def m_digests(self, q):
        self._send(200, self.server.engine.weight_digests(self._json().get("names")))

    def m_read(self, q):
        from safetensors.torch import save as st_save

        names = self._json().get("names")
        if not isinstance(names, list):
            raise BadRequest("'names' (a list of tensor names) is required")
        self._send(200, st_save(self.server.engine.read_weights(names)), "application/octet-stream")


GET = {"/health": RequestHandler.health, "/get_weight_version": RequestHandler.weight_version, "/flush_cache": RequestHandler.flush,
       "/miles_lp/health": RequestHandler.m_health, "/miles_lp/quantized_params": RequestHandler.m_quantized,
       "/miles_lp/param_specs": RequestHandler.m_specs, "/miles_lp/storage_pointers": RequestHandler.m_pointers}
POST = {"/generate": RequestHandler.generate, "/update_weights_from_disk": RequestHandler.update_from_disk,
        "/update_weights_from_tensor": RequestHandler.update_from_tensor, "/pause_generation": RequestHandler.pause,
        "/continue_generation": RequestHandler.resume, "/flush_cache": RequestHandler.flush,
        "/miles_lp/self_check": RequestHandler.m_self_check, "/miles_lp/weight_digests": RequestHandler.m_digests,
        "/miles_lp/read_weights": RequestHandler.m_read, "/miles_lp/abort_update": RequestHandler.m_abort_update}


def serve_in_thread(engine, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None) -> EngineServer:
    """Start a server on a daemon thread (tests, in-process RL); ``server.shutdown()`` stops it."""
    srv = EngineServer(engine, host, port, api_key)
    threading.Thread(target=srv.serve_forever, name="miles-lp-serve", daemon=True).start()
    return srv
