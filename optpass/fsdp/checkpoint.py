"""A fully sharded model's parameters and optimizer state: whole, or saved with DCP on N ranks, loaded on M.

``full_state_dict(model)`` gathers every parameter: ``{name: full tensor}`` (with the buffers) on
every rank, the form ``torch.save``, a single-process model's ``load_state_dict`` or an evaluation
job take. ``load_full_state_dict`` is its inverse (each rank keeps its shard of each tensor).

A DCP checkpoint stores each parameter, and each elementwise optimizer state entry of it, in the
parameter's full shape, written as a ``ShardedTensor`` whose local shard is a view of this rank's
valid rows (the padding is not saved): DCP writes and reads in place, without gathering, and reads
overlapping pieces, so a checkpoint saved on N ranks loads on any M. A 0-d parameter is saved as
one element. Per-parameter scalars (Adam's ``step``) are saved by
each rank that holds a piece (DCP keeps one), hyper-parameters as the user's ``param_groups`` with
parameter names. ``save_sharded_checkpoint``/``load_sharded_checkpoint`` take a ZeRO-1 optimizer
too and hand it to ``optpass.zero1.checkpoint``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from optpass.checkpoint_files import load_checked, publishing, require_complete, save, with_extra
from optpass.rank_failure import clear_failed_step, refuse_saving_after_a_failed_step
from optpass.errors import OptpassError
from optpass.fsdp.materialize import finish_initialization, mark_written, refuse_meta, write_back_alive
from optpass.fsdp import low_bit_checkpoint, write_through
from optpass.fsdp.shard import ShardSpec, shard_spec, sharded_parameters
from optpass.optim import low_bit_states
from optpass.zero1 import checkpoint as zero1_checkpoint

MODEL_KEY, OPTIMIZER_KEY = "model", "optimizer"


def _require_sharded(model) -> list:
    write_through.write_back_released(write_through.ALL)      # writes into parameters read outside the step
    params = sharded_parameters(model)
    if not params:
        raise OptpassError(f"{type(model).__name__} has no parameters sharded by optpass.fully_shard: call "
                           "optpass.fully_shard(model) on every rank first.")
    refuse_meta(model)
    return params


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of a fully sharded model, gathered, and its buffers: a collective.

    Args:
        model: a module passed to ``optpass.fully_shard``.

    Returns:
        ``{name: tensor}`` in ``model.state_dict()``'s order and names, each parameter in its full
        shape (a new tensor), on every rank: what ``model.state_dict()`` gives without sharding.

    Raises:
        OptpassError: the model holds no sharded parameter.
    """
    _require_sharded(model)
    finish_initialization(model)
    full = {}
    with torch.no_grad():
        for name, value in model.state_dict(keep_vars=True).items():
            spec = shard_spec(value)
            full[name] = _gathered(value.detach(), spec) if spec is not None else value.detach().clone()
    return full


def _gathered(shard: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    pieces = torch.empty(spec.chunk * spec.world, *shard.shape[1:], dtype=shard.dtype, device=shard.device)
    dist.all_gather_single(pieces, shard.contiguous(), group=spec.group)
    local = pieces[:spec.rows].reshape(spec.shape).clone()
    # FSDP + tensor parallel: what was gathered is the tensor-parallel local tensor; then its DTensor's
    return local if spec.tensor_parallel is None else spec.tensor_parallel.as_dtensor(local).full_tensor()


def load_full_state_dict(model: torch.nn.Module, source, strict: bool = True) -> None:
    """Load full tensors into a fully sharded model: each rank keeps its shard of each parameter.
    No collective.

    Args:
        model: a module passed to ``optpass.fully_shard``.
        source: ``{name: full tensor}`` (``full_state_dict``'s or a single-process model's
            ``state_dict()``), or the path of a ``.safetensors`` file or of a directory of them (a
            Hugging Face ``save_pretrained`` directory, sharded with ``model.safetensors.index.json``
            or not): then each rank reads from disk only its own rows of each sharded parameter,
            never a full copy. A weight tied between two names may be stored under either, and a
            Hugging Face base model's keys (without ``model.base_model_prefix``) load into its head
            model. Tensors stored in another dtype are converted, as ``load_state_dict`` does.
        strict: a stored name the model does not have is an error (False: it is ignored). A name
            of the model that is not stored is always an error.

    Raises:
        OptpassError: the model holds no sharded parameter; a name is missing or unexpected; a
            tensor's shape is not the parameter's; a path that holds no ``.safetensors`` file.
    """
    from optpass.fsdp.safetensors_source import SafetensorsSource, is_safetensors_source, match_names

    _require_sharded(model)
    write_back_alive()                   # no parameter gathered for initialization writes over the load later
    own = model.state_dict(keep_vars=True)
    if is_safetensors_source(source):
        files = SafetensorsSource(source)
        key_of, missing, unexpected = match_names(model, own, files.keys())
        shape_of, rows_of = files.shape, files.rows
    else:
        key_of = {name: name for name in own if name in source}
        missing, unexpected = sorted(set(own) - set(source)), sorted(set(source) - set(own))
        shape_of = (lambda key: tuple(source[key].shape))

        def rows_of(key, start, stop):
            value = source[key]
            return (value if value.dim() else value.reshape(1))[start:stop]
    if missing or (unexpected and strict):
        raise OptpassError(f"load_full_state_dict: missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
                           f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} "
                           f"({len(missing)} missing, {len(unexpected)} unexpected"
                           f"{'' if strict else ', unexpected ignored: strict=False'}).")
    with torch.no_grad():
        for name, target in own.items():
            key, spec = key_of[name], shard_spec(target)
            shape = spec.shape if spec is not None else tuple(target.shape)
            if tuple(shape_of(key)) != tuple(shape):
                raise OptpassError(f"load_full_state_dict: {name} has shape {tuple(shape_of(key))} in the "
                                   f"checkpoint, the model's is {tuple(shape)}.")
            if spec is None:
                target.copy_(rows_of(key, 0, shape[0] if shape else 1).reshape(target.shape))
            else:
                target.zero_()
                rows = rows_of(key, spec.offset, spec.offset + spec.valid)
                target[:spec.valid].copy_(rows.reshape(spec.valid, *target.shape[1:]))
                mark_written(target, loaded=True)
    finish_initialization(model)       # a model from the meta device: what the checkpoint left unset is refused


