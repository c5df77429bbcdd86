"""What every benchmark here does the same way: start its children, measure Linux process memory and CPU time.

* ``proc_status_kib("VmHWM")`` read before any reset: the whole run's peak RSS, what
  decides whether a model fits (docs/design.md, Measuring);
* ``reset_peak_rss()`` then ``proc_status_kib("VmHWM")``: the steady-state peak RSS
  of the steps that ran in between.
* ``cpu_busy_s()`` / ``children_cpu_s()`` / ``other_cores(...)``: how busy the machine and
  our children were, to tell when other processes disturbed a timing.
* ``CPUTensorBytes``: the peak of live CPU tensor bytes on every thread (a counting
  allocator), what ``torch.cuda.max_memory_allocated()`` is on a GPU.

Children: a bench re-invokes its own script (``child_command(__file__, child=..., ...)``) in a
fresh process with ``child_env(threads, cache_dir)`` (its own Inductor cache, ``OMP_NUM_THREADS``,
no debug logging), the child calls ``emit_result(dict)`` and the parent gets that dict back from
``run_child(cmd, env, timeout)``, with the process's wall and CPU time and the load of other
processes added; ``run_ranks(cmd, world, ...)`` starts ``world`` gloo ranks of one job on a free
port (``--rank R --port P``; the child calls ``init_gloo``). ``graph_count()`` and
``training_step(loss_of, opt)`` are the child side's count of compiled graphs and the supported
step shape; ``MemoryCap(cap_bytes)`` ends a child whose peak RSS passes a cap, with
``OVER_CAP_EXIT``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

RESULT_PREFIX = "RESULT:"
# environment variables that make a child log or skip its caches: never passed to one
DEBUG_VARS = ("TORCH_COMPILE_DEBUG", "TORCH_TRACE", "TORCH_LOGS", "TORCHINDUCTOR_FORCE_DISABLE_CACHES")
_POLL_S = 0.1   # with several children: how often each is checked for an early failure
OVER_CAP_EXIT = 86   # the exit status of a child that MemoryCap ended


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


class MemoryCap:
    """Child side: end this process at once when its peak RSS passes ``cap_bytes``, so that a model
    too large for the cap fails within a fraction of a second instead of swapping or waking the
    kernel's OOM killer.

    ``start()`` runs a daemon thread that reads ``VmHWM`` (the peak RSS, so that a spike between
    two reads counts too) every ``interval_s``; past the cap it writes ``{"rss_bytes",
    "cap_bytes", "phase"}`` and what ``details()`` returns (if given: a dict) as JSON to
    ``report_path`` (if given; ``phase`` is whatever the child last set) and calls
    ``os._exit(OVER_CAP_EXIT)``: no cleanup, nothing the child could catch. RSS, not
    ``RLIMIT_AS``: torch reserves far more virtual memory than it touches."""

    def __init__(self, cap_bytes: int, report_path: str | None = None, interval_s: float = 0.05,
                 details=None) -> None:
        self.cap_bytes, self.report_path, self.interval_s, self.details = cap_bytes, report_path, interval_s, details
        self.phase = "start"

    def start(self) -> "MemoryCap":
        threading.Thread(target=self._watch, name="memory-cap", daemon=True).start()
        return self

    def _watch(self) -> None:
        while True:
            peak = proc_status_kib("VmHWM") * 1024
            if peak > self.cap_bytes:
                if self.report_path:
                    with open(self.report_path, "w") as f:
                        json.dump({"rss_bytes": peak, "cap_bytes": self.cap_bytes, "phase": self.phase,
                                   **(self.details() if self.details else {})}, f)
                os._exit(OVER_CAP_EXIT)
            time.sleep(self.interval_s)


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


def other_cores(machine_busy_s: float | None, own_cpu_s: float, wall_s: float) -> float | None:
    """Cores that processes other than ours kept busy, on average over ``wall_s``: the machine's
    busy CPU seconds (``cpu_busy_s()`` after minus before) less our own; None off Linux."""
    if machine_busy_s is None:
        return None
    return round(max(0.0, machine_busy_s - own_cpu_s) / wall_s, 2)


def median(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


# ====================================================================== children

def child_command(script: str, **flags) -> list[str]:
    """``python script --flag value ...``: each keyword a flag (``d_model`` -> ``--d-model``);
    None is left out, True is the bare flag, False is left out, anything else is ``str()``."""
    cmd = [sys.executable, os.path.abspath(script)]
    for name, value in flags.items():
        if value is None or value is False:
            continue
        cmd.append("--" + name.replace("_", "-"))
        if value is not True:
            cmd.append(str(value))
    return cmd


def child_env(threads: int, cache_dir: str | None = None, **extra) -> dict:
    """This process's environment for a child: ``OMP_NUM_THREADS=threads``, the Inductor cache in
    ``cache_dir`` (an empty one: nothing compiled is shared between children), no ``DEBUG_VARS``;
    ``extra`` variables set as given (None: not set)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if cache_dir is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    env.update({k: str(v) for k, v in extra.items() if v is not None})
    for var in DEBUG_VARS:
        env.pop(var, None)
    return env


