"""What a run shows while it trains: plain step lines for cluster logs, a progress bar for terminals.

- Every ``logging.log_every_steps`` optimizer steps (and on the first and the last step) rank 0 logs
  one plain line through the ``automodel`` logger, so it reaches stdout and ``logs/rank_0.log``::

      step 40/120 | loss 3.2145 | lr 2.71e-03 | grad norm 0.812 | 51234 tokens/s (25617/device) | 0.32 s/step | peak mem 1.20 GiB (cpu_peak_rss)

- The tqdm bar (``logging.progress_bar``) runs only when stderr is a terminal: under a scheduler or a
  pipe, tqdm's ``\\r`` frames would be glued to the log lines. While the bar is shown, the console
  handlers of the ``automodel`` logger write through ``tqdm.write`` (the bar is cleared first, then
  redrawn), so a line never lands inside a frame.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["format_step_line", "should_log_step", "progress_bar"]


def format_step_line(record: dict[str, Any], max_steps: int) -> str:
    """One plain line for a train record of :meth:`FinetuneTrainer.train_step` (no logging prefix)."""
    parts = [
        f"step {record['step']}/{max_steps}",
        f"loss {record['loss']:.4f}",
        f"lr {record['lr']:.3e}",
        f"grad norm {record['grad_norm']:.3f}",
        f"{record['tokens_per_s']:.0f} tokens/s ({record['tokens_per_s_per_device']:.0f}/device)",
        f"{record['step_time_s']:.2f} s/step",
        f"peak mem {record['peak_mem_gib']:.2f} GiB ({record['mem_kind']})",
    ]
    return " | ".join(parts)


def should_log_step(step: int, every: int | None, start_step: int, max_steps: int) -> bool:
    """True for step ``step`` (1-based) when step lines are on: every ``every`` steps, the first step of
    this process (``start_step + 1``) and the last step."""
    if every is None:
        return False
    return step % every == 0 or step == start_step + 1 or step == max_steps


@contextlib.contextmanager
def progress_bar(enabled: bool, total: int, initial: int, stream: Any = None) -> Iterator[Any]:
    """A tqdm bar on ``stream`` (default stderr) when ``enabled`` and the stream is a terminal, else None.

    While it is open, the ``automodel`` logger's console handlers write through ``tqdm.write`` (file
    handlers are untouched). Closed on exit.
    """
    stream = sys.stderr if stream is None else stream
    if not enabled or not getattr(stream, "isatty", lambda: False)():
        yield None
        return
    from tqdm import tqdm

    log = logging.getLogger("automodel")
    consoles = [h for h in log.handlers if type(h) is logging.StreamHandler]  # not the FileHandlers
    wrapped = [_ThroughTqdm(h) for h in consoles]
    bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True, file=stream)
    for old, new in zip(consoles, wrapped, strict=True):
        log.removeHandler(old)
        log.addHandler(new)
    try:
        yield bar
    finally:
        for old, new in zip(consoles, wrapped, strict=True):
            log.removeHandler(new)
            log.addHandler(old)
        bar.close()


class _ThroughTqdm(logging.Handler):
    """A console handler's records written with ``tqdm.write``: the bar is cleared, the line written on
    a line of its own, the bar redrawn below it."""

    def __init__(self, inner: logging.StreamHandler) -> None:
        super().__init__(inner.level)
        self.inner = inner
        self.setFormatter(inner.formatter)
        for f in inner.filters:
            self.addFilter(f)

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.inner.stream)
            self.inner.flush()
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)
