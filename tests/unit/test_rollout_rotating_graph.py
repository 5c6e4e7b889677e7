"""C3's rotating layer as a replayed graph per layer configuration (``miles_lp.rollout.reference.rotating_graph``).

On CPU the capture is replaced by a recorder that re-runs the captured function on replay (the same ops into
the same output tensor): this checks everything around the graph (the copy into the stand-in, the signature
check, the queued replay, the periodic eager recheck, turning a configuration off), not CUDA graph semantics.
The real graphs run on the H200 (``-m gpu`` at the end of this file)."""

from __future__ import annotations

import pytest
import torch

from miles_lp.rollout.reference import ReferenceEngine, rotating_graph
from miles_lp.rollout.testing import tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = "policies/qwen3-moe-mxfp8-nvfp4-experts.yaml"


class _Recorded:
    def __init__(self, fn, out):
        self.fn, self.out, self.replays = fn, out, 0

    def replay(self):
        self.replays += 1
        self.out.copy_(self.fn())


def _fake_capture(fn, pool):
    out = fn()
    return _Recorded(fn, out), out


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    monkeypatch.setattr(ReferenceEngine, "_graphs_on", lambda self: True)
    monkeypatch.setattr(rotating_graph, "capture", _fake_capture)
    monkeypatch.setattr(rotating_graph, "new_pool", lambda: None)


def _rotating(sc):
    """(name, figures) of the rotating layer; (None, None) at a version that reaches one of the fixed pair."""
    found = [(n, v) for n, v in sc["layers"].items() if v["kind"] == "rotating"]
    assert len(found) <= 1
    return found[0] if found else (None, None)


def _eager_figures(engine, version):
    engine.weight_version = version
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ReferenceEngine, "_graphs_on", lambda self: False)
        name, v = _rotating(engine.self_check(0))
    return name, None if v is None else (v["rel_err"], v["fresh_diff"])


@pytest.mark.parametrize("arch, recipe", [("qwen3_moe", RECIPE), ("qwen3", "policies/qwen3-mxfp8.yaml")])
def test_rotating_replay_equals_eager_for_every_layer(arch, recipe, graphs_on_cpu):
    engine = ReferenceEngine(tiny_checkpoint(arch, recipe), device="cpu")
    n = len(engine._c3_rotation())
    hows = []
    for version in range(1, n + 1):
        name, expect = _eager_figures(engine, version)
        engine.weight_version = version
        sc = engine.self_check(0)
        got_name, v = _rotating(sc)
        assert got_name == name and sc["ok"]
        if v is None:  # a version reaching one of the fixed pair: no rotating layer
            continue
        assert (v["rel_err"], v["fresh_diff"]) == expect
        hows.append(v["graph"])
    configs = len(engine._rot_graph_state.entries)
    assert configs >= 2 and hows.count("eager, graph captured") == configs
    assert hows.count("graph replay") == len(hows) - configs >= n // 2


def test_queued_early_then_dropped_by_an_update(graphs_on_cpu):
    engine = ReferenceEngine(tiny_checkpoint("qwen3_moe", RECIPE), device="cpu")
    for version in (1, 2, 3, 4):  # capture every configuration the first versions reach
        engine.weight_version = version
        engine.self_check(0)
    engine.weight_version = 2
    assert engine.self_check_begin(0)
    _, v = _rotating(engine.self_check(0))
    assert v["graph"] == "graph replay (queued early)"
    assert engine.self_check_begin(0)
    engine.begin_weight_update()  # an update drops the queued replay: it read the previous weights
    engine.finish_weight_update(weight_version=2)
    _, v = _rotating(engine.self_check(0))
    assert v["graph"] == "graph replay"


