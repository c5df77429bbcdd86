"""What every benchmark here measures the same way: Linux process memory and CPU time.

* ``proc_status_kib("VmHWM")`` read before any reset: the whole run's peak RSS, what
  decides whether a model fits (DESIGN.md, Measuring);
* ``reset_peak_rss()`` then ``proc_status_kib("VmHWM")``: the steady-state peak RSS
  of the steps that ran in between.
* ``cpu_busy_s()`` / ``children_cpu_s()``: how busy the machine and our children
  were, to tell when other processes disturbed a timing.
* ``emit_result(dict)`` in a child, ``run_child(cmd, env, timeout)`` in the parent:
  run one variant in a fresh process and get back its numbers.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import time

RESULT_PREFIX = "RESULT:"


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


def emit_result(result: dict) -> None:
    """Child side: print the numbers as the one line ``run_child`` parses."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_child(cmd: list[str], env: dict | None = None, timeout: float | None = None) -> dict:
    """Run ``cmd`` (a fresh process that calls ``emit_result``) and return its result.

    Adds ``process_wall_s``, ``other_processes_cores`` (cores kept busy by processes other
    than this child, on average over its run; None off Linux) and ``stderr_warnings``.
    Exits with the tails of the child's output when it fails, times out or prints no result.
    """
    cpu_before, ours_before = cpu_busy_s(), children_cpu_s()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise SystemExit(f"child timed out after {timeout}s: {' '.join(cmd)}\n"
                         f"--- stderr tail ---\n{err[-4000:]}")
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"child failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                         f"--- stdout tail ---\n{proc.stdout[-3000:]}\n--- stderr tail ---\n{proc.stderr[-6000:]}")
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    result["process_wall_s"] = round(wall, 2)
    cpu_after, ours_after = cpu_busy_s(), children_cpu_s()
    result["other_processes_cores"] = None if cpu_before is None or cpu_after is None else round(
        max(0.0, (cpu_after - cpu_before) - (ours_after - ours_before)) / wall, 2)
    result["stderr_warnings"] = sorted({ln.strip() for ln in proc.stderr.splitlines() if "Warning" in ln})[:20]
    return result


class LiveTensorBytes:
    """Child side: the peak of live CPU tensor bytes, from the profiler's allocation events.

    What ``torch.cuda.max_memory_allocated()`` is on a GPU, for CPU tensors: every
    allocation and free of the c10 CPU allocator while profiling is on is reported
    with ``total_allocated``, the allocator's running sum of the bytes it handed out
    since profiling started and has not got back (kept under its lock, so in true
    order). Its maximum is the peak of live tensor bytes: no glibc retention, no
    compile state, no tensors that were alive before ``start()`` (imports).

    The profiler is enabled through ``torch.autograd._enable_profiler`` with
    ``profile_memory=True`` and only the user scope, so it records allocations and
    ``mark()`` ranges but not one event per operator (the public
    ``torch.profiler.profile`` records every op, compiling included, which costs RSS
    and time). Caveat: the reporting is per thread; only threads that run with the
    profiler's thread-local state are seen (the main thread, autograd's), so a
    tensor freed on another thread (a gloo worker) would be missed, and the running
    total would stay that much too high from then on (c10's
    ``ProfiledCPUMemoryReporter::Delete`` counts a free only on a thread with memory
    profiling on): ``stop()`` returns the live bytes at the end of every mark, which
    shows such drift (none in bench/mixed_precision.py's runs: 8.0055 B/param after
    every zero1 step).
    """

    def __init__(self) -> None:
        self.on = False
        self.names: set[str] = set()

    def start(self) -> None:
        import torch
        from torch._C._profiler import (ProfilerActivity, ProfilerConfig, ProfilerState, RecordScope,
                                        _ExperimentalConfig)
        config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
        torch.autograd._prepare_profiler(config, {ProfilerActivity.CPU})
        torch.autograd._enable_profiler(config, {ProfilerActivity.CPU}, {RecordScope.USER_SCOPE})
        self.on = True

    def mark(self, name: str):
        """A context manager: a named range whose own peak and end value ``stop()`` reports."""
        import contextlib

        import torch
        self.names.add(name)
        return torch.profiler.record_function(name) if self.on else contextlib.nullcontext()

    def stop(self) -> dict:
        """Stop profiling; ``peak_bytes``, ``end_bytes``, ``events`` and per mark
        ``{name: {"peak_bytes", "end_bytes"}}`` (``end_bytes``: live at the range's end);
        a name marked twice keeps its last range."""
        import torch
        from torch._C._profiler import _EventType

        result = torch.autograd._disable_profiler()
        self.on = False
        allocs, marks, stack = [], [], list(result.experimental_event_tree())
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            if e.tag == _EventType.Allocation:
                allocs.append((e.start_time_ns, e.extra_fields.total_allocated, e.extra_fields.alloc_size))
            elif e.tag == _EventType.TorchOp and e.name in self.names:   # not torch's own (gloo:..., Optimizer...)
                marks.append((e.start_time_ns, e.start_time_ns + e.duration_time_ns, e.name))
        allocs.sort()
        running = running_peak = 0
        for _, _, size in allocs:                      # cross-check: the sum of the sizes, in time order
            running += size
            running_peak = max(running_peak, running)
        import bisect
        times = [a[0] for a in allocs]
        per_mark = {}
        for t0, t1, name in sorted(marks):
            i, j = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1)
            live_at_start = allocs[i - 1][1] if i else 0
            per_mark[name] = {"peak_bytes": max([live_at_start] + [a[1] for a in allocs[i:j]]),
                              "end_bytes": allocs[j - 1][1] if j else 0}
        return {"peak_bytes": max((a[1] for a in allocs), default=0),
                "end_bytes": allocs[-1][1] if allocs else 0,
                "running_sum_peak_bytes": running_peak, "events": len(allocs), "marks": per_mark}
