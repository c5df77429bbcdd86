"""What each rank runs in tests/test_rank_failure.py: a rank killed in the middle of training.

``killed_mid_training``: both ranks train a compiled zero1 or fsdp step and save a checkpoint
after 3 steps; then one rank kills itself (SIGKILL, as the OOM killer does) from a thread while
the ranks step on; the other must raise an ``OptpassError`` naming it, at once (not at the process
group's timeout), refuse to save what the failed step left, and find the earlier checkpoint whole.
Rank 0's process holds the process group's store: killed, it takes the store with it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

import optpass
from sharded_training import compiled_step, sharded_model

def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)


def _kill_myself_after(delay_s: float, stamp_path: str) -> None:
    def kill():
        time.sleep(delay_s)
        with open(stamp_path, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=kill, daemon=True).start()


def killed_mid_training(rank: int, world: int, kind: str, lower: str, killed: int, workdir: str) -> dict:
    torch.set_default_dtype(torch.float64)
    model = sharded_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = compiled_step(model, opt, kind, lower=lower)
    for i in range(3):
        step(*_batch(i, rank))
    checkpoint = os.path.join(workdir, "step-3")
    optpass.save_sharded_checkpoint(checkpoint, opt, model=model)
    stamp = os.path.join(workdir, "killed-at")
    if rank == killed:
        _kill_myself_after(0.5, stamp)
    failure, steps_after = None, 0
    deadline = time.monotonic() + 120
    while failure is None and time.monotonic() < deadline:     # rank 1 dies within one of these steps
        try:
            step(*_batch(3 + steps_after, rank))
            steps_after += 1
        except Exception as error:  # noqa: BLE001  (the test reads it)
            failure = error
    raised_at = time.time()
    try:
        optpass.save_sharded_checkpoint(os.path.join(workdir, "after-failure"), opt, model=model)
        save_after = "saved"
    except Exception as error:  # noqa: BLE001  (the test reads it)
        save_after = f"{type(error).__name__}: {error}"
    with open(stamp) as f:
        killed_at = float(f.read())
    return {"type": type(failure).__name__, "message": str(failure), "steps_after": steps_after,
            "seconds_to_raise": raised_at - killed_at, "save_after": save_after,
            "left": sorted(os.listdir(workdir)), "checkpoint": sorted(os.listdir(checkpoint))}
