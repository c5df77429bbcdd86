"""A c10 CPU allocator that counts live tensor bytes on every thread: what ``measure_tensor_peak``
and the benches read.

Why an allocator: torch.profiler's memory events are recorded per thread, for the threads the
profiler was started on. A collective on gloo allocates and frees buffers on gloo's worker threads,
and a tensor made on the main thread often dies there (its last reference is the work object the
worker drops): the profiler misses those frees, so a block of fully sharded steps drifts upward (a
functional all-gather on 2 ranks left its whole output counted alive after the block).
A Python thread's allocations are missed the same way, and the profiler's "all threads" mode records
no memory events at all (torch 2.13). What the allocator counts is what
``torch.cuda.max_memory_allocated`` counts on a GPU: bytes handed to tensors, not glibc's heap.

How: c10's CPU allocation (``c10::alloc_cpu``, 64-byte aligned) with a 64-byte header that holds
the size. Each allocation adds its bytes to a running total and its deleter takes them off again, on
whatever thread the tensor dies, under a mutex. Every open measurement window keeps the highest
total seen since it opened. Allocations still report to torch.profiler (``profile_memory=True``
keeps working for the threads it sees). Tensors of at least 1 MiB are listed, so that a run's peak
can say which large tensors were alive at it and whether each was made on the thread that installed
the allocator or on another (a collective's buffers, made on gloo's worker threads): the benches use this.

It is compiled from the C++ below with ``torch.utils.cpp_extension.load_inline`` the first time it
is needed (a C++ compiler and ninja; about 20 s, then cached by torch in ``TORCH_EXTENSIONS_DIR``).
Once installed it stays installed for the life of the process (tensors it allocated may die any time
later, and a free it did not see would be a wrong count); memory still comes from glibc as before,
64 bytes more per tensor. A tensor allocated before it was installed is counted once it is adopted
(``adopt(tensor)``: its storage's memory is handed to a deleter that takes its bytes off when it dies,
no copy; ``measure_tensor_peak`` adopts every storage reachable from Python when a block opens);
until then neither it nor its free is counted.
"""

from __future__ import annotations

import threading

