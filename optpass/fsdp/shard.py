"""``fully_shard``: each rank keeps its shard of every parameter; the module gathers on use.

How a parameter is held (docs/design.md §38, §42): the registered parameter *is* this rank's shard,
its ``ceil(rows / N)`` rows along dim 0 of the full parameter padded with zero rows to a multiple of
N (a 0-d parameter counts as one row), as ``torch.chunk`` and DTensor's ``Shard(0)`` split it. Its
shape never changes, so the step's graph inputs and Dynamo's guards stay stable; it keeps the
parameter's number of dimensions (param groups chosen by ``p.dim()`` stay right);
``model.parameters()`` yields shards (an optimizer built afterwards keeps state for the shards
only) and ``model.state_dict()`` holds shards under the parameters' own names.

Reading the parameter through its module (``linear.weight``) gathers it: the module's class is
swapped for a subclass whose property of that name returns ``gather(shard)``, an all-gather of the
shards in the step's graph whose gradient is the reduce-scatter of the full gradient onto the
shard, averaged over the ranks. The gathered value lives only as long as the code that read it; in
a compiled step with ``data_parallel="fsdp"`` the pass ``reshard_after_forward`` gathers it again
for backward, so no full parameter outlives its use. Padding stays zero: its gradient is zero and an
elementwise update leaves a zero with a zero gradient at zero (optimizers whose update reads a whole
parameter are refused, as for ZeRO-1: §28).

A parameter registered in several modules (tied weights: GPT-2's embedding and head) is one shard,
registered under each name; each read gathers it, and backward sums the reduce-scatters.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from optpass.errors import OptpassError
from optpass.fsdp.gather import gather
from optpass.process_groups import collective_group_name
from optpass.zero1.agreement import agree, announce_refusal


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How one parameter is sharded: its full shape and dtype, the group, and this rank's part.

    Attributes:
        name: the parameter's name in the module passed to ``fully_shard`` (the first, if tied).
        shape: the full parameter's shape.
        numel: its number of elements.
        rows: its rows along dim 0 (1 for a 0-d parameter).
        chunk: rows per rank (``ceil(rows / world)``); rank r holds rows ``[r * chunk, (r + 1) * chunk)``
            of the full parameter padded with zero rows.
        world: the number of ranks of the group.
        rank: this rank in the group.
        group: the process group.
        group_name: the name of the group the shard's collectives run on: ``group``'s, or on gloo its
            twin with one worker thread (``optpass.process_groups``; docs/design.md §45).
        reshard_after_forward: whether the step gathers the parameter again for backward.
    """

    name: str
    shape: tuple[int, ...]
    numel: int
    rows: int
    chunk: int
    world: int
    rank: int
    group: object
    group_name: str
    reshard_after_forward: bool

    @property
    def valid(self) -> int:
        """How many of this rank's ``chunk`` rows belong to the parameter (the rest is padding)."""
        return max(0, min(self.chunk, self.rows - self.rank * self.chunk))

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """The shape of every rank's shard: ``chunk`` rows of the parameter."""
        return (self.chunk, *self.shape[1:])

    @property
    def saved_shape(self) -> tuple[int, ...]:
        """The shape a checkpoint stores: the parameter's, a 0-d one as one element."""
        return self.shape if self.shape else (1,)

    @property
    def offset(self) -> int:
        """The first of this rank's rows in the parameter."""
        return min(self.rank * self.chunk, self.rows)


_SPECS: WeakIdKeyDictionary = WeakIdKeyDictionary()       # shard parameter -> ShardSpec
_REPLACED: WeakIdKeyDictionary = WeakIdKeyDictionary()    # full parameter fully_shard replaced -> its name
GATHER_ARGS = "_optpass_gather_args"      # on a sharded module: {name: (rows, shape, world, group name)}
_SHARDED_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def shard_spec(tensor) -> ShardSpec | None:
    """The ShardSpec of a parameter ``fully_shard`` made, or None for any other tensor."""
    return _SPECS.get(tensor)


