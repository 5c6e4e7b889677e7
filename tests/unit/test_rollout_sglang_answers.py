"""The SGLang client reads a /generate answer strictly: an unknown finish reason is an error, not a guess."""

from __future__ import annotations

import pytest


def test_sglang_answer_with_an_unknown_finish_reason_is_an_error():
    from miles_lp.rollout.engine import EngineError
    from miles_lp.rollout.sglang import generation_from_json

    ok = {"output_ids": [5], "meta_info": {"output_token_logprobs": [[-0.5, 5, None]],
                                           "finish_reason": {"type": "stop"}, "weight_version": "3"}}
    g = generation_from_json(ok)
    assert (g.finish_reason, g.weight_version) == ("stop", 3)
    bad = {**ok, "meta_info": {**ok["meta_info"], "finish_reason": {"type": "timeout"}}}
    with pytest.raises(EngineError, match=r"finish_reason \{'type': 'timeout'\}; expected type stop, length or abort"):
        generation_from_json(bad)
