"""Pass shard_optimizer: ZeRO-1 inside the compiled step, with functional collectives.

Precondition: a step graph (forward + backward, fact 19's supported shape) whose
gradients are the raw gradients of autograd (legality: no gradient transform
runs before the update, since the gradients are averaged across ranks here);
the bucket layout and this rank's shard optimizer (``optpass/zero1.py``); the
shard optimizer's update harvested from torch.optim (``harvest.py``: one
"parameter" per bucket, this rank's flat chunk), with its state tensors and
each group's lr as extra inputs (``fused_update.ShardedStep`` adds them).

Rewrite, per bucket, with the ``_c10d_functional`` ops Inductor knows (facts 7, 15):

    flat  = cat([view(g, [-1])[segment] ... , zeros(pad)])   # rank-major: chunk r = rank r's piece
    chunk = wait_tensor(reduce_scatter_tensor(flat, "avg", N, group))     # this rank's averaged gradients
    shard = cat([view(p, [-1])[segment] for this rank's segments])        # its current parameter values
    new   = <torch.optim update of (shard, chunk[:owned], state, lr)>     # state: copy_ in place
    full  = wait_tensor(all_gather_into_tensor(cat([new, zeros(pad)]), N, group))
    copy_(p, view(cat(full[pieces of p]), p.shape))        # for each parameter of the bucket

and every bucketed gradient's output slot becomes None (``p.grad`` stays None,
the step's ``opt.step()`` does nothing: fact 4).

Placement: without optimizer_in_backward the buckets run after backward, in
bucket order (ZeroRedundancyOptimizer's semantics, in one graph). With it,
each bucket runs as soon as its gradients are final and every read of its
parameters' old values is done (fact 21): during backward, and each gradient
dies at its bucket's reduce-scatter.

Effect: optimizer state is 1/N per rank; per step, reduce-scatter + all-gather
move exactly DDP's all-reduce volume (even partition; greedy adds padding).

With master_weights (Megatron's distributed optimizer): the chunk of a bf16/fp16
bucket that a rank updates is its fp32 master shard ``m``, an input of the graph
(``zero1.ShardedOptimizer`` keeps it; the shard optimizer's state is fp32 too).
Only the dtypes change, the collectives stay where they are:

    flat  = convert_element_type(cat([...bf16 gradient pieces...]), f32)  # cast BEFORE the reduction
    chunk = wait_tensor(reduce_scatter_tensor(flat, "avg", N, group))      # fp32
    new   = <torch.optim update of (m, chunk[:owned], state, lr)>;  copy_(m, new)
    full  = wait_tensor(all_gather_into_tensor(convert_element_type(new, bf16), N, group))
    copy_(p, view(cat(full[pieces of p]), p.shape))

The reduction runs in fp32 (``_in_reduction_dtype``), as Megatron's
``grad_reduce_in_fp32``: gloo and NCCL reduce bf16/fp16 too, but a half-precision
sum rounds to 8 (bf16) or 11 (fp16) bits at every addition, and an fp16 sum can
overflow where the average would not. Measured on the tests' MLP against the
Megatron-way reference (fp32 average; bench/zero1_master_weights_reduction.py):
reducing in the half dtype put parameters up to 27 ulps and masters up to 5.7e-4
(relative) off after one step from the same state (2-3 ranks, AdamW/SGD,
bf16/fp16), against 0-1 ulp and 8e-7 for fp32.
The price: the reduce-scatter carries 4 bytes per element instead of 2, so a step
moves 6 bytes per parameter (fp32 in, bf16 out): 1.5x DDP's bf16 all-reduce,
0.75x an fp32 one. The all-gather carries the rounded parameters
(``_in_param_dtype``), which is all a rank needs from the others.
fp32 buckets (an fp32 parameter is its own master) are unchanged.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from optpass.errors import OptpassError
from optpass.passes.clip_grad_norm_in_backward import clip_coefficient, squared_norm, sum_all
from optpass.passes.optimizer_in_backward import (copy_slice, last_node_update_must_follow,
                                                  placeholders_by_dynamo_index, take_gradient_outputs)
from optpass.step import REGION_KEY, UPDATE

CONTEXT_KEY = "sharded_update"

aten = torch.ops.aten
functional = torch.ops._c10d_functional
convert_element_type = torch.ops.prims.convert_element_type.default


@dataclasses.dataclass
class ShardPlan:
    sharded: object                            # zero1.ShardedOptimizer
    names: dict[int, str]                      # parameter index (optimizer order) -> name in the step
    harvested: object | None                   # HarvestedUpdate of the shard optimizer (None: owns nothing)
    lr_index: dict[int, int]                   # param group -> Dynamo input index
    state_index: dict[tuple[str, str], int]    # (shard name, state key) -> Dynamo input index
    in_backward: bool
    clip_grad_norm: float | None = None        # global-norm clipping of the averaged gradients
    master_index: dict[str, int] = dataclasses.field(default_factory=dict)  # shard name -> Dynamo input
    #                                            index of its fp32 master (master_weights)

    def digest(self) -> str:
        """What makes this rank's rewritten graph differ from another's (Inductor cache key): also the
        harvested update, since the first step (which creates SGD's momentum buffers) and the later
        ones (which read them) rewrite the same step graph differently."""
        update = self.harvested.digest() if self.harvested is not None else "no-shard"
        return (f"rank{self.sharded.rank}-{self.sharded.layout.digest()}-{self.in_backward}"
                f"-masters={sorted(self.master_index)}-{update}")


def run(step, options) -> str | None:
    plan = step.context.get(CONTEXT_KEY)
    if plan is None:
        return ("not requested (options data_parallel)" if options.data_parallel != "zero1"
                else "this compile keeps gradients (first update runs eagerly)")
    shard_update(step, plan)
    step.notes.append(_summary(plan))
    return None


def _summary(plan: ShardPlan) -> str:
    sharded, layout = plan.sharded, plan.sharded.layout
    return (f"rank {sharded.rank} of {layout.world}: {len(layout.buckets)} bucket(s), "
            f"{layout.partition} partition, {layout.collective_elements()} elements per "
            f"reduce-scatter/all-gather pass, {'during' if plan.in_backward else 'after'} backward")


def shard_update(step, plan: ShardPlan) -> None:
    graph = step.graph
    layout = plan.sharded.layout
    missing = [plan.names.get(i, f"#{i}") for b in layout.buckets for i in b.params
               if plan.names.get(i) not in step.gradient_nodes]
    if missing:
        raise OptpassError(
            f"data_parallel='zero1': parameter(s) {', '.join(missing[:3])} are in the optimizer and "
            "require grad but get no gradient in this step; every rank must update every bucket. "
            "Set requires_grad=False on unused parameters or leave them out of the optimizer.")
    gradients = take_gradient_outputs(step, [plan.names[i] for b in layout.buckets for i in b.params])
    inputs = placeholders_by_dynamo_index(graph)
    position = {n: i for i, n in enumerate(graph.nodes)}
    end = step.output_node.prev
    if plan.clip_grad_norm is not None:
        with graph.inserting_before(end.next):
            emit = _Emitter(step)
            _emit_clipped_update(emit, plan, gradients, inputs)
        for node in emit.nodes:
            node.meta[REGION_KEY] = UPDATE
        step.gradient_nodes.clear()
        return
    for bucket in layout.buckets:
        names = [plan.names[i] for i in bucket.params]
        if plan.in_backward:
            anchor = max((last_node_update_must_follow(position, step.param_nodes[n], gradients[n])
                          for n in names), key=position.__getitem__)
        else:
            anchor = end
        with graph.inserting_before(anchor.next):   # keeps the emitted order
            inserted = _Emitter(step)
            _emit_bucket(inserted, plan, bucket, gradients, inputs)
        for node in inserted.nodes:
            node.meta[REGION_KEY] = UPDATE
        if not plan.in_backward:
            end = inserted.nodes[-1]
    step.gradient_nodes.clear()


class _Emitter:
    """StepGraph.emit that remembers what it inserted, in order."""

    def __init__(self, step):
        self.step, self.nodes = step, []

    def __call__(self, target, *args, **kwargs) -> torch.fx.Node:
        node = self.step.emit(target, *args, **kwargs)
        self.nodes.append(node)
        return node

    def flat(self, value: torch.fx.Node) -> torch.fx.Node:
        if not value.meta["val"].is_contiguous():
            value = self(aten.clone.default, value, memory_format=torch.contiguous_format)
        return self(aten.view.default, value, [-1])

    def piece(self, flat: torch.fx.Node, start: int, stop: int) -> torch.fx.Node:
        """flat[start:stop], or flat itself when that is all of it."""
        whole = (start, stop) == (0, flat.meta["val"].numel())
        return flat if whole else self(aten.slice.Tensor, flat, 0, start, stop)

    def cat(self, pieces: list[torch.fx.Node]) -> torch.fx.Node:
        return pieces[0] if len(pieces) == 1 else self(aten.cat.default, pieces)

    def joined(self, ranges: list[tuple], like: torch.fx.Node) -> torch.fx.Node:
        """cat of flat[start:stop] for (flat, start, stop) in order (flat None: that many zeros like
        `like`); adjacent ranges of one tensor, e.g. a parameter cut at a chunk border, are one slice."""
        merged: list[list] = []
        for flat, start, stop in ranges:
            if merged and flat is not None and merged[-1][0] is flat and merged[-1][2] == start:
                merged[-1][2] = stop
            else:
                merged.append([flat, start, stop])
        return self.cat([self.zeros(like, stop - start) if flat is None else self.piece(flat, start, stop)
                         for flat, start, stop in merged])

    def zeros(self, like: torch.fx.Node, n: int) -> torch.fx.Node:
        val = like.meta["val"]
        return self(aten.full.default, [n], 0.0, dtype=val.dtype, layout=torch.strided,
                    device=val.device, pin_memory=False)


def _emit_bucket(emit: _Emitter, plan: ShardPlan, bucket, gradients: dict, inputs: dict) -> None:
    chunk = _emit_reduce_scatter(emit, plan, bucket, gradients)
    _emit_update_and_gather(emit, plan, bucket, chunk, inputs)


def _emit_clipped_update(emit: _Emitter, plan: ShardPlan, gradients: dict, inputs: dict) -> None:
    """clip_grad_norm_ on the averaged gradients: every bucket's reduce-scatter first, then one
    all_reduce of the chunks' squared norms gives the global norm, then the scaled updates."""
    layout, group_name = plan.sharded.layout, plan.sharded.pg.name
    chunks = [_emit_reduce_scatter(emit, plan, bucket, gradients) for bucket in layout.buckets]
    local = sum_all(emit, [squared_norm(emit, c) for c in chunks])
    total = emit(functional.wait_tensor.default, emit(functional.all_reduce.default, local, "sum", group_name))
    coef = clip_coefficient(emit, emit(aten.sqrt.default, total), plan.clip_grad_norm)
    for bucket, chunk in zip(layout.buckets, chunks):
        _emit_update_and_gather(emit, plan, bucket, emit(aten.mul.Tensor, chunk, coef), inputs)


def _emit_reduce_scatter(emit: _Emitter, plan: ShardPlan, bucket, gradients: dict) -> torch.fx.Node:
    """This rank's chunk of the bucket's gradients, averaged over the ranks."""
    layout = plan.sharded.layout
    flat_grad = {i: emit.flat(gradients[plan.names[i]]) for i in bucket.params}
    ranges = []
    for segments in bucket.segments:                        # rank-major: chunk r is rank r's
        ranges += [(flat_grad[s.param], s.start, s.stop) for s in segments]
        used = sum(s.numel for s in segments)
        if used < bucket.chunk:
            ranges.append((None, 0, bucket.chunk - used))
    flat = _in_reduction_dtype(emit, plan, bucket, emit.joined(ranges, like=flat_grad[bucket.params[0]]))
    scattered = emit(functional.reduce_scatter_tensor.default, flat, "avg", layout.world, plan.sharded.pg.name)
    return emit(functional.wait_tensor.default, scattered)


def _emit_update_and_gather(emit: _Emitter, plan: ShardPlan, bucket, chunk, inputs: dict) -> None:
    """Update this rank's shard from its gradient chunk, all-gather, write every parameter."""
    sharded, layout = plan.sharded, plan.sharded.layout
    world, rank, group_name = layout.world, sharded.rank, sharded.pg.name
    owned = bucket.owned(rank)
    param = emit.step.param_nodes[plan.names[bucket.params[0]]]     # the all-gather's dtype
    if owned:
        name = sharded.shard_name(bucket)
        shard = inputs[plan.master_index[name]] if name in plan.master_index else \
            emit.joined([(emit.flat(emit.step.param_nodes[plan.names[s.param]]), s.start, s.stop)
                         for s in bucket.segments[rank]], like=chunk)
        gradient = emit.piece(chunk, 0, owned)
        new_shard = _in_param_dtype(emit, plan, name, _emit_update(emit, plan, name, shard, gradient, inputs),
                                    param)
        mine = new_shard if owned == bucket.chunk else emit.cat([new_shard, emit.zeros(param, bucket.chunk - owned)])
    else:
        mine = emit.zeros(param, bucket.chunk)
    gathered = emit(functional.wait_tensor.default,
                    emit(functional.all_gather_into_tensor.default, mine, world, group_name))
    for i in bucket.params:
        at = [r * bucket.chunk + s.offset for r, s in bucket.segments_of(i)]
        parts = emit.joined([(gathered, a, a + s.numel) for a, (_, s) in zip(at, bucket.segments_of(i))],
                            like=gathered)
        value = emit(aten.view.default, parts, list(layout.shapes[i]))
        emit(aten.copy_.default, emit.step.param_nodes[plan.names[i]], value)


def _emit_update(emit: _Emitter, plan: ShardPlan, shard_name: str, shard, gradient, inputs) -> torch.fx.Node:
    """torch.optim's update of this rank's shard, copied from the harvested graph; its new value.
    An fp32 master shard is written in place (it persists); a shard cut from the parameters is not
    (the all-gather writes the parameters)."""
    update = plan.harvested.updates[shard_name]
    env = {update.param: shard, update.gradient: gradient}
    env.update({ph: inputs[plan.state_index[(shard_name, key)]] for key, ph in update.states.items()})
    env.update({ph: inputs[plan.lr_index[group]] for ph, group in update.lr.items()})
    emit.nodes += copy_slice(emit.step, update, env, write_param=shard_name in plan.master_index)
    return env[update.writes[update.param]]


# ---------------------------------------------------------------- dtypes (master_weights)

def _in_reduction_dtype(emit: _Emitter, plan: ShardPlan, bucket, flat: torch.fx.Node) -> torch.fx.Node:
    """A bucket updated on fp32 masters is reduced in fp32: each rank's bf16/fp16 gradients are cast
    before the reduce-scatter, as Megatron's grad_reduce_in_fp32 does (the sum of N half-precision
    gradients is then exact or rounded once, never rounded to 8 or 11 bits per addition, and an fp16
    sum cannot overflow where the average would not). The price: the reduce-scatter moves fp32 bytes."""
    if not plan.sharded.has_master(bucket):
        return flat
    return emit(convert_element_type, flat, plan.sharded.master_dtype)


def _in_param_dtype(emit: _Emitter, plan: ShardPlan, shard_name: str, new_shard: torch.fx.Node,
                    param: torch.fx.Node) -> torch.fx.Node:
    """The updated fp32 master rounded (to nearest even) to the parameters' dtype: the all-gather
    carries half-precision parameters, half the bytes of the masters."""
    if shard_name not in plan.master_index:
        return new_shard
    return emit(convert_element_type, new_shard, param.meta["val"].dtype)


def collectives_in(graph: torch.fx.Graph) -> dict[str, list[int]]:
    """Count and size a graph's functional collectives: kind -> [count, bytes per rank].

    Bytes are the buffer each rank hands in (reduce-scatter) or gets out
    (all-gather, all-reduce), the figure to compare with DDP's all-reduce buckets."""
    found = {"reduce_scatter": [0, 0], "all_gather": [0, 0], "all_reduce": [0, 0]}
    for node in graph.nodes:
        name = getattr(node.target, "__name__", "")
        for kind, counts in found.items():
            if name.startswith(kind):
                val = node.args[0].meta["val"] if kind == "reduce_scatter" else node.meta["val"]
                counts[0] += 1
                counts[1] += val.numel() * val.element_size()
    return found
