"""Start and stop a real SGLang server on its CPU platform (``rollout.server: launch``, the tests).

The server runs in SGLang's own venv (``sglang_python()``: ``MILES_LP_SGLANG_PYTHON``, else the venv
``.ci/sglang_venv.sh`` builds) as ``python -m miles_lp.rollout.sglang_cpu.serve``: SGLang's ``launch_server`` with
miles-lp's introspection endpoints added (``serve``) and this package's ``shim/`` first on its PYTHONPATH (the two
``sgl_kernel`` CPU ops, in torch). It binds loopback on a free port; ``start()`` returns once ``/health`` answers
(or raises with the end of its log when the process exits first or the timeout passes); ``stop()`` ends the
process group it started (SGLang's scheduler and detokenizer are its children) and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from miles_lp.errors import BackendUnavailable
from miles_lp.ports import free_port
from miles_lp.rollout.engine import EngineError
from miles_lp.rollout.engine_venv import cached_venv, missing_python, venv_python

REPO = Path(__file__).resolve().parents[3]
SHIM = Path(__file__).resolve().parent / "shim"
#: the introspection endpoint's API key, handed to the server process (read there by ``hook``)
ENV_KEY = "MILES_LP_SGLANG_INTROSPECT_KEY"
SGLANG_VENV_NAME = "venv-sglang-cpu-0.5.23"  # keyed by the pin, as .ci/sglang_venv.sh names it

#: the server's flags on SGLang's CPU platform, each needed there: torch-native attention and sampling (the
#: FlashInfer / Triton ones are CUDA kernels), no CUDA graphs, no grammar backend, token ids in and out (no
#: tokenizer), a small static KV pool (``--max-total-tokens``). ``MEM_FRACTION``: on CPU ``--mem-fraction-static`` is a
#: fraction of host memory, and SGLang refuses to start when the host's available memory fell by more than
#: that fraction while the model loaded (its profile counts any other process's allocations as the model's:
#: at 0.05 a learner growing by 12% of the free memory during the load stopped the server). The KV pool is capped by
#: ``--max-total-tokens`` anyway, so the fraction only sets that tolerance.
MEM_FRACTION = "0.5"
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
             "--disable-cuda-graph", "--grammar-backend", "none", "--skip-tokenizer-init")


def default_sglang_venv() -> Path:
    return cached_venv("MILES_LP_SGLANG_VENV", SGLANG_VENV_NAME)


def sglang_python() -> str | None:
    """SGLang's interpreter: ``MILES_LP_SGLANG_PYTHON`` (None when it names a missing file), else
    ``build/venv-sglang/bin/python``, else the venv ``.ci/sglang_venv.sh`` builds, else None."""
    return venv_python("MILES_LP_SGLANG_PYTHON", REPO, "venv-sglang", default_sglang_venv())


def sglang_missing() -> str:
    return missing_python("MILES_LP_SGLANG_PYTHON", "SGLang", f"sglang 0.5.23, or build {default_sglang_venv()} "
                          "with `source .ci/sglang_venv.sh; sglang_venv DIR`")


def server_args(model_path: str | Path, port: int, *, host: str = "127.0.0.1", max_total_tokens: int = 4096,
                context_length: int | None = None, dtype: str = "bfloat16", tp_size: int = 1,
                extra: Sequence[str] = ()) -> list[str]:
    """SGLang's command-line flags for ``model_path`` on CPU (``CPU_FLAGS`` + the size of the KV pool); ``tp_size``:
    SGLang's ``--tp-size``, the engine's own tensor-parallel ranks (``rollout.engine_tp``)."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an integer >= 1, got {tp_size!r}")
    args = ["--model-path", str(model_path), "--host", host, "--port", str(port), "--dtype", dtype, *CPU_FLAGS,
            "--mem-fraction-static", MEM_FRACTION, "--max-total-tokens", str(max_total_tokens), "--log-level", "warning",
            "--weight-version", "0", "--tp-size", str(tp_size)]
    if context_length is not None:
        args += ["--context-length", str(context_length)]
    return [*args, *extra]


def cpu_bind_ranks(tp_size: int, threads: int | None = None, cores: Sequence[int] | None = None,
                   engine: str = "SGLang on CPU at --tp-size") -> list[list[int]]:
    """The cores of each of ``tp_size`` ranks: consecutive slices of this process's cores (``threads`` each, else
    an equal share). SGLang's and vLLM's CPU platforms refuse more ranks than NUMA nodes unless each rank's cores
    are named (``SGLANG_CPU_OMP_THREADS_BIND`` / ``VLLM_CPU_OMP_THREADS_BIND``)."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    per = threads or len(cores) // tp_size
    if per < 1 or per * tp_size > len(cores):
        raise BackendUnavailable(f"{engine} {tp_size} (rollout.engine_tp) binds each rank to cores "
                                 f"of its own ({threads or 'at least 1'} each); this process may use {len(cores)} "
                                 f"core(s): lower rollout.engine_tp")
    return [cores[r * per:(r + 1) * per] for r in range(tp_size)]


def cpu_bind(tp_size: int, threads: int | None = None, cores: Sequence[int] | None = None,
             engine: str = "SGLang on CPU at --tp-size") -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` (and vLLM's ``VLLM_CPU_OMP_THREADS_BIND``, the same syntax) for ``tp_size``
    ranks: ``0-3|4-7`` (each rank's cores, ``|`` between)."""
    def span(c: list[int]) -> str:
        return str(c[0]) if len(c) == 1 else (f"{c[0]}-{c[-1]}" if c == list(range(c[0], c[-1] + 1))
                                              else ",".join(map(str, c)))
    return "|".join(span(c) for c in cpu_bind_ranks(tp_size, threads, cores, engine))


