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
taken (``write_back_released``).

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
    """A compiled fsdp graph is about to run: released reads are written back first, and every read
    still held becomes stale (the graph may update any shard)."""
    write_back_released()
    _COMPILED_RUNS[0] += 1


def write_back_released() -> None:
    """Write back every remembered read that nothing references any more (see the module's doc)."""
    if not _PENDING:
        return
    kept = []
    for read in _PENDING:
        if torch._C._storage_Use_Count(read.gathered.untyped_storage()._cdata) > _OWN_REFERENCES:
            kept.append(read)
        else:
            _write_back(read)
    _PENDING[:] = kept


def _write_back(read: _Read) -> None:
    if read.shard._version != read.shard_version or read.compiled_runs != _COMPILED_RUNS[0]:
        if read.gathered._version != read.read_version:
            warnings.warn(
                f"optpass: a write into {read.name}, read through its module outside the step, was lost: the "
                "parameter changed (a training step or a load) before the read was released. Write into a "
                "parameter right where you read it (with torch.no_grad(): model.fc.weight.fill_(0)), not into a "
                "read kept across a step.", stacklevel=2)
        return
    if read.valid == 0:
        return
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
    read.shard_version = shard._version           # (the entry is dropped; kept consistent all the same)
