"""What every benchmark here measures the same way: Linux process memory and CPU time.

* ``proc_status_kib("VmHWM")`` read before any reset: the whole run's peak RSS, what
  decides whether a model fits (docs/design.md, Measuring);
* ``reset_peak_rss()`` then ``proc_status_kib("VmHWM")``: the steady-state peak RSS
  of the steps that ran in between.
* ``cpu_busy_s()`` / ``children_cpu_s()``: how busy the machine and our children
  were, to tell when other processes disturbed a timing.
* ``CPUTensorBytes``: the peak of live CPU tensor bytes on every thread (a counting
  allocator), what ``torch.cuda.max_memory_allocated()`` is on a GPU.
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


_COUNTING_ALLOCATOR_CPP = r"""
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace {
// c10's CPU allocation (c10::alloc_cpu, 64-byte aligned) with a 64-byte header that holds the
// size: every tensor allocation adds its bytes to `live` and its deleter takes them off again,
// on whatever thread the tensor dies. The data pointer is its own context, as c10's default
// allocator gives it (raw_allocate / raw_deallocate work). Allocations of at least kListed
// bytes are listed, so that the run's peak can say which large tensors were alive.
constexpr size_t kHeader = 64;
constexpr int64_t kListed = 1 << 20;

struct CountingCPUAllocator final : c10::Allocator {
  bool installed = false;
  std::mutex mutex;
  int64_t live = 0, window_peak = 0, run_peak = 0, allocations = 0, run_peak_at = 0;
  std::unordered_map<void*, std::pair<int64_t, int64_t>> listed;   // data -> (bytes, allocation number)
  std::vector<std::pair<int64_t, int64_t>> listed_at_run_peak;

  static CountingCPUAllocator& instance() {
    static auto* allocator = new CountingCPUAllocator();   // never destroyed: tensors may outlive main()
    return *allocator;
  }
  static void release(void* data) {
    if (data == nullptr) return;
    char* block = static_cast<char*>(data) - kHeader;
    int64_t bytes;
    std::memcpy(&bytes, block, sizeof(bytes));
    auto& a = instance();
    {
      std::lock_guard<std::mutex> guard(a.mutex);
      a.live -= bytes;
      if (bytes >= kListed) a.listed.erase(data);
    }
    c10::free_cpu(block);
  }
  c10::DataPtr allocate(size_t n) override {
    char* block = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    const int64_t bytes = static_cast<int64_t>(n);
    std::memcpy(block, &bytes, sizeof(bytes));
    void* data = block + kHeader;
    {
      std::lock_guard<std::mutex> guard(mutex);
      live += bytes;
      ++allocations;
      if (bytes >= kListed) listed[data] = {bytes, allocations};
      window_peak = std::max(window_peak, live);
      if (live > run_peak) {
        run_peak = live;
        run_peak_at = allocations;
        listed_at_run_peak.clear();
        for (const auto& entry : listed) listed_at_run_peak.push_back(entry.second);
      }
    }
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
}  // namespace

bool install() {
  auto& a = CountingCPUAllocator::instance();
  if (!a.installed) {
    c10::SetCPUAllocator(&a, /*priority=*/100);
    a.installed = true;
  }
  return c10::GetCPUAllocator() == &a;
}
// live bytes, the window's peak, the run's peak, allocations so far, the allocation that set the run's peak
std::vector<int64_t> counters() {
  auto& a = CountingCPUAllocator::instance();
  std::lock_guard<std::mutex> guard(a.mutex);
  return {a.live, a.window_peak, a.run_peak, a.allocations, a.run_peak_at};
}
void reset_window() {   // the window's peak from now on: live bytes
  auto& a = CountingCPUAllocator::instance();
  std::lock_guard<std::mutex> guard(a.mutex);
  a.window_peak = a.live;
}
void reset_run() {   // the run starts now
  auto& a = CountingCPUAllocator::instance();
  std::lock_guard<std::mutex> guard(a.mutex);
  a.window_peak = a.run_peak = a.live;
  a.run_peak_at = a.allocations;
  a.listed_at_run_peak.clear();
}
// (bytes, allocation number) of every listed tensor alive when the run's peak was set
std::vector<std::vector<int64_t>> listed_at_run_peak() {
  auto& a = CountingCPUAllocator::instance();
  std::lock_guard<std::mutex> guard(a.mutex);
  std::vector<std::vector<int64_t>> out;
  for (const auto& entry : a.listed_at_run_peak) out.push_back({entry.first, entry.second});
  return out;
}
"""


class CPUTensorBytes:
    """Child side: the peak of live CPU tensor bytes, counted by the allocator on every thread.

    What ``torch.cuda.max_memory_allocated()`` is on a GPU, for CPU tensors. ``load()``
    builds (once per machine, ~20 s; cached by ``torch.utils.cpp_extension``) and
    ``start()`` installs a c10 CPU allocator that allocates as c10's default one does
    (``c10::alloc_cpu``) with a 64-byte header holding the size: each allocation adds its
    size to a running total and its deleter subtracts it, on whichever thread the tensor
    dies (a gloo worker's included), under a mutex. The maximum of that total is the peak
    of live tensor bytes allocated since ``start()``: no glibc retention, no compile
    state, no tensor allocated before ``start()`` (nor its free). Memory still comes from
    glibc as before (64 bytes more per tensor), so RSS is measured in the same process.
    Tensors of 1 MiB or more are listed, so ``stop()`` also says which were alive at the
    run's peak. Once installed it stays for the life of the process; torch.profiler's
    memory events no longer see CPU allocations (c10's default allocator reports them,
    this one does not).
    """

    def __init__(self) -> None:
        self.on = False
        self._ext = None
        self._marks: dict[str, dict] = {}

    def load(self) -> None:
        """Build (or find) and import the allocator, not yet installed: do it before reading an
        RSS baseline, so that the module's own pages are not counted as the run's."""
        if self._ext is not None:
            return
        from torch.utils.cpp_extension import load_inline
        self._ext = load_inline("optpass_bench_counting_cpu_allocator", cpp_sources=_COUNTING_ALLOCATOR_CPP,
                                functions=["install", "counters", "reset_window", "reset_run",
                                           "listed_at_run_peak"], extra_cflags=["-O2"])

    def start(self) -> None:
        """Install the allocator: tensors allocated from here on are counted."""
        self.load()
        if not self._ext.install():
            raise RuntimeError("another CPU allocator with a higher priority is installed")
        self._ext.reset_run()
        self.on = True

    def mark(self, name: str):
        """A context manager: a named range whose own peak and end value ``stop()`` reports."""
        import contextlib

        @contextlib.contextmanager
        def measured():
            if not self.on:
                yield
                return
            self._ext.reset_window()
            first = self._ext.counters()[3] + 1
            try:
                yield
            finally:
                live, window_peak, _, allocations, _ = self._ext.counters()
                self._marks[name] = {"peak_bytes": window_peak, "end_bytes": live,
                                     "allocations": (first, allocations)}
        return measured()

    def stop(self) -> dict:
        """``peak_bytes``, ``end_bytes``, ``allocations``, per mark ``{name: {"peak_bytes",
        "end_bytes"}}`` (``end_bytes``: live at the range's end; a name marked twice keeps its
        last range), and ``peak_in`` (the mark the run's peak fell in) with ``alive_at_peak``:
        the sizes of the tensors of 1 MiB or more alive at the run's peak that were allocated
        in that mark, largest first. The allocator stays installed; counting goes on."""
        live, _, run_peak, allocations, run_peak_at = self._ext.counters()
        self.on = False
        peak_in = next((name for name, m in self._marks.items()
                        if m["allocations"][0] <= run_peak_at <= m["allocations"][1]), None)
        since = self._marks[peak_in]["allocations"][0] if peak_in else 0
        alive = sorted((b for b, number in self._ext.listed_at_run_peak() if number >= since), reverse=True)
        return {"peak_bytes": run_peak, "end_bytes": live, "allocations": allocations, "peak_in": peak_in,
                "alive_at_peak": alive,
                "marks": {k: {"peak_bytes": m["peak_bytes"], "end_bytes": m["end_bytes"]}
                          for k, m in self._marks.items()}}
