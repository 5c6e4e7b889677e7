"""``train.megatron.distributed_optimizer``: typed, default off; on is refused naming the key and why (megatron-core
0.16's DistributedOptimizer and DDP buffers are CUDA-only: the reason is read from the installed package)."""

from __future__ import annotations

import inspect

import pytest

from miles_lp.config import load_yaml_text
from miles_lp.errors import ConfigError
from miles_lp.train.config import parse_train_config


def _parse(text):
    doc = load_yaml_text(text, "recipe.yaml")
    return parse_train_config(doc.data.get("train"), doc.where("train"))


def test_default_off_and_typed():
    assert _parse("train: {backend: megatron}\n").megatron.distributed_optimizer is False
    with pytest.raises(ConfigError, match="distributed_optimizer"):
        _parse("train:\n  megatron: {distributed_optimizer: maybe}\n")


def test_on_is_refused_naming_the_key_and_the_reason():
    with pytest.raises(ConfigError, match=r"recipe.yaml:3.*distributed_optimizer.*not built.*torch.cuda.*set distributed_optimizer: "
                                          r"false"):
        _parse("train:\n  megatron:\n    distributed_optimizer: true\n")


def test_the_stated_reason_is_megatron_cores_own_code():
    pytest.importorskip("megatron.core")
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.optimizer import distrib_optimizer

    assert "device=torch.cuda.current_device()" in inspect.getsource(param_and_grad_buffer)
    assert "'torch.cuda.FloatTensor'" in inspect.getsource(distrib_optimizer)
