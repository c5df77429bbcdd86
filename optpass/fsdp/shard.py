"""``fully_shard``: each rank keeps its shard of every parameter; the module gathers on use.

How a parameter is held (docs/design.md §38, §42): the registered parameter *is* this rank's shard,
its ``ceil(rows / N)`` rows along dim 0 of the full parameter padded with zero rows to a multiple of
N (a 0-d parameter counts as one row), as ``torch.chunk`` and DTensor's ``Shard(0)`` split it. Its
shape never changes, so the step's graph inputs and Dynamo's guards stay stable; it keeps the
parameter's number of dimensions (param groups chosen by ``p.dim()`` stay right);
``model.parameters()`` yields shards (an optimizer built afterwards keeps state for the shards
only); ``model.state_dict()`` holds, as FSDP2's does, each parameter as a DTensor of its full shape
whose local tensor is this rank's rows (``optpass.fsdp.state_dict``).

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
from optpass.fsdp import materialize, mixed_precision, state_dict, write_through
from optpass.fsdp.gather import gather, rows_per_rank
from optpass.process_groups import collective_group_name
from optpass.tensor_parallel import TensorParallelLayout
from optpass.zero1.agreement import agree


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
        unit: the module the parameter is gathered with: the qualified name (in the root model) of
            the block ``fully_shard`` was called on before the root, ``""`` for the root's other
            parameters when blocks were named; None: found from the name (a block of a ModuleList or
            Sequential, else the parameter's module).
        param_dtype: the dtype it is gathered and computed in (a mixed-precision policy's); None:
            the shard's own.
        reduce_dtype: the dtype its gradient is reduced in (the policy's, else its param_dtype);
            None: no policy (fp32 for a bf16/fp16 gradient, else the gradient's dtype).
        tensor_parallel: FSDP + tensor parallel (a 2-D mesh): the parameter was a DTensor of a
            tensor-parallel plan, and what is sharded here (``shape``, ``rows``) is this rank's local
            tensor of it; gathered, the local tensor becomes that DTensor again. None: a plain parameter.
        float8: a torchao ``Float8Linear`` weight converted with ``enable_fsdp_float8_all_gather=True``:
            (its float8 dtype, its ``LinearMMConfig``); the shard is its values (fp32) and a compiled
            step gathers it in float8 (``optpass.fsdp.gather``). None: gathered in its own dtype.
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
    unit: str | None = None
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    tensor_parallel: TensorParallelLayout | None = None
    float8: tuple | None = None

    @property
    def gather_args(self) -> tuple:
        """What the module's property passes to ``gather`` after the shard."""
        return (self.rows, self.shape, self.world, self.group_name, self.param_dtype, self.reduce_dtype, self.float8)

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
GATHER_ARGS = "_optpass_gather_args"      # on a sharded module: {name: ShardSpec.gather_args}
TENSOR_PARALLEL = "_optpass_tensor_parallel"   # on a sharded module: {name: TensorParallelLayout}
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


