"""SGLang backend: an HTTP client for a running server (SGLang's, or ``miles-lp serve``) and a thin
``sglang.Engine`` path. Both implement the ``Engine`` protocol.

What ran where: the HTTP client is tested here against ``miles-lp serve`` over loopback (the same protocol
subset). SGLang itself cannot run on these machines (its MXFP8 kernels need SM100 and its wheel is CUDA-only):
``SGLangEngine`` is written against SGLang's documented Python API (``sglang.Engine``: ``generate``,
``update_weights_from_tensor(named_tensors, load_format, flush_cache)``, ``pause_generation``,
``continue_generation``, ``flush_cache``) and has **not** been run; it is kept thin on purpose.

Weight updates:

* against ``miles-lp serve``: ``POST /update_weights_from_tensor`` with one safetensors file per bucket
  (``finish=false`` until the last call); against a real SGLang server the HTTP tensor path takes SGLang's own
  pickle-based serialization, which this client refuses to produce: set ``flavor="sglang"`` and the client
  updates through ``/update_weights_from_disk`` (a checkpoint folder the caller wrote), or use ``SGLangEngine``.
* ``SGLangEngine`` sends ``update_weights_from_tensor(bucket, load_format=LOADER)`` where ``LOADER`` is
  ``miles_lp.rollout.weight_loader.load_weights`` registered with ``--custom-weight-loader``: it re-runs
  ``process_weights_after_loading`` on the touched modules and keeps the captured storage (CONTRACT 5).
  Its environment must set ``FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH=1`` (FlashInfer's default FP4 quantization
  uses approximate reciprocals and is not TE's rule); ``SGLangEngine`` sets it before importing SGLang.

Introspection (``quantized_params``, ``weight_digests``, ``read_weights``, ``storage_pointers``, ``self_check``)
uses ``miles-lp serve``'s ``/miles_lp/*`` endpoints; a stock SGLang server has none, and the client raises
``BackendUnavailable`` saying so rather than answering from the configuration.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from miles_lp.errors import BackendUnavailable
from miles_lp.rollout.engine import EngineBusy, EngineError, Generation, SamplingParams, WeightUpdateError

LOADER = "miles_lp.rollout.weight_loader.load_weights"
FLAVORS = ("miles-lp", "sglang")


def sampling_json(sp: SamplingParams) -> dict[str, Any]:
    d: dict[str, Any] = {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k,
                         "max_new_tokens": sp.max_new_tokens}
    if sp.stop_token_ids:
        d["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.seed is not None:
        d["sampling_seed"] = sp.seed
    return d


def generation_from_json(obj: Mapping[str, Any], want_routes: bool = False) -> Generation:
    """One SGLang ``/generate`` answer -> ``Generation``."""
    meta = obj.get("meta_info") or {}
    lps = meta.get("output_token_logprobs")
    ids = obj.get("output_ids")
    if ids is None and lps is not None:
        ids = [int(x[1]) for x in lps]
    if ids is None:
        raise EngineError("the server's /generate answer has neither output_ids nor meta_info.output_token_logprobs")
    if lps is None:
        raise EngineError("the server's /generate answer has no meta_info.output_token_logprobs (return_logprob)")
    if [int(x[1]) for x in lps] != list(ids):
        raise EngineError("output_token_logprobs token ids differ from output_ids")
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    reason = {"stop": "stop", "length": "length", "abort": "abort"}.get(kind, "length")
    wv = meta.get("weight_version")
    try:
        version = int(wv) if wv is not None else -1
    except (TypeError, ValueError):
        version = -1
    routes = meta.get("routed_experts")
    return Generation(list(ids), torch.tensor([float(x[0]) for x in lps], dtype=torch.float32), reason, version,
                      torch.tensor(routes) if (want_routes and routes is not None) else None)


class SGLangHTTPEngine:
    """``Engine`` over HTTP. ``url``: ``http://127.0.0.1:30000``; ``api_key``: default from ``MILES_LP_API_KEY``
    or ``SGLANG_API_KEY``; ``flavor``: ``miles-lp`` (our server: tensor updates and introspection) or ``sglang``."""

    def __init__(self, url: str, api_key: str | None = None, *, timeout: float = 600.0, flavor: str = "miles-lp",
                 pause_mode: str = "retract"):
        from miles_lp.rollout.server import api_key_from_env

        if flavor not in FLAVORS:
            raise EngineError(f"flavor must be one of {', '.join(FLAVORS)}, got {flavor!r}")
        self.url = url.rstrip("/")
        self.api_key = api_key if api_key is not None else api_key_from_env()
        self.timeout = timeout
        self.flavor = flavor
        self.pause_mode = pause_mode
        self._updating = False
        self._sent = 0

    # ---- transport -------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                 query: str = "") -> Any:
        headers = {}
        data = None
        if raw is not None:
            data, headers["Content-Type"] = raw, "application/octet-stream"
        elif body is not None or method == "POST":
            data, headers["Content-Type"] = json.dumps(body or {}).encode(), "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url + path + (f"?{query}" if query else ""), data=data, headers=headers,
                                     method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                payload, ctype = resp.read(), resp.headers.get("Content-Type", "")
        except urllib.error.HTTPError as exc:
            msg = exc.read().decode(errors="replace")
            try:
                msg = json.loads(msg).get("error", {}).get("message", msg)
            except (json.JSONDecodeError, AttributeError):
                pass
            if exc.code == 401:
                raise EngineError(f"{self.url}{path}: 401 unauthorized ({msg}); set MILES_LP_API_KEY / "
                                  "SGLANG_API_KEY to the server's key") from None
            if exc.code == 404 and path.startswith("/miles_lp/"):
                raise BackendUnavailable(f"{self.url} has no {path}: not a `miles-lp serve` server; a stock SGLang "
                                         "server cannot report its live quantized state") from None
            if exc.code == 503:
                raise EngineBusy(f"{self.url}{path}: {msg}") from None
            if path.startswith("/update_weights"):
                raise WeightUpdateError(f"{self.url}{path}: {exc.code} {msg}") from None
            raise EngineError(f"{self.url}{path}: {exc.code} {msg}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            raise EngineError(f"{self.url}{path}: server unreachable ({exc})") from None
        if "application/json" in ctype:
            return json.loads(payload) if payload else None
        return payload

    # ---- Engine protocol -------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        v = self._request("GET", "/get_weight_version")
        v = v.get("weight_version") if isinstance(v, dict) else v
        try:
            return int(v)
        except (TypeError, ValueError):
            return -1

    def generate(self, input_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        sampling.validate()
        body = {"input_ids": [list(map(int, p)) for p in input_ids], "sampling_params": sampling_json(sampling),
                "return_logprob": True}
        if sampling.logprob_mode != "raw":
            body["sampling_params"]["logprob_mode"] = sampling.logprob_mode
        if sampling.return_routed_experts:
            body["return_routed_experts"] = True
        out = self._request("POST", "/generate", body)
        if isinstance(out, dict):
            out = [out]
        return [generation_from_json(o, sampling.return_routed_experts) for o in out]

    def pause(self, mode: str | None = None) -> None:
        self._request("POST", "/pause_generation", {"mode": mode or self.pause_mode})

    def resume(self) -> None:
        self._request("POST", "/continue_generation", {})

    def flush_cache(self) -> None:
        self._request("POST", "/flush_cache", {})

    def begin_weight_update(self) -> None:
        if self._updating:
            raise EngineError("begin_weight_update: an update is already in progress")
        if self.flavor == "sglang":
            raise BackendUnavailable("a stock SGLang server takes tensors only in its pickle-based serialization, "
                                     "which miles-lp does not produce; call update_from_disk(path) or use "
                                     "SGLangEngine (in-process) with the custom weight loader")
        self._updating, self._sent = True, 0

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save

        if not self._updating:
            raise EngineError("update_weights outside begin_weight_update() ... finish_weight_update()")
        bucket = {}
        for name, t in named_tensors:
            if name in bucket:
                raise WeightUpdateError(f"update bucket: '{name}' appears twice")
            bucket[name] = t.detach().contiguous().cpu()
        self._request("POST", "/update_weights_from_tensor", raw=save(bucket), query="finish=false")
        self._sent += len(bucket)

    def finish_weight_update(self, weight_version: int | None = None) -> dict[str, Any]:
        from safetensors.torch import save

        if not self._updating:
            raise EngineError("finish_weight_update without begin_weight_update")
        q = "finish=true" + (f"&weight_version={int(weight_version)}" if weight_version is not None else "")
        try:
            return self._request("POST", "/update_weights_from_tensor", raw=save({}), query=q)
        finally:
            self._updating = False

    def update_from_disk(self, path: str, weight_version: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": str(path)}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._request("POST", "/update_weights_from_disk", body)

    def quantized_params(self) -> dict[str, str]:
        return self._request("GET", "/miles_lp/quantized_params")

    def param_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {k: (d, tuple(s)) for k, (d, s) in self._request("GET", "/miles_lp/param_specs").items()}

    def weight_digests(self, names: Iterable[str] | None = None) -> dict[str, str]:
        return self._request("POST", "/miles_lp/weight_digests", {"names": None if names is None else list(names)})

    def read_weights(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        return load(self._request("POST", "/miles_lp/read_weights", {"names": list(names)}))

    def storage_pointers(self) -> dict[str, int]:
        return self._request("GET", "/miles_lp/storage_pointers")

    def self_check(self, seed: int = 0) -> dict[str, Any]:
        return self._request("POST", "/miles_lp/self_check", {"seed": seed})

    def health(self) -> dict[str, Any]:
        base = self._request("GET", "/health") or {}
        try:
            return self._request("GET", "/miles_lp/health")
        except BackendUnavailable:
            return {"status": base.get("status", "ok"), "backend": "sglang", "weight_version": self.weight_version}

    def close(self) -> None:
        pass


class SGLangEngine:
    """In-process ``sglang.Engine`` (CUDA only; not run on these machines, see the module docstring)."""

    def __init__(self, model_path: str, *, custom_weight_loader: str = LOADER, **server_args: Any):
        os.environ.setdefault("FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH", "1")
        try:
            import sglang
        except ImportError as exc:
            raise BackendUnavailable("SGLang is not installed (pip install 'miles-lp[sglang]' on a CUDA host); "
                                     "use backend reference, or serve with SGLang and use SGLangHTTPEngine") from exc
        self._loader = custom_weight_loader
        self._engine = sglang.Engine(model_path=model_path, custom_weight_loader=[custom_weight_loader], **server_args)
        self.weight_version = 0
        self._updating = False

    def generate(self, input_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        sampling.validate()
        out = self._engine.generate(input_ids=[list(p) for p in input_ids], sampling_params=sampling_json(sampling),
                                    return_logprob=True)
        return [generation_from_json(o) for o in (out if isinstance(out, list) else [out])]

    def _call(self, name: str, *args, **kw):
        fn = getattr(self._engine, name, None)
        if fn is None:
            raise BackendUnavailable(f"this SGLang version's Engine has no {name}()")
        return fn(*args, **kw)

    def pause(self, mode: str = "retract") -> None:
        self._call("pause_generation", mode=mode)

    def resume(self) -> None:
        self._call("continue_generation")

    def flush_cache(self) -> None:
        self._call("flush_cache")

    def begin_weight_update(self) -> None:
        self._updating = True

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if not self._updating:
            raise EngineError("update_weights outside begin_weight_update() ... finish_weight_update()")
        self._call("update_weights_from_tensor", list(named_tensors), load_format=self._loader, flush_cache=False)

    def finish_weight_update(self, weight_version: int | None = None) -> dict[str, Any]:
        self._updating = False
        self._call("flush_cache")
        self.weight_version = self.weight_version + 1 if weight_version is None else int(weight_version)
        return {"weight_version": self.weight_version}

    def _unavailable(self, *a, **k):
        raise BackendUnavailable("sglang.Engine exposes no live-parameter introspection here; serve the checkpoint "
                                 "with `miles-lp serve` or the reference engine to run the sync checks")

    quantized_params = weight_digests = read_weights = storage_pointers = self_check = _unavailable

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "backend": "sglang.Engine", "weight_version": self.weight_version}

    def close(self) -> None:
        self._call("shutdown")