def _sharded_tensor(piece: torch.Tensor, spec: ShardSpec) -> ShardedTensor:
    """The parameter in its full shape (a 0-d one as one element), this rank's valid rows as its
    local shard."""
    shape = spec.saved_shape
    placements, mine = [], None
    for rank in range(spec.world):
        start = min(rank * spec.chunk, spec.rows)
        size = max(0, min(spec.chunk, spec.rows - start))
        if size == 0:
            continue
        placement = ShardMetadata([start] + [0] * (len(shape) - 1), [size, *shape[1:]],
                                  f"rank:{dist.get_global_rank(spec.group, rank)}/{piece.device}")
        placements.append(placement)
        if rank == spec.rank:
            mine = placement
    metadata = ShardedTensorMetadata(placements, torch.Size(shape),
                                     TensorProperties(dtype=piece.dtype, requires_grad=False))
    local = [Shard(piece[:spec.valid], mine)] if mine is not None else []
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata, process_group=spec.group)


def _state_entry(value, spec: ShardSpec, name: str, key: str):
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value                                   # Adam's step, or a non-tensor entry
    if tuple(value.shape) != spec.shard_shape:
        raise OptpassError(f"fsdp checkpoint: optimizer state {key!r} of {name} has shape {tuple(value.shape)}, "
                           "not the shard's; only elementwise optimizer state can be saved sharded.")
    return _sharded_tensor(value, spec)


def _names(model) -> dict[int, str]:
    return {id(p): name for name, p, _ in sharded_parameters(model)}


def _param_groups(optimizer, names: dict[int, str]) -> list[dict]:
    return [{**{k: v for k, v in group.items() if k != "params"},
             "params": [names[id(p)] for p in group["params"]]} for group in optimizer.param_groups]


def fsdp_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """The state DCP saves for a fully sharded model (and its optimizer), by reference.

    Returns:
        ``{"model": {name: ShardedTensor or buffer}, "optimizer": {"state": {name: {key: value}},
        "param_groups": [...]}}``; the ShardedTensors' local shards are views of this rank's shards.
    """
    _require_sharded(model)
    names = _names(model)
    state: dict = {MODEL_KEY: {}}
    for name, value in model.state_dict(keep_vars=True).items():
        spec = shard_spec(value)
        state[MODEL_KEY][name] = _sharded_tensor(value.detach(), spec) if spec is not None else value.detach()
    if optimizer is not None:
        _refuse_unsharded_optimizer(optimizer, names)
        entries = {}
        for p, values in optimizer.state.items():
            spec, saved = shard_spec(p), entries.setdefault(names[id(p)], {})
            for k, v in values.items():
                if low_bit_states.is_quantized(v):       # torchao's moment: its codes and block scales
                    saved.update(low_bit_checkpoint.saved_pieces(v, spec, k))
                else:
                    saved[k] = _state_entry(v, spec, names[id(p)], k)
        state[OPTIMIZER_KEY] = {"state": entries, "param_groups": _param_groups(optimizer, names)}
    return state


