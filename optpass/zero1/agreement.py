"""The ranks of a data-parallel step agree before their first collective, or all fail alike.

A rank compiled with other options than the others (``clip_grad_norm`` on one rank only, another
``lr``, ``data_parallel`` left off) would run other collectives, or none, and the ranks would hang
in them until the process group's timeout, or drift apart silently. So at the first compile of a
``data_parallel`` step every rank posts what it will run (its *signature*: (what, value) pairs)
to the process group's store, without blocking, and reads every other rank's:

* every rank then sees the same signatures and raises the same ``OptpassError``, naming the first
  difference and the ranks, before any collective of the step. A rank that found a difference
  says so in the store once it has read every signature, and raises only when every rank has
  said so (``_wait_until_every_rank_has_read``): the store lives in rank 0's process, and a rank 0
  that raised and exited at once would leave a rank still reading with a broken connection
  (``DistNetworkError``) instead of the error;
* a rank that loses the store inside an agreement all the same (its host exited for another
  reason) raises ``RanksDisagree`` saying so, not the store's network error;
* a rank that compiles its training step *without* ``data_parallel`` says so in the store
  (``announce_undistributed``): when the others have waited for it ``UNDISTRIBUTED_GRACE_S``
  while it stayed there, they fail with that reason instead of at the timeout (the grace keeps
  a rank that compiles an undistributed step first, e.g. a reference, from being taken for one
  that forgot the option);
* a rank that never arrives fails the others after the process group's timeout, with a message
  that says which ranks are missing.

The store is the one every process group of ``init_process_group`` is built on (its TCPStore);
reading it is not a collective, so a rank that never compiles a step cannot hang the others for
longer than the timeout.
"""

from __future__ import annotations

import datetime
import pickle
import time
from typing import Any

import torch.distributed as dist

from optpass.errors import OptpassError
from optpass.rank_failure import lost_ranks_sentence, mark_failed_step, remember_whereabouts, whereabouts

_PREFIX = "optpass/agreement"
_POLL_S = 0.02
UNDISTRIBUTED_GRACE_S = 60.0
REFUSAL_GRACE_S = 10.0
LOST_RANK_WAIT_S = 1.5      # a killed process's sockets close before it is gone: how long to look for it
# Agreements started in this process, a refusal at compile time counting as one: every rank of a
# group counts the same steps, so the count names this agreement's keys and tells a stale refusal
# or announcement (made for an earlier step) from one made for this step.
_started = 0


class RanksDisagree(OptpassError):
    """Raised by ``agree`` on every rank alike (or on the ranks that waited for one that will not
    come): not announced as a refusal of this rank's own."""


def _store():
    return dist.distributed_c10d._get_default_store()


def _timeout_s(store) -> float:
    """The store's timeout: init_process_group(timeout=...), 30 minutes by default on gloo."""
    return getattr(store, "timeout", datetime.timedelta(minutes=30)).total_seconds()


def several_ranks() -> bool:
    """torch.distributed runs more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _global_ranks(group) -> list[int]:
    return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]


def announce_undistributed(what: str) -> None:
    """This rank compiles a training step without data_parallel: ``what`` becomes the reason a rank
    waiting for this one to join a data-parallel step gives (see UNDISTRIBUTED_GRACE_S)."""
    if not several_ranks():
        return
    _store().set(f"{_PREFIX}/undistributed/{dist.get_rank()}",
                 pickle.dumps((_started, time.monotonic_ns(), what)))


def announce_refusal(message: str) -> None:
    """This rank refused its step at compile time: a rank waiting for it to join a data-parallel
    step fails at once with this rank's message (it will not arrive). The refusal takes the place
    of that step's agreement: this rank's next one is the others' next one too."""
    global _started
    if several_ranks():
        _store().set(f"{_PREFIX}/refused/{dist.get_rank()}", pickle.dumps((_started, message)))
        if dist.get_rank() == 0:
            _wait_until_the_refusal_is_read(_store(), _started)
        _started += 1


def _wait_until_the_refusal_is_read(store, started: int) -> None:
    """On rank 0, whose process hosts the store (init_process_group's env:// and tcp:// rendezvous):
    give every other rank up to ``REFUSAL_GRACE_S`` to read this refusal (or to refuse the same step
    itself), so that a program that exits on the refusal leaves them its message, not a broken
    connection. A rank that does not come within the grace gets the store's loss, said plainly."""
    others = [r for r in range(dist.get_world_size()) if r != 0]
    deadline = time.monotonic() + REFUSAL_GRACE_S
    while others and time.monotonic() < deadline:
        others = [r for r in others if not store.check([f"{_PREFIX}/refusal-read/{started}/{r}"])
                  and not _refused(store, r, started)]
        time.sleep(_POLL_S)