def fully_shard(module: torch.nn.Module, process_group=None, reshard_after_forward: bool = True, *,
                mesh=None, mp_policy=None, offload_policy=None) -> torch.nn.Module:
    """Shard every parameter of ``module`` over the ranks of a process group (ZeRO-3).

    Call it on every rank, after the model is built and before the optimizer: on the whole model,
    or FSDP2's way, on each block first and then on the whole model (the blocks are then the units
    the step gathers together; by default they are found from the parameters' names). Each rank then keeps
    only its shard of each parameter (its ``ceil(rows / N)`` rows along dim 0, zero-padded; rank 0's
    values, so every rank starts from the same model, as DDP does); ``module.parameters()`` yields
    the shards, so the optimizer built afterwards keeps state for the shards only. Reading a
    parameter through its module (``module.weight``) gathers it from every rank: the forward of a
    step compiled with ``data_parallel="fsdp"`` gathers each parameter just before its use and frees
    it after; its backward reduces each gradient onto its shard (averaged over the ranks). Outside
    the step, ``model(x)`` under ``torch.no_grad()`` gathers too: every rank must call it.

    A model built on the meta device is sharded as shapes: ``module.to_empty(device=...)`` then
    allocates each rank's shards only, and the model's own initialization (``reset_parameters()``,
    ``model.apply(fn)``, ``init_weights()``) writes each rank's rows of what it gives the unsharded
    model under the same seed (``optpass.fsdp.materialize``; seed every rank alike).

    Args:
        module: the model (every parameter it holds is sharded, tied ones once). Buffers stay whole.
        process_group: the torch.distributed group to shard over (None: the default group).
        reshard_after_forward: True (FSDP2's default): backward gathers each parameter again, so
            no full parameter lives from forward to backward; False keeps the forward's gathered
            parameters for backward (more memory, one all-gather less per parameter).
        mesh: FSDP2's spelling of the group: a 1-D ``DeviceMesh`` (its group is used), e.g.
            ``mesh["dp"]`` of a 2-D mesh whose ``"tp"`` dimension holds a tensor-parallel plan
            (``parallelize_module`` first): then each DTensor parameter's local tensor is sharded
            over dp, and gathered it is the plan's DTensor again (FSDP + tensor parallel). Give
            ``process_group`` or ``mesh``, not both.
        mp_policy: FSDP2's ``torch.distributed.fsdp.MixedPrecisionPolicy``: the shards and the
            optimizer's state stay in the parameters' dtype (fp32); each parameter is cast to
            ``param_dtype`` before it is gathered (half the all-gather's bytes for bf16) and the model
            computes in it; gradients are reduced in ``reduce_dtype`` (default: ``param_dtype``) and
            reach the shards in their own dtype; floating-point inputs of this module's forward are
            cast to ``param_dtype`` (``cast_forward_inputs``) and its outputs to ``output_dtype``
            (when given). The policy of the call that sharded a parameter holds for it (a block's,
            for the block's parameters).
        offload_policy: FSDP2's ``OffloadPolicy()`` (no offload) is accepted; ``CPUOffloadPolicy``
            is refused (shards stay on the parameters' device).

    Returns:
        ``module``, its parameters now shards.

    Raises:
        OptpassError: torch.distributed is not initialized; a mesh of more than one dimension, both
            ``process_group`` and ``mesh``, or CPU offload was asked for; ``fully_shard`` was called on this
            module already, or on a module around it before it; a block was sharded over another
            group or with another ``reshard_after_forward``; a weight is tied between a block
            sharded first and the rest of the model; parameters are DTensors over the ranks sharded
            over (torch's FSDP2 ``fully_shard``, or a plan that shares ranks with the group); the
            ranks hold different models (names,
            shapes or dtypes differ; every rank raises it).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise OptpassError("optpass.fully_shard needs torch.distributed: call "
                           "torch.distributed.init_process_group(...) on every rank first.")
    group = _group_of(process_group, mesh)
    _refuse_offload(offload_policy)
    _check_tensor_parallel_parameters(module, group)
    param_dtype, reduce_dtype = mixed_precision.dtypes(mp_policy)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        materialize.remember_meta_buffers(module)
    blocks = _sharded_blocks(module, group, reshard_after_forward)
    named = [(n, p) for n, p in module.named_parameters(remove_duplicate=True) if p not in _SPECS]
    # every rank the same model, before any collective (a mismatch would hang in the broadcast)
    agree(group, "fsdp", [("parameters", [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in named]),
                          ("buffers", [(n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()])])
    shards: dict[int, torch.nn.Parameter] = {}
    with torch.no_grad():
        for name, full in named:
            shards[id(full)] = _shard(full, name, group, world, rank, reshard_after_forward,
                                      unit="" if blocks else None, param_dtype=param_dtype,
                                      reduce_dtype=reduce_dtype)
        for buffer in module.buffers():
            if not buffer.is_meta:             # a meta buffer is made rank 0's after its initialization
                dist.broadcast(buffer, dist.get_global_rank(group, 0), group=group)
    for sub in module.modules():
        local = [n for n, p in sub._parameters.items() if p is not None and id(p) in shards]
        if not local:
            continue
        gathering = dict(getattr(sub, GATHER_ARGS, {}))
        layouts = dict(getattr(sub, TENSOR_PARALLEL, {}))
        for n in local:
            _REPLACED[sub._parameters[n]] = _SPECS[shards[id(sub._parameters[n])]].name
            shard = sub._parameters[n] = shards[id(sub._parameters[n])]
            spec = _SPECS[shard]
            gathering[n] = spec.gather_args
            if spec.tensor_parallel is not None:
                layouts[n] = spec.tensor_parallel
        # plain values on the module, which Dynamo reads as constants (a WeakIdKeyDictionary lookup
        # in the property would break the graph)
        object.__setattr__(sub, GATHER_ARGS, gathering)
        object.__setattr__(sub, TENSOR_PARALLEL, layouts)
        sub.__class__ = _sharded_class(type(sub), tuple(sorted(local)))
        # its state dict in FSDP2's language: DTensors over the group's mesh (optpass.fsdp.state_dict)
        state_dict.install_module_hooks(sub, _sharded_names, shard_spec, _loaded)
    object.__setattr__(module, SHARDED_HERE, True)
    mixed_precision.cast_forward_inputs_and_outputs(module, mp_policy)
    state_dict.adopt_optimizers_at_their_first_step(shard_spec, _stepped_at_zero_lr)
    if not isinstance(module, _KeepsShardsThroughApply):
        module.__class__ = _keeping_shards_class(type(module))
    materialize.track_root(module)
    return module


def _sharded_names(module: torch.nn.Module) -> list[str]:
    return list(getattr(module, GATHER_ARGS, {}))


def _loaded(shard: torch.Tensor) -> None:
    """A load_state_dict wrote ``shard``'s rows: a checkpoint's values, not an init's direct write."""
    materialize.mark_written(shard, loaded=True)


