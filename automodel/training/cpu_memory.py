"""Process memory on CPU as the kernel counts it: current RSS and a resettable peak (VmHWM).

On CPU there is no allocator with peak statistics, so memory figures (benchmarks, the memory tests)
come from the kernel: the peak RSS since :func:`reset_peak_rss`, minus the RSS before the measured
work. Fix glibc's mmap threshold (``MALLOC_MMAP_THRESHOLD_=65536`` in the environment of a fresh
process) so that freed tensors leave the RSS instead of staying in glibc's heap.
"""

from __future__ import annotations

import os
import resource

__all__ = ["rss_mib", "reset_peak_rss", "peak_rss_mib", "MMAP_ENV"]

# environment for a fresh process whose RSS should follow its live tensors
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024), "MALLOC_TRIM_THRESHOLD_": str(1024 * 1024)}


def rss_mib() -> float:
    """This process's resident set size now, MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process; False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    """Peak RSS since the last :func:`reset_peak_rss` (or process start), MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