def _refused(store, rank: int, started: int) -> str | None:
    """Global rank `rank`'s message if it refused the step counted `started`, else None."""
    key = f"{_PREFIX}/refused/{rank}"
    if not store.check([key]):
        return None
    their_started, message = pickle.loads(store.get(key))
    return message if their_started == started else None


def agree(group, kind: str, signature: list[tuple[str, Any]], payload: Any = None) -> list[Any]:
    """Post this rank's ``signature`` and ``payload`` for the next data-parallel step of ``group``
    and wait for every rank's; raise the same OptpassError on every rank if the signatures differ.
    Returns every rank's payload (rank order of the group)."""
    store = _store()
    ranks = _global_ranks(group)
    me = dist.get_rank(group)
    name = getattr(group, "group_name", str(id(group)))
    global _started
    started, _started = _started, _started + 1
    prefix = f"{_PREFIX}/{name}/{started}"
    keys = [f"{prefix}/{r}" for r in range(len(ranks))]
    try:
        store.set(f"{prefix}/{me}", pickle.dumps((signature, payload, whereabouts())))
        _wait(store, keys, ranks, me, kind, _timeout_s(store), started)
        posted = [pickle.loads(store.get(key)) for key in keys]
    except dist.DistError as error:
        raise RanksDisagree(_store_lost(kind, me, error)) from error
    remember_whereabouts({ranks[r]: where for r, (_, _, where) in enumerate(posted)})
    difference = _difference(kind, [s for s, _, _ in posted])
    if difference is not None:
        _wait_until_every_rank_has_read(store, prefix, len(ranks), me, _timeout_s(store))
        raise RanksDisagree(difference)
    return [p for _, p, _ in posted]