def adopt_optimizer(optimizer) -> None:
    """The optimizer's ``state_dict()`` / ``load_state_dict`` speak DTensors for its shards' state
    (``optpass.fsdp.state_dict``); done at its first step, or here by a step compiled with it."""
    state_dict.adopt_optimizer(optimizer, shard_spec, _stepped_at_zero_lr)


def _stepped_at_zero_lr(shard: torch.Tensor) -> None:
    """An optimizer's load_state_dict took state for ``shard``: the step torch's set_state_dict takes at
    lr 0 before it (to create the state) wrote the shard in place, which is not an init's draw."""
    materialize.mark_written(shard)


class _KeepsShardsThroughApply:
    """Mixed into the class of a module passed to ``fully_shard``: ``to_empty``, ``.to()``,
    ``.float()`` (``Module._apply``) give each module new parameter objects (tied ones untied, as
    without sharding); the shards' specs follow them, and shards that come off the meta device start
    their initialization (``optpass.fsdp.materialize``)."""

    def get_parameter(self, target: str) -> torch.nn.Parameter:
        """The registered parameter (a shard), as ``named_parameters()`` yields it: reading it as an
        attribute would gather it (Hugging Face's ``tie_weights`` looks parameters up this way)."""
        module_path, _, name = target.rpartition(".")
        module = self.get_submodule(module_path)
        if name in getattr(module, GATHER_ARGS, {}):
            return module._parameters[name]
        return super().get_parameter(target)

    def _apply(self, fn, recurse=True):
        before = {(m, n): m._parameters[n] for m in self.modules() for n in getattr(m, GATHER_ARGS, {})}
        result = super()._apply(fn, recurse)
        materialize.materialized(self, before, _SPECS)
        for module in self.modules():           # the collectives' group for the device the shards are on now
            gathering = getattr(module, GATHER_ARGS, None)
            for n in gathering or ():
                shard, spec = module._parameters[n], _SPECS[module._parameters[n]]
                group_name = collective_group_name(spec.group, shard.device.type)
                if group_name != spec.group_name:
                    _SPECS[shard] = spec = dataclasses.replace(spec, group_name=group_name)
                gathering[n] = spec.gather_args
        return result


def _keeping_shards_class(cls: type) -> type:
    key = (cls, "keeps shards")
    if key not in _SHARDED_CLASSES:
        _SHARDED_CLASSES[key] = type(cls.__name__, (_KeepsShardsThroughApply, cls),
                                     {"__module__": cls.__module__, "_optpass_unsharded_class":
                                      getattr(cls, "_optpass_unsharded_class", cls)})
    return _SHARDED_CLASSES[key]


SHARDED_HERE = "_optpass_fully_shard_called"     # on a module fully_shard was called on