def replaced_name(tensor) -> str | None:
    """The name of a full parameter that ``fully_shard`` replaced by its shard (an optimizer built
    before ``fully_shard`` still holds it), or None."""
    return _REPLACED.get(tensor)


def optimizer_group(optimizer):
    """The process group the optimizer's parameters are sharded over (None: none is a shard)."""
    spec = optimizer_shard_spec(optimizer)
    return spec.group if spec is not None else None


def optimizer_shard_spec(optimizer) -> ShardSpec | None:
    """The ShardSpec of the optimizer's first sharded parameter (None: none is a shard)."""
    return next((s for g in optimizer.param_groups for p in g["params"] if (s := _SPECS.get(p)) is not None), None)


def sharded_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, ShardSpec]]:
    """(name, shard, spec) of every sharded parameter of ``module``, each shard once."""
    return [(name, p, _SPECS[p]) for name, p in module.named_parameters() if p in _SPECS]


def fully_shard(module: torch.nn.Module, process_group=None, reshard_after_forward: bool = True
                ) -> torch.nn.Module:
    """Shard every parameter of ``module`` over the ranks of a process group (ZeRO-3).

    Call it on every rank, after the model is built and before the optimizer. Each rank then keeps
    only its shard of each parameter (its ``ceil(rows / N)`` rows along dim 0, zero-padded; rank 0's
    values, so every rank starts from the same model, as DDP does); ``module.parameters()`` yields
    the shards, so the optimizer built afterwards keeps state for the shards only. Reading a
    parameter through its module (``module.weight``) gathers it from every rank: the forward of a
    step compiled with ``data_parallel="fsdp"`` gathers each parameter just before its use and frees
    it after; its backward reduces each gradient onto its shard (averaged over the ranks). Outside
    the step, ``model(x)`` under ``torch.no_grad()`` gathers too: every rank must call it.

    Args:
        module: the model (every parameter it holds is sharded, tied ones once). Buffers stay whole.
        process_group: the torch.distributed group to shard over (None: the default group).
        reshard_after_forward: True (FSDP2's default): backward gathers each parameter again, so
            no full parameter lives from forward to backward; False keeps the forward's gathered
            parameters for backward (more memory, one all-gather less per parameter).

    Returns:
        ``module``, its parameters now shards.

    Raises:
        OptpassError: torch.distributed is not initialized; the module holds tensors on the meta
            device (build it on the CPU, or ``to_empty`` and initialize it first); the module was
            sharded already; the ranks hold different models (names, shapes or dtypes differ;
            every rank raises it).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise OptpassError("optpass.fully_shard needs torch.distributed: call "
                           "torch.distributed.init_process_group(...) on every rank first.")
    group = process_group if process_group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    _refuse_meta_tensors(module)
    already = [name for name, p in module.named_parameters() if p in _SPECS]
    if already:
        raise OptpassError(f"optpass.fully_shard: {module.__class__.__name__} holds sharded parameters "
                           f"already ({', '.join(already[:3])}): call fully_shard once, on the whole model. "
                           "optpass finds the units itself (a block of a ModuleList or Sequential: one all-gather "
                           "per block, per parameter on gloo), so FSDP2's fully_shard(block) for each block first "
                           "is not needed; those parts are sharded now: build the model again and call "
                           "optpass.fully_shard(model) alone.")
    named = list(module.named_parameters(remove_duplicate=True))
    # every rank the same model, before any collective (a mismatch would hang in the broadcast)
    agree(group, "fsdp", [("parameters", [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in named]),
                          ("buffers", [(n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()])])
    shards: dict[int, torch.nn.Parameter] = {}
    with torch.no_grad():
        for name, full in named:
            shards[id(full)] = _shard(full, name, group, world, rank, reshard_after_forward)
        for buffer in module.buffers():
            dist.broadcast(buffer, dist.get_global_rank(group, 0), group=group)
    for sub in module.modules():
        local = [n for n, p in sub._parameters.items() if p is not None and id(p) in shards]
        if not local:
            continue
        gathering = dict(getattr(sub, GATHER_ARGS, {}))
        for n in local:
            _REPLACED[sub._parameters[n]] = _SPECS[shards[id(sub._parameters[n])]].name
            shard = sub._parameters[n] = shards[id(sub._parameters[n])]
            spec = _SPECS[shard]
            gathering[n] = (spec.rows, spec.shape, spec.world, spec.group_name)
        # plain values on the module, which Dynamo reads as constants (a WeakIdKeyDictionary lookup
        # in the property would break the graph)
        object.__setattr__(sub, GATHER_ARGS, gathering)
        sub.__class__ = _sharded_class(type(sub), tuple(sorted(local)))
    return module


def _refuse_meta_tensors(module: torch.nn.Module) -> None:
    """A model built under ``torch.device("meta")`` holds no values: nothing to broadcast from rank 0
    or to shard. Refused before the ranks' agreement (announced: a rank waiting in it fails with this)."""
    on_meta = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if not on_meta:
        return
    message = (
        f"optpass.fully_shard: {module.__class__.__name__} holds {len(on_meta)} parameter(s) and buffer(s) on "
        f"the meta device ({', '.join(on_meta[:3])}{', ...' if len(on_meta) > 3 else ''}): they have no values "
        "to shard or to take from rank 0. fully_shard shards a model that holds its values: build it on the "
        "CPU, or materialize it first, on every rank: model.to_empty(device='cpu'), then initialize every "
        "parameter and buffer (reset_parameters() of each module that has one, and what the constructor "
        "computes, such as a rotary table), then optpass.fully_shard(model), which takes rank 0's values. "
        "Each rank holds the whole model until fully_shard: a model that stays on the meta device until it "
        "is sharded is not supported.")
    announce_refusal(message)
    raise OptpassError(message)


