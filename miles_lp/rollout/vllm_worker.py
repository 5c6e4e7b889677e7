"""The vLLM engine process (runs under the vLLM venv's interpreter; ``miles_lp.rollout.vllm`` starts it).

Protocol: ``multiprocessing.connection`` over a Unix socket with an HMAC auth key, ``send_bytes`` /
``recv_bytes`` only (no pickle). Each request is one JSON message; ``bucket`` requests are followed by one
safetensors message. Each answer is one JSON message (``{"ok": true, ...}`` or ``{"ok": false, "error"}``).

vLLM's offline ``LLM`` and its engine core run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). At tp 1
the executor is ``uni``: the model too, and ``collective_rpc`` / ``apply_model`` run in-process. At tp N
(``rollout.engine_tp``) it is ``mp``: one vLLM worker process per TP rank, each with its shard and its own
``vllm_state.STATE``; ``collective_rpc`` sends our module-level targets (by reference: cloudpickle, through vLLM's
own shared-memory queue, never on our channel) and returns one answer per rank, merged here (``Ranks``).
Weight update (CONTRACT 10): buffered buckets (whole checkpoint tensors) are handed at ``finish`` to every rank's
``worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)`` (vLLM's loaders keep the rank's shard
and re-run the quantized layers' post-processing), then ``llm.reset_prefix_cache()`` (without it a reused prompt
prefix keeps stale KV). ``__main__`` guard: vLLM may spawn processes that re-import the main module.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _checkpoint_tensors(folder: str) -> dict:
    """Every tensor of the model in ``folder``: the files ``select_weight_files`` names (the index's shards, else
    ``model.safetensors``; never a stray ``consolidated.safetensors`` with foreign names)."""
    from safetensors.torch import load_file

    from miles_lp.io.safetensors_io import select_weight_files

    out: dict = {}
    for f in select_weight_files(folder)[0]:
        out.update(load_file(str(f)))
    return out


def _reload_checked(llm, tensors: dict) -> None:
    """The reload in every TP rank (``vllm_state.reload_on_rank``: the fault hooks of the fault-injection tests
    around it, all off unless set)."""
    from miles_lp.rollout import vllm_state

    llm.collective_rpc(vllm_state.reload_on_rank, args=(tensors,))


class Ranks:
    """The sync checks' answers over every TP rank (``vllm_state``'s per-rank targets and merges)."""

    def __init__(self, llm, shapes: dict):
        from miles_lp.rollout import vllm_state

        self.llm, self.shapes, self.vs = llm, shapes, vllm_state

    def call(self, method: str, *args, **kwargs) -> list:
        """``Canonical.<method>`` in every rank: the answers in rank order."""
        return self.llm.collective_rpc(self.vs.on_rank, args=(method, *args), kwargs=kwargs)

    def tensors(self, names: list[str]) -> tuple[dict, dict]:
        """``({name: whole tensor or None}, {name: why the ranks' copies do not make one})``."""
        return self.vs.merge_parts(self.call("parts", names), names, self.shapes)

    def digests(self, names: list[str]) -> dict:
        from miles_lp.rollout.engine import tensor_digest

        got, bad = self.tensors(names)
        return {n: (f"TP ranks disagree: {bad[n]}" if n in bad else None if t is None else tensor_digest(t))
                for n, t in got.items()}

    def fingerprints(self, names: list[str]) -> dict:
        from miles_lp.multitensor import digest

        got, bad = self.tensors(names)
        out: dict = dict(digest.fingerprints({n: t for n, t in got.items() if t is not None}))
        out.update({n: None for n, t in got.items() if t is None})
        out.update({n: f"TP ranks disagree: {why}" for n, why in bad.items()})
        return out

    def group_fingerprints(self, groups: dict) -> dict:
        from miles_lp.multitensor import digest

        got, bad = self.tensors(list(dict.fromkeys(n for ns in groups.values() for n in ns)))
        ok = {g: [got[n] for n in ns] for g, ns in groups.items() if all(got[n] is not None for n in ns)}
        out: dict = dict(digest.group_fingerprints(ok))
        out.update({g: None for g in groups if g not in ok})
        out.update({g: f"TP ranks disagree: {bad[n]}" for g, ns in groups.items() for n in ns if n in bad})
        return out


def _answer(conn, obj) -> None:
    conn.send_bytes(json.dumps(obj).encode())


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model / collective_rpc callables
    from multiprocessing.connection import Client

    cfg = json.loads(os.environ["MILES_LP_VLLM_WORKER"])
    conn = Client(cfg["address"], family="AF_UNIX", authkey=bytes.fromhex(os.environ["MILES_LP_VLLM_AUTHKEY"]))
    t0 = time.perf_counter()
    try:
        from miles_lp.config import use_runtime_from_env

        use_runtime_from_env()  # the run's runtime: section (MILES_LP_RUNTIME from rollout.vllm), before any codec loads
        from safetensors.torch import load as st_load
        from vllm import LLM, SamplingParams

        tp = int(cfg.get("tp", 1))  # at tp > 1 each rank's cores come in VLLM_CPU_OMP_THREADS_BIND (rollout.vllm)
        llm = LLM(model=cfg["model"], skip_tokenizer_init=True, enforce_eager=True, dtype=cfg["dtype"],
                  max_model_len=cfg["max_model_len"], max_num_seqs=cfg["max_num_seqs"], seed=0,
                  tensor_parallel_size=tp, distributed_executor_backend="uni" if tp == 1 else "mp",
                  enable_prefix_caching=True, kv_cache_dtype=cfg.get("kv_cache_dtype", "auto"))
        # the C2 capture hook in every TP rank, then one reload of the served checkpoint through it: the canonical
        # bytes as vLLM's loaders placed them exist from the start (miles_lp.rollout.vllm_state)
        from miles_lp.rollout import vllm_state

        hooked = llm.collective_rpc(vllm_state.attach_rank)
        served = _checkpoint_tensors(cfg["model"])
        shapes = {n: tuple(t.shape) for n, t in served.items()}
        ranks = Ranks(llm, shapes)
        llm.collective_rpc(vllm_state.set_shapes, args=(shapes,))
        ranks.call("set_faults", dict(cfg.get("faults") or {}))
        _reload_checked(llm, served)
        llm.reset_prefix_cache()
        _answer(conn, {"ok": True, "seconds": time.perf_counter() - t0, "hooked": hooked[0], "tp": tp})
    except Exception as exc:
        _answer(conn, {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        return
    pending: dict = {}
    while True:
        try:
            req = json.loads(conn.recv_bytes())
        except EOFError:
            return
        op = req.get("op")
        try:
            if op == "generate":
                s = req["sampling"]
                # vLLM seeds a generator PER REQUEST: one seed for all would give every copy of a prompt (a GRPO
                # group) the same sample. Request i gets its own seed derived from (seed, i), as the reference
                # engine's draws depend on the batch index.
                seed = s.get("seed")
                sps = [SamplingParams(max_tokens=s["max_new_tokens"], temperature=s["temperature"], top_p=s["top_p"],
                                      top_k=s["top_k"] if s["top_k"] > 0 else -1,
                                      seed=None if seed is None else (int(seed) * 1_000_003 + i) % (2 ** 63),
                                      logprobs=0, stop_token_ids=s.get("stop_token_ids") or None, detokenize=False,
                                      ignore_eos=True)  # only explicit stop tokens stop (the Engine protocol)
                       for i in range(len(req["prompts"]))]
                outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], sps, use_tqdm=False)
                res = []
                for o in outs:
                    c = o.outputs[0]
                    ids = list(c.token_ids)
                    lps = [float(d[t].logprob) for t, d in zip(ids, c.logprobs, strict=True)]
                    res.append({"ids": ids, "logprobs": lps, "finish": c.finish_reason or "length"})
                _answer(conn, {"ok": True, "outputs": res})
            elif op == "score":
                sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
                outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], sp, use_tqdm=False)
                res = [[float(d[t].logprob) for t, d in zip(p[1:], o.prompt_logprobs[1:], strict=True)]
                       for p, o in zip(req["prompts"], outs, strict=True)]
                _answer(conn, {"ok": True, "logprobs": res})
            elif op == "bucket":
                pending.update(st_load(conn.recv_bytes()))
                _answer(conn, {"ok": True, "pending": len(pending)})
            elif op == "finish":
                t = time.perf_counter()
                n = len(pending)
                try:
                    _reload_checked(llm, pending)
                    llm.reset_prefix_cache()
                finally:  # a failed reload must not leave its tensors to merge into the next update
                    pending = {}
                _answer(conn, {"ok": True, "reloaded": n, "seconds": time.perf_counter() - t})
            elif op == "abort_update":
                pending = {}
                _answer(conn, {"ok": True})
            elif op == "flush":
                llm.reset_prefix_cache()
                _answer(conn, {"ok": True})
            elif op == "introspect":
                _answer(conn, {"ok": True, "layers": vllm_state.merge_introspection(llm.apply_model(vllm_state.introspect))})
            elif op == "digests":
                names = req["names"]
                srcs = ranks.call("sources", names)
                _answer(conn, {"ok": True, "digests": ranks.digests(names), "sources": srcs[0],
                               "captures": sum(ranks.call("capture_count"))})
            elif op == "fingerprints":
                _answer(conn, {"ok": True, "fingerprints": ranks.fingerprints(req["names"])})
            elif op == "group_fingerprints":
                _answer(conn, {"ok": True, "fingerprints": ranks.group_fingerprints(req["groups"])})
            elif op == "read":
                from safetensors.torch import save

                got, bad = ranks.tensors(req["names"])
                _answer(conn, {"ok": True, "missing": sorted(n for n, t in got.items() if t is None), "tp_mismatch": bad})
                conn.send_bytes(save({n: t.contiguous() for n, t in got.items() if t is not None}))
            elif op == "pointers":
                _answer(conn, {"ok": True, "pointers": vllm_state.merge_pointers(ranks.call("pointers"))})
            elif op == "self_check":
                version = req.get("version")
                _answer(conn, {"ok": True, "result": vllm_state.merge_self_check(ranks.call(
                    "self_check", int(req.get("seed", 0)), version=None if version is None else int(version)))})
            elif op == "self_check_every_layer":
                _answer(conn, {"ok": True, "layers": vllm_state.merge_layers(
                    ranks.call("every_layer", int(req.get("seed", 0))))})
            elif op == "faults":
                ranks.call("set_faults", dict(req.get("faults") or {}))
                _answer(conn, {"ok": True})
            elif op == "shutdown":
                _answer(conn, {"ok": True})
                return
            else:
                _answer(conn, {"ok": False, "error": f"unknown op {op!r}"})
        except Exception as exc:  # report and keep serving
            traceback.print_exc(file=sys.stderr)
            _answer(conn, {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]})


if __name__ == "__main__":
    main()