def _sharded_blocks(module: torch.nn.Module, group, reshard_after_forward: bool) -> list[str]:
    """FSDP2's pattern: ``fully_shard(block)`` for each block, then ``fully_shard(model)``. The
    blocks sharded before this call become its gather units (their shards' specs get the block's
    qualified name in ``module`` and their names in it); returns their names. Refuses a second call
    on the same module, a block sharded over another group or with another ``reshard_after_forward``,
    and a module whose parameters are all sharded by a call on a module around it."""
    if getattr(module, SHARDED_HERE, False):
        raise OptpassError(f"optpass.fully_shard: {module.__class__.__name__} was sharded already: call "
                           "fully_shard once on each block (optional) and then once on the whole model.")
    blocks = [(q, sub) for q, sub in module.named_modules() if q and getattr(sub, SHARDED_HERE, False)]
    inner = {id(p) for _, sub in blocks for p in sub.parameters()}
    stray = [n for n, p in module.named_parameters() if p in _SPECS and id(p) not in inner]
    if stray:
        raise OptpassError(f"optpass.fully_shard: {module.__class__.__name__}'s parameters "
                           f"({', '.join(stray[:3])}) were sharded by a fully_shard call on a module around it: "
                           "call fully_shard on each block first, then on the whole model (FSDP2's order).")
    outermost = [(q, sub) for q, sub in blocks if not any(q.startswith(o + ".") for o, _ in blocks if o != q)]
    for qualified, block in outermost:
        for name, shard in block.named_parameters(remove_duplicate=True):
            spec = _SPECS[shard]
            if spec.group is not group or spec.reshard_after_forward != reshard_after_forward:
                raise OptpassError(f"optpass.fully_shard: block {qualified} was sharded over another process "
                                   "group or with another reshard_after_forward than the whole model: use the "
                                   "same for every call.")
            _SPECS[shard] = dataclasses.replace(spec, name=f"{qualified}.{name}", unit=qualified)
    tied = [n for n, p in module.named_parameters() if p in _REPLACED]
    if tied:
        raise OptpassError(f"optpass.fully_shard: {', '.join(tied[:3])} is tied to a parameter of a block sharded "
                           "before (the block holds its shard, this module the full tensor): shard the whole "
                           "model with one call, optpass.fully_shard(model), or keep tied weights out of the "
                           "blocks you shard first.")
    return [q for q, _ in outermost]


def _group_of(process_group, mesh):
    """The process group to shard over: ``process_group``, a 1-D mesh's group, else the default group."""
    if mesh is None:
        return process_group if process_group is not None else dist.group.WORLD
    if process_group is not None:
        raise OptpassError("optpass.fully_shard: give process_group or mesh, not both.")
    if mesh.ndim != 1:
        raise OptpassError(f"optpass.fully_shard: mesh has {mesh.ndim} dimensions ({mesh.mesh_dim_names or ''}); "
                           "optpass shards over one group (FSDP, not HSDP or FSDP + tensor parallel): pass a 1-D "
                           "mesh, e.g. init_device_mesh(device, (world_size,)), or its process group.")
    return mesh.get_group()


def _check_tensor_parallel_parameters(module: torch.nn.Module, group) -> None:
    """DTensor parameters are sharded further only where they come from a tensor-parallel plan over
    other ranks than ``group``'s (FSDP + TP on a 2-D mesh: ``mesh["tp"]`` for the plan, ``mesh["dp"]``
    here); DTensors over the group's own ranks were sharded by torch (FSDP2's ``fully_shard``)."""
    from torch.distributed.tensor import DTensor

    dtensors = [(n, p) for n, p in module.named_parameters() if isinstance(p, DTensor)]
    if not dtensors:
        return
    mine = set(dist.get_process_group_ranks(group))
    for name, p in dtensors:
        mesh = p.device_mesh
        ranks = set(mesh.mesh.flatten().tolist())
        plain = all(placement.is_shard() or placement.is_replicate() for placement in p.placements)
        if mesh.ndim == 1 and plain and ranks & mine == {dist.get_rank()}:
            continue
        named = [n for n, _ in dtensors]
        raise OptpassError(
            f"optpass.fully_shard: {', '.join(named[:3])}{' and more' if len(named) > 3 else ''} are DTensors "
            f"({name} on a mesh of ranks {sorted(ranks)}, placements {tuple(p.placements)}) that are not a "
            "tensor-parallel plan over other ranks than the ones fully_shard shards over: torch's "
            "torch.distributed.fsdp.fully_shard sharded them already, or the plan and fully_shard share ranks. "
            "optpass.fully_shard shards plain parameters, or a tensor-parallel plan's local tensors on a 2-D mesh: "
            "mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')); parallelize_module(model, "
            "mesh['tp'], plan); optpass.fully_shard(block, mesh=mesh['dp']) per block, then the model. Do not "
            "mix torch's fully_shard with optpass's.")


def _refuse_offload(offload_policy) -> None:
    if offload_policy is not None and type(offload_policy).__name__ != "OffloadPolicy":
        raise OptpassError(f"optpass.fully_shard: offload_policy={type(offload_policy).__name__}(...) is not "
                           "supported: optpass keeps each rank's shards and optimizer state on the parameters' "
                           "device. Leave offload_policy out.")


