"""`miles-lp convert` on tiny checkpoints of every architecture, for every target, checked by `verify`,
by the compressed-tensors package, by transformers (BF16 parts) and by SGLang's skip-matching rules."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.checkpoint.verify import decode, verify_checkpoint
from miles_lp.cli import main
from miles_lp.formats import Format
from miles_lp.io.safetensors_io import INDEX_NAME, TensorReader, open_checkpoint

ARCHS = ("qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v3", "mixtral")
MOE = ("qwen3_moe", "qwen2_moe", "deepseek_v3", "mixtral")
# (format, target) per architecture. Mixed MXFP8 + NVFP4: SGLang (modelopt_mixed) and compressed-tensors; vLLM's
# modelopt config holds one format (test_convert_bad_input)
CASES = [(a, "mxfp8", t) for a in ARCHS for t in ("sglang", "vllm", "compressed-tensors")]
CASES += [(a, f, t) for a in MOE for f, t in (("nvfp4-experts", "sglang"), ("nvfp4-experts", "vllm"),
                                             ("nvfp4-experts", "compressed-tensors"),
                                             ("mxfp8+nvfp4-experts", "sglang"),
                                             ("mxfp8+nvfp4-experts", "compressed-tensors"))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{arch: path} of multi-shard tiny checkpoints."""
    root = tmp_path_factory.mktemp("tiny")
    return {a: make_tiny_model(a, root / a, seed=1, max_shard_size="200KB") for a in ARCHS}


def convert(src, out, *flags) -> int:
    return main(["convert", "--hf-checkpoint", str(src), "--output", str(out), "--no-progress", *flags])


@pytest.mark.parametrize("arch,fmt,target", CASES)
def test_convert_and_verify(tiny, tmp_path, capsys, arch, fmt, target):
    out = tmp_path / "out"
    assert convert(tiny[arch], out, "--format", fmt, "--target", target, "--num-layers-at-start-in-bf16", "1",
                   "--max-shard-size", "300KB") == 0
    printed = capsys.readouterr()
    assert "plan: sha256" in printed.err and "FORMAT" in printed.err and "converted:" in printed.out and "bytes out" in printed.out
    files = sorted(p.name for p in out.iterdir())
    assert INDEX_NAME in files and "config.json" in files and "miles_lp_plan.json" in files
    assert "generation_config.json" in files  # copied
    assert sum(f.endswith(".safetensors") for f in files) >= 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    if fmt == "nvfp4-experts" and target == "sglang":
        assert qc["quant_algo"] == "NVFP4" and (out / "hf_quant_config.json").exists()
    report = verify_checkpoint(out, source=tiny[arch])
    assert report.ok, report.format()
    assert [c.verdict for c in report.checks] == ["pass"] * 8
    assert main(["verify", str(out), "--source", str(tiny[arch])]) == 0


def test_sglang_skip_matching_every_tensor(tiny, tmp_path):
    """Every checkpoint tensor, read with SGLang's `is_layer_skipped` over `modules_to_not_convert`, lands in
    the plan's format: quantized modules carry weight_scale_inv, skipped ones are plain bf16."""
    from miles_lp.policy import consumers as C
    from miles_lp.policy import get_layout

    out = tmp_path / "out"
    assert convert(tiny["qwen3_moe"], out, "--format", "mxfp8", "--num-layers-at-end-in-bf16", "1",
                   "--bf16-pattern", "*.self_attn.o_proj") == 0
    cfg = json.loads((out / "config.json").read_text())
    skip = cfg["quantization_config"]["modules_to_not_convert"]
    layout = get_layout(cfg)
    tensors = open_checkpoint(out).tensors
    n = 0
    for name, h in tensors.items():
        if not name.endswith(".weight") or len(h.shape) != 2:
            continue
        info = layout.describe(name)
        if info.engine_module is None:  # embeddings, lm_head, routers: never quantized by SGLang
            assert h.dtype == "BF16", name
            continue
        quantized = not C.sglang_is_layer_skipped(info.engine_module, skip)
        assert (h.dtype == "F8_E4M3") == quantized, name
        assert ((name + "_scale_inv") in tensors) == quantized, name
        n += 1
    assert n > 40


