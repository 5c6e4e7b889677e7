"""The pure parts of ``rollout.vllm_state`` (what the vLLM engine process uses for C2/C3), without vLLM:
fused-parameter splitting into checkpoint names, and its own float64 decodes against the project's codecs."""

from __future__ import annotations

import torch

from miles_lp.formats.mxfp8 import quantize_mxfp8
from miles_lp.formats.nvfp4 import quantize_nvfp4
from miles_lp.rollout.vllm_state import dequant_mxfp8_f64, dequant_nvfp4_f64, rel_err, split_fused


def test_split_fused_rows_per_shard_scalars_and_plain_modules():
    w = torch.arange(8 * 2).reshape(8, 2)
    parts = split_fused("model.layers.0.self_attn.qkv_proj", "weight", w, [4, 2, 2])
    assert list(parts) == [f"model.layers.0.self_attn.{s}_proj.weight" for s in "qkv"]
    assert torch.equal(torch.cat(list(parts.values())), w)
    assert torch.equal(parts["model.layers.0.self_attn.k_proj.weight"], w[4:6])
    per_shard = split_fused("m.mlp.gate_up_proj", "weight_scale_2", torch.tensor([0.5, 0.25]), [4, 4])
    assert {k: float(v) for k, v in per_shard.items()} == {"m.mlp.gate_proj.weight_scale_2": 0.5,
                                                            "m.mlp.up_proj.weight_scale_2": 0.25}
    assert all(v.shape == () for v in per_shard.values())  # the checkpoint's scalar shape
    plain = split_fused("m.mlp.down_proj", "weight", w, None)
    assert list(plain) == ["m.mlp.down_proj.weight"] and plain["m.mlp.down_proj.weight"] is w


def test_own_decodes_equal_the_codecs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=g) * 3
    mx = quantize_mxfp8(x.to(torch.bfloat16))
    assert torch.equal(dequant_mxfp8_f64(mx.data, mx.scale).to(torch.float32), mx.dequantize(torch.float32))
    nv = quantize_nvfp4(x.to(torch.bfloat16))
    ours = dequant_nvfp4_f64(nv.data, nv.scale, nv.global_scale)
    assert torch.allclose(ours, nv.dequantize(torch.float32).to(torch.float64), rtol=1e-6, atol=0)
    assert rel_err(ours.to(torch.float32), ours) < 1e-7
    assert rel_err(torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.float64)) == 1.0
