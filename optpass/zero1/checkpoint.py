"""Save and load a ZeRO-1 sharded optimizer with torch.distributed.checkpoint (DCP).

Each rank holds its chunk of every bucket (``state.py``); the chunk boundaries
depend on the world size, the partition and the bucket size. A checkpoint
therefore stores the state in a layout-free form, the one a single process
would have: for parameter ``i`` (optimizer order) and state key ``k``, a flat
tensor of ``p.numel()`` elements written as a ShardedTensor whose local shard is
this rank's piece — a view of its shard state, so DCP writes and reads in place,
without gathering anything. Scalar state (Adam's ``step``) is written by every
rank that owns a piece of the parameter (DCP deduplicates it), hyper-parameters
as the user's ``param_groups``. DCP reads overlapping chunks, so a checkpoint
saved on N ranks loads on M (ZeroRedundancyOptimizer cannot: pytorch#65650).

With master_weights, each bf16/fp16 parameter's fp32 master is one more entry of
that form, ``state.<i>.master`` (the rank's master shard is the shard
optimizer's parameter, so its piece is a view of it, like the state's). Loading
such a checkpoint restores the masters exactly; loading one without masters (a
run without master_weights) re-reads the masters from the parameters before the
next step; a run without master_weights ignores the masters of a checkpoint.

    optpass.save_sharded_checkpoint(path, opt, model=model)   # every rank
    optpass.load_sharded_checkpoint(path, opt, model=model)   # every rank, any world size
"""

from __future__ import annotations

import contextlib
import warnings
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from optpass.checkpoint_files import check_matches, load_checked, publishing, require_complete, save, with_extra
from optpass.rank_failure import clear_failed_step, refuse_saving_after_a_failed_step
from optpass.errors import OptpassError
from optpass.optim import low_bit_states
from optpass.zero1.state import ShardedOptimizer, _SHARDED, sharded_optimizer, sharded_state

OPTIMIZER_KEY = "optimizer"
MASTER_KEY = "master"            # a bf16/fp16 parameter's fp32 master, beside its optimizer state


