"""Fixtures shared by every test folder."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny GEMMs on a shared 2-core CPU: one intra-op thread is 10-30x faster than two spinning ones. A module
    opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")`` (or adds it to its pytestmark list)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
