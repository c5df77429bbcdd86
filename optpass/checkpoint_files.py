"""A sharded checkpoint directory is published whole or not at all, and a load reads only a whole one.

``save_sharded_checkpoint`` (fsdp and zero1) writes through ``torch.distributed.checkpoint`` into
``<checkpoint_id>.incomplete``, a sibling directory. When every rank has written its files (DCP's
coordinator writes ``.metadata`` last), rank 0 of the group moves it to ``<checkpoint_id>``: a
directory that existed there is first renamed to ``<checkpoint_id>.previous``, then removed once the
new one is in place. So a save killed at any point leaves the last complete checkpoint loadable:
at ``<checkpoint_id>``, or at ``<checkpoint_id>.previous`` if it died between the two renames. An
``.incomplete`` left by a save that died is removed by the next save to the same place. The
renames need every rank to see one filesystem, as DCP's ``FileSystemWriter`` does. A directory at
``<checkpoint_id>`` that holds anything but DCP's files is refused, not replaced: a save would
delete it.

``require_complete`` is what ``load_sharded_checkpoint`` checks first: a directory without DCP's
metadata, or with metadata that cannot be read (a truncated or foreign file), is an ``OptpassError``
that says which and where the last complete checkpoint is, before anything of the model or the
optimizer is touched. A ``checkpoint_id`` that is not a path (a storage writer or reader object)
is passed to DCP as it is. Why written aside and renamed: docs/design.md §70.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from optpass.errors import OptpassError, name_list

INCOMPLETE = ".incomplete"
PREVIOUS = ".previous"


def _path(checkpoint_id) -> Path | None:
    return Path(checkpoint_id) if isinstance(checkpoint_id, (str, os.PathLike)) else None


def sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


@contextlib.contextmanager
def publishing(checkpoint_id, group) -> Iterator:
    """Yield where DCP should write (``<checkpoint_id>.incomplete``); after the block, on every rank of
    `group` together, publish it at ``checkpoint_id``. A block that raises publishes nothing."""
    final = _path(checkpoint_id)
    if final is None:
        yield checkpoint_id
        return
    _refuse_replacing_other_files(final)
    leader = dist.get_rank(group) == 0
    temporary = sibling(final, INCOMPLETE)
    if leader and temporary.exists():
        shutil.rmtree(temporary)                 # an earlier save here that died
    dist.barrier(group)
    yield str(temporary)
    dist.barrier(group)                          # every rank's files are written
    if leader:
        _publish(temporary, final)
    dist.barrier(group)                          # no rank returns before the checkpoint is there


def _is_dcp_file(name: str) -> bool:
    """A file DCP's FileSystemWriter writes: ``.metadata``, a rank's ``__R.metadata``, ``*.distcp``."""
    return name.endswith((".metadata", ".distcp", ".metadata.tmp"))


def _refuse_replacing_other_files(final: Path) -> None:
    """Publishing replaces the directory at `final`: only an empty one or an earlier checkpoint."""
    if final.is_dir():
        others = sorted(e.name for e in final.iterdir() if not (e.is_file() and _is_dcp_file(e.name)))
        if others:
            raise OptpassError(f"save_sharded_checkpoint: {final} holds files that are not a checkpoint's "
                               f"({name_list(others, 5)}); "
                               "a save replaces the whole directory once it is complete, so it would delete them. "
                               "Save each checkpoint into a directory of its own (e.g. "
                               f"{final / 'step-1000'}).")
    elif final.exists():
        raise OptpassError(f"save_sharded_checkpoint: {final} is a file, not a checkpoint directory.")


def _publish(temporary: Path, final: Path) -> None:
    previous = sibling(final, PREVIOUS)
    if previous.exists():
        shutil.rmtree(previous)
    if final.exists():
        os.replace(final, previous)
    os.replace(temporary, final)
    if previous.exists():
        shutil.rmtree(previous)


def require_complete(checkpoint_id, what: str) -> None:
    """An ``OptpassError`` unless `checkpoint_id` holds a checkpoint whose metadata DCP can read."""
    path = _path(checkpoint_id)
    if path is None:
        return
    problem = None
    if not path.is_dir():
        problem = "there is no checkpoint directory there"
    else:
        try:
            dcp.FileSystemReader(str(path)).read_metadata()
        except FileNotFoundError:
            problem = "it has no DCP metadata (.metadata): a save to it did not finish, or it is not a DCP checkpoint"
        except Exception as error:          # noqa: BLE001  (unpickling a cut or foreign file raises anything)
            problem = (f"its DCP metadata cannot be read ({type(error).__name__}: {str(error)[:200]}): the file is "
                       "cut short or is not DCP's")
    if problem is None:
        return
    hints = []
    if sibling(path, PREVIOUS).is_dir():
        hints.append(f"the checkpoint it was replacing is at {sibling(path, PREVIOUS)}: load that one")
    if sibling(path, INCOMPLETE).is_dir():
        hints.append(f"{sibling(path, INCOMPLETE)} is a save that did not finish (not loadable)")
    raise OptpassError(f"{what}: {path} is not a complete checkpoint: {problem}. Nothing was loaded"
                       + (f"; {'; '.join(hints)}." if hints else "."))
