"""The CPU ring rotates k/v and dk/dv synchronously: no asynchronous functional collective is issued.

torch's own rotaters (the control) issue them; automodel's (``cpu_ring._SyncRotater``, installed only
inside ``cpu_ring_attention``) does not, and both give the single-process result (fp64).
"""

from __future__ import annotations

import pytest

from tests.dist_harness import run_distributed

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def results():
    return run_distributed("tests.workers.ring_rotation_worker:main", world_size=2, timeout=300)


def test_ring_rotation_is_synchronous_and_exact(results):
    for rank, res in enumerate(results):
        assert res["factory_restored"], f"rank {rank}: torch's _create_rotater was not restored"
        for method in ("allgather", "alltoall"):
            ours, control = res[f"automodel-{method}"], res[f"torch-{method}"]
            assert ours["factory_inside"] and control["factory_inside"]
            assert ours["async_collectives"] == 0, f"rank {rank} {method}: {ours}"
            assert control["async_collectives"] >= 2, f"rank {rank} {method}: the counter saw nothing"
            assert ours["max_err"] <= 1e-12 and control["max_err"] <= 1e-12
