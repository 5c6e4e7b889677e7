"""Causal attention over a packed row, one sequence at a time: cost in the sequences' lengths, not the row's.

The learner packs a micro-batch into one row (``position_ids`` restart at each sequence). transformers' ``sdpa``
path turns that into a block-diagonal ``[T, T]`` mask and one masked attention over the whole row: work and (in
the math kernel, which keeps the probabilities for backward) memory quadratic in the row, ``T = 2,800`` tokens
for 64 RL samples of ~45 tokens, where each sequence only ever attends to its own ~45 tokens. Here the row is cut
where ``position_ids`` restart, the segments are gathered into a right-padded ``[S, H, L_max, D]`` batch and run
through ``scaled_dot_product_attention(is_causal=True)``: a query never sees a key after it, so the padding at
the end of a segment is never attended to and no mask is needed. The same softmax over the same keys; only the
kernel's blocking (summation order) differs from the masked whole-row call.

Registered with transformers as the attention implementation ``miles_lp_packed`` together with a mask function
(``packed_mask``): no mask for the packed row (one row, no padding mask, no cached keys: transformers builds no
``[T, T]`` mask), ``sdpa``'s mask for anything else. Inputs the packed path does not cover (a padding mask, a KV
cache, batch > 1) go to transformers' ``sdpa`` with that mask, as a plain ``sdpa`` model would run them: without
a registered mask function transformers passes no mask at all to an unknown implementation, and left-padded
``generate`` batches would attend to their padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "miles_lp_packed"
#: attention arguments this function does not implement (models using them keep ``sdpa``)
_UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "position_bias")
_REGISTERED = [False]


def segments(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, length)`` of each run of ``position_ids`` (``[T]``) that counts up by one."""
    pos = position_ids.reshape(-1)
    t = int(pos.numel())
    if t == 0:
        return []
    starts = [0, *(torch.nonzero(pos[1:] != pos[:-1] + 1).reshape(-1) + 1).tolist()]
    ends = [*starts[1:], t]
    return [(s, e - s) for s, e in zip(starts, ends, strict=True)]


def segment_index(segs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(gather index ``[S, L_max]`` into the row (padding repeats a segment's last token), valid ``[S * L_max]``
    bool, L_max)."""
    lmax = max(n for _, n in segs)
    ar = torch.arange(lmax)
    starts = torch.tensor([s for s, _ in segs])[:, None]
    lens = torch.tensor([n for _, n in segs])[:, None]
    valid = ar[None, :] < lens
    idx = starts + torch.minimum(ar[None, :], lens - 1)
    return idx.to(device), valid.reshape(-1).to(device), lmax


def packed_causal_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``[1, H, T, D]``, ``key``/``value``
    ``[1, H_kv, T, D]``; returns ``[1, T, H, D]``."""
    for extra in _UNSUPPORTED:
        if kwargs.get(extra) is not None:  # use_packed_attention refuses such models; never a silent full-row causal
            raise NotImplementedError(f"{NAME} attention does not implement {extra!r}")
    position_ids = kwargs.get("position_ids")
    t = query.shape[2]
    if (attention_mask is not None or position_ids is None or query.shape[0] != 1 or key.shape[2] != t
            or position_ids.numel() != t or dropout != 0.0):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    segs = segments(position_ids)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if len(segs) == 1:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    idx, valid, lmax = segment_index(segs, query.device)
    s = idx.shape[0]

    def gather(x: torch.Tensor) -> torch.Tensor:  # [1, H, T, D] -> [S, H, L_max, D]
        h, d = x.shape[1], x.shape[3]
        return x[0][:, idx.reshape(-1)].reshape(h, s, lmax, d).transpose(0, 1)

    q, k, v = gather(query), gather(key), gather(value)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = SegmentAttention.apply(q, k, v, scaling)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
    h, d = out.shape[1], out.shape[3]
    out = out.transpose(1, 2).reshape(s * lmax, h, d)[valid]  # segments are contiguous and in row order
    return out[None], None


class SegmentAttention(torch.autograd.Function):
    """Causal attention over the ``[S, H, L_max, D]`` segments: the forward is the same
    ``scaled_dot_product_attention(is_causal=True)`` call (the same bytes as without autograd, so a training
    forward's log-probs equal the no-grad pass's); the backward recomputes the probabilities in fp32 and runs the
    softmax backward as plain batched matmuls. ATen's CPU flash-attention backward takes ~18x its forward on these
    short segments (SmolLM2-135M, 64 segments of ~45 tokens: 2.2 s of a 6.3 s update on 2 cores); this one is a few
    small GEMMs per layer. The gradients differ from that kernel's by its bf16 roundings only (fp32 here, rounded
    once to the input dtype; ``tests/unit/test_train_packed_rows.py`` bounds the difference against a float64
    reference for both)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        ctx.save_for_backward(q, k, v)
        ctx.scale = scale if scale is not None else q.shape[-1] ** -0.5
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v = ctx.saved_tensors
        scale = ctx.scale
        qf, kf, vf, do = q.float(), k.float(), v.float(), dout.float()
        lq, lk = q.shape[-2], k.shape[-2]
        s = torch.matmul(qf, kf.transpose(-1, -2)).mul_(scale)  # [S, H, L, L]
        s.masked_fill_(torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
        p = torch.softmax(s, dim=-1)
        dv = torch.matmul(p.transpose(-1, -2), do)
        dp = torch.matmul(do, vf.transpose(-1, -2))
        ds = p.mul_(dp - (dp * p).sum(-1, keepdim=True)).mul_(scale)  # softmax backward, p reused in place
        dq = torch.matmul(ds, kf)
        dk = torch.matmul(ds.transpose(-1, -2), qf)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def packed_mask(batch_size: int, q_length: int, kv_length: int, attention_mask: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor | None:
    """transformers' mask-function signature (``masking_utils.sdpa_mask``): ``None`` for one packed row with no
    padding mask and no cached keys (``packed_causal_attention`` cuts it by ``position_ids``), otherwise the mask
    ``sdpa`` would get (padding, KV cache, batch > 1: ``packed_causal_attention`` hands those to ``sdpa``)."""
    if attention_mask is None and batch_size == 1 and q_length == kv_length:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, attention_mask=attention_mask,
                     **kwargs)


def register() -> str:
    """Register ``miles_lp_packed`` and its mask function with transformers (once); returns the name for
    ``set_attn_implementation``."""
    if not _REGISTERED[0]:
        from transformers import AttentionInterface, AttentionMaskInterface

        AttentionInterface.register(NAME, packed_causal_attention)
        AttentionMaskInterface.register(NAME, packed_mask)
        _REGISTERED[0] = True
    return NAME


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Switch a transformers model whose attention is ``sdpa`` to ``miles_lp_packed``; False (unchanged) for any
    other implementation (eager, flash, flex: their own kernels and masks) and for sliding-window or soft-capped
    attention."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "_attn_implementation", None) != "sdpa":
        return False
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if any(getattr(text, k, None) for k in ("sliding_window", "attn_logit_softcapping", "use_sliding_window")):
        return False
    if any(t != "full_attention" for t in (getattr(text, "layer_types", None) or ())):
        return False
    name = register()
    try:
        model.set_attn_implementation(name)
    except (ValueError, AttributeError, TypeError):
        return False
    return getattr(model.config, "_attn_implementation", None) == name
