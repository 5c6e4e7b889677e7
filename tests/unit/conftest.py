"""Fixtures shared by the unit tests."""

from __future__ import annotations

import os
import socket
import warnings

import pytest


@pytest.fixture(scope="module")
def mp():
    """A Megatron-Core world of one process (gloo) with model-parallel sizes 1, torn down after the module."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    warnings.filterwarnings("ignore")
    created = False
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=0, world_size=1)
        created = True
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()
