"""shard_optimizer's rewrite: per bucket, the reduce, this rank's update of its shard and the
parameters' writes, emitted at the points ``placement`` finds (see the package docstring)."""

from __future__ import annotations

import functools

import torch
import torch.fx

from optpass.errors import OptpassError
from optpass.passes._graph_utils import (clip_coefficient, copy_slice, placeholders_by_dynamo_index, squared_norm,
                                         sum_all, take_gradient_outputs, write_grad_norm)
from optpass.passes.shard_optimizer.collectives import PLANS, _chunk_dtype
from optpass.passes.shard_optimizer.placement import (_Emitter, _InsertPoints, _insertion_order, _is_a_sum,
                                                      _stage_points)
from optpass.passes.shard_optimizer.plan import ShardPlan

aten = torch.ops.aten
functional = torch.ops._c10d_functional
convert_element_type = torch.ops.prims.convert_element_type.default


def shard_update(step, plan: ShardPlan) -> None:
    graph = step.graph
    layout = plan.sharded.layout
    missing = [plan.names.get(i, f"#{i}") for i in layout.parameters()
               if plan.names.get(i) not in step.gradient_nodes]
    if missing:
        raise OptpassError(
            f"data_parallel='zero1': parameter(s) {', '.join(missing[:3])} are in the optimizer and "
            "require grad but get no gradient in this step; every rank must update every bucket. "
            "Set requires_grad=False on unused parameters or leave them out of the optimizer.")
    gradients = take_gradient_outputs(step, [plan.names[i] for i in layout.parameters()])
    inputs = placeholders_by_dynamo_index(graph)
    collectives = PLANS[plan.collectives](plan.sharded)
    points = _stage_points(step, plan, gradients)
    insert = _InsertPoints(step)
    started: dict[int, object] = {}
    if plan.clip_grad_norm is not None:
        for bucket in layout.buckets:
            with insert.after(points[bucket.index][0]) as emit:
                started[bucket.index] = collectives.start_reduce(emit, bucket, _flat_gradients(emit, plan, bucket, gradients))
        with insert.after(points[0][1]) as emit:
            _emit_clipped_update(emit, plan, collectives, started, inputs)
        step.gradient_nodes.clear()
        return
    gathering: dict[int, object] = {}
    work = sorted(((points[b.index][stage], stage, b) for b in layout.buckets for stage in range(3)),
                  key=lambda item: _insertion_order(plan, points, insert.position, *item))
    for place, stage, bucket in work:
        with insert.after(place) as emit:
            if stage == 0:
                started[bucket.index] = collectives.start_reduce(
                    emit, bucket, _flat_gradients(emit, plan, bucket, gradients))
            elif stage == 1:
                chunk = collectives.finish_reduce(emit, bucket, started[bucket.index])
                new_shard = _emit_shard_update(emit, plan, bucket, chunk, inputs)
                gathering[bucket.index] = collectives.start_gather(emit, bucket, new_shard)
            else:
                _emit_parameter_writes(emit, plan, bucket, collectives.finish_gather(
                    emit, bucket, gathering[bucket.index]))
    step.gradient_nodes.clear()


@torch.library.custom_op("optpass::materialized", mutates_args=())
def materialized(gradient: torch.Tensor) -> torch.Tensor:
    """A copy of `gradient` that Inductor computes as an extern kernel: nothing fuses into or across it."""
    return gradient.clone()


@materialized.register_fake
def _(gradient):
    return torch.empty_like(gradient)


def _flat_gradients(emit: _Emitter, plan: ShardPlan, bucket, gradients: dict) -> dict[int, torch.fx.Node]:
    """Each gradient of the bucket flat, in its own dtype (bf16/fp16 gradients of a bucket on fp32
    masters are sent as they are and summed in fp32 by their owner: ``_AllToAllReduce``)."""
    def fenced(g):
        if plan.in_backward and len(bucket.params) > 1 and _is_a_sum(g):
            return emit(torch.ops.optpass.materialized.default, g)
        return g
    return {i: emit.flat(fenced(gradients[plan.names[i]])) for i in bucket.params}


def _emit_shard_update(emit: _Emitter, plan: ShardPlan, bucket, chunk, inputs: dict) -> torch.fx.Node | None:
    """torch.optim's update of this rank's shard of the bucket from its averaged gradient chunk;
    the shard's new value (None: this rank owns nothing of the bucket)."""
    sharded = plan.sharded
    if chunk is None:
        return None
    name = sharded.shard_name(bucket)
    if name in plan.master_index:              # the fp32 master shard, an input of the graph
        shard = inputs[plan.master_index[name]]
    else:                                      # cut from the parameters
        shard = emit.joined([(emit.flat(emit.step.param_nodes[plan.names[s.param]]), s.start, s.stop)
                             for s in bucket.segments[sharded.rank]], like=chunk)
    return _in_param_dtype(emit, plan, name, _emit_update(emit, plan, name, shard, chunk, inputs),
                           emit.step.param_nodes[plan.names[bucket.params[0]]])