_SOURCE = r"""
#include <torch/extension.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <unordered_map>

namespace {
constexpr size_t kHeader = 64;
constexpr int64_t kListed = 1 << 20;

struct Window { int64_t start_live, peak, start_events; };

// A tensor's memory allocated before the counting allocator was installed, counted from its adoption
// on: the storage's DataPtr is swapped for one whose deleter takes its bytes off and then frees it
// through the original DataPtr (same address: no copy).
struct Adopted { c10::DataPtr original; int64_t bytes; };

struct CountingCPUAllocator final : c10::Allocator {
  bool installed = false;
  c10::DeleterFnPtr default_deleter = nullptr;                     // the CPU allocator's before ours
  std::mutex mutex;
  int64_t live = 0, events = 0, allocations = 0, run_peak = 0, run_peak_at = 0, next_window = 0;
  std::map<int64_t, Window> windows;                                // open measurement windows
  std::thread::id installing_thread;                                // the thread that installed it (the main one)
  // data -> (bytes, allocation number, made on another thread than the installing one: gloo's workers)
  std::unordered_map<void*, std::tuple<int64_t, int64_t, int64_t>> listed;
  std::vector<std::tuple<int64_t, int64_t, int64_t>> listed_at_run_peak;

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
    int64_t live_now;
    {
      std::lock_guard<std::mutex> guard(a.mutex);
      a.live -= bytes;
      ++a.events;
      live_now = a.live;
      if (bytes >= kListed) a.listed.erase(data);
    }
    c10::reportMemoryUsageToProfiler(data, -bytes, live_now, live_now, c10::Device(c10::DeviceType::CPU));
    c10::free_cpu(block);
  }
  c10::DataPtr allocate(size_t n) override {
    char* block = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    const int64_t bytes = static_cast<int64_t>(n);
    std::memcpy(block, &bytes, sizeof(bytes));
    void* data = block + kHeader;
    int64_t live_now;
    {
      std::lock_guard<std::mutex> guard(mutex);
      live += bytes;
      ++events;
      ++allocations;
      live_now = live;
      if (bytes >= kListed)
        listed[data] = {bytes, allocations, std::this_thread::get_id() != installing_thread ? 1 : 0};
      for (auto& entry : windows) entry.second.peak = std::max(entry.second.peak, live);
      if (live > run_peak) {
        run_peak = live;
        run_peak_at = allocations;
        listed_at_run_peak.clear();
        for (const auto& entry : listed) listed_at_run_peak.push_back(entry.second);
      }
    }
    c10::reportMemoryUsageToProfiler(data, bytes, live_now, live_now, c10::Device(c10::DeviceType::CPU));
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  static void release_adopted(void* context) {
    auto* adopted = static_cast<Adopted*>(context);
    auto& a = instance();
    {
      std::lock_guard<std::mutex> guard(a.mutex);
      a.live -= adopted->bytes;
      ++a.events;
    }
    delete adopted;                       // the original DataPtr frees the memory
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
    a.installing_thread = std::this_thread::get_id();
    a.default_deleter = c10::GetCPUAllocator()->raw_deleter();
    c10::SetCPUAllocator(&a, /*priority=*/100);
    a.installed = true;
  }
  return c10::GetCPUAllocator() == &a;
}
// Count the memory of `tensor`'s storage from now on, if it was allocated before the allocator was
// installed, by the CPU allocator then in place (not a NumPy array's, shared memory, a mapped file):
// true if adopted now.
bool adopt(const at::Tensor& tensor) {
  auto& a = CountingCPUAllocator::instance();
  if (!a.installed || a.default_deleter == nullptr || !tensor.has_storage()) return false;
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  const c10::DataPtr& current = storage->data_ptr();
  if (current.get() == nullptr || current.device().type() != c10::DeviceType::CPU ||
      current.get_deleter() != a.default_deleter || current.get_context() != current.get())
    return false;
  const int64_t bytes = static_cast<int64_t>(storage->nbytes());
  auto* adopted = new Adopted{c10::DataPtr(), bytes};
  c10::DataPtr counted(current.get(), adopted, &CountingCPUAllocator::release_adopted, current.device());
  adopted->original = storage->set_data_ptr(std::move(counted));
  std::lock_guard<std::mutex> guard(a.mutex);
  a.live += bytes;
  ++a.events;
  return true;
}
// live bytes, the run's peak, allocations so far, the allocation that set the run's peak
std::vector<int64_t> counters() {
  auto& a = CountingCPUAllocator::instance();
  std::lock_guard<std::mutex> guard(a.mutex);
  return {a.live, a.run_peak, a.allocations, a.run_peak_at};
}
// a window opens: its number
int64_t open_window() {
  auto& a = CountingCPUAllocator::instance();
  std::lock_guard<std::mutex> guard(a.mutex);
  const int64_t number = a.next_window++;
  a.windows[number] = {a.live, a.live, a.events};
  return number;
}
// the window closes: live bytes at its start, its peak, live bytes now, events in it, allocations so far
std::vector<int64_t> close_window(int64_t number) {
  auto& a = CountingCPUAllocator::instance();
  std::lock_guard<std::mutex> guard(a.mutex);
  const Window w = a.windows.at(number);
  a.windows.erase(number);
  return {w.start_live, w.peak, a.live, a.events - w.start_events, a.allocations};
}
void reset_run() {   // the run's peak from now on
  auto& a = CountingCPUAllocator::instance();
  std::lock_guard<std::mutex> guard(a.mutex);
  a.run_peak = a.live;
  a.run_peak_at = a.allocations;
  a.listed_at_run_peak.clear();
}
// (bytes, allocation number, made on another thread) of every listed tensor alive when the run's peak was set
std::vector<std::vector<int64_t>> listed_at_run_peak() {
  auto& a = CountingCPUAllocator::instance();
  std::lock_guard<std::mutex> guard(a.mutex);
  std::vector<std::vector<int64_t>> out;
  for (const auto& entry : a.listed_at_run_peak)
    out.push_back({std::get<0>(entry), std::get<1>(entry), std::get<2>(entry)});
  return out;
}
"""

_FUNCTIONS = ["install", "adopt", "counters", "open_window", "close_window", "reset_run", "listed_at_run_peak"]
_lock = threading.Lock()
_built = None                   # the built extension, once built
_installed = False
_unavailable: str | None = None  # why it could not be built or installed, once that is known


def counting_allocator(install: bool = True):
    """The counting allocator's extension module (``counters()``, ``open_window()``,
    ``close_window(n)``, ``reset_run()``, ``listed_at_run_peak()``), built on the first call and
    installed unless ``install=False`` (built only: a bench loads it before reading an RSS baseline
    and installs it later); ``None`` if it cannot be (no C++ compiler, no ninja, another allocator
    installed with a higher priority): ``why_unavailable()`` says why."""
    global _built, _installed, _unavailable
    with _lock:
        if _built is None and _unavailable is None:
            try:
                _built = _build()
            except Exception as error:      # no compiler, no ninja, a failed build: the caller falls back
                _unavailable = f"building it failed: {type(error).__name__}: {str(error).strip()[-300:]}"
        if _built is None or not install or _installed:
            return _built
        if not _built.install():
            _unavailable = "another c10 CPU allocator with a higher priority is installed"
            return None
        _installed = True
        return _built


def why_unavailable() -> str | None:
    """Why ``counting_allocator()`` returned None (after it did), else None."""
    return _unavailable


def _build():
    from torch.utils.cpp_extension import load_inline

    return load_inline("optpass_counting_cpu_allocator", cpp_sources=_SOURCE, functions=_FUNCTIONS,
                       extra_cflags=["-O2"])
