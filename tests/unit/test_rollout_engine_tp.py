"""``rollout.engine_tp``: the tensor-parallel ranks inside one engine. Typed (an integer >= 1); backend vllm runs
it (the model's sizes checked at start and in --dry-run, naming them); elsewhere above 1 refused, naming the key
and why (no tensor parallelism of its own; the server's own flag; not built for the launched SGLang CPU server);
SGLang's ``--tp-size`` and each rank's cores on the command line of a server launched with ``tp_size``."""

from __future__ import annotations

import pytest

from miles_lp.errors import ConfigError
from miles_lp.rollout.config import load_rollout_config, parse_rollout_config
from miles_lp.rollout.sglang_cpu.launch import server_args


def test_default_is_one_and_the_key_is_typed(tmp_path):
    assert parse_rollout_config(None).engine_tp == 1
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match=r"rollout.engine_tp.*(must be an integer >= 1|expected an integer)"):
            parse_rollout_config({"engine_tp": bad})  # the typed parser or the range check
    p = tmp_path / "r.yaml"
    p.write_text("rollout:\n  backend: sglang\n  server: launch\n  engine_tp: 1\n")
    assert load_rollout_config(p).engine_tp == 1
    p.write_text("rollout:\n  backend: sglang\n  server: launch\n  engine_tp: 2\n")
    with pytest.raises(ConfigError, match=r"r.yaml:4.*engine_tp.*--tp-size 2 is not built.*PyNccl.*every TP rank"):
        load_rollout_config(p)
    assert parse_rollout_config({"backend": "vllm", "engine_tp": 2}).engine_tp == 2


def test_the_models_sizes_must_split_across_the_engine_ranks():
    from miles_lp.formats.spec import Format
    from miles_lp.launch.runner import check_engine_tp
    from miles_lp.rollout.config import engine_tp_problems

    qwen = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "hidden_size": 64,
            "intermediate_size": 128}
    assert engine_tp_problems(1, qwen) == engine_tp_problems(2, qwen) == []
    assert engine_tp_problems(4, qwen, block=32) == []  # 2 KV heads on 4 ranks: each held by 2; 128 / 4 = 32
    p3 = engine_tp_problems(3, qwen)
    assert "num_attention_heads 4 is not divisible by rollout.engine_tp 3" in p3
    assert "num_key_value_heads 2 and rollout.engine_tp 3: neither divides the other" in p3
    assert "intermediate_size 128 is not divisible by rollout.engine_tp 3" in p3
    assert engine_tp_problems(8, {**qwen, "num_attention_heads": 8}, block=32) == [  # 256 / 8 = 32: whole blocks
        "intermediate_size 128 / rollout.engine_tp 8 = 16 input features per rank is not a whole number of "
        "32-element scale blocks"]
    with pytest.raises(ConfigError, match=r"rollout.engine_tp 4: .* cannot split /m: intermediate_size 128 / "
                                          r"rollout.engine_tp 4 = 32 .* 128-element scale blocks"):
        check_engine_tp(4, qwen, [Format.FP8_BLOCK, Format.BF16], "/m")
    check_engine_tp(2, qwen, [Format.MXFP8], "/m")  # splits
    wide = {**qwen, "hidden_size": 128, "head_dim": 64, "intermediate_size": 256}  # tiny qwen3_wide: FP8 blockwise
    check_engine_tp(1, wide, [Format.FP8_BLOCK], "/m")
    with pytest.raises(ConfigError, match=r"k_proj / v_proj: 64 output rows per rank is not a whole number of "
                                          r"128-row scale blocks"):  # vLLM fails in its qkv loader otherwise
        check_engine_tp(2, wide, [Format.FP8_BLOCK], "/m")


def test_backends_without_their_own_tensor_parallelism_refuse_it_naming_the_key(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("rollout:\n  backend: reference\n  engine_tp: 2\n")
    with pytest.raises(ConfigError, match=r"r.yaml:3.*engine_tp.*reference has no tensor parallelism.*"
                                          r"rollout.engines"):
        load_rollout_config(p)
    with pytest.raises(ConfigError, match=r"engine_tp.*miles-lp serve.*rollout.engines: N"):
        parse_rollout_config({"backend": "sglang", "url": "http://127.0.0.1:30000", "engine_tp": 2})
    with pytest.raises(ConfigError, match=r"engine_tp.*started by hand.*--tp-size"):
        parse_rollout_config({"backend": "sglang", "server": "sglang", "url": "http://127.0.0.1:30000",
                              "engine_tp": 2})


def test_sglang_launch_passes_the_tp_size():
    args = server_args("/m", 1234, tp_size=2)
    assert args[args.index("--tp-size") + 1] == "2"
    assert server_args("/m", 1234)[server_args("/m", 1234).index("--tp-size") + 1] == "1"
    with pytest.raises(ValueError, match="tp_size"):
        server_args("/m", 1234, tp_size=0)


def test_each_sglang_cpu_rank_gets_cores_of_its_own():
    from miles_lp.errors import BackendUnavailable
    from miles_lp.rollout.sglang_cpu.launch import cpu_bind

    assert cpu_bind(2, cores=[0, 1]) == "0|1"
    assert cpu_bind(2, cores=range(8)) == "0-3|4-7"
    assert cpu_bind(2, 1, cores=[0, 2, 5, 6]) == "0|2"
    assert cpu_bind(2, 2, cores=[0, 2, 5, 6]) == "0,2|5-6"
    with pytest.raises(BackendUnavailable, match=r"--tp-size 3 \(rollout.engine_tp\).*2 core\(s\)"):
        cpu_bind(3, cores=[0, 1])


def test_the_megatron_learner_gets_the_engines_tp(monkeypatch):
    """``check_activation_partition`` (NVFP4 activation scales cut as the engine cuts K) needs the engine's tp."""
    from pathlib import Path

    import miles_lp.train.megatron.group as group
    from miles_lp.launch.recipe import load_recipe
    from miles_lp.launch.runner import make_learner

    seen = {}
    monkeypatch.setattr(group, "make_megatron_learner", lambda *a, **kw: seen.update(kw) or "learner")
    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "tiny-mxfp8-vllm.yaml",
                         ["train.backend=megatron", "rollout.engine_tp=2"])
    assert make_learner(recipe, Path("/m"), None) == "learner" and seen["engine_tp"] == 2


def test_engines_at_tp_above_one_bind_cores_of_their_own(monkeypatch):
    """Two vLLM engines at engine_tp 2 on one host: each gets its own half of the cores to bind its ranks to."""
    import os

    from miles_lp.errors import ConfigError
    from miles_lp.launch.runner import engine_cores
    from miles_lp.rollout.sglang_cpu.launch import cpu_bind

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    a, b = engine_cores(0, 2), engine_cores(1, 2)
    assert a == [0, 1, 2, 3] and b == [4, 5, 6, 7]
    assert cpu_bind(2, cores=a) == "0-1|2-3" and cpu_bind(2, cores=b) == "4-5|6-7"
    with pytest.raises(ConfigError, match="need cores of their own; this process may use 8"):
        engine_cores(0, 9)
