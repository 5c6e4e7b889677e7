"""The Triton kernels equal the reference codecs byte for byte: Triton's interpreter on CPU tensors.

The same comparison (``miles_lp.formats.kernels.selfcheck``) runs compiled on CUDA in
``test_formats_kernels_gpu.py`` (``pytest -m gpu`` on the H200). Here a handful of inputs that exercise
every special path (NaN/inf, subnormals, inf beside huge values, odd shapes and swizzle padding, fp16, an
expert stack) run in the default suite, plus the element encoders on every E4M3 value / midpoint / edge;
every small input runs under ``-m slow``. The interpreter runs in a subprocess (it must be on before
Triton is first imported).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from miles_lp.errors import BackendUnavailable, FormatError  # noqa: E402
from miles_lp.formats import kernels  # noqa: E402
from miles_lp.formats.kernels import selfcheck  # noqa: E402

_ROOT = Path(__file__).resolve().parents[2]  # the checkout these tests belong to

FAST_CASES = ("nan_inf(64,128)", "subnormal(32,64)", "odd_rows(33,96)", "experts_fp16(2,32,64)",
              "specials_bf16(32,64)")


def _selfcheck(*args: str) -> tuple[list[dict], dict, int]:
    """Run the selfcheck in a fresh interpreter-mode process (Triton must be imported with
    TRITON_INTERPRET=1 for its own library functions to be interpreted). Returns (rows, encoders, rc)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "miles_lp.formats.kernels.selfcheck", "--device", "cpu", *args],
                          capture_output=True, text=True, env=env, timeout=1800)  # small cases: ~3 min idle, >10 loaded
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    rows = [r for r in lines if "case" in r]
    enc = next((r for r in lines if "encoders_checked" in r), {})
    assert rows or enc, proc.stderr[-3000:]
    return rows, enc, proc.returncode


def _assert_clean(rows, enc, rc):
    bad = [r for r in rows if r["mismatches"]]
    assert not bad, "\n".join(f"{r['format']} / {r['case']}: {r['mismatches']} of {r['bytes_compared']}" for r in bad)
    assert enc.get("encoder_mismatch_count") == 0, enc
    assert rc == 0


def test_every_kernel_on_special_inputs_and_the_encoders_on_edge_values():
    rows, enc, rc = _selfcheck("--cases", ";".join(FAST_CASES))
    _assert_clean(rows, enc, rc)
    assert {r["case"] for r in rows} == set(FAST_CASES)
    assert {r["format"] for r in rows} == {name for name, _, _ in selfcheck.kernel_pairs()}
    assert enc["encoders_checked"] > 1000


@pytest.mark.slow
def test_every_kernel_on_every_small_input():
    _assert_clean(*_selfcheck("--cases", "small"))


def test_the_comparison_sees_one_flipped_byte():
    """Fault injection: each kernel's first output with one byte flipped is one mismatch in every row."""
    rows, _, rc = _selfcheck("--cases", "zeros(64,64)", "--inject-fault", "--no-encoders", "--kernels",
                             "mxfp8 row+col+deq+swizzle;nvfp4 row (one pass) +deq;nvfp4 dequant tensor bf16")
    assert len(rows) == 3 and all(r["mismatches"] == 1 for r in rows), rows
    assert rc == 1


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_refusals_name_the_tensor_and_rule(interpret):
    with pytest.raises(FormatError, match=r"'w'.*not a multiple of the block of 32"):
        kernels.mxfp8_quantize(torch.randn(40, 64), colwise=True, name="w")
    with pytest.raises(FormatError, match="dtype torch.int32"):
        kernels.nvfp4_quantize(torch.zeros(16, 16, dtype=torch.int32))
    with pytest.raises(BackendUnavailable, match="float32 or bfloat16"):
        kernels.mxfp8_quantize(torch.randn(32, 32), dequant_dtype=torch.float16)


def test_cpu_tensor_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailable, match="run on CUDA tensors.*reference codecs.*TRITON_INTERPRET=1"):
        kernels.mxfp8_quantize(torch.randn(32, 32))
    assert not kernels.enabled(torch.randn(32, 32))  # the codecs keep their CPU path


