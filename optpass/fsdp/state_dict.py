"""FSDP2's state-dict language for a model sharded by ``optpass.fully_shard``: DTensors on a mesh.

A rank holds each parameter as a plain tensor of ``chunk`` rows, zero-padded (``optpass.fsdp.shard``).
What a state dict holds instead is what FSDP2's holds (docs/design.md §50): a ``DTensor`` with the
parameter's full shape, placed ``Shard(0)`` on a one-dimensional device mesh over the group, whose
local tensor is a view of this rank's valid rows (``torch.chunk``'s split, the padding left out). So
``model.state_dict()``, the optimizer's ``state_dict()``, torch's ``get_state_dict`` /
``set_state_dict`` (sharded or full), ``dcp.save`` / ``dcp.load`` (which write and read the local
views in place) and torchtitan's checkpoint manager see one global tensor per name, never a shard
under a full name, and a checkpoint saved on N ranks loads on M.

* ``model.state_dict()``: each module that holds shards has a state-dict hook that puts the DTensor
  in place of its shard (``keep_vars=True`` still gives the registered shard parameters); a 0-d
  parameter is a ``Replicate`` DTensor of rank 0's value (a broadcast).
* ``model.load_state_dict(sd)``: a load hook turns what it is given back into this rank's padded
  rows: a DTensor (its local rows when it is split as the shard is, else its ``full_tensor()``), a
  full tensor (this rank's rows of it), or a shard-shaped tensor of an older optpass state dict.
* The optimizer: its ``state_dict()`` gives each elementwise state tensor of a shard (Adam's
  ``exp_avg``) as the parameter's DTensor; ``load_state_dict`` takes them back the same way. An
  optimizer is adopted (its hooks registered) at its first step (a global step pre-hook that
  ``fully_shard`` registers; torch's ``get_state_dict`` / ``set_state_dict`` step a stateless
  optimizer once to create its state) and when a step compiled with ``data_parallel="fsdp"`` names it.
  State that is not elementwise cannot be expressed as a shard: saving it is refused.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from optpass.errors import OptpassError
from optpass.fsdp import write_through
from optpass.optim import low_bit_states

_MESHES: dict[tuple[int, str], DeviceMesh] = {}
_ADOPTED: WeakIdKeyDictionary = WeakIdKeyDictionary()          # optimizer -> True
_GLOBAL_HOOK: list = []


def device_mesh(group, device_type: str) -> DeviceMesh:
    """The one-dimensional device mesh over ``group`` (one per group and device type)."""
    key = (id(group), device_type)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(group, device_type)
    return _MESHES[key]


def shard_as_dtensor(piece: torch.Tensor, spec) -> DTensor:
    """``piece`` (a shard's rows, or an elementwise optimizer state of it: ``spec.shard_shape``) as
    the parameter's DTensor; its local tensor is a view of ``piece``'s valid rows."""
    if spec.tensor_parallel is not None:
        return _as_two_dimensional_dtensor(piece, spec)
    mesh = device_mesh(spec.group, piece.device.type)
    if not spec.shape:                  # 0-d: rank 0 holds it; every rank gets its value, replicated
        value = piece[:1].clone()
        dist.broadcast(value, dist.get_global_rank(spec.group, 0), group=spec.group)
        return DTensor.from_local(value.reshape(()), mesh, [Replicate()], run_check=False)
    return DTensor.from_local(piece[:spec.valid], mesh, [Shard(0)], run_check=False,
                              shape=torch.Size(spec.shape), stride=make_contiguous_strides_for(spec.shape))


def two_dimensional_layout(spec) -> tuple[DeviceMesh, list]:
    """FSDP + tensor parallel: the 2-D mesh (the tensor-parallel mesh's root) and the placements of a
    parameter whose tensor-parallel local tensor is sharded over ``spec.group``: the tensor-parallel
    placement on its mesh dimension, and on the other the data-parallel rows of the local tensor,
    ``Shard(0)``, or FSDP2's ``_StridedShard(0, split_factor=tp)`` where tensor parallelism splits
    dim 0 first (the rows of each tensor-parallel part split over dp)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    layout = spec.tensor_parallel
    root = layout.mesh._get_root_mesh()
    names = root.mesh_dim_names or ()
    tp_name = (layout.mesh.mesh_dim_names or (None,))[0]
    if root.ndim != 2 or tp_name not in names:
        raise OptpassError(f"state_dict of {spec.name}: its tensor-parallel mesh is not a named dimension of a "
                           "2-D mesh; make both with init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', "
                           "'tp')) and use mesh['tp'] for the plan and mesh['dp'] for optpass.fully_shard.")
    tp_dim = names.index(tp_name)
    dp_dim = 1 - tp_dim
    if set(dist.get_process_group_ranks(root.get_group(dp_dim))) != set(dist.get_process_group_ranks(spec.group)):
        raise OptpassError(f"state_dict of {spec.name}: optpass.fully_shard sharded it over other ranks than the "
                           f"2-D mesh's {names[dp_dim]!r} dimension; pass mesh={names[dp_dim]!r}'s submesh to it.")
    if not spec.shape or spec.rows % spec.world:
        raise OptpassError(f"state_dict of {spec.name}: its tensor-parallel local tensor has {spec.rows} rows, which "
                           f"the {spec.world} data-parallel ranks do not divide: a 2-D DTensor cannot describe the "
                           "padded shards. Choose sizes that divide, or save with optpass.full_state_dict(model).")
    tp_placement = layout.placements[0]
    placements = [None, None]
    placements[tp_dim] = tp_placement
    placements[dp_dim] = (_StridedShard(0, split_factor=root.size(tp_dim)) if tp_placement.is_shard(0)
                          else Shard(0))
    return root, placements


def _as_two_dimensional_dtensor(piece: torch.Tensor, spec) -> DTensor:
    root, placements = two_dimensional_layout(spec)
    layout = spec.tensor_parallel
    return DTensor.from_local(piece[:spec.valid], root, placements, run_check=False,
                              shape=torch.Size(layout.shape), stride=layout.stride)


def _split_as_the_shard(value: DTensor, spec) -> bool:
    if spec.tensor_parallel is not None:
        root, placements = two_dimensional_layout(spec)
        return (value.device_mesh == root and tuple(value.placements) == tuple(placements)
                and tuple(value.shape) == tuple(spec.tensor_parallel.shape))
    mesh = value.device_mesh
    return (tuple(value.placements) == (Shard(0),) and mesh.ndim == 1 and mesh.size() == spec.world
            and mesh.get_local_rank() == spec.rank and tuple(value.shape) == tuple(spec.shape))


def as_shard(value, spec, name: str, like: torch.Tensor) -> torch.Tensor:
    """This rank's padded rows (``spec.shard_shape``, ``like``'s dtype and device) of ``value``: the
    parameter's DTensor, its full tensor, or already a shard of it.

    Raises:
        OptpassError: ``value``'s shape is neither the parameter's nor the shard's.
    """
    if isinstance(value, DTensor):
        if _split_as_the_shard(value, spec):
            return _padded(value.to_local(), spec, like)
        value = value.full_tensor()
    if spec.tensor_parallel is not None and tuple(value.shape) == tuple(spec.tensor_parallel.shape):
        value = spec.tensor_parallel.local_of(value)        # the whole parameter: this tp rank's part
    if tuple(value.shape) == tuple(spec.shape) or (not spec.shape and value.numel() == 1):
        full = value.detach().reshape(1) if not spec.shape else value.detach()
        return _padded(full[spec.offset:spec.offset + spec.valid], spec, like)
    if tuple(value.shape) == tuple(spec.shard_shape):
        return value.detach().to(dtype=like.dtype, device=like.device)
    raise OptpassError(f"load_state_dict: {name} has shape {tuple(value.shape)}, the parameter's is "
                       f"{tuple(spec.shape)} (this rank's shard: {tuple(spec.shard_shape)}).")


def _padded(rows: torch.Tensor, spec, like: torch.Tensor) -> torch.Tensor:
    """This rank's valid rows, zero-padded to the shard's shape, in ``like``'s dtype and device."""
    out = torch.zeros(spec.shard_shape, dtype=like.dtype, device=like.device)
    out[:spec.valid].copy_(rows.reshape(spec.valid, *spec.shard_shape[1:]))
    return out


# ---------------------------------------------------------------- the module's hooks

def install_module_hooks(module: torch.nn.Module, sharded_names, spec_of, on_loaded) -> None:
    """State-dict hooks on a module that holds shards: ``sharded_names(module)`` lists the names of its
    sharded parameters, ``spec_of(shard)`` gives a shard's spec, ``on_loaded(shard)`` is told of a
    shard a load wrote."""
    if getattr(module, "_optpass_state_dict_hooks", False):
        return
    object.__setattr__(module, "_optpass_state_dict_hooks", True)

    def names():
        return [n for n in sharded_names(module) if module._parameters.get(n) is not None]

    def to_dtensors(mod, state_dict, prefix, local_metadata):
        for n in names():
            value = state_dict.get(prefix + n)
            if isinstance(value, torch.Tensor) and not isinstance(value, (torch.nn.Parameter, DTensor)):
                state_dict[prefix + n] = shard_as_dtensor(value, spec_of(mod._parameters[n]))

    def to_shards(mod, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        loaded = []
        for n in names():
            if prefix + n in state_dict:
                shard = mod._parameters[n]
                state_dict[prefix + n] = as_shard(state_dict[prefix + n], spec_of(shard), prefix + n, shard)
                loaded.append(shard)
        object.__setattr__(mod, "_optpass_loading", loaded)

    def mark_loaded(mod, incompatible_keys):
        for shard in getattr(mod, "_optpass_loading", ()):
            on_loaded(shard)
        object.__setattr__(mod, "_optpass_loading", [])

    module.register_state_dict_pre_hook(lambda *_: None if torch.compiler.is_compiling()
                                        else write_through.write_back_released(write_through.ALL))
    module.register_state_dict_post_hook(to_dtensors)
    module.register_load_state_dict_pre_hook(to_shards)
    module.register_load_state_dict_post_hook(mark_loaded)


# ---------------------------------------------------------------- the optimizer's hooks

def _params_in_order(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def adopt_optimizer(optimizer, spec_of, on_loaded=None) -> None:
    """Register the state-dict hooks on an optimizer that holds shards (once). ``on_loaded(shard)`` is
    told of each shard whose state a load wrote (torch's ``set_state_dict`` steps the optimizer at lr 0
    before loading: a write to the shards that is not an initialization's)."""
    if optimizer in _ADOPTED or not any(spec_of(p) is not None for p in _params_in_order(optimizer)):
        return
    _ADOPTED[optimizer] = True

    def to_dtensors(opt, state_dict):
        params = _params_in_order(opt)
        for index, entries in list(state_dict["state"].items()):
            spec = spec_of(params[index])
            if spec is None:
                continue
            # Optimizer.state_dict() hands out the optimizer's own per-parameter dicts: a new one
            entries = state_dict["state"][index] = dict(entries)
            for key, value in list(entries.items()):
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    continue                         # Adam's step, a non-tensor entry
                if tuple(value.shape) != tuple(spec.shard_shape):
                    raise OptpassError(
                        f"optimizer state_dict: state {key!r} of {spec.name} has shape {tuple(value.shape)}, not "
                        f"its shard's {tuple(spec.shard_shape)}: only elementwise optimizer state of a parameter "
                        "sharded by optpass.fully_shard can be expressed as the parameter's DTensor.")
                # a torchao quantized moment as its values: DCP writes and reshards plain tensors (it
                # pickled the subclass whole, which no other number of ranks could read); the load
                # quantizes them again (as_loaded_moment)
                entries[key] = shard_as_dtensor(value.dequantize() if low_bit_states.is_quantized(value) else value, spec)
        return state_dict

    def to_shards(opt, state_dict):
        saved = [i for group in state_dict["param_groups"] for i in group["params"]]
        param_of = dict(zip(saved, _params_in_order(opt)))
        state = {}
        for index, entries in state_dict["state"].items():
            p = param_of.get(index)
            spec = spec_of(p) if p is not None else None
            if spec is None:
                state[index] = entries
                continue
            # a low-bit optimizer's moments quantized as torchao keeps them for this shard, not fp32
            state[index] = {key: (low_bit_states.as_loaded_moment(
                                      opt, p, key, as_shard(value, spec, f"{spec.name} {key!r}", p.detach()))
                                  if isinstance(value, torch.Tensor) and value.dim() > 0 else value)
                            for key, value in entries.items()}
            if on_loaded is not None:
                on_loaded(p)
        return {**state_dict, "state": state}

    optimizer.register_state_dict_post_hook(to_dtensors)
    optimizer.register_load_state_dict_pre_hook(to_shards)


def adopt_optimizers_at_their_first_step(spec_of, on_loaded=None) -> None:
    """A global optimizer step pre-hook (registered once): an optimizer over shards is adopted at its
    first eager step, and before every eager step the writes into parameters read outside the step
    reach the shards (``write_through``). Under Dynamo it is a no-op (nothing traced into another
    compile)."""
    if _GLOBAL_HOOK:
        return

    def adopt(optimizer, args, kwargs):
        if torch.compiler.is_compiling():
            return
        write_through.write_back_released(write_through.ALL)      # an eager step: what was written first
        adopt_optimizer(optimizer, spec_of, on_loaded)

    _GLOBAL_HOOK.append(register_optimizer_step_pre_hook(adopt))
