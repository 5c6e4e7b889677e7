"""The vLLM ``fp8`` config of an FP8 blockwise plan: re-read by our mirror of vLLM's skip rule, its refusals, and
(where the vLLM CPU venv exists) by vLLM 0.32's own ``Fp8Config`` and ``is_layer_skipped``."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from miles_lp.checkpoint.tiny import tiny_config
from miles_lp.config import Where
from miles_lp.errors import ConfigError
from miles_lp.policy import compile_plan, consumers, emit, get_layout, parse_policy


def _plan(arch, mapping):
    return compile_plan(parse_policy(mapping, Where("t.yaml", "precision"), comparison_formats=True),
                        get_layout(tiny_config(arch).to_dict()))


POLICY = {"default": "fp8_block", "rules": [{"layers": "first 1", "format": "bf16"},
                                            {"match": "*.o_proj", "format": "bf16"}]}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_vllm_fp8_block_config_reads_back(arch):
    plan = _plan(arch, POLICY)
    cfg = emit.vllm_config(plan)
    assert cfg == {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                   "ignored_layers": cfg["ignored_layers"]}
    mods = emit.engine_modules(plan)
    assert {n for n in mods if not emit.vllm_fp8_is_layer_skipped(n, cfg["ignored_layers"])} == {
        m.name for m in mods.values() if m.format.quantized}
    assert "model.layers.0.self_attn.q_proj" in cfg["ignored_layers"]  # exact shard paths, not a layer prefix


def test_vllm_fp8_block_refuses_mixed_plans():
    with pytest.raises(ConfigError, match=r"vLLM fp8 holds one format \(fp8_block\)"):
        emit.vllm_fp8_block_config(_plan("qwen3", {"default": "fp8_block",
                                                   "rules": [{"role": "mlp", "format": "mxfp8"}]}))


def test_the_skip_mirror_can_disagree():
    """A layer-prefix entry (SGLang's style) skips nothing under vLLM's exact rule: the mirror says so."""
    assert not emit.vllm_fp8_is_layer_skipped("model.layers.0.self_attn.o_proj", ["model.layers.0."])
    assert emit.vllm_fp8_is_layer_skipped("model.layers.0.self_attn.o_proj", ["model.layers.0.self_attn.o_proj"])


_READER = r"""
import json, sys
from vllm.model_executor.layers.quantization.fp8 import Fp8Config
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
cfg, names, packed = json.loads(sys.stdin.read())
c = Fp8Config.from_config(cfg)
out = {n: not is_layer_skipped(n, c.ignored_layers, packed, match_mode=c.ignored_layers_match_mode) for n in names}
print("JSON" + json.dumps([out, c.weight_block_size, c.is_checkpoint_fp8_serialized]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_vllm_reads_the_config_itself(arch):
    from miles_lp.rollout.vllm import vllm_missing, vllm_python

    py = vllm_python() or ""
    if not (py and os.access(py, os.X_OK)):
        pytest.skip(f"vLLM CPU reader not installed: {vllm_missing()}")
    plan = _plan(arch, POLICY)
    cfg = emit.vllm_config(plan)
    mods = emit.engine_modules(plan)
    payload = json.dumps([cfg, sorted(mods), {k: list(v) for k, v in consumers.PACKED_MODULES.items()}])
    p = subprocess.run([py, "-c", _READER], input=payload, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got, block, serialized = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("JSON"))[4:])
    assert block == [128, 128] and serialized
    assert got == {n: m.format.quantized for n, m in mods.items()}
