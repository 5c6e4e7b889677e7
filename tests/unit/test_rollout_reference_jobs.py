"""``ReferenceEngine`` answers the engine protocol from one module per job: each protocol method is defined in the
module of its job, once, and the engine declares exactly the optional parts it implements."""

from __future__ import annotations

import inspect

from miles_lp.rollout.engine import Capability, Engine, OptionalEngine
from miles_lp.rollout.reference import ReferenceEngine

JOBS = {
    "generation": {"generate", "pause", "resume", "flush_cache"},
    "updates": {"begin_weight_update", "update_weights", "finish_weight_update", "abort_weight_update"},
    "introspect": {"quantized_params", "weight_digests", "read_weights", "storage_pointers", "param_specs",
                   "weight_fingerprints", "weight_group_fingerprints", "check_state"},
    "c3": {"self_check", "self_check_begin", "self_check_every_layer"},
    "engine": {"health", "close"},
}


def _protocol_methods() -> set[str]:
    names = set()
    for proto in (Engine, OptionalEngine):
        names |= {n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")}
    return names


def test_every_protocol_method_lives_in_its_jobs_module_once():
    assert set().union(*JOBS.values()) == _protocol_methods()
    for job, names in JOBS.items():
        for name in names:
            owners = [c for c in ReferenceEngine.__mro__ if name in vars(c)]
            assert len(owners) == 1, (name, owners)
            assert owners[0].__module__ == f"miles_lp.rollout.reference.{job}", (name, owners[0].__module__)


def test_the_declared_capabilities_are_every_optional_part():
    assert ReferenceEngine.capabilities == frozenset(Capability)
    methods = {c for c in Capability if c is not Capability.ROTATION_BASE}  # an attribute, set per engine
    assert all(callable(getattr(ReferenceEngine, c.value, None)) for c in methods)
