"""Run a function on N local gloo ranks and collect what each rank returns.

For tests and benchmarks on one machine (CPU, gloo on 127.0.0.1): one call starts ``world_size``
processes, initialises ``torch.distributed`` in each, calls the target, and returns the
per-rank results. A failure on any rank, or a hang past ``timeout``, raises ``RuntimeError``
carrying every failed rank's traceback (after a hang: every thread's stack, where it waited), and every worker
is killed so a hang never blocks. The ranks meet through a file in the launch's own temporary folder
(``init_method=file://``), so launches running at once never share a rendezvous.

The target is named ``"package.module:function"`` (importable in the workers: they inherit the
parent's ``sys.path``) and is called as ``function(rank, world_size, **kwargs)``; whatever it
returns must be picklable (tensors are fine). Each worker runs with one intra-op thread.

Start-up: importing torch and transformers costs a rank ~5 s of CPU, more than many tests' work. The ranks
are therefore forked from a ``forkserver`` that imported :data:`PRELOAD` once per launching process (the
target's own modules are imported in each rank, as with ``spawn``). The server runs under the environment
of the launch (a launch after a change of ``os.environ``, other than :data:`IGNORED_ENV`, restarts it), so a
variable read at interpreter start or at import reaches the ranks as with ``spawn``;
``AUTOMODEL_LAUNCH_START=spawn`` starts a fresh interpreter per rank instead.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import signal
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

__all__ = ["PRELOAD", "RANK_ENV", "free_port", "run_on_ranks"]

#: third-party modules the forkserver imports once, so that a forked rank finds them imported already
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.llama.modeling_llama",
)

#: set by each rank itself (:func:`_worker`), so a change of them in the launching process changes nothing
RANK_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
#: also left out of the comparison: pytest names the running test in it, which no rank reads
IGNORED_ENV = (*RANK_ENV, "PYTEST_CURRENT_TEST")

_forkserver_env: dict[str, str] | None = None  # the environment the running forkserver started with


def _start_context():
    """``forkserver`` with :data:`PRELOAD`, started under the launching process's current environment (a server
    started under another one is stopped first); ``spawn`` where that cannot be done or is asked for."""
    global _forkserver_env
    if os.environ.get("AUTOMODEL_LAUNCH_START", "forkserver") == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    env = {k: v for k, v in os.environ.items() if k not in IGNORED_ENV}
    if _forkserver_env is not None and env != _forkserver_env:
        stop = getattr(getattr(forkserver, "_forkserver", None), "_stop", None)  # CPython's (3.8+), no public one
        if stop is None:
            return mp.get_context("spawn")
        stop()  # the next start runs a server under this environment
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    _forkserver_env = env
    return ctx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(target: str, rank: int, world_size: int, port: int, kwargs: dict, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    out = Path(out_dir) / f"rank{rank}.pt"
    # SIGUSR1 (sent by run_on_ranks on a time-out, before the kill) writes every thread's stack here
    stacks = open(Path(out_dir) / f"rank{rank}.stacks", "w")  # noqa: SIM115 - open for the process's life
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        import torch.distributed as dist

        from automodel.distributed.mesh import destroy_distributed

        # The rendezvous is a file in this launch's own folder, not a TCP port: two launches at once (pytest-xdist
        # workers) can never meet in one store, as they could through a port that free_port() handed to both.
        dist.init_process_group("gloo", init_method=f"file://{Path(out_dir) / 'store'}", rank=rank,
                                world_size=world_size)  # fmt: skip
        module_name, fn_name = target.split(":")
        fn = getattr(importlib.import_module(module_name), fn_name)
        result = fn(rank, world_size, **kwargs)
        torch.save({"ok": True, "result": result}, out)
        dist.barrier()
        destroy_distributed()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        raise


def run_on_ranks(target: str, world_size: int = 2, timeout: float = 600.0, **kwargs: Any) -> list[Any]:
    """Run ``target`` on ``world_size`` gloo ranks; return the list of per-rank results.

    Raises:
        RuntimeError: a rank failed (its traceback is in the message) or ``timeout`` seconds passed.
    """
    ctx = _start_context()
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(target=_worker, args=(target, r, world_size, port, kwargs, out_dir))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        timed_out = False
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                timed_out = True
                break
        if timed_out:
            for p in procs:  # where each rank waits: its stacks, written by faulthandler (see _worker)
                if p.is_alive() and p.pid is not None:
                    os.kill(p.pid, signal.SIGUSR1)
            time.sleep(2.0)
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(10)
        results, errors = [], []
        for r in range(world_size):
            f = Path(out_dir) / f"rank{r}.pt"
            if not f.exists():
                stacks = Path(out_dir) / f"rank{r}.stacks"
                where = stacks.read_text()[-6000:] if timed_out and stacks.exists() else ""
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode})" + (f"; its stacks:\n{where}" if where else ""))
                results.append(None)
                continue
            payload = torch.load(f, weights_only=False)
            if payload["ok"]:
                results.append(payload["result"])
            else:
                errors.append(f"rank {r}:\n{payload['error']}")
                results.append(None)
        if timed_out:
            errors.insert(0, f"timed out after {timeout:.0f}s running {target} on {world_size} ranks")
        if errors:
            raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
        return results
