"""The invariant that ties conversion to live sync (must show): for the same weights, ``miles-lp
convert`` and the embedded learner's export give identical tensors (bytes), names and configs, per target;
and an export after optimizer steps is the codec of the new master weights, byte for byte."""

from __future__ import annotations

import json
import re

import pytest
import torch

from miles_lp import formats
from miles_lp.checkpoint.convert import convert_checkpoint
from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.cli import main
from miles_lp.cli.convert import policy_for_format
from miles_lp.cli.export import learner_from_hf
from miles_lp.config import Where
from miles_lp.errors import CheckpointError, ConfigError
from miles_lp.export import naming
from miles_lp.export.writer import PLAN_FILE, export_learner
from miles_lp.io.safetensors_io import open_checkpoint, read_tensor
from miles_lp.policy import parse_policy
from miles_lp.train.config import TrainConfig
from miles_lp.train.embedded import EmbeddedTrainer, plan_for_model

TARGETS = ("sglang", "vllm", "compressed-tensors")
DENSE_NVFP4 = {"default": "nvfp4", "backward": "high_precision"}  # gate+up share one global scale


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = make_tiny_model(arch, tmp_path_factory.mktemp(arch), num_layers=2)
        return cache[arch]
    return get


def read_all(d):
    return {n: read_tensor(h) for n, h in open_checkpoint(d).tensors.items()}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def assert_same_checkpoint(a, b):
    ta, tb = read_all(a), read_all(b)
    assert ta.keys() == tb.keys()
    diff = [n for n in ta if not same_bytes(ta[n], tb[n])]
    assert not diff, diff[:5]
    files = {p.name for p in a.iterdir()} - {PLAN_FILE}
    for f in sorted(files):
        if f.endswith(".json") and not f.endswith("index.json"):
            assert json.loads((a / f).read_text()) == json.loads((b / f).read_text()), f
    ra, rb = json.loads((a / PLAN_FILE).read_text()), json.loads((b / PLAN_FILE).read_text())
    assert ra["plan_hash"] == rb["plan_hash"] and ra["plan"] == rb["plan"] and ra["target"] == rb["target"]
    assert ra["source"]["files"] == rb["source"]["files"] and ra["source"]["shapes"] == rb["source"]["shapes"]
    return ta


CASES = [(arch, "mxfp8+nvfp4-experts") for arch in ("qwen3_moe", "qwen2_moe", "deepseek_v3")] + [
    ("qwen3", "mxfp8"), ("qwen3", "dense-nvfp4")]


def policy_of(fmt):
    if fmt == "dense-nvfp4":
        return parse_policy(DENSE_NVFP4, Where("<test>", "precision"))
    return policy_for_format(fmt)


@pytest.mark.parametrize("arch,fmt", CASES)
def test_convert_equals_learner_export(tiny, tmp_path, arch, fmt):
    d = tiny(arch)
    learner = learner_from_hf(d, policy_of(fmt))
    for target in TARGETS:
        conv, exp = tmp_path / f"convert-{target}", tmp_path / f"export-{target}"
        try:
            convert_checkpoint(d, conv, policy_of(fmt), target=target, progress=False, log=lambda s: None)
        except ConfigError as exc:  # a target that cannot express the plan: export refuses it the same way
            with pytest.raises(ConfigError, match=re.escape(str(exc))):
                export_learner(learner, exp, target=target, base=d, log=lambda s: None)
            assert not exp.exists()
            continue
        export_learner(learner, exp, target=target, base=d, log=lambda s: None)
        tensors = assert_same_checkpoint(conv, exp)
        qnames = [n for n, e in learner.plan.quantized().items()]
        assert qnames and all(any(k.startswith(naming.module_prefix(n)) for k in tensors) for n in qnames)
        assert len(tensors) > len(open_checkpoint(d).tensors)  # scales were written


