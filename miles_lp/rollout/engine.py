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
import enum
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
    """What every engine answers: generation, the pause / update / resume cycle, and the introspection the
    weight sync's checks read (C1 ``quantized_params``, C2 ``weight_digests`` / ``read_weights``, C3
    ``self_check``, C4 ``storage_pointers``). A backend that cannot answer one of the introspection calls (a stock
    SGLang server has no endpoint for them) raises ``NotImplementedError`` or ``BackendUnavailable`` there: the
    check is then skipped with that reason (C7), never guessed.

    Faster or finer answers are optional and declared, not probed: ``capabilities`` (a set of ``Capability``)
    names the optional methods below that the engine implements (``OptionalEngine`` documents each). The sync
    reads the set once per engine (``engine_capabilities``) and calls only what it names."""

    weight_version: int

    def generate(self, input_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        """One ``Generation`` per prompt, in order. ``sampling.seed`` makes the call reproducible for the same
        prompts in the same order; ``EngineBusy`` while paused or in an update."""
        ...

    def pause(self) -> None:
        """Stop serving (requests in flight wait or abort, as the engine's pause mode says)."""
        ...

    def resume(self) -> None:
        """Serve again after ``pause`` (or after a finished update)."""
        ...

    def flush_cache(self) -> None:
        """Drop the prefix / KV cache (its entries were computed with the weights being replaced)."""
        ...

    def begin_weight_update(self) -> None:
        """Open an update: generation refused until ``finish_weight_update``."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Validate the whole bucket (names, shapes, dtypes: ``WeightUpdateError``, nothing written), then write it
        in place into the canonical tensors; the engine copies before returning (the caller reuses the buffer)."""
        ...

    def finish_weight_update(self) -> None:
        """Rebuild derived state (swizzled scales, dequantized operands), bump ``weight_version``."""
        ...

    def quantized_params(self) -> Mapping[str, str]:
        """``{canonical weight name: format}`` of every parameter the engine's live modules hold in low
        precision, read from the modules themselves (C1), not from any config."""
        ...

    def weight_digests(self, names: Iterable[str] | None = None) -> Mapping[str, str]:
        """A digest (``tensor_digest``) of each canonical on-disk-named tensor the engine serves from (C2; also
        the update's target spec when the engine lacks ``Capability.PARAM_SPECS``)."""
        ...

    def read_weights(self, names: Iterable[str]) -> Mapping[str, torch.Tensor]:
        """Copies of canonical tensors (C2 full compare; tests)."""
        ...

    def storage_pointers(self) -> Mapping[str, int]:
        """``data_ptr()`` of each tensor the serving kernels read (C4)."""
        ...

    def self_check(self, seed: int = 0) -> Mapping[str, Any]:
        """C3: one quantized dense layer and one expert through the serving kernel on random input vs a
        high-precision GEMM on the dequantized canonical weights; ``{"layers": {name: rel_err}, ...}``. The probe,
        its figures and the pass rule are ``miles_lp.rollout.self_check``'s, the same for every engine."""
        ...

    def health(self) -> Mapping[str, Any]:
        """``{"status": "ok" | "dead" | ..., ...}``; ``dead`` only from an engine whose own process is gone."""
        ...

    def close(self) -> None: ...


class Capability(enum.StrEnum):
    """An optional part of the engine protocol (``OptionalEngine``); the value is the method or attribute name."""

    PARAM_SPECS = "param_specs"
    GROUP_FINGERPRINTS = "weight_group_fingerprints"
    FINGERPRINTS = "weight_fingerprints"
    CHECK_STATE = "check_state"
    SELF_CHECK_BEGIN = "self_check_begin"
    SELF_CHECK_EVERY_LAYER = "self_check_every_layer"
    ABORT_UPDATE = "abort_weight_update"
    ROTATION_BASE = "c3_rotation_base"


class OptionalEngine(Engine, Protocol):
    """The optional methods, each present exactly when its ``Capability`` is in ``capabilities``."""

    capabilities: frozenset[Capability]
    c3_rotation_base: int
    """``ROTATION_BASE``: C3 rotates its probed layer with the weight version; a restarted engine counts from 0,
    so the run sets this to its syncs so far and the rotation stays where a straight run's is."""

    def param_specs(self) -> Mapping[str, tuple[torch.dtype, tuple[int, ...]]]:
        """``PARAM_SPECS``: ``{name: (dtype, shape)}`` of every canonical tensor, without hashing any."""
        ...

    def weight_group_fingerprints(self, groups: Mapping[str, Sequence[str]]) -> Mapping[str, str]:
        """``GROUP_FINGERPRINTS``: one fingerprint per atomic group (``miles_lp.multitensor.digest.group_fingerprints``
        of the group's tensors in the given order): C2 in one value per group."""
        ...

    def weight_fingerprints(self, names: Sequence[str]) -> Mapping[str, str]:
        """``FINGERPRINTS``: ``miles_lp.multitensor.digest.fingerprints`` of each named tensor (C2, names the differing
        tensors of a group; faster than ``weight_digests``)."""
        ...

    def check_state(self, groups: Mapping[str, Sequence[str]] | None) -> Mapping[str, Any]:
        """``CHECK_STATE``: C2's and C4's engine side in one read of the live tensors: ``{"names", "pointers"}``
        (aligned tuples) and, with ``groups``, ``"group_heads"`` / ``"group_values"`` (what
        ``weight_group_fingerprints`` hashes, unhashed) and ``"pointer_seconds"``."""
        ...

    def self_check_begin(self, seed: int = 0) -> bool:
        """``SELF_CHECK_BEGIN``: queue C3's device work now; ``self_check(seed)`` collects it."""
        ...

    def self_check_every_layer(self) -> Mapping[str, float]:
        """``SELF_CHECK_EVERY_LAYER``: every quantized layer's serving state against a fresh derivation (the
        full-compare syncs run it)."""
        ...

    def abort_weight_update(self) -> None:
        """``ABORT_UPDATE``: drop an update opened by ``begin_weight_update`` before any byte was written, so the
        previous weights serve again."""
        ...


def engine_capabilities(engine: Any) -> frozenset[Capability]:
    """The optional capabilities of ``engine``: its declared ``capabilities`` attribute; for an engine class that
    does not declare one, the members of ``Capability`` it defines (read once, here, so the callers name what
    they use instead of probing). A declared set naming a method the engine lacks is refused: a declaration
    must not promise what the engine cannot do."""
    declared = getattr(engine, "capabilities", None)
    if declared is None:
        return frozenset(c for c in Capability if getattr(engine, c.value, None) is not None)
    caps = frozenset(Capability(c) for c in declared)
    missing = [c.value for c in caps if getattr(engine, c.value, None) is None]
    if missing:
        raise TypeError(f"{type(engine).__name__} declares capabilities {missing} it does not implement")
    return caps


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
