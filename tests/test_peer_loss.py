"""A rank lost during training (issue 27 item 7): the survivors stop quietly with exit code 4, and the
``automodel`` command prints one line naming the lost rank.

The end-to-end check (the command, a SIGKILL mid-step, ``resume=auto`` with the same losses) is
``scripts/fault_kill.py`` (about 2 minutes: three launches); here the two halves separately:

- two gloo processes: rank 1 SIGKILLs itself between collectives, rank 0 (inside
  :func:`stop_quietly_if_peer_lost`) gets :class:`RunAborted` with :data:`EXIT_LOST_RANK` within seconds
  and prints one ``error: [rank 0]`` line (quiet under the command);
- the command's reading of the ranks' exit codes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from automodel import cli
from automodel.training.peer_loss import EXIT_LOST_RANK, LAUNCHER_ENV, is_peer_loss
from tests.dist_harness import REPO_ROOT, free_port

WORKER = r"""
import os, signal, sys, time, datetime
import torch, torch.distributed as dist
from automodel.training.peer_loss import stop_quietly_if_peer_lost
from automodel.training.user_errors import RunAborted, exit_process
rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
steps = [0]
def train():
    t = torch.ones(1000)
    while True:
        steps[0] += 1
        if rank == 1 and steps[0] == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(t)
        t /= 2
try:
    stop_quietly_if_peer_lost(train, step=lambda: steps[0])
except RunAborted as e:
    print(f"aborted {e.exit_code}", flush=True)
    exit_process(e.exit_code)  # as recipes/finetune.py exits
"""


def _launch(launcher_env: str | None) -> list[subprocess.CompletedProcess | subprocess.Popen]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", LAUNCHER_ENV)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    if launcher_env is not None:
        env[LAUNCHER_ENV] = launcher_env
    return [
        subprocess.Popen([sys.executable, "-c", WORKER, str(r)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
        for r in (0, 1)
    ]


@pytest.mark.dist
@pytest.mark.parametrize("launcher", [None, "cli"])
def test_survivor_of_a_killed_rank_exits_4_with_at_most_one_line(launcher):
    procs = _launch(launcher)
    try:
        rank1_rc = procs[1].wait(timeout=120)
        t_dead = time.monotonic()
        out, err = procs[0].communicate(timeout=60)
        waited = time.monotonic() - t_dead
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert rank1_rc == -signal.SIGKILL
    assert procs[0].returncode == EXIT_LOST_RANK, (out, err)
    assert waited < 30, waited
    assert "aborted 4" in out and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    if launcher == "cli":
        assert lines == [], err  # the command names the lost rank
    else:
        assert len(lines) == 1 and lines[0].startswith("error: [rank 0] lost contact with another rank"), err
        assert "checkpoint.resume=auto" in lines[0]


NODE_WORKER = r"""
import os, sys, time, datetime
import torch, torch.distributed as dist
from automodel.training.peer_loss import stop_quietly_if_peer_lost
from automodel.training.user_errors import RunAborted, exit_process
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
open(os.path.join(os.environ["READY_DIR"], f"rank{rank}"), "w").write(str(os.getpid()))
def train():
    t = torch.ones(1000)
    while True:
        if os.environ["MODE"] == "idle":  # no collective: the launcher notices the lost node first
            time.sleep(0.05)
            continue
        dist.all_reduce(t)
        t /= 2
        time.sleep(0.01)
try:
    stop_quietly_if_peer_lost(train)
except RunAborted as e:
    exit_process(e.exit_code)
"""

NODE = r"""
import sys
from automodel import cli
cli.COMMANDS["peer"] = sys.argv[2]  # the command launches this script instead of the recipe
sys.exit(cli.main(["peer", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                   f"127.0.0.1:{sys.argv[1]}", "--rdzv-id", "peer-loss", "--monitor-interval", "0.2",
                   "--config", "configs/cp.yaml"]))
