"""shard_optimizer's collectives: the plans per backend (reduce-scatter + all-gather, or all-reduce +
broadcasts; ``choose_collectives``), the all-to-all reduction of half-precision buckets in fp32,
and ``collectives_in`` (what a rewritten graph runs)."""

from __future__ import annotations

import torch
import torch.fx

from optpass.errors import OptpassError
from optpass.options import COLLECTIVE_PLANS
from optpass.passes.shard_optimizer.placement import _Emitter

aten = torch.ops.aten
functional = torch.ops._c10d_functional
convert_element_type = torch.ops.prims.convert_element_type.default


@torch.library.custom_op("optpass::empty_after", mutates_args=())
def empty_after(after: torch.Tensor, numel: int) -> torch.Tensor:
    """An uninitialized 1-d tensor of `after`'s dtype, allocated only once `after` exists (an extern kernel
    that reads it, so Inductor cannot allocate it earlier)."""
    return after.new_empty(numel)


@empty_after.register_fake
def _(after, numel):
    return after.new_empty(numel)


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