def test_missing_triton_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(kernels.runtime, "_TRITON", [])
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(BackendUnavailable, match="Triton is not importable.*pip install triton"):
        kernels.nvfp4_quantize(torch.randn(16, 16))


def test_cached_launcher_key_separates_every_triton_specialization():
    """kernels.runtime.launch reuses a compiled kernel for a key; two arguments Triton would compile differently
    (dtype, 16-byte pointer alignment, an int of 1, a multiple of 16, 64-bit) must never share one."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    a = torch.zeros(64, dtype=torch.uint8)
    pool = [a, a[1:], a[16:], a.view(torch.int8), torch.zeros(0, dtype=torch.uint8), torch.zeros(4),
            1, 2, 7, 16, 48, 40, 2**31 - 16, 2**31, -16, True, False]
    triton_spec = [native_specialize_impl(BaseBackend, v, False, True, True) for v in pool]
    ours = [kernels.runtime.spec_key((v,)) for v in pool]
    for i in range(len(pool)):
        for j in range(len(pool)):
            if triton_spec[i] != triton_spec[j]:
                assert ours[i] != ours[j], (pool[i], pool[j])
    assert kernels.runtime.spec_key((a, 7)) == kernels.runtime.spec_key((a[16:], 9))  # same specialization: one launcher


def test_a_launch_hook_sends_launches_through_the_jit():
    """A profiler's Triton launch hook must see every launch: the cached path is then off."""
    from triton import knobs

    assert not kernels.launch_hooks_set()
    chain = knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip("this Triton keeps launch hooks as plain attributes")
    hook = lambda *a: None  # noqa: E731
    chain.add(hook)
    try:
        assert kernels.launch_hooks_set()
    finally:
        chain.remove(hook)
    assert not kernels.launch_hooks_set()


_LAUNCH_NAMES = """
import json, torch
from miles_lp.formats import kernels
names = []
real = kernels.runtime.launch
kernels.runtime.launch = lambda mod, name, *a, **k: (names.append(name), real(mod, name, *a, **k))
x = torch.randn(4, 34, 64).bfloat16()
out = []
for t, dq in [(x[0], None), (x[0], torch.bfloat16), (x[0].float(), None), (x[0], torch.float32),
              (x.flatten()[1:1 + 32 * 64].view(32, 64), None), ("off", None)]:
    if isinstance(t, str):
        kernels.CONFIG["nvfp4_pairs"]["enabled"] = False
        t = x[0]
    names.clear()
    kernels.nvfp4_quantize(t, "row", dequant_dtype=dq)
    out.append(list(names))
print(json.dumps(out))
"""


def test_bf16_rows_take_the_pairs_kernel_and_others_the_general_one():
    """Per-token NVFP4: bf16 (no decode / bf16 decode) reads int32 pairs; fp32 input, an fp32 decode, a
    2-byte-offset view or the switch off take nvfp4_quantize_rows_kernel. Both paths' bytes are compared with
    the reference in the selfcheck rows above ("nvfp4 row pairs*", "nvfp4 row (one pass)")."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", _LAUNCH_NAMES], cwd=_ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pairs, general = ["nvfp4_rows_pairs_kernel"], ["nvfp4_quantize_rows_kernel"]
    assert json.loads(proc.stdout.splitlines()[-1]) == [pairs, pairs, general, general, general, general]


def test_plan_caches_are_bounded(monkeypatch):
    """Per-shape plans (and their launcher lookups) are dropped when the cache is full: micro-batch token
    counts vary, so an unbounded cache would grow for the whole run."""
    monkeypatch.setattr(kernels.runtime, "MAX_PLANS", 3)
    monkeypatch.setattr(kernels.runtime, "PLANS", {i: None for i in range(4)})
    monkeypatch.setattr(kernels.runtime, "SITES", {i: None for i in range(4)})
    key = kernels.runtime.plan_key(torch.zeros(2, 32), "mx")
    assert kernels.runtime.PLANS == {} and kernels.runtime.SITES == {}
    assert key[0] == torch.Size([2, 32]) and key[-1] == "mx"


_PERSIST_NAMES = """
import json, torch
from miles_lp.formats import kernels
names = []
real = kernels.runtime.launch
kernels.runtime.launch = lambda mod, name, *a, **k: (names.append((name, a[0])), real(mod, name, *a, **k))
x = torch.randn(33, 64).bfloat16()
out = []
for cfg, dq in [({}, None), ({"pps": 2}, None), ({"pps_dq": 1}, torch.bfloat16), ({"pps": 2}, torch.bfloat16)]:
    per = kernels.CONFIG["nvfp4_persist"]
    old = dict(per)
    per.update(cfg)
    names.clear()
    kernels.nvfp4_quantize(x, "row", dequant_dtype=dq)
    per.clear(); per.update(old)
    out.append([[n, list(g)] for n, g in names])
