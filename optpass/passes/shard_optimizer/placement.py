"""shard_optimizer's placement: where in the step graph each bucket's stages go (as soon as its
gradients are final, after the last read of the old values) and the emitter that inserts there."""

from __future__ import annotations

import contextlib

import torch
import torch.fx

from optpass.passes._graph_utils import last_node_update_must_follow
from optpass.passes.shard_optimizer.plan import ShardPlan
from optpass.step import REGION_KEY, UPDATE

aten = torch.ops.aten
functional = torch.ops._c10d_functional
convert_element_type = torch.ops.prims.convert_element_type.default


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
