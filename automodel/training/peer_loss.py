"""A rank lost during training (SIGKILL, OOM killer, a node going down): the others stop quietly.

When a rank dies in the middle of a step, every other rank fails in its next collective with that
rank (gloo: ``Connection reset by peer`` / ``closed by peer``; NCCL: an aborted communicator or a
remote error), and torch's elastic agent sends the local survivors SIGTERM. Without care each
survivor prints a traceback of the failed collective, which says nothing about which rank was lost.

:func:`stop_quietly_if_peer_lost` runs the training phase; when it fails with such a communication
error it writes the traceback to the rank's log file (``<run dir>/logs/rank_<r>.log``), ignores the
launcher's SIGTERM from then on, and raises :class:`~automodel.training.user_errors.RunAborted` with
:data:`EXIT_LOST_RANK`. Under the ``automodel`` command (which sets :data:`LAUNCHER_ENV`) the survivors
print nothing: the command knows which rank died (its exit status) and prints the one line. Under
plain ``torchrun`` each survivor prints one ``error: [rank r] ...`` line (torchrun's own report names
the dead rank). Either way ``checkpoint.resume=auto`` continues from the newest good checkpoint.

Any other exception (a bug) propagates unchanged, with its traceback.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from automodel.training.user_errors import RunAborted, global_rank, print_user_error

__all__ = ["EXIT_LOST_RANK", "LAUNCHER_ENV", "is_peer_loss", "stop_quietly_if_peer_lost"]

logger = logging.getLogger("automodel.peer_loss")

EXIT_LOST_RANK = 4  # distinct from 1 (a bug), 2 (a mistake in the input), 3 (non-finite numbers)
LAUNCHER_ENV = "AUTOMODEL_LAUNCHER"  # "cli": the automodel command launched the ranks and reports a lost one
T = TypeVar("T")

# what the process-group backends say when the other end of a collective is gone
_PEER_LOSS_MARKERS = (
    "connection reset by peer",
    "connection closed by peer",
    "connection refused",
    "broken pipe",
    "gloo/transport",
    "communicator was aborted",
    "ncclremoteerror",
    "remote process exited",
    "nccl watchdog",
)


def is_peer_loss(exc: BaseException) -> bool:
    """True when ``exc`` (or an exception in its cause / context chain) is a collective that failed
    because another rank went away: a ``torch.distributed.DistError`` or a ``RuntimeError`` with one of
    the backends' messages for it."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, getattr(dist, "DistNetworkError", ())) or isinstance(
            cur, getattr(dist, "DistBackendError", ())
        ):
            return True
        if isinstance(cur, RuntimeError) and any(m in str(cur).lower() for m in _PEER_LOSS_MARKERS):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _log_to_files(text: str) -> None:
    log = logging.getLogger("automodel")
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s", (text,), None)
    for h in log.handlers:
        if isinstance(h, logging.FileHandler):
            h.handle(record)


def _first_line(exc: BaseException) -> str:
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return line if len(line) <= 200 else line[:197] + "..."


def stop_quietly_if_peer_lost(fn: Callable[[], T], step: Callable[[], int] | None = None) -> T:
    """Run ``fn()`` (the training phase); a collective failed by a lost rank becomes
    :class:`RunAborted` (:data:`EXIT_LOST_RANK`) without a traceback on the terminal.

    Args:
        fn: the phase.
        step: returns the optimizer step the run had reached (for the message), or None.

    Raises:
        RunAborted: ``fn`` failed because another rank was lost (see the module docstring).
        BaseException: anything else ``fn`` raised, unchanged.
    """
    try:
        return fn()
    except Exception as exc:
        if isinstance(exc, RunAborted) or not is_peer_loss(exc):
            raise
        try:  # the launcher's SIGTERM to the survivors: exit with our code, not -15
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        except ValueError:  # not the main thread
            pass
        rank = global_rank()
        at = ""
        if step is not None:
            try:
                at = f" after step {step()}"
            except Exception:  # noqa: BLE001 - the message only
                at = ""
        message = (
            f"lost contact with another rank during training{at} ({_first_line(exc)}): a rank died or its "
            f"node went down (the launcher's report names it); resume with checkpoint.resume=auto"
        )
        _log_to_files(f"rank {rank}: {message}\n{''.join(traceback.format_exception(exc))}")
        if os.environ.get(LAUNCHER_ENV) != "cli":
            print_user_error(message, rank_prefix=rank)
        raise RunAborted(EXIT_LOST_RANK, message) from None
