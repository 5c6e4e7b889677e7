"""Bucketing never splits an atomic group; staging is 0xFF-filled; the C5 ledger; the transports."""

import pytest
import torch

from miles_lp.formats import quantize_mxfp8, quantize_nvfp4_pair
from miles_lp.formats.spec import Format
from miles_lp.sync.buckets import Ledger, ff_count, ff_counts, make_buckets
from miles_lp.sync.items import Item, SyncInputError, engine_items, group_items, group_key
from miles_lp.sync.transport import InProcessTransport, Staging, flatten, make_transport


def _item(name, n, group=None, scale=False):
    t = torch.arange(n, dtype=torch.uint8)
    return Item(name, t, name, Format.BF16, "scale" if scale else None, group or group_key(name))


def test_group_keys_keep_modules_experts_qkv_and_gate_up_together():
    g = group_key
    assert g("model.layers.1.mlp.experts.3.gate_proj.weight") == g("model.layers.1.mlp.experts.0.down_proj."
                                                                  "weight_scale_inv") == "model.layers.1.mlp.experts"
    assert g("model.layers.0.self_attn.q_proj.weight") == g("model.layers.0.self_attn.v_proj.weight_scale_inv")
    assert g("model.layers.0.mlp.gate_proj.weight_scale_2") == g("model.layers.0.mlp.up_proj.weight")
    assert g("model.layers.0.mlp.down_proj.weight") == g("model.layers.0.mlp.down_proj.weight_scale_inv")
    assert g("model.layers.0.mlp.down_proj.weight") != g("model.layers.0.mlp.gate_proj.weight")
    assert g("model.layers.2.block_sparse_moe.experts.1.w1.weight") == "model.layers.2.block_sparse_moe.experts"


def test_buckets_respect_budget_and_never_split_a_group():
    items = [_item(f"a{i}.w", 100, group="A") for i in range(3)] + [_item("b.w", 10, group="B"),
             _item("c.w", 1000, group="C"), _item("d.w", 10, group="D")]
    buckets = make_buckets(group_items(items), bucket_bytes=512)  # aligned: A 3x128, B 64
    assert [b.groups for b in buckets] == [("A", "B"), ("C",), ("D",)]  # C (1000 B) alone: larger than a bucket
    assert [b.last for b in buckets] == [False, False, True]
    assert sum(len(b.slots) for b in buckets) == len(items)
    for b in buckets:
        assert all(s.offset % 64 == 0 for s in b.slots)
    assert make_buckets([], 10) == []
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        make_buckets(group_items(items), 0)


def test_engine_items_encode_the_learner_grid_without_copies():
    w = torch.randn(64, 64)
    q = quantize_mxfp8(w)
    bias = torch.randn(64, dtype=torch.bfloat16)
    items = engine_items([("model.layers.0.mlp.down_proj.weight", q), ("model.norm.weight", bias)], "sglang")
    by = {it.name: it for it in items}
    assert set(by) == {"model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight_scale_inv",
                       "model.norm.weight"}
    assert by["model.layers.0.mlp.down_proj.weight"].tensor.data_ptr() == q.data.data_ptr()
    assert by["model.layers.0.mlp.down_proj.weight_scale_inv"].is_scale
    assert by["model.norm.weight"].tensor.dtype == torch.bfloat16 and by["model.norm.weight"].component is None
    with pytest.raises(SyncInputError, match="wrote engine tensor 'model.norm.weight' twice"):
        engine_items([("model.norm.weight", bias), ("model.norm.weight", bias)], "sglang")
    with pytest.raises(SyncInputError, match="yielded 'x' as list"):
        engine_items([("x", [1])], "sglang")


def test_nvfp4_pair_items_carry_global_scales():
    g, u = quantize_nvfp4_pair(torch.randn(32, 64), torch.randn(32, 64))
    items = engine_items([("m.gate_proj.weight", g), ("m.up_proj.weight", u)], "sglang")
    names = [it.name for it in items]
    assert "m.gate_proj.weight_scale_2" in names and "m.up_proj.input_scale" in names
    assert {it.group for it in items} == {"m.gate_up"}


def test_staging_is_refilled_with_nan_code_every_bucket():
    st = Staging()
    a = st.take(16)
    a.fill_(7)
    b = st.take(8)
    assert b.data_ptr() == a.data_ptr() and bool((b == 0xFF).all())


