"""``rollout.engine_tp``: the tensor-parallel ranks inside one engine. Typed (an integer >= 1); above 1 refused on
every backend, naming the key and why (no tensor parallelism of its own; the server's own flag; not built for the
launched SGLang CPU server and the vLLM worker, whose checks read one process's weights); SGLang's ``--tp-size``
and each rank's cores on the command line of a server launched with ``tp_size``."""

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
    with pytest.raises(ConfigError, match=r"engine_tp.*vllm at tensor_parallel_size 2 is not built.*checks"):
        parse_rollout_config({"backend": "vllm", "engine_tp": 2})


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
