"""One small exception hierarchy for user-facing errors.

Every error says what was wrong (file, tensor, YAML line or flag) and what to do about it.
``assert`` is reserved for internal invariants, never for user input.
"""

from __future__ import annotations


class MilesLPError(Exception):
    """Base class for errors caused by user input or the environment (not bugs)."""


class FormatError(MilesLPError, ValueError):
    """A tensor cannot be encoded in the requested format (dtype, shape, block size)."""


class ConfigError(MilesLPError, ValueError):
    """A recipe, policy or CLI option is invalid. Carries the source location when known."""

    def __init__(self, message: str, *, source: str | None = None, line: int | None = None):
        self.source = source
        self.line = line
        where = ""
        if source is not None:
            where = f"{source}:{line}: " if line is not None else f"{source}: "
        super().__init__(where + message)


class LayoutError(MilesLPError, ValueError):
    """A model architecture or tensor name that no registered layout understands."""


class CheckpointError(MilesLPError):
    """A checkpoint is missing, corrupt or inconsistent with its index or plan."""


class BackendUnavailable(MilesLPError, RuntimeError):
    """An optional backend (TE, SGLang, Megatron, Triton, CUDA) is not importable or usable here."""
