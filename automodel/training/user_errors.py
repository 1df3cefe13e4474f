"""One ``error:`` line for a mistake in the user's input, whichever rank found it.

A run launched with ``torchrun`` has N copies of the recipe. A mistake in the input (a malformed
jsonl line, a missing tokenizer, a model directory without ``config.json``, a checkpoint of another
model; see :class:`automodel.errors.UserInputError`) would otherwise print N tracebacks, or none
from rank 0 when only one node lacks a file, while rank 0 waits forever in the next collective.
Here:

- :func:`run_phase` runs one phase of the recipe (setup, training) on every rank. At the end of
  setup every rank takes part in one agreement (:func:`agree_on_failure`: an ``all_gather_object``
  of "ok" / the error message on a gloo group), so a rank that failed early waits for the others
  instead of leaving them in a collective, and rank 0 prints the message of the lowest failed rank
  once (then any different message of another rank, once each). Every rank then raises
  :class:`RunAborted` with exit code 2; the recipe returns it.
- The full traceback goes to ``<run dir>/logs/rank_<r>.log`` through the ``automodel`` logger
  (:func:`automodel.training.logs.setup_logging`), never to the terminal.
- Any other exception is a programming error: it propagates with its traceback at once (no
  agreement, so torchrun stops the other ranks as it always did).

Errors during training: today's datasets read and check all their data in setup, so no user
error is raised during training; a lazily reading dataset could. When one happens on every rank
(the usual case: every rank sees the same input) the same agreement runs on a group with a short
timeout (:data:`TRAIN_AGREEMENT_TIMEOUT_S`); if the other ranks do not join in time (they are
still training), the failing rank prints its own message, prefixed with its rank, and exits 2.

What is left: a rank that fails in setup while the others wait for it inside a collective of the
setup itself (only checkpoint loading has one, after every check that reads shared files) waits in
the agreement until the process group's timeout. Checks therefore run before collectives.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from automodel.errors import UserInputError

__all__ = [
    "EXIT_USER_ERROR",
    "TRAIN_AGREEMENT_TIMEOUT_S",
    "RunAborted",
    "find_user_error",
    "global_rank",
    "print_user_error",
    "agree_on_failure",
    "agreement_group",
    "run_phase",
    "run_guarded",
    "agree_before_collectives",
    "report_error_before_setup",
    "stop_run_agreed",
    "exit_process",
]

logger = logging.getLogger("automodel.user_errors")

EXIT_USER_ERROR = 2
TRAIN_AGREEMENT_TIMEOUT_S = 60.0
T = TypeVar("T")


class RunAborted(Exception):
    """Raised on every rank after a user error was agreed on and reported; carries the exit code."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code
        self.message = message


def find_user_error(exc: BaseException) -> UserInputError | None:
    """The :class:`UserInputError` that caused ``exc``: ``exc`` itself, or one in its ``__cause__``
    chain (``raise ... from e``, e.g. Hydra's ``InstantiationException``), else None.

    ``__context__`` is not followed: a bug raised while handling a user error is still a bug.
    """
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, UserInputError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__
    return None


def global_rank() -> int:
    """This process's global rank: from the process group if there is one, else ``$RANK`` (0)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def print_user_error(message: str, rank_prefix: int | None = None) -> None:
    """Print ``error: <message>`` to stderr (flushed). ``rank_prefix`` adds ``[rank r]``."""
    where = f"[rank {rank_prefix}] " if rank_prefix is not None else ""
    stream = sys.stderr  # while the setup's output is held (console_hold.HeldStream), the error goes through
    getattr(stream, "write_past_hold", stream.write)(f"error: {where}{message}\n")
    stream.flush()


def _log_traceback(exc: BaseException) -> Path | None:
    """Write ``exc``'s traceback to this rank's run log file; return the file (None: no log file yet).

    The ``automodel`` logger writes to ``<run dir>/logs/rank_<r>.log`` once the trainer made the run
    directory, before it reads any user input (and to stdout on rank 0: the traceback goes to the
    file handlers only).
    """
    text = "".join(traceback.format_exception(exc))
    log = logging.getLogger("automodel")
    files = [h for h in log.handlers if isinstance(h, logging.FileHandler)]
    if files:
        record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "user input error:\n%s", (text,), None)
        for h in files:
            h.handle(record)
        return Path(files[0].baseFilename)
    return None


def agreement_group(timeout_s: float | None = None) -> dist.ProcessGroup | None:
    """A gloo group over all ranks for :func:`agree_on_failure`. Collective (every rank calls it).

    None (the default group) when that is gloo and no timeout is asked; else a new gloo group, with
    ``timeout_s`` as its collectives' timeout when given.
    """
    if timeout_s is None and dist.get_backend() == "gloo":
        return None
    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s is not None else {}
    return dist.new_group(backend="gloo", **kwargs)


def agree_on_failure(message: str | None, group: dist.ProcessGroup | None = None) -> list[str | None]:
    """Exchange this rank's ``message`` (None = ok) with every rank; return all of them by rank.

    Collective over ``group`` (default: the world); objects travel through pickling, so ``group``
    should be a gloo group. Without a process group (or on one rank) returns ``[message]``.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [message]
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, message, group=group)
    return gathered


