"""Writes into a parameter gathered outside the step reach this rank's shard.

Outside a compiled step, reading a sharded parameter through its module (``model.head.bias``)
gathers it into a temporary full tensor. A user who writes into it, as into any parameter
(``model.head.bias.fill_(0.25)``, ``torch.nn.init.zeros_(model.fc.weight)``,
``model.fc.weight.data[0].zero_()``, ``model.fc.weight[0] = row``, under ``torch.no_grad()``),
means the parameter; FSDP2's DTensor parameters take such a write on each rank's shard.

Here each read is remembered with its gathered buffer until nothing else references the buffer's
storage (the read, ``.data``, an index or any view of it: the storage's use count, so a write
through a view made from the read is seen however short-lived the read was). Then this rank's
rows of it are compared with the shard and every element that differs is written into the shard
(cast to the shard's dtype when the gather ran in a mixed-precision ``param_dtype``; an element
left alone keeps its full-precision value). Every rank runs the same code, so each takes its own
rows of the write, as with a DTensor. Released reads are written back before the next gather,
before each compiled fsdp step or eager ``opt.step()``, and before a state dict or checkpoint is
taken (``write_back_released``); a read still held is written back too (and stays remembered)
when its parameter is gathered again, before a compiled step, an eager step and a state dict.

A read kept across a change of the shard (an eager write or load: its version counter moved; any
compiled fsdp graph run, whose Inductor kernels write shards without moving it) is stale: it is dropped
without writing, and if it was written into (its version counter moved), a warning says the
write was lost and how to make it (docs/design.md §54).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch


@dataclasses.dataclass
class _Read:
    gathered: torch.Tensor          # the all-gather's buffer: every rank's rows
    shard: torch.Tensor
    offset: int
    valid: int
    shard_version: int              # the shard's version counter when it was read
    read_version: int               # the buffer's (shared with the read and its views, not .data)
    name: str
    compiled_runs: int              # compiled fsdp graphs run before the read (``_COMPILED_RUNS``)
    stale: bool = False             # found stale while still held: never written back


_PENDING: list[_Read] = []
# compiled fsdp graphs run so far: Inductor writes a shard in place without moving its version
# counter, so a read taken before a compiled step is stale even where the counter did not move
_COMPILED_RUNS = [0]
# references to a storage besides the remembered buffer's own: the wrapper the count is read through
_OWN_REFERENCES = 2


def remember(full: torch.Tensor, shard: torch.Tensor, spec, shard_version: int) -> torch.Tensor:
    """Remember ``full`` (gathered from every rank's shard of ``spec`` when ``shard`` was at
    ``shard_version``; call ``write_back_released`` before the gather) so that what is written into
    it reaches ``shard`` once nothing references it; returns ``full``."""
    gathered = full._base if full._base is not None else full
    _PENDING.append(_Read(gathered, shard, spec.offset, spec.valid, shard_version, gathered._version, spec.name,
                          _COMPILED_RUNS[0]))
    return full


def before_compiled_run() -> None:
    """A compiled fsdp graph is about to run: what was written through every read, released or
    still held, reaches the shards first; then every read still held becomes stale (the graph may
    update any shard)."""
    write_back_released(ALL)
    _COMPILED_RUNS[0] += 1


def write_back_released(held_of=None) -> None:
    """Write back every remembered read that nothing references any more (see the module's doc), and
    the reads still held of ``held_of`` (a shard about to be gathered again: a fresh read must see
    what was written through a read still held) or, with ``ALL``, of every shard (a compiled step,
    a state dict). A read still held stays remembered, for what is written into it later."""
    if not _PENDING:
        return
    kept = []
    for read in _PENDING:
        held = torch._C._storage_Use_Count(read.gathered.untyped_storage()._cdata) > _OWN_REFERENCES
        if held and held_of is not ALL and read.shard is not held_of:
            kept.append(read)
            continue
        current = _write_back(read, warn=not held)
        if held:
            if current:                     # in step with the shard again, from here on
                read.shard_version, read.read_version = read.shard._version, read.gathered._version
                read.compiled_runs = _COMPILED_RUNS[0]
            else:
                read.stale = True
            kept.append(read)
    _PENDING[:] = kept


ALL = object()       # ``write_back_released(ALL)``: the reads still held of every shard too


def _write_back(read: _Read, warn: bool) -> bool:
    """Write ``read``'s differing rows into its shard; False (nothing written) if it is stale."""
    if read.stale or read.shard._version != read.shard_version or read.compiled_runs != _COMPILED_RUNS[0]:
        if warn and read.gathered._version != read.read_version:
            warnings.warn(
                f"optpass: a write into {read.name}, read through its module outside the step, was lost: the "
                "parameter changed since it was read (a training step, a load, or a write through another "
                "read of it) before the write reached it. Write into a parameter right where you read it "
                "(with torch.no_grad(): model.fc.weight.fill_(0)), not into a read kept across a step.",
                stacklevel=3)
        return False
    if read.valid == 0:
        return True
    shard = read.shard
    rows = read.gathered.reshape(-1, *shard.shape[1:]) if shard.dim() else read.gathered.reshape(-1)
    written, mine = rows[read.offset:read.offset + read.valid], shard[:read.valid]
    with torch.no_grad():
        if written.dtype == mine.dtype:
            if not torch.equal(written, mine):
                mine.copy_(written)
        else:
            changed = written != mine.to(written.dtype)
            if bool(changed.any()):
                mine.copy_(torch.where(changed, written.to(mine.dtype), mine))
    return True