def _shard(full: torch.nn.Parameter, name, group, world, rank, reshard_after_forward,
           unit: str | None = None, param_dtype: torch.dtype | None = None,
           reduce_dtype: torch.dtype | None = None) -> torch.nn.Parameter:
    """Rank 0's value of ``full`` (received into ``full`` itself, which the shard replaces), this
    rank's rows of it as a new parameter: no copy of the whole parameter is made. Of a tensor-parallel
    DTensor, its local tensor is what is sharded (rank 0 of ``group`` holds the same part of it)."""
    layout, requires_grad = TensorParallelLayout.of(full), full.requires_grad
    if layout is not None:
        full = full._local_tensor
    float8 = _float8_all_gather(full, name, layout)
    if float8 is not None:
        full = full._tensor           # torchao's WeightWithDynamicFloat8CastTensor: its values
    value = full.detach()
    rows_of = value.reshape(1) if value.dim() == 0 else value
    rows = rows_of.shape[0]
    chunk = max(1, math.ceil(rows / world))
    if value.is_meta:        # shapes only: the shard's values come with its initialization, on its device
        data, device_type = rows_of.new_empty(chunk, *rows_of.shape[1:]), "cpu"
    else:
        dist.broadcast(value, dist.get_global_rank(group, 0), group=group)
        mine = rows_of[min(rank * chunk, rows):min((rank + 1) * chunk, rows)]
        padding = rows_of.new_zeros(chunk - mine.shape[0], *rows_of.shape[1:])
        data, device_type = torch.cat([mine, padding]) if padding.shape[0] else mine.clone(), value.device.type
    shard = torch.nn.Parameter(data, requires_grad=requires_grad)
    floating = value.is_floating_point()
    _SPECS[shard] = ShardSpec(name, tuple(value.shape), value.numel(), rows, chunk, world, rank, group,
                              collective_group_name(group, device_type), reshard_after_forward, unit,
                              param_dtype if floating and param_dtype != value.dtype else None,
                              reduce_dtype if floating else None, layout, float8)
    return shard


def _float8_all_gather(full: torch.Tensor, name: str, layout) -> tuple | None:
    """(float8 dtype, LinearMMConfig) of a weight torchao converted for FSDP2's float8 all-gather
    (``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``), else None."""
    if type(full).__name__ != "WeightWithDynamicFloat8CastTensor":
        return None
    if layout is not None or getattr(full, "_precomputed_scale", None) is not None:
        raise OptpassError(
            f"optpass.fully_shard: {name} is a torchao float8 weight for FSDP2's float8 all-gather "
            "(Float8LinearConfig(enable_fsdp_float8_all_gather=True)) inside a tensor-parallel DTensor or with a "
            "precomputed scale: optpass gathers it in float8 on a 1-D mesh only. Convert with the default "
            "Float8LinearConfig for FSDP + tensor parallel (each gathered weight is cast to float8 for its GEMM).")
    return (full._dtype, full._linear_mm_config)


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
        shard = self._parameters[name]
        args = getattr(self, GATHER_ARGS)[name]
        rows, shape, world = args[:3]
        if shard is None or tuple(shard.shape) != ((rows_per_rank(rows, world), *shape[1:]) if shape else (1,)):
            raise OptpassError(
                f"{type(self).__name__}.{name} is not the shard optpass.fully_shard registered (its shape is "
                f"{None if shard is None else tuple(shard.shape)}): a parameter replaced after fully_shard. Replace "
                "parameters before calling optpass.fully_shard(model), or load new values into the shards with "
                f"optpass.load_full_state_dict(model, {{...}}).")
        if shard.device.type == "meta":
            raise OptpassError(materialize.meta_message(f"{type(self).__name__}.{name} is"))
        layout = getattr(self, TENSOR_PARALLEL, {}).get(name)
        if torch.compiler.is_compiling():
            local = gather(shard, *args)
            return local if layout is None else layout.as_dtensor(local)
        if materialize.initializing(shard):
            if layout is not None:
                raise OptpassError("optpass.fully_shard on a tensor-parallel model built on the meta device: not "
                                   "supported; build it on the device, then parallelize_module and fully_shard.")
            return materialize.full_for_initialization(shard, _SPECS[shard])
        if args[4] is not None and not mixed_precision.in_forward():
            args = (*args[:4], None, *args[5:])     # read outside a forward: the shard's dtype, as FSDP2's
        args = (*args[:6], None)      # eagerly, a float8 weight is gathered in its dtype: its Linear casts it
        write_through.write_back_released(shard)   # earlier reads' writes first: this gather reads them
        version = shard._version
        local = write_through.remember(gather(shard, *args), shard, _SPECS[shard], version)
        return local if layout is None else layout.as_dtensor(local)
    gathered.__name__ = name
    return gathered
