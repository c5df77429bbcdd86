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
metadata, with metadata that cannot be read (a truncated or foreign file), or with a data file
missing or shorter than the metadata says, is an ``OptpassError`` that says which and where the last
complete checkpoint is, before anything of the model or the optimizer is touched. Then
``load_checked`` compares what the load will read into with the metadata (``check_matches``: every
entry there, of the same size, no model entry more): a checkpoint of another model, another
optimizer class or another program is refused naming the first difference, on every rank alike,
before DCP reads anything. A ``checkpoint_id`` that is not a path (a storage writer or reader object)
is passed to DCP as it is. Why written aside and renamed: docs/design.md §70, §71.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from optpass.errors import OptpassError, name_list

INCOMPLETE = ".incomplete"
PREVIOUS = ".previous"
EXTRA_KEY = "extra"          # the user's ``extra`` in a checkpoint (``with_extra``)


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


def require_complete(checkpoint_id, what: str) -> Metadata | None:
    """The checkpoint's DCP metadata, read once for the whole load (None: `checkpoint_id` is not a
    path); an ``OptpassError`` unless it holds a checkpoint whose metadata DCP can read and whose
    data files are all there, whole."""
    path = _path(checkpoint_id)
    if path is None:
        return None
    problem, metadata = None, None
    if not path.is_dir():
        problem = "there is no checkpoint directory there"
    else:
        try:
            metadata = dcp.FileSystemReader(str(path)).read_metadata()
        except FileNotFoundError:
            problem = "it has no DCP metadata (.metadata): a save to it did not finish, or it is not a DCP checkpoint"
        except Exception as error:          # noqa: BLE001  (unpickling a cut or foreign file raises anything)
            problem = (f"its DCP metadata cannot be read ({type(error).__name__}: {str(error)[:200]}): the file is "
                       "cut short or is not DCP's")
    if problem is None:
        problem = _cut_data_files(path, metadata)
    if problem is None:
        return metadata
    hints = []
    if sibling(path, PREVIOUS).is_dir():
        hints.append(f"the checkpoint it was replacing is at {sibling(path, PREVIOUS)}: load that one")
    if sibling(path, INCOMPLETE).is_dir():
        hints.append(f"{sibling(path, INCOMPLETE)} is a save that did not finish (not loadable)")
    raise OptpassError(f"{what}: {path} is not a complete checkpoint: {problem}. Nothing was loaded"
                       + (f"; {'; '.join(hints)}." if hints else "."))


