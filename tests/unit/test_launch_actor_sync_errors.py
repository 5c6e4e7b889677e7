"""A sync error raised in the learner actor reaches the driver whole: the sync's exceptions take more than a
message to build, which Ray's exception pickling cannot do; ``ActorSyncError`` carries them across and rebuilds
them (kind, stage, bucket, verdicts, report, the engine's index)."""

from __future__ import annotations

import pickle

import pytest

from miles_lp.launch.actor_sync import ActorSyncError, _portable
from miles_lp.sync.verdict import SyncAbortedError, SyncCheckError, failed


def test_the_syncs_own_exceptions_do_not_pickle_but_cross_to_the_driver_whole():
    aborted = SyncAbortedError("engine 1 gone", "transfer", 2, None)
    aborted.engine_index = 1
    with pytest.raises(TypeError):  # what Ray would meet: the class rebuilt from its message alone
        pickle.loads(pickle.dumps(aborted))
    back = pickle.loads(pickle.dumps(ActorSyncError.of(aborted))).rebuild()
    assert isinstance(back, SyncAbortedError) and str(back) == "engine 1 gone"
    assert (back.stage, back.bucket, back.engine_index) == ("transfer", 2, 1)
    check = SyncCheckError("grid failed", [failed("grid", 3.0, "3 tensors differ")], None)
    back = pickle.loads(pickle.dumps(ActorSyncError.of(check))).rebuild()
    assert isinstance(back, SyncCheckError) and back.verdicts[0].name == "grid" and back.verdicts[0].failed


def test_a_learner_actor_method_raises_the_portable_form():
    @_portable
    def run_sync():
        raise SyncCheckError("x", [], None)

    with pytest.raises(ActorSyncError) as info:
        run_sync()
    assert info.value.kind == "SyncCheckError"