def _shard(full: torch.nn.Parameter, name, group, world, rank, reshard_after_forward) -> torch.nn.Parameter:
    """Rank 0's value of ``full`` (received into ``full`` itself, which the shard replaces), this
    rank's rows of it as a new parameter: no copy of the whole parameter is made."""
    value = full.detach()
    dist.broadcast(value, dist.get_global_rank(group, 0), group=group)
    rows_of = value.reshape(1) if value.dim() == 0 else value
    rows = rows_of.shape[0]
    chunk = max(1, math.ceil(rows / world))
    mine = rows_of[min(rank * chunk, rows):min((rank + 1) * chunk, rows)]
    padding = rows_of.new_zeros(chunk - mine.shape[0], *rows_of.shape[1:])
    shard = torch.nn.Parameter(torch.cat([mine, padding]) if padding.shape[0] else mine.clone(),
                               requires_grad=full.requires_grad)
    _SPECS[shard] = ShardSpec(name, tuple(value.shape), value.numel(), rows, chunk, world, rank, group,
                              collective_group_name(group, value.device.type), reshard_after_forward)
    return shard


def _sharded_class(cls: type, names: tuple[str, ...]) -> type:
    """``cls`` with a property per sharded parameter name that gathers the shard."""
    key = (cls, names)
    if key not in _SHARDED_CLASSES:
        attrs = {name: property(_gathering(name)) for name in names}
        attrs["__module__"] = cls.__module__
        attrs["_optpass_unsharded_class"] = cls
        _SHARDED_CLASSES[key] = type(f"Sharded{cls.__name__}", (cls,), attrs)
    return _SHARDED_CLASSES[key]


def _gathering(name: str):
    def gathered(self):
        return gather(self._parameters[name], *getattr(self, GATHER_ARGS)[name])
    gathered.__name__ = name
    return gathered