def test_export_after_steps_is_the_codec_of_the_new_master(tiny, tmp_path):
    d = tiny("qwen3_moe")
    pol = policy_for_format("mxfp8+nvfp4-experts")
    learner = EmbeddedTrainer(d, plan_for_model(pol, d), TrainConfig(device="cpu", lr=1e-2))  # fp32 master
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        assert learner.train_step([{"tokens": torch.randint(0, 256, (n,), generator=g)} for n in (40, 33)])["finite"]
    out = tmp_path / "after"
    summary = export_learner(learner, out, target="sglang", base=d, log=lambda s: None)
    assert summary.step == 2 and json.loads((out / PLAN_FILE).read_text())["learner"]["step"] == 2
    disk = read_all(out)
    sd = {k: v.detach() for k, v in learner.model.state_dict().items()}
    plan, checked = learner.plan, 0
    for layer in (0, 1):
        o = f"model.layers.{layer}.self_attn.o_proj.weight"
        want = naming.encode("sglang", formats.Format.MXFP8, o, formats.quantize_mxfp8(sd[o]))
        gu = sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        for e in range(gu.shape[0]):
            pair = formats.quantize_nvfp4_pair(gu[e, :64], gu[e, 64:])
            for proj, q in zip(("gate_proj", "up_proj"), pair, strict=True):
                want |= naming.encode("sglang", formats.Format.NVFP4,
                                      f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight", q)
        for name, t in want.items():
            assert same_bytes(disk[name], t), name
            checked += 1
    n = "model.layers.0.post_attention_layernorm.weight"
    assert same_bytes(disk[n], sd[n].to(torch.bfloat16))
    # and it is not the untrained checkpoint's grid any more
    conv = tmp_path / "conv"
    convert_checkpoint(d, conv, pol, progress=False, log=lambda s: None)
    before = read_all(conv)
    moved = [k for k in want if k.endswith(".weight") and not same_bytes(before[k], disk[k])]
    assert len(moved) == sum(k.endswith(".weight") for k in want) and len(plan.quantized()) > 0


def test_cli_export_equals_cli_convert_and_verifies(tiny, tmp_path, capsys):
    from miles_lp.checkpoint.verify import verify_checkpoint

    d = tiny("qwen3_moe")
    conv, exp = tmp_path / "c", tmp_path / "e"
    flags = ["--hf-checkpoint", str(d), "--format", "mxfp8+nvfp4-experts", "--target", "sglang"]
    assert main(["convert", *flags, "--output", str(conv), "--no-progress"]) == 0
    assert main(["export", *flags, "--output", str(exp)]) == 0
    assert "exported:" in capsys.readouterr().out
    assert_same_checkpoint(conv, exp)
    report = verify_checkpoint(exp, source=d)
    assert report.ok, report


def test_export_refusals(tiny, tmp_path, capsys):
    d = tiny("qwen3")
    learner = learner_from_hf(d, policy_for_format("mxfp8"))
    with pytest.raises(ConfigError, match="unknown --target"):
        export_learner(learner, tmp_path / "x", target="tensorrt", base=d)
    class Bf16:  # compile_plan refuses an all-BF16 policy; a Learner may still run without a plan
        plan, step = None, 0
    with pytest.raises(ConfigError, match="quantizes no tensor"):
        export_learner(Bf16(), tmp_path / "x", base=d)

    class Partial:  # a learner whose export drops a tensor: nothing written (C5)
        plan, step = learner.plan, 0

        def export_weights(self):
            return ((n, t) for n, t in learner.export_weights() if n != "model.norm.weight")
    with pytest.raises(CheckpointError, match=r"1 planned tensor\(s\) not exported.*model.norm.weight"):
        export_learner(Partial(), tmp_path / "x", base=d, log=lambda s: None)
    assert not (tmp_path / "x").exists()
    assert main(["export", "--hf-checkpoint", str(d), "--format", "mxfp8", "--output", str(d), "--overwrite"]) == 2
    assert "is the input folder" in capsys.readouterr().err


def test_convert_with_the_learners_plan_object(tiny, tmp_path):
    """convert takes the compiled plan object as it is (no re-derivation): the learner's own plan gives the
    learner's export; a plan compiled for another model is refused before anything is written."""
    from miles_lp.checkpoint.convert import convert_with_plan

    d = tiny("qwen2_moe")
    learner = learner_from_hf(d, policy_for_format("mxfp8+nvfp4-experts"))
    convert_with_plan(d, tmp_path / "c", learner.plan, target="sglang", progress=False, log=lambda s: None)
    export_learner(learner, tmp_path / "e", target="sglang", base=d, log=lambda s: None)
    assert_same_checkpoint(tmp_path / "c", tmp_path / "e")
    other = learner_from_hf(tiny("qwen3"), policy_for_format("mxfp8")).plan
    with pytest.raises(ConfigError, match="plan was not compiled for"):
        convert_with_plan(d, tmp_path / "x", other, progress=False, log=lambda s: None)
    assert not (tmp_path / "x").exists()


def test_block_fp8_source_is_refused_with_a_pointer_to_convert(tiny, tmp_path, capsys):
    from tests.e2e.test_convert import _to_block_fp8

    fp8 = tmp_path / "fp8"
    _to_block_fp8(tiny("deepseek_v3"), fp8)
    rc = main(["export", "--hf-checkpoint", str(fp8), "--format", "mxfp8", "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "holds block-FP8 weights" in err and "miles-lp convert" in err
    assert not (tmp_path / "o").exists()
