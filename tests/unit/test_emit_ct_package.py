"""The compressed-tensors config we emit, read by the compressed-tensors package's OWN matcher (the
emitter round trips were checked against our copy of the readers' matching, ``policy/consumers.py``).

For every linear of the model (HF names, as transformers and the package see them), the config group that
``compressed_tensors.utils.match.is_match`` selects (targets, ``re:`` patterns, ``ignore``) must be the plan's
format, and no linear may match two groups. vLLM's own matching is exercised by the readers' tests
(tests/readers, vLLM CPU) on real loads.
"""

from __future__ import annotations

import pytest
import torch

from miles_lp.checkpoint.tiny import tiny_config
from miles_lp.config import Where
from miles_lp.formats.spec import Format
from miles_lp.policy import compile_plan, get_layout, parse_policy
from miles_lp.policy.emit import compressed_tensors_config

match = pytest.importorskip("compressed_tensors.utils.match", reason="compressed-tensors not installed")
_CT_FORMAT = {"mxfp8-quantized": Format.MXFP8, "nvfp4-pack-quantized": Format.NVFP4}

POLICIES = {
    "mxfp8": {"default": "mxfp8"},
    "mxfp8+nvfp4-experts-last-bf16": {"default": "mxfp8", "rules": [
        {"layers": "last 1", "format": "bf16"}, {"role": "routed_experts", "format": "nvfp4"}]},
    "nvfp4-experts-first-bf16": {"default": "bf16", "rules": [
        {"role": "routed_experts", "format": "nvfp4"}, {"layers": "first 1", "format": "bf16"}]},
    "mxfp8-attention-o-bf16": {"default": "mxfp8", "rules": [{"match": "*.self_attn.o_proj", "format": "bf16"}]},
}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v3", "mixtral"])
def test_the_packages_matcher_selects_the_plans_format_for_every_linear(arch, policy):
    layout = get_layout(tiny_config(arch, 4).to_dict())
    plan = compile_plan(parse_policy(POLICIES[policy], Where("<test>", "precision")), layout,
                        require_quantized=False)
    if not plan.quantized():
        pytest.skip("nothing quantized for this architecture")
    cfg = compressed_tensors_config(plan)
    linear, other = torch.nn.Linear(2, 2), torch.nn.Module()
    checked = 0
    for name, entry in plan.entries.items():
        if not name.endswith(".weight") or len(entry.shape) != 2 or not name.startswith("model.layers."):
            continue
        module = name[: -len(".weight")]
        is_lin = module.rsplit(".", 1)[1].endswith(("_proj", "_mqa")) or module.rsplit(".", 1)[1] in ("w1", "w2", "w3")
        mod = linear if is_lin else other
        hits = [g for g, spec in cfg["config_groups"].items()
                if match.is_match(module, mod, spec["targets"], cfg["ignore"])]
        assert len(hits) <= 1, f"{module} matches several config groups {hits}"
        got = _CT_FORMAT[cfg["config_groups"][hits[0]]["format"]] if hits else Format.BF16
        assert got is entry.format, f"{module}: the package reads {got.value}, the plan says {entry.format.value}"
        checked += 1
    assert checked >= 8
