"""automodel.distributed.launch: ranks forked from a forkserver that imported torch and transformers once, under
the launching process's environment (a changed variable restarts the server), or spawned on request."""

from __future__ import annotations

import os

import pytest

from tests.dist_harness import run_distributed

pytestmark = pytest.mark.dist

TARGET = "tests.workers.launch_probe:probe"
KEY = "AUTOMODEL_TEST_LAUNCH_PROBE"


def test_ranks_fork_from_a_preloaded_server_under_the_launching_environment(monkeypatch):
    monkeypatch.delenv("AUTOMODEL_LAUNCH_START", raising=False)
    monkeypatch.delenv(KEY, raising=False)
    first = run_distributed(TARGET, world_size=2, timeout=120, key=KEY)
    assert [r["rank_env"] for r in first] == [("0", "2", "0"), ("1", "2", "1")]
    assert all(r["preloaded"] and r["value"] is None for r in first)
    assert first[0]["parent"] == first[1]["parent"] != os.getpid()  # the forkserver's children
    again = run_distributed(TARGET, world_size=2, timeout=120, key=KEY)
    assert again[0]["parent"] == first[0]["parent"]  # the same server: the environment did not change

    monkeypatch.setenv(KEY, "set before the launch")  # e.g. a variable read at import: the server restarts
    changed = run_distributed(TARGET, world_size=2, timeout=120, key=KEY)
    assert all(r["preloaded"] and r["value"] == "set before the launch" for r in changed)
    assert changed[0]["parent"] != first[0]["parent"]

    monkeypatch.setenv("AUTOMODEL_LAUNCH_START", "spawn")  # a fresh interpreter per rank
    spawned = run_distributed(TARGET, world_size=2, timeout=120, key=KEY)
    assert all(r["value"] == "set before the launch" and not r["preloaded"] for r in spawned)
    assert spawned[0]["parent"] == os.getpid()


def test_a_hang_names_where_each_rank_waits():
    """A time-out kills the ranks and reports each one's stack (faulthandler on SIGUSR1), so a hang in CI says where
    it hung; the rendezvous is a file in the launch's folder (no TCP port two launches could share)."""
    with pytest.raises(RuntimeError) as info:
        run_distributed("tests.workers.launch_probe:wait_for_a_peer_that_never_comes", world_size=2, timeout=8)
    text = str(info.value)
    assert "timed out after 8s" in text
    assert "rank 0: no result" in text and "rank 1: no result" in text
    assert "in wait_for_a_peer_that_never_comes" in text and "all_reduce" in text  # rank 0 waits in the collective