def _emit_parameter_writes(emit: _Emitter, plan: ShardPlan, bucket, gathered: list[tuple]) -> None:
    """Copy every parameter of the bucket from the gathered chunks: `gathered[r]` is (tensor, offset)
    where rank r's chunk starts. A parameter cut over several chunks is written through a chain of
    slice_scatter, which Inductor fuses into the copy (a cat would first materialize the parameter
    in a buffer of its own)."""
    shapes = plan.sharded.layout.shapes
    for i in bucket.params:
        param = emit.step.param_nodes[plan.names[i]]
        pieces = [(emit.piece(gathered[r][0], gathered[r][1] + s.offset, gathered[r][1] + s.offset + s.numel), s)
                  for r, s in bucket.segments_of(i)]
        if len(pieces) == 1:
            value = pieces[0][0]
        else:
            value = emit.flat(param)
            for piece, segment in pieces:
                value = emit(aten.slice_scatter.default, value, piece, 0, segment.start, segment.stop)
        emit(aten.copy_.default, param, emit(aten.view.default, value, list(shapes[i])))


def _emit_clipped_update(emit: _Emitter, plan: ShardPlan, collectives, started: dict, inputs: dict) -> None:
    """clip_grad_norm_ on the averaged gradients: every bucket's reduce first, then one all_reduce
    of the chunks' squared norms gives the global norm, then the scaled updates and the gathers."""
    layout, group_name = plan.sharded.layout, plan.sharded.pg.name
    chunks = [collectives.finish_reduce(emit, bucket, started[bucket.index]) for bucket in layout.buckets]
    owned = [c for c in chunks if c is not None]
    # every rank all-reduces one dtype, whichever chunks it owns: fp32 at least (the masters' or
    # the chunks' widest, e.g. fp64)
    dtype = functools.reduce(torch.promote_types, [_chunk_dtype(plan.sharded, b) for b in layout.buckets],
                             torch.float32)
    if owned:
        local = sum_all(emit, [squared_norm(emit, c) for c in owned])
        if local.meta["val"].dtype != dtype:
            local = emit(convert_element_type, local, dtype)
    else:                                      # this rank owns nothing: it adds 0 to the norm
        device = plan.sharded.params[0][1].device
        local = emit(aten.full.default, [], 0.0, dtype=dtype, layout=torch.strided, device=device,
                     pin_memory=False)
    total = emit(functional.wait_tensor.default, emit(functional.all_reduce.default, local, "sum", group_name))
    norm = emit(aten.sqrt.default, total)
    coef = clip_coefficient(emit, norm, plan.clip_grad_norm)
    write_grad_norm(emit.step, norm)           # what clip_grad_norm_ returns: optpass.grad_norm(opt)
    gathering = [collectives.start_gather(emit, bucket, _emit_shard_update(
                     emit, plan, bucket, None if chunk is None else emit(aten.mul.Tensor, chunk, coef), inputs))
                 for bucket, chunk in zip(layout.buckets, chunks)]
    for bucket, pending in zip(layout.buckets, gathering):
        _emit_parameter_writes(emit, plan, bucket, collectives.finish_gather(emit, bucket, pending))


def _emit_update(emit: _Emitter, plan: ShardPlan, shard_name: str, shard, gradient, inputs) -> torch.fx.Node:
    """torch.optim's update of this rank's shard, copied from the harvested graph; its new value.
    An fp32 master shard is written in place (it persists); a shard cut from the parameters is not
    (the all-gather writes the parameters)."""
    update = plan.harvested.updates[shard_name]
    env = {update.param: shard, update.gradient: gradient}
    env.update({ph: inputs[plan.state_index[(shard_name, key)]] for key, ph in update.states.items()})
    env.update({ph: inputs[plan.lr_index[group]] for ph, group in update.lr.items()})
    in_place = shard_name in plan.master_index
    inserted = copy_slice(emit.step, update, env, write_param=in_place)
    emit.nodes += inserted
    if in_place:    # what copy_(master, value) wrote: with grad_scaler already where(skip, master, new)
        return next(n.args[1] for n in inserted if n.target is aten.copy_.default and n.args[0] is shard)
    new = env[update.writes[update.param]]
    if emit.step.skip_update is not None:     # grad_scaler: a skipped step gathers the shard as it was
        new = emit(aten.where.self, emit.step.skip_update, shard, new)
    return new


def _in_param_dtype(emit: _Emitter, plan: ShardPlan, shard_name: str, new_shard: torch.fx.Node,
                    param: torch.fx.Node) -> torch.fx.Node:
    """The updated fp32 master rounded (to nearest even) to the parameters' dtype: the all-gather
    carries half-precision parameters, half the bytes of the masters."""
    if shard_name not in plan.master_index:
        return new_shard
    return emit(convert_element_type, new_shard, param.meta["val"].dtype)
