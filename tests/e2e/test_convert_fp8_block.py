"""An fp8_block conversion for every target, judged by ``verify`` (its own table and reference codec: every check
passes, byte equality with the oracle included) and a flipped scale byte seen; the reference engine serves the
converted checkpoint (every planned weight fp8_block as the engine reads the config, the self-check within
tolerance, the served operand the codec's decode); transformers' own FP8 reader and the compressed-tensors
package load it on CPU to the codec's values. Real vLLM / SGLang CPU serving it: ``test_rollout_vllm_fp8_block.py``,
``test_rollout_sglang_cpu_server.py`` (docs/rollout.md)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_lp.checkpoint.convert import convert_checkpoint
from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.checkpoint.verify import verify_checkpoint
from miles_lp.config import Where
from miles_lp.formats import oracle, quantize_fp8_blockwise
from miles_lp.formats.spec import Format
from miles_lp.policy import parse_policy

POLICY = {"default": "fp8_block", "rules": [{"layers": "first 1", "format": "bf16"}]}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("fp8blk") / "base", seed=3, num_layers=2)


def _convert(base, out, target, pow2=False):
    policy = parse_policy(dict(POLICY, pow2_scales=pow2), Where("t.yaml", "precision"))
    convert_checkpoint(base, out, policy, target=target, progress=False, log=lambda s: None)
    return out


@pytest.mark.parametrize("target", ["sglang", "vllm", "compressed-tensors"])
def test_convert_then_verify_passes(base, tmp_path, target):
    out = _convert(base, tmp_path / "out", target)
    report = verify_checkpoint(out, base, log=lambda s: None)
    assert report.ok, report.format()
    verdicts = {c.check: c.verdict for c in report.checks}
    assert verdicts["grid"] == "pass" and verdicts["error"] == "pass" and verdicts["config"] == "pass"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    if target != "compressed-tensors":
        assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    scale = "weight_scale" if target == "compressed-tensors" else "weight_scale_inv"
    sd = {}
    for f in out.glob("*.safetensors"):
        sd.update(load_file(f))
    w = sd["model.layers.1.mlp.down_proj.weight"]
    s = sd[f"model.layers.1.mlp.down_proj.{scale}"]
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(s.shape) == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
    assert sd["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16  # the first layer stays BF16


def test_verify_sees_a_changed_block_scale(base, tmp_path):
    out = _convert(base, tmp_path / "out", "sglang")
    f = next(f for f in out.glob("*.safetensors") if "model.layers.1.mlp.up_proj.weight_scale_inv" in load_file(f))
    sd = load_file(f)
    sd["model.layers.1.mlp.up_proj.weight_scale_inv"] = sd["model.layers.1.mlp.up_proj.weight_scale_inv"] * 2
    save_file(sd, str(f), metadata={"format": "pt"})
    report = verify_checkpoint(out, base, log=lambda s: None)
    bad = {c.check: c.detail for c in report.checks if c.verdict == "FAIL"}
    assert "grid" in bad and "up_proj.weight_scale_inv" in bad["grid"]


@pytest.mark.parametrize("pow2", [False, True])
def test_oracle_equals_the_codec(pow2):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 200, generator=g) * torch.logspace(-3, 3, 200)).bfloat16()
    x[:128, :128] = 0  # an all-zero block: scale 1
    data, scale_inv = oracle.fp8_block_quantize(x, 128, pow2)
    q = quantize_fp8_blockwise(x, (128, 128), pow2)
    assert torch.equal(data, q.data.view(torch.uint8)) and torch.equal(scale_inv, q.scale_inv)


def test_reference_engine_serves_the_converted_checkpoint(base, tmp_path):
    from miles_lp.rollout.reference import ReferenceEngine

    out = _convert(base, tmp_path / "out", "sglang", pow2=True)
    eng = ReferenceEngine(out, device="cpu", dtype="float32")
    try:
        q = eng.quantized_params()
        assert q and set(q.values()) == {"fp8_block"} and not any(".layers.0." in n for n in q)
        layer = next(m for m in eng._linears if m.prefix == "model.layers.1.mlp.down_proj.")
        assert layer.kernel_format is Format.FP8_BLOCK and layer.activation_scale == "pow2"
        assert torch.equal(layer.operand, (layer.weight.float() * layer.weight_scale_inv.repeat_interleave(
            128, 0).repeat_interleave(128, 1)[:layer.out_features, :layer.in_features]))
        check = eng.self_check()  # C3: the serving GEMM vs float64 on the decoded weights; the fresh derivation
        assert check["ok"] and check["layers"], check
        assert {v["format"] for v in check["layers"].values()} == {"fp8_block"}
        assert all(v["fresh_diff"] == 0 and 0 < v["rel_err"] < 0.1 for v in check["layers"].values()), check
    finally:
        eng.close()


@pytest.mark.parametrize("target", ["sglang", "compressed-tensors"])
def test_transformers_reads_the_checkpoint(base, tmp_path, target):
    """Independent readers on CPU: transformers' FineGrainedFP8 (``quant_method: fp8`` with ``weight_block_size``,
    the SGLang/vLLM checkpoint) and the compressed-tensors package through transformers (``float-quantized``, block
    strategy, ``dequantize``) load the checkpoint by decoding each weight with its block scales: every tensor equals
    the codec's bf16(fp32(q) * s) of the source, the BF16 weights as stored. (FineGrainedFP8 infers the block from
    the scale grid, so it reads partial edge blocks right only when whole: the tiny model's dims are single whole
    blocks; real models' are multiples of 128.)"""
    pytest.importorskip("accelerate", reason="transformers' FP8 reader needs accelerate (in the test extra)")
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    out = _convert(base, tmp_path / "out", target)
    kw = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if target == "compressed-tensors" else {}
    src = {}
    for f in base.glob("*.safetensors"):
        src.update(load_file(f))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, **kw)
    got = model.state_dict()
    assert not any("scale" in k for k in got)  # decoded, not kept compressed
    n_fp8 = 0
    for name, t in src.items():
        if ".layers.1." in name and name.endswith("_proj.weight"):  # planned fp8_block: the codec's meaning
            n_fp8 += 1
            t = quantize_fp8_blockwise(t, (128, 128)).dequantize(torch.bfloat16)
        assert torch.equal(got[name].view(torch.int16), t.view(torch.int16)), name
    assert n_fp8 == 7  # every linear of layer 1
