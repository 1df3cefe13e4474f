"""Per-step metrics as JSON lines (rank 0) and the numbers that go into them."""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["MetricsWriter", "SUPERSEDED_METRICS", "peak_memory_gib", "reset_peak_memory", "read_metrics", "supersede_metrics"]

SUPERSEDED_METRICS = "metrics.superseded.jsonl"  # beside metrics.jsonl: records a resume from an earlier step dropped


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (CUDA only; CPU reports the process peak RSS)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> tuple[float, str]:
    """``(GiB, kind)``: CUDA max allocated since the last reset, or the process peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "cuda_max_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    scale = 1 if sys.platform == "darwin" else 1024
    return rss * scale / 2**30, "cpu_peak_rss"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no inf/nan
    return value


class MetricsWriter:
    """Append one JSON object per line to ``path``; a no-op unless ``enabled`` (rank 0)."""

    def __init__(self, path: str | Path, enabled: bool):
        self.path = Path(path)
        self.enabled = enabled
        self._fh = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            return
        self._fh.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics file, in order."""
    with Path(path).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def supersede_metrics(path: str | Path, step: int) -> int:
    """Keep in ``path`` only the records of steps ``<= step``; move the others to ``metrics.superseded.jsonl``.

    A run that resumes ``step_<step>`` continues the metrics of that run from there: records of later
    steps (written before a crash, or by the trajectory an explicit ``resume_from`` of an earlier step
    abandoned) would otherwise stand twice. A line that is not JSON (a write cut by a crash) is moved too.
    Appends to the superseded file (nothing is lost); returns how many lines moved. A no-op without ``path``.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    keep, drop = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            record_step = json.loads(line).get("step")
        except (json.JSONDecodeError, AttributeError):
            record_step = None
        (keep if isinstance(record_step, int) and record_step <= step else drop).append(line)
    if drop:
        with (path.parent / SUPERSEDED_METRICS).open("a", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in drop))
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
        tmp.replace(path)
    return len(drop)