@contextlib.contextmanager
def _quiet():
    """DCP's resharding of arbitrary 1-D chunks goes through ShardedTensor, which warns that
    DTensor replaces it; DTensor cannot describe a bucket split that cuts a parameter anywhere."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        yield


def _sharded(optimizer) -> ShardedOptimizer:
    return sharded_state(optimizer)


def optimizer_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    """This rank's part of the optimizer state, in the layout-free form DCP saves.

    For parameter ``i`` (optimizer order) and state key ``k``: a 1-D ShardedTensor of
    ``p.numel()`` elements whose local shard is a view of this rank's piece of the state; a
    per-parameter scalar (Adam's ``step``) as it is; with master_weights the fp32 master as one
    more key, ``"master"``.

    Args:
        optimizer: the user's optimizer, sharded by a step compiled with
            ``data_parallel="zero1"``.

    Returns:
        ``{"state": {str(i): {key: value}}, "param_groups": [...]}``, the groups as the user's
        ``param_groups`` with parameter indices.

    Raises:
        OptpassError: the optimizer is not sharded (yet), or a state entry is neither elementwise
            (the shard's shape) nor a scalar.
    """
    sharded = _sharded(optimizer)
    shard_optimizer = sharded.shard_optimizer
    state: dict[str, dict] = {}
    for bucket in sharded.layout.buckets:
        shard = sharded.shards.get(bucket.index)
        values = dict(shard_optimizer.state.get(shard, {})) if shard is not None else {}
        if shard is not None and sharded.has_master(bucket):
            values[MASTER_KEY] = shard                     # the master shard is the shard optimizer's parameter
        for key, value in values.items():
            for s in bucket.segments[sharded.rank]:
                if low_bit_states.is_quantized(value):
                    state.setdefault(str(s.param), {}).update(_quantized_pieces(sharded, bucket, s, key, value))
                else:
                    state.setdefault(str(s.param), {})[key] = _logical(sharded, bucket, s, shard, key, value)
    return {"state": state, "param_groups": _param_groups(optimizer)}


def _quantized_pieces(sharded, bucket, segment, key: str, value) -> dict:
    """A quantized moment's piece as its inner tensors (``"exp_avg.codes"``, ``"exp_avg.scale"``),
    each layout-free: the parameter's codes and block scales, this rank's piece a view of them
    (the layout puts whole blocks on a rank, so the piece of every inner tensor is whole). Not the
    dequantized values: requantizing a signed 8-bit moment does not give its codes back."""
    pieces = {}
    for name, ratio in low_bit_states.inner_rows(value).items():
        inner = getattr(value, name).reshape(-1)
        piece = inner[int(segment.offset * ratio): int((segment.offset + segment.numel) * ratio)]
        pieces[f"{key}.{name}"] = _sharded_tensor(sharded, bucket, segment.param, piece, ratio)
    return pieces


def _logical(sharded, bucket, segment, shard, key, value):
    if not isinstance(value, torch.Tensor):
        return value
    if value.numel() == 1 and value.shape != shard.shape:
        return value                                   # per-parameter scalar (step): replicated
    if value.shape != shard.shape:
        raise OptpassError(f"zero1 checkpoint: state {key!r} has shape {tuple(value.shape)}, not the "
                           "shard's; only elementwise optimizer state can be saved sharded.")
    piece = value[segment.offset: segment.offset + segment.numel]
    return _sharded_tensor(sharded, bucket, segment.param, piece)


def _sharded_tensor(sharded, bucket, param: int, piece: torch.Tensor, ratio: Fraction = Fraction(1)) -> ShardedTensor:
    """A 1-D ShardedTensor of the parameter's numel (times `ratio`: a quantized moment's inner
    tensor, ``low_bit_states.inner_rows``) whose only local shard is `piece`."""
    pg = sharded.pg
    placements = []
    mine = None
    for rank, s in bucket.segments_of(param):
        metadata = ShardMetadata([int(s.start * ratio)], [int(s.numel * ratio)],
                                 f"rank:{dist.get_global_rank(pg.group, rank)}/{piece.device}")
        placements.append(metadata)
        if rank == pg.rank:
            mine = metadata
    numel = int(sharded.layout.shapes[param].numel() * ratio)
    global_metadata = ShardedTensorMetadata(
        placements, torch.Size([numel]), TensorProperties(dtype=piece.dtype, requires_grad=False))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(piece, mine)], global_metadata, process_group=pg.group)


def _param_groups(optimizer) -> list[dict]:
    params = {id(p): i for i, (_, p) in enumerate(
        (g, p) for g, group in enumerate(optimizer.param_groups) for p in group["params"])}
    return [{**{k: v for k, v in group.items() if k != "params"},
             "params": [params[id(p)] for p in group["params"]]} for group in optimizer.param_groups]


def save_sharded_checkpoint(checkpoint_id, optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None,
                            extra=None) -> None:
    """Save this rank's optimizer shard (and the model, if given) with DCP; call on every rank.

    The state is stored in a layout-free form (``optimizer_state_dict``), so the checkpoint loads
    on any number of ranks. It is written into ``<checkpoint_id>.incomplete`` and published at
    ``checkpoint_id`` when every rank is done (``optpass.checkpoint_files``).

    Args:
        checkpoint_id: where to save (DCP's ``checkpoint_id``, e.g. a directory path).
        optimizer: the user's optimizer, sharded by a step compiled with
            ``data_parallel="zero1"``.
        model: also save ``model.state_dict()`` under ``"model"``; None: the optimizer only.
        extra: what else the run needs to resume (the step, an LR scheduler's ``state_dict()``):
            anything ``torch.save`` writes, saved with the rest (``load_sharded_checkpoint``
            returns it).

    Raises:
        OptpassError: the optimizer is not sharded (yet), or a state entry is neither elementwise
            nor a scalar.
    """
    refuse_saving_after_a_failed_step("save_sharded_checkpoint", optimizer, model)
    with _quiet():
        state = {OPTIMIZER_KEY: optimizer_state_dict(optimizer)}
        if model is not None:
            state["model"] = model.state_dict()
        group = _sharded(optimizer).pg.group
        with publishing(checkpoint_id, group) as writing_to:
            save(with_extra(state, extra), writing_to, group, "save_sharded_checkpoint")


def load_sharded_checkpoint(checkpoint_id, optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None,
                            process_group=None, partition: str = "even",
                            bucket_bytes: int | None = None, master_weights: torch.dtype | None = None):
    """Load a checkpoint saved by save_sharded_checkpoint, on any number of ranks; call on every rank.

    Call it before (or between) steps of a step compiled with the same
    process_group / partition / bucket_bytes / master_weights options; the next
    step continues exactly where the saved run stopped. Called before the first step, it shards
    the optimizer with those options. A checkpoint with fp32 masters restores them exactly; one
    without re-reads the masters from the parameters before the next step.

    Args:
        checkpoint_id: where the checkpoint was saved (DCP's ``checkpoint_id``).
        optimizer: the user's optimizer (sharded already, or sharded here).
        model: also load the model's state from ``"model"``; None: the optimizer only.
        process_group: the step's ``process_group`` option (None: the default WORLD group).
        partition: the step's ``partition`` option (``"even"`` or ``"greedy"``).
        bucket_bytes: the step's ``bucket_bytes`` option (None: its default).
        master_weights: the step's ``master_weights`` option (``torch.float32``, or None).

    Returns:
        The ``extra`` the checkpoint was saved with (None: none).

    Raises:
        OptpassError: torch.distributed is not initialized; the optimizer is already sharded
            with other options; it cannot be sharded (no parameter that requires grad, an update
            that is not elementwise, a bad partition, the ranks disagree); the checkpoint holds
            no optimizer state, or a number of param groups other than the optimizer's.
    """
    if optimizer not in _SHARDED and not (dist.is_available() and dist.is_initialized()):
        raise OptpassError(
            "load_sharded_checkpoint: torch.distributed is not initialized. A sharded checkpoint is loaded into "
            "an optimizer sharded over ranks, even one: run under torchrun (torchrun --nproc-per-node 1 for a "
            "single process) or call torch.distributed.init_process_group('gloo', rank=0, world_size=1, ...) "
            "first, and compile the step with the options it was saved with (data_parallel='zero1', ...). For a "
            "model passed to optpass.fully_shard, pass model=.")
    metadata = (require_complete(checkpoint_id, "load_sharded_checkpoint")
                or dcp.FileSystemReader(checkpoint_id).read_metadata())
    sharded = _SHARDED.get(optimizer) or sharded_optimizer(optimizer, process_group, partition, bucket_bytes,
                                                          master_dtype=master_weights)
    if model is not None:      # before the optimizer's template: each rank builds that for its pieces only
        check_matches(checkpoint_id, metadata, {"model": model.state_dict()}, "load_sharded_checkpoint")
    with _quiet():
        template, install = _template(sharded, metadata.state_dict_metadata)
        state = {OPTIMIZER_KEY: template}
        if model is not None:
            state["model"] = model.state_dict()
        extra = load_checked(state, checkpoint_id, metadata, sharded.pg.group, "load_sharded_checkpoint")
    if model is not None:
        model.load_state_dict(state["model"])
    install(state[OPTIMIZER_KEY])
    restore_param_groups(optimizer, state[OPTIMIZER_KEY]["param_groups"])
    sharded.sync_hyperparameters()          # every saved setting, not only lr (the step reads the shards')
    clear_failed_step(optimizer)
    return extra


def _refuse_other_shapes(sharded: ShardedOptimizer, saved_keys: dict[int, dict[str, object]]) -> None:
    """Every rank alike (over every parameter, not its own pieces): the checkpoint's optimizer state is
    of as many parameters as this optimizer's, each entry either a scalar or of its parameter's size."""
    shapes = sharded.layout.shapes
    for param, entries in sorted(saved_keys.items()):
        if param >= len(shapes):
            raise OptpassError(f"load_sharded_checkpoint: the checkpoint does not match: it holds optimizer state of "
                               f"parameter {param}, and this optimizer has {len(shapes)}: it was saved from another "
                               "model. Nothing was loaded.")
        for key, md in entries.items():
            inner = key.partition(".")[2]
            if inner and inner not in low_bit_states.INNER_NAMES:    # zero1 saves "<index>.<key>[.codes|.scale]"
                raise OptpassError(f"load_sharded_checkpoint: the checkpoint does not match: its optimizer state "
                                   f"{param}.{key!r} is named by parameter, as a fully sharded model's "
                                   "(optpass.fully_shard) is saved, not by index as a zero1 optimizer's: load it "
                                   "into the fully sharded model it was saved from. Nothing was loaded.")
            size = tuple(getattr(md, "size", ()) or ())
            if "." not in key and len(size) == 1 and size[0] not in (1, shapes[param].numel()):
                raise OptpassError(f"load_sharded_checkpoint: the checkpoint does not match: optimizer state {key!r} "
                                   f"of parameter {param} has {size[0]} elements, the parameter "
                                   f"{shapes[param].numel()} ({list(shapes[param])}): it was saved from another "
                                   "model. Nothing was loaded.")


def _template(sharded: ShardedOptimizer, metadata: dict):
    """Destination tensors for every saved state entry of this rank's pieces, and how to install them."""
    saved_keys: dict[int, dict[str, object]] = {}
    prefix = f"{OPTIMIZER_KEY}.state."
    for fqn, md in metadata.items():
        if fqn.startswith(prefix):
            param, key = fqn[len(prefix):].split(".", 1)
            saved_keys.setdefault(int(param), {})[key] = md
    _refuse_other_shapes(sharded, saved_keys)
    if not saved_keys:
        raise OptpassError("load_sharded_checkpoint: the checkpoint holds no optimizer state under "
                           f"{OPTIMIZER_KEY!r}: it was saved without the optimizer, or by another program "
                           "(optpass.save_sharded_checkpoint saves it). Nothing was loaded.")
    template: dict[str, dict] = {}
    new_state: dict[torch.Tensor, dict] = {}
    without_masters: set[int] = set()      # buckets whose masters the checkpoint lacks
    for bucket in sharded.layout.buckets:
        shard = sharded.shards.get(bucket.index)
        if shard is None:
            continue
        for s in bucket.segments[sharded.rank]:
            if sharded.has_master(bucket):
                if MASTER_KEY in saved_keys.get(s.param, {}):     # read in place into the master shard
                    piece = shard[s.offset: s.offset + s.numel]
                    template.setdefault(str(s.param), {})[MASTER_KEY] = _sharded_tensor(sharded, bucket, s.param, piece)
                else:
                    without_masters.add(bucket.index)
            for key, md in saved_keys.get(s.param, {}).items():
                if key == MASTER_KEY:
                    continue
                size = getattr(md, "size", None)
                state = new_state.setdefault(shard, {})
                head, _, inner = key.partition(".")
                if inner:                  # a quantized moment's codes or scales: read in place
                    quantized = _quantized_destination(sharded, shard, head, key)
                    state[head] = quantized
                    ratio = low_bit_states.inner_rows(quantized)[inner]
                    piece = getattr(quantized, inner).reshape(-1)[int(s.offset * ratio): int((s.offset + s.numel) * ratio)]
                    template.setdefault(str(s.param), {})[key] = _sharded_tensor(sharded, bucket, s.param, piece, ratio)
                elif size is not None and tuple(size) == (sharded.layout.shapes[s.param].numel(),):
                    flat = state.setdefault(key, torch.zeros_like(shard))
                    piece = flat[s.offset: s.offset + s.numel]
                    template.setdefault(str(s.param), {})[key] = _sharded_tensor(sharded, bucket, s.param, piece)
                elif size is not None:
                    scalar = state.setdefault(key, torch.zeros(size, dtype=md.properties.dtype))
                    template.setdefault(str(s.param), {})[key] = scalar
                else:
                    template.setdefault(str(s.param), {})[key] = None
    template = {"state": template, "param_groups": _param_groups(sharded.optimizer)}

    def install(loaded: dict) -> None:
        sharded.mark_masters_stale(without_masters)
        for shard, values in new_state.items():
            sharded.shard_optimizer.state[shard] = dict(values)
        for bucket in sharded.layout.buckets:      # non-tensor state (rare): from any piece
            shard = sharded.shards.get(bucket.index)
            for s in bucket.segments[sharded.rank] if shard is not None else ():
                for key, value in loaded["state"].get(str(s.param), {}).items():
                    if key != MASTER_KEY and not isinstance(value, (torch.Tensor, ShardedTensor)):
                        sharded.shard_optimizer.state[shard][key] = value

    return template, install


def _quantized_destination(sharded, shard: torch.Tensor, head: str, key: str):
    """This rank's quantized moment `head` of `shard` (made with the shard optimizer: quantized where
    the bucket's parameters are), which a checkpoint's ``key`` (its codes or scales) is read into."""
    value = (sharded.shard_optimizer.state.get(shard) or {}).get(head)
    if not low_bit_states.is_quantized(value):
        raise OptpassError(
            f"zero1 checkpoint: it holds torchao's quantized {head!r} ({key!r}), which this run's optimizer "
            f"keeps {'unquantized' if isinstance(value, torch.Tensor) else 'nowhere'} for these parameters: "
            "load it with the optimizer class (and block size) that saved it.")
    return value


def restore_param_groups(optimizer, saved: list[dict]) -> None:
    """The saved hyper-parameters of every param group into ``optimizer`` (a tensor lr in place)."""
    if len(saved) != len(optimizer.param_groups):
        raise OptpassError(f"checkpoint: saved {len(saved)} param groups, the optimizer has "
                           f"{len(optimizer.param_groups)}.")
    for group, values in zip(optimizer.param_groups, saved):
        for key, value in values.items():
            if key == "params":
                continue
            if isinstance(group.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                group[key].copy_(value)
            else:
                group[key] = value
