"""Engine-side linear layers in SGLang's three steps: ``create_weights``, ``process_weights_after_loading``, ``apply``.

A layer holds its *canonical* tensors exactly as the checkpoint stores them for its target (CONTRACT 4), under
their on-disk suffixes, so a fresh load and a live update write the same parameters::

    sglang MXFP8   weight float8_e4m3fn [N, K], weight_scale_inv uint8 E8M0 [N, K/32]
    vllm MXFP8     weight float8_e4m3fn [N, K], weight_scale uint8 [N, K/32]
    NVFP4 (ModelOpt, sglang/vllm)  weight uint8 [N, K/2], weight_scale e4m3 [N, K/16], weight_scale_2 fp32 [],
                   input_scale fp32 []
    NVFP4 (compressed-tensors)     weight_packed uint8 [N, K/2], weight_scale e4m3, weight_global_scale fp32 [1]
    FP8 blockwise  weight float8_e4m3fn [N, K], weight_scale_inv fp32 [ceil(N/128), ceil(K/128)] (compressed-
                   tensors: weight_scale), the decode multiplier of each 128x128 block (DeepSeek-V3)
    BF16           weight in its on-disk dtype [N, K]

``process_weights_after_loading`` derives the kernel state from the canonical tensors, as the serving kernels
do at load: the block scales in the cuBLAS 128x4 layout (``swizzle_scales``, CONTRACT 3) and the GEMM operand,
the weight dequantized *from the data and the swizzled scales* (what the kernel reads). The derived tensors are
allocated once and later rebuilt *in place* (``copy_``), so their storage stays where a captured graph would
look (C4). A live update that writes the canonical tensors without re-running this step leaves the operand
stale: that is the failure mode the engine's fault hooks reproduce and ``self_check`` detects (C3).

``apply`` is the learner's emulated GEMM (``miles_lp.train.quant_linear``): the input quantized as the plan
says (MXFP8: 1x32 blocks along K; NVFP4: per-token global scale when ``activation_scale`` is ``token``; FP8
blockwise: 1x128 tiles along K, TE Float8BlockScaling's rule, power-of-two scales when ``activation_scale`` is
``pow2``), dequantized, and ``F.linear`` on operands of the learner's operand dtype (bf16 for bf16 activations,
fp32 otherwise; always fp32 for FP8 blockwise with arbitrary fp32 scales, whose decode is not exact in
bf16), bias added in that dtype, then cast back to the activation dtype. FP8 blockwise keeps its scales as
stored: its block kernels read ``weight_scale_inv`` [ceil(N/128), ceil(K/128)] as it is (no swizzled copy). Same grid, same operand
dtype, same order of operations: engine and learner agree to float tolerance (the GEMM shapes differ).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from miles_lp.errors import CheckpointError
from miles_lp.formats.schemes import scheme_for
from miles_lp.formats.spec import NVFP4_GLOBAL_DIVISOR, Format

_ST_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8, "F32": torch.float32, "BF16": torch.bfloat16,
              "F16": torch.float16}


def _naming():
    """``miles_lp.export.naming`` (CONTRACT 4 names per target), imported on first use (layering)."""
    global _NAMING
    if _NAMING is None:
        from miles_lp.export import naming

        _NAMING = naming
    return _NAMING


_NAMING = None


#: "plan": activations quantized as the recipe says (the learner's grid). "vllm": as vLLM's CPU emulation kernels
#: do (``EmulationMxfp8LinearKernel``: activations not quantized; ``EmulationNvFp4LinearKernel``: NVFP4 with the
#: static per-tensor ``input_scale``; both dequantize to and multiply in the activation dtype), to compare the grids
#: alone against vLLM.
ACTIVATION_MODES = ("plan", "vllm")
#: FP8 blockwise activation tile scales: "pow2" (the plan's ``pow2_scales``) or "fp32" (TE's default)
FP8_BLOCK_SCALES = ("pow2", "fp32")

#: bumped whenever any layer's or stack's *set* of derived buffers changes (a buffer registered, re-registered or
#: removed; never by an in-place rebuild): the reference engine's C4/C2 accessor table is rebuilt when it moved
#: (``ReferenceEngine.check_state``). Only this module changes those sets.
_DERIVED_EPOCH = [0]


def derived_epoch() -> int:
    return _DERIVED_EPOCH[0]


def operand_dtype(device: torch.device, act_dtype: torch.dtype) -> torch.dtype:
    """The learner's GEMM operand dtype (``train.gemm.gemm_operand_dtype``): bf16 for bf16 activations (CUDA and CPU;
    fp32 accumulation either way), fp32 otherwise."""
    return torch.bfloat16 if act_dtype == torch.bfloat16 else torch.float32


class EngineLinear(torch.nn.Module):
    """One linear module of the engine: canonical on-disk tensors, derived kernel state, emulated GEMM.

    ``disk_format``: how the checkpoint stores the weight (what ``create_weights`` allocates).
    ``serve_format``: what ``apply`` computes in; equal to ``disk_format`` except under the
    ``quantize_lm_head`` fault (a BF16 weight the sampler quantizes on its own side).
    ``activation_scale``: NVFP4 activation global-scale scope, ``"token"`` (the RL recipe) or ``"tensor"``; FP8
    blockwise: how the 1x128 activation tiles' scales are kept, ``"pow2"`` (rounded down to powers of two, the
    plan's ``pow2_scales``) or ``"fp32"``.
    """

    def __init__(self, prefix: str, in_features: int, out_features: int, *, disk_format: Format, target: str,
                 bias: bool = False, weight_dtype: torch.dtype = torch.bfloat16, activation_scale: str = "token",
                 act_dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 serve_format: Format | None = None, activation_mode: str = "plan"):
        super().__init__()
        if activation_mode not in ACTIVATION_MODES:
            raise ValueError(f"activation_mode must be one of {ACTIVATION_MODES}, got {activation_mode!r}")
        self.activation_mode = activation_mode
        self.prefix = prefix  # "model.layers.0.self_attn.q_proj."
        self.in_features, self.out_features = in_features, out_features
        self.disk_format = Format(disk_format)
        self.serve_format = Format(serve_format or disk_format)
        self.target = target
        self.activation_scale = activation_scale
        self.act_dtype = act_dtype
        self.weight_dtype = weight_dtype
        self.device_ = torch.device(device)
        serve = scheme_for(self.serve_format)
        if activation_mode == "vllm" and not serve.vllm_emulation:
            raise CheckpointError(f"'{prefix}weight': {self.serve_format.value} has no vLLM emulation mode here; "
                                  "serve it with activation_mode 'plan' (the learner's grid)")
        if serve.engine_activation_scales and activation_scale not in serve.engine_activation_scales:
            raise ValueError(f"{self.serve_format.value} activation_scale must be one of "
                             f"{serve.engine_activation_scales}, got {activation_scale!r}")
        # vLLM's emulation kernels dequantize to, and multiply in, the activation dtype (bf16); otherwise the
        # learner's rule (gemm._recipe_operand_dtype: fp32 for FP8 blockwise with fp32 tile scales)
        self.op_dtype = act_dtype if activation_mode == "vllm" else serve.operand_dtype(
            self.device_, act_dtype, pow2_scales=activation_scale != "fp32")
        self.has_bias = bias
        self._derived: set[str] = set()  # buffers the kernel reads besides the canonical tensors
        self.kernel_format: Format | None = None  # set by process_weights_after_loading from what it built
        self.create_weights()

    # ---- step 1 ------------------------------------------------------------------------------------
    def canonical_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """``{suffix: (dtype, shape)}`` of the canonical tensors, as on disk for this target (a fresh dict;
        computed once per configuration: the self-check and the rebuild ask for it every sync)."""
        key = (self.out_features, self.in_features, self.disk_format, self.target, self.weight_dtype, self.has_bias)
        hit = self.__dict__.get("_specs")
        if hit is None or hit[0] != key:
            hit = self.__dict__["_specs"] = (key, self._canonical_specs())
        return dict(hit[1])

    def _canonical_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        n, k = self.out_features, self.in_features
        specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        if not self.disk_format.quantized:
            specs["weight"] = (self.weight_dtype, (n, k))
        else:
            for name, (st, shape) in _naming().expected(self.target, self.disk_format, "w.weight", (n, k)).items():
                specs[name.removeprefix("w.")] = (_ST_DTYPES[st], tuple(shape))
        if self.has_bias:
            specs["bias"] = (self.weight_dtype, (n,))
        return specs

    def create_weights(self) -> None:
        """Typed, empty canonical parameters (SGLang ``create_weights``); the loader fills every byte."""
        for suffix, (dtype, shape) in self.canonical_specs().items():
            self.register_parameter(suffix, torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=self.device_),
                                                               requires_grad=False))

    def canonical(self) -> dict[str, torch.Tensor]:
        """``{suffix: live tensor}`` of the canonical tensors (what the module attributes hold now)."""
        return {s: getattr(self, s) for s in self.canonical_specs()}

    # ---- step 2 ------------------------------------------------------------------------------------
    def decoded(self):
        """The canonical tensors as a codec tensor (``MXFP8Tensor`` / ``NVFP4Tensor``); ``None`` for BF16."""
        return decode_weight(self.target, self.disk_format, {s: t for s, t in self.canonical().items()},
                             (self.out_features, self.in_features))

    def process_weights_after_loading(self) -> None:
        """Derive the kernel state (swizzled scales, the GEMM operand) from the canonical tensors, in place."""
        n, k = self.out_features, self.in_features
        new: dict[str, torch.Tensor] = {}
        q = self.decoded()
        if not self.disk_format.quantized and self.serve_format.quantized:
            # fault: the sampler quantizes on its own
            q = scheme_for(self.serve_format).quantize_weight(self.weight.detach())
            new["weight_q_data"] = q.data
        # the format's kernel state (FormatScheme.kernel_state): the GEMM operand, and for MXFP8 / NVFP4 the block
        # scales in the cuBLAS 128x4 layout with the operand decoded from the scales read back from it
        fmt = Format.BF16 if q is None else q.format
        new.update(scheme_for(fmt).kernel_state(self.weight if q is None else q, n, k, self.op_dtype))
        self.kernel_format = fmt
        if self.has_bias and self.bias.dtype != self.op_dtype:
            new["bias_operand"] = self.bias.detach().to(self.op_dtype)
        for name, t in new.items():
            old = getattr(self, name) if name in self._derived else None
            if old is not None and old.shape == t.shape and old.dtype == t.dtype:
                old.copy_(t)  # rebuild in place: the storage a captured graph reads stays put
            else:  # first build: a non-persistent buffer (visible to .to(), absent from state_dict)
                self.register_buffer(name, t.contiguous(), persistent=False)
                self._derived.add(name)
                _DERIVED_EPOCH[0] += 1
        for name in self._derived - set(new):
            self._derived.discard(name)
            delattr(self, name)
            _DERIVED_EPOCH[0] += 1

    def derived(self) -> Mapping[str, torch.Tensor]:
        """The derived tensors the kernel reads, as the module attributes hold them now."""
        return {name: getattr(self, name) for name in self._derived}

    def detached_copy(self) -> EngineLinear:
        """A private ``EngineLinear`` of the same configuration holding a copy of the live canonical tensors
        (own storage, not a view of any stack), derived state not built yet (the C3 fresh derivation)."""
        new = EngineLinear(self.prefix, self.in_features, self.out_features, disk_format=self.disk_format,
                           target=self.target, bias=self.has_bias, weight_dtype=self.weight_dtype,
                           activation_scale=self.activation_scale, act_dtype=self.act_dtype, device=self.device_,
                           serve_format=self.serve_format, activation_mode=self.activation_mode)
        with torch.no_grad():
            for suffix, t in self.canonical().items():
                getattr(new, suffix).copy_(t)
        return new

    # ---- step 3 ------------------------------------------------------------------------------------
    def _weight_operand(self) -> torch.Tensor:
        return self.operand if "operand" in self._derived else self.weight

    def _bias_operand(self) -> torch.Tensor | None:
        if not self.has_bias:
            return None
        return self.bias_operand if "bias_operand" in self._derived else self.bias

    input_cache: InputCache | None = None  # shared by siblings that read one input (q/k/v, gate/up)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """The activation on the serving grid, dequantized to the operand dtype (``x`` is ``[M, K]``).

        Siblings reading the same input tensor (q/k/v, gate/up: one fused GEMM in SGLang and vLLM) share an
        ``InputCache``: the input is quantized once, as the fused kernel does (same bytes either way)."""
        cache = self.input_cache
        if cache is None:
            return self.quantize_input_uncached(x)
        key = (self.kernel_format, self.activation_scale, self.activation_mode, self.op_dtype)
        if cache.x is x and cache.key == key:
            return cache.value
        value = self.quantize_input_uncached(x)
        cache.x, cache.key, cache.value = x, key, value  # holds x: its memory cannot be reused while cached
        return value

    def quantize_input_uncached(self, x: torch.Tensor) -> torch.Tensor:
        fmt = self.kernel_format
        if fmt is None:
            raise CheckpointError(f"'{self.prefix}weight': process_weights_after_loading has not run")
        if not fmt.quantized:
            return x
        scheme = scheme_for(fmt)
        if self.activation_mode == "vllm":
            return scheme.vllm_input(x, self.op_dtype, self._static_amax)
        # the learner's operands.quantize_activation (FP8 blockwise: 1x128 tiles along K)
        scope = "tensor" if self.activation_scale == "tensor" else "row"
        return scheme.quantize_activation(x, scope=scope, pow2_scales=self.activation_scale == "pow2").dequantize(
            self.op_dtype)

    def _static_amax(self) -> torch.Tensor:
        """The calibrated activation amax a static NVFP4 kernel uses: 2688 * input_scale (ModelOpt's decode
        scale) or 2688 / input_global_scale (compressed-tensors' encode scale); 2688 when the layer has none."""
        c = self.canonical()
        if "input_scale" in c:
            return (NVFP4_GLOBAL_DIVISOR * c["input_scale"].float()).reshape(())
        if "input_global_scale" in c:
            return (NVFP4_GLOBAL_DIVISOR / c["input_global_scale"].float()).reshape(())
        return torch.tensor(NVFP4_GLOBAL_DIVISOR, device=self.device_)

    def gemm(self, x_deq: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``F.linear`` on operands already on the grid; bias added in the operand dtype, then cast."""
        if not self.kernel_format.quantized:
            w = self._weight_operand()
            b = self._bias_operand()
            return F.linear(x_deq.to(w.dtype), w, None if b is None else b.to(w.dtype)).to(out_dtype)
        y = F.linear(x_deq, self._weight_operand())
        b = self._bias_operand()
        if b is not None:
            y = y + b.to(y.dtype)
        return y.to(out_dtype)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        y = self.gemm(self.quantize_input(x2), x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply(x)

    def extra_repr(self) -> str:
        return (f"{self.prefix}weight, in={self.in_features}, out={self.out_features}, disk={self.disk_format.value}, "
                f"kernel={getattr(self.kernel_format, 'value', None)}, target={self.target}")


class InputCache:
    """The last (input tensor, grid key) -> quantized-dequantized input of a group of sibling layers."""

    __slots__ = ("x", "key", "value")

    def __init__(self):
        self.x = self.key = self.value = None


#: sibling linears that read one input tensor, by leaf name
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"))


def share_input_caches(model: torch.nn.Module) -> int:
    """Give each group of sibling ``EngineLinear``s (same parent, names in ``SIBLINGS``) one ``InputCache``."""
    n = 0
    for _, parent in model.named_modules():
        for group in SIBLINGS:
            mods = [getattr(parent, g, None) for g in group]
            mods = [m for m in mods if isinstance(m, EngineLinear)]
            if len(mods) > 1:
                cache = InputCache()
                for m in mods:
                    m.input_cache = cache
                n += 1
    return n


def dequantize_operand(q, dtype: torch.dtype) -> torch.Tensor:
    """``q.dequantize(dtype)`` through the format's scheme: on CUDA one Triton launch of
    ``miles_lp.formats.kernels`` (byte-identical to the codec's torch code, which builds fp32 temporaries of the
    whole stack: ~3x the operand's bytes more)."""
    return scheme_for(q.format).dequantize(q, dtype)


def decode_weight(target: str, fmt: Format, tensors: Mapping[str, torch.Tensor], shape: tuple[int, int],
                  lead: tuple[int, ...] = ()):
    """Codec tensor of one weight from its on-disk tensors keyed by suffix (``weight``, ``weight_scale_inv``...).
    ``lead``: leading dims of stacked tensors (``(E,)`` for a ``LinearStack``: one codec tensor ``[E, N, K]``,
    NVFP4 global scale ``[E, 1, 1]``, as the codecs hold a stacked per-matrix scale). ``None`` for BF16."""
    return _naming().decode(target, fmt, "w.weight", {f"w.{s}": t for s, t in tensors.items()}, shape, lead=lead)


class EngineExpert(torch.nn.Module):
    """One routed expert: ``gate_proj``, ``up_proj``, ``down_proj`` as separate ``EngineLinear`` (HF names)."""

    def __init__(self, gate_proj: EngineLinear, up_proj: EngineLinear, down_proj: EngineLinear):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward_tokens(self, x: torch.Tensor, act: Callable, apply_gate: Callable | None) -> torch.Tensor:
        g, u = self.gate_proj, self.up_proj
        if g.kernel_format == u.kernel_format and g.activation_scale == u.activation_scale:
            xq = g.quantize_input(x)  # same input, same grid: quantize once (the fused gate_up GEMM does)
            gate, up = g.gemm(xq, x.dtype), u.gemm(xq, x.dtype)
        else:
            gate, up = g.apply(x), u.apply(x)
        h = apply_gate(torch.cat([gate, up], dim=-1)) if apply_gate is not None else act(gate) * up
        return self.down_proj.apply(h)


class EngineExperts(torch.nn.Module):
    """Drop-in for a transformers-5 fused experts module (same ``forward(hidden, top_k_index, top_k_weights)``)
    holding per-expert canonical tensors as checkpoints store them: children ``0``, ``1``, ... so the names are
    ``<block>.experts.{e}.gate_proj.weight`` etc.

    ``recorder``: when set, called with ``top_k_index [tokens, top_k]`` on every forward (routing replay).
    """

    def __init__(self, experts: list[EngineExpert], act_fn: Callable, apply_gate: Callable | None = None):
        super().__init__()
        for e, ex in enumerate(experts):
            self.add_module(str(e), ex)
        self._list = list(experts)
        self.num_experts = len(experts)
        self.act_fn = act_fn
        self._apply_gate = apply_gate
        self.recorder: Callable[[torch.Tensor], None] | None = None

    def __getitem__(self, e: int) -> EngineExpert:
        return self._list[e]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.recorder is not None:
            self.recorder(top_k_index)
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            if e >= self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[e])
            h = self._list[e].forward_tokens(hidden_states[token_idx], self.act_fn, self._apply_gate)
            h = h * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, h.to(final.dtype))
        return final


STACK_CHUNK_BYTES = 256 << 20  # canonical bytes derived per batched pass (bounds the temporaries)


class LinearStack:
    """Sibling ``EngineLinear`` of one shape, format and target (one projection of every expert of every MoE
    layer; the q_proj of every layer; ...) whose canonical and derived tensors are slices ``[i]`` of stacked
    ``[L, ...]`` storage, as SGLang's and vLLM's fused MoE layers hold ``w13`` / ``w2``. Each layer keeps its
    checkpoint-named parameters (views), so names, loads and updates are unchanged; an update of many of them
    lands in a few strided copies (``miles_lp.multitensor.strided.batched_copy``), and ``process_weights_after_loading``
    derives all of them in a few batched passes (the same elementwise ops on a leading dim: the same bytes as
    one pass per layer; ``tests/unit/test_rollout_stacks.py``).

    The batched pass is used only while every layer still serves from its slice (``aliased``: the module
    attribute is the view made here); otherwise each layer is derived from what it actually serves
    (``EngineLinear.process_weights_after_loading``), so a re-bound parameter stays as stale as it is (C4)."""

    def __init__(self, layers: list[EngineLinear]):
        if not layers:
            raise ValueError("LinearStack needs at least one layer")
        first = layers[0]
        key = _stack_key(first)
        for layer in layers[1:]:
            if _stack_key(layer) != key:
                raise CheckpointError(f"'{layer.prefix}weight' cannot share a stack with '{first.prefix}weight': "
                                      "stacked layers must have one shape and format")
        self.layers = list(layers)
        self.canonical: dict[str, torch.Tensor] = {}  # suffix -> [L, ...]
        self.views: list[dict[str, torch.nn.Parameter]] = [{} for _ in layers]  # what each layer must serve
        for suffix, (dtype, shape) in first.canonical_specs().items():
            stack = torch.empty((len(layers), *shape), dtype=dtype, device=first.device_)
            self.canonical[suffix] = stack
            for i, layer in enumerate(layers):
                p = torch.nn.Parameter(stack[i], requires_grad=False)  # a view: the stack's storage
                layer.register_parameter(suffix, p)
                self.views[i][suffix] = p
        self.derived: dict[str, torch.Tensor] = {}  # name -> [L, ...]
        per_layer = sum(t[0].numel() * t.element_size() for t in self.canonical.values())
        self.chunk = max(1, STACK_CHUNK_BYTES // max(per_layer, 1))

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def prefixes(self) -> list[str]:
        return [layer.prefix for layer in self.layers]

    def aliased(self) -> bool:
        """Every layer's canonical attributes are still the views of this stack (not re-bound)."""
        return all(getattr(layer, s) is p for layer, views in zip(self.layers, self.views, strict=True)
                   for s, p in views.items())

    def pointers(self) -> dict[str, int]:
        """``data_ptr()`` of the stacked storage (canonical and derived), by ``<first layer prefix>stack.<name>``:
        the storage the layers' views must stay in (C4 with views)."""
        head = self.layers[0].prefix + "stack."
        out = {head + s: t.data_ptr() for s, t in self.canonical.items()}
        out.update({head + n: t.data_ptr() for n, t in self.derived.items()})
        return out

    def _derive(self, lo: int, hi: int) -> tuple[dict[str, torch.Tensor], Format]:
        """Derived state of layers ``lo:hi`` (``EngineLinear.process_weights_after_loading`` with a leading dim)."""
        first = self.layers[0]
        n, k = first.out_features, first.in_features
        canon = {s: t[lo:hi] for s, t in self.canonical.items()}
        q = decode_weight(first.target, first.disk_format, canon, (n, k), lead=(hi - lo,))
        # [L, N, K]: the scheme's kernel state on a leading dim (each matrix's blocks, as one layer's pass)
        fmt = Format.BF16 if q is None else q.format
        new = scheme_for(fmt).kernel_state(canon["weight"] if q is None else q, n, k, first.op_dtype)
        if first.has_bias and canon["bias"].dtype != first.op_dtype:
            new["bias_operand"] = canon["bias"].to(first.op_dtype)
        return new, fmt

    def process_weights_after_loading(self) -> int:
        """Derive every layer's kernel state in batched passes of ``self.chunk`` layers; returns the count."""
        first = self.layers[0]
        if first.serve_format is not first.disk_format or not self.aliased():
            for layer in self.layers:
                layer.process_weights_after_loading()
            return len(self.layers)
        fmt = None
        fresh = False
        for lo in range(0, len(self.layers), self.chunk):
            hi = min(lo + self.chunk, len(self.layers))
            new, fmt = self._derive(lo, hi)
            if lo == 0:  # the layout of the derived state: allocate it once, then rebuild in place
                fresh = set(new) != set(self.derived) or any(
                    self.derived[n].shape[1:] != t.shape[1:] or self.derived[n].dtype != t.dtype
                    for n, t in new.items()) or not all(set(new) <= layer._derived for layer in self.layers)
                if fresh:
                    _DERIVED_EPOCH[0] += 1
                    self.derived = {n: torch.empty((len(self.layers), *t.shape[1:]), dtype=t.dtype,
                                                   device=t.device) for n, t in new.items()}
            for name, t in new.items():
                self.derived[name][lo:hi].copy_(t)  # in place: the layers' views (a captured graph) read this
        if fresh:
            _DERIVED_EPOCH[0] += 1
            for i, layer in enumerate(self.layers):
                for name in list(layer._derived):
                    layer._derived.discard(name)
                    delattr(layer, name)
                for name, t in self.derived.items():
                    layer.register_buffer(name, t[i], persistent=False)
                    layer._derived.add(name)
        for layer in self.layers:
            if layer.kernel_format is not fmt:  # nn.Module.__setattr__ costs ~10 us: only on a change
                layer.kernel_format = fmt
        return len(self.layers)


def _stack_key(m: EngineLinear) -> tuple:
    return (m.in_features, m.out_features, m.disk_format, m.serve_format, m.target, m.has_bias, m.weight_dtype,
            m.act_dtype, m.op_dtype, m.activation_scale, m.activation_mode, m.device_)


def stack_linears(model: torch.nn.Module) -> list[LinearStack]:
    """Stack the ``EngineLinear`` of ``model`` that differ only by their layer / expert indices (the prefix with
    every numeric component replaced) and share shape and format: one ``LinearStack`` per projection (every
    expert of every layer in one, ``model.layers.#.mlp.experts.#.gate_proj``). Call before the tensors are
    indexed and loaded (it replaces the parameters by views of the stacks)."""
    import re

    groups: dict[tuple, list[EngineLinear]] = {}
    for _, m in engine_linears(model):
        pattern = re.sub(r"\.\d+(?=\.)", ".#", "." + m.prefix)
        groups.setdefault((pattern, _stack_key(m)), []).append(m)
    return [LinearStack(ms) for ms in groups.values() if len(ms) > 1]


def stack_params(model: torch.nn.Module) -> int:
    """Give the plain parameters outside ``EngineLinear`` (norms, routers) that differ only by layer index and
    share dtype, shape and device one stacked storage each (every parameter becomes a view of it): an update of
    all layers' ``input_layernorm.weight`` then lands in one strided copy. Tied parameters (one tensor under two
    names) are left alone. Returns how many stacks were made. Call before the tensors are indexed and loaded."""
    import re

    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    groups: dict[tuple, list[tuple[torch.nn.Module, str, torch.Tensor]]] = {}
    for mname, module in model.named_modules():
        if isinstance(module, EngineLinear):
            continue
        for attr, p in module.named_parameters(recurse=False):
            if seen.get(id(p), 0) > 1:
                continue
            pattern = re.sub(r"\.\d+(?=\.)", ".#", f".{mname}.{attr}")
            groups.setdefault((pattern, p.dtype, tuple(p.shape), p.device), []).append((module, attr, p))
    made = 0
    for (_, dtype, shape, device), members in groups.items():
        if len(members) < 2:
            continue
        stack = torch.empty((len(members), *shape), dtype=dtype, device=device)
        with torch.no_grad():
            for i, (module, attr, p) in enumerate(members):
                stack[i].copy_(p)
                setattr(module, attr, torch.nn.Parameter(stack[i], requires_grad=p.requires_grad))
        made += 1
    return made


def engine_linears(model: torch.nn.Module) -> Iterator[tuple[str, EngineLinear]]:
    for name, m in model.named_modules():
        if isinstance(m, EngineLinear):
            yield name, m


def describe_layer(m: EngineLinear) -> dict[str, Any]:
    return {"disk": m.disk_format.value, "kernel": getattr(m.kernel_format, "value", None), "target": m.target,
            "activation_scale": m.activation_scale if m.kernel_format is not None
            and scheme_for(m.kernel_format).scaled_activations else None}