print(json.dumps(out))
"""


def test_persistent_grid_is_taken_only_when_configured():
    """CONFIG["nvfp4_persist"]["pps"] (quantize) / "pps_dq" (qdq) > 0 sends bf16 per-token rows to
    nvfp4_rows_persist_kernel on min(rows, 4 "SMs" x pps) programs (the interpreter's count); 0 keeps the
    one-row-per-program kernel. Its bytes: the "nvfp4 row persist *" selfcheck rows above."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", _PERSIST_NAMES], cwd=_ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pairs, persist = "nvfp4_rows_pairs_kernel", "nvfp4_rows_persist_kernel"
    assert json.loads(proc.stdout.splitlines()[-1]) == [
        [[pairs, [33, 1]]], [[persist, [8]]], [[persist, [4]]], [[pairs, [33, 1]]]]


def test_unmasked_forms_and_register_caps_only_where_they_apply(interpret):
    """FULL (no load / store masks) only where the tiles cover x exactly; the MXFP8 register cap only for the
    forms without decode outputs (those hold ~255 registers: a cap would spill). Both forms' bytes: the
    selfcheck rows ("... FULL=0" beside the defaults; odd shapes take the masked form by themselves)."""
    cfg = {"BMB": 1, "NB": 8, "num_warps": 2, "STV": 16, "maxnreg": 168, "FULL": 1}

    def mx(shape, dq=None, **over):
        return kernels.mxfp8._mxfp8_plan(torch.randn(*shape), True, True, dq, ("row", "col"), False, None, {**cfg, **over})

    assert mx((64, 512))["consts"]["FULL"] == 1 and mx((64, 512))["maxnreg"] == 168
    assert mx((64, 96))["consts"]["FULL"] == 0  # K not a multiple of the 256-column tile
    assert mx((64, 512), FULL=0)["consts"]["FULL"] == 0
    assert mx((64, 512), torch.bfloat16)["maxnreg"] == 0
    swz = kernels.mxfp8._mxfp8_plan(torch.randn(64, 512), True, True, None, ("row", "col"), True, None, cfg)
    assert (swz["maxnreg"], swz["consts"]["STV"], swz["consts"]["FULL"]) == (0, 0, 0)  # the 12-01c launch
    assert kernels.mxfp8._mxfp8_plan(torch.randn(48, 256), True, False, None, ("row",), False, None, cfg)["consts"]["FULL"] == 0

    def nv(shape, dq=None):
        return kernels.nvfp4._nvfp4_plan(torch.randn(*shape).bfloat16(), "row", False, False, dq)

    assert nv((4, 256))["path"] == "pairs" and nv((4, 256))["consts"]["FULL"] == 1  # K = 16 * next_pow2(K/16)
    assert nv((4, 96))["consts"]["FULL"] == 0  # 6 blocks in an 8-block tile: masked
    assert nv((4, 256), torch.bfloat16)["consts"]["FULL"] == 1
    pairs = kernels.CONFIG["nvfp4_pairs"]
    old = dict(pairs)
    pairs["RS"] = 2
    try:
        assert nv((4, 256))["consts"]["FULL"] == 0  # two rows per program: the second may not exist
    finally:
        pairs.clear()
        pairs.update(old)


