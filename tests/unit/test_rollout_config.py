"""The recipe's rollout: section (RolloutConfig): defaults, SamplingParams, refusals with file:line."""

from __future__ import annotations

import pytest

from miles_lp.errors import ConfigError
from miles_lp.rollout.config import load_rollout_config, parse_rollout_config


def test_defaults_and_sampling_params():
    cfg = parse_rollout_config(None)
    assert cfg.backend == "reference" and cfg.kv_cache == "bf16" and cfg.max_response_len == 1024
    sp = parse_rollout_config({"max_response_len": 64, "stop_token_ids": [2], "sampling": {"temperature": 0.7}}
                              ).sampling_params(seed=5)
    assert (sp.max_new_tokens, sp.stop_token_ids, sp.temperature, sp.seed) == (64, (2,), 0.7, 5)
    sp.validate()


def test_refusals_name_the_line(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("rollout:\n  backend: reference\n  kv_cache: fp8\n")
    with pytest.raises(ConfigError, match=r"r.yaml:3.*kv_cache"):
        load_rollout_config(p)
    p.write_text("rollout:\n  samplng: {}\n")
    with pytest.raises(ConfigError, match="did you mean 'sampling'"):
        load_rollout_config(p)
    with pytest.raises(ConfigError, match="needs the server's url"):
        parse_rollout_config({"backend": "sglang"})
    with pytest.raises(ConfigError, match="top_p.*must be in"):
        parse_rollout_config({"sampling": {"top_p": 0}})
