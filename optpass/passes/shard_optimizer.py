"""Pass shard_optimizer: ZeRO-1 inside the compiled step, with functional collectives.

Precondition: a step graph (forward + backward, the supported shape of docs/design.md §4) whose
gradients are the raw gradients of autograd (legality: no gradient transform
runs before the update, since the gradients are averaged across ranks here);
the bucket layout and this rank's shard optimizer (``optpass/zero1/state.py``); the
shard optimizer's update harvested from torch.optim (``optim/harvest.py``: one
"parameter" per bucket, this rank's flat chunk), with its state tensors and
each group's lr as extra inputs (``runtime/sharded_step.py`` adds them).

Rewrite, per bucket, in three stages; a functional collective (``_c10d_functional``,
docs/design.md §24, §25) runs in the background from its call until its ``wait_tensor``:

    started  = <reduce>(cat(view(g, [-1]) ...))        # 1. as soon as the bucket's gradients are final
    chunk    = <wait>(started)                          # 2. this rank's averaged gradients
    new      = <torch.optim update of (shard, chunk, state, lr)>   # shard: its parameters' values
    gathered = <gather>(new)
    full     = <wait>(gathered)                         # 3. after the last read of the old values
    copy_(p, view(slice_scatter(...(flat(p), full[piece of p])...), p.shape))   # each parameter

and every bucketed gradient's output slot becomes None (``p.grad`` stays None,
the step's ``opt.step()`` does nothing: docs/design.md §17).

Collectives (option ``collectives``, a key of ``PLANS``; "auto" asks ``choose_collectives``
with the process group's backend for the parameters' device):

| plan             | reduce (stage 1 -> 2)                                  | gather (2 -> 3)                      | auto for |
|------------------|--------------------------------------------------------|--------------------------------------|----------|
| "reduce_scatter" | ``reduce_scatter_tensor(flat, "avg")``, flat rank-major | ``all_gather_into_tensor(new)``      | NCCL and every backend but gloo |
|                  | with each chunk padded to the bucket's chunk size      | (padded like the chunk)              |          |
| "all_reduce"     | ``all_reduce_(flat, "sum")`` in place, unpadded; this  | ``broadcast_`` of each rank's new    | gloo     |
|                  | rank's chunk is one slice of it, divided by N          | shard from its owner (N calls)       |          |

Why: on gloo (2 and 3 ranks, 1 thread each; ``bench/zero1.py`` times each plan's
collectives alone on its layout) reduce_scatter_tensor + all_gather_into_tensor take
1.4x the time of all_reduce + a broadcast per owner on an idle machine (1.0-1.6x on a
loaded one), although the latter moves 1.5x the bytes: gloo's reduce-scatter and all-gather are
not the halves of its ring all-reduce. DDP + ZeroRedundancyOptimizer does the same
on gloo. NCCL's reduce-scatter and all-gather each run at its all-reduce's bus
bandwidth (nccl-tests), so there the reduce_scatter plan (1x DDP's bytes) beats the
all_reduce plan (1.5x): planned from that cost model, not measured (no GPU here).
Both plans use the same layout and shards, so checkpoints do not depend on the plan.

Placement (stage 1 always during backward; ``_stage_points``; Inductor keeps it, see
``ShardPlan.inductor_config``):

* default: stage 1 right after the bucket's last gradient; stages 2 and 3 after
  backward, all buckets' stage 2 before any stage 3, so one bucket's gather runs
  while the next bucket is updated (the update after backward, like
  ZeroRedundancyOptimizer). The gradients live until stage 2, as they would in ``.grad``.
* optimizer_in_backward: stage 2 of bucket k just before the kernel that first writes
  bucket k+1's buffer: bucket k+1's first gradient computed by a kernel Inductor fuses
  the cast into (a bias's or norm weight's sum), else its last gradient
  (``_before_bucket_allocation``: its reduce runs while backward computes the GEMMs of
  bucket k+1 before that, and its buffer is freed before bucket k+1's is
  allocated), stage 3 where bucket k+1's stage 2 goes, and never before the last
  read of bucket k's old parameter values (docs/design.md §22); the last ones after backward.
  Each gradient dies at its bucket's cat. At one place, what frees buffers goes
  first (``_insertion_order``): the writes of gathers started earlier, then the
  updates, then the next reduce. So at most one bucket's reduce buffer, one layer's
  gradient and one bucket's gather buffers are alive at once (bench/mixed_precision.py).
  In a bucket of several parameters, a gradient that is a sum (a bias's or norm weight's,
  small) goes through ``optpass::materialized`` (a copy Inductor runs as an extern kernel):
  otherwise Inductor may fuse two such sums of two
  buckets into one kernel (a transformer layer's two norm weights, when a bucket border falls
  between them), which allocates both buckets' buffers before the first one's reduce starts.
  So a bucket's buffer is allocated by its cat, after the update before it.
  Buckets whose gradients are all final at one place (the last ones, at the end of
  backward) are each reduced and waited before the next one's buffer is allocated.
* clip_grad_norm (not with optimizer_in_backward): stage 1 as by default; after backward
  every bucket's stage 2 waits first, one all_reduce of the chunks' squared norms
  gives the global norm, then the scaled updates, the gathers and the writes.

Effect: optimizer state is 1/N per rank; the reduce_scatter plan moves exactly DDP's
all-reduce volume (even partition; greedy adds padding), the all_reduce plan that
plus one broadcast of the parameters.

With master_weights (Megatron's distributed optimizer): the chunk of a bf16/fp16
bucket that a rank updates is its fp32 master shard ``m``, an input of the graph
(``zero1.state.ShardedOptimizer`` keeps it; the shard optimizer's state is fp32 too).
The reduce is an all-to-all of the half-precision gradients, summed in fp32 by
the rank that owns them (``_AllToAllReduce``), in either plan; the gather stays:

    flat  = cat([bf16 gradient piece ...])                                 # rank-major, as it is
    mine  = <wait>(all_to_all_single(flat))             # every other rank's copy of my chunk (the
                                                        # first and last rank read theirs from flat)
    chunk = (f32(row_0) + ... + f32(row_N-1)) / N       # the fp32 average, rows in rank order
    new   = <torch.optim update of (m, chunk, state, lr)>;  copy_(m, new)
    full  = <wait>(<gather>(convert_element_type(new, bf16)))
    copy_(p, view(slice_scatter(...(flat(p), full[piece of p])...), p.shape))

The sum is fp32, as Megatron's ``grad_reduce_in_fp32``: gloo and NCCL reduce
bf16/fp16 too, but a half-precision sum rounds to 8 (bf16) or 11 (fp16) bits at
every addition, and an fp16 sum can overflow where the average would not.
Measured on the tests' MLP against the Megatron-way reference (fp32 average;
bench/zero1_master_weights_reduction.py): reducing in the half dtype put
parameters up to 27 ulps and masters up to 5.7e-4 (relative) off after one step
from the same state (2-3 ranks, AdamW/SGD, bf16/fp16), against 0-1 ulp and 8e-7
for fp32. Casting the gradients to fp32 before an fp32 reduce
(all_reduce_ / reduce_scatter_tensor) gives the same sum (bitwise at 2 ranks,
the order of N > 2 fp32 additions aside), for twice the bytes and an fp32 copy
of the bucket beside its bf16 gradients. Sent as they are, a rank holds the bf16
bucket and what it receives (2 + 2 bytes per element, not 2 + 4), a step moves
4 bytes per parameter (bf16 in, bf16 out: DDP's bf16 all-reduce volume), and on
gloo (2 ranks, 1 thread each) the zero1 step of bench/mixed_precision.py went from
0.98x to 0.72x (MLP) and from 1.59x to 1.00x (Llama) the by-hand step's time. The
all-gather carries the rounded parameters (``_in_param_dtype``), which is all a
rank needs from the others; on gloo (the all_reduce plan's broadcasts) the other
ranks' shards are received into buffers allocated after the update
(``optpass::empty_after``). Receiving them into the all-to-all's output instead
(read by the update by then) kept that output, as long as the bucket, alive until the
parameters are written: the Llama's live-tensor peak rose from 8.50 to 8.56 B/param.
With a grad_scaler the gradients are unscaled into fp32 first (``loss_scaling``) and
reduced in fp32 as fp32 buckets are.
fp32 buckets (an fp32 parameter is its own master) are unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.fx

from optpass.errors import OptpassError
from optpass.options import COLLECTIVE_PLANS
from optpass.passes._graph_utils import (clip_coefficient, copy_slice, last_node_update_must_follow,
                                         placeholders_by_dynamo_index, squared_norm, sum_all, take_gradient_outputs)
from optpass.step import REGION_KEY, UPDATE

CONTEXT_KEY = "sharded_update"

aten = torch.ops.aten
functional = torch.ops._c10d_functional
convert_element_type = torch.ops.prims.convert_element_type.default


@dataclasses.dataclass
class ShardPlan:
    sharded: object                            # zero1.state.ShardedOptimizer
    names: dict[int, str]                      # parameter index (optimizer order) -> name in the step
    harvested: object | None                   # HarvestedUpdate of the shard optimizer (None: owns nothing)
    lr_index: dict[int, int]                   # param group -> Dynamo input index
    state_index: dict[tuple[str, str], int]    # (shard name, state key) -> Dynamo input index
    in_backward: bool
    clip_grad_norm: float | None = None        # global-norm clipping of the averaged gradients
    collectives: str = "reduce_scatter"        # a key of PLANS (choose_collectives resolved "auto")
    master_index: dict[str, int] = dataclasses.field(default_factory=dict)  # shard name -> Dynamo input
    #                                            index of its fp32 master (master_weights)

    def digest(self) -> str:
        """What makes this rank's rewritten graph differ from another's (Inductor cache key): also the
        harvested update, since the first step (which creates SGD's momentum buffers) and the later
        ones (which read them) rewrite the same step graph differently."""
        update = self.harvested.digest() if self.harvested is not None else "no-shard"
        return (f"rank{self.sharded.rank}-{self.sharded.layout.digest()}-{self.in_backward}"
                f"-{self.collectives}-masters={sorted(self.master_index)}-{update}")

    @property
    def inductor_config(self) -> dict:
        """Inductor keeps the order this pass emits (seen in its generated code, torch 2.13, CPU):

        * ``reorder_for_locality`` (on for graphs without a backward graph of their own, like
          the step graph) runs before the post-grad passes and moves each gradient computation
          next to its user, the gradient output at the graph's end: every bucket's gradients
          would be final only after all of backward, and no collective could start during it;
        * ``reorder_for_peak_memory`` moves each bucket's wait and update right after its
          reduce starts (that frees the bucket soonest), so the step waits for every collective
          as soon as it starts."""
        return {"reorder_for_locality": False, "reorder_for_peak_memory": False}


# explain's dry compile of a step zero1 shards: no plan (the layout needs every rank), said so
EXPLAIN_KEY = "shard_optimizer.explained"


def run(step, options) -> str | None:
    plan = step.context.get(CONTEXT_KEY)
    if plan is None and step.context.get(EXPLAIN_KEY):
        return ("applies at the first training call, not in explain: there every rank agrees on the model, "
                "and per gradient bucket a reduce starts during backward, this rank updates its 1/N shard "
                "and a gather brings the parameters back (explain runs no collective)")
    if plan is None:
        return ("not requested (options data_parallel)" if options.data_parallel != "zero1"
                else "this compile keeps gradients (a micro-step without opt.step(): they add up in .grad)")
    shard_update(step, plan)
    step.notes.append(_summary(plan))
    return None


def _summary(plan: ShardPlan) -> str:
    sharded, layout = plan.sharded, plan.sharded.layout
    return (f"rank {sharded.rank} of {layout.world}: {len(layout.buckets)} bucket(s), "
            f"{layout.partition} partition, {PLANS[plan.collectives].describe(layout)}, reduce started "
            f"during backward, update {'during' if plan.in_backward else 'after'} backward")


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


def _insertion_order(plan: ShardPlan, points: dict, position: dict, place, stage: int, bucket) -> tuple:
    """Where a bucket's stage goes among what is inserted at the same place.

    After backward: (place, stage, bucket): every bucket's reduce starts before any bucket is
    updated, and every update (so every gather) starts before any gather is waited on.

    optimizer_in_backward (memory first, the gradients being what it saves): at a place in
    backward, first what frees buffers of buckets started earlier -- the writes of gathers
    started at an earlier place (their receive buffers), then the updates of reduces started
    at an earlier place (their fp32/bucket buffers) -- and only then a reduce that allocates
    the next bucket's buffer. With the update placed before the kernel that allocates that buffer
    (``_before_bucket_allocation``) one reduce buffer is alive at a time (tests/
    test_zero1_master_weights.py reads it in Inductor's schedule). Buckets whose reduce and update
    both go here (the last buckets, at the end of backward) go one after the other, each reduce
    waited before the next one allocates its buffer: one buffer at a time."""
    at = position[place]
    if not plan.in_backward:
        return (at, stage, bucket.index)
    started_earlier = stage > 0 and position[points[bucket.index][stage - 1]] < at
    group = {(2, True): 0, (1, True): 1, (0, False): 2, (1, False): 2, (2, False): 3}[(stage, started_earlier)]
    return (at, group, bucket.index, stage)


def _stage_points(step, plan: ShardPlan, gradients: dict) -> dict[int, tuple]:
    """Per bucket, the nodes after which its stages 1, 2 and 3 go (see the module docstring)."""
    position = {n: i for i, n in enumerate(step.graph.nodes)}
    end = step.output_node.prev
    latest = lambda nodes: max(nodes, key=position.__getitem__)    # noqa: E731
    ready_of = {b.index: latest([gradients[plan.names[i]] for i in b.params]) for b in plan.sharded.layout.buckets}
    # in the order their gradients are final in this graph (the layout's order is found before
    # the graph exists: zero1.layout.gradient_order cannot tell a weight's gradient from its bias's)
    buckets = sorted(plan.sharded.layout.buckets, key=lambda b: (position[ready_of[b.index]], b.index))
    ready = [ready_of[b.index] for b in buckets]
    # optimizer_in_backward: what bucket k waits for goes just before the kernel that first writes
    # bucket k+1's buffer (``_before_bucket_allocation``), after the end of backward for the last buckets
    before = [_before_bucket_allocation(position, [gradients[plan.names[i]] for i in buckets[k + 1].params], ready[k])
              if plan.in_backward and k + 1 < len(buckets) else end for k in range(len(buckets))]
    points = {}
    for k, bucket in enumerate(buckets):
        if not plan.in_backward:
            points[bucket.index] = (ready[k], end, end)
            continue
        update = latest([ready[k], before[k]])
        last_read = latest([last_node_update_must_follow(position, step.param_nodes[plan.names[i]],
                                                         gradients[plan.names[i]]) for i in bucket.params])
        write = latest([update, last_read, before[k + 1] if k + 1 < len(buckets) else end])
        points[bucket.index] = (ready[k], update, write)
    return points


# Gradients computed by these ops come out of an extern kernel (a GEMM): Inductor cannot fuse the
# fp32 cast into it, so the cast into the bucket's buffer runs where it is emitted, after the last
# gradient. Any other producer (a bias's or a norm weight's sum) takes the cast into its own kernel
# and so writes the bucket's buffer, and allocates it, as soon as that gradient exists.
_EXTERN_PRODUCERS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
_VIEWS = {aten.view.default, aten.t.default, aten.permute.default, aten.transpose.int,
          aten._unsafe_view.default, aten.reshape.default}


def _producer(gradient: torch.fx.Node, skipped=_VIEWS) -> torch.fx.Node:
    """The node that computes `gradient`, back through the ops in `skipped` (views) after it."""
    while gradient.op == "call_function" and gradient.target in skipped:
        gradient = gradient.args[0]
    return gradient


def _allocates_bucket(gradient: torch.fx.Node) -> bool:
    """Whether Inductor may write this gradient's cast into the bucket's buffer where it computes it."""
    producer = _producer(gradient)
    return not (producer.op == "call_function" and producer.target in _EXTERN_PRODUCERS)


def _is_a_sum(gradient: torch.fx.Node) -> bool:
    """Whether the gradient is a sum (a bias's or a norm weight's): Inductor may fuse two such sums
    of two buckets into one kernel, and with them the fp32 casts into both buckets' buffers."""
    producer = _producer(gradient, _VIEWS | {convert_element_type})
    return producer.op == "call_function" and producer.target in (aten.sum.dim_IntList, aten.sum.default)


def _before_bucket_allocation(position: dict, bucket_gradients: list, floor: torch.fx.Node) -> torch.fx.Node:
    """The node after which the update of the bucket before goes: just before the computation of
    this bucket's first gradient whose kernel may write the bucket's fp32 buffer (``_allocates_bucket``),
    or its last gradient if none does. So the previous reduce buffer is freed before this one is
    allocated, and the previous reduce overlaps the GEMMs before."""
    ordered = sorted(bucket_gradients, key=position.__getitem__)
    first = next((i for i, g in enumerate(ordered) if _allocates_bucket(g)), len(ordered) - 1)
    return _before_last_gradient(position, ordered[:first + 1], floor)


def _before_last_gradient(position: dict, bucket_gradients: list, floor: torch.fx.Node) -> torch.fx.Node:
    """The node after which the update of the bucket before goes: just before the computation of
    this bucket's last gradient that nothing before needs (its ancestors after this bucket's other
    gradients and after `floor`, the previous bucket's last gradient). Updating there frees the
    previous bucket's reduce buffer before Inductor allocates this bucket's (it fuses the cast into
    the kernel that computes the last gradient, e.g. a bias's sum), while the previous reduce still
    overlaps everything before: the other gradients' GEMMs."""
    last = max(bucket_gradients, key=position.__getitem__)
    bound = max(position[n] for n in [floor] + [g for g in bucket_gradients if g is not last])
    first, stack, seen = last, [last], {last}
    while stack:
        for node in stack.pop().all_input_nodes:
            if node not in seen and position[node] > bound:
                seen.add(node)
                stack.append(node)
                first = min(first, node, key=position.__getitem__)
    return first.prev


class _InsertPoints:
    """Inserts after graph nodes; what goes after one node stays in the order it was inserted."""

    def __init__(self, step):
        self.step = step
        self.position = {n: i for i, n in enumerate(step.graph.nodes)}
        self.last: dict[torch.fx.Node, torch.fx.Node] = {}

    @contextlib.contextmanager
    def after(self, place: torch.fx.Node):
        emit = _Emitter(self.step)
        with self.step.graph.inserting_before(self.last.get(place, place).next):
            yield emit
        for node in emit.nodes:
            node.meta[REGION_KEY] = UPDATE
        if emit.nodes:
            self.last[place] = emit.nodes[-1]


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


@torch.library.custom_op("optpass::materialized", mutates_args=())
def materialized(gradient: torch.Tensor) -> torch.Tensor:
    """A copy of `gradient` that Inductor computes as an extern kernel: nothing fuses into or across it."""
    return gradient.clone()


@materialized.register_fake
def _(gradient):
    return torch.empty_like(gradient)


@torch.library.custom_op("optpass::empty_after", mutates_args=())
def empty_after(after: torch.Tensor, numel: int) -> torch.Tensor:
    """An uninitialized 1-d tensor of `after`'s dtype, allocated only once `after` exists (an extern kernel
    that reads it, so Inductor cannot allocate it earlier)."""
    return after.new_empty(numel)


@empty_after.register_fake
def _(after, numel):
    return after.new_empty(numel)


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
    coef = clip_coefficient(emit, emit(aten.sqrt.default, total), plan.clip_grad_norm)
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


# ---------------------------------------------------------------- collective plans

def choose_collectives(requested: str, backend: str) -> str:
    """The collective plan (a key of PLANS) for a process group backend ("gloo", "nccl", ...):
    `requested` unless it is "auto"; "auto" is "all_reduce" on gloo, "reduce_scatter" elsewhere."""
    if requested != "auto":
        if requested not in PLANS:
            raise OptpassError(f"zero1 collectives must be 'auto' or one of {sorted(PLANS)}, got {requested!r}")
        return requested
    return "all_reduce" if backend == "gloo" else "reduce_scatter"


class ReduceScatterPlan:
    """Per bucket one reduce_scatter_tensor("avg") and one all_gather_into_tensor, each chunk padded
    to the bucket's chunk size: together DDP's all-reduce volume (NCCL)."""

    def __init__(self, sharded):
        self.sharded, self.world, self.rank, self.group = sharded, sharded.pg.world, sharded.rank, sharded.pg.name
        self._reduced: dict[int, torch.fx.Node] = {}          # bucket -> this rank's waited chunk

    @staticmethod
    def describe(layout) -> str:
        return (f"reduce_scatter + all_gather of {layout.collective_elements()} elements per step "
                "(each chunk padded to the bucket's chunk size)")

    def start_reduce(self, emit: _Emitter, bucket, flat_grad: dict) -> torch.fx.Node:
        ranges = []
        for segments in bucket.segments:                    # rank-major: chunk r is rank r's
            ranges += [(flat_grad[s.param], s.start, s.stop) for s in segments]
            used = sum(s.numel for s in segments)
            if used < bucket.chunk:
                ranges.append((None, 0, bucket.chunk - used))
        flat = emit.joined(ranges, like=flat_grad[bucket.params[0]])
        if _summed_by_owner(self.sharded, bucket, flat):
            return _AllToAllReduce.start(emit, self.sharded, flat, [bucket.chunk] * self.world)
        return emit(functional.reduce_scatter_tensor.default, flat, "avg", self.world, self.group)

    def finish_reduce(self, emit: _Emitter, bucket, started: torch.fx.Node) -> torch.fx.Node | None:
        """This rank's averaged gradients (its owned elements; None: it owns none)."""
        chunk = self._reduced[bucket.index] = _AllToAllReduce.finish(emit, self.sharded, started, bucket.chunk) \
            if _AllToAllReduce.started(started) else emit(functional.wait_tensor.default, started)
        owned = bucket.owned(self.rank)
        return emit.piece(chunk, 0, owned) if owned else None

    def start_gather(self, emit: _Emitter, bucket, new_shard: torch.fx.Node | None) -> torch.fx.Node:
        owned = bucket.owned(self.rank)
        if new_shard is None:       # a chunk of padding only, reduced to zeros: send it back as is
            mine = _in_gather_dtype(emit, self.sharded, bucket, self._reduced[bucket.index])
        elif owned < bucket.chunk:
            mine = emit.cat([new_shard, emit.zeros(new_shard, bucket.chunk - owned)])
        else:
            mine = new_shard
        return emit(functional.all_gather_into_tensor.default, mine, self.world, self.group)

    def finish_gather(self, emit: _Emitter, bucket, started: torch.fx.Node) -> list[tuple]:
        """(tensor, offset) where each rank's chunk starts."""
        gathered = emit(functional.wait_tensor.default, started)
        return [(gathered, r * bucket.chunk) for r in range(self.world)]


class AllReducePlan:
    """Per bucket one all_reduce ("sum", in place, no padding) of which this rank keeps its slice,
    and one broadcast of each rank's updated shard from its owner (gloo)."""

    def __init__(self, sharded):
        self.sharded, self.world, self.rank, self.group = sharded, sharded.pg.world, sharded.rank, sharded.pg.name
        self._reduced: dict[int, torch.fx.Node] = {}          # bucket -> the waited all-reduce

    @staticmethod
    def describe(layout) -> str:
        elements = sum(s.numel for b in layout.buckets for segs in b.segments for s in segs)
        return (f"all_reduce of {elements} elements + broadcast of each rank's shard "
                f"({sum(1 for b in layout.buckets for segs in b.segments if segs)} broadcasts) per step")

    @staticmethod
    def _starts(bucket) -> list[int]:
        """Where each rank's elements start in the unpadded rank-major bucket."""
        starts, at = [], 0
        for rank in range(len(bucket.segments)):
            starts.append(at)
            at += bucket.owned(rank)
        return starts

    def start_reduce(self, emit: _Emitter, bucket, flat_grad: dict) -> torch.fx.Node:
        flat = emit.joined([(flat_grad[s.param], s.start, s.stop) for segments in bucket.segments
                            for s in segments], like=flat_grad[bucket.params[0]])
        if _summed_by_owner(self.sharded, bucket, flat):
            return _AllToAllReduce.start(emit, self.sharded, flat, [bucket.owned(r) for r in range(self.world)])
        return emit(functional.all_reduce_.default, _own(emit, flat), "sum", self.group)

    def finish_reduce(self, emit: _Emitter, bucket, started: torch.fx.Node) -> torch.fx.Node | None:
        owned, start = bucket.owned(self.rank), self._starts(bucket)[self.rank]
        if _AllToAllReduce.started(started):     # this rank's elements, averaged already
            reduced = self._reduced[bucket.index] = _AllToAllReduce.finish(emit, self.sharded, started, owned)
            return reduced if owned else None
        reduced = self._reduced[bucket.index] = emit(functional.wait_tensor.default, started)
        if not owned:
            return None
        return emit(aten.div.Tensor, emit.piece(reduced, start, start + owned), self.world)

    def start_gather(self, emit: _Emitter, bucket, new_shard: torch.fx.Node | None) -> list:
        starts, started, reduced = self._starts(bucket), [], self._reduced[bucket.index]
        for rank in range(self.world):
            owned = bucket.owned(rank)
            if not owned:
                continue
            if rank == self.rank:
                buffer = _own(emit, new_shard)
            elif new_shard is None and not started and not self.sharded.has_master(bucket):
                # this rank owns nothing here, so nothing else reads the all-reduce's result: receive
                # into a slice of it (an out-of-place broadcast), which waits for it before reuse
                # (not when the all-reduce ran in fp32 for masters: the broadcasts carry bf16/fp16)
                piece = emit.piece(reduced, starts[rank], starts[rank] + owned)
                started.append((rank, emit(functional.broadcast.default, piece, rank, self.group)))
                continue
            elif new_shard is not None:
                # allocated after this rank's update (an extern kernel that reads its result), when the
                # reduced chunk the update read is dead: Inductor allocates an `empty` before the update
                buffer = emit(torch.ops.optpass.empty_after.default, new_shard, owned)
            else:
                val = reduced.meta["val"]
                buffer = emit(aten.empty.memory_format, [owned], dtype=_param_dtype(self.sharded, bucket),
                              device=val.device, pin_memory=False)
            started.append((rank, emit(functional.broadcast_.default, buffer, rank, self.group)))
        return started

    def finish_gather(self, emit: _Emitter, bucket, started: list) -> list[tuple]:
        gathered: list = [None] * self.world
        for rank, node in started:
            gathered[rank] = (emit(functional.wait_tensor.default, node), 0)
        return gathered


# A plan: describe(layout), start_reduce / finish_reduce ("reduce this bucket, give me my
# chunk"), start_gather / finish_gather ("gather these chunks"). bench/zero1.py adds one without
# communication, to time the step without it.
# by name (option 'collectives'); options validates the option against this dict
PLANS = COLLECTIVE_PLANS
PLANS.update({"reduce_scatter": ReduceScatterPlan, "all_reduce": AllReducePlan})


def _own(emit: _Emitter, value: torch.fx.Node) -> torch.fx.Node:
    """`value`, or a copy of it if it aliases another tensor (a view, an in-place op's result, an
    input): an in-place collective must write only into a tensor of its own (a bucket of one
    parameter is a view of its gradient)."""
    target = value.target
    aliases = not isinstance(target, torch._ops.OpOverload) or any(
        r.alias_info is not None for r in target._schema.returns)
    return emit(aten.clone.default, value) if value.op != "call_function" or aliases else value


# ---------------------------------------------------------------- dtypes (master_weights)

def _param_dtype(sharded, bucket) -> torch.dtype:
    """The dtype of the bucket's parameters (one per bucket), which the gather carries."""
    return sharded.params[bucket.params[0]][1].dtype


def _chunk_dtype(sharded, bucket) -> torch.dtype:
    """The dtype of the bucket's reduced gradient chunk: fp32 for a bucket on fp32 masters."""
    return sharded.master_dtype if sharded.has_master(bucket) else _param_dtype(sharded, bucket)


def _summed_by_owner(sharded, bucket, flat: torch.fx.Node) -> bool:
    """A bucket updated on fp32 masters whose gradients are bf16/fp16 (not unscaled into fp32 by a
    grad_scaler) is reduced by ``_AllToAllReduce``: its sum is fp32, as Megatron's
    grad_reduce_in_fp32 reduces (the sum of N half-precision gradients is rounded once, never to 8 or
    11 bits per addition, and an fp16 sum cannot overflow where the average would not)."""
    return sharded.has_master(bucket) and flat.meta["val"].dtype != sharded.master_dtype


class _AllToAllReduce:
    """The reduction of a half-precision bucket on fp32 masters, without an fp32 copy of the bucket:

        received = all_to_all_single(flat, [n_me] * N, [n_0, ..., n_N-1])   # rank r sends my elements of
        mine     = (f32(row_0) + ... + f32(row_N-1)) / N                      # its bucket; summed in fp32

    Each rank gets every rank's bf16/fp16 gradients of the elements it owns and sums them in fp32, in
    rank order: the fp32 sum of an fp32 all-reduce of the cast gradients (bitwise at 2 ranks), for
    2 bytes per element sent instead of 4, and no fp32 buffer of the whole bucket.

    A rank whose elements are at an end of the bucket (the first and the last rank: every rank at
    N = 2) does not send them to itself: it sends the rest of the bucket (a view) and receives only
    the other ranks' rows, reading its own row from its bucket. At the reduction it holds the bucket
    and (N-1)/N of it received (2 + 2(N-1)/N bytes per element, 3 at N = 2; 4 when it sends itself
    its row, and 6 for the cast bucket of an fp32 reduction). Inductor fuses the sum into the
    update's kernel."""

    @staticmethod
    def start(emit: _Emitter, sharded, flat: torch.fx.Node, sent: list[int]) -> torch.fx.Node:
        world, rank = sharded.pg.world, sharded.rank
        mine, total = sent[rank], sum(sent)
        if world == 1 or not mine or rank not in (0, world - 1):
            return emit(functional.all_to_all_single.default, flat, [mine] * world, sent, sharded.pg.name)
        rest = emit.piece(flat, mine, total) if rank == 0 else emit.piece(flat, 0, total - mine)
        started = emit(functional.all_to_all_single.default, rest,
                       [0 if r == rank else mine for r in range(world)],
                       [0 if r == rank else n for r, n in enumerate(sent)], sharded.pg.name)
        started.meta[_KEPT_ROW] = emit.piece(flat, 0, mine) if rank == 0 else emit.piece(flat, total - mine, total)
        return started

    @staticmethod
    def started(node: torch.fx.Node) -> bool:
        return node.target is functional.all_to_all_single.default

    @staticmethod
    def finish(emit: _Emitter, sharded, started: torch.fx.Node, mine: int) -> torch.fx.Node:
        world, rank = sharded.pg.world, sharded.rank
        kept = started.meta.get(_KEPT_ROW)
        received = emit(functional.wait_tensor.default, started)
        others = world - 1 if kept is not None else world
        rows = [emit.piece(received, i * mine, (i + 1) * mine) for i in range(others)]
        if kept is not None:
            rows.insert(rank, kept)
        total = None
        for row in rows:                                       # in rank order
            row = emit(convert_element_type, row, sharded.master_dtype)
            total = row if total is None else emit(aten.add.Tensor, total, row)
        return emit(aten.div.Tensor, total, world)


_KEPT_ROW = "optpass_all_to_all_kept_row"   # started.meta: this rank's own row, not sent to itself


def _in_gather_dtype(emit: _Emitter, sharded, bucket, value: torch.fx.Node) -> torch.fx.Node:
    """`value` (a reduced chunk, fp32 for masters) in the dtype the bucket's gather carries."""
    dtype = _param_dtype(sharded, bucket)
    return value if value.meta["val"].dtype == dtype else emit(convert_element_type, value, dtype)


def _in_param_dtype(emit: _Emitter, plan: ShardPlan, shard_name: str, new_shard: torch.fx.Node,
                    param: torch.fx.Node) -> torch.fx.Node:
    """The updated fp32 master rounded (to nearest even) to the parameters' dtype: the all-gather
    carries half-precision parameters, half the bytes of the masters."""
    if shard_name not in plan.master_index:
        return new_shard
    return emit(convert_element_type, new_shard, param.meta["val"].dtype)


def collectives_in(graph: torch.fx.Graph) -> dict[str, list[int]]:
    """Count and size a graph's functional collectives: kind -> [count, bytes per rank].

    Bytes are the buffer each rank hands in (reduce-scatter, all-to-all) or gets out
    (all-gather, all-reduce, broadcast), the figure to compare with DDP's all-reduce buckets."""
    found = {"reduce_scatter": [0, 0], "all_gather": [0, 0], "all_reduce": [0, 0], "broadcast": [0, 0],
             "all_to_all": [0, 0]}
    for node in graph.nodes:
        name = getattr(node.target, "__name__", "")
        for kind, counts in found.items():
            if name.startswith(kind):
                val = node.args[0].meta["val"] if kind in ("reduce_scatter", "all_to_all") else node.meta["val"]
                counts[0] += 1
                counts[1] += val.numel() * val.element_size()
    return found