@contextlib.contextmanager
def empty_cache_dir(tag: str):
    """A new empty directory for one child's compile caches, removed afterwards."""
    path = tempfile.mkdtemp(prefix=f"optpass-bench-{tag.replace('/', '-')}-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def emit_result(result: dict) -> None:
    """Child side: print the numbers as the one line ``run_child`` parses."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


class ChildError(SystemExit):
    """A child failed, timed out or printed no result. Not caught, it ends the bench with its
    message (the command and the tails of the child's output), as any ``SystemExit`` does."""

    def __init__(self, message: str, cmd: list[str], returncode: int | None, stdout: str, stderr: str,
                 wall_s: float, timed_out: bool) -> None:
        super().__init__(message)
        self.cmd, self.returncode, self.stdout, self.stderr = cmd, returncode, stdout, stderr
        self.wall_s, self.timed_out = wall_s, timed_out


def run_child(cmd: list[str], env: dict | None = None, timeout: float | None = None) -> dict:
    """Run ``cmd`` (a fresh process that calls ``emit_result``) and return its result: see
    ``run_children``."""
    return run_children([cmd], env, timeout)[0]


def run_children(cmds: list[list[str]], env: dict | None = None, timeout: float | None = None) -> list[dict]:
    """Run the commands at once (the ranks of one job) and return their results, in order.

    Adds to each ``process_wall_s`` (until the last child ended), ``process_cpu_s`` (CPU time
    of all of them and the processes they reaped: less sensitive to other load than wall time),
    ``other_processes_cores`` (cores kept busy by processes other than these children, on
    average over their run; None off Linux) and its own ``stderr_warnings``. Raises
    ``ChildError`` when one fails, runs past ``timeout`` seconds or prints no result (the others
    are killed then)."""
    cpu_before, ours_before = cpu_busy_s(), children_cpu_s()
    t0 = time.perf_counter()
    deadline = None if timeout is None else t0 + timeout
    with contextlib.ExitStack() as stack:
        logs = [(stack.enter_context(tempfile.TemporaryFile()), stack.enter_context(tempfile.TemporaryFile()))
                for _ in cmds]
        procs = [subprocess.Popen(cmd, env=env, stdout=out, stderr=err) for cmd, (out, err) in zip(cmds, logs)]
        pending, failed, timed_out = list(procs), None, None
        try:
            while pending and failed is None:
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    timed_out = pending[0]
                    break
                proc = pending[0]
                try:     # the last one exactly; with several, each in turn, so that any failure shows soon
                    proc.wait(timeout=left if len(pending) == 1 else min(_POLL_S, left or _POLL_S))
                except subprocess.TimeoutExpired:
                    pending.append(pending.pop(0))
                    continue
                pending.pop(0)
                if proc.returncode != 0:
                    failed = proc
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        wall = time.perf_counter() - t0
        outputs = []
        for out, err in logs:
            out.seek(0)
            err.seek(0)
            outputs.append((out.read().decode(errors="replace"), err.read().decode(errors="replace")))
    cpu_after, ours_after = cpu_busy_s(), children_cpu_s()
    lines = [[ln for ln in out.splitlines() if ln.startswith(RESULT_PREFIX)] for out, _ in outputs]
    if timed_out is not None:
        i = procs.index(timed_out)
        raise ChildError(f"child timed out after {timeout}s: {' '.join(cmds[i])}\n"
                         f"--- stderr tail ---\n{outputs[i][1][-4000:]}", cmds[i], None, *outputs[i], wall, True)
    if failed is None:
        failed = next((p for p, found in zip(procs, lines) if not found), None)
    if failed is not None:
        i = procs.index(failed)
        out, err = outputs[i]
        raise ChildError(f"child failed (exit {failed.returncode}): {' '.join(cmds[i])}\n"
                         f"--- stdout tail ---\n{out[-3000:]}\n--- stderr tail ---\n{err[-6000:]}",
                         cmds[i], failed.returncode, out, err, wall, False)
    results = []
    for found, (_, err) in zip(lines, outputs):
        result = json.loads(found[-1][len(RESULT_PREFIX):])
        result["process_wall_s"] = round(wall, 2)
        result["process_cpu_s"] = round(ours_after - ours_before, 3)
        result["other_processes_cores"] = other_cores(
            None if cpu_before is None or cpu_after is None else cpu_after - cpu_before,
            ours_after - ours_before, wall)
        result["stderr_warnings"] = sorted({ln.strip() for ln in err.splitlines() if "Warning" in ln})[:20]
        results.append(result)
    return results


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(cmd: list[str], world: int, env: dict | None = None, timeout: float | None = None) -> list[dict]:
    """``world`` processes of ``cmd`` (which says ``world`` to them) with ``--rank R --port P`` (one
    free port for all; ``add_rank_flags`` reads them), run at once as ``run_children`` does; their
    results by rank."""
    port = free_port()
    return run_children([cmd + ["--rank", str(r), "--port", str(port)] for r in range(world)], env, timeout)


def add_rank_flags(parser: argparse.ArgumentParser, world: bool = True) -> None:
    """Child side of ``run_ranks``: its ``--rank`` and ``--port``, and ``--world`` unless the bench has
    one of its own (hidden from ``--help``)."""
    if world:
        parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)


def init_gloo(rank: int, world: int, port: int, timeout_s: float) -> None:
    """Child side of ``run_ranks``: join the gloo process group on 127.0.0.1:``port``."""
    import datetime

    import torch.distributed as dist   # lazy: the parents never import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def print_json(brief: dict, full: dict | None = None, path: str | None = None, indent: int = 2) -> None:
    """Parent side, last: ``brief`` on one line after ``JSON: ``; with ``path``, ``full`` (or ``brief``)
    written there."""
    print("JSON: " + json.dumps(brief))
    if path:
        with open(path, "w") as f:
            json.dump(brief if full is None else full, f, indent=indent)


def graph_count() -> int:
    """Child side: graphs Dynamo compiled in this process so far (to fail if one compiles while timing)."""
    import torch._dynamo.utils   # lazy: the parents never import torch

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def training_step(loss_of, opt, clip_parameters=None, max_norm: float | None = None):
    """The supported step shape around ``loss_of(x, y)``; a new closure each call (Dynamo guards
    on a closure's contents, so two variants compiled in one process need one each). With
    ``max_norm``: ``clip_grad_norm_(clip_parameters, max_norm)`` between backward and the update."""
    import torch

    def train_step(x, y):
        loss = loss_of(x, y)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(clip_parameters, max_norm)
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    return train_step


def waited_per_step(step, steps: int) -> float:
    """Seconds per step the step's thread spends blocked in wait_tensor (torch.profiler): the
    communication its schedule did not overlap with its own work."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            dist.barrier()
            step()
    return sum(e.cpu_time_total for e in prof.events() if e.name == "_c10d_functional::wait_tensor") / 1e6 / steps


class CPUTensorBytes:
    """Child side: the peak of live CPU tensor bytes, counted by the allocator on every thread.

    What ``torch.cuda.max_memory_allocated()`` is on a GPU, for CPU tensors: optpass's counting
    c10 CPU allocator (``optpass.analysis.counting_allocator``, the one ``measure_tensor_peak``
    counts with). ``load()`` builds it (once per machine, ~20 s; cached by
    ``torch.utils.cpp_extension``); ``start()`` installs it and starts the run: its peak is that of
    the live tensor bytes allocated since the allocator was installed (the first ``start()``, or an
    earlier ``measure_tensor_peak``), on whichever thread each tensor dies (a gloo worker's
    included): no glibc retention, no compile state, no tensor allocated before it was installed
    (nor its free). Memory still comes from glibc as before (64 bytes
    more per tensor), so RSS is measured in the same process. Tensors of 1 MiB or more are listed,
    so ``stop()`` also says which were alive at the run's peak. Once installed it stays for the
    life of the process.
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
        from optpass.analysis.counting_allocator import counting_allocator, why_unavailable

        self._ext = counting_allocator(install=False)
        if self._ext is None:
            raise RuntimeError(f"the counting CPU allocator is not available: {why_unavailable()}")

    def start(self) -> None:
        """Install the allocator (tensors allocated from here on are counted) and start the run:
        its peak is counted from here on."""
        from optpass.analysis.counting_allocator import counting_allocator, why_unavailable

        self.load()
        if counting_allocator() is None:
            raise RuntimeError(f"the counting CPU allocator cannot be installed: {why_unavailable()}")
        self._ext.reset_run()
        self.on = True

    def mark(self, name: str, list_peak: bool = False):
        """A context manager: a named range whose own peak and end value ``stop()`` reports.

        ``list_peak=True``: also the tensors of 1 MiB or more alive at this range's own peak
        (``alive_at_peak``: ``(bytes, where it was made, made on another thread)``, largest first;
        where: the name of the range it was allocated in, or ``"earlier"``). The run's peak starts
        again at the range's start (``stop()``'s ``peak_in`` then looks from there on), so use it on
        one range a process, the one whose peak a bench reports: what runs after it (a bench
        replaying the step's collectives to time them) does not take the listing over."""
        @contextlib.contextmanager
        def measured():
            if not self.on:
                yield
                return
            if list_peak:
                self._ext.reset_run()
            window = self._ext.open_window()
            first = self._ext.counters()[2] + 1
            try:
                yield
            finally:
                _, window_peak, live, _, allocations = self._ext.close_window(window)
                self._marks[name] = {"peak_bytes": window_peak, "end_bytes": live,
                                     "allocations": (first, allocations)}
                if list_peak:
                    self._marks[name]["alive_at_peak"] = sorted(
                        ((b, self._made_in(number), bool(elsewhere))
                         for b, number, elsewhere in self._ext.listed_at_run_peak()), reverse=True)
        return measured()

    def _made_in(self, allocation: int) -> str:
        """The innermost closed range whose allocations include this one, else ``"earlier"``."""
        within = [(m["allocations"][1] - m["allocations"][0], name) for name, m in self._marks.items()
                  if m["allocations"][0] <= allocation <= m["allocations"][1]]
        return min(within)[1] if within else "earlier"

    def so_far(self) -> dict:
        """``live_bytes`` and ``peak_bytes`` (since ``start()``) now, on any thread; counting goes on."""
        live, run_peak, _, _ = self._ext.counters()
        return {"live_bytes": live, "peak_bytes": run_peak}

    def stop(self) -> dict:
        """``peak_bytes``, ``end_bytes``, ``allocations``, per mark ``{name: {"peak_bytes",
        "end_bytes"}}`` (``end_bytes``: live at the range's end; a name marked twice keeps its
        last range), and ``peak_in`` (the mark the run's peak fell in) with ``alive_at_peak``:
        the sizes of the tensors of 1 MiB or more alive at the run's peak that were allocated
        in that mark, largest first. The allocator stays installed; counting goes on."""
        live, run_peak, allocations, run_peak_at = self._ext.counters()
        self.on = False
        peak_in = next((name for name, m in self._marks.items()
                        if m["allocations"][0] <= run_peak_at <= m["allocations"][1]), None)
        since = self._marks[peak_in]["allocations"][0] if peak_in else 0
        alive = sorted((b for b, number, _ in self._ext.listed_at_run_peak() if number >= since), reverse=True)
        return {"peak_bytes": run_peak, "end_bytes": live, "allocations": allocations, "peak_in": peak_in,
                "alive_at_peak": alive,
                "marks": {k: {key: m[key] for key in ("peak_bytes", "end_bytes", "alive_at_peak") if key in m}
                          for k, m in self._marks.items()}}
