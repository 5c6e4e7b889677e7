"""C3 as a replayed CUDA graph (``ReferenceEngine._c3_values``): the same figures as the eager path bit for bit,
replayed while everything it reads stays where it was captured, and still failing on stale derived state (the
replay reads the live bytes) and after a re-bound parameter (the key moves: eager again). CPU: the eager path
only (no graphs), the reason reported. GPU tests run on the H200 (``-m gpu``)."""

from __future__ import annotations

import pytest
import torch

from miles_lp.rollout.reference import ReferenceEngine
from miles_lp.rollout.testing import tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = "policies/qwen3-moe-mxfp8-nvfp4-experts.yaml"


def _figures(sc):
    """The fixed pair's figures (the graph's); the rotating layer (eager, one per weight version) changes with
    every update and is checked on its own."""
    return [(v["rel_err"], v["fresh_diff"]) for v in sc["layers"].values() if v["kind"] != "rotating"]


def test_dequantize_exact_is_the_codec():
    """The self-check's NVFP4 decode (a kept E2M1 table, capturable) gives the codec's bytes; MXFP8 is the codec."""
    from miles_lp import formats
    from miles_lp.rollout.self_check import dequantize_exact

    g = torch.Generator().manual_seed(3)
    for shape in ((64, 128), (3, 32, 64)):
        x = torch.randn(*shape, generator=g) * torch.logspace(-3, 3, shape[-1])
        for q in (formats.quantize_nvfp4(x, scale_scope="tensor"), formats.quantize_mxfp8(x, axis=-1)):
            for dt in (torch.float64, torch.float32, torch.bfloat16):
                a, b = dequantize_exact(q, dt), q.dequantize(dt)
                assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_cpu_self_check_is_eager():
    engine = ReferenceEngine(tiny_checkpoint("qwen3_moe", RECIPE), device="cpu")
    assert not engine.self_check_begin(0)  # nothing to queue without a graph
    a, b = engine.self_check(0), engine.self_check(0)
    assert a["graph"] == b["graph"] == "eager" and a["ok"] and _figures(a) == _figures(b)


@pytest.mark.gpu
@pytest.mark.parametrize("arch, recipe", [("qwen3_moe", RECIPE), ("qwen3", "policies/qwen3-mxfp8.yaml")])
def test_graph_replay_equals_eager_and_still_sees_stale_state(arch, recipe, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    engine = ReferenceEngine(tiny_checkpoint(arch, recipe), device="cuda")
    first = engine.self_check(0)
    second = engine.self_check(0)
    third = engine.self_check(0)
    assert first["graph"] == "eager, graph captured", first["graph"]
    assert second["graph"] == third["graph"] == "graph replay"
    assert _figures(first) == _figures(second) == _figures(third) and third["ok"]
    # queued early (self_check_begin), collected by self_check: the same figures; a weight update drops it
    assert engine.self_check_begin(0)
    early = engine.self_check(0)
    assert early["graph"] == "graph replay (queued early)" and _figures(early) == _figures(third)
    assert engine.self_check_begin(0)
    engine.begin_weight_update()
    engine.finish_weight_update()
    after = engine.self_check(0)
    assert after["graph"] == "graph replay" and _figures(after) == _figures(third)
    monkeypatch.setenv("MILES_LP_SYNC_GRAPHS", "0")
    eager = engine.self_check(0)
    monkeypatch.delenv("MILES_LP_SYNC_GRAPHS")
    assert eager["graph"] == "eager" and _figures(eager) == _figures(third)
    # stale derived state: the live operand of the checked dense layer no longer matches its canonical bytes
    name = next(n for n, v in third["layers"].items() if v["kind"] == "dense")
    layer = next(m for m in engine._linears if f"{m.prefix}weight" == name)
    keep = layer.operand.clone()
    with torch.no_grad():
        layer.operand.mul_(1.5)
    stale = engine.self_check(0)
    assert stale["graph"] == "graph replay" and not stale["ok"]
    assert stale["layers"][name]["fresh_diff"] > 0
    with torch.no_grad():
        layer.operand.copy_(keep)
    assert engine.self_check(0)["ok"]
    # a re-bound canonical tensor: the graph's key moves, the figures come from the eager path again
    layer.weight = torch.nn.Parameter(layer.weight.detach().clone(), requires_grad=False)
    moved = engine.self_check(0)
    assert moved["graph"] == "eager, graph captured" and moved["ok"]
    assert _figures(moved) == _figures(third)