def _cut_data_files(path: Path, metadata: Metadata) -> str | None:
    """What is missing of the data files the metadata points into (a file cut short or lost after the
    save), or None: checked before a load reads any of them, so that none is half-read into a model."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        relative = getattr(info, "relative_path", None)
        if relative is not None:
            needed[relative] = max(needed.get(relative, 0), info.offset + info.length)
    for relative, end in sorted(needed.items()):
        file = path / relative
        if not file.is_file():
            return f"its data file {relative} is missing"
        size = file.stat().st_size
        if size < end:
            return f"its data file {relative} is cut short ({size} bytes; the metadata reads up to byte {end})"
    return None


def check_matches(checkpoint_id, metadata: Metadata | None, state: dict, what: str) -> None:
    """An ``OptpassError`` naming the first difference unless the checkpoint at `checkpoint_id` (its
    `metadata` from ``require_complete``; None: nothing to check) holds every entry of `state` (the
    destination ``dcp.load`` will read into, flattened as DCP flattens it) with the same global
    sizes, and no model entry that `state` lacks. Every rank sees the same keys and global sizes, so
    every rank raises alike, before any collective of the load: nothing of the model or the
    optimizer is changed."""
    if metadata is None:
        return
    path = _path(checkpoint_id)
    saved = metadata.state_dict_metadata
    wanted, _ = flatten_state_dict(state)
    problem = None
    for key, value in wanted.items():
        if key not in saved:
            problem = _missing(key)
        elif isinstance(value, (torch.Tensor, ShardedTensor)) and hasattr(saved[key], "size") \
                and tuple(saved[key].size) != tuple(value.size()):
            head, _, rest = key.partition(".")
            problem = (f"{'this model' if head == 'model' else 'the optimizer'}'s {rest} has size "
                       f"{list(value.size())}, the checkpoint's {list(saved[key].size)}: it was saved from "
                       "another model")
        if problem is not None:
            break
    extra = sorted(k[len("model."):] for k in saved if k.startswith("model.") and k not in wanted)
    if problem is None and extra and "model" in state:
        problem = (f"it holds model entries this model lacks ({name_list(extra, 5)}): it was saved from another "
                   "model")
    if problem is not None:
        raise OptpassError(f"{what}: the checkpoint at {path} does not match: {problem}. Nothing was loaded.")


def _missing(key: str) -> str:
    """An entry DCP would read that the checkpoint lacks, in a model's and an optimizer's terms."""
    head, _, rest = key.partition(".")
    if head == "model":
        return f"this model's {rest} is not in it: it was saved from another model or by another program"
    if rest.startswith("param_groups."):
        index, _, setting = rest[len("param_groups."):].partition(".")
        return (f"the optimizer's setting {setting!r} (param group {index}) is not in it: it was saved with "
                "another optimizer class")
    return f"{key} is not in it: it was saved from another optimizer or by another program"


def load_checked(state: dict, checkpoint_id, metadata: Metadata | None, group, what: str):
    """``dcp.load(state, ...)`` of a checkpoint that ``check_matches`` `state` (else an OptpassError,
    nothing read), with a place for the ``extra`` it was saved with; returns that extra (None: none).

    Our ShardedTensors are never nested, so DCP's planner is told not to flatten them: flattening
    drops one without local rows (a rank that holds none of a parameter with fewer rows than ranks),
    and DCP then takes the missing key for a pre-2.4 checkpoint and reads the param groups under
    their old keys, which fails ("Missing key in checkpoint state_dict: optimizer.param_groups").
    DCP's ``CheckpointException`` (a ``BaseException``, which ``except Exception`` misses) becomes
    an OptpassError."""
    if metadata is not None and EXTRA_KEY in metadata.state_dict_metadata:
        state[EXTRA_KEY] = None                  # read into (``with_extra`` saved it)
    check_matches(checkpoint_id, metadata, state, what)
    try:
        dcp.load(state, checkpoint_id=checkpoint_id, process_group=group,
                 planner=DefaultLoadPlanner(flatten_sharded_tensors=False))
    except CheckpointException as error:
        raise OptpassError(f"{what}: torch.distributed.checkpoint could not load {checkpoint_id}: "
                           f"{str(error).strip().splitlines()[-1]}") from error
    loaded = state.get(EXTRA_KEY)
    return loaded[0] if isinstance(loaded, tuple) else None



def with_extra(state: dict, extra) -> dict:
    """`state` with the user's `extra` (the step, an LR scheduler's or a data loader's state: anything
    ``torch.save`` can write) as one entry, saved in the same checkpoint and so published with it."""
    if extra is not None:
        state[EXTRA_KEY] = (extra,)         # a tuple: one entry for DCP, not flattened into its leaves
    return state


def save(state: dict, writing_to, group, what: str) -> None:
    """``dcp.save``, its ``CheckpointException`` (a ``BaseException``: an ``extra`` that cannot be
    pickled, a full disk) turned into an OptpassError; nothing is published (``publishing``)."""
    try:
        dcp.save(state, checkpoint_id=writing_to, process_group=group)
    except CheckpointException as error:
        raise OptpassError(f"{what}: torch.distributed.checkpoint could not save: "
                           f"{str(error).strip().splitlines()[-1]}. Nothing was published; the previous "
                           "checkpoint at this path, if any, is kept.") from error
