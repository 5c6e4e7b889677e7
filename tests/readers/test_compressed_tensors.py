"""The compressed-tensors package (0.20 here) decompresses every format we write, to our codecs' values.

For each config group of a ``--target compressed-tensors`` checkpoint: the package's registered compressor for
the group's ``format`` (``mxfp8-quantized``, ``nvfp4-pack-quantized``; ``mixed-precision`` checkpoints hold
both) decompresses each targeted module's on-disk tensors with the group's scheme, and the weight must equal,
bit for bit, our dequantization (tests/readers/reference.py). MoE experts included: the package reads them
per expert (it is transformers that cannot load them, tests/readers/test_transformers.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.readers.reference import dequantized_state_dict

pytestmark = pytest.mark.reader_compressed_tensors
ct = pytest.importorskip("compressed_tensors")


@pytest.mark.parametrize("arch,fmt", [("qwen3", "mxfp8"), ("qwen3", "nvfp4"),
                                      ("qwen3_moe", "mxfp8+nvfp4-experts")])
def test_package_decompresses_to_our_values(store, arch, fmt):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, QuantizationStatus

    from miles_lp.policy.consumers import ct_is_match

    ck = store.converted(arch, fmt, "compressed-tensors")
    cfg = json.loads((ck / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(cfg)
    assert parsed.quantization_status == QuantizationStatus.COMPRESSED
    disk: dict[str, torch.Tensor] = {}
    for f in ck.glob("*.safetensors"):
        disk.update(load_file(str(f)))
    ours = dequantized_state_dict(ck)
    modules = sorted({n.rsplit(".", 1)[0] for n in disk if n.endswith((".weight_scale", ".weight_packed"))})
    seen_formats = set()
    for m in modules:
        hits = [g for g in cfg["config_groups"].values() if ct_is_match(m, True, g["targets"], cfg["ignore"])]
        assert len(hits) == 1, (m, len(hits))
        group = hits[0]
        scheme = QuantizationScheme.model_validate({k: v for k, v in group.items() if k != "format"})
        sd = {k[len(m) + 1:]: v for k, v in disk.items() if k.rsplit(".", 1)[0] == m}
        out = BaseCompressor.load_from_registry(group["format"]).decompress(sd, scheme)
        w = out["weight"]
        assert w.dtype == torch.bfloat16 and torch.equal(w, ours[m + ".weight"]), f"{m}: decompressed differently"
        seen_formats.add(group["format"])
    want = {"mxfp8": {"mxfp8-quantized"}, "nvfp4": {"nvfp4-pack-quantized"}}.get(
        fmt, {"mxfp8-quantized", "nvfp4-pack-quantized"})
    assert seen_formats == want
    assert cfg["format"] == (want.copy().pop() if len(want) == 1 else "mixed-precision")
