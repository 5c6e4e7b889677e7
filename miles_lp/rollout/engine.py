"""The ``Engine`` protocol: what the RL loop and the weight sync need from a sampler.

Backends: the embedded reference engine (default; CPU or one GPU), ``miles-lp serve`` (the same engine
behind SGLang's HTTP subset), vLLM (offline engine, runs on this CPU), SGLang (HTTP client / ``sglang.Engine``).

Names on the update path are the engine checkpoint's own tensor names for its target (what
``miles_lp.export`` encodes: ``model.layers.0.mlp.down_proj.weight`` + ``...weight_scale_inv`` for the
SGLang MXFP8 target), so a live update writes exactly what a fresh load from disk would read.

Update semantics (SGLang's): ``begin_weight_update()`` stops serving; each ``update_weights(bucket)`` is
validated whole (names, shapes, dtypes) before any byte is written, then written in place into the
canonical tensors (storage and data pointers unchanged); ``finish_weight_update()`` rebuilds derived
state (swizzled scales, dequantized GEMM operands), bumps ``weight_version`` and serves again.
``generate`` between begin and finish raises ``EngineBusy``.

Log-probs: ``Generation.logprobs`` are the raw policy log-probs (temperature 1, before top-k/top-p) unless
``SamplingParams.logprob_mode == "processed"``; see ``miles_lp.rollout.sampling``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from miles_lp.errors import MilesLPError


class EngineError(MilesLPError, RuntimeError):
    """The engine refused a request or failed (bad update, dead process, unreachable server)."""


class EngineBusy(EngineError):
    """The engine is paused, in a weight update or closed: retry later (HTTP 503), the request itself is fine."""


class WeightUpdateError(EngineError, ValueError):
    """An update bucket names an unknown parameter or has a wrong shape/dtype: nothing was written."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    return_routed_experts: bool = False
    # "raw": log p of the policy at temperature 1 (RL's old_logprobs; vLLM's raw_logprobs); "processed": of the
    # distribution actually sampled (temperature, top-k, top-p applied; SGLang's default). See rollout/sampling.py.
    logprob_mode: str = "raw"

    def validate(self) -> None:
        if not self.temperature >= 0:
            raise EngineError(f"sampling temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise EngineError(f"sampling top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise EngineError(f"sampling top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise EngineError(f"sampling max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.logprob_mode not in ("raw", "processed"):
            raise EngineError(f"sampling logprob_mode must be 'raw' or 'processed', got {self.logprob_mode!r}")


@dataclasses.dataclass
class Generation:
    """One completion: the sampled tokens and the engine's log-prob of each (fp32 on CPU)."""

    output_ids: list[int]
    logprobs: torch.Tensor  # [len(output_ids)] log p_engine(token_t | prefix): raw (T=1) unless logprob_mode
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int
    routed_experts: torch.Tensor | None = None  # [len(prompt)+len(output)-1, MoE layers, top_k] int, MoE only


@runtime_checkable
class Engine(Protocol):
    weight_version: int

    def generate(self, input_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def flush_cache(self) -> None: ...

    def begin_weight_update(self) -> None: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def finish_weight_update(self) -> None: ...

    def quantized_params(self) -> Mapping[str, str]:
        """``{canonical weight name: format}`` of every parameter the engine's live modules hold in low
        precision, read from the modules themselves (C1), not from any config."""
        ...

    def weight_digests(self, names: Iterable[str] | None = None) -> Mapping[str, str]:
        """A digest of each canonical on-disk-named tensor the engine serves from (C2)."""
        ...

    def read_weights(self, names: Iterable[str]) -> Mapping[str, torch.Tensor]:
        """Copies of canonical tensors (C2 full compare; tests)."""
        ...

    def storage_pointers(self) -> Mapping[str, int]:
        """``data_ptr()`` of each tensor the serving kernels read (C4)."""
        ...

    def self_check(self, seed: int = 0) -> Mapping[str, Any]:
        """C3: one quantized dense layer and one expert through the serving kernel on random input vs a
        high-precision GEMM on the dequantized canonical weights; ``{"layers": {name: rel_err}, ...}``."""
        ...

    def health(self) -> Mapping[str, Any]: ...

    def close(self) -> None: ...


def tensor_digest(t: torch.Tensor) -> str:
    """The C2 digest of one tensor, the same on both sides of a sync: dtype, shape and a blake2b of its bytes.

    Byte-based (not value-based): an E4M3 NaN code, an E8M0 0xFF and a -0.0 differ from their neighbours.
    """
    import hashlib

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
    h = hashlib.blake2b(raw, digest_size=16)
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}:{h.hexdigest()}"