def _wait_until_every_rank_has_read(store, prefix: str, world: int, me: int, timeout_s: float) -> None:
    """Every rank of the group read every signature (each says so once it has): only then may one
    raise, and its program exit. After this rank has said so it needs the store no more, so a store
    lost meanwhile (its host read the last word and exited) ends the wait."""
    try:
        store.set(f"{prefix}/read/{me}", b"1")
        keys = [f"{prefix}/read/{r}" for r in range(world)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
    except dist.DistError:
        pass


def _store_lost(kind: str, me: int, error: Exception) -> str:
    return (f"data_parallel={kind!r}: this rank ({me}) lost the process group's store while the ranks "
            "compared what they run: the store lives in rank 0's process, and rank 0 was killed, exited, or "
            "failed before it joined this step (its own output says which). If it failed on an error, that "
            "error is the cause; if it was killed, restart the job from the last complete checkpoint "
            "(docs/fsdp.md, 'When a rank fails'). The store's error: "
            f"{str(error).splitlines()[0]}")


def _wait(store, keys, ranks, me, kind, timeout_s, started) -> None:
    began = time.monotonic()
    seen: dict[int, tuple[bytes, float]] = {}        # rank -> (its announcement, when first seen)
    while True:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if not missing:
            return
        now = time.monotonic()
        for r in missing:
            message = _refused(store, ranks[r], started)
            if message is not None:
                store.set(f"{_PREFIX}/refusal-read/{started}/{dist.get_rank()}", b"1")
                raise RanksDisagree(f"data_parallel={kind!r}: rank {r} refused the step, so it will not "
                                    f"join this rank ({me}) in it. Rank {r}'s error: {message}")
            reason = f"{_PREFIX}/undistributed/{ranks[r]}"
            if not store.check([reason]):
                continue
            raw = store.get(reason)
            if seen.get(r, (None,))[0] != raw:
                seen[r] = (raw, now)
            their_started, _, what = pickle.loads(raw)
            if their_started == started and now - seen[r][1] >= min(UNDISTRIBUTED_GRACE_S, timeout_s / 2):
                raise RanksDisagree(
                    f"data_parallel={kind!r}: rank {r} compiled its training step without data_parallel "
                    f"({what}) and has not compiled this one for {now - seen[r][1]:.0f} s; this rank "
                    f"({me}) compiled it with data_parallel={kind!r}, so the ranks would wait for each "
                    "other's collectives. Pass the same options on every rank.")
        if now - began > timeout_s:
            raise RanksDisagree(
                f"data_parallel={kind!r}: rank(s) {missing} did not compile the step within the process "
                f"group's timeout ({timeout_s:.0f} s), this rank ({me}) did. Every rank must compile "
                "and run the same step with the same options (a rank that failed, exited or runs "
                "something else first never arrives).")
        time.sleep(_POLL_S)


def _difference(kind: str, signatures: list[list[tuple[str, Any]]]) -> str | None:
    """The message naming the first difference between rank 0's signature and another's, or None."""
    reference = signatures[0]
    for rank, theirs in enumerate(signatures[1:], start=1):
        for (what, ref_value), (_, value) in zip(reference, theirs):
            if ref_value != value:
                return (f"data_parallel={kind!r}: the ranks do not train the same model: {what} is "
                        f"{ref_value!r} on rank 0 but {value!r} on rank {rank}. Every rank must build the "
                        "same model and optimizer (same parameters, shapes, dtypes, groups and settings) "
                        "and compile the step with the same options.")
        if len(theirs) != len(reference):
            return (f"data_parallel={kind!r}: the ranks do not train the same model: rank 0 has "
                    f"{len(reference)} signature entries, rank {rank} has {len(theirs)} (a different "
                    "number of parameters, buffers or param groups).")
    return None


def failed_step_error(kind: str, group, error: BaseException, optimizer) -> OptpassError:
    """The error a rank raises when its data-parallel step failed (a collective broke off, or its own
    error): a lost rank named first when this host knows it (optpass.rank_failure), the error, what
    the other ranks reported, and what to do; the optimizer is marked as failed part-way, so that
    a save of its half-updated state is refused."""
    ranks = _global_ranks(group)
    lost = lost_ranks_sentence(ranks, wait_s=LOST_RANK_WAIT_S)
    rank, world = dist.get_rank(group), len(ranks)
    others = explain_failed_collective(group, lost, waited_s=0.2 if lost else 1.0)
    message = (f"data_parallel={kind!r}: the step failed on rank {rank} of {world}"
               f"{': ' + lost if lost else '.'} Its error: {error}\n{others}\n"
               "This step may have updated some parameters and not others, on each rank differently: restart "
               "every rank from the last complete checkpoint (torchrun --max-restarts restarts them; "
               "optpass.load_sharded_checkpoint resumes exactly). A save of this state is refused.")
    mark_failed_step(optimizer, message)
    return OptpassError(message)


def explain_failed_collective(group, lost: str = "", waited_s: float = 1.0) -> str:
    """This rank's step failed (a collective broke off, or its own error): post that to the store
    and say what the other ranks did, for the error message. A rank whose collective broke off
    while no other rank reports a failure and none is `lost` was left alone: the others stopped
    calling the step."""
    try:
        store, ranks = _store(), _global_ranks(group)
        me = dist.get_rank()
        store.set(f"{_PREFIX}/failed/{me}", b"1")
    except Exception:  # noqa: BLE001  (the store is gone with the other ranks: say what may have happened)
        return ("The other ranks could not be asked what they did (the process group's store, in rank 0's "
                "process, is gone: it exited or was killed). A rank that stops calling the step, or fails, "
                "makes every other rank's collectives fail.")
    failed: list[int] = []
    deadline = time.monotonic() + waited_s
    while not failed and time.monotonic() < deadline:
        try:
            failed = [r for r, g in enumerate(ranks) if g != me and store.check([f"{_PREFIX}/failed/{g}"])]
        except Exception:  # noqa: BLE001  (the store went away meanwhile: what was seen stands)
            break
        time.sleep(_POLL_S)
    if failed:
        return (f"Rank(s) {failed} failed in the step too: the first error among the ranks is the cause "
                "(a rank that stops taking part in the collectives makes the others' fail).")
    if lost:
        return ("No other rank reported a failure inside this step: the lost rank's collectives broke off (if it "
                "was not killed, its own output says why it exited).")
    return ("No other rank reported a failure inside this step: another rank either stopped calling it "
            "(fewer batches on it than on this rank, or it went on to something else: every rank must "
            "call the compiled step the same number of times, e.g. DistributedSampler(..., "
            "drop_last=True)), or failed outside the step (its error is then the cause).")
