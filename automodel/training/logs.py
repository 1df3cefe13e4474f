"""Logging for a run: every rank to ``<run dir>/logs/rank_<r>.log``, rank 0 also to stdout."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

__all__ = ["setup_logging"]

_FORMAT = "%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s"


def setup_logging(run_dir: Path | None, rank: int, level: str = "INFO") -> None:
    """Configure the ``automodel`` logger (idempotent: replaces handlers it added before)."""
    log = logging.getLogger("automodel")
    log.setLevel(level)
    log.propagate = False
    for h in list(log.handlers):
        if getattr(h, "_automodel", False):
            log.removeHandler(h)
            h.close()
    fmt = logging.Formatter(_FORMAT.format(rank=rank), datefmt="%H:%M:%S")
    if run_dir is not None:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(run_dir / "logs" / f"rank_{rank}.log")
        fh.setFormatter(fmt)
        fh._automodel = True  # type: ignore[attr-defined]
        log.addHandler(fh)
    if rank == 0:
        sh = logging.StreamHandler(sys.stdout)
        sh.setFormatter(fmt)
        sh._automodel = True  # type: ignore[attr-defined]
        log.addHandler(sh)
