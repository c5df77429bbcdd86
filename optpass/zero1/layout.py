"""ZeRO-1's layout: buckets and partitions of the optimizer's trainable parameters.

The optimizer's trainable parameters in buckets, in the order
backward makes their gradients final (``gradient_order``: the reverse of their
first use in the step's forward, the order DDP finds by recording its first
backward; reverse parameter order, DDP's first guess, when the state is made
before the step is compiled, by ``load_sharded_checkpoint``); a
bucket never spans two param groups or dtypes, and holds up to
``bucket_bytes`` of gradients counted in the dtype they are summed in -- fp32 for
bf16/fp16 parameters with master weights (sent in bf16/fp16, summed in fp32); None: DDP's 25 MiB, at most a quarter of the model, at least
1 MiB, see ``MIN_BUCKETS``; a larger parameter is a bucket of its own size, as in
DDP). Each bucket is split over the N ranks by one of two partitions:

- ``"even"`` (default, DeepSpeed's): the bucket's flat concatenation, padded to
  a multiple of N, in N equal chunks; a parameter may be split across ranks.
  reduce_scatter + all_gather bytes equal DDP's all-reduce; needs an elementwise optimizer
  (every torch.optim optimizer but Adafactor/Muon/LBFGS/SparseAdam; ``optim/elementwise.py``
  checks the update's graph and refuses the others, for either partition: each rank's
  chunk is one flat tensor).
- ``"greedy"`` (ZeroRedundancyOptimizer's sorted-greedy): whole parameters,
  largest first, each to the rank with the least state so far; a rank's chunk
  is padded to the bucket's largest, so reduce_scatter + all_gather may carry
  padding (the all_reduce plan sends none).

With an optimizer whose state is quantized in blocks (torchao's ``AdamW8bit``, ``AdamW4bit``,
``AdamWFp8``: a scale per block of 256 or 128 consecutive elements of a parameter), ``block_of``
gives each parameter its block size, or None where one process keeps its moments unquantized
(torchao's rule: fewer than 4096 elements, or a size the block size does not divide). A bucket
then holds parameters of one block size only, and under ``"even"`` its chunk is a whole number of
blocks: every parameter of a quantized bucket is a whole number of blocks too, so each block of a
rank's chunk is one block of one parameter, the block one process quantizes alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Callable

import torch

from optpass.errors import OptpassError
from optpass.precision.masters import LOW_PRECISION

PARTITIONS = ("even", "greedy")
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024   # DDP's default bucket_cap_mb
# bucket_bytes=None: at least MIN_BUCKETS buckets, none below DDP's first bucket (1 MiB). A bucket's
# reduce starts when its last gradient is final, so the last bucket's reduce and every update follow
# backward: with K buckets about 1/K of the reduction is left after backward; every bucket costs a
# few more collective calls (~0.6 ms each on gloo, 2 ranks: bench/zero1.py --quick). Measured
# (bench/zero1.py --bucket-bytes, 8.4M parameters, gloo, 3 ranks): 2 buckets 1.12x DDP's step time,
# 4 buckets 0.87x, 8 buckets 0.94x.
MIN_BUCKETS = 4
MIN_BUCKET_BYTES = 1024 * 1024



@dataclasses.dataclass(frozen=True)
class Segment:
    """Elements [start, stop) of flattened parameter `param`, at `offset` in its rank's chunk."""

    param: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass
class Bucket:
    index: int
    group: int
    params: list[int]                    # parameter indices, in bucket order
    chunk: int                           # elements per rank in the collectives
    segments: list[list[Segment]]        # per rank, in chunk order

    def owned(self, rank: int) -> int:
        """Elements of real parameters in `rank`'s chunk (the rest is padding)."""
        return sum(s.numel for s in self.segments[rank])

    def segments_of(self, param: int) -> list[tuple[int, Segment]]:
        """(rank, segment) pieces of one parameter, in flat-parameter order."""
        found = [(r, s) for r, segs in enumerate(self.segments) for s in segs if s.param == param]
        return sorted(found, key=lambda rs: rs[1].start)


@dataclasses.dataclass
class Layout:
    world: int
    partition: str
    buckets: list[Bucket]
    shapes: list[torch.Size]             # per parameter index (optimizer order)

    def bucket_of(self, param: int) -> Bucket:
        return next(b for b in self.buckets if param in b.params)

    def parameters(self) -> list[int]:
        """Every bucketed parameter (each is in one bucket), in bucket order."""
        return [i for b in self.buckets for i in b.params]

    def collective_elements(self) -> int:
        """Elements sent through reduce-scatter (= through all-gather) per step, all buckets."""
        return sum(self.world * b.chunk for b in self.buckets)

    def digest(self) -> str:
        text = repr((self.world, self.partition, [(b.group, b.chunk, b.segments) for b in self.buckets]))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def trainable_params(optimizer: torch.optim.Optimizer) -> list[tuple[int, torch.Tensor]]:
    """(group, parameter) for every parameter ZeRO-1 updates, in optimizer order."""
    return [(g, p) for g, group in enumerate(optimizer.param_groups) for p in group["params"]
            if p.requires_grad]


def on_masters(dtype: torch.dtype, master_dtype: torch.dtype | None) -> bool:
    """Parameters of ``dtype`` are updated on masters of ``master_dtype`` (and summed in it)."""
    return master_dtype is not None and dtype in LOW_PRECISION


def reduced_bytes(p: torch.Tensor, master_dtype: torch.dtype | None) -> int:
    """Bytes of ``p``'s gradient in the dtype it is summed in: with master weights a bf16/fp16
    gradient is sent as it is and summed in the master dtype (fp32) by its owner, so a bucket of
    ``bucket_bytes`` holds the same elements as if it were cast to fp32 before the reduction (the
    layouts of checkpoints do not depend on how the gradients travel)."""
    return p.numel() * (master_dtype.itemsize if on_masters(p.dtype, master_dtype) else p.element_size())