def test_compressed_tensors_package_decompresses_our_output(tiny, tmp_path):
    """compressed-tensors' own compressors decompress every quantized module of our output to exactly our
    dequantization (compared in the dtype the package returns)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs

    out = tmp_path / "out"
    assert convert(tiny["qwen3_moe"], out, "--format", "mxfp8+nvfp4-experts", "--target", "compressed-tensors") == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    record = json.loads((out / "miles_lp_plan.json").read_text())
    ck = open_checkpoint(out)
    seen = {Format.MXFP8: 0, Format.NVFP4: 0}
    stats: list[float] = []
    with TensorReader() as r:
        for g in qc["config_groups"].values():
            from compressed_tensors.quantization import QuantizationScheme

            weights = QuantizationArgs.model_validate(g["weights"])  # the package parses our weight args
            scheme = QuantizationScheme(targets=g["targets"], weights=weights)
            comp = BaseCompressor.load_from_registry(g["format"])
            fmt = {"mxfp8-quantized": Format.MXFP8, "nvfp4-pack-quantized": Format.NVFP4}[g["format"]]
            for name, shape in record["source"]["shapes"].items():
                prefix = name[: -len("weight")]
                key = prefix + ("weight_packed" if fmt is Format.NVFP4 else "weight")
                if not name.endswith(".weight") or key not in ck.tensors:
                    continue
                if fmt is Format.MXFP8 and ck.tensors[key].dtype != "F8_E4M3":
                    continue
                sd = {k[len(prefix):]: r.read(h) for k, h in ck.tensors.items()
                      if k.startswith(prefix) and k[len(prefix):].startswith("weight")}
                theirs = comp.decompress(sd, scheme)["weight"]
                ours = decode("compressed-tensors", fmt, name, {prefix + k: v for k, v in sd.items()},
                              tuple(shape)).dequantize(theirs.dtype)
                if fmt is Format.MXFP8:
                    assert torch.equal(theirs, ours), name
                else:  # CT decodes in bf16 arithmetic (scale / global_scale, then x * s): double rounding
                    ulp = torch.finfo(torch.bfloat16).eps * ours.float().abs()
                    assert ((theirs.float() - ours.float()).abs() <= ulp).all(), name
                    stats.append(float((theirs == ours).float().mean()))
                seen[fmt] += 1
    assert seen[Format.MXFP8] >= 12 and seen[Format.NVFP4] >= 36
    print(f"NVFP4: CT decode == ours for {100 * sum(stats) / len(stats):.3f}% of elements, others 1 bf16 ulp")
    assert sum(stats) / len(stats) > 0.99


def test_compressed_tensors_parses_full_config(tiny, tmp_path):
    """The package's own (strict, pydantic) config model accepts our emitted quantization_config."""
    from compressed_tensors.quantization import QuantizationConfig

    out = tmp_path / "out"
    assert convert(tiny["qwen3_moe"], out, "--format", "mxfp8+nvfp4-experts", "--target", "compressed-tensors") == 0
    QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_transformers_loads_bf16_parts(tiny, tmp_path, arch):
    """The converted checkpoint's non-quantized tensors have transformers' names and the source's values."""
    import transformers

    out = tmp_path / "out"
    assert convert(tiny[arch], out, "--format", "mxfp8", "--num-layers-at-start-in-bf16", "1") == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny[arch], dtype=torch.bfloat16)
    sd = model.state_dict()
    ck = open_checkpoint(out)
    plan = json.loads((out / "miles_lp_plan.json").read_text())["plan"]["entries"]
    bf16 = {}
    with TensorReader() as r:
        for name, h in ck.tensors.items():
            if name in plan and h.dtype == "BF16" and name in sd:
                bf16[name] = r.read(h)
    missing, unexpected = model.load_state_dict(bf16, strict=False)
    assert not unexpected
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(bf16)
    assert any(".layers.0.self_attn.q_proj" in n for n in bf16)  # layer 0 kept bf16
    for name, t in bf16.items():
        assert torch.equal(model.state_dict()[name], t), name


