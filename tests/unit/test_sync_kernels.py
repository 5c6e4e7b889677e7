"""The C2 fingerprint kernel (miles_lp.multitensor.kernels) equals the torch reference
(miles_lp.multitensor.digest) bit for bit (miles_lp.sync.kernel_selfcheck): on CPU through Triton's interpreter (a
subprocess: it must be on before Triton is first imported), on CUDA compiled (``pytest -m gpu``, the H200 script).
Fresh random inputs every run (the seed is in the failure)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from miles_lp.multitensor import digest, kernels  # noqa: E402

_BOTH_PATHS = r"""
import json, os, torch
from miles_lp.multitensor import digest, kernels
g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
pool = torch.randint(0, 256, (300000,), dtype=torch.uint8, generator=g)
named = {"a": pool[5:5 + 70001], "b": torch.randn(40, 300, generator=g), "c": pool[64:64 + 4096 * 9],
         "d": torch.randn(7, generator=g).to(torch.bfloat16), "e": pool[:0]}
groups = {"g1": [named["a"], named["b"]], "g2": [named["c"], named["d"], named["e"]], "g3": [named["b"]]}
assert kernels.enabled(torch.device("cpu"))
k = (digest.fingerprints(named), digest.group_fingerprints(groups))
os.environ["MILES_LP_SYNC_KERNELS"] = "reference"
assert not kernels.enabled(torch.device("cpu"))
r = (digest.fingerprints(named), digest.group_fingerprints(groups))
print(json.dumps({"kernel": k, "reference": r}))
"""


_FUSED = r"""
import json, torch
from miles_lp.multitensor import digest
from miles_lp.sync import SyncCheckError
from miles_lp.sync.faults import RegridEngine
from miles_lp.sync.weight_sync import WeightSync
from tests.unit.test_sync_digest_groups import GroupEngine
from tests.unit.test_sync_weight_sync import DOWN, Learner, _sync
seen = []
orig = WeightSync._grid_groups
def spy(self, items, expected, groups=None, mine=None, *rest):
    by_name = {it.name: it.tensor for it in items}
    indep = digest.group_fingerprints({g: [by_name[n] for n in ns] for g, ns in (groups or {}).items()})
    got = digest.group_strings(list(groups), *mine) if isinstance(mine, tuple) else mine
    seen.append((mine is not None, got == indep))
    return orig(self, items, expected, groups, mine, *rest)
WeightSync._grid_groups = spy
engine, ws, _ = _sync(GroupEngine(), c2_learner_side="fused")  # opt-in (sync.c2_learner_side: fused)
learner = Learner()
ws.initial_sync(learner)
r = ws.sync(learner)
healthy = (r.ok, ws.fused_digest)
_, ws2, _ = _sync(RegridEngine(GroupEngine(), "floor"), c2_learner_side="fused")
try:
    ws2.sync(Learner(), full_compare=False)
    caught = []
except SyncCheckError as e:
    caught = list(e.report.verdict("grid").examples)
from tests.unit.test_sync_weight_sync import GATE, UP
seen_fused = list(seen)  # the fused syncs' (the runs below take the export side)
blind = {}
for side in ("export", "fused"):  # a fill that copies gate's bytes into up's slot and the reverse
    _, ws3, _ = _sync(GroupEngine(), c2_learner_side=side)
    ws3.initial_sync(Learner())
    send = ws3.transport.send
    def swapped(bucket, send=send):
        p = bucket.payload
        if GATE in p and UP in p:
            p[GATE], p[UP] = p[UP], p[GATE]
        return send(bucket)
    ws3.transport.send = swapped
    try:
        ws3.sync(Learner())
        blind[side] = [ws3.fused_digest, []]
    except SyncCheckError as e:
        blind[side] = [ws3.fused_digest, sorted(e.report.verdict("grid").examples)]
print(json.dumps({"healthy": healthy, "seen": seen_fused, "caught": caught, "fused2": ws2.fused_digest, "down": DOWN,
                  "blind": blind, "gate_up": sorted([GATE, UP])}))
"""


def test_the_fused_learner_digest_equals_the_independent_one_and_a_regrid_is_still_caught():
    """Under the interpreter the bucket fill computes the learner side of C2 while it copies (WeightSync
    fused_digest): the values equal digest.group_fingerprints of the export, and a sampler on another grid is
    caught by C2 naming the tensor."""
    proc = _interpreted("-c", _FUSED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["healthy"] == [True, True] and res["fused2"]
    # a fill reading the wrong sources: caught with the default learner side (the export's own tensors); the fused
    # side, opt-in, holds the same wrong bytes as the engine and passes (the blind spot its docs name)
    assert res["blind"]["export"][0] is False and set(res["gate_up"]) <= set(res["blind"]["export"][1])
    assert res["blind"]["fused"] == [True, []]
    assert res["seen"] and all(fused and equal for fused, equal in res["seen"]), res["seen"]
    assert res["down"] in res["caught"]


def _interpreted(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("MILES_LP_SYNC_KERNELS", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300, cwd=root)


_COPY_TWICE = r"""
import json, torch
from miles_lp.multitensor import kernels
g = torch.Generator().manual_seed(7)
sizes = [1, 3, 16, 17, 4095, 4096, 4097, 8 * 4096 + 5, 40000, 64]
offs, o = [], 0
for n in sizes:
    offs.append(o)
    o += n + (-(n) % 16)
