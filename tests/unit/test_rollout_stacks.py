"""The reference engine's stacked storage (``LinearStack``): every projection's layers and experts are views of
one ``[L, ...]`` tensor; the batched derivation gives exactly the bytes of one pass per layer; updates keep
the storage; C4 stays meaningful with views (a re-bound expert is seen, and then derived from what it serves)."""

from __future__ import annotations

import pytest
import torch

from miles_lp.rollout.reference import EngineFaults, ReferenceEngine
from miles_lp.rollout.testing import tiny_checkpoint
from miles_lp.sync import checks

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = "policies/qwen3-moe-mxfp8-nvfp4-experts.yaml"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _moved(engine: ReferenceEngine, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the engine with fresh random bytes where that keeps it finite (data codes, not scales)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, t in engine.read_weights(list(engine.param_specs())).items():
        if t.dtype == torch.float8_e4m3fn or (t.dtype == torch.uint8 and name.endswith(".weight")):
            codes = torch.randint(0, 0x7E, t.shape, generator=g, dtype=torch.uint8)
            out.append((name, codes.view(t.dtype)))
        else:
            out.append((name, t))
    return out


def test_stacks_are_views_and_the_batched_derivation_equals_one_pass_per_layer():
    engine = ReferenceEngine(tiny_checkpoint("qwen3_moe", RECIPE), device="cpu")
    stacks = engine._stacks
    experts = [st for st in stacks if ".experts." in st.layers[0].prefix]
    # gate/up/down of the 3 NVFP4 layers x 4 experts, and of the last (BF16) layer's 4 experts
    assert sorted((len(st), st.layers[0].disk_format.value) for st in experts) == [(4, "bf16")] * 3 + [(12, "nvfp4")] * 3
    assert any(".self_attn.q_proj." in st.layers[0].prefix for st in stacks)  # dense projections across layers too
    engine.begin_weight_update()
    engine.update_weights(_moved(engine, 0))
    report = engine.finish_weight_update()
    assert report["not_written"] == 0
    for st in stacks:
        for i, layer in enumerate(st.layers):
            for suffix, stack in st.canonical.items():  # canonical: a view of the stack
                assert getattr(layer, suffix).data_ptr() == stack[i].data_ptr()
            fresh = layer.detached_copy()
            fresh.process_weights_after_loading()
            assert set(fresh.derived()) == set(layer.derived()) == set(st.derived)
            for name, t in layer.derived().items():  # derived: a view of the stack, byte-equal to one pass
                assert t.data_ptr() == st.derived[name][i].data_ptr()
                assert torch.equal(_bytes(t), _bytes(fresh.derived()[name])), (layer.prefix, name)
            assert layer.kernel_format is fresh.kernel_format
    sc = engine.self_check()
    assert sc["ok"] and all(v["fresh_diff"] == 0 for v in sc["layers"].values())


def test_updates_keep_the_storage_and_a_rebound_expert_is_seen_and_served_stale():
    ckpt = tiny_checkpoint("qwen3_moe", RECIPE)
    victim = "model.layers.1.mlp.experts.3.down_proj.weight"
    engine = ReferenceEngine(ckpt, device="cpu", faults=EngineFaults(rebind=(victim,)))
    base = engine.storage_pointers()
    assert any(".stack." in n for n in base)  # the stacks themselves are part of the C4 baseline
    healthy = ReferenceEngine(ckpt, device="cpu")
    before = healthy.storage_pointers()
    update = _moved(healthy, 1)
    for e in (healthy, engine):
        e.begin_weight_update()
        e.update_weights(update)
        e.finish_weight_update()
    assert healthy.storage_pointers() == before
    assert checks.storage_identity(before, healthy.storage_pointers()).ok
    v = checks.storage_identity(base, engine.storage_pointers())
    assert v.failed and victim in v.examples
    # the re-bound expert's stack was derived per layer, from what each layer serves: the victim from its
    # stale copy, its neighbours from the update
    layer = engine._owner[victim][2]
    st = next(s for s in engine._stacks if layer in s.layers)
    assert not st.aliased()
    fresh = layer.detached_copy()
    fresh.process_weights_after_loading()
    assert torch.equal(_bytes(layer.operand), _bytes(fresh.operand))
    new = dict(update)[victim]
    assert not torch.equal(_bytes(layer.weight), _bytes(new))  # the update landed where nobody reads
    j = st.layers.index(layer) + 1
    assert torch.equal(_bytes(st.layers[j].operand), _bytes(
        healthy._owner[st.layers[j].prefix + "weight"][2].operand))


def test_an_update_of_whole_stacks_is_a_few_copies(monkeypatch):
    import miles_lp.multitensor.strided as strided

    calls = []
    real = strided.copy_plan
    monkeypatch.setattr(strided, "copy_plan", lambda pairs: calls.append((len(pairs), len(real(pairs)))) or real(pairs))
    engine = ReferenceEngine(tiny_checkpoint("qwen3_moe", RECIPE), device="cpu")
    update = _moved(engine, 2)
    # the update as a bucket delivers it: one staging buffer, slots in export order
    from miles_lp.sync.buckets import make_buckets
    from miles_lp.sync.items import Item
    from miles_lp.sync.transport import InProcessTransport

    items = [Item(n, t, n, None, None, "g") for n, t in update]
    received = InProcessTransport("cpu").send(make_buckets([items], 1 << 30)[0])
    engine.begin_weight_update()
    engine.update_weights(received)
    engine.finish_weight_update()
    (n, copies), = calls
    assert n == len(update) and copies * 4 < n  # whole projections and norms of all layers per strided copy


@pytest.mark.gpu
def test_stacks_on_cuda_derive_the_bytes_of_one_pass_per_layer():
    engine = ReferenceEngine(tiny_checkpoint("qwen3_moe", RECIPE), device="cuda")
    engine.begin_weight_update()
    engine.update_weights([(n, t.cuda()) for n, t in _moved(engine, 3)])
    engine.finish_weight_update()
    for st in engine._stacks:
        for layer in st.layers:
            fresh = layer.detached_copy()
            fresh.process_weights_after_loading()
            for name, t in layer.derived().items():
                assert torch.equal(_bytes(t), _bytes(fresh.derived()[name])), (layer.prefix, name)
    assert engine.self_check()["ok"]


@pytest.mark.gpu
def test_cuda_derivation_through_the_dequantize_kernels_equals_the_torch_codecs(monkeypatch):
    """On CUDA the operands are rebuilt by miles_lp.formats.kernels (layers.dequantize_operand); with
    MILES_LP_KERNELS=reference by the codecs' torch code on the same device: the same bytes, every layer (MXFP8
    dense, NVFP4 experts, stacked and single)."""
    from miles_lp.rollout.layers import engine_linears

    ckpt = tiny_checkpoint("qwen3_moe", RECIPE)
    update = _moved(ReferenceEngine(ckpt, device="cpu"), 7)
    engines = []
    for mode in ("auto", "reference"):
        monkeypatch.setenv("MILES_LP_KERNELS", mode)
        e = ReferenceEngine(ckpt, device="cuda")
        e.begin_weight_update()
        e.update_weights([(n, t.cuda()) for n, t in update])
        e.finish_weight_update()
        engines.append(e)
    pairs = list(zip(engine_linears(engines[0].model), engine_linears(engines[1].model), strict=True))
    assert any(m.kernel_format is not None and m.kernel_format.quantized for (_, m), _ in pairs)
    for (name, a), (_, b) in pairs:
        assert set(a.derived()) == set(b.derived())
        for k, t in a.derived().items():
            assert torch.equal(_bytes(t), _bytes(b.derived()[k])), (name, k)


def test_a_bucket_staged_in_the_same_buffer_replays_its_copy_plan_with_the_same_bytes():
    from miles_lp.sync.buckets import make_buckets
    from miles_lp.sync.items import Item
    from miles_lp.sync.transport import InProcessTransport

    ckpt = tiny_checkpoint("qwen3_moe", RECIPE)
    engine, ref = ReferenceEngine(ckpt, device="cpu"), ReferenceEngine(ckpt, device="cpu")
    tx = InProcessTransport("cpu")
    for seed in (4, 5):  # the second update hits the plan of the first (same staging, names, shapes)
        update = _moved(ref, seed)
        bucket = make_buckets([[Item(n, t, n, None, None, "g") for n, t in update]], 1 << 30)[0]
        for e in (engine, ref):
            e.begin_weight_update()
        engine.update_weights(tx.send(bucket))
        ref.update_weights(update)  # from the update's own tensors: no plan reuse
        for e in (engine, ref):
            e.finish_weight_update()
        assert len(engine._plans) == 1 and len(ref._plans) == 0  # only a bucket in one staging buffer is kept
        got, want = engine.weight_digests(), ref.weight_digests()
        assert got == want
    # another dtype is another signature: never a cached plan, the checks run and refuse it
    engine.begin_weight_update()
    bad = [(n, t.float()) if t.dtype == torch.bfloat16 else (n, t) for n, t in tx.send(bucket)]
    from miles_lp.rollout.engine import WeightUpdateError

    with pytest.raises(WeightUpdateError, match="dtype"):
        engine.update_weights(bad)
    engine.finish_weight_update()
