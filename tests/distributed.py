"""Run a function on N gloo ranks (fresh processes on this machine) and collect what each returns.

    results = run_ranks(2, some_module.worker, arg)   # [value of rank 0, value of rank 1]

A rank that raises comes back as a RankError (type name and message), never as a
hang: the parent waits at most `timeout_s`, then kills what is left and fails.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp


@dataclasses.dataclass
class RankError:
    type: str
    message: str
    elapsed_s: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, pg_timeout_s, fn, args, queue, log_path):
    import torch
    import torch.distributed as dist

    # Everything this rank prints, and the Python stacks of a fatal signal (an abort in C++),
    # go to a file the parent shows when the rank dies.
    log = open(log_path, "w", buffering=1)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.enable(file=log, all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    start = time.monotonic()
    try:
        queue.put((rank, fn(rank, world, *args)))
    except BaseException as error:  # noqa: BLE001  (report every failure to the parent)
        message = f"{error}\n{traceback.format_exc()}"
        queue.put((rank, RankError(type(error).__name__, message, time.monotonic() - start)))
    finally:
        queue.close()
        queue.join_thread()         # the result reaches the parent before the teardown below
        print(f"rank {rank}: result sent; destroying the process group", flush=True)
        if os.environ.get("OPTPASS_TEST_KEEP_PG") is None:
            dist.destroy_process_group()


class RankCrashed(RuntimeError):
    """A rank's process was killed by a signal (an abort in C++, a segfault)."""


@dataclasses.dataclass
class RankKilled:
    """A rank in ``run_ranks(..., may_be_killed=...)`` that died by a signal, as its test meant it to."""
    signal: int


def run_ranks(world: int, fn, *args, timeout_s: float = 300, pg_timeout_s: float = 60,
              may_be_killed: tuple[int, ...] = ()) -> list:
    """``fn(rank, world, *args)`` on ``world`` fresh gloo ranks; each rank's return value (or its
    RankError). A rank killed by a signal (an abort in C++, a segfault) fails the call with the
    end of its output: no rerun; one of `may_be_killed` (a test that kills it) comes back as
    RankKilled."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    logs = tempfile.mkdtemp(prefix="optpass-ranks-")
    log_paths = [os.path.join(logs, f"rank{rank}.log") for rank in range(world)]
    processes = [context.Process(target=_worker,
                                 args=(rank, world, port, pg_timeout_s, fn, args, queue, log_paths[rank]))
                 for rank in range(world)]
    for p in processes:
        p.start()
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(results))} did not finish "
                                   f"within {timeout_s} s (results so far: {results})")
            try:
                rank, value = queue.get(timeout=min(remaining, 5))
                results[rank] = value
            except Exception:  # noqa: BLE001  (queue.Empty: check for dead processes)
                for r in may_be_killed:
                    if (processes[r].exitcode or 0) < 0 and r not in results:
                        results[r] = RankKilled(-processes[r].exitcode)
                crashed = [r for r, p in enumerate(processes) if (p.exitcode or 0) < 0 and r not in may_be_killed]
                if crashed:        # the others would wait for it in a collective until their timeout
                    raise RankCrashed(f"ranks {crashed} were killed by a signal (exit codes "
                                      f"{[p.exitcode for p in processes]})" + _tails(log_paths, crashed)) from None
                dead = [r for r, p in enumerate(processes) if not p.is_alive() and r not in results]
                if dead and all(not p.is_alive() for p in processes) and queue.empty():
                    raise RuntimeError(f"ranks {dead} exited without a result "
                                       f"(exit codes {[p.exitcode for p in processes]})"
                                       + _tails(log_paths, dead)) from None
    finally:
        crashed = any((p.exitcode or 0) < 0 for r, p in enumerate(processes)     # then the others are not waited for
                      if r not in may_be_killed)
        stuck_in_teardown = set()
        for r, p in enumerate(processes):
            p.join(timeout=0 if crashed else 120)
            if p.is_alive():
                if not crashed and r in results:      # its result came back; its teardown outlasted the wait
                    stuck_in_teardown.add(r)
                p.kill()
                p.join()
    # a rank this call killed after its result came back (destroy_process_group slow on a loaded
    # machine) is not a fault; one that died on its own in its teardown is
    failed = [r for r, p in enumerate(processes) if p.exitcode != 0 and r not in stuck_in_teardown
              and not isinstance(results.get(r), RankKilled)]
    if failed:     # every result came back, yet a rank died in its teardown: a fault, not a pass
        error = RankCrashed if any(processes[r].exitcode < 0 for r in failed) else RuntimeError
        raise error(f"ranks {failed} failed after sending their results "
                    f"(exit codes {[p.exitcode for p in processes]})" + _tails(log_paths, failed))
    if not os.environ.get("OPTPASS_TEST_KEEP_LOGS"):
        shutil.rmtree(logs, ignore_errors=True)
    return [results[r] for r in range(world)]


def _tails(log_paths: list[str], ranks: list[int], chars: int = 6000) -> str:
    """The end of what each of these ranks printed (its stderr: a C++ abort's message, the Python
    stacks faulthandler wrote)."""
    text = ""
    for r in ranks:
        try:
            with open(log_paths[r], errors="replace") as f:
                text += f"\n--- rank {r}'s output ({log_paths[r]}), its end:\n" + f.read()[-chars:]
        except OSError as error:
            text += f"\n--- rank {r}'s output: unreadable ({error})"
    return text


def values(results: list) -> list:
    """The results, failing the test with every rank's error if any rank raised."""
    errors = [f"rank {r}: {v.type}: {v.message}" for r, v in enumerate(results) if isinstance(v, RankError)]
    if errors:
        raise AssertionError("\n\n".join(errors))
    return results
