"""Per-step metrics as JSON lines (rank 0) and the numbers that go into them."""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["MetricsWriter", "peak_memory_gib", "reset_peak_memory", "read_metrics"]


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
