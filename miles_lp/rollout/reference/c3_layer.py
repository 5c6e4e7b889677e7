"""What C3 needs to know of one ``EngineLinear``: the key of its activation grid, the configuration a private copy
must share, and a private copy derived afresh (the reference engine's C3 and its graphs read these)."""

from __future__ import annotations

from typing import Any


def input_key(layer: Any) -> tuple:
    """What ``EngineLinear.quantize_input``'s cache keys the activation grid by."""
    return (layer.kernel_format, layer.activation_scale, layer.activation_mode, layer.op_dtype)


def fresh_config(layer: Any) -> tuple:
    """The configuration a kept private copy of ``layer`` must share (``ReferenceSelfCheck._freshly_derived``)."""
    return (layer.prefix, layer.in_features, layer.out_features, layer.disk_format, layer.target, layer.has_bias,
            layer.weight_dtype, layer.activation_scale, layer.act_dtype, layer.device_, layer.serve_format,
            layer.activation_mode)


def freshly_derived(layer: Any) -> Any:
    """A private copy of ``layer`` whose derived kernel state is rebuilt from its canonical tensors now (its
    own storage: never a view of a stack, never the live siblings' cached input)."""
    fresh = layer.detached_copy()
    fresh.process_weights_after_loading()
    return fresh
