"""Byte-level work over many tensors at once, each read in place: the C2 fingerprint both sides of a sync compute
(``digest``: the torch reference; ``kernels``: the same arithmetic as one Triton launch, plus the packed copy and
the float-format count the sync's buckets use) and batched strided copies (``strided``). Below the engines and
the sync, which both call it."""