class SGLangCPUServer:
    """One SGLang server process serving ``model_path`` on CPU, on loopback. ``api_key``: passed as SGLang's
    ``--api-key`` (default ``MILES_LP_API_KEY`` / ``SGLANG_API_KEY``); ``log_path``: both streams (default: a file
    beside nothing, discarded)."""

    def __init__(self, model_path: str | Path, *, python: str | None = None, port: int | None = None,
                 host: str = "127.0.0.1", api_key: str | None = None, log_path: str | Path | None = None,
                 threads: int | None = None, max_total_tokens: int = 4096, context_length: int | None = None,
                 extra_args: Sequence[str] = (), start_timeout_s: float = 600.0,
                 extra_env: Mapping[str, str] | None = None, tp_size: int = 1):
        from miles_lp.rollout.server import api_key_from_env

        self.python = python or sglang_python()
        if self.python is None:
            raise BackendUnavailable(sglang_missing())
        self.model_path = Path(model_path).absolute()
        self.host = host
        self.port = port or free_port(host)
        self.api_key = api_key if api_key is not None else api_key_from_env()
        self.log_path = Path(log_path) if log_path else None
        self.threads = threads
        self.extra_env = dict(extra_env or {})
        self.start_timeout_s = start_timeout_s
        self.tp_size = tp_size
        if tp_size > 1:
            cpu_bind(tp_size, threads)  # refused here, before a process starts, when the cores do not split
        self.args = server_args(self.model_path, self.port, host=host, max_total_tokens=max_total_tokens,
                                context_length=context_length, tp_size=tp_size, extra=extra_args)
        if self.api_key:
            self.args += ["--api-key", self.api_key]
        self._proc: subprocess.Popen | None = None
        self._log = None
        self.start_seconds: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:

        from miles_lp.config import child_runtime_env

        # the run's switches for the hook's code in SGLang's processes (serve.py applies them at import)
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", **child_runtime_env(), **self.extra_env}
        if self.api_key:  # the introspection endpoints take the key SGLang's own routes take
            env[ENV_KEY] = self.api_key
        # the shim first (SGLang's `import sgl_kernel`), then this checkout (the serve module, miles_lp)
        env["PYTHONPATH"] = os.pathsep.join([str(SHIM), str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        if self.tp_size > 1:  # SGLang's CPU platform binds each TP rank to cores of its own (numa_utils)
            env["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_bind(self.tp_size, self.threads)
            env["OMP_NUM_THREADS"] = str(len(cpu_bind_ranks(self.tp_size, self.threads)[0]))
        elif self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
            env["SGLANG_CPU_OMP_THREADS_BIND"] = "all"
        return env

    def start(self) -> SGLangCPUServer:
        if self._proc is not None:
            raise EngineError(f"the SGLang server on {self.url} is already started")
        self._log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 (closed in stop)
        out = self._log or subprocess.DEVNULL
        t0 = time.monotonic()
        # its own process group: stop() ends SGLang's scheduler and detokenizer children with it
        self._proc = subprocess.Popen([self.python, "-m", "miles_lp.rollout.sglang_cpu.serve", *self.args],
                                      env=self.env(), stdout=out, stderr=subprocess.STDOUT if self._log else None,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_healthy(t0 + self.start_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def _wait_healthy(self, deadline: float) -> None:
        req = urllib.request.Request(self.url + "/health")
        while True:
            code = self._proc.poll()
            if code is not None:
                raise EngineError(f"the SGLang server serving {self.model_path} exited with code {code} before it "
                                  f"answered /health{self._log_tail()}")
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise EngineError(f"the SGLang server serving {self.model_path} did not answer {self.url}/health "
                                  f"within {self.start_timeout_s:.0f} s{self._log_tail()}")
            time.sleep(0.5)

    def _log_tail(self, n: int = 3000) -> str:
        if not self.log_path or not self.log_path.is_file():
            return " (no log: pass log_path)"
        text = self.log_path.read_bytes()[-n:].decode(errors="replace")
        return f"; the end of {self.log_path}:\n{text}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server's process group at once (fault injection: a server that dies mid-run)."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(30)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the process group this object started, SIGKILL what is left after ``timeout``."""
        proc, self._proc = self._proc, None
        if proc is not None:
            for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 30.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(wait)
                    # the group's other members (SGLang's children) may outlive the leader by a moment
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> SGLangCPUServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
