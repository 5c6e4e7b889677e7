"""``ReferenceEngine.check_state``: C4's pointers and C2's engine-side group digests from one read of the live
tensors. It must answer exactly what ``storage_pointers()`` and ``weight_group_fingerprints()``
answer, and its cached fast path (the digest's launch tables reused while every canonical tensor is the same
object at the same address) must never hide a re-bound parameter, a ``.data`` swap, a re-registered derived
buffer or a changed byte. The fast path needs the digest kernel: it runs under Triton's interpreter in a
subprocess (as tests/unit/test_sync_kernels.py), and compiled on the H200 (``-m gpu``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from miles_lp.multitensor import digest
from miles_lp.rollout.reference import ReferenceEngine
from miles_lp.rollout.testing import tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = "policies/qwen3-moe-mxfp8-nvfp4-experts.yaml"


def _groups(engine: ReferenceEngine) -> dict[str, list[str]]:
    """Groups of a few names each, in an order unlike the engine's (the sync's layout groups are the export's)."""
    names = sorted(engine.param_specs(), reverse=True)
    return {f"g{i}": names[i:i + 5] for i in range(0, len(names), 5)}


def _strings(groups, st):
    return digest.group_strings(list(groups), st["group_heads"], st["group_values"])


def test_check_state_is_storage_pointers_and_the_group_digests_in_one_read():
    engine = ReferenceEngine(tiny_checkpoint("qwen3_moe", RECIPE), device="cpu", dtype="bf16")
    groups = _groups(engine)
    st = engine.check_state(groups)
    assert dict(zip(st["names"], st["pointers"], strict=True)) == engine.storage_pointers()
    assert len(set(st["names"])) == len(st["names"])
    assert _strings(groups, st) == engine.weight_group_fingerprints(groups)
    live = {n: engine._live(n) for n in engine.param_specs()}
    assert _strings(groups, st) == digest.group_fingerprints({g: [live[n] for n in ns] for g, ns in groups.items()})
    assert engine.check_state(None)["group_values"] is None
    assert engine.check_state(None)["names"] is st["names"]  # one tuple while the served set stands


def test_check_state_sees_a_rebound_parameter_a_data_swap_and_a_reregistered_buffer():
    engine = ReferenceEngine(tiny_checkpoint("qwen3_moe", RECIPE), device="cpu", dtype="bf16")
    base = engine.check_state(None)
    lin = engine._linears[0]
    # a re-bound parameter: a new Parameter object in the module
    old = lin.weight
    lin.weight = torch.nn.Parameter(old.detach().clone(), requires_grad=False)
    now = engine.check_state(None)
    moved = dict(zip(now["names"], now["pointers"], strict=True))
    was = dict(zip(base["names"], base["pointers"], strict=True))
    assert moved[lin.prefix + "weight"] != was[lin.prefix + "weight"]
    assert moved == engine.storage_pointers()
    lin.weight = old
    assert engine.check_state(None)["pointers"] == base["pointers"]
    # the same object, its storage swapped (``.data =``)
    keep = old.data
    old.data = keep.clone()
    assert engine.check_state(None)["pointers"] != base["pointers"]
    old.data = keep
    # a derived buffer re-registered from outside the layer code (no epoch bump: read live anyway)
    op = lin.operand
    lin.register_buffer("operand", op.clone(), persistent=False)
    st = engine.check_state(None)
    assert st["names"] == base["names"] and st["pointers"] != base["pointers"]
    lin.register_buffer("operand", op, persistent=False)
    assert engine.check_state(None)["pointers"] == base["pointers"]
    # an instance attribute shadowing a parameter is what getattr (and so the kernel) reads: seen too
    shadow = lin.weight.detach().clone()
    lin.__dict__["weight"] = shadow
    try:
        now = dict(zip(base["names"], engine.check_state(None)["pointers"], strict=True))
        assert now[lin.prefix + "weight"] == shadow.data_ptr()
    finally:
        del lin.__dict__["weight"]
    assert engine.check_state(None)["pointers"] == base["pointers"]


_FAST = r"""
import json, os, time, torch
from miles_lp.rollout.reference import ReferenceEngine
from miles_lp.rollout.testing import tiny_checkpoint
from miles_lp.multitensor import digest, kernels
assert kernels.enabled(torch.device("cpu"))
engine = ReferenceEngine(tiny_checkpoint("qwen3_moe", "policies/qwen3-moe-mxfp8-nvfp4-experts.yaml"), device="cpu",
                         dtype="bf16")
# a few groups (the interpreter reads every byte slowly): a quantized dense layer's tensors and a few others
lin = [l for l in engine._linears if l.kernel_format is not None and l.kernel_format.quantized][0]
small = sorted(engine.param_specs(), key=lambda n: engine._live(n).nbytes)[:7]
names = [lin.prefix + s for s in lin.canonical_specs()] + [n for n in small if not n.startswith(lin.prefix)]
groups = {"a": names[:2], "b": names[2:5], "c": names[5:]}
def indep():  # the torch reference on what the modules hold now
    os.environ["MILES_LP_SYNC_KERNELS"] = "reference"
    try:
        live = {n: engine._live(n) for n in names}
        return digest.group_fingerprints({g: [live[n] for n in ns] for g, ns in groups.items()})
    finally:
        del os.environ["MILES_LP_SYNC_KERNELS"]
def state():
    st = engine.check_state(groups)
    return digest.group_strings(list(groups), st["group_heads"], st["group_values"])
out = {}
before = state()
out["first"] = before == indep()
plan = engine._group_plan(groups)
out["fast_built"] = plan[5] is not None
out["second"] = state() == before         # the fast path
out["fast_kept"] = plan[5] is not None
w = lin.weight
with torch.no_grad():                     # a changed byte: the fast path reads the bytes again
    w.view(torch.uint8).reshape(-1)[7] ^= 1
s = state()
out["byte"] = s != before and s == indep()
with torch.no_grad():
    w.view(torch.uint8).reshape(-1)[7] ^= 1
out["byte_back"] = state() == before
lin.weight = torch.nn.Parameter(w.detach().clone(), requires_grad=False)   # re-bound: digested from the new tensor
with torch.no_grad():
    lin.weight.view(torch.uint8).reshape(-1)[3] ^= 1
s = state()
out["rebound"] = s != before and s == indep()
lin.weight = w
out["restored"] = state() == before
keep = w.data                              # .data swap on the same object
w.data = keep.clone()
with torch.no_grad():
    w.view(torch.uint8).reshape(-1)[5] ^= 1
s = state()
out["data_swap"] = s != before and s == indep()
w.data = keep
out["restored2"] = state() == before
print(json.dumps(out))
"""


def test_the_fast_path_equals_the_full_digest_and_sees_every_change():
    """Under the interpreter: check_state's cached launch (kernels.PreparedValues) gives the independent
    group digests, and a flipped byte, a re-bound parameter and a ``.data`` swap each change the value (and are
    digested from what the module holds now)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("MILES_LP_SYNC_KERNELS", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _FAST], env=env, cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res == {k: True for k in res} and len(res) == 10, res


@pytest.mark.gpu
def test_the_fast_path_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("MILES_LP_SYNC_KERNELS", None)
    env.pop("TRITON_INTERPRET", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = _FAST.replace('device="cpu"', 'device="cuda"').replace(
        'assert kernels.enabled(torch.device("cpu"))', 'assert kernels.enabled(torch.device("cuda"))')
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res == {k: True for k in res} and len(res) == 10, res