def _refuse_unsharded_optimizer(optimizer, names) -> None:
    foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in names]
    if foreign:
        raise OptpassError(f"fsdp checkpoint: {len(foreign)} parameter(s) of the optimizer are not shards of this "
                           "model (was the optimizer built before optpass.fully_shard(model)?).")


def save_sharded_checkpoint(checkpoint_id, optimizer: torch.optim.Optimizer | None = None,
                            model: torch.nn.Module | None = None, extra=None) -> None:
    """Save a sharded training state with ``torch.distributed.checkpoint``; call on every rank.

    For a model passed to ``optpass.fully_shard``: its parameters and the optimizer's state, each
    rank writing its own pieces, into ``<checkpoint_id>.incomplete`` first, published at
    ``checkpoint_id`` when every rank is done (``optpass.checkpoint_files``: a save killed half-way
    leaves the previous checkpoint loadable). For an optimizer sharded by ``data_parallel="zero1"``:
    ``optpass.zero1.checkpoint.save_sharded_checkpoint``. Either loads on any number of ranks.

    Args:
        checkpoint_id: where to save (DCP's ``checkpoint_id``, e.g. a directory path).
        optimizer: the optimizer (None: a fully sharded model's parameters only).
        model: the model (needed for a fully sharded one).
        extra: what else the run needs to resume (the step, an LR scheduler's ``state_dict()``, a
            data loader's position): anything ``torch.save`` writes, saved in the same checkpoint
            (so published with it); ``load_sharded_checkpoint`` returns it.

    Raises:
        OptpassError: neither a fully sharded model nor a zero1 optimizer; optimizer state that is
            neither elementwise nor a scalar; a training step failed part-way since the last load
            (its state may be half-updated: optpass/rank_failure.py).
    """
    optimizer = _one_optimizer(optimizer, model)
    if model is None or not sharded_parameters(model):
        if optimizer is None:
            raise OptpassError("save_sharded_checkpoint needs the optimizer (zero1) or a fully sharded model.")
        zero1_checkpoint.save_sharded_checkpoint(checkpoint_id, optimizer, model=model, extra=extra)
        return
    _refuse_two_dimensional(model, "save_sharded_checkpoint")
    refuse_saving_after_a_failed_step("save_sharded_checkpoint", optimizer, model)
    group = sharded_parameters(model)[0][2].group
    with publishing(checkpoint_id, group) as writing_to:
        save(with_extra(fsdp_state_dict(model, optimizer), extra), writing_to, group, "save_sharded_checkpoint")


def _refuse_two_dimensional(model, what: str) -> None:
    """optpass's own fsdp checkpoint describes shards of one group; a 2-D model's goes through torch's DCP."""
    if any(spec.tensor_parallel is not None for _, _, spec in sharded_parameters(model)):
        raise OptpassError(
            f"{what}: this model is sharded on a 2-D mesh (optpass.fully_shard over a tensor-parallel plan); "
            "save and load it with torch's API, whose state dicts are DTensors on the 2-D mesh: "
            "from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict; "
            "model_sd, optim_sd = get_state_dict(model, opt); dcp.save({'model': model_sd, 'optim': optim_sd}, "
            "checkpoint_id=path), and set_state_dict(...) after dcp.load.")


def _one_optimizer(optimizer, model=None):
    """The optimizers of a step given as a list (``options={"optimizer": [a, b]}``) seen as one: zero1
    saves and loads each member's shards; a fully sharded model's list is refused."""
    if not isinstance(optimizer, (list, tuple)):
        return optimizer
    if model is not None and sharded_parameters(model):
        raise OptpassError("save_sharded_checkpoint / load_sharded_checkpoint: a list of optimizers with a fully "
                           "sharded model is not supported (zero1's list is): save the model's parameters with "
                           "optpass.full_state_dict(model) or a checkpoint of the model alone "
                           "(save_sharded_checkpoint(path, model=model)), and train the list from them.")
    from optpass.options import OptimizerList

    return OptimizerList.of(optimizer)