def test_ff_counts_count_fill_bytes_in_any_dtype_batched():
    u8 = torch.tensor([0xFF, 0x7F, 0], dtype=torch.uint8)
    e4m3 = torch.tensor([0xFF, 0x7F, 0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn)
    unwritten_fp32 = torch.full((2,), 0xFF, dtype=torch.uint8).repeat(4).view(torch.float32)  # 2 NaN floats
    assert ff_counts([u8, e4m3, unwritten_fp32, torch.ones(3)]).tolist() == [1, 2, 8, 0]
    assert ff_count(u8) == 1 and ff_counts([]).numel() == 0


def test_ledger_reports_missing_repeated_unexpected_and_unwritten_scales():
    items = [_item("w", 8), _item("s", 4, scale=True)]
    (b,) = make_buckets(group_items(items), 1 << 20)
    ledger = Ledger(frozenset({"w", "s", "never"}))
    ledger.sent(b)
    got = InProcessTransport().send(b)
    ledger.received(0, got, {"s": True})
    ledger.received(1, [("w", got[0][1]), ("ghost", got[0][1])], {})
    p = ledger.problems()
    assert p["missing"] == ["never"] and p["repeated"] == ["w"] and p["unexpected"] == ["ghost"]
    assert p["unwritten_scale_bytes"] == []
    dup = Ledger(frozenset({"w"}))  # one name twice within one bucket
    dup.received(0, [("w", got[0][1]), ("w", got[0][1])], {})
    assert dup.problems()["repeated"] == ["w"] and dup.writes == {"w": 2}
    # a transport that skipped the scale's bytes leaves the 0xFF fill: detected
    b.payload.pop("s")
    ledger2 = Ledger(frozenset({"w", "s"}))
    ledger2.received(0, InProcessTransport().send(b), {"s": True})
    assert ledger2.problems()["unwritten_scale_bytes"] == ["s"]


def _bucket():
    q = quantize_mxfp8(torch.randn(32, 64))
    items = engine_items([("l.weight", q), ("n.weight", torch.randn(5, dtype=torch.bfloat16)),
                          ("z.weight", torch.tensor(3.5))], "sglang")
    return items, make_buckets(group_items(items), 1 << 20)[0]


def _assert_identical(items, received):
    got = dict(received)
    assert set(got) == {it.name for it in items}
    for it in items:
        assert got[it.name].dtype == it.tensor.dtype and got[it.name].shape == it.tensor.shape
        assert torch.equal(got[it.name].reshape(-1).view(torch.uint8), it.tensor.reshape(-1).view(torch.uint8))


def test_inprocess_and_flatten_deliver_identical_bytes():
    items, b = _bucket()
    _assert_identical(items, InProcessTransport().send(b))
    flat = flatten(b)
    assert flat.numel() == b.nbytes


@pytest.mark.slow  # ~10 s of ray.init on 2 cores
def test_ray_object_store_round_trip():
    ray = pytest.importorskip("ray")
    from miles_lp.errors import BackendUnavailable

    if ray.is_initialized():
        ray.shutdown()
    with pytest.raises(BackendUnavailable, match="ray is not initialized"):
        make_transport("ray")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        items, b = _bucket()
        _assert_identical(items, make_transport("ray").send(b))
    finally:
        ray.shutdown()


def test_gpu_transports_refuse_without_cuda():
    from miles_lp.errors import BackendUnavailable, ConfigError

    if torch.cuda.is_available():
        pytest.skip("CUDA present: covered by the gpu test")
    with pytest.raises(BackendUnavailable, match="cuda_ipc' needs CUDA"):
        make_transport("cuda_ipc")
    with pytest.raises(ConfigError, match="unknown transport 'tcp'"):
        make_transport("tcp")


@pytest.mark.gpu
def test_cuda_ipc_round_trip():
    items, b = _bucket()
    for it in items:
        b.payload[it.name] = it.tensor.cuda()
    got = make_transport("cuda_ipc", "cuda").send(b)
    _assert_identical(items, [(n, t.cpu()) for n, t in got])


def _ipc_child(q_in, q_out):
    from miles_lp.sync.transport import Staging, cuda_ipc_receive

    staging = Staging("cuda")
    index, slots, handle = q_in.get()
    got = cuda_ipc_receive(handle, slots, staging)
    # plain bytes back: a CPU tensor through a torch.multiprocessing queue is shared by file descriptor, which
    # the parent can no longer open once this process has exited (ConnectionResetError on the H200)
    q_out.put({n: (str(t.dtype).removeprefix("torch."), tuple(t.shape),
                   t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()) for n, t in got})


@pytest.mark.gpu
def test_cuda_ipc_between_two_processes():
    import torch.multiprocessing as mp

    items, b = _bucket()
    for it in items:
        b.payload[it.name] = it.tensor.cuda()
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_ipc_child, args=(q_in, q_out))
    child.start()
    tx = make_transport("cuda_ipc", "cuda")
    tx.handles = lambda index, slots, handle: q_in.put((index, slots, handle))
    assert tx.send(b) == []
    raw = q_out.get(timeout=120)  # the sender's buffer stays alive until the child has copied it
    child.join(timeout=60)
    assert child.exitcode == 0
    got = {n: torch.frombuffer(bytearray(b), dtype=torch.uint8).view(getattr(torch, dt)).reshape(shape)
           for n, (dt, shape, b) in raw.items()}
    _assert_identical(items, list(got.items()))