def test_stale_rotating_layer_is_caught_through_the_replay(graphs_on_cpu):
    engine = ReferenceEngine(tiny_checkpoint("qwen3_moe", RECIPE), device="cpu")
    rot = engine._c3_rotation()
    engine.weight_version = 1
    engine.self_check(0)  # captures the configuration of the layer at version 1
    name, _ = _rotating(engine.self_check(0))
    layer = next(m for m in rot if f"{m.prefix}weight" == name)
    # another layer of the same configuration, reached by a later version: stale derived state there
    twin = next(i for i, m in enumerate(rot) if m is not layer and rotating_graph_cfg(m) == rotating_graph_cfg(layer))
    with torch.no_grad():
        rot[twin].operand.mul_(1.5)
    engine.weight_version = twin
    sc = engine.self_check(0)
    got, v = _rotating(sc)
    assert got == f"{rot[twin].prefix}weight" and v["graph"] == "graph replay"
    assert v["fresh_diff"] > 0 and not sc["ok"]


def rotating_graph_cfg(layer):
    from miles_lp.rollout.reference.c3_layer import fresh_config

    return fresh_config(layer)[1:]


def test_recheck_mismatch_turns_the_configuration_off(graphs_on_cpu, monkeypatch):
    monkeypatch.setattr(rotating_graph, "RECHECK", 2)
    engine = ReferenceEngine(tiny_checkpoint("qwen3", "policies/qwen3-mxfp8.yaml"), device="cpu")
    engine.weight_version = 1
    first = _rotating(engine.self_check(0))[1]
    assert first["graph"] == "eager, graph captured"
    (cfg, ent), = [(c, e) for c, e in engine._rot_graph_state.entries.items()]
    ent.graph.fn = lambda: torch.tensor([0.5, 0.0], dtype=torch.float64)  # a replay that no longer computes C3
    second = _rotating(engine.self_check(0))[1]
    assert second["graph"] == "graph replay" and second["rel_err"] == 0.5  # between rechecks: the replay's
    third = _rotating(engine.self_check(0))[1]
    assert third["graph"].startswith("eager (replay [0.5, 0.0] != eager") and third["rel_err"] == first["rel_err"]
    assert cfg in engine._rot_graph_state.off and cfg not in engine._rot_graph_state.entries
    assert _rotating(engine.self_check(0))[1]["graph"].startswith("eager (replay")


def test_a_graph_that_records_nothing_is_turned_off(graphs_on_cpu, monkeypatch):
    """A capture whose replay does nothing (the ops ran eagerly during the capture, on another device's stream,
    say) leaves the capture-time figures in its output; the first-replay check must not take them for a replay's:
    the output is overwritten before that replay, so the configuration goes off, eager from then."""
    class _Empty:
        def replay(self):
            """Records nothing: the capture ran the ops eagerly (the output holds their capture-time values)."""

    monkeypatch.setattr(rotating_graph, "capture", lambda fn, pool: (_Empty(), fn()))
    engine = ReferenceEngine(tiny_checkpoint("qwen3", "policies/qwen3-mxfp8.yaml"), device="cpu")
    engine.weight_version = 1
    name, v = _rotating(engine.self_check(0))
    assert v["graph"].startswith("eager (first replay [-1.0, -1.0] != eager"), v["graph"]
    state = engine._rot_graph_state
    assert not state.entries and len(state.off) == 1
    layer = next(m for m in engine._c3_rotation() if f"{m.prefix}weight" == name)
    with torch.no_grad():
        layer.operand.mul_(1.5)  # stale: the eager answer sees it
    sc = engine.self_check(0)
    _, v = _rotating(sc)
    assert v["graph"].startswith("eager (first replay") and v["fresh_diff"] > 0 and not sc["ok"]


def test_a_large_configuration_is_answered_eager(graphs_on_cpu, monkeypatch):
    """A configuration whose float64 reference would pin more device memory than the bound stays eager."""
    monkeypatch.setattr(rotating_graph, "MAX_REFERENCE_BYTES", 1)
    engine = ReferenceEngine(tiny_checkpoint("qwen3", "policies/qwen3-mxfp8.yaml"), device="cpu")
    engine.weight_version = 1
    _, v = _rotating(engine.self_check(0))
    assert v["graph"].startswith("eager (not kept as a graph: its float64 reference weight is"), v["graph"]
    assert not engine._rot_graph_state.entries and engine.self_check(0)["ok"]