"""


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["collective", "idle"])
def test_surviving_node_prints_one_line_and_no_cpp_trace(tmp_path, mode):
    """Two nodes under the ``automodel`` command (c10d rendezvous, as on a cluster); node 0, which hosts the
    rendezvous store, goes down (its launcher and rank SIGKILLed). The surviving node prints one ``error:`` line
    and exits 4: no C++ stack trace of c10d's failed TCPStore calls (about 25 lines each before), no Python
    traceback. ``collective``: its rank is in an all-reduce (the rank or the launcher notices first);
    ``idle``: its rank runs no collective, so the launcher's rendezvous store call fails first."""
    worker = tmp_path / "worker.py"
    worker.write_text(NODE_WORKER)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", LAUNCHER_ENV, "TORCH_CPP_LOG_LEVEL")}
    env.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", READY_DIR=str(tmp_path), MODE=mode)
    port = str(free_port())
    nodes = [
        subprocess.Popen([sys.executable, "-c", NODE, port, str(worker)], cwd=REPO_ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for _ in range(2)
    ]  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"rank{r}").is_file() for r in (0, 1)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in nodes), [p.poll() for p in nodes]
            time.sleep(0.2)
        time.sleep(1.0)
        # the rendezvous store lives in the launcher that bound the endpoint: that node goes down
        ranks = {int((tmp_path / f"rank{r}").read_text()): r for r in (0, 1)}
        host = 0 if nodes[0].poll() is None and _listens(nodes[0].pid, int(port)) else 1
        lost = [pid for pid, r in ranks.items() if _parent(pid) == nodes[host].pid]
        for pid in [nodes[host].pid, *lost]:
            os.kill(pid, signal.SIGKILL)
        out, _ = nodes[1 - host].communicate(timeout=120)
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
        for pid in ranks if "ranks" in locals() else ():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    lines = [line for line in out.splitlines() if line.strip()]
    assert nodes[1 - host].returncode == EXIT_LOST_RANK, out
    assert len(lines) == 1 and lines[0].startswith("error: ") and "checkpoint.resume=auto" in lines[0], out
    assert "frame #" not in out and "TCPStore" not in out and "Traceback" not in out, out


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` has a listening TCP socket on ``port`` (Linux /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A" and cols[9] in inodes:
                    return True
    return False


def test_peer_loss_is_recognised_and_bugs_are_not():
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:10127: Connection reset by peer.")
    assert is_peer_loss(gloo)
    try:
        try:
            raise gloo
        except RuntimeError as e:
            raise ValueError("while handling it") from e
    except ValueError as chained:
        assert is_peer_loss(chained)
    assert not is_peer_loss(RuntimeError("shape mismatch: [2, 3] vs [3, 2]"))
    assert not is_peer_loss(KeyError("x"))


def _fail(**codes: int) -> dict:
    return {int(r.removeprefix("r")): SimpleNamespace(exitcode=c) for r, c in codes.items()}


def test_the_command_names_the_lost_rank_in_one_line():
    assert cli.EXIT_LOST_RANK == EXIT_LOST_RANK
    code, line = cli._exit_code_of_failures(_fail(r1=-signal.SIGKILL))
    assert code == EXIT_LOST_RANK and line.startswith("rank 1 (signal SIGKILL) died during training"), line
    assert "checkpoint.resume=auto" in line
    code, line = cli._exit_code_of_failures(_fail(r0=EXIT_LOST_RANK, r2=EXIT_LOST_RANK, r3=-signal.SIGKILL))
    assert code == EXIT_LOST_RANK and line.startswith("rank 3 (signal SIGKILL) died"), line
    code, line = cli._exit_code_of_failures(_fail(r0=EXIT_LOST_RANK, r1=EXIT_LOST_RANK))
    assert code == EXIT_LOST_RANK and "lost contact with a rank of another node" in line
    # a rank that failed on its own (a bug, with its traceback) keeps the usual line and exit 1
    code, line = cli._exit_code_of_failures(_fail(r0=EXIT_LOST_RANK, r1=1))
    assert code == 1 and "rank 1: exit code 1" in line
    assert cli._exit_code_of_failures(_fail(r0=2, r1=EXIT_LOST_RANK)) == (2, None)
    assert cli._exit_code_of_failures(_fail(r0=-signal.SIGTERM, r1=143)) == (143, None)


