"""What the converter writes for each declared scheme, read back from disk.

- compressed-tensors W4A4 NVFP4 (a config group declaring ``input_activations``): every NVFP4 module carries
  ``input_global_scale`` F32 [1]. vLLM's ``CompressedTensorsW4A4Fp4`` creates it with ``torch.empty`` and loads
  it from the checkpoint; absent, it served ``inf`` / ``-1288.7`` and NaN logprobs. Value: the recipe's static
  activation scale (encode 1.0 = 1 / ModelOpt's ``input_scale`` 1.0).
- the shards an engine fuses (q/k/v, gate/up) store ONE global scale, bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from miles_lp.checkpoint.convert import convert_checkpoint
from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.config import Where
from miles_lp.policy import parse_policy


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("wt") / "m", seed=5, num_layers=2)


@pytest.fixture(scope="module")
def converted(src, tmp_path_factory):
    """target -> (tensors, quantization_config) of an all-NVFP4 conversion (two conversions per module)."""
    cache = {}

    def get(target):
        if target not in cache:
            out = tmp_path_factory.mktemp("wt_out") / target
            policy = parse_policy({"default": "nvfp4"}, Where("<test>", "precision"))
            convert_checkpoint(src, out, policy, target=target, progress=False, log=lambda s: None)
            t = {}
            for f in out.glob("*.safetensors"):
                t.update(load_file(str(f)))
            cache[target] = t, json.loads((out / "config.json").read_text())["quantization_config"]
        return cache[target]

    return get


def test_compressed_tensors_w4a4_carries_input_global_scale(converted):
    t, cfg = converted("compressed-tensors")
    (group,) = cfg["config_groups"].values()
    assert group["format"] == "nvfp4-pack-quantized" and group["input_activations"] is not None  # W4A4 declared
    modules = sorted(n[: -len(".weight_packed")] for n in t if n.endswith(".weight_packed"))
    assert len(modules) == 14
    for m in modules:
        s = t.get(m + ".input_global_scale")
        assert s is not None, f"{m}.input_global_scale missing"
        assert s.dtype == torch.float32 and s.shape == (1,) and float(s) == 1.0


def test_modelopt_nvfp4_carries_input_scale(converted):
    t, _ = converted("vllm")
    modules = sorted(n[: -len(".weight_scale_2")] for n in t if n.endswith(".weight_scale_2"))
    assert len(modules) == 14 and all(float(t[m + ".input_scale"]) == 1.0 for m in modules)


@pytest.mark.parametrize("target,suffix", [("compressed-tensors", "weight_global_scale"), ("vllm", "weight_scale_2")])
def test_fused_shards_store_one_global_scale(converted, target, suffix):
    t, _ = converted(target)
    for layer in range(2):
        for shards in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            vals = {t[f"model.layers.{layer}.{s}.{suffix}"].reshape(-1).view(torch.int32).item() for s in shards}
            assert len(vals) == 1, (layer, shards, vals)
    alone = {t[f"model.layers.0.{s}.{suffix}"].reshape(-1).view(torch.int32).item()
             for s in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")}
    assert len(alone) == 4  # different fused groups keep their own scales: not everything was merged
