"""From a learner to an engine: engine tensor naming/encoding, export groups, engine checkpoints.

    from miles_lp.export import naming                      # target x format -> on-disk names, dtypes, encode
    from miles_lp.export import encode_weight, engine_tensors  # (name, tensor) + plan + target -> disk tensors
    from miles_lp.export import export_groups, ExportGroup     # atomic groups for the sync's buckets
    from miles_lp.export import emit_configs                   # plan + target -> quantization_config, side files
    from miles_lp.export import export_learner                 # `miles-lp export`: any Learner -> checkpoint

One module owns engine naming (``naming``), used by ``miles-lp convert``, ``miles-lp export`` and the live
weight sync, so a converted checkpoint and a synchronized engine hold the same tensors under the same names.
Layering: ``naming`` needs only ``formats``; ``tensors`` / ``groups`` / ``schemes`` / ``configs`` add the plan;
``writer`` adds ``miles_lp.io`` (safetensors shards, atomic folders). Nothing here imports the converter or a
learner: ``checkpoint`` and ``train`` sit above. Names are imported lazily so ``import miles_lp.export.naming``
stays light.
"""

from __future__ import annotations

_LAZY = {
    "encode_weight": "miles_lp.export.tensors", "engine_tensors": "miles_lp.export.tensors",
    "is_quantized": "miles_lp.export.tensors",
    "ExportGroup": "miles_lp.export.groups", "export_groups": "miles_lp.export.groups",
    "group_key": "miles_lp.export.groups",
    "emit_configs": "miles_lp.export.configs",
    "export_learner": "miles_lp.export.writer",
    "write_metadata": "miles_lp.export.writer", "ExportSummary": "miles_lp.export.writer",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'miles_lp.export' has no attribute '{name}'")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = sorted(_LAZY)
