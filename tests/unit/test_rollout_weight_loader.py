"""The SGLang custom weight loader against modules that follow SGLang's create_weights /
process_weights_after_loading contract: an SGLang-style MXFP8 linear (post-processing allocates a new swizzled
scale, as FlashInfer's path does) and the reference engine's own layers."""

from __future__ import annotations

import pytest
import torch

from miles_lp import formats
from miles_lp.rollout.engine import EngineError, SamplingParams
from miles_lp.rollout.reference import ReferenceEngine
from miles_lp.rollout.testing import tiny_checkpoint
from miles_lp.rollout.weight_loader import load_weights


class MXFP8Method:
    """SGLang LinearMethodBase shape: create_weights(layer, ...), process_weights_after_loading(layer), apply."""

    backend = "flashinfer_cutlass"

    def __init__(self, mode: str = "new_tensor"):
        self.mode = mode

    def create_weights(self, layer, n: int, k: int) -> None:
        layer.register_parameter("weight", torch.nn.Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn), False))
        layer.register_parameter("weight_scale_inv", torch.nn.Parameter(torch.empty(n, k // 32, dtype=torch.uint8),
                                                                       False))

    def process_weights_after_loading(self, layer) -> None:
        sw = formats.swizzle_scales(layer.weight_scale_inv.data)
        if self.mode == "reshape":
            sw = sw.reshape(-1)
        if self.mode == "in_place_weight":  # e.g. a shuffle of the loaded weight: not idempotent
            layer.weight.data.copy_(layer.weight.data.flip(0))
        layer.weight_scale_inv_swizzled = torch.nn.Parameter(sw, requires_grad=False)  # a NEW tensor each time

    def apply(self, layer, x):
        n, k = layer.weight.shape
        scale = formats.unswizzle_scales(layer.weight_scale_inv_swizzled.data, n, k // 32)
        w = formats.MXFP8Tensor(layer.weight.data, scale).dequantize(torch.float32)
        return x @ w.T


class Linear(torch.nn.Module):
    def __init__(self, n, k, method):
        super().__init__()
        self.quant_method = method
        method.create_weights(self, n, k)

    def forward(self, x):
        return self.quant_method.apply(self, x)


class Model(torch.nn.Module):
    def __init__(self, method_factory=MXFP8Method):
        super().__init__()
        self.a = Linear(64, 64, method_factory())
        self.b = Linear(32, 64, method_factory())

    def load_weights(self, named):  # SGLang's default weight_loader: copy into the parameter
        params = dict(self.named_parameters())
        for n, t in named:
            params[n].data.copy_(t)


def _q(seed, n=64, k=64):
    q = formats.quantize_mxfp8(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    return q.data, q.scale


def _load(model, seed):
    out = []
    for name, (n, k) in (("a", (64, 64)), ("b", (32, 64))):
        d, s = _q(seed + (name == "b"), n, k)
        out += [(f"{name}.weight", d), (f"{name}.weight_scale_inv", s)]
    return out


def _fresh(seed, factory=MXFP8Method):
    m = Model(factory)
    m.load_weights(_load(m, seed))
    for layer in (m.a, m.b):
        layer.quant_method.process_weights_after_loading(layer)
    return m


def test_loader_rebuilds_derived_state_in_captured_storage():
    m = _fresh(0)
    ptr = m.a.weight_scale_inv_swizzled.data_ptr()
    x = torch.randn(4, 64)
    stale = _fresh(0)
    stale.load_weights(_load(stale, 10))  # SGLang's tensor path without the loader: swizzled scales stay old
    target = _fresh(10)
    assert not torch.equal(stale.a(x), target.a(x))
    report = load_weights(m, [n for n in _load(m, 10) if n[0].startswith("a.")])
    assert report["touched"] == ["a"] and report["copied_back"] == ["a.weight_scale_inv_swizzled"]
    assert m.a.weight_scale_inv_swizzled.data_ptr() == ptr  # the storage a CUDA graph captured
    assert torch.equal(m.a(x), target.a(x))
    assert torch.equal(m.b(x), _fresh(0).b(x))  # untouched module: not re-processed


@pytest.mark.parametrize("mode, match", [("reshape", "cannot be copied back"),
                                         ("in_place_weight", "changed a loaded tensor in place")])
def test_loader_refuses_what_it_cannot_keep(mode, match):
    m = _fresh(0, lambda: MXFP8Method("new_tensor"))
    m.a.quant_method.mode = mode
    with pytest.raises(EngineError, match=match):
        load_weights(m, _load(m, 3)[:2])


def test_loader_refuses_non_idempotent_backend():
    class TRTLLM(MXFP8Method):
        backend = "flashinfer_trtllm"

    m = _fresh(0, TRTLLM)
    with pytest.raises(EngineError, match="flashinfer_trtllm.*not idempotent"):
        load_weights(m, _load(m, 1)[:2])


def test_loader_on_reference_engine_layers():
    """The reference engine's EngineLinear follows the same contract (post-processing in place)."""
    torch.set_num_threads(1)
    recipe = "policies/qwen3-moe-mxfp8-nvfp4-experts.yaml"
    from safetensors.torch import load_file

    eng = ReferenceEngine(tiny_checkpoint("qwen3_moe", recipe), device="cpu")
    other = tiny_checkpoint("qwen3_moe", recipe, seed=1)
    new = {}
    for f in sorted(other.glob("*.safetensors")):
        new.update(load_file(f))
    ptrs = eng.storage_pointers()
    targets = eng._captured

    def load(named):
        for n, t in named:
            targets[n].copy_(t)

    report = load_weights(eng.model, new.items(), load=load)
    assert len(report["touched"]) == 4 * 4 + 4 * 4 * 3 + 1  # 4 attn projs + 12 experts per layer, + lm_head
    assert eng.storage_pointers() == ptrs
    fresh = ReferenceEngine(other, device="cpu")
    sp = SamplingParams(max_new_tokens=4, seed=1)
    a, b = eng.generate([[1, 2, 3]], sp)[0], fresh.generate([[1, 2, 3]], sp)[0]
    assert a.output_ids == b.output_ids and torch.equal(a.logprobs, b.logprobs)
