"""The engine protocol the sync builds on: the optional parts are declared (``capabilities``), read once, and
the sync calls exactly what an engine declares; a declaration naming a method the engine lacks is refused."""

import pytest

from miles_lp.rollout.engine import Capability, engine_capabilities
from miles_lp.sync import SyncConfig, WeightSync
from tests.unit.test_sync_weight_sync import FingerprintEngine, Learner, StubEngine, _plan


def _ws(engine):
    return WeightSync(engine, _plan(), "sglang", SyncConfig(bucket_mb=0.004).with_modes(all="raise"), env={},
                      log=lambda line: None)


class Declared(FingerprintEngine):
    """Implements ``weight_fingerprints`` but declares no optional capability: the sync must not call it."""

    capabilities = frozenset()

    def weight_fingerprints(self, names=None):
        raise AssertionError("called a method the engine did not declare")


class OverDeclared(StubEngine):
    capabilities = frozenset({Capability.GROUP_FINGERPRINTS})


def test_an_undeclared_engine_gets_the_capabilities_its_class_defines():
    assert engine_capabilities(StubEngine()) == frozenset()
    assert engine_capabilities(FingerprintEngine()) == {Capability.FINGERPRINTS}


def test_the_sync_calls_only_what_the_engine_declares():
    engine = Declared()
    ws = _ws(engine)
    assert ws.caps == frozenset()
    assert ws.sync(Learner(), full_compare=False).ok  # C2 through weight_digests, the required method
    fp = FingerprintEngine()
    assert _ws(fp).sync(Learner(), full_compare=False).ok and fp.fingerprinted


def test_a_declaration_the_engine_cannot_keep_is_refused():
    with pytest.raises(TypeError, match="weight_group_fingerprints"):
        engine_capabilities(OverDeclared())


def test_a_replaced_engine_is_read_again():
    ws = _ws(StubEngine())
    ws.engine = FingerprintEngine()
    assert ws.caps == {Capability.FINGERPRINTS}


