"""What every benchmark here measures the same way: Linux process memory and CPU time.

* ``reset_peak_rss()`` then ``proc_status_kib("VmHWM")``: the steady-state peak RSS
  of the steps that ran in between (DESIGN.md, Measuring).
* ``malloc_trim()``: hand the heap's free pages back to the OS (glibc keeps them in RSS).
* ``cpu_busy_s()`` / ``children_cpu_s()``: how busy the machine and our children
  were, to tell when other processes disturbed a timing.
"""

from __future__ import annotations

import os
import resource
import statistics


def proc_status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmHWM, VmRSS, ...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def malloc_trim() -> bool:
    """glibc: give the free pages of the heap back to the OS (what warm-up freed stays in RSS otherwise)."""
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def cpu_busy_s() -> float | None:
    """Busy CPU seconds of the whole machine so far (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def median(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")