_ZERO_POOL = """
import json, torch
from miles_lp.formats import kernels, quantize_nvfp4
kernels.nvfp4._POOL_INTS = 48  # tiny: the pool is replaced after 48 ints, slices up to 3 ints
x = torch.randn(3, 16, 32).bfloat16()
got = []
for i in range(20):  # 60 ints from pools of 48: one replacement (call 17); every call starts from zeros
    t = x * (i + 1)
    q, _ = kernels.nvfp4_quantize(t, "tensor")
    ref = quantize_nvfp4(t)
    got.append(bool(torch.equal(q.amax, ref.amax) and torch.equal(q.data, ref.data) and torch.equal(q.scale.view(torch.uint8), ref.scale.view(torch.uint8))))
amaxes = [kernels.nvfp4_quantize(x * (i + 1), "tensor")[0].amax for i in range(3)]
distinct = len({a.data_ptr() for a in amaxes}) == 3 and all(float(a.max()) > 0 for a in amaxes)
big = kernels.nvfp4._zeros_i32(4, torch.device("cpu"))  # over the slice bound: its own zeros
offsets = [ent[1] for ent in kernels.nvfp4._ZERO_POOLS.values()]
print(json.dumps({"ok": got, "distinct": distinct, "big": big.tolist(), "offsets": offsets}))
"""


def test_per_matrix_amax_starts_from_fresh_zeros_from_the_pool():
    """The per-tensor amax's atomic-max accumulator comes from a zeroed pool (no torch.zeros per call): every
    call's slice is fresh (results equal the reference over repeated calls and a pool replacement), the
    returned amax tensors never share memory, a slice over the bound gets its own zeros."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", _ZERO_POOL], cwd=_ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["ok"] == [True] * 20 and out["distinct"] and out["big"] == [0, 0, 0, 0]
    assert out["offsets"] == [23 * 3 - 48]  # 23 calls of 3 ints: the second pool holds the last 7 (the pool is used)


def test_zero_pool_slices_are_disjoint_across_threads(monkeypatch):
    """Two threads taking amax accumulators on one stream get disjoint slices (the offset bump is
    under a lock; a shared slice would give two tensors the larger amax). The switch interval is made tiny so
    that the threads interleave inside the bump if they can."""
    import threading

    from miles_lp.formats import kernels

    monkeypatch.setattr(kernels.nvfp4, "_POOL_INTS", 1 << 12)
    monkeypatch.setattr(kernels.nvfp4, "_ZERO_POOLS", {})
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    got: list[list[tuple[int, int]]] = [[], []]
    held: list[torch.Tensor] = []  # the slices stay alive: a freed pool's address could be reused

    def take(out):
        for _ in range(3000):
            t = kernels.nvfp4._zeros_i32(2, torch.device("cpu"))
            held.append(t)
            out.append((t.untyped_storage().data_ptr(), t.storage_offset()))

    try:
        threads = [threading.Thread(target=take, args=(o,)) for o in got]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(old)
    both = got[0] + got[1]
    assert len(both) == 6000 and len(set(both)) == 6000  # no slice handed out twice (pools are replaced, not reused)


def test_decode_only_launch_needs_a_decode(interpret):
    with pytest.raises(BackendUnavailable, match=r"store_q=False.*give dequant_dtype"):
        kernels.mxfp8_quantize(torch.randn(32, 64), store_q=False)
    with pytest.raises(BackendUnavailable, match=r"store_q=False.*an asked-for grid"):
        kernels.mxfp8_quantize(torch.randn(32, 64), dequant_dtype=torch.bfloat16, dequant=("col",), store_q=False)


def test_the_bf16x2_amax_tree_is_chosen_only_where_ptx_has_it(monkeypatch):
    """ENC 1's max.xorsign.abs.bf16x2 needs sm_86+: an A100 (sm_80) gets the ENC 0 form (same bytes)."""
    import torch

    from miles_lp.formats import kernels

    for cap, ok in (((8, 0), False), ((8, 6), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None, cap=cap: cap)
        assert kernels.nvfp4._has_bf16x2_max(torch.device("cuda", 0)) is ok
    assert kernels.nvfp4._has_bf16x2_max(torch.device("cpu"))
