"""The Megatron-Core learner backend (extra ``megatron``).

* ``model``: build a Megatron GPT/MoE model for an HF config (local layer spec) and load HF weights;
* ``layers``: Megatron's parallel linears with miles-lp's quantized GEMM, the plan attached per module (their
  grids are walked by the one ``miles_lp.train.quant_linear.learner_weights``);
* ``te``: the Transformer Engine configuration a plan implies (Blackwell + TE only; thin);
* ``naming``: Megatron -> HF names (the inverse of ``hf_to_megatron``) and the tensor-parallel gather of shards
  (pure tensor code, no megatron-core needed); ``export``: the Megatron learner's whole-model export under HF
  names (``megatron_export_weights``: forward grids gathered over TP, named, the rest in the checkpoint dtype).
* ``parallel``: the sizes (tp x pp x dp, the expert grid), the gradient reductions and norm; ``data``: which
  micro-batches each data-parallel replica runs; ``pipeline``: Megatron-Core's 1F1B schedule over the packed rows;
* ``group``: ``MegatronGroup``, the ranks driven from one process as one ``Learner``; ``ranks``: the protocol
  between rank 0 and the others and the spawned-process placement; ``ray_ranks``: one Ray actor per rank.

Importing ``miles_lp.train.megatron.layers`` / ``.model`` needs megatron-core; this package itself does not.
"""

from __future__ import annotations


def megatron_available() -> str | None:
    """``None`` if megatron-core imports, else the reason (for ``BackendUnavailable`` messages)."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        return f"megatron-core is not installed ({exc}); pip install 'miles-lp[megatron]'"
    return None