def resolve_bucket_bytes(params: list[tuple[int, torch.Tensor]], bucket_bytes: int | None,
                         master_dtype: torch.dtype | None = None) -> int:
    """`bucket_bytes`, or for None: DDP's 25 MiB, or less so that there are MIN_BUCKETS buckets
    of at least MIN_BUCKET_BYTES (bytes of the reduced buffers, see ``reduced_bytes``)."""
    if bucket_bytes is not None:
        return bucket_bytes
    total = sum(reduced_bytes(p, master_dtype) for _, p in params)
    return min(DEFAULT_BUCKET_BYTES, max(MIN_BUCKET_BYTES, math.ceil(total / MIN_BUCKETS)))


def build_layout(params: list[tuple[int, torch.Tensor]], world: int, partition: str,
                 bucket_bytes: int | None, master_dtype: torch.dtype | None = None,
                 order: list[int] | None = None,
                 block_of: Callable[[torch.Tensor], int | None] | None = None) -> Layout:
    """Buckets filled in `order` (parameter indices in the order backward makes their gradients
    final, ``gradient_order``; None: reverse parameter order, DDP's first guess). `block_of`: a
    parameter's quantization block size (None: unquantized state), see the module docstring."""
    if partition not in PARTITIONS:
        raise OptpassError(f"zero1 partition must be one of {PARTITIONS}, got {partition!r}")
    bucket_bytes = resolve_bucket_bytes(params, bucket_bytes, master_dtype)
    buckets: list[Bucket] = []
    block = block_of or (lambda p: None)
    # Buckets being filled, by block size: parameters quantized alike share a bucket, and a bias
    # between two quantized weights (unquantized: too small) goes to its own kind's open bucket
    # instead of ending the weights' bucket. A new param group or dtype closes every open bucket.
    open_buckets: dict[int | None, list[int]] = {}
    sizes: dict[int | None, int] = {}

    def close(kind) -> None:
        members = open_buckets.pop(kind, None)
        sizes.pop(kind, None)
        if members:
            buckets.append(_partition(len(buckets), params[members[0]][0], members, params,
                                      world, partition, loads, kind))

    loads = [0] * world                  # greedy: elements assigned to each rank so far
    order = list(reversed(range(len(params)))) if order is None else order
    position = {index: n for n, index in enumerate(order)}
    for index in order:
        group, p = params[index]
        kind = block(p)
        if any(params[m[0]][0] != group or params[m[0]][1].dtype != p.dtype for m in open_buckets.values()):
            for other in sorted(open_buckets, key=lambda k: position[open_buckets[k][-1]]):
                close(other)
        if kind in open_buckets and sizes[kind] + reduced_bytes(p, master_dtype) > bucket_bytes:
            close(kind)
        open_buckets.setdefault(kind, []).append(index)
        sizes[kind] = sizes.get(kind, 0) + reduced_bytes(p, master_dtype)
    for kind in sorted(open_buckets, key=lambda k: position[open_buckets[k][-1]]):
        close(kind)
    return Layout(world, partition, buckets, [p.shape for _, p in params])


def _partition(index, group, members, params, world, partition, loads, block: int | None = None) -> Bucket:
    numel = {i: params[i][1].numel() for i in members}
    segments: list[list[Segment]] = [[] for _ in range(world)]
    if partition == "even":
        total = sum(numel.values())
        chunk = max(1, math.ceil(total / world))
        if block is not None:            # whole blocks: no block of a parameter on two ranks
            chunk = math.ceil(chunk / block) * block
        position = 0
        for i in members:
            start = position
            while start < position + numel[i]:
                rank = start // chunk
                stop = min(position + numel[i], (rank + 1) * chunk)
                segments[rank].append(Segment(i, start - position, stop - position, start - rank * chunk))
                start = stop
            position += numel[i]
    else:
        owner = {}
        for i in sorted(members, key=lambda i: (-numel[i], i)):
            rank = min(range(world), key=lambda r: (loads[r], r))
            owner[i] = rank
            loads[rank] += numel[i]
        for i in members:                 # bucket order within each rank's chunk
            rank = owner[i]
            offset = sum(s.numel for s in segments[rank])
            segments[rank].append(Segment(i, 0, numel[i], offset))
        chunk = max(1, max(sum(s.numel for s in segs) for segs in segments))
    return Bucket(index, group, members, chunk, segments)


def gradient_order(graph: torch.fx.Graph, input_index: dict[int, int], count: int) -> list[int]:
    """Parameter indices (optimizer order, `count` of them) in the order backward makes their
    gradients final: the reverse of their first use in the forward of Dynamo's step `graph`, which
    runs in program order (`input_index`: parameter index -> its placeholder's index). DDP finds
    this order by recording its first backward and rebuilding its buckets; reverse registration
    order is its first guess, and wrong wherever a module registers its parameters in another
    order than it uses them (a transformer layer's norms: registered last, used first). With
    that guess a bucket could hold a gradient that is final early (the next layer's norm weight)
    and one that is final late, and its reduce buffer lived across the next bucket's.
    Parameters used together keep reverse parameter order; one the graph does not use goes last."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    position = {n: i for i, n in enumerate(graph.nodes)}
    last = len(position)                 # after every used parameter

    def key(index: int) -> tuple[int, int]:
        users = placeholders[input_index[index]].users if index in input_index else ()
        return (-min(position[u] for u in users) if users else last, -index)

    return sorted(range(count), key=key)
