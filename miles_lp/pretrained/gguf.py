"""GGUF file -> HF folder (bf16 safetensors, tokenizer, chat template), through transformers' GGUF reader.

The adapter for one library behaviour: a model loaded with ``gguf_file=`` carries a ``quantization_config`` that
makes ``save_pretrained`` refuse it; its dequantized state dict loads into a fresh model of the same config.
Loading in float32 keeps plain dense tensors (the Q4_1 grid dequantized exactly: scale * q + min in fp32).
"""

from __future__ import annotations

from pathlib import Path

from miles_lp.errors import BackendUnavailable, CheckpointError


def build_hf_folder(gguf: Path, out: Path) -> dict:
    """Write the model in ``gguf`` to ``out`` (an empty folder) as bf16 safetensors + tokenizer. Returns facts for
    the manifest (architecture, parameters, layers)."""
    try:
        import gguf as _gguf  # noqa: F401 - transformers' GGUF reader needs it; fail here with the install line
    except ImportError:
        raise BackendUnavailable("reading a GGUF file needs the package gguf: pip install gguf accelerate") from None
    import torch
    import transformers

    folder, name = str(gguf.parent), gguf.name
    try:
        tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        src = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - any reader failure is one user-facing message
        raise CheckpointError(f"transformers {transformers.__version__} could not read {gguf}: "
                              f"{type(exc).__name__}: {str(exc)[:300]}") from exc
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model_cls = type(src)
    fresh = model_cls(config).to(torch.bfloat16)
    state = {k: v.to(torch.bfloat16) for k, v in src.state_dict().items()}
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    # tied embeddings: lm_head.weight is the embedding itself, not an entry of its own
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(f"{gguf}: the dequantized weights do not fit {model_cls.__name__}: missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]}")
    fresh.generation_config = src.generation_config
    fresh.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    n_params = sum(p.numel() for p in fresh.parameters())
    return {"architecture": model_cls.__name__, "parameters": int(n_params),
            "num_layers": int(config.num_hidden_layers), "transformers": transformers.__version__}