bad = []
layouts = 0
buf = torch.empty((o,), dtype=torch.uint8)  # one staging buffer, as the transport's
for rnd in range(4):  # new source tensors every round (new addresses), the same layout
    pool = torch.randint(0, 255, (1 << 18,), dtype=torch.uint8, generator=g)
    shift = 16 * rnd if rnd < 2 else rnd  # rounds 0-1 keep the alignment classes, 2-3 change them
    srcs = [pool[shift + 1008 * i: shift + 1008 * i + n] for i, n in enumerate(sizes)]
    buf.fill_(0xFF)
    kernels.copy_into(buf, srcs, offs)
    want = torch.full((o,), 0xFF, dtype=torch.uint8)
    for t, off in zip(srcs, offs):
        want[off:off + t.numel()] = t
    bad.append(int((buf != want).sum()))
    layouts = sum(1 for k in kernels._TABLES if k[0] == "copy-layout")
print(json.dumps({"bad": bad, "layouts": layouts}))
"""


def test_copy_tables_for_new_source_addresses_reuse_the_layout_and_copy_exactly():
    """The bucket fill's tables rebuilt from the per-layout arrays when only the sources' addresses change
    (every sync: the export's tensors are new): the bytes equal a plain copy, whether the alignment classes stay
    (the layout entry reused) or change (a new one)."""
    proc = _interpreted("-c", _COPY_TWICE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["bad"] == [0, 0, 0, 0] and 1 < res["layouts"] <= 3, res


def test_kernel_equals_the_reference_on_awkward_tensors_in_the_interpreter():
    proc = _interpreted("-m", "miles_lp.sync.kernel_selfcheck", "--device", "cpu")
    res = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    assert res.get("cases", 0) >= 20, proc.stderr[-3000:]
    assert res["mismatches"] == [], f"seed {res['seed']}: {res['mismatches'][:5]}"
    fill = res["fill"]  # the bucket fill through copy_into vs the torch concatenation
    assert fill["kernel_path"] and fill["slots"] >= 14 and fill["ff_bytes"] > 0
    assert fill["mismatched_bytes"] == 0, fill
    assert proc.returncode == 0


def test_digest_takes_the_kernel_when_enabled_and_both_paths_agree():
    proc = _interpreted("-c", _BOTH_PATHS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["kernel"] == res["reference"]
    fps, groups = res["kernel"]
    assert len(set(fps.values())) == 5 and len(set(groups.values())) == 3


def test_the_kernel_is_off_on_cpu_without_the_interpreter_and_when_turned_off(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not kernels.enabled(torch.device("cpu"))
    monkeypatch.setenv("MILES_LP_SYNC_KERNELS", "reference")
    assert not kernels.enabled(torch.device("cuda"))


def test_group_value_is_the_weighted_sum_of_member_values():
    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(10, 50, generator=g), torch.randint(0, 255, (9000,), generator=g, dtype=torch.uint8)]
    vals = [int(v) for v in digest.tensor_sums(ts).tolist()]
    exp = sum(digest.member_weight(k) * v for k, v in enumerate(vals)) & digest.MASK64
    assert digest.group_fingerprints({"g": ts})["g"].endswith(f":{exp:016x}")
    assert digest.member_weight(0) == 1 and len({digest.member_weight(k) for k in range(5000)}) == 5000
    assert all(digest.member_weight(k) & 1 for k in range(100))


@pytest.mark.gpu
def test_kernel_equals_the_reference_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from miles_lp.sync.kernel_selfcheck import selfcheck

    res = selfcheck("cuda", large=True)
    assert res["mismatches"] == [], f"seed {res['seed']}: {res['mismatches'][:5]}"


@pytest.mark.gpu
def test_bucket_fill_through_the_copy_kernel_equals_the_torch_path_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from miles_lp.sync.kernel_selfcheck import fill_check

    res = fill_check("cuda")
    assert res["kernel_path"] and res["mismatched_bytes"] == 0, res


@pytest.mark.gpu
def test_cuda_fingerprints_equal_the_cpu_reference():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    cpu = {"w": torch.randn(256, 2048, generator=g).to(torch.float8_e4m3fn),
           "s": torch.randint(0, 255, (256, 64), generator=g, dtype=torch.uint8),
           "b": torch.randn(2048, generator=g).to(torch.bfloat16), "odd": torch.randint(0, 255, (4099,), generator=g,
                                                                                       dtype=torch.uint8)}
    gpu = {n: t.cuda() for n, t in cpu.items()}
    assert kernels.enabled(torch.device("cuda"))
    assert digest.fingerprints(gpu) == digest.fingerprints(cpu)
    groups = {"x": ["w", "s"], "y": ["b", "odd", "w"]}
    assert (digest.group_fingerprints({k: [gpu[n] for n in ns] for k, ns in groups.items()})
            == digest.group_fingerprints({k: [cpu[n] for n in ns] for k, ns in groups.items()}))