def test_a_changed_kernel_state_is_answered_eager(graphs_on_cpu):
    engine = ReferenceEngine(tiny_checkpoint("qwen3", "policies/qwen3-mxfp8.yaml"), device="cpu")
    engine.weight_version = 1
    name, _ = _rotating(engine.self_check(0))
    layer = next(m for m in engine._c3_rotation() if f"{m.prefix}weight" == name)
    layer.register_buffer("extra", torch.zeros(1), persistent=False)
    layer._derived.add("extra")
    try:
        _, v = _rotating(engine.self_check(0))
        assert v["graph"] == "eager (the layer's kernel state differs from the kept stand-in's)"
    finally:
        layer._derived.discard("extra")
        delattr(layer, "extra")
    assert _rotating(engine.self_check(0))[1]["graph"] == "graph replay"


def test_every_layer_pass_captures_every_configuration(graphs_on_cpu):
    """A full-compare sync (``self_check_every_layer``) captures one graph per layer configuration, so the
    normal syncs after it only replay (a capture costs a synchronisation and tens of launches)."""
    engine = ReferenceEngine(tiny_checkpoint("qwen3_moe", RECIPE), device="cpu")
    engine.self_check(7)
    engine.self_check_every_layer()
    from miles_lp.rollout.reference.c3_layer import fresh_config

    cfgs = {fresh_config(m)[1:] for m in engine._c3_rotation()}
    state = engine._rot_graph_state
    assert set(state.entries) == cfgs and not state.off
    hows = set()
    for version in range(1, len(engine._c3_rotation()) + 1):
        engine.weight_version = version
        _, v = _rotating(engine.self_check(7))
        if v is not None:
            hows.add(v["graph"])
    assert hows == {"graph replay"}
    for version in range(1, 20):  # a version whose rotating layer is not one of the fixed pair
        engine.weight_version = version
        if _rotating(engine.self_check(7))[1] is not None:
            break
    _, v = _rotating(engine.self_check(8))  # another seed's probe: captured again on it
    assert v["graph"] == "eager, graph captured"


@pytest.mark.gpu
def test_cuda_rotating_graph_equals_eager_and_sees_stale_state():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    engine = ReferenceEngine(tiny_checkpoint("qwen3_moe", RECIPE), device="cuda")
    rot = engine._c3_rotation()
    hows = []
    for version in range(1, len(rot) + 1):
        name, expect = _eager_figures(engine, version)
        engine.weight_version = version
        sc = engine.self_check(0)
        got, v = _rotating(sc)
        assert got == name and sc["ok"], (version, v)
        if v is not None:
            assert (v["rel_err"], v["fresh_diff"]) == expect, (version, v)
            hows.append(v["graph"])
    assert "graph replay" in hows and not any(h.startswith("eager (") for h in hows), hows
    engine.self_check_every_layer()  # every configuration captured: no eager fallback anywhere
    assert not engine._rot_graph_state.off, engine._rot_graph_state.off
    engine.weight_version = len(rot) - 1
    assert engine.self_check_begin(0)
    assert _rotating(engine.self_check(0))[1]["graph"] == "graph replay (queued early)"
    layer = rot[(len(rot) - 1) % len(rot)]
    with torch.no_grad():
        layer.operand.mul_(1.5)
    sc = engine.self_check(0)
    _, v = _rotating(sc)
    assert v["graph"] == "graph replay" and v["fresh_diff"] > 0 and not sc["ok"]


def test_the_rotation_base_shifts_the_rotating_layer():
    """``c3_rotation_base`` (set by the runner to the run's sync count before this engine started) picks the layer a
    straight run's engine would probe at the same step: the one of weight version + base."""
    engine = ReferenceEngine(tiny_checkpoint("qwen3", "policies/qwen3-mxfp8.yaml"), device="cpu")

    def probed(version, base):
        engine.weight_version, engine.c3_rotation_base = version, base
        return _rotating(engine.self_check(0))[0]

    n = len(engine._c3_rotation())
    straight = [probed(v, 0) for v in range(3, 3 + n)]  # a straight run's engine at versions 3, 4, ...
    resumed = [probed(v, 2) for v in range(1, 1 + n)]  # a fresh engine two syncs later in the run
    assert straight == resumed and any(name is not None for name in straight)
    assert [probed(v, 0) for v in range(1, 1 + n)] != resumed  # without the base: other layers
