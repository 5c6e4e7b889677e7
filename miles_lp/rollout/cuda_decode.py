"""The reference engine's decode without the host in the loop: static KV cache, CUDA-graph replay per batch-size
bucket, sampling on the device, one launch per activation quantization.

The eager path (``ReferenceEngine._run``) runs transformers' forward with a ``DynamicCache`` and samples on the
host: every decode step costs hundreds of Python-dispatched launches, a host->device copy of the uniforms and a
``.tolist()``, so its speed is Python's, not the GEMMs'. This path, as SGLang and vLLM do:

* **Static KV cache** ``[layers][B, kv_heads, S, head_dim]`` for a batch bucket ``B`` and a length bucket ``S``:
  the prompts are left-padded to width ``W`` in columns ``[0, W)`` (the eager path's layout), decode step ``s``
  writes column ``W + s - 1`` for every row; a key-validity mask ``[B, S]`` and per-row positions are the eager
  path's ``attention_mask`` and ``position_ids``. A padded query attends to itself only (its output is unused and
  stays finite, so no NaN can reach a real row through a masked key).
* **One CUDA graph per (batch bucket, length bucket, sampling constants)**, captured on first use and replayed
  once per token; the step counter, column, positions, mask and the last token live on the device and are
  advanced inside the graph. Rows beyond the batch (bucket padding) repeat row 0.
* **Sampling on the device**: the uniforms of every step are drawn up front from the request's seeded CPU
  generator (the eager path's stream, ``rollout.sampling``), copied once; tokens and log-probs are written into
  ``[S, B]`` device buffers. The host reads them back once at the end, or every ``STOP_CHECK_EVERY`` steps when
  the request has stop tokens (to stop early). Rows keep decoding after they finish (the batch is static); their
  extra tokens are cut on the host.
* **Activation quantization in one launch on the hot path**: MXFP8 (plan mode) through the decode-only Triton
  launch (``kernels.mxfp8_quantize(store_q=False)``: the codec's quantize-then-dequantize bytes); FP8 blockwise on
  sm_90 through the Triton decode GEMM that quantizes its input in its prologue (``formats.kernels.
  fp8_block_decode``, at most 8 tokens under ``auto``) or, above that, the 1x128 operand kernel and the native block-scaled GEMM
  (``train.fp8_block_gemm``, the learner's forward; ``runtime.fp8_decode_gemm``, ``fp8_gemm``), reading the served
  E4M3 weight and its block scales as stored. Siblings reading one input (q/k/v, gate/up) quantize it once (with
  the fused kernels: one GEMM over their concatenated weights). Every other layer calls its own
  ``EngineLinear.apply``.

What runs it: ``MILES_LP_DECODE`` = ``auto`` (default: the graph path on CUDA where ``unsupported_reason`` is None,
the eager path otherwise), ``eager`` (off), ``static`` (this module's forward without graphs, any device: what the
CPU tests compare with the eager path), ``graph`` (graphs required: an error where they cannot run).
Supported: dense decoder-only Llama / Qwen2 / Qwen3 models with full attention; layers served as BF16, MXFP8
(plan activations) or FP8 blockwise; no engine fault active (the fault hooks re-bind tensors a captured graph
would not see); no routing capture. Same tokens as the eager path under greedy decoding and, while no row stops
early, the same draws (the eager path drops finished rows from the batch, which shifts later rows' uniforms).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from miles_lp.config import switch
from miles_lp.formats.spec import Format
from miles_lp.rollout import graph_capture
from miles_lp.rollout.engine import EngineError, Generation
from miles_lp.rollout.sampling import sample_with_uniform

MODES = ("auto", "eager", "static", "graph")
ARCHS = ("llama", "qwen2", "qwen3")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
SEQ_BUCKET = 128  # cache length rounded up to this: one graph serves every prompt width of a bucket
STOP_CHECK_EVERY = 16
MAX_GRAPHS = 4  # slots (cache + graph) kept per engine, least recently used dropped: each holds a KV cache


def mode() -> str:
    """The ``runtime.decode`` switch (its debugging variable ``MILES_LP_DECODE`` overrides it)."""
    m = switch("decode")
    if m not in MODES:
        raise EngineError(f"runtime.decode (MILES_LP_DECODE) must be one of {', '.join(MODES)}, got {m!r}")
    return m


def batch_bucket(n: int) -> int:
    for b in BATCH_BUCKETS:
        if n <= b:
            return b
    return -(-n // 64) * 64


def seq_bucket(n: int) -> int:
    return -(-n // SEQ_BUCKET) * SEQ_BUCKET


def finish_rows(tokens: list[list[int]], logprobs: list[list[float]], budgets: list[int], stop: set[int]
                ) -> list[tuple[list[int], list[float], str]]:
    """Cut each row's decoded stream as the eager loop does: at its first stop token (kept, ``stop``) or at its
    budget (``length``)."""
    out = []
    for toks, lps, budget in zip(tokens, logprobs, budgets, strict=True):
        n, reason = min(budget, len(toks)), "length"
        for i, t in enumerate(toks[:n]):
            if t in stop:
                n, reason = i + 1, "stop"
                break
        out.append((toks[:n], lps[:n], reason))
    return out


# ------------------------------------------------------------------------------------------------------------
# what can run here
# ------------------------------------------------------------------------------------------------------------
def _decoder_model(model):
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens"):
        return None
    return inner


def unsupported_reason(engine, sp=None, *, graphs: bool = True) -> str | None:
    """Why this path cannot serve ``engine`` (None: it can). ``graphs``: also require what a captured graph needs."""
    from miles_lp.rollout.layers import EngineExperts, EngineLinear

    cfg = engine.hf_config
    if getattr(cfg, "model_type", None) not in ARCHS:
        return f"model_type {getattr(cfg, 'model_type', None)!r} (supported: {', '.join(ARCHS)})"
    if _decoder_model(engine.model) is None:
        return "the model has no .model.layers / .model.embed_tokens"
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"} or getattr(cfg, "use_sliding_window", False):
        return f"attention layer types {sorted(types)} (full attention only)"
    if any(isinstance(m, EngineExperts) for m in engine.model.modules()):
        return "mixture-of-experts layers"
    if engine.faults.active():
        return f"engine faults active: {sorted(engine.faults.active())}"
    if sp is not None and sp.return_routed_experts:
        return "return_routed_experts"
    if graphs:
        if engine.device.type != "cuda":
            return f"device {engine.device} (CUDA graphs need a CUDA device)"
        for m in engine.model.modules():
            if isinstance(m, EngineLinear) and _op_kind(m, None) == "generic":
                return (f"'{m.prefix}weight' is served as {getattr(m.kernel_format, 'value', None)} "
                        f"(activation mode {m.activation_mode}); graphs take bf16, mxfp8 and native fp8_block")
    return None


def _op_kind(layer, x: torch.Tensor | None) -> str:
    """How this module computes ``layer``: ``bf16``, ``mxfp8`` (one decode-only launch), ``fp8_native`` or
    ``generic`` (``layer.apply``)."""
    fmt = layer.kernel_format
    dev = layer.device_
    if fmt is Format.BF16:
        return "bf16"
    if dev.type != "cuda" or layer.activation_mode != "plan":
        return "generic"
    if fmt is Format.MXFP8 and layer.op_dtype in (torch.bfloat16, torch.float32):
        return "mxfp8"
    if fmt is Format.FP8_BLOCK:
        from miles_lp.train import fp8_block_gemm

        probe = x if x is not None else torch.empty((1, layer.in_features), dtype=layer.act_dtype, device=dev)
        w = layer.canonical()["weight"]
        if fp8_block_gemm.unavailable_reason(probe, w) is None and layer.activation_scale in ("pow2", "fp32"):
            return "fp8_native"
    return "generic"


FP8_GEMMS = ("auto", "triton", "scaled_mm")


def fp8_gemm(m: int) -> str:
    """The ``fp8_native`` GEMM for ``m`` tokens (``runtime.fp8_decode_gemm``): ``triton`` (the decode GEMM,
    ``formats.kernels.fp8_block_decode``: the activation quantization in its prologue, rows padded to 16 / 32 / 64)
    or ``scaled_mm`` (the 1x128 operand kernel, tokens padded to 128, then cuBLAS's block-scaled GEMM)."""
    c = switch("fp8_decode_gemm")
    if c not in FP8_GEMMS:
        raise EngineError(f"runtime.fp8_decode_gemm (MILES_LP_FP8_DECODE_GEMM) must be one of "
                          f"{', '.join(FP8_GEMMS)}, got {c!r}")
    if c == "auto":
        from miles_lp.formats.kernels.fp8_block_decode import MAX_M

        return "triton" if m <= MAX_M else "scaled_mm"
    return c


# ------------------------------------------------------------------------------------------------------------
# the fused elementwise kernels (rollout._decode_triton)
# ------------------------------------------------------------------------------------------------------------
_KMOD: dict[bool, Any] = {}


def _kernels(x: torch.Tensor):
    from miles_lp.formats.kernels.runtime import load_jit_module

    interp = not x.is_cuda
    mod = _KMOD.get(interp)
    if mod is None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_decode_triton.py")
        mod = _KMOD[interp] = load_jit_module(path, "miles_lp.rollout._decode_triton", interp)
    return mod


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def add_rms(x: torch.Tensor, d: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """``(x + d, rmsnorm(x + d) * weight)`` of rows ``x [R, N]`` (``d`` None: no add; the first is ``x``)."""
    n = x.shape[-1]
    y = torch.empty_like(x)
    xo = torch.empty_like(x) if d is not None else x
    dd = d if d is not None else x
    _kernels(x).add_rms_kernel[(x.shape[0],)](x, dd, weight, xo, y, n, x.stride(0), dd.stride(0), xo.stride(0),
                                              y.stride(0), float(eps), HAS_RES=d is not None, BLOCK=_pow2(n),
                                              num_warps=4)
    return xo, y


def heads(src: torch.Tensor, t: int, d: int, dst: torch.Tensor, col: torch.Tensor | None, weight=None,
          eps: float = 0.0, cos=None, sin=None) -> None:
    """Each head of ``src [B*T, H*D]`` (row stride as given): optional RMSNorm (``weight``), optional rotary
    (``cos``/``sin`` ``[B*T, D]`` contiguous), stored into ``dst [B, H, S, D]`` at column ``col[0] + t``
    (``col`` None: column ``t``)."""
    h = src.shape[1] // d
    _kernels(src).head_kernel[(src.shape[0], h)](
        src, weight if weight is not None else src, cos if cos is not None else src,
        sin if sin is not None else src, dst, col if col is not None else src, t, src.stride(0), dst.stride(0),
        dst.stride(1), dst.stride(2), float(eps), D=d, HAS_NORM=weight is not None, HAS_ROPE=cos is not None,
        USE_COL=col is not None, num_warps=1)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` of rows ``[R, N]`` (row strides as given)."""
    r, n = g.shape
    out = torch.empty((r, n), dtype=g.dtype, device=g.device)
    block = min(1024, _pow2(n))
    _kernels(g).silu_mul_kernel[(r, -(-n // block))](g, u, out, n, g.stride(0), u.stride(0), out.stride(0),
                                                    BLOCK=block, num_warps=4)
    return out


# ------------------------------------------------------------------------------------------------------------
# linear groups: siblings that read one input
# ------------------------------------------------------------------------------------------------------------
class _Group:
    """Sibling layers reading one input: the input quantized once, then one GEMM per layer, or (``concat``) one
    GEMM over their weights concatenated along N (copies refreshed in place at every weight version), the
    outputs column slices of it."""

    def __init__(self, layers, concat: bool = False):
        self.layers = list(layers)
        kinds = {_op_kind(m, None) for m in self.layers}
        keys = {(m.kernel_format, m.activation_scale, m.op_dtype, m.has_bias) for m in self.layers}
        self.kind = kinds.pop() if len(kinds) == 1 and len(keys) == 1 else "generic"
        self.widths = [m.out_features for m in self.layers]
        # (FP8 block scales concatenate along N only when every width is whole 128-row blocks)
        self.concat = (concat and len(self.layers) > 1 and self.kind != "generic"
                       and (self.kind != "fp8_native" or all(w % 128 == 0 for w in self.widths)))
        self.native: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (data, scale_inv, scale_b buf)
        self.cat: dict[str, torch.Tensor] = {}
        self.refresh()

    def _parts(self) -> dict[str, list[torch.Tensor]]:
        """What the GEMM reads, per layer: the weight operand (and bias), or the E4M3 data and block scales."""
        if self.kind == "fp8_native":
            qs = [m.decoded() for m in self.layers]
            out = {"data": [q.data.view(torch.uint8) for q in qs], "scale": [q.scale_inv for q in qs]}
        else:
            out = {"w": [m._weight_operand() for m in self.layers]}
        if self.layers[0].has_bias:
            out["bias"] = [m._bias_operand() for m in self.layers]
        return out

    def refresh(self) -> None:
        """Re-read the served tensors into this group's copies (in place: graphs read them)."""
        if self.kind == "generic" or (self.kind != "fp8_native" and not self.concat):
            return
        parts = self._parts()
        if self.concat:
            for name, ts in parts.items():
                buf = self.cat.get(name)
                if buf is None:
                    self.cat[name] = torch.cat([t.detach() for t in ts], dim=0)
                else:
                    torch.cat([t.detach() for t in ts], dim=0, out=buf)
        if self.kind != "fp8_native":
            return
        scales = [self.cat["scale"]] if self.concat else parts["scale"]
        datas = [self.cat["data"]] if self.concat else parts["data"]
        new = not self.native
        for i, (data, s) in enumerate(zip(datas, scales, strict=True)):
            nb, kb = s.shape
            if new:
                buf = torch.ones((nb, -(-kb // 4) * 4), dtype=torch.float32, device=s.device)
                self.native.append((data, s, buf))
            d0, s0, buf = self.native[i]
            if d0.data_ptr() != data.data_ptr() or s0.data_ptr() != s.data_ptr():
                raise EngineError(f"'{self.layers[i].prefix}weight': served storage moved; rebuild the decode state")
            buf[:, :kb].copy_(s)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.kind == "generic" or (self.kind == "bf16" and not self.concat):
            return [m.apply(x) for m in self.layers]
        shape = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        first = self.layers[0]
        if self.kind in ("bf16", "mxfp8"):
            if self.kind == "mxfp8":
                from miles_lp.formats import kernels

                x2 = kernels.mxfp8_quantize(x2, dequant_dtype=first.op_dtype, dequant=("row",),
                                            store_q=False).row_deq
            if not self.concat:
                return [m.gemm(x2, x.dtype).reshape(*shape, m.out_features) for m in self.layers]
            w = self.cat["w"]
            if self.kind == "bf16":
                b = self.cat.get("bias")
                y = F.linear(x2.to(w.dtype), w, None if b is None else b.to(w.dtype)).to(x.dtype)
            else:
                y = F.linear(x2, w)
                if "bias" in self.cat:
                    y = y + self.cat["bias"].to(y.dtype)
                y = y.to(x.dtype)
            return self._split(y, shape)
        pow2 = first.activation_scale == "pow2"
        if fp8_gemm(x2.shape[0]) == "triton":
            from miles_lp.formats.kernels import fp8_block_decode as fd

            out = torch.float32 if x2.dtype == torch.float32 else torch.bfloat16  # (bf16 on CUDA: _op_kind)
            ys = [fd.decode_mm(x2, data, s, pow2, out_dtype=out) for data, s, _ in self.native]
        else:
            from miles_lp.formats.kernels import fp8_block as fk
            from miles_lp.train import fp8_block_gemm as g

            _, _, (xs, _) = fk.quantize_act(x2, pow2, rows=True, grids=False)
            ys = []
            for data, _, buf in self.native:
                y = g._mm(xs.data, xs.scale_inv, data.view(torch.float8_e4m3fn).t(), buf.t(), "BlockWise128x128")
                ys.append(y[:xs.rows] if y.shape[0] != xs.rows else y)
        if self.concat:
            y = ys[0]
            if "bias" in self.cat:
                y = y + self.cat["bias"].to(y.dtype)
            return self._split(y.to(x.dtype), shape)
        out = []
        for m, y in zip(self.layers, ys, strict=True):
            b = m._bias_operand()
            if b is not None:
                y = y + b.to(y.dtype)
            out.append(y.to(x.dtype).reshape(*shape, m.out_features))
        return out

    def _split(self, y: torch.Tensor, shape) -> list[torch.Tensor]:
        out, o = [], 0
        for n in self.widths:
            out.append(y[:, o:o + n].reshape(*shape, n) if len(shape) == 1 else y[:, o:o + n].unflatten(0, shape))
            o += n
        return out


# ------------------------------------------------------------------------------------------------------------
# the forward on the static cache
# ------------------------------------------------------------------------------------------------------------
class _Layer:
    def __init__(self, block, fused: bool):
        attn, mlp = block.self_attn, block.mlp
        self.block, self.attn, self.mlp = block, attn, mlp
        self.qkv = _Group([attn.q_proj, attn.k_proj, attn.v_proj], concat=fused)
        self.o = _Group([attn.o_proj])
        self.gate_up = _Group([mlp.gate_proj, mlp.up_proj], concat=fused)
        self.down = _Group([mlp.down_proj])
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)

    def groups(self):
        return (self.qkv, self.o, self.gate_up, self.down)


def fused_reason(engine) -> str | None:
    """Why the fused elementwise kernels cannot run the forward (None: they can): CUDA (or the Triton
    interpreter, ``runtime.decode_fused: interpret``), RMSNorm modules, SiLU, a power-of-two head dim, no FP8
    KV rounding. ``runtime.decode_fused: off`` (``MILES_LP_DECODE_FUSED=0``) switches them off."""
    want = switch("decode_fused")
    if want == "off":
        return "runtime.decode_fused: off"
    if engine.device.type != "cuda" and want != "interpret":
        return f"device {engine.device}"
    cfg = engine.hf_config
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(cfg, 'hidden_act', None)!r}"
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if hd & (hd - 1) or cfg.hidden_size > 16384:
        return f"head_dim {hd} / hidden {cfg.hidden_size}"
    if engine.kv_cache != "bf16":
        return f"kv_cache {engine.kv_cache}"
    inner = _decoder_model(engine.model)
    for blk in inner.layers:
        for mod in (blk.input_layernorm, blk.post_attention_layernorm, getattr(blk.self_attn, "q_norm", None)):
            if mod is not None and not hasattr(mod, "variance_epsilon"):
                return f"norm module {type(mod).__name__}"
    return None


class StaticForward:
    """The model's forward over a static KV cache (prefill of a left-padded batch, or one decode token per row)."""

    def __init__(self, engine):
        from transformers.models.llama import modeling_llama

        self.engine = engine
        self.model = engine.model
        self.inner = _decoder_model(engine.model)
        cfg = engine.hf_config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.fused = fused_reason(engine) is None
        self.layers = [_Layer(b, self.fused) for b in self.inner.layers]
        self.rope = modeling_llama.apply_rotary_pos_emb  # the same formula in qwen2 / qwen3
        self.kv_round = None
        if engine.kv_cache == "fp8_e4m3":
            from miles_lp.rollout.kv_cache import fp8_kv_roundtrip

            ks, vs = engine.kv_scales
            self.kv_round = (lambda k: fp8_kv_roundtrip(k, ks), lambda v: fp8_kv_roundtrip(v, vs))

    def refresh(self) -> None:
        for layer in self.layers:
            for g in layer.groups():
                g.refresh()

    def new_cache(self, b: int, s: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        dev, dt = self.engine.device, self.engine.act_dtype
        shape = (b, self.n_kv, s, self.head_dim)
        return [(torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev))
                for _ in self.layers]

    def _attend(self, layer: _Layer, h, cos, sin, cache, write, mask):
        """Self-attention of ``h [B, T, H]``; ``write(kc, vc, k, v)`` stores the new keys/values and returns the
        keys/values to attend over; ``mask [B, 1, T, S']`` (True: attend)."""
        b, t, _ = h.shape
        q, k, v = layer.qkv(h)
        q = q.view(b, t, -1, self.head_dim)
        k = k.view(b, t, -1, self.head_dim)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, k, cos, sin)
        if self.kv_round is not None:
            k, v = self.kv_round[0](k), self.kv_round[1](v)
        keys, values = write(cache[0], cache[1], k, v)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=layer.attn.scaling,
                                           enable_gqa=self.n_heads != self.n_kv)
        o = o.transpose(1, 2).reshape(b, t, -1)
        return layer.o(o)[0]

    def forward(self, ids, pos, caches, write, mask) -> torch.Tensor:
        """Last-position logits ``[B, V]`` of ``ids [B, T]`` at positions ``pos [B, T]``."""
        x = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(x, pos)
        for layer, cache in zip(self.layers, caches, strict=True):
            blk = layer.block
            x = x + self._attend(layer, blk.input_layernorm(x), cos, sin, cache, write, mask)
            h = blk.post_attention_layernorm(x)
            gate, up = layer.gate_up(h)
            x = x + layer.down(layer.mlp.act_fn(gate) * up)[0]
        x = self.inner.norm(x[:, -1:])
        return self.model.lm_head(x)[:, -1]

    def forward_fused(self, ids, pos, caches, col, mask, kv_len: int | None) -> torch.Tensor:
        """``forward`` through the fused kernels: K/V stored straight into the cache at ``col[0] + t`` (``col``
        None: column t); attention over the first ``kv_len`` columns (None: all)."""
        b, t = ids.shape
        hd = self.head_dim
        x = self.inner.embed_tokens(ids).reshape(b * t, -1)
        cos, sin = self.inner.rotary_emb(x, pos)
        cos, sin = cos.reshape(b * t, hd).contiguous(), sin.reshape(b * t, hd).contiguous()
        delta = None
        for layer, (kc, vc) in zip(self.layers, caches, strict=True):
            blk, attn = layer.block, layer.attn
            ln = blk.input_layernorm
            x, h = add_rms(x, delta, ln.weight, ln.variance_epsilon)
            q, k, v = layer.qkv(h)
            qd = torch.empty((b, self.n_heads, t, hd), dtype=x.dtype, device=x.device)
            qn, kn = layer.q_norm, layer.k_norm
            heads(q, t, hd, qd, None, None if qn is None else qn.weight, 0.0 if qn is None else qn.variance_epsilon,
                  cos, sin)
            heads(k, t, hd, kc, col, None if kn is None else kn.weight, 0.0 if kn is None else kn.variance_epsilon,
                  cos, sin)
            heads(v, t, hd, vc, col)
            keys, values = (kc, vc) if kv_len is None else (kc[:, :, :kv_len], vc[:, :, :kv_len])
            o = F.scaled_dot_product_attention(qd, keys, values, attn_mask=mask, scale=attn.scaling,
                                               enable_gqa=self.n_heads != self.n_kv)
            a = layer.o(o.transpose(1, 2).reshape(b * t, -1))[0]
            ln = blk.post_attention_layernorm
            x, h = add_rms(x, a, ln.weight, ln.variance_epsilon)
            gate, up = layer.gate_up(h)
            delta = layer.down(silu_mul(gate, up))[0]
        last = x.view(b, t, -1)[:, -1]
        _, h = add_rms(last, delta.view(b, t, -1)[:, -1], self.inner.norm.weight, self.inner.norm.variance_epsilon)
        return self.model.lm_head(h)

    def prefill(self, ids: torch.Tensor, valid: torch.Tensor, caches) -> torch.Tensor:
        """``ids``, ``valid`` ``[B, W]`` (left-padded): fills cache columns ``[0, W)``; the last position's logits."""
        w = ids.shape[1]
        pos = (valid.long().cumsum(-1) - 1).clamp_(min=0)
        idx = torch.arange(w, device=ids.device)
        causal = idx[None, :] <= idx[:, None]  # [Tq, Tk]
        mask = causal[None] & (valid[:, None, :] | torch.eye(w, dtype=torch.bool, device=ids.device)[None])
        mask = mask[:, None]  # [B, 1, W, W]
        if self.fused:
            return self.forward_fused(ids, pos, caches, None, mask, w)

        def write(kc, vc, k, v):
            kc[:, :, :w].copy_(k)
            vc[:, :, :w].copy_(v)
            return k, v

        return self.forward(ids, pos, caches, write, mask)

    def decode(self, tok: torch.Tensor, pos: torch.Tensor, col: torch.Tensor, valid: torch.Tensor, caches):
        """One token per row: ``tok [B]`` at ``pos [B, 1]``, cache column ``col [1]`` (device tensors)."""
        valid.index_fill_(1, col, True)
        mask = valid[:, None, None, :]
        if self.fused:
            return self.forward_fused(tok[:, None], pos, caches, col, mask, None)

        def write(kc, vc, k, v):
            kc.index_copy_(2, col, k)
            vc.index_copy_(2, col, v)
            return kc, vc

        return self.forward(tok[:, None], pos, caches, write, mask)


# ------------------------------------------------------------------------------------------------------------
# the decode state of one (batch bucket, length bucket, sampling) key, and its graph
# ------------------------------------------------------------------------------------------------------------
class _Slot:
    def __init__(self, fwd: StaticForward, b: int, s: int, sampling: tuple, graphs: bool, pool):
        dev = fwd.engine.device
        self.fwd, self.b, self.s, self.sampling = fwd, b, s, sampling
        self.caches = fwd.new_cache(b, s)
        self.tok = torch.zeros(b, dtype=torch.long, device=dev)
        self.pos = torch.zeros(b, 1, dtype=torch.long, device=dev)
        self.col = torch.zeros(1, dtype=torch.long, device=dev)
        self.t = torch.zeros(1, dtype=torch.long, device=dev)
        self.valid = torch.zeros(b, s, dtype=torch.bool, device=dev)
        self.u = torch.zeros(s, b, dtype=torch.float32, device=dev)
        self.tokens = torch.zeros(s, b, dtype=torch.long, device=dev)
        self.logprobs = torch.zeros(s, b, dtype=torch.float32, device=dev)
        self.graph = None
        self.graphs, self.pool = graphs, pool

    def _step(self) -> None:
        logits = self.fwd.decode(self.tok, self.pos, self.col, self.valid, self.caches)
        u = self.u.index_select(0, self.t)[0][:, None]
        tokens, lp = sample_with_uniform(logits, u, *self.sampling)
        self.tokens.index_copy_(0, self.t, tokens[None])
        self.logprobs.index_copy_(0, self.t, lp.float()[None])
        self.tok.copy_(tokens)
        self.pos.add_(1)
        self.col.add_(1)
        self.t.add_(1)

    def step(self) -> None:
        if not self.graphs:
            self._step()
            return
        if self.graph is None:
            self._capture()
        self.graph.replay()

    def _capture(self) -> None:
        # one capture at a time in the process, thread_local mode: other engines' threads keep decoding
        # (graph_capture says why)
        with graph_capture.CAPTURE_LOCK:
            self._capture_locked()

    def _capture_locked(self) -> None:
        # warm up on a side stream (Triton compiles, cuBLAS picks its kernels), then capture; the state tensors
        # are saved and restored around the warm-up so the first replay starts where the caller left them
        saved = [x.clone() for x in (self.tok, self.pos, self.col, self.t, self.valid, self.tokens, self.logprobs)]
        kv = [(k.clone(), v.clone()) for k, v in self.caches]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step()
                self._restore(saved, kv)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with graph_capture.capturing(g, self.pool):
            self._step()
        self._restore(saved, kv)
        self.graph = g

    def _restore(self, saved, kv) -> None:
        for dst, src in zip((self.tok, self.pos, self.col, self.t, self.valid, self.tokens, self.logprobs), saved,
                            strict=True):
            dst.copy_(src)
        for (k, v), (k0, v0) in zip(self.caches, kv, strict=True):
            k.copy_(k0)
            v.copy_(v0)


class CudaDecoder:
    """Per-engine state: the forward, the slots (one cache and graph per key), the signature of the storage the
    graphs read (a change drops everything) and the weight version the scale copies were read at."""

    def __init__(self, engine, graphs: bool):
        self.engine = engine
        self.graphs = graphs
        self.fwd: StaticForward | None = None
        self.slots: dict[tuple, _Slot] = {}
        self.signature: tuple | None = None
        self.version: int | None = None
        self.pool = torch.cuda.graph_pool_handle() if graphs else None
        self.captures = 0

    def _storage_signature(self) -> tuple:
        from miles_lp.rollout.layers import derived_epoch

        m = self.engine.model
        return (derived_epoch(), tuple(p.data_ptr() for p in m.parameters()),
                tuple(b.data_ptr() for b in m.buffers()))

    def _ready(self) -> StaticForward:
        sig = self._storage_signature()
        if sig != self.signature or self.fwd is None:
            self.slots.clear()
            self.fwd = StaticForward(self.engine)
            self.signature, self.version = sig, self.engine.weight_version
        elif self.version != self.engine.weight_version:
            self.fwd.refresh()
            self.version = self.engine.weight_version
        return self.fwd

    def _slot(self, b: int, s: int, sampling: tuple) -> _Slot:
        key = (b, s, sampling, switch("fp8_decode_gemm"))  # a graph keeps the GEMM it was captured with
        slot = self.slots.pop(key, None)
        if slot is None:
            if len(self.slots) >= MAX_GRAPHS:
                self.slots.pop(next(iter(self.slots)))
            slot = _Slot(self.fwd, b, s, sampling, self.graphs, self.pool)
            if self.graphs:
                self.captures += 1
        self.slots[key] = slot  # most recently used last
        return slot

    def run(self, prompts: list[list[int]], sp) -> list[Generation]:
        eng = self.engine
        n = len(prompts)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        budgets = [min(sp.max_new_tokens, eng.context_len - len(p)) for p in prompts]
        steps = max(budgets)
        stop = set(sp.stop_token_ids)
        toks, lps, aborted = self._decode(prompts, sp, gen, steps, stop, n)
        if aborted:
            rows = [(t[:_cut(t, stop)], lp[:_cut(t, stop)], "abort") for t, lp in zip(toks, lps, strict=True)]
        else:
            rows = finish_rows(toks, lps, budgets, stop)
        version = eng.weight_version
        return [Generation(t, torch.tensor(lp, dtype=torch.float32), r, version, None) for t, lp, r in rows]

    def _decode(self, prompts, sp, gen, steps: int, stop: set, n: int):
        eng = self.engine
        eng._park()  # marks the step as running (the eager path's step boundary)
        try:
            self._ready()
            bb = batch_bucket(n)
            rows = prompts + [prompts[0]] * (bb - n)
            w = max(len(p) for p in rows)
            s = seq_bucket(w + steps)
            sampling = (float(sp.temperature), int(sp.top_k), float(sp.top_p), sp.logprob_mode)
            slot = self._slot(bb, s, sampling)
            u = torch.rand(steps, n, generator=gen, dtype=torch.float32) if sp.temperature != 0 else \
                torch.zeros(steps, n)
            if bb > n:
                u = torch.cat([u, u[:, :1].expand(steps, bb - n)], dim=1)
            slot.u[:steps].copy_(u)
            self._prefill(slot, rows, w)
        finally:
            eng._set_stepping(False)
        done_at, aborted = 1, False
        for step in range(1, steps):
            if stop and step % STOP_CHECK_EVERY == 0:
                toks = slot.tokens[:step, :n].t().tolist()
                if all(any(t in stop for t in row) for row in toks):
                    done_at = step
                    break
            mode = eng._park()
            try:
                if mode == "abort":
                    done_at, aborted = step, True
                    break
                if mode is not None and self._ready() is not slot.fwd:  # storage moved: a new slot, retract
                    old, slot = slot, self._slot(bb, s, sampling)
                    for dst, src in ((slot.u, old.u), (slot.tokens, old.tokens), (slot.logprobs, old.logprobs)):
                        dst.copy_(src)
                    mode = "retract"
                if mode == "retract":  # the weights changed while parked: recompute prompt + tokens so far
                    toks = slot.tokens[:step].t().tolist()
                    self._prefill(slot, [p + t for p, t in zip(rows, toks, strict=True)], w + step, keep_t=step)
                else:  # None, or in_place: the cache stays as computed
                    slot.step()
            finally:
                eng._set_stepping(False)
            done_at = step + 1
        toks = slot.tokens[:done_at, :n].t().tolist()
        lps = slot.logprobs[:done_at, :n].t().tolist()
        return toks, lps, aborted

    def _prefill(self, slot: _Slot, rows: list[list[int]], w: int, keep_t: int = 0) -> None:
        """Fill the cache from ``rows`` (left-padded to ``w``) and sample token ``keep_t`` from its logits."""
        eng = self.engine
        b = len(rows)
        ids = torch.zeros(b, w, dtype=torch.long)
        valid = torch.zeros(b, w, dtype=torch.bool)
        for r, seq in enumerate(rows):
            ids[r, w - len(seq):] = torch.tensor(seq, dtype=torch.long)
            valid[r, w - len(seq):] = True
        ids, valid = ids.to(eng.device), valid.to(eng.device)
        logits = slot.fwd.prefill(ids, valid, slot.caches)
        slot.valid.zero_()
        slot.valid[:, :w].copy_(valid)
        t = torch.tensor([keep_t], device=eng.device)
        u = slot.u.index_select(0, t)[0][:, None]
        tokens, lp = sample_with_uniform(logits, u, *slot.sampling)
        slot.tokens.index_copy_(0, t, tokens[None])
        slot.logprobs.index_copy_(0, t, lp.float()[None])
        slot.tok.copy_(tokens)
        slot.pos.copy_(valid.long().sum(-1, keepdim=True))
        slot.col.fill_(w)
        slot.t.fill_(keep_t + 1)


def _cut(row: list[int], stop: set) -> int:
    for i, t in enumerate(row):
        if t in stop:
            return i + 1
    return len(row)


_ATTR = "_cuda_decoder"  # the engine holds its decoder (a cycle the collector frees with the engine)


def decoder(engine) -> CudaDecoder | None:
    """``engine``'s decoder state, if this path has served it."""
    return engine.__dict__.get(_ATTR)


def maybe_run(engine, prompts: list[list[int]], sp) -> list[Generation] | None:
    """The reference engine's hook: this path's generations, or None where the eager path runs."""
    m = mode()
    if m == "eager" or (m == "auto" and engine.device.type != "cuda"):
        return None
    graphs = m in ("auto", "graph")
    reason = unsupported_reason(engine, sp, graphs=graphs)
    if reason is not None:
        if m == "auto":
            return None
        raise EngineError(f"runtime.decode {m}: this engine cannot use the static decode path: {reason}")
    dec = decoder(engine)
    if dec is None or dec.graphs != graphs:
        dec = CudaDecoder(engine, graphs)
        engine.__dict__[_ATTR] = dec
    return dec.run(prompts, sp)


def stats(engine) -> dict[str, Any]:
    """Graph captures and slots of ``engine``'s decoder (for benchmarks and tests)."""
    dec = decoder(engine)
    if dec is None:
        return {"active": False}
    return {"active": True, "graphs": dec.graphs, "captures": dec.captures, "slots": len(dec.slots),
            "fused": bool(dec.fwd is not None and dec.fwd.fused)}