def test_nvfp4_gate_up_share_global_scale_across_shards(tiny, tmp_path):
    """Put every expert's gate and up in different input shards: they still share one weight_scale_2."""
    src = tmp_path / "split"
    src.mkdir()
    tensors = {}
    for f in sorted(tiny["qwen3_moe"].glob("*.safetensors")):
        tensors.update(load_file(f))
    a = {k: v for k, v in tensors.items() if "up_proj" not in k}
    b = {k: v for k, v in tensors.items() if "up_proj" in k}
    save_file(a, str(src / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(b, str(src / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    wm = {k: "model-00001-of-00002.safetensors" for k in a} | {k: "model-00002-of-00002.safetensors" for k in b}
    (src / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (src / "config.json").write_text((tiny["qwen3_moe"] / "config.json").read_text())
    out = tmp_path / "out"
    assert convert(src, out, "--format", "nvfp4-experts") == 0
    _assert_gate_up_share_one_scale(out, src, tensors)


def test_nvfp4_gate_up_in_one_shard_share_global_scale_without_pre_pass(tiny, tmp_path, monkeypatch):
    """One input shard: every gate/up group is computed inline (no second read), same shared weight_scale_2."""
    from miles_lp.checkpoint import convert as conv

    src = tmp_path / "one"
    src.mkdir()
    tensors = {}
    for f in sorted(tiny["qwen3_moe"].glob("*.safetensors")):
        tensors.update(load_file(f))
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text((tiny["qwen3_moe"] / "config.json").read_text())
    pre_pass: list[str] = []
    real = conv.group_amax

    def spy(s, groups, device, skip=frozenset(), **kw):
        out = real(s, groups, device, skip=skip, **kw)
        pre_pass.extend(out)
        return out

    monkeypatch.setattr(conv, "group_amax", spy)
    out = tmp_path / "out"
    assert convert(src, out, "--format", "nvfp4-experts") == 0
    assert pre_pass == []  # every group was consecutive in the one shard
    _assert_gate_up_share_one_scale(out, src, tensors)


def _assert_gate_up_share_one_scale(out: Path, src: Path, tensors: dict) -> None:
    """Every expert's gate and up carry the same weight_scale_2 = max(amax(gate), amax(up)) / 2688."""
    ck = open_checkpoint(out)
    pairs = 0
    with TensorReader() as r:
        for name in ck.tensors:
            if name.endswith("gate_proj.weight_scale_2"):
                up = name.replace("gate_proj", "up_proj")
                g, u = r.read(ck.tensors[name]), r.read(ck.tensors[up])
                amax = max(tensors[name.replace("weight_scale_2", "weight")].float().abs().max(),
                           tensors[up.replace("weight_scale_2", "weight")].float().abs().max())
                assert torch.equal(g, u) and math.isclose(float(g), float(amax) / 2688, rel_tol=1e-6), name
                pairs += 1
    assert pairs == 4 * 4
    assert verify_checkpoint(out, source=src).ok


def _to_block_fp8(src: Path, dst: Path) -> None:
    """A DeepSeek-style block-FP8 copy of ``src``: every quantizable 2-D linear weight as e4m3 + 128x128
    weight_scale_inv, config with quantization_config fp8."""
    from miles_lp.formats import quantize_fp8_blockwise
    from miles_lp.policy import get_layout

    cfg = json.loads((src / "config.json").read_text())
    layout = get_layout(cfg)
    dst.mkdir()
    wm = {}
    for f in sorted(src.glob("*.safetensors")):
        out = {}
        for name, t in load_file(f).items():
            info = layout.describe(name)
            if t.dim() == 2 and info.engine_module is not None:
                q = quantize_fp8_blockwise(t)
                out[name], out[name + "_scale_inv"] = q.data, q.scale_inv
            else:
                out[name] = t
        save_file(out, str(dst / f.name), metadata={"format": "pt"})
        wm.update({k: f.name for k in out})
    (dst / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(cfg))


def test_deepseek_block_fp8_input(tiny, tmp_path):
    fp8 = tmp_path / "fp8"
    _to_block_fp8(tiny["deepseek_v3"], fp8)
    out = tmp_path / "out"
    assert convert(fp8, out, "--format", "mxfp8+nvfp4-experts", "--num-layers-at-start-in-bf16", "1",
                   "--target", "compressed-tensors") == 0
    names = open_checkpoint(out).tensors
    assert not [n for n in names if n.endswith("weight_scale_inv")]  # the input's block scales are gone
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"  # the input's fp8 config is gone
    # a layer-0 weight that was FP8 in the input is now the bf16 rounding of its decode (--fp8-decode bf16)
    report = verify_checkpoint(out, source=fp8)
    assert report.ok, report.format()


def test_recipe_and_alias(tiny, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("precision:\n  default: mxfp8\n  rules:\n    - {layers: first 1, format: bf16}\n")
    a, b = tmp_path / "a", tmp_path / "b"
    assert convert(tiny["qwen3"], a, "--recipe", str(recipe)) == 0
    assert convert(tiny["qwen3"], b, "--format", "mxfp8", "--extra-high-precision-layers-hf",
                   "model.layers.0.*") == 0
    qa = json.loads((a / "config.json").read_text())["quantization_config"]
    qb = json.loads((b / "config.json").read_text())["quantization_config"]
    assert qa["modules_to_not_convert"] == qb["modules_to_not_convert"]
    assert open_checkpoint(a).tensors.keys() == open_checkpoint(b).tensors.keys()


def test_converters_entry_point(tiny, tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, str(root / "converters" / "convert_hf.py"), "--hf-checkpoint",
                          str(tiny["qwen3"]), "--output", str(tmp_path / "o"), "--format", "mxfp8",
                          "--no-progress"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "o" / "miles_lp_plan.json").exists()


def test_make_tiny_model_cli(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["make-tiny-model", "--arch", "mixtral", "--out", str(out), "--num-layers", "2",
                 "--max-shard-size", "100KB"]) == 0
    assert len(list(out.glob("*.safetensors"))) > 1 and (out / INDEX_NAME).exists()
    assert main(["make-tiny-model", "--arch", "mixtral", "--out", str(out)]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert main(["make-tiny-model", "--arch", "mixtral", "--out", str(out), "--overwrite", "--seed", "3"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
