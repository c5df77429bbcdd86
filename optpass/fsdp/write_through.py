"""Writes into a parameter gathered outside the step reach this rank's shard.

Outside a compiled step, reading a sharded parameter through its module (``model.head.bias``)
gathers it into a temporary full tensor. A user who writes into it, as into any parameter,
(``model.head.bias.fill_(0.25)`` or ``.zero_()`` under ``torch.no_grad()``, ``.data.copy_(...)``,
``torch.nn.init.*``) means the parameter; FSDP2's DTensor parameters take such a write on each
rank's shard. Here the temporary carries a finalizer: when it dies, this rank's rows of it are
compared with the shard and every element that differs is written into the shard (cast to the
shard's dtype when the gather ran in a mixed-precision ``param_dtype``; an element left alone keeps
its full-precision value). Every rank runs the same code, so each takes its own rows of the write,
as with a DTensor. A read that wrote nothing costs one comparison of this rank's rows.

Not taken yet: a write through another tensor made from the read that outlives it
(``model.fc.weight.data[0].zero_()``, ``model.fc.weight[0].zero_()``, ``.detach().fill_()``):
Python drops the read before the write runs, so the comparison sees nothing written and the write
is lost (pinned by a strict xfail in tests/test_user_programs_distributed.py; docs/fsdp.md).
"""

from __future__ import annotations

import weakref

import torch


def write_back_when_it_dies(full: torch.Tensor, shard: torch.Tensor, spec) -> torch.Tensor:
    """Arrange for this rank's rows of ``full`` (gathered from every rank's shard of ``spec``) to be
    written into ``shard`` where they differ from it, once nothing reads ``full`` any more."""
    gathered = full._base if full._base is not None else full
    # the gathered buffer is the finalizer's argument, so it outlives ``full`` only as long as the
    # finalizer waits, which ends when ``full`` (or the last view of it) dies
    finalizer = weakref.finalize(full, _write_rows_back, gathered, shard, spec.offset, spec.valid)
    finalizer.atexit = False
    return full


def _write_rows_back(gathered: torch.Tensor, shard: torch.Tensor, offset: int, valid: int) -> None:
    if valid == 0:
        return
    rows = gathered.reshape(-1, *shard.shape[1:]) if shard.dim() else gathered.reshape(-1)
    written, mine = rows[offset:offset + valid], shard[:valid]
    with torch.no_grad():
        if written.dtype == mine.dtype:
            if not torch.equal(written, mine):
                mine.copy_(written)
            return
        changed = written != mine.to(written.dtype)
        if bool(changed.any()):
            mine.copy_(torch.where(changed, written.to(mine.dtype), mine))
