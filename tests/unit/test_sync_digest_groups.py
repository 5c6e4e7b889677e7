"""C2 by atomic group: one fingerprint per group on each side; a differing group is narrowed to its tensors by
per-tensor fingerprints, so the verdict still names them."""

import pytest
import torch

from miles_lp.multitensor.digest import fingerprint, group_fingerprints
from miles_lp.sync import SyncCheckError
from miles_lp.sync.faults import RegridEngine
from tests.unit.test_sync_weight_sync import DOWN, FingerprintEngine, Learner, _sync


def _members():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 100, generator=g), torch.randint(0, 255, (7000,), generator=g, dtype=torch.uint8),
            torch.randn(5, generator=g).to(torch.bfloat16), torch.tensor(0.5)]


def test_group_fingerprint_is_of_the_bytes_in_order_whatever_the_memory_layout():
    ts = _members()
    ref = group_fingerprints({"g": ts})["g"]
    stacked = torch.stack([ts[0], ts[0] + 1])  # members that are views of one storage
    assert group_fingerprints({"g": [stacked[0], *ts[1:]]})["g"] == ref
    assert group_fingerprints({"a": ts, "b": ts[:1]}) == {"a": ref, "b": group_fingerprints({"b": ts[:1]})["b"]}
    one = group_fingerprints({"g": ts[:1]})["g"]
    assert one.rsplit(":", 1)[1] == fingerprint(ts[0]).rsplit(":", 1)[1]  # a one-tensor group: its fingerprint
    changed = [t.clone() for t in ts]
    changed[1][6999] ^= 1  # one bit of the last byte
    assert group_fingerprints({"g": changed})["g"] != ref
    assert group_fingerprints({"g": [ts[1], ts[0], *ts[2:]]})["g"] != ref  # the same tensors, another order
    same_bytes = [ts[0].view(torch.int32), *ts[1:]]  # the same bytes under another dtype
    assert group_fingerprints({"g": same_bytes})["g"].rsplit(":", 1)[1] == ref.rsplit(":", 1)[1]
    assert group_fingerprints({"g": same_bytes})["g"] != ref


class GroupEngine(FingerprintEngine):
    def weight_group_fingerprints(self, groups):
        self.grouped = getattr(self, "grouped", 0) + 1
        return group_fingerprints({g: [self.t[n] for n in ns] for g, ns in groups.items()})


def test_sync_uses_group_digests_and_names_the_tensors_of_a_differing_group():
    engine, ws, lines = _sync(GroupEngine())
    r = ws.sync(Learner(), full_compare=False)
    assert r.ok and engine.grouped == 1 and not getattr(engine, "fingerprinted", False)
    assert "groups equal" in r.verdict("grid").reason
    regrid = RegridEngine(GroupEngine(), "floor")
    _, ws, _ = _sync(regrid)
    with pytest.raises(SyncCheckError, match="grid: failed") as err:
        ws.sync(Learner(), full_compare=False)
    v = err.value.report.verdict("grid")
    assert regrid.inner.grouped == 1 and regrid.inner.fingerprinted  # per-tensor only for the differing group
    assert set(v.examples) <= {DOWN, DOWN[:-6] + "weight_scale_inv"} and DOWN in v.examples
    assert "in 1 of" in v.reason


def test_a_transfer_that_reads_the_wrong_source_fails_the_per_sync_digest():
    """The learner side of the per-sync C2 digest comes from the export's own tensors by default
    (``sync.c2_learner_side: export``), so a transfer that copies gate's bytes into up's slot and the reverse (an
    addressing bug in the fill) fails C2 naming both; with the fused side (taken from the fill's own reads, opt-in)
    both sides would hold the same wrong bytes."""
    from tests.unit.test_sync_weight_sync import GATE, UP

    engine, ws, _ = _sync(GroupEngine())
    assert ws.config.c2_learner_side == "export"
    send = ws.transport.send

    def swapped(bucket):
        p = bucket.payload
        if GATE in p and UP in p:
            p[GATE], p[UP] = p[UP], p[GATE]
        return send(bucket)

    ws.transport.send = swapped
    with pytest.raises(SyncCheckError, match="grid: failed") as err:
        ws.sync(Learner(), full_compare=False)
    assert {GATE, UP} <= set(err.value.report.verdict("grid").examples)
    assert not ws.fused_digest
