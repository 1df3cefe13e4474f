"""Fixtures shared by test modules (none is autouse: a module asks for one by name)."""

from __future__ import annotations

import re

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


# A module that starts processes (gloo ranks, torchrun, the recipe as a subprocess, the cookbook's commands)
LAUNCHES = re.compile(r"run_distributed|run_on_ranks|launch_nodes|subprocess|torch\.distributed\.run|Popen")
#: the longest modules (issue 45's measurement, 2 cores), handed out first
LONGEST = ("test_compile_recipe.py", "test_tp_recipe.py", "test_recipe_parity.py", "test_user_errors.py",
           "test_cookbook.py", "test_family_matrix.py")  # fmt: skip


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (scripts/test.sh: ``-n 2 --dist loadfile --no-loadscope-reorder``, each module whole on one
    worker, its module-scoped fixtures once): the longest modules first, then the others that start processes,
    then the rest, so that short modules fill the end and no worker waits on a long one alone; a no-op without
    xdist."""
    if not hasattr(config, "workerinput"):  # not an xdist worker (the workers collect)
        return
    ranks: dict = {}

    def rank(item) -> int:
        path = item.path
        if path not in ranks:
            launches = path.suffix == ".py" and LAUNCHES.search(path.read_text()) is not None
            ranks[path] = LONGEST.index(path.name) if path.name in LONGEST else len(LONGEST) + (0 if launches else 1)
        return ranks[path]

    items.sort(key=rank)  # stable: a module's tests keep their order
