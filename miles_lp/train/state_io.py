"""A learner's ``state_dict()`` on disk: tensors in safetensors, everything else in JSON (no pickle).

    save_learner_state(trainer.state_dict(), run_dir / "learner")      # writes tensors.safetensors + state.json
    trainer.load_state_dict(load_learner_state(run_dir / "learner"))    # bit-identical resume

The state is a tree of dicts (any key type JSON can tell apart: ``str``, ``int``), lists, tuples, tensors and
JSON scalars (the optimizer's ``state`` is keyed by int, Python's RNG state is a tuple). The tree is written
as JSON with tensors replaced by ``{"__tensor__": key}`` and dict keys / tuples tagged so that reading back
gives the same types; tensors go to one safetensors file (shared storage, as tied weights have, is cloned:
safetensors refuses aliases). Written to a temporary folder and renamed (``atomic_output_dir``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from miles_lp.errors import CheckpointError, ConfigError

TENSORS_FILE = "tensors.safetensors"
STATE_FILE = "state.json"
FORMAT_VERSION = 1


def _encode(obj: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    if isinstance(obj, torch.Tensor):
        key = path or "root"
        if key in tensors:  # a key holding "/" meets a nested path: the second would overwrite the first
            raise CheckpointError(f"learner state: two tensors at '{key}' (a key containing '/' collides with a "
                                  "nested one); rename the key")
        tensors[key] = obj
        return {"__tensor__": key}
    if isinstance(obj, Mapping):
        items = []
        for k, v in obj.items():
            if not isinstance(k, str | int) or isinstance(k, bool):
                raise CheckpointError(f"learner state key {k!r} at '{path}' is a {type(k).__name__}; only str and "
                                      "int keys can be saved")
            items.append([k, _encode(v, tensors, f"{path}/{k}" if path else str(k))])
        return {"__dict__": items}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise CheckpointError(f"learner state value at '{path}' is a {type(obj).__name__}, which cannot be saved "
                          "(tensors, dicts, lists, tuples and JSON scalars only)")


def _decode(obj: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            key = obj["__tensor__"]
            if key not in tensors:
                raise CheckpointError(f"learner state names tensor '{key}', which {TENSORS_FILE} does not hold")
            return tensors[key]
        if "__tuple__" in obj:
            return tuple(_decode(v, tensors) for v in obj["__tuple__"])
        if "__dict__" in obj:
            return {k: _decode(v, tensors) for k, v in obj["__dict__"]}
        raise CheckpointError(f"unexpected object in {STATE_FILE}: keys {sorted(obj)[:5]}")
    return obj


def save_learner_state(state: Mapping[str, Any], path: str | Path, *, overwrite: bool = False) -> Path:
    """Write ``state`` (a learner's ``state_dict()``) into the folder ``path``; returns ``path``."""
    from safetensors.torch import save_file

    from miles_lp.io.atomic import atomic_output_dir, check_output_target

    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, tensors, "")
    seen: set[int] = set()
    flat: dict[str, torch.Tensor] = {}
    for k, t in tensors.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        flat[k] = t
    out = check_output_target(path, overwrite)
    with atomic_output_dir(out, overwrite) as tmp:
        save_file(flat, str(tmp / TENSORS_FILE))
        (tmp / STATE_FILE).write_text(json.dumps({"version": FORMAT_VERSION, "state": tree}))
    return Path(path)


def load_learner_state(path: str | Path) -> dict[str, Any]:
    """Read a folder written by ``save_learner_state`` (CPU tensors)."""
    from safetensors.torch import load_file

    path = Path(path)
    sfile, jfile = path / TENSORS_FILE, path / STATE_FILE
    for f in (sfile, jfile):
        if not f.is_file():
            raise CheckpointError(f"{path} is not a learner state folder: {f.name} is missing "
                                  "(written by miles_lp.train.state_io.save_learner_state)")
    try:
        doc = json.loads(jfile.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{jfile}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{jfile}: learner state format version {doc.get('version') if isinstance(doc, dict) else None!r}"
                              f", this miles-lp reads version {FORMAT_VERSION}")
    return _decode(doc["state"], load_file(str(sfile)))


def check_learner_state(state: Mapping[str, Any], *, kind: str, plan_hash: str | None, learner: str) -> None:
    """Refuse a state another backend saved (``kind``) or one saved under another precision plan: its masters
    were trained against another grid, so resuming would silently change the policy both sides compute.
    ``learner`` names the learner in the message ("the embedded trainer")."""
    if state.get("kind") != kind:
        raise ConfigError(f"learner state of kind {state.get('kind')!r} cannot be loaded into {learner} "
                          "(train.backend must match the run that saved it)")
    if state.get("plan_hash") != plan_hash:
        raise ConfigError(f"learner state was saved under plan {str(state.get('plan_hash'))[:16]}, {learner} "
                          f"runs plan {str(plan_hash)[:16]}; resume with the recipe the run started with")
