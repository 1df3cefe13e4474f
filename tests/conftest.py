"""Fixtures shared by test modules (none is autouse: a module asks for one by name)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests: tiny tensors run fastest so, and the module does not fight the
    processes it launches for the cores. The thread count is restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