def _report(messages: list[str | None]) -> RunAborted:
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    first_rank, first = failed[0]
    if global_rank() == 0:
        print_user_error(first)
        others = sorted({m for _, m in failed if m != first})
        for m in others:  # ranks that disagree (e.g. a different file missing per node): each once
            print_user_error(m)
    logger.debug("user error agreed: ranks %s failed", [r for r, _ in failed])
    return RunAborted(EXIT_USER_ERROR, first)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _finish_collectively(group: dist.ProcessGroup | None) -> None:
    """Let rank 0 print before any rank exits (torchrun stops the rest as soon as one exits).

    From here on this rank ignores SIGTERM: torchrun sends it as soon as another rank has exited,
    and this rank is about to exit 2 itself (a Python handler would not do: the interpreter resets
    those to the default while it shuts down, and the rank would show up as -15 in torchrun's report).
    """
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass
    try:
        dist.barrier(group=group)
    except Exception:  # a broken group: exiting is all that is left
        pass


def run_phase(
    fn: Callable[[], T],
    *,
    name: str = "setup",
    agree_on_success: bool = True,
    group: dist.ProcessGroup | None | Callable[[], dist.ProcessGroup | None] = agreement_group,
) -> T:
    """Run ``fn()`` on every rank; turn user errors into one ``error:`` line and :class:`RunAborted`.

    Args:
        fn: the phase (e.g. ``trainer.setup``). It may initialise the process group itself.
        name: the phase's name, for the logs.
        agree_on_success: take part in the agreement also when ``fn`` succeeded (setup: yes, so a
            rank that failed early is never left alone in a collective; training: no, a
            finished run does not wait for anyone).
        group: the gloo group of the agreement, or a function that makes it once ``fn`` returned or
            failed (the default, :func:`agreement_group`, for a phase that creates the process
            group). If its collectives time out (the others are busy elsewhere), the failing rank
            prints its own message with a ``[rank r]`` prefix.

    Raises:
        RunAborted: on every rank, after rank 0 printed the error, when any rank had a user error.
        BaseException: anything else ``fn`` raised, unchanged (programming errors keep their
            traceback; the other ranks are stopped by torchrun).
    """
    try:
        result = fn()
    except RunAborted:  # agreed and reported inside the phase (agree_before_collectives)
        raise
    except BaseException as exc:
        user = find_user_error(exc)
        if user is None:
            raise
        where = _log_traceback(exc)
        if where is not None:
            logger.debug("traceback of the user error in %s written to %s", name, where)
        message = str(user)
        if not _distributed():
            if global_rank() == 0:
                print_user_error(message)
            raise RunAborted(EXIT_USER_ERROR, message) from None
        try:
            g = group() if callable(group) else group
            messages = agree_on_failure(message, g)
        except Exception:  # the others did not come (busy in another collective, or training on)
            print_user_error(message, rank_prefix=None if global_rank() == 0 else global_rank())
            raise RunAborted(EXIT_USER_ERROR, message) from None
        aborted = _report(messages)
        _finish_collectively(g)
        raise aborted from None
    if agree_on_success and _distributed():
        g = group() if callable(group) else group
        messages = agree_on_failure(None, g)
        if any(m is not None for m in messages):
            aborted = _report(messages)
            _finish_collectively(g)
            raise aborted
    return result


