"""Whole-model export of a transformers model under canonical HF names (the embedded learner's side).

``hf_named_tensors`` walks the model's ``state_dict`` once, in order, and yields EVERY tensor the HF
checkpoint holds, once each (``Learner.export_weights``, miles_lp/train/learner.py):

* a weight the learner runs quantized -> its forward grid (``learner_weights``: the very bytes the last or
  next forward computes with, never a re-quantization of a BF16 copy);
* every other parameter / persistent buffer -> a detached ``torch.Tensor`` in the checkpoint's dtype (the
  dtype the source checkpoint stored for that name; BF16 when unknown);
* transformers-5 fused experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) -> per-expert canonical
  names (``experts.{e}.gate_proj.weight`` = rows ``[0, I)`` of expert ``e``, ``up_proj`` = rows ``[I, 2I)``,
  the member order ``ModelLayout.describe`` lists), whether the experts run quantized or BF16;
* tied weights once: only the names the source checkpoint stores when those are known, else the first name
  a shared storage appears under (``model.embed_tokens.weight`` before ``lm_head.weight``, what
  ``save_pretrained`` keeps).

A yielded tensor may share memory with the live parameter (when the dtypes agree): consumers copy, never
write into it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any

import torch

from miles_lp.errors import CheckpointError

DEFAULT_DTYPE = torch.bfloat16


def split_fused(t: torch.Tensor, members: tuple[str, ...]) -> list[tuple[str, torch.Tensor]]:
    """A fused ``[E, R, K]`` expert tensor -> one ``[R * E / len(members), K]`` matrix per member, in order.

    ``gate_up_proj [E, 2I, H]`` with members ``(e0.gate, e0.up, e1.gate, ...)`` reshapes to ``[2E, I, H]``:
    index ``2e`` is rows ``[0, I)`` of expert ``e`` (gate), ``2e + 1`` rows ``[I, 2I)`` (up); transformers 5
    concatenates gate before up (``is_concatenated``). ``down_proj [E, H, I]``: one member per expert.
    """
    if t.dim() != 3 or (t.shape[0] * t.shape[1]) % len(members):
        raise CheckpointError(f"fused tensor of shape {list(t.shape)} cannot hold the {len(members)} members "
                              f"{members[0]}...")
    parts = t.reshape(len(members), -1, t.shape[-1])
    return [(m, parts[i]) for i, m in enumerate(members)]


def hf_named_tensors(model: torch.nn.Module, layout, quantized: Mapping[str, Any], *,
                     dtypes: Mapping[str, torch.dtype] | None = None, default_dtype: torch.dtype = DEFAULT_DTYPE,
                     names: Collection[str] | None = None) -> Iterator[tuple[str, Any]]:
    """``(canonical HF name, quantized grid | tensor)`` for every tensor of ``model``'s checkpoint.

    ``quantized``: ``{canonical name: grid}`` (from ``learner_weights``); ``dtypes``: the source checkpoint's
    dtype per canonical name; ``names``: the names the source checkpoint holds (when known: the export then
    yields exactly those, and a name the model does not hold is a ``CheckpointError`` at the end).
    """
    dtypes = dtypes or {}
    wanted = None if names is None else set(names)
    done: set[str] = set()
    storages: set[tuple] = set()
    for mem_name, t in model.state_dict().items():
        info = layout.describe(mem_name)
        members = info.members
        if wanted is None:  # tied weights: the first name a storage appears under
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            if t.numel() and key in storages:
                continue
            storages.add(key)
        if len(members) > 1 and all(m in quantized for m in members):
            pieces = [(m, None) for m in members]  # every member exports its grid: no views of the master needed
        elif len(members) > 1 or (info.kind == "fused" and t.dim() == 3):
            pieces = split_fused(t, members)
        else:
            pieces = [(members[0], t)]
        for name, piece in pieces:
            if (wanted is not None and name not in wanted) or name in done:
                continue
            done.add(name)
            q = quantized.get(name)
            if q is not None:
                yield name, q
                continue
            piece = piece.detach()
            if piece.is_floating_point():
                piece = piece.to(dtypes.get(name, default_dtype))
            yield name, piece
    missing = sorted((wanted or set()) - done) + sorted(set(quantized) - done)
    if missing:
        raise CheckpointError(f"the model holds no tensor for {len(missing)} name(s) of its checkpoint / plan, "
                              f"e.g. {missing[:5]} (layers transformers does not build, such as DeepSeek's MTP "
                              "layers, cannot be exported from this learner)")
