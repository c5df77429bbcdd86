"""Run a function on N gloo ranks (fresh processes on this machine) and collect what each returns.

    results = run_ranks(2, some_module.worker, arg)   # [value of rank 0, value of rank 1]

A rank that raises comes back as a RankError (type name and message), never as a
hang: the parent waits at most `timeout_s`, then kills what is left and fails.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
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


def _worker(rank, world, port, pg_timeout_s, fn, args, queue):
    import torch
    import torch.distributed as dist

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
        if os.environ.get("OPTPASS_TEST_KEEP_PG") is None:
            dist.destroy_process_group()


def run_ranks(world: int, fn, *args, timeout_s: float = 300, pg_timeout_s: float = 60) -> list:
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=_worker, args=(rank, world, port, pg_timeout_s, fn, args, queue))
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
                dead = [r for r, p in enumerate(processes) if not p.is_alive() and r not in results]
                if dead and all(not p.is_alive() for p in processes) and queue.empty():
                    raise RuntimeError(f"ranks {dead} exited without a result "
                                       f"(exit codes {[p.exitcode for p in processes]})") from None
    finally:
        for p in processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def values(results: list) -> list:
    """The results, failing the test with every rank's error if any rank raised."""
    errors = [f"rank {r}: {v.type}: {v.message}" for r, v in enumerate(results) if isinstance(v, RankError)]
    if errors:
        raise AssertionError("\n\n".join(errors))
    return results