def load_sharded_checkpoint(checkpoint_id, optimizer: torch.optim.Optimizer | None = None,
                            model: torch.nn.Module | None = None, **zero1_options):
    """Load a checkpoint saved by ``save_sharded_checkpoint``, on any number of ranks; call on every rank.

    For a fully sharded model (``optpass.fully_shard`` on this world size): its parameters, and
    the optimizer's state and ``param_groups``, in place, before or between steps (a fresh
    optimizer gets its state from the checkpoint). For a zero1 optimizer the keyword options are
    ``optpass.zero1.checkpoint.load_sharded_checkpoint``'s.

    Args:
        checkpoint_id: where the checkpoint was saved.
        optimizer: the optimizer (None: a fully sharded model's parameters only).
        model: the model (needed for a fully sharded one).
        **zero1_options: process_group, partition, bucket_bytes, master_weights (zero1 only).

    Returns:
        The ``extra`` the checkpoint was saved with (None: none).

    Raises:
        OptpassError: neither a fully sharded model nor an optimizer; no complete checkpoint at
            ``checkpoint_id`` (a save that did not finish, a cut or foreign file: nothing is loaded);
            the checkpoint lacks a parameter or holds other param groups.
    """
    optimizer = _one_optimizer(optimizer, model)
    if model is None or not sharded_parameters(model):
        if optimizer is None:
            raise OptpassError("load_sharded_checkpoint needs the optimizer (zero1) or a fully sharded model.")
        return zero1_checkpoint.load_sharded_checkpoint(checkpoint_id, optimizer, model=model, **zero1_options)
    if zero1_options:
        raise OptpassError(f"load_sharded_checkpoint: {sorted(zero1_options)} are zero1's options; a fully "
                           "sharded model takes none.")
    _refuse_two_dimensional(model, "load_sharded_checkpoint")
    metadata = require_complete(checkpoint_id, "load_sharded_checkpoint")
    group = sharded_parameters(model)[0][2].group
    names = _names(model)
    by_name = {name: p for name, p, _ in sharded_parameters(model)}
    write_back_alive()                   # no parameter gathered for initialization writes over the load later
    state = fsdp_state_dict(model)
    fresh: dict[torch.Tensor, dict] = {}
    low_bit = None
    if optimizer is not None:
        _refuse_unsharded_optimizer(optimizer, names)
        if low_bit_states.is_low_bit(optimizer):
            # each shard's new state by torchao's rule for the shard; the checkpoint is read into it
            low_bit = low_bit_checkpoint.LowBitLoad(optimizer, _sharded_tensor)
            group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
            fresh = {p: low_bit_states.new_state(optimizer, p, group_of[id(p)]) for p in by_name.values()
                     if id(p) in group_of}
        entries: dict[str, dict] = {}
        prefix = f"{OPTIMIZER_KEY}.state."
        saved = (metadata or dcp.FileSystemReader(checkpoint_id).read_metadata()).state_dict_metadata
        for fqn, md in saved.items():
            if not fqn.startswith(prefix):
                continue
            rest = fqn[len(prefix):]
            name = next((n for n in sorted(by_name, key=len, reverse=True) if rest.startswith(n + ".")), None)
            if name is None:
                raise OptpassError(f"load_sharded_checkpoint: the checkpoint at {checkpoint_id} does not match: it "
                                   f"holds optimizer state {rest!r}, of no parameter of this model: it was saved from "
                                   "another model. Nothing was loaded.")
            key = rest[len(name) + 1:]
            p, spec = by_name[name], shard_spec(by_name[name])
            size = tuple(getattr(md, "size", ()) or ())
            target = fresh.setdefault(p, {})
            if low_bit is None and key.rpartition(".")[2] in low_bit_states.INNER_NAMES:
                raise OptpassError(
                    f"fsdp checkpoint: optimizer state {key!r} of {name} is a quantized moment's, saved with one of "
                    f"torchao's low-bit optimizers: load it with the optimizer class it was saved with, not "
                    f"{type(optimizer).__name__}.")
            read_into = low_bit.destination(target, p, spec, key, md) if low_bit is not None else None
            if read_into is not None:
                entries.setdefault(name, {})[key] = read_into
            elif size == spec.saved_shape:
                target[key] = torch.zeros_like(p.detach())
                entries.setdefault(name, {})[key] = _sharded_tensor(target[key], spec)
            else:
                target[key] = torch.zeros(size, dtype=md.properties.dtype)
                entries.setdefault(name, {})[key] = target[key]
        state[OPTIMIZER_KEY] = {"state": entries, "param_groups": _param_groups(optimizer, names)}
    extra = load_checked(state, checkpoint_id, metadata, group, "load_sharded_checkpoint")
    if low_bit is not None:
        low_bit.finish()
    with torch.no_grad():
        for name, value in model.state_dict(keep_vars=True).items():
            loaded = state[MODEL_KEY][name]
            if shard_spec(value) is not None:
                mark_written(value, loaded=True)     # the checkpoint's rows, not an init's direct write
            elif loaded is not value:
                value.copy_(loaded)
    finish_initialization(model)       # a model from the meta device: what the checkpoint left unset is refused
    if optimizer is not None:
        optimizer.state.clear()
        for p, values in fresh.items():
            optimizer.state[p] = values
        zero1_checkpoint.restore_param_groups(optimizer, state[OPTIMIZER_KEY]["param_groups"])
        clear_failed_step(optimizer)
    return extra