def agree_before_collectives() -> None:
    """Meet every rank in an agreement before a step of a phase that runs collectives of its own.

    Called inside a phase run by :func:`run_phase` (e.g. the trainer's setup, before the CP self-check
    runs forward/backward collectives): a rank that failed earlier in the phase is in
    :func:`run_phase`'s failure agreement, and this call is the same agreement on the ranks that did
    not fail, so no rank is left alone in a mismatched collective. Raises :class:`RunAborted` (after
    rank 0 printed the error) when any rank failed; a no-op without a process group. Every rank of the
    phase must call it at the same point.
    """
    if not _distributed():
        return
    g = agreement_group()
    messages = agree_on_failure(None, g)
    if any(m is not None for m in messages):
        aborted = _report(messages)
        _finish_collectively(g)
        raise aborted


def run_guarded(
    setup: Callable[[], None], train: Callable[[], T], *, train_timeout_s: float = TRAIN_AGREEMENT_TIMEOUT_S
) -> T:
    """``setup()`` then ``train()`` on every rank, user errors reported once (see the module doc).

    Setup ends with an agreement on every rank; training agrees only on failure, on a gloo group
    made after setup with a ``train_timeout_s`` timeout. Raises :class:`RunAborted`.
    """
    run_phase(setup, name="setup")
    train_group = agreement_group(train_timeout_s) if _distributed() else None
    return run_phase(train, name="training", agree_on_success=False, group=train_group)


def report_error_before_setup(message: str, timeout_s: float = 60.0) -> int:
    """Report a mistake found before the process group exists (the config) once; return exit code 2.

    Without torchrun (no ``$WORLD_SIZE`` > 1) rank 0 prints ``error: <message>``. Under torchrun every
    rank validated the same config and found the same mistake: the ranks join a gloo process group
    only to agree (:func:`agree_on_failure`), rank 0 prints, and no rank exits before rank 0 printed
    (a rank exiting first would get rank 0 killed by the launcher before its line is out). If the
    group cannot be formed within ``timeout_s``, each rank prints its own message (``[rank r]`` on
    ranks > 0) rather than none.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or "MASTER_ADDR" not in os.environ or dist.is_initialized():
        if global_rank() == 0:
            print_user_error(message)
        return EXIT_USER_ERROR
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
        messages = agree_on_failure(message)
    except Exception:
        rank = int(os.environ.get("RANK", "0"))
        print_user_error(message, rank_prefix=None if rank == 0 else rank)
        return EXIT_USER_ERROR
    _report(messages)
    _finish_collectively(None)
    return EXIT_USER_ERROR


def stop_run_agreed(message: str, exit_code: int) -> RunAborted:
    """End a run that every rank decided to stop at the same point (an all-reduced flag, e.g. a non-finite
    loss: :mod:`automodel.training.nonfinite`): rank 0 prints ``error: <message>`` once, the message goes
    to each rank's log file (not the terminal), and no rank returns before rank 0 printed. Returns the
    :class:`RunAborted` (``exit_code``) for the caller to raise; :func:`run_phase` passes it through.
    Collective over the world when there is a process group.
    """
    log = logging.getLogger("automodel")
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "run stopped: %s", (message,), None)
    for h in log.handlers:
        if isinstance(h, logging.FileHandler):
            h.handle(record)
    if global_rank() == 0:
        print_user_error(message)
    if _distributed():
        _finish_collectively(None)
    return RunAborted(exit_code, message)


def exit_process(code: int, keep: tuple[int, ...] = (0,)) -> None:
    """End the process with ``code``. A stopped run (a code not in ``keep``) skips the interpreter's
    finalization once its output and logs are flushed: there, gloo's worker threads can still hold
    tensors of a failed collective and abort the process (SIGABRT, "terminate called without an active
    exception"), which would turn the exit code every rank agreed on into a signal in the launcher's
    report. Codes in ``keep`` exit normally (``sys.exit``), with every ``atexit`` handler."""
    if code in keep:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
