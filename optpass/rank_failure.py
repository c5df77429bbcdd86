"""A rank that dies in a data-parallel step: the others say which one, and keep no half-updated checkpoint.

When a rank's process dies (SIGKILL, the OOM killer, a node that reboots) its sockets close and
every other rank's next collective with it fails at once on gloo ("Connection reset by peer")
and on NCCL once its watchdog sees the communicator abort; a rank that hangs without dying holds
its connections, and the others fail only at the process group's timeout
(``init_process_group(timeout=...)``, 30 minutes by default: docs/fsdp.md "When a rank fails").
Either way the collective's own error names an address, not a rank. So:

* every rank posts where it runs (host name, process id) when the ranks first agree on a step
  (``optpass.zero1.agreement.agree``), and each keeps every rank's in this process
  (``remember_whereabouts``): read again when a step fails, without the store, which died with
  rank 0's process if rank 0 is the one lost;
* ``lost_ranks`` says which ranks of a group are gone: a process on this host that no longer
  exists (or is a zombie, dead and not yet reaped) is gone for certain; a rank on another host,
  or one alive here, is not called lost;
* a step that fails part-way may have updated some parameters (with the update in backward,
  each as its gradient is final) and not others, on this rank and differently on the others:
  ``mark_failed_step`` records that for the optimizer, and ``save_sharded_checkpoint`` refuses
  to save such a state (``refuse_saving_after_a_failed_step``), so that the last checkpoint on
  disk stays the last consistent one; a restart resumes from it.

What a rank can know of another's death, and why: docs/design.md §72.
"""

from __future__ import annotations

import os
import socket
import time

from torch.utils.weak import WeakIdKeyDictionary

from optpass.errors import OptpassError

# global rank -> (host name, process id), as the ranks posted them at their last agreement
_WHEREABOUTS: dict[int, tuple[str, int]] = {}
# optimizer -> the message of the step that failed part-way through its update
_FAILED_STEP: WeakIdKeyDictionary = WeakIdKeyDictionary()


def whereabouts() -> tuple[str, int]:
    """Where this process runs: (host name, process id)."""
    return socket.gethostname(), os.getpid()


def remember_whereabouts(by_global_rank: dict[int, tuple[str, int]]) -> None:
    _WHEREABOUTS.update(by_global_rank)


def _process_is_gone(pid: int) -> bool:
    """The process `pid` of this host no longer runs: it does not exist, or it is a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:          # it exists, another user's
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return False


def lost_ranks(global_ranks: list[int], wait_s: float = 0.0) -> dict[int, str]:
    """The ranks among `global_ranks` whose process is known to be gone, each with what is known of it.
    A dying process closes its sockets before it is gone (a zombie), so a rank whose collective just
    broke looks again for up to `wait_s` while none is found."""
    host = socket.gethostname()
    deadline = time.monotonic() + wait_s
    while True:
        lost = {}
        for rank in global_ranks:
            where = _WHEREABOUTS.get(rank)
            if where is not None and where[0] == host and where[1] != os.getpid() and _process_is_gone(where[1]):
                lost[rank] = f"its process (pid {where[1]} on {host}) no longer runs: it was killed or exited"
        if lost or time.monotonic() >= deadline:
            return lost
        time.sleep(0.05)


def lost_ranks_sentence(global_ranks: list[int], wait_s: float = 0.0) -> str:
    """A sentence naming the lost ranks among `global_ranks`, or "" when none is known to be lost."""
    lost = lost_ranks(global_ranks, wait_s)
    if not lost:
        return ""
    return " ".join(f"Rank {rank} is lost: {what}." for rank, what in sorted(lost.items()))


def mark_failed_step(optimizer, message: str) -> None:
    _FAILED_STEP[optimizer] = message


def clear_failed_step(optimizer) -> None:
    """A checkpoint was loaded into `optimizer` (and its model): their state is consistent again."""
    if optimizer is not None:
        _FAILED_STEP.pop(optimizer, None)


def _failure_of(optimizer, model) -> str | None:
    """The failed step's message if `optimizer`, or an optimizer holding one of `model`'s parameters,
    failed part-way through a step."""
    if optimizer is not None and optimizer in _FAILED_STEP:
        return _FAILED_STEP[optimizer]
    if model is not None and len(_FAILED_STEP):
        ids = {id(p) for p in model.parameters()}
        for failed, message in _FAILED_STEP.items():
            if any(id(p) in ids for group in failed.param_groups for p in group["params"]):
                return message
    return None


def refuse_saving_after_a_failed_step(what: str, optimizer, model) -> None:
    message = _failure_of(optimizer, model)
    if message is not None:
        raise OptpassError(
            f"{what}: a training step failed part-way ({message.splitlines()[0][:300]}), so the parameters and "
            "the optimizer state may be partly updated, and differently on each rank; a checkpoint of them "
            "would not resume any run. Nothing was saved: the last checkpoint saved before the failure is the "
            "one to resume from (restart the job, e.g. under torchrun --max-restarts, and load it with "
            "optpass.load_sharded_checkpoint).")
