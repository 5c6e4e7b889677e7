"""Every shipped recipe compiles to the plan its comment promises (`test_recipes_parse` asserted
nothing). The expectations are written here by hand from each recipe's own description, tensor by tensor,
from the names alone (not from the policy's rule engine), on a model of realistic depth.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from miles_lp.checkpoint.tiny import tiny_config
from miles_lp.formats.spec import Format
from miles_lp.policy import compile_plan, get_layout, load_policy

ROOT = Path(__file__).resolve().parents[2]
LINEAR = re.compile(r"^model\.layers\.(\d+)\..*_proj(_with_mqa)?\.weight$")  # every decoder-layer GEMM weight
BF16, MX, NV, FB = Format.BF16, Format.MXFP8, Format.NVFP4, Format.FP8_BLOCK


def _last(n_layers: int, pct: float) -> int:
    """First layer of "last pct%": ceil(n * pct / 100) layers at the end."""
    return n_layers - math.ceil(n_layers * pct / 100)


def qwen3_mxfp8(name: str, n: int) -> Format:
    """Qwen3 dense: MXFP8 end to end, first layer and last 15% of layers BF16."""
    m = LINEAR.match(name)
    return MX if m and 1 <= int(m[1]) < _last(n, 15) else BF16


def qwen3_moe_mxfp8_nvfp4_experts(name: str, n: int) -> Format:
    m = LINEAR.match(name)
    if not m or int(m[1]) >= _last(n, 15):
        return BF16
    return NV if ".mlp.experts." in name else MX


def qwen3_moe_nvfp4_experts(name: str, n: int) -> Format:
    m = LINEAR.match(name)
    return NV if m and int(m[1]) < _last(n, 15) and ".mlp.experts." in name else BF16


def deepseek_v3_mxfp8(name: str, n: int) -> Format:
    """Last 15% of decoder layers BF16, shared experts BF16, MLA kv_b_proj BF16."""
    m = LINEAR.match(name)
    if not m or int(m[1]) >= _last(n, 15) or ".shared_experts." in name or name.endswith("kv_b_proj.weight"):
        return BF16
    return MX


def tiny_mxfp8(name: str, n: int) -> Format:
    """The tiny RL recipes' learner precision: MXFP8 end to end (their sampler_precision is another section)."""
    return MX if LINEAR.match(name) else BF16


def tiny_nvfp4_experts(name: str, n: int) -> Format:
    m = LINEAR.match(name)
    return (NV if ".mlp.experts." in name else MX) if m else BF16


def qwen3_moe_mxfp8(name: str, n: int) -> Format:
    """Qwen3-30B-A3B MXFP8 end to end, last 15% of layers BF16 (recipes/qwen3-30b-a3b-mxfp8.yaml)."""
    m = LINEAR.match(name)
    return MX if m and int(m[1]) < _last(n, 15) else BF16


def tiny_fp8_block(name: str, n: int) -> Format:
    """FP8 blockwise end to end, learner and sampler (recipes/tiny-fp8-blockwise-e2e.yaml)."""
    return FB if LINEAR.match(name) else BF16


def qwen3_fp8_block(name: str, n: int) -> Format:
    """Qwen3 dense FP8 blockwise, the first and the last decoder layer BF16 (recipes/qwen3-8b-fp8-blockwise.yaml)."""
    m = LINEAR.match(name)
    return FB if m and 1 <= int(m[1]) < n - 1 else BF16


def nvfp4_last_15_bf16(name: str, n: int) -> Format:
    """NVFP4 linears, the last 15% of decoder layers BF16 (recipes/smollm2-nvfp4.yaml)."""
    m = LINEAR.match(name)
    return NV if m and int(m[1]) < _last(n, 15) else BF16


def all_bf16(name: str, n: int) -> Format:
    return BF16


def _config(arch: str, layers: int) -> dict:
    if arch == "deepseek_v3_full":
        return json.loads((ROOT / "tests/fixtures/deepseek_v3_config.json").read_text())
    return tiny_config(arch, layers).to_dict()


