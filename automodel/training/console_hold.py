"""Hold the setup's console lines back until the setup is agreed to have worked (or for a few seconds).

A mistake in the input is reported as one ``error:`` line (:mod:`automodel.training.user_errors`).
The setup logs a few lines on rank 0's stdout before it reads the data (run directory, world, model
config), and libraries print progress bars and warnings on stderr (``datasets``); when the data then
turns out to be broken those lines would surround the error line. So during the setup stdout and
stderr are :class:`HeldStream` s: what is written to them is kept, and

- written out when the setup succeeded (:meth:`HeldStream.release`), or after ``hold_s`` seconds
  (30, or ``$AUTOMODEL_SETUP_HOLD_S``: a long setup, e.g. loading big weights, shows its progress
  after that delay, and a mistake found later comes after those lines);
- dropped when the run stops on a user error (:meth:`HeldStream.discard`): they are in
  ``<run dir>/logs/rank_0.log`` anyway.

After the first release or discard the stream writes straight through.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import TextIO

__all__ = ["HOLD_S", "HeldConsole", "HeldStream", "hold_console", "hold_seconds"]

HOLD_S = 30.0  # default; $AUTOMODEL_SETUP_HOLD_S overrides it


def hold_seconds() -> float:
    """How long the setup's output is held at most: ``$AUTOMODEL_SETUP_HOLD_S``, else :data:`HOLD_S`."""
    return float(os.environ.get("AUTOMODEL_SETUP_HOLD_S", HOLD_S))


class HeldStream:
    """A text stream that keeps what is written until :meth:`release` / :meth:`discard` (thread safe)."""

    def __init__(self, target: TextIO, hold_s: float | None = HOLD_S):
        self.target = target
        self._held: list[str] | None = []
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        if hold_s is not None:
            self._timer = threading.Timer(hold_s, self.release)
            self._timer.daemon = True
            self._timer.start()

    def write(self, text: str) -> int:
        with self._lock:
            if self._held is not None:
                self._held.append(text)
                return len(text)
        return self.target.write(text)

    def write_past_hold(self, text: str) -> int:
        """Write ``text`` at once, past what is held (the ``error:`` line)."""
        n = self.target.write(text)
        self.target.flush()
        return n

    def flush(self) -> None:
        with self._lock:
            if self._held is not None:
                return
        self.target.flush()

    def _end(self, keep: bool) -> None:
        with self._lock:
            held, self._held = self._held, None
            if self._timer is not None:
                self._timer.cancel()
            if held and keep:
                self.target.write("".join(held))
                self.target.flush()

    def release(self) -> None:
        """Write out what was held; from now on write straight through."""
        self._end(keep=True)

    def discard(self) -> None:
        """Drop what was held; from now on write straight through."""
        self._end(keep=False)

    def isatty(self) -> bool:
        return self.target.isatty()

    def fileno(self) -> int:
        return self.target.fileno()

    def __getattr__(self, name: str):  # encoding, errors, ... of the real stream
        return getattr(self.target, name)


class HeldConsole:
    """``sys.stdout`` and ``sys.stderr`` held together (see :func:`hold_console`)."""

    def __init__(self, hold_s: float | None = None):
        hold_s = hold_seconds() if hold_s is None else hold_s
        self._originals = (sys.stdout, sys.stderr)
        self.streams = (HeldStream(sys.stdout, hold_s), HeldStream(sys.stderr, hold_s))
        sys.stdout, sys.stderr = self.streams  # type: ignore[assignment]

    def restore(self) -> None:
        """Release what is still held and put the original streams back into ``sys`` (mutates it)."""
        self.release()
        if (sys.stdout, sys.stderr) == self.streams:
            sys.stdout, sys.stderr = self._originals

    def release(self) -> None:
        for s in self.streams:
            s.release()

    def discard(self) -> None:
        for s in self.streams:
            s.discard()


def hold_console(hold_s: float | None = None) -> HeldConsole:
    """Replace ``sys.stdout`` and ``sys.stderr`` with :class:`HeldStream` s over them (mutates both).

    Install it before the setup creates its log handlers: a handler keeps the stream it was given.
    The ``error:`` line of a user error goes past the hold (:meth:`HeldStream.write_past_hold`).
    """
    return HeldConsole(hold_s)
