"""A simulated multi-node launch on one machine: ``torchrun --nnodes N --nproc-per-node P`` started once per
"node" (``--node-rank n``) with a static rendezvous on 127.0.0.1, as a cluster's job script would.

Every launch runs in its own session; if one exits non-zero or the deadline passes, all of them are
stopped at once (SIGTERM: torchrun stops its workers; SIGKILL after 10 s), so a failed node never
leaves the others waiting for it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.dist_harness import REPO_ROOT, free_port

__all__ = ["launch_nodes"]


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def _kill(procs: list[subprocess.Popen]) -> None:
    """Stop every launch still running: SIGTERM first (torchrun then stops its workers, which run in
    sessions of their own), SIGKILL to what is left after 10 s."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in running:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL)
            p.wait(10)


def launch_nodes(module: str, args: list[str], nnodes: int, nproc_per_node: int, timeout: float, log_dir: Path) -> None:
    """Run ``python -m module *args`` on ``nnodes x nproc_per_node`` ranks, one torchrun per node.

    Raises:
        RuntimeError: a launch failed or ``timeout`` seconds passed; the message holds each launch's log tail.
    """
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    procs, logs = [], []
    for node in range(nnodes):
        log = open(log_dir / f"node{node}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node), "--node-rank", str(node),
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--rdzv-backend", "static",
            "-m", module, *args,
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
    deadline = time.monotonic() + timeout
    failed = None
    try:
        while any(p.poll() is None for p in procs):
            bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:
                failed = f"node {bad[0]} exited with {procs[bad[0]].returncode}"
                break
            if time.monotonic() > deadline:
                failed = f"timed out after {timeout:.0f} s"
                break
            time.sleep(0.2)
        else:
            bad = [i for i, p in enumerate(procs) if p.returncode != 0]
            if bad:
                failed = f"node {bad[0]} exited with {procs[bad[0]].returncode}"
    finally:
        _kill(procs)
        for log in logs:
            log.close()
    if failed:
        tails = "\n".join(
            f"--- node {n} ---\n" + (log_dir / f"node{n}.log").read_text()[-3000:] for n in range(nnodes)
        )
        raise RuntimeError(f"simulated {nnodes}-node launch failed: {failed}\n{tails}")
