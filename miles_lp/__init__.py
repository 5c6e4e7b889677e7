"""miles-lp: low-precision RL for LLMs with one precision contract.

The package is organised by stage: ``formats`` (bit-exact codecs), ``policy`` (the precision
policy and its compiled per-tensor plan), ``checkpoint`` (conversion and verification),
``train`` (quantized linears and trainers), ``rollout`` / ``sync`` / ``rl`` / ``launch``.
"""

__version__ = "0.1.0"
