"""The linear layers of SGLang's model as the checks see them: which ones serve in low precision (C1) and what a
high-precision GEMM on their dequantized weights gives (C3's reference)."""

from __future__ import annotations

import torch


def live_format(module: torch.nn.Module) -> str | None:
    """The low-precision format ``module`` serves in, read from its live quant method: None for a module that is
    not a linear layer or that SGLang serves unquantized."""
    qm = getattr(module, "quant_method", None)
    if qm is None or not hasattr(module, "weight") or type(qm).__name__ == "UnquantizedLinearMethod":
        return None
    if not hasattr(qm, "apply") or type(module).__name__.endswith(("Embedding", "ParallelLMHead")):
        return None
    return getattr(qm, "miles_lp_format", None) or type(qm).__name__


def reference_output(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x @ W^T (+ bias)`` in float64 on the module's weights dequantized (``dequantized_weight``)."""
    w = getattr(module.quant_method, "dequantized_weight", None)
    if w is None:
        raise NotImplementedError(f"{type(module.quant_method).__name__} has no dequantized_weight(layer)")
    y = x.double() @ w(module).double().t()
    bias = getattr(module, "bias", None)
    return y + bias.double() if bias is not None else y


# ---- the CPU linear method (runs inside the SGLang process) ----------------------------------------------------------
# SGLang's CPU platform serves MXFP8 and block FP8 only through AMX kernels (Fp8LinearMethod asserts AMX support)
# and has no CPU branch for NVFP4 (ModelOpt). Neither config has a registration point for another linear method:
# ``register()`` wraps ``Fp8Config.get_quant_method`` and ``ModelOptFp4Config.get_quant_method`` in this one place
# so that, on CPU, every MXFP8 / FP8 blockwise / NVFP4 dense linear they would quantize gets the emulated method
# instead (MoE experts are not
# covered: SGLang's fused-MoE methods are left as they are). The weights are still created by SGLang's own code
# (``Fp8LinearMethod.create_fp8_weight_``, ``ModelOptFp4LinearMethod.create_weights``: its parameter classes and
# weight loaders, so fused q/k/v and gate/up shards load as SGLang loads them; NVFP4 keeps one global scale per
# shard, and each shard is decoded with its own) and
# loaded by SGLang's loader; only the GEMM is ours, emulated exactly as the reference engine's ``EngineLinear``
# does: the served bytes decoded and dequantized once per load into the operand (``process_weights_after_loading``,
# rebuilt in place, which SGLang's disk update re-runs), the activation quantized by the learner's rule and
# dequantized, ``F.linear`` in the reference engine's operand dtype.
#
# The scale's second name. SGLang 0.5.23's Llama loader renames every checkpoint ``*.weight_scale_inv`` to
# ``*.weight_scale`` before it looks the parameter up (``sglang/srt/models/llama.py:723-724``,
# ``LlamaForCausalLM._legacy_load_weights``, and the same rename in its ``AutoWeightsLoader`` path:
# ``sglang/srt/model_loader/auto_loader.py:217-225``), while the block-FP8 / MXFP8 linear registers
# ``weight_scale_inv`` (``Fp8LinearMethod.create_fp8_weight_``, layers/quantization/fp8.py:689): every scale of a
# Llama-family model would be dropped ("Parameter ... weight_scale not found in params_dict"), left zero, and the
# model would serve a different policy. Qwen3's loader keeps the name. Neither loader can be told, and no checkpoint
# name survives both, so the MXFP8 layer answers to both: ``weight_scale`` is a second parameter over the very
# storage of ``weight_scale_inv`` (same loader, same block attributes), whichever name the model's loader asks for
# writes the bytes the GEMM and the checks read. ``ALIAS`` marks it; the checks' view of the model skips it (the
# checkpoint has one tensor).
ALIAS = "miles_lp_alias_of"


def add_scale_alias(layer: torch.nn.Module, name: str = "weight_scale_inv", alias: str = "weight_scale") -> None:
    """Register ``alias`` on ``layer``: a parameter of ``name``'s class over ``name``'s storage, marked ``ALIAS``."""
    src = getattr(layer, name)
    if alias in layer._parameters:
        raise ValueError(f"{type(layer).__name__} already has a parameter {alias!r}: cannot alias {name!r} to it")
    twin = type(src).__new__(type(src), src.data)  # a new Parameter object over the same storage
    twin.__dict__.update(src.__dict__)  # the weight loader and the block attributes (output_dim, format_ue8m0, ...)
    setattr(twin, ALIAS, name)
    layer.register_parameter(alias, twin)


def _emulated_method_classes():
    """``(MXFP8 method, NVFP4 method)``: SGLang's own ``create_weights`` (Fp8LinearMethod's static helper, the
    ModelOpt NVFP4 method's), miles-lp's derived operand and GEMM."""
    from sglang.srt.layers.quantization.base_config import LinearMethodBase
    from sglang.srt.layers.quantization.fp8 import Fp8LinearMethod
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4LinearMethod

    from miles_lp.formats.schemes import scheme_for
    from miles_lp.formats.spec import Format
    from miles_lp.rollout.layers import decode_weight, dequantize_operand, operand_dtype

    class _Emulated(LinearMethodBase):
        fmt: Format
        suffixes: tuple[str, ...]
        #: weight rows one scale row covers (FP8 blockwise: 128; MXFP8 / NVFP4 scale every row)
        row_block = 1

        @property
        def miles_lp_format(self) -> str:
            return self.fmt.value

        def __init__(self, quant_config):
            self.quant_config = quant_config

        def shards(self, layer):
            """The codec tensor of each checkpoint shard (q/k/v, gate/up) of the fused weight, as served."""
            k, rb = layer.input_size_per_partition, self.row_block
            widths = list(getattr(layer, "logical_widths", None) or [layer.weight.shape[0]])
            at, out = 0, []
            for i, n in enumerate(widths):
                parts = {}
                for s in self.suffixes:
                    t = getattr(layer, s).data
                    if s == "weight":
                        parts[s] = t[at:at + n]
                    elif t.dim() == 1 and t.shape[0] == len(widths):
                        parts[s] = t[i]
                    else:  # a shard's scale rows (whole blocks: SGLang refuses a fused shard that is not)
                        parts[s] = t[at // rb:(at + n + rb - 1) // rb]
                out.append(decode_weight("sglang", self.fmt, parts, (n, k)))
                at += n
            return out

        def dequantized_weight(self, layer) -> torch.Tensor:
            """The weight decoded afresh from the served bytes (C3's reference, not the derived operand)."""
            return torch.cat([q.dequantize(torch.float64) for q in self.shards(layer)])

        def process_weights_after_loading(self, layer) -> None:
            operand = torch.cat([dequantize_operand(q, layer.miles_lp_op_dtype) for q in self.shards(layer)])
            old = getattr(layer, "miles_lp_operand", None)
            if old is not None and old.shape == operand.shape:
                old.copy_(operand)  # rebuilt in place: the storage the GEMM reads stays put
            else:
                layer.register_buffer("miles_lp_operand", operand.contiguous(), persistent=False)

        def quantize_input(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            raise NotImplementedError

        def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            k = x.shape[-1]
            x2 = self.quantize_input(x.reshape(-1, k), layer.miles_lp_op_dtype)
            y = torch.nn.functional.linear(x2, layer.miles_lp_operand)
            if bias is not None:
                y = y + bias.to(y.dtype)
            return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    class _BlockFp8(_Emulated):
        """SGLang's own block-FP8 parameters (``Fp8LinearMethod.create_fp8_weight_``: ``weight`` and
        ``weight_scale_inv``), which MXFP8 and FP8 blockwise share; ``mxfp8_blocks`` picks the block layout."""

        mxfp8_blocks = False

        def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                           params_dtype, **extra_weight_attrs):
            Fp8LinearMethod.create_fp8_weight_(
                layer, block_quant=True, quant_config=self.quant_config, use_mxfp8=self.mxfp8_blocks,
                output_size_per_partition=sum(output_partition_sizes), input_size_per_partition=input_size_per_partition,
                output_partition_sizes=output_partition_sizes, input_size=input_size, output_size=output_size,
                params_dtype=params_dtype, weight_loader=extra_weight_attrs.get("weight_loader"),
                is_checkpoint_fp8_serialized=True)
            add_scale_alias(layer)  # Llama's loader asks for ``weight_scale`` (see above)
            layer.miles_lp_op_dtype = self.op_dtype(params_dtype)

        def op_dtype(self, params_dtype: torch.dtype) -> torch.dtype:
            raise NotImplementedError(f"{type(self).__name__} does not define its GEMM operand dtype")

    class Mxfp8(_BlockFp8):
        fmt, suffixes, mxfp8_blocks = Format.MXFP8, ("weight", "weight_scale_inv"), True

        def op_dtype(self, params_dtype):
            return operand_dtype(torch.device("cpu"), params_dtype)

        def quantize_input(self, x, dtype):
            from miles_lp import formats

            return formats.quantize_mxfp8(x, axis=-1).dequantize(dtype)

    class Nvfp4(_Emulated):
        fmt, suffixes = Format.NVFP4, ("weight", "weight_scale", "weight_scale_2", "input_scale")

        def create_weights(self, layer, *args, **kwargs):
            ModelOptFp4LinearMethod.create_weights(self, layer, *args, **kwargs)
            layer.miles_lp_op_dtype = operand_dtype(torch.device("cpu"), layer.params_dtype)

        def quantize_input(self, x, dtype):
            from miles_lp import formats

            # the RL recipe's per-token global scale (the reference engine's default ``activation_scale``)
            return formats.quantize_nvfp4(x, scale_scope="row").dequantize(dtype)

    class Fp8Block(_BlockFp8):
        """FP8 blockwise (DeepSeek-V3 style): E4M3 weight with one fp32 ``weight_scale_inv`` per 128x128 block,
        activations in 1x128 tiles with fp32 scales (the learner's TE Float8BlockScaling rule, ``pow2_scales:
        false``: the checkpoint's ``quantization_config`` cannot say otherwise)."""

        fmt, suffixes, row_block = Format.FP8_BLOCK, ("weight", "weight_scale_inv"), 128

        def op_dtype(self, params_dtype):
            return scheme_for(Format.FP8_BLOCK).operand_dtype(torch.device("cpu"), params_dtype, pow2_scales=False)

        def quantize_input(self, x, dtype):
            return scheme_for(Format.FP8_BLOCK).quantize_activation(x, pow2_scales=False).dequantize(dtype)

    Fp8Block.__name__ = Fp8Block.__qualname__ = "MilesLpFp8BlockLinearMethod"  # named in SGLang's loader list
    return Mxfp8, Nvfp4, Fp8Block


def register() -> None:
    """On SGLang's CPU platform, MXFP8 / NVFP4 dense linears get the emulated methods (see above); elsewhere nothing
    changes."""
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.quantization import fp8
    from sglang.srt.utils import is_cpu

    orig = fp8.Fp8Config.get_quant_method
    if not is_cpu() or getattr(orig, "_miles_lp", False):
        return
    method, nvfp4, fp8_block = _emulated_method_classes()

    def get_quant_method(self, layer, prefix):
        block = not self.use_mxfp8 and self.is_checkpoint_fp8_serialized and self.weight_block_size is not None
        if isinstance(layer, LinearBase) and (self.use_mxfp8 or block):
            if fp8.is_layer_skipped(prefix, self.ignored_layers, fused_mapping=self.packed_modules_mapping):
                return fp8.UnquantizedLinearMethod()
            return method(self) if self.use_mxfp8 else fp8_block(self)
        return orig(self, layer, prefix)

    get_quant_method._miles_lp = True
    fp8.Fp8Config.get_quant_method = get_quant_method
    # SGLang's linears pick the block-aware weight loader (``weight_loader_v2``: a fused shard's 128-row blocks land
    # in its scale rows) by the quant method's class name (``WEIGHT_LOADER_V2_SUPPORTED``, layers/linear.py:140)
    from sglang.srt.layers import linear as sglang_linear

    if fp8_block.__name__ not in sglang_linear.WEIGHT_LOADER_V2_SUPPORTED:
        sglang_linear.WEIGHT_LOADER_V2_SUPPORTED.append(fp8_block.__name__)

    # SGLang's CPU tensor-parallel padding asks the weight block for a square shape; MXFP8's [1, 32] blocks one row
    # at a time, so the rows need no padding at all (a multiple of 1): the answer for that block, nothing else
    from sglang.srt.configs import update_config

    pad = update_config.get_moe_padding_size

    def get_moe_padding_size(weight_block_size):
        if weight_block_size is not None and list(weight_block_size) == [1, 32]:
            return 1
        return pad(weight_block_size)

    update_config.get_moe_padding_size = get_moe_padding_size

    from sglang.srt.layers.quantization import modelopt_quant

    orig_fp4 = modelopt_quant.ModelOptFp4Config.get_quant_method

    def get_fp4_quant_method(self, layer, prefix):
        out = orig_fp4(self, layer, prefix)
        return nvfp4(self) if type(out) is modelopt_quant.ModelOptFp4LinearMethod else out

    modelopt_quant.ModelOptFp4Config.get_quant_method = get_fp4_quant_method
