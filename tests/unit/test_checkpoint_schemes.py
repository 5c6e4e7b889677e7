"""`export.schemes`: the reader fields verify compares. ``ct_args`` mirrors how the
compressed-tensors package parses a ``QuantizationArgs`` (defaults, strategy inference); pinned against the package
itself where it is installed, on our emitted schemes and on edits a producer may make."""

from __future__ import annotations

import pytest

from miles_lp.export import schemes as S
from miles_lp.formats.spec import Format
from miles_lp.policy.emit import _ct_scheme


def _variants():
    for fmt in (Format.MXFP8, Format.NVFP4):
        scheme = _ct_scheme(fmt)
        for kind in ("weights", "input_activations"):
            base = scheme[kind]
            yield f"{fmt.value}-{kind}", base
            for drop in ("strategy", "symmetric", "zp_dtype", "scale_dtype", "observer"):
                if drop in base and not (drop == "strategy" and base["strategy"] == "tensor_group"):
                    yield f"{fmt.value}-{kind}-no-{drop}", {k: v for k, v in base.items() if k != drop}
            yield f"{fmt.value}-{kind}-short-dtype", {**base, "scale_dtype": str(base["scale_dtype"]).removeprefix("torch.")}
    yield "tensor-default", {"num_bits": 8, "type": "float"}
    yield "channel", {"num_bits": 8, "type": "float", "group_size": -1, "strategy": None}


@pytest.mark.parametrize("name,args", list(_variants()), ids=[n for n, _ in _variants()])
def test_ct_args_reads_as_the_package_does(name, args):
    qa = pytest.importorskip("compressed_tensors.quantization").QuantizationArgs
    parsed = qa.model_validate(args)

    def value(v):
        v = getattr(v, "value", v)
        return str(v).removeprefix("torch.") if v is not None and not isinstance(v, (bool, int, str)) else v

    package = {"num_bits": parsed.num_bits, "type": value(parsed.type), "strategy": value(parsed.strategy),
               "group_size": parsed.group_size, "block_structure": S._norm(parsed.block_structure),
               "symmetric": parsed.symmetric, "dynamic": value(parsed.dynamic), "scale_dtype": value(parsed.scale_dtype)}
    assert S.ct_args(args) == package


def test_compare_lists_only_fields_both_sides_have_and_that_differ():
    plan = S.Scheme(Format.NVFP4, (S.Param("group_size", 16, "group_size"),
                                   S.Param("hf_quant_config.group_size", 16, "hf_quant_config.json ...")))
    same = S.Scheme(Format.NVFP4, (S.Param("group_size", 16, "group_size"),))
    assert S.compare(same, plan) == []  # hf_quant_config.json absent on disk: SGLang does not read it
    wrong = S.Scheme(Format.NVFP4, (S.Param("group_size", 32, "group_size"),))
    assert S.compare(wrong, plan) == [(wrong.params[0], 16)]


def test_present_or_null_activations_is_a_field_of_its_own():
    scheme = _ct_scheme(Format.NVFP4)
    w4a4 = S.ct_params("g", scheme | {"targets": []}, {"quantization_status": "compressed"})
    w4a16 = S.ct_params("g", scheme | {"targets": [], "input_activations": None}, {"quantization_status": "compressed"})
    diff = S.compare(S.Scheme(Format.NVFP4, w4a16), S.Scheme(Format.NVFP4, w4a4))
    assert [(p.where, p.value, v) for p, v in diff] == [("config_groups.g.input_activations", "(null)", "(set)")]


def test_vllm_mixed_nvfp4_group_size_is_the_top_level_else_the_first_nvfp4_entry():
    layers = {"a.q_proj": {"quant_algo": "MXFP8", "group_size": 32}, "a.experts.0.up_proj": {"quant_algo": "NVFP4",
                                                                                               "group_size": 8}}
    assert S._vllm_mixed_nvfp4_group_size({"quantized_layers": layers})[0] == 8
    assert S._vllm_mixed_nvfp4_group_size({"quantized_layers": layers, "group_size": 16})[0] == 16
    assert S._vllm_mixed_nvfp4_group_size({"quantized_layers": {}})[0] == 16
