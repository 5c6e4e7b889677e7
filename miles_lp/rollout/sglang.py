"""SGLang backend: an HTTP client for a running server (SGLang's, or ``miles-lp serve``) and a thin
``sglang.Engine`` path. Both implement the ``Engine`` protocol.

What ran where: the HTTP client runs against real SGLang 0.5.23 on its CPU platform (``flavor="launch"``: the client
starts the server itself through ``miles_lp.rollout.sglang_cpu``, on loopback, and stops it at ``close()``; BF16,
MXFP8 and NVFP4 dense checkpoints; updates from disk; the checks answered inside SGLang's process) and against
``miles-lp serve`` over loopback (the same protocol subset plus tensor updates). ``SGLangEngine`` (in-process
``sglang.Engine``: ``generate``, ``update_weights_from_tensor(named_tensors, load_format, flush_cache)``,
``pause_generation``, ``continue_generation``, ``flush_cache``) has **not** been run; it is kept thin on purpose.

Weight updates:

* against ``miles-lp serve``: ``POST /update_weights_from_tensor`` with one safetensors file per bucket
  (``finish=false`` until the last call); against a real SGLang server the HTTP tensor path takes SGLang's own
  pickle-based serialization, which this client refuses to produce: with ``flavor="sglang"`` and an
  ``update_dir`` the same begin / buckets / finish calls stage the buckets (checked against the served
  checkpoint's names, dtypes and shapes) and ``finish`` writes them as one checkpoint folder (the served
  checkpoint's config files + one safetensors file, written to a temporary name and renamed) and posts
  ``/update_weights_from_disk`` with it (the path must be visible to the server: same host or shared storage);
  or use ``SGLangEngine``. Flavor launch takes this disk path too: it is the one SGLang update path that never
  unpickles anything and on which SGLang itself re-runs ``process_weights_after_loading`` (the CPU linear method's
  derived operand is rebuilt by SGLang's loader); it sends ``keep_pause`` while paused (SGLang would resume) and
  numbers the versions from the server's ``--weight-version 0``.
* ``SGLangEngine`` sends ``update_weights_from_tensor(bucket, load_format=LOADER)`` where ``LOADER`` is
  ``miles_lp.rollout.weight_loader.load_weights`` registered with ``--custom-weight-loader``: it re-runs
  ``process_weights_after_loading`` on the touched modules and keeps the captured storage (CONTRACT 5), DeepSeek's
  ``fused_qkv_a_proj_with_mqa`` included (SGLang assembles it from q_a_proj + kv_a_proj_with_mqa within one call:
  both halves must be in one bucket, as ``export_groups`` makes them; the loader refuses a split pair).
  Its environment must set ``FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH=1`` (FlashInfer's default FP4 quantization
  uses approximate reciprocals and is not TE's rule); ``SGLangEngine`` sets it before importing SGLang.

Introspection (``quantized_params``, ``weight_digests``, ``read_weights``, ``storage_pointers``, ``self_check``)
uses the ``/miles_lp/*`` endpoints of ``miles-lp serve``, or of an SGLang server started as
``miles_lp.rollout.sglang_cpu.serve`` (flavor launch, or ``introspect=True``), which answers them from SGLang's own
model; a stock SGLang server has none, and the client raises ``BackendUnavailable`` saying so rather than answering
from the configuration.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from miles_lp.errors import BackendUnavailable
from miles_lp.rollout.engine import (
    Capability,
    EngineBusy,
    EngineError,
    Generation,
    SamplingParams,
    WeightUpdateError,
)

LOADER = "miles_lp.rollout.weight_loader.load_weights"
FLAVORS = ("miles-lp", "sglang", "launch")


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
    reason = {"stop": "stop", "length": "length", "abort": "abort"}.get(kind)
    if reason is None:  # guessing "length" would feed the sentinel's length-cap streak a reason nobody gave
        raise EngineError(f"the server's /generate answer has finish_reason {fr!r}; expected type stop, length or "
                          "abort")
    wv = meta.get("weight_version")
    try:  # a stock server started without a numeric --weight-version reports "default": -1, which C7's
        version = int(wv) if wv is not None else -1  # version check then flags (never a silent match)
    except (TypeError, ValueError):
        version = -1
    routes = meta.get("routed_experts")
    return Generation(list(ids), torch.tensor([float(x[0]) for x in lps], dtype=torch.float32), reason, version,
                      torch.tensor(routes) if (want_routes and routes is not None) else None)


class SGLangHTTPEngine:
    """``Engine`` over HTTP. ``url``: ``http://127.0.0.1:30000``; ``api_key``: default from ``MILES_LP_API_KEY``
    or ``SGLANG_API_KEY``; ``flavor``: ``miles-lp`` (our server: tensor updates and introspection) or ``sglang``."""

    capabilities = frozenset({Capability.PARAM_SPECS, Capability.ABORT_UPDATE})

    def __init__(self, url: str, api_key: str | None = None, *, timeout: float = 600.0, flavor: str = "miles-lp",
                 pause_mode: str = "retract", checkpoint: str | os.PathLike | None = None,
                 update_dir: str | os.PathLike | None = None, server_options: Mapping[str, Any] | None = None,
                 introspect: bool | None = None):
        from miles_lp.rollout.server import api_key_from_env

        if flavor not in FLAVORS:
            raise EngineError(f"flavor must be one of {', '.join(FLAVORS)}, got {flavor!r}")
        self.api_key = api_key if api_key is not None else api_key_from_env()
        self.server = None  # the SGLang server this client started (flavor "launch")
        if flavor == "launch":
            if url:
                raise EngineError("flavor launch starts its own server: give no url (or use flavor sglang for a "
                                  "server started by hand)")
            if checkpoint is None or update_dir is None:
                raise EngineError("flavor launch needs checkpoint= (what the server loads) and update_dir= (where "
                                  "each update is written for /update_weights_from_disk)")
            from miles_lp.rollout.sglang_cpu.launch import SGLangCPUServer

            opts = {"log_path": Path(update_dir).parent / "sglang-server.log", **(server_options or {})}
            self.server = SGLangCPUServer(checkpoint, api_key=self.api_key, **opts).start()
            url = self.server.url
        elif not url:
            raise EngineError(f"flavor {flavor} needs the server's url")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.flavor = flavor
        self.pause_mode = pause_mode
        self._updating = False
        self._paused = False
        self._sent = 0
        # the checkpoint the server serves (names / dtypes / shapes of updates; the disk path's config files)
        self.checkpoint = None if checkpoint is None else Path(checkpoint)
        self.update_dir = None if update_dir is None else Path(update_dir).absolute()  # the server resolves it in its cwd
        self._staged: dict[str, torch.Tensor] = {}
        self._disk_version = 0
        # whether SGLang's own model answers /miles_lp/* (a server run as miles_lp.rollout.sglang_cpu.serve: flavor
        # launch always; flavor sglang only when told, a stock server having none)
        self._introspectable = (flavor == "launch") if introspect is None else bool(introspect)
        self._version_path = "/model_info" if flavor == "launch" else "/get_weight_version"

    def probe(self, timeout: float = 5.0) -> dict[str, Any]:
        """``GET /health`` with a short timeout: raises ``EngineError`` naming the url when nothing answers."""
        saved, self.timeout = self.timeout, timeout
        try:
            return self._request("GET", "/health") or {}
        finally:
            self.timeout = saved

    def router_workers(self, timeout: float = 5.0) -> tuple[str, ...] | None:
        """The servers behind this url when it is an sglang-router (its ``GET /workers``: the url of each worker),
        None when it is a server (no ``/workers`` route) or does not answer (``probe`` says so, naming it).
        Refused (``EngineError``): a router with no worker, an unhealthy one, or prefill / decode workers
        (PD disaggregation: a sync would have to reach both halves of each pair)."""
        saved, self.timeout = self.timeout, timeout
        try:
            listing = self._request("GET", "/workers")
        except EngineError:
            return None
        finally:
            self.timeout = saved
        if not isinstance(listing, dict) or not isinstance(listing.get("workers"), list):
            return None
        workers = listing["workers"]
        if not workers:
            raise EngineError(f"{self.url} is an sglang-router with no worker: add servers to it (its --worker-urls "
                              "or POST /workers) before the run")
        split = [w.get("url") for w in workers if w.get("worker_type", "regular") != "regular"]
        if split:
            raise EngineError(f"{self.url} is an sglang-router in prefill/decode disaggregation ({split[0]} is a "
                              f"{workers[0].get('worker_type')} worker): not supported; list regular servers in "
                              "rollout.urls")
        sick = [w.get("url") for w in workers if w.get("is_healthy") is False]
        if sick:
            raise EngineError(f"{self.url} is an sglang-router whose worker {sick[0]} is unhealthy: start it (or "
                              "remove it from the router) before the run; every server is synced and checked")
        return tuple(str(w["url"]).rstrip("/") for w in workers)

    @property
    def _disk(self) -> bool:
        """Updates go through ``/update_weights_from_disk`` (a real SGLang server: its tensor path takes pickle)."""
        return self.flavor in ("sglang", "launch")

    def _stock(self, what: str) -> None:
        """Raise ``BackendUnavailable`` for a server without the ``/miles_lp/*`` introspection: a stock SGLang
        server. One started as ``miles_lp.rollout.sglang_cpu.serve`` (flavor launch, or ``introspect=True``)
        answers it from SGLang's own model (``sglang_cpu.introspect``)."""
        if self._disk and not self._introspectable:
            raise BackendUnavailable(f"{what}: a stock SGLang server ({self.url}) cannot report its live quantized "
                                     "state (no /miles_lp/ endpoints); serve with `miles-lp serve` for the live "
                                     "checks, or start SGLang as miles_lp.rollout.sglang_cpu.serve "
                                     "(rollout.server: launch does)")

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
        # SGLang 0.5.23 reports it in /model_info only (404 for /get_weight_version); `miles-lp serve` in
        # /get_weight_version: asked there first unless the server is known to be SGLang's
        if self._version_path == "/get_weight_version":
            try:
                v = self._request("GET", self._version_path)
            except EngineError as exc:
                if ": 404 " not in str(exc):
                    raise
                self._version_path = "/model_info"
        if self._version_path == "/model_info":
            v = self._request("GET", "/model_info")
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
        self._paused = True

    def resume(self) -> None:
        self._request("POST", "/continue_generation", {})
        self._paused = False

    def flush_cache(self) -> None:
        self._request("POST", "/flush_cache", {})

    def begin_weight_update(self) -> None:
        if self._updating:
            raise EngineError("begin_weight_update: an update is already in progress")
        if self._disk and (self.update_dir is None or self.checkpoint is None):
            raise BackendUnavailable("a stock SGLang server takes tensors only in its pickle-based serialization, "
                                     "which miles-lp does not produce; give the client checkpoint= and update_dir= "
                                     "(updates from disk), call update_from_disk(path) or use SGLangEngine "
                                     "(in-process) with the custom weight loader")
        self._updating, self._sent, self._staged = True, 0, {}

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save

        if not self._updating:
            raise EngineError("update_weights outside begin_weight_update() ... finish_weight_update()")
        bucket = {}
        for name, t in named_tensors:
            if name in bucket or name in self._staged:
                raise WeightUpdateError(f"update bucket: '{name}' appears twice")
            bucket[name] = t.detach().contiguous().cpu()
        if self._disk:  # disk path: checked whole against the served checkpoint, then staged
            specs = self.param_specs()
            for name, t in bucket.items():
                spec = specs.get(name)
                got = (str(t.dtype).removeprefix("torch."), tuple(t.shape))
                if spec is None:
                    raise WeightUpdateError(f"update bucket: unknown parameter '{name}' (not in {self.checkpoint})")
                if got != spec:
                    raise WeightUpdateError(f"update bucket: '{name}' is {got[0]}{list(got[1])}, the served "
                                            f"checkpoint holds {spec[0]}{list(spec[1])}")
            self._staged.update(bucket)
        else:
            self._request("POST", "/update_weights_from_tensor", raw=save(bucket), query="finish=false")
        self._sent += len(bucket)

    def finish_weight_update(self, weight_version: int | None = None) -> dict[str, Any]:
        from safetensors.torch import save

        if not self._updating:
            raise EngineError("finish_weight_update without begin_weight_update")
        try:
            if self._disk:
                return self._finish_from_disk(weight_version)
            q = "finish=true" + (f"&weight_version={int(weight_version)}" if weight_version is not None else "")
            return self._request("POST", "/update_weights_from_tensor", raw=save({}), query=q)
        finally:
            self._updating, self._staged = False, {}

    def abort_weight_update(self) -> None:
        """Drop an open update: the staged buckets here, and (miles-lp flavor) the server's open update through
        ``/miles_lp/abort_update``, which succeeds where nothing was written yet. A no-op outside an update."""
        if not self._updating:
            return
        try:
            if not self._disk:  # the server opens an update at its first bucket, refused or not
                self._request("POST", "/miles_lp/abort_update", {})
        finally:
            self._updating, self._staged, self._sent = False, {}, 0

    def _finish_from_disk(self, weight_version: int | None) -> dict[str, Any]:
        """The staged tensors as one checkpoint folder (the served one's config files + one safetensors file),
        written to a temporary name and renamed, then ``/update_weights_from_disk``; the previous folder is removed
        after the server loaded the new one."""
        from safetensors.torch import save_file

        missing = sorted(set(self.param_specs()) - set(self._staged))
        if missing:  # SGLang's disk load replaces every tensor: a partial folder cannot be loaded
            raise WeightUpdateError(f"update from disk: {len(missing)} tensor(s) of the served checkpoint were not "
                                    f"sent (first: {missing[0]}); nothing was loaded")
        if weight_version is None:  # SGLang keeps its version across a disk load unless told: one more per update
            weight_version = self.weight_version + 1
        self._disk_version += 1
        self.update_dir.mkdir(parents=True, exist_ok=True)
        final = self.update_dir / f"update_{self._disk_version:06d}"
        tmp = self.update_dir / f".update_{self._disk_version:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for f in self.checkpoint.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, tmp / f.name)
        save_file(self._staged, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        out = self.update_from_disk(str(final), weight_version) or {}
        for old in self.update_dir.glob("update_*"):
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return {**out, "path": str(final), "written": len(self._staged)}

    def update_from_disk(self, path: str, weight_version: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": str(path)}
        if weight_version is not None:  # SGLang's field is a string (its /generate reports it back as one)
            body["weight_version"] = str(weight_version) if self._disk else weight_version
        if self._disk and self._paused:  # SGLang resumes generation after a disk update unless told to stay paused
            body["keep_pause"] = True
        return self._request("POST", "/update_weights_from_disk", body)

    def quantized_params(self) -> dict[str, str]:
        """The live modules' formats (``miles-lp serve``). A stock server cannot report them: ``BackendUnavailable``
        (the sync then skips C1 with the reason and validates the update against the plan; never guessed from the
        served checkpoint's config)."""
        self._stock("quantized_params")
        return self._request("GET", "/miles_lp/quantized_params")

    def param_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        if self._disk and self.checkpoint is not None:  # the served checkpoint's headers
            from miles_lp.rollout.checkpoint import open_checkpoint

            return {n: (h.dtype, tuple(h.shape)) for n, h in open_checkpoint(self.checkpoint).tensors.items()}
        self._stock("param_specs")
        return {k: (d, tuple(s)) for k, (d, s) in self._request("GET", "/miles_lp/param_specs").items()}

    def weight_digests(self, names: Iterable[str] | None = None) -> dict[str, str]:
        self._stock("weight_digests")
        return self._request("POST", "/miles_lp/weight_digests", {"names": None if names is None else list(names)})

    def read_weights(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        self._stock("read_weights")
        return load(self._request("POST", "/miles_lp/read_weights", {"names": list(names)}))

    def storage_pointers(self) -> dict[str, int]:
        self._stock("storage_pointers")
        return self._request("GET", "/miles_lp/storage_pointers")

    def self_check(self, seed: int = 0) -> dict[str, Any]:
        self._stock("self_check")
        return self._request("POST", "/miles_lp/self_check", {"seed": seed})

    def health(self) -> dict[str, Any]:
        if self.server is not None and not self.server.running:  # the runner restarts a dead engine
            return {"status": "dead", "backend": "sglang", "url": self.url}
        base = self._request("GET", "/health") or {}
        try:
            self._stock("health")
            return self._request("GET", "/miles_lp/health")
        except BackendUnavailable:
            return {"status": base.get("status", "ok"), "backend": "sglang", "weight_version": self.weight_version,
                    "updates": "from disk" if self._disk else "tensor"}

    def inject_fault(self, kind: str, name: str) -> dict[str, Any]:
        """A fault written into the live model (a server started with ``MILES_LP_SGLANG_FAULTS=1``): ``perturb``
        (one element of ``name`` changed in place) or ``rebind`` (its parameter moved to new storage)."""
        self._stock("inject_fault")
        return self._request("POST", "/miles_lp/inject_fault", {"kind": kind, "name": name})

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


class SGLangEngine:
    """In-process ``sglang.Engine`` (CUDA only; not run on these machines, see the module docstring)."""

    capabilities: frozenset[Capability] = frozenset()

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
