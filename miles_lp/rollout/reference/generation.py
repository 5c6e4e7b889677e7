"""The reference engine's generation and serving state (``ReferenceEngine``'s fifth job).

Batched, left-padded (a prompt repeated in the batch, a GRPO group, is prefilled once: ``_prefill_shared``), transformers' KV cache (``kv_cache: fp8_e4m3`` rounds K/V as the engines do,
``rollout.kv_cache``), one token per step for every unfinished row, finished rows dropped from the batch.
``Generation.logprobs`` are raw policy log-probs (temperature 1; ``rollout.sampling``). Prompts must be shorter
than the context (``max_position_embeddings``); ``max_new_tokens`` is capped at what fits (finish ``length``).

Serving state: ``pause`` / ``resume`` / ``flush_cache``, and the step boundary (``_park``) where a generation in
flight waits while paused or in a weight update, then continues as its pause mode says (``retract``: recompute
the KV of prompt + tokens so far with the new weights, SGLang's ``retract``; ``in_place``: keep it; ``abort``).
Every forward pass of the model runs in ``_forward`` (prefill and decode steps alike).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import torch

from miles_lp.rollout.engine import EngineBusy, EngineError, Generation, SamplingParams
from miles_lp.rollout.kv_cache import make_cache
from miles_lp.rollout.layers import EngineExperts
from miles_lp.rollout.sampling import sample

PAUSE_MODES = ("abort", "retract", "in_place")


class ReferenceGeneration:
    """``ReferenceEngine``'s generation. Reads ``model``, ``hf_config``, ``_cache_kwarg``, ``device``,
    ``kv_cache`` / ``kv_scales``, ``context_len``, ``vocab_size``, ``weight_version``; owns the serving state
    (``_cond``, ``_gen_lock``, ``_paused``, ``_pause_mode``, ``_stepping``, ``_cache_epoch``, ``_in_flight``,
    ``parked``) that the updates share."""

    model: torch.nn.Module
    device: torch.device
    context_len: int
    vocab_size: int
    weight_version: int
    _cond: threading.Condition
    #: prefill each distinct prompt once and share its KV with the rows that repeat it (``_prefill_shared``)
    share_prompts: bool = True

    def pause(self, mode: str = "retract") -> None:
        """Stop generating at the next step boundary (``abort``: in-flight requests end with finish ``abort``;
        ``retract``: they resume after ``resume()`` recomputing their KV; ``in_place``: they keep their KV)."""
        if mode not in PAUSE_MODES:
            raise EngineError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        with self._cond:
            self._paused, self._pause_mode = True, mode
            self._cond.wait_for(lambda: not self._stepping)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def flush_cache(self) -> None:
        """No KV outlives a request here (no prefix cache); a generation parked ``in_place`` recomputes its KV."""
        with self._cond:
            self._cache_epoch += 1

    def validate_prompts(self, input_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.tolist()
        if not input_ids:
            raise EngineError("generate: empty batch")
        prompts = []
        for i, p in enumerate(input_ids):
            p = [int(t) for t in p]
            if not p:
                raise EngineError(f"generate: prompt {i} is empty")
            if len(p) >= self.context_len:
                raise EngineError(f"generate: prompt {i} has {len(p)} tokens; the context is {self.context_len} "
                                  "(max_position_embeddings): shorten the prompt")
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise EngineError(f"generate: prompt {i} has token ids outside the vocabulary [0, {self.vocab_size}): "
                                  f"{bad[:3]}")
            prompts.append(p)
        return prompts

    def generate(self, input_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        sampling.validate()
        prompts = self.validate_prompts(input_ids)
        for i, p in enumerate(prompts):  # SGLang and vLLM refuse it too: a cut response would read as `length`
            if len(p) + sampling.max_new_tokens > self.context_len:
                raise EngineError(f"generate: prompt {i} has {len(p)} tokens + max_new_tokens "
                                  f"{sampling.max_new_tokens} = {len(p) + sampling.max_new_tokens}, beyond the "
                                  f"context {self.context_len} (max_position_embeddings): lower max_new_tokens "
                                  "(rollout.max_response_len) or shorten the prompt")
        with self._gen_lock:
            with self._cond:
                if self._closed:
                    raise EngineBusy("generate: the engine is closed")
                if self._partial:
                    raise EngineBusy("generate: a failed weight update left a partial state; generation is refused "
                                     "until a full update (begin_weight_update ... finish_weight_update) succeeds")
                if self._updating:
                    raise EngineBusy("generate: a weight update is in progress (begin_weight_update ... "
                                      "finish_weight_update); generation is refused until it finishes")
                if self._paused and not self._cond.wait_for(lambda: not self._paused, timeout=self.pause_timeout_s):
                    raise EngineBusy("generate: the engine is paused; call resume() (continue_generation)")
            self._in_flight += 1
            try:
                with torch.inference_mode():
                    return self._run(prompts, sampling)
            finally:
                self._in_flight -= 1

    def score(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Teacher-forced raw log-probs ``log p(x_t | x_<t)`` for t = 1..L-1 of each sequence (fp32, CPU): the
        serving kernels on given tokens (vLLM's ``prompt_logprobs``), for comparisons on identical inputs."""
        seqs = self.validate_prompts(sequences)
        with self._gen_lock, torch.inference_mode():
            out = []
            for s in seqs:
                ids = torch.tensor([s], device=self.device)
                cache = make_cache(self.hf_config, self.kv_cache, *self.kv_scales)  # K/V through the cache's rounding
                logits = self.model(input_ids=ids, use_cache=True, **{self._cache_kwarg: cache}).logits[0].float()
                lp = torch.log_softmax(logits, -1)[:-1]
                out.append(lp.gather(-1, ids[0, 1:, None])[:, 0].cpu())
            return out

    def _forward(self, ids, mask, pos, cache):
        kw = {self._cache_kwarg: cache}
        return self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                          **kw).logits[:, -1]

    def _prefill(self, seqs: list[list[int]], rows: list[int], recorder):
        """Left-padded prefill of ``seqs``; returns (logits [R, V], cache, mask [R, L], next positions [R, 1])."""
        lens = [len(s) for s in seqs]
        width = max(lens)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[r, width - len(s):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp_(min=0)
        cache = make_cache(self.hf_config, self.kv_cache, *self.kv_scales)
        with self._routing(recorder, len(seqs), width):
            logits = self._forward(ids, mask, pos, cache)
        return logits, cache, mask, pos[:, -1:] + 1, lens

    def _prefill_shared(self, seqs: list[list[int]], rows: list[int], recorder):
        """``_prefill`` of each distinct sequence once, its logits and KV then gathered back to every row that holds it
        (a GRPO group's samples share their prompt, as SGLang's radix cache shares a prefix). The left padding is the
        same (the distinct set holds the longest sequence) and every row's forward is its own; the GEMMs have fewer
        rows, and CPU BLAS may round a row differently at another row count: on the shapes of
        ``tests/unit/test_rollout_reference.py`` the generations are byte-identical with and without sharing, while
        a one-layer tiny Qwen3 with 2 prompts x 4 samples moved the log-probs by ~2e-8 (``tests/e2e/test_run.py``).
        Under routing replay (``recorder``), or without duplicates, the plain prefill."""
        first: dict[tuple[int, ...], int] = {}
        inverse = [first.setdefault(tuple(s), len(first)) for s in seqs]
        if recorder is not None or not self.share_prompts or len(first) == len(seqs):
            return self._prefill(seqs, rows, recorder)
        distinct = [list(s) for s in first]
        logits, cache, mask, pos, _ = self._prefill(distinct, [rows[seqs.index(s)] for s in distinct], None)
        idx = torch.tensor(inverse, device=self.device)
        cache.batch_select_indices(idx)  # every layer's K/V rows gathered (repeats allowed)
        return logits[idx], cache, mask[idx], pos[idx], [len(s) for s in seqs]

    def _routing(self, recorder, batch: int, width: int):
        model = self.model

        @contextlib.contextmanager
        def ctx():
            if recorder is None:
                yield
                return
            mods = [m for m in model.modules() if isinstance(m, EngineExperts)]
            step: list[torch.Tensor] = []
            for m in mods:
                m.recorder = lambda idx, step=step: step.append(idx.reshape(batch, width, -1).cpu())
            try:
                yield
            finally:
                for m in mods:
                    m.recorder = None
            if step:
                recorder(torch.stack(step, dim=2))  # [B, T, layers, top_k]
        return ctx()

    def _park(self) -> str | None:
        """At a step boundary: wait while paused or updating, then mark the next step as running (atomically, so a
        ``pause()`` returns only once no step runs). Returns None (not parked), or the pause mode it woke from."""
        with self._cond:
            mode = None
            if self._paused or self._updating:
                mode = self._pause_mode if self._paused else "retract"
                if mode == "abort":
                    return "abort"
                epoch, version = self._cache_epoch, self.weight_version
                self.parked += 1
                self._cond.wait_for(lambda: not (self._paused or self._updating) or self._closed)
                if self._closed:
                    return "abort"
                if mode == "in_place" and epoch != self._cache_epoch and version == self.weight_version:
                    mode = "retract"  # the cache was flushed while parked: recompute
            self._stepping = True
            return mode

    def _run(self, prompts: list[list[int]], sp: SamplingParams) -> list[Generation]:
        from miles_lp.rollout import cuda_decode  # static KV cache + CUDA graphs where they apply

        fast = cuda_decode.maybe_run(self, prompts, sp)
        if fast is not None:
            return fast
        n = len(prompts)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        stop = set(sp.stop_token_ids)
        budget = [min(sp.max_new_tokens, self.context_len - len(p)) for p in prompts]
        outs: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        routes: list[list[torch.Tensor]] = [[] for _ in range(n)]
        want_routes = sp.return_routed_experts
        active = list(range(n))  # original indices of the rows in the batch

        def prefill_recorder(r: torch.Tensor, rows=None, lens=None):
            for j, b in enumerate(rows):
                routes[b] = [r[j, r.shape[1] - lens[j]:]]

        def prefill(rows):
            seqs = [prompts[b] + outs[b] for b in rows]
            lens = [len(s) for s in seqs]
            rec = (lambda r: prefill_recorder(r, rows, lens)) if want_routes else None
            return self._prefill_shared(seqs, rows, rec)

        self._park()  # marks the step as running
        try:
            logits, cache, mask, pos, _ = prefill(active)
        finally:
            self._set_stepping(False)
        while True:
            tokens, lp = sample(logits, sp.temperature, sp.top_k, sp.top_p, gen, sp.logprob_mode)
            tokens_l, lp_l = tokens.tolist(), lp.float().cpu().tolist()
            keep = []
            for j, b in enumerate(active):
                t = tokens_l[j]
                outs[b].append(t)
                lps[b].append(lp_l[j])
                if t in stop:
                    reasons[b] = "stop"
                elif len(outs[b]) >= budget[b]:
                    reasons[b] = "length"
                else:
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(active):
                idx = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(idx)
                mask, pos, tokens = mask[idx], pos[idx], tokens[idx]
                active = [active[j] for j in keep]
            mode = self._park()
            if mode == "abort":
                for b in active:
                    reasons[b] = "abort"
                break
            try:
                if mode == "retract":
                    logits, cache, mask, pos, _ = prefill(active)
                    continue
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                rec = None
                if want_routes:
                    def rec(r, rows=tuple(active)):
                        for j, b in enumerate(rows):
                            routes[b].append(r[j])
                with self._routing(rec, len(active), 1):
                    logits = self._forward(tokens[:, None], mask, pos, cache)
                pos = pos + 1
            finally:
                self._set_stepping(False)
        version = self.weight_version
        result = []
        for b in range(n):
            r = None
            if want_routes and routes[b]:
                r = torch.cat(routes[b], dim=0)[: len(prompts[b]) + len(outs[b]) - 1]
            result.append(Generation(outs[b], torch.tensor(lps[b], dtype=torch.float32), reasons[b] or "length",
                                     version, r))
        return result

    def _set_stepping(self, on: bool) -> None:
        with self._cond:
            self._stepping = on
            if not on:
                self._cond.notify_all()