# recipe file -> (architecture, decoder layers, expected format, backward mode, NVFP4 activation scale)
RECIPES = {
    "policies/qwen3-mxfp8.yaml": ("qwen3", 36, qwen3_mxfp8, "dequantized", None),
    "policies/qwen3-moe-mxfp8-nvfp4-experts.yaml": ("qwen3_moe", 48, qwen3_moe_mxfp8_nvfp4_experts, "dequantized", "token"),
    "policies/qwen3-moe-nvfp4-experts.yaml": ("qwen3_moe", 48, qwen3_moe_nvfp4_experts, "high_precision", "token"),
    "policies/deepseek-v3-mxfp8.yaml": ("deepseek_v3_full", 61, deepseek_v3_mxfp8, "dequantized", None),
    "tiny-mxfp8.yaml": ("qwen3", 2, tiny_mxfp8, "dequantized", None),
    "tiny-bf16.yaml": ("qwen3", 2, all_bf16, None, None),
    "tiny-bf16-vllm.yaml": ("qwen3", 2, all_bf16, None, None),  # the same learner; vLLM samples
    "tiny-mxfp8-vllm.yaml": ("qwen3", 2, tiny_mxfp8, "dequantized", None),
    "tiny-bf16-sglang.yaml": ("qwen3", 2, all_bf16, None, None),  # the same learner; real SGLang (CPU) samples
    "tiny-mxfp8-sglang.yaml": ("qwen3", 2, tiny_mxfp8, "dequantized", None),
    # SmolLM2-135M-Instruct (Llama, 30 decoder layers)
    "smollm2-bf16.yaml": ("llama", 30, all_bf16, None, None),
    "smollm2-mxfp8.yaml": ("llama", 30, tiny_mxfp8, "dequantized", None),
    "smollm2-mxfp8-bf16-sampler.yaml": ("llama", 30, tiny_mxfp8, "dequantized", None),
    "smollm2-nvfp4.yaml": ("llama", 30, nvfp4_last_15_bf16, "dequantized", "token"),
    "tiny-mxfp8-bf16-sampler-sglang.yaml": ("qwen3", 2, tiny_mxfp8, "dequantized", None),
    "tiny-fp8-blockwise.yaml": ("qwen3", 2, tiny_mxfp8, "dequantized", None),
    "tiny-fp8-tensorwise.yaml": ("qwen3", 2, tiny_mxfp8, "dequantized", None),
    "tiny-fp8-blockwise-e2e.yaml": ("qwen3", 2, tiny_fp8_block, "quantized", None),
    "tiny-fp8-blockwise-e2e-sglang.yaml": ("qwen3_wide", 2, tiny_fp8_block, "quantized", None),  # real SGLang
    "tiny-fp8-blockwise-e2e-vllm.yaml": ("qwen3_wide", 2, tiny_fp8_block, "quantized", None),  # vLLM CPU
    "tiny-mxfp8-bf16-sampler.yaml": ("qwen3", 2, tiny_mxfp8, "dequantized", None),
    "tiny-mxfp8-moe-replay.yaml": ("qwen3_moe", 2, tiny_mxfp8, "dequantized", None),  # routed experts MXFP8 too
    "tiny-nvfp4-experts.yaml": ("qwen3_moe", 2, tiny_nvfp4_experts, "dequantized", "token"),
    "tiny-nvfp4-experts-hp.yaml": ("qwen3_moe", 2, tiny_nvfp4_experts, "high_precision", "token"),
    # the full-scale recipes' parallel shapes at tiny size (recipes/rehearsal-*.yaml)
    "rehearsal-moe-ep2-dp2.yaml": ("qwen3_moe", 2, tiny_mxfp8, "dequantized", None),
    "rehearsal-dense-tp2-dp2.yaml": ("qwen3", 2, tiny_mxfp8, "dequantized", None),
    "rehearsal-deepseek-pp2.yaml": ("deepseek_v3", 4, tiny_mxfp8, "dequantized", None),
    # full-scale RL recipes
    "qwen3-8b-mxfp8.yaml": ("qwen3", 36, tiny_mxfp8, "dequantized", None),  # every decoder linear MXFP8
    "qwen3-8b-fp8-blockwise.yaml": ("qwen3", 36, qwen3_fp8_block, "quantized", None),
    "qwen3-30b-a3b-mxfp8.yaml": ("qwen3_moe", 48, qwen3_moe_mxfp8, "dequantized", None),
    "qwen3-30b-a3b-nvfp4-experts.yaml": ("qwen3_moe", 48, qwen3_moe_mxfp8_nvfp4_experts, "dequantized", "token"),
    "qwen3-30b-a3b-nvfp4-experts-hp.yaml": ("qwen3_moe", 48, qwen3_moe_mxfp8_nvfp4_experts, "high_precision",
                                            "token"),
    "deepseek-v3-mxfp8.yaml": ("deepseek_v3_full", 61, deepseek_v3_mxfp8, "dequantized", None),
}


def test_every_recipe_has_an_expectation():
    names = [p.relative_to(ROOT / "recipes").as_posix() for p in (ROOT / "recipes").rglob("*.yaml")]
    missing = sorted(n for n in names if n not in RECIPES)
    assert not missing, (f"recipes without a stated plan: {missing}; add each to RECIPES in "
                         "tests/unit/test_policy_recipes.py (architecture, layers, expected format per tensor)")


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_compiles_to_its_stated_plan(recipe):
    arch, layers, expected, backward, act = RECIPES[recipe]
    layout = get_layout(_config(arch, layers))
    assert layout.num_layers == layers
    plan = compile_plan(load_policy(ROOT / "recipes" / recipe), layout, require_quantized=False)
    wrong = [f"{n}: plan {e.format.value}, recipe says {expected(n, layers).value}"
             for n, e in plan.entries.items() if e.format is not expected(n, layers)]
    assert not wrong, f"{len(wrong)} tensors differ, e.g.\n" + "\n".join(wrong[:8])
    quantized = [e for e in plan.entries.values() if e.format.quantized]
    assert {e.backward.value for e in quantized} == ({backward} if backward else set())
    assert bool(quantized) == (expected is not all_bf16)
    nv = [e for e in quantized if e.format is NV]
    assert {e.activation_scale for e in nv} == ({act} if nv else set())
