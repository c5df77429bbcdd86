"""ZeRO-1 for a single-device step: buckets, partitions and the sharded optimizer state.

``options={"optimizer": opt, "data_parallel": "zero1"}`` trains the user's
single-device step data-parallel over a torch.distributed process group. This
module holds what does not live in a graph:

* **layout** — buckets and partitions (``layout.py``).

* **sharded state** — a torch.optim optimizer of the user's class and
  hyper-parameters whose parameters are this rank's chunks (one flat tensor per
  bucket): its state is 1/N of the unsharded state. The user's optimizer never
  steps and never allocates state. ``optimizer_state_dict``/``load_optimizer``
  save and load it with torch.distributed.checkpoint in a layout-free form
  (one flat tensor per parameter and state key), so a checkpoint written on
  N ranks resumes on M.

* **fp32 master shards** (``master_weights=torch.float32``, Megatron's distributed
  optimizer) — the shard optimizer's parameter for a bf16/fp16 bucket is this
  rank's fp32 master of its chunk, read from the parameters when the shards are
  made (or loaded from a checkpoint) and updated in place by the step; its state
  is fp32. No rank holds a full-size master: per parameter element a rank keeps
  the bf16 parameter (2 bytes) and 1/N of the master (4) and of the state (AdamW 8).
  ``master_pieces()`` lists this rank's pieces.

* **every update in the graph** — the ``shard_optimizer`` pass puts collectives
  and the shard optimizer's update into the step graph from the first step on;
  the shard optimizer's state is created as torch.optim's first step creates it
  (``optim/harvest.py``), 1/N of the unsharded state, with no full gradients held.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist

from optpass.errors import OptpassError
from optpass.options import OptimizerList, optimizers_of
from optpass.process_groups import backend_for_device
from optpass.optim import low_bit_states
from optpass.optim.elementwise import refuse_non_elementwise
from optpass.precision.masters import note_sharded_masters, refuse_step_outside_the_compiled_step
from optpass.zero1.agreement import agree
from optpass.zero1.adopt import adopt_unsharded_state, state_digest, state_summary
from optpass.zero1.layout import Bucket, build_layout, on_masters, trainable_params


# ---------------------------------------------------------------- sharded state

@dataclasses.dataclass
class ProcessGroupInfo:
    group: Any
    rank: int
    world: int

    @property
    def name(self) -> str:
        return self.group.group_name

    def backend_for(self, device: torch.device) -> str:
        """The name of the backend ("gloo", "nccl", ...) that runs this group's collectives on `device`."""
        return backend_for_device(dist.get_backend(self.group), device.type)

    @staticmethod
    def of(group) -> "ProcessGroupInfo":
        if not dist.is_available() or not dist.is_initialized():
            raise OptpassError(
                "data_parallel='zero1' needs torch.distributed: call "
                "torch.distributed.init_process_group() first (e.g. run under torchrun; gloo on CPU, "
                "nccl on GPU).")
        group = group if group is not None else dist.group.WORLD
        return ProcessGroupInfo(group, dist.get_rank(group), dist.get_world_size(group))


class ShardedOptimizer:
    """This rank's shard of `optimizer`: a torch.optim optimizer over its chunk of each bucket.

    With ``master_dtype`` (options master_weights) the chunk of a bf16/fp16 bucket is this
    rank's fp32 master of those elements (Megatron's distributed optimizer): it persists
    between steps, the graph updates it in place and all-gathers its rounding. Without it
    (or for an fp32 bucket) the chunk is a stand-in the graph fills from the parameters.

    Made by the first compile of a step with ``data_parallel="zero1"`` (or by
    ``load_sharded_checkpoint``); read it with ``optpass.zero1.sharded_state(opt)``.

    Attributes:
        optimizer: the user's optimizer (it never steps and holds no state).
        pg: the process group, with this rank and the world size.
        partition: the ``partition`` option.
        bucket_bytes: the ``bucket_bytes`` option.
        master_dtype: the ``master_weights`` option (None: no masters).
        params: (param group index, parameter) for every trainable parameter, in optimizer order.
        layout: the buckets and each rank's segments of them.
        shards: bucket index -> this rank's flat chunk of it, for the buckets it owns elements of.
        shard_optimizer: a torch.optim optimizer of the user's class and hyper-parameters over
            the shards (None when this rank owns no elements); its state is 1/N of the
            unsharded state.
        replicas: the frozen parameters and buffers rank 0 hands to every rank (``Replicas``;
            None until the first compiled step).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, pg: ProcessGroupInfo, partition: str,
                 bucket_bytes: int | None, master_dtype: torch.dtype | None = None,
                 order: list[int] | None = None):
        self.optimizer, self.pg = optimizer, pg
        self.partition, self.bucket_bytes, self.master_dtype = partition, bucket_bytes, master_dtype
        self.params = trainable_params(optimizer)
        if not self.params:
            raise OptpassError("data_parallel='zero1': the optimizer has no parameters that require grad.")
        self._member_of = {id(p): member for member in optimizers_of(optimizer)
                           for group in member.param_groups for p in group["params"]}
        self.layout = build_layout(self.params, pg.world, partition, bucket_bytes, master_dtype, order,
                                   block_of=lambda p: low_bit_states.block_size(self._member_of[id(p)], p))
        # One flat shard per bucket this rank owns elements of, named like a parameter.
        self.shards: dict[int, torch.Tensor] = {}
        for bucket in self.layout.buckets:
            owned = bucket.owned(pg.rank)
            if owned:
                p = self.params[bucket.params[0]][1]
                dtype = master_dtype if self.has_master(bucket) else p.dtype
                self.shards[bucket.index] = torch.zeros(owned, dtype=dtype, device=p.device)
        self.shard_optimizer = self._make_shard_optimizer() if self.shards else None
        self._create_quantized_state()
        self.replicas: Replicas | None = None   # with the first compiled step (sharded_optimizer)
        self._stale_masters = {b.index for b in self.layout.buckets if b.index in self.shards}
        adopt_unsharded_state(self)          # eager steps, a plain checkpoint: this rank's rows of it
        self.refresh_masters()

    @property
    def rank(self) -> int:
        """This rank in the process group."""
        return self.pg.rank

    def shard_name(self, bucket: Bucket) -> str:
        return f"bucket{bucket.index}"

    def _make_shard_optimizer(self) -> torch.optim.Optimizer | OptimizerList:
        """One optimizer of each user optimizer's class over its shards (a list of optimizers: one
        per member this rank holds shards of, a bucket never spans two param groups)."""
        # Only groups this rank holds a shard of: torch.optim traces an empty group to no ops, and
        # Dynamo then skips the update function for every group. user_group maps them back.
        made, self.user_group, first = [], [], 0
        for member in optimizers_of(self.optimizer):
            groups = []
            for g, group in enumerate(member.param_groups, start=first):
                shard_params = [self.shards[b.index] for b in self.layout.buckets
                                if b.group == g and b.index in self.shards]
                if shard_params:
                    settings = {k: v for k, v in group.items() if k != "params"}
                    groups.append({**settings, "params": shard_params})
                    self.user_group.append(g)
            first += len(member.param_groups)
            if groups:
                made.append(_shard_optimizer_like(member, groups))
        return OptimizerList.of(made)

    def block_of(self, bucket: Bucket) -> int | None:
        """The block size the bucket's state is quantized in (None: unquantized; see ``layout.py``)."""
        p = self.params[bucket.params[0]][1]
        return low_bit_states.block_size(self._member_of[id(p)], p)

    def _create_quantized_state(self) -> None:
        """torchao's state for each low-bit shard optimizer's shards, made now rather than by its first
        step: torchao would quantize a shard by the shard's own size (fp32 below 4096 elements), where
        one process quantizes each parameter by its size; a shard is quantized exactly where its
        bucket's parameters are (``block_of``), in the same blocks (the layout's chunks are whole blocks)."""
        if self.shard_optimizer is None:
            return
        quantized = {id(self.shards[b.index]) for b in self.layout.buckets
                     if b.index in self.shards and self.block_of(b) is not None}
        for member in optimizers_of(self.shard_optimizer):
            if low_bit_states.is_low_bit(member):
                shards = [p for group in member.param_groups for p in group["params"]]
                low_bit_states.create_missing_state(member, shards, quantized=lambda shard: id(shard) in quantized)

    def sync_lr(self) -> None:
        """The user's scheduler changes the user's optimizer: the shard optimizer follows."""
        if self.shard_optimizer is None:
            return
        for mine, g in zip(self.shard_optimizer.param_groups, self.user_group):
            mine["lr"] = self.optimizer.param_groups[g]["lr"]

    def sync_hyperparameters(self) -> None:
        """A checkpoint's param groups were restored into the user's optimizer: the shard optimizer's
        groups take every setting (betas, weight_decay, ...), as they did from the user's when made."""
        if self.shard_optimizer is None:
            return
        for mine, g in zip(self.shard_optimizer.param_groups, self.user_group):
            mine.update({k: v for k, v in self.optimizer.param_groups[g].items() if k != "params"})

    def state_bytes(self) -> int:
        """Bytes of optimizer-state tensors on this rank (the shard optimizer's; 0 without one)."""
        if self.shard_optimizer is None:
            return 0
        return sum(low_bit_states.stored_bytes(t) for state in self.shard_optimizer.state.values()
                   for t in state.values())

    # ------------------------------------------------------------ fp32 masters (master_weights)

    def has_master(self, bucket: Bucket) -> bool:
        """The bucket's update runs on fp32 masters (the same answer on every rank: it sets the
        dtype of the bucket's reduce-scatter)."""
        return on_masters(self.params[bucket.params[0]][1].dtype, self.master_dtype)

    def mark_masters_stale(self, buckets) -> None:
        """Re-read these buckets' masters from the parameters before the next step (a checkpoint
        without masters was loaded; the parameters may be loaded after it)."""
        self._stale_masters.update(b for b in buckets if b in self.shards)

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Re-read the masters marked stale from the parameters (nothing to do when none is)."""
        if not self._stale_masters:              # every step asks: usually nothing to do
            return
        for bucket in self.layout.buckets:
            if bucket.index in self._stale_masters and self.has_master(bucket):
                shard = self.shards[bucket.index]
                for s in bucket.segments[self.rank]:
                    flat = self.params[s.param][1].detach().reshape(-1)
                    shard[s.offset: s.offset + s.numel].copy_(flat[s.start: s.stop])
        self._stale_masters.clear()

    def master_pieces(self) -> dict[int, list[tuple[int, int, torch.Tensor]]]:
        """This rank's fp32 masters: parameter index (optimizer order) -> [(start, stop, view)],
        elements [start, stop) of the flattened parameter; the views are the masters the step updates.

        Returns:
            parameter index -> [(start, stop, fp32 view)]; empty without master_weights.
        """
        self.refresh_masters()
        pieces: dict[int, list] = {}
        for bucket in self.layout.buckets:
            if bucket.index in self.shards and self.has_master(bucket):
                shard = self.shards[bucket.index]
                for s in bucket.segments[self.rank]:
                    pieces.setdefault(s.param, []).append((s.start, s.stop, shard[s.offset: s.offset + s.numel]))
        return pieces

    def master_bytes(self) -> int:
        """Bytes of fp32 masters on this rank (0 without master_weights)."""
        return sum(t.numel() * t.element_size() for b, t in self.shards.items()
                   if self.has_master(self.layout.buckets[b]))


# ---------------------------------------------------------------- sessions and checks

_SHARDED: WeakKeyDictionary = WeakKeyDictionary()


def sharded_optimizer(optimizer: torch.optim.Optimizer, process_group=None, partition: str = "even",
                      bucket_bytes: int | None = None,
                      names: dict[int, str] | None = None,
                      master_dtype: torch.dtype | None = None,
                      order: list[int] | None = None,
                      step: list[tuple[str, Any]] | None = None,
                      replicated: dict[str, torch.Tensor] | None = None) -> ShardedOptimizer:
    """The sharded state of `optimizer` on this rank (created once; later calls must agree, but
    for `order`: a state created without it, by load_sharded_checkpoint before the first step,
    keeps DDP's reverse parameter order).

    `step` (what the compiled step's options and hyper-parameters are, as (what, value) pairs) and
    `replicated` (the frozen parameters and buffers it reads) come with the first compile of a
    step: every rank must agree on them, and takes rank 0's `replicated` tensors (``Replicas``)."""
    pg = ProcessGroupInfo.of(process_group)
    replicated = replicated or {}
    existing = _SHARDED.get(optimizer)
    if existing is not None:
        wanted = (pg.group, partition, bucket_bytes, master_dtype)
        if (existing.pg.group, existing.partition, existing.bucket_bytes, existing.master_dtype) != wanted:
            raise OptpassError(
                "data_parallel='zero1': this optimizer is already sharded with process group "
                f"{existing.pg.name}, partition {existing.partition!r}, bucket_bytes "
                f"{existing.bucket_bytes}, master_weights {existing.master_dtype}; compile every step "
                "that uses it, and call load_sharded_checkpoint, with the same options.")
        if step is not None and existing.replicas is None:      # made by load_sharded_checkpoint
            agree(pg.group, "zero1", step + Replicas.signature(replicated))
            existing.replicas = Replicas(pg, replicated)
        return existing
    for member in optimizers_of(optimizer):               # every rank: the same verdict, before any collective
        refuse_non_elementwise(member, master_dtype)
    agreed = signature(optimizer, partition, bucket_bytes, names, master_dtype) + _held_state_values(optimizer)
    if step is not None:
        agreed += step + Replicas.signature(replicated)
    order = agree(pg.group, "zero1", agreed, order)[0]   # rank 0's bucket order (each found its own)
    broadcast_parameters(optimizer, pg)
    sharded = ShardedOptimizer(optimizer, pg, partition, bucket_bytes, master_dtype, order)
    if step is not None:
        sharded.replicas = Replicas(pg, replicated)
    for member in optimizers_of(optimizer):
        # an eager opt.step() with gradients would update every parameter with this rank's gradients
        # (and, with master_weights, bypass the masters): it raises
        member.register_step_pre_hook(refuse_step_outside_the_compiled_step if master_dtype is not None
                                      else refuse_unsharded_step)
        # its state lives in the shards: a plain state_dict would save none, a plain load would be ignored
        member.register_state_dict_pre_hook(refuse_plain_state_dict)
        member.register_load_state_dict_pre_hook(refuse_plain_load_state_dict)
    _SHARDED[optimizer] = sharded
    if master_dtype is not None:
        note_sharded_masters(optimizer, pg.world)       # optpass.master_weights(opt) says where they are
    return sharded


def _shard_optimizer_like(optimizer: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """An optimizer of `optimizer`'s class and defaults over `groups` (this rank's shards)."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    try:
        return cls(groups, **defaults, **low_bit_states.constructor_settings(optimizer))
    except (TypeError, ValueError) as error:
        raise OptpassError(f"data_parallel='zero1': could not build a {cls.__name__} over this "
                           f"rank's shards ({error}).") from error


class Replicas:
    """What every rank holds the same besides the trained parameters: the other parameters and
    the buffers of the models the step reads (``runtime.sharded_step.replicated_tensors``), as DDP
    keeps them. DDP broadcasts rank 0's parameters and
    buffers when it wraps the model, and rank 0's buffers again before every forward
    (``broadcast_buffers=True``): a BatchNorm's running statistics, which each rank updates on
    its own batch, are rank 0's at the start of every step, so rank 0's equal one process's.

    Here: rank 0's tensors when the step is first compiled, and before later calls the buffers
    the step writes, found at its first call (their version changed; the same on every rank,
    which runs the same graph), in one coalesced broadcast (see ``run`` for when)."""

    BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024          # DDP's broadcast_bucket_size

    def __init__(self, pg: ProcessGroupInfo, tensors: dict[str, torch.Tensor]):
        self.pg, self.tensors = pg, tensors
        self.written: list[torch.Tensor] | None = None       # learned at the first call
        self._in_window = False                              # the last call was a micro-step
        self._broadcast(list(tensors.values()))

    @staticmethod
    def signature(tensors: dict[str, torch.Tensor]) -> list[tuple[str, Any]]:
        return [(f"frozen parameter or buffer {name}", (tuple(t.shape), str(t.dtype)))
                for name, t in sorted(tensors.items())]

    @torch.no_grad()
    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        if tensors and self.pg.world > 1:
            dist._broadcast_coalesced(self.pg.group, tensors, self.BROADCAST_BUCKET_BYTES, 0)

    def run(self, call, args, micro_step: bool = False):
        """``call(*args)`` after rank 0's written buffers reached this rank. As DDP: before every
        step, but within an accumulation window only before its first micro-step (DDP syncs
        buffers before a forward that follows a synchronizing one, not after a ``no_sync()`` one)."""
        if self.written is None:                 # the first call: rank 0's, from the first compile
            versions = [t._version for t in self.tensors.values()]
            result = call(*args)
            self.written = [t for t, v in zip(self.tensors.values(), versions)
                            if t._version != v and not isinstance(t, torch.nn.Parameter)]
        else:
            if not self._in_window:
                self._broadcast(self.written)
            result = call(*args)
        self._in_window = micro_step
        return result


def refuse_plain_state_dict(optimizer: torch.optim.Optimizer) -> None:
    raise OptpassError(
        "data_parallel='zero1': opt.state_dict() of a sharded optimizer would hold no state: each rank keeps "
        "its shard of it (optpass.zero1.sharded_state(opt)), and the user's optimizer none. Save with "
        "optpass.save_sharded_checkpoint(path, opt, model=model) on every rank (torch.distributed.checkpoint; "
        "it loads on any number of ranks with optpass.load_sharded_checkpoint).")


def refuse_plain_load_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    raise OptpassError(
        "data_parallel='zero1': opt.load_state_dict() after the optimizer was sharded (at the first compile "
        "of its step) would not reach the shards. Load a zero1 checkpoint with "
        "optpass.load_sharded_checkpoint(path, opt, model=model) on every rank; load a plain torch.optim "
        "state_dict before the first compiled step, on every rank: each rank then takes its rows of it.")


def refuse_unsharded_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """An eager opt.step() with gradients on a sharded optimizer (e.g. after micro-steps of gradient
    accumulation, which leave this rank's gradients in .grad). While Dynamo traces opt.step() inside
    the compiled step this checks nothing: there the update is the sharded one."""
    if torch.compiler.is_compiling():
        return
    fed = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if fed:
        raise OptpassError(
            f"data_parallel='zero1': opt.step() was called with gradients on {len(fed)} parameter(s) outside "
            "the compiled step. This optimizer's state is sharded over the ranks, and its update runs inside "
            "the step compiled with options={'optimizer': opt, 'data_parallel': 'zero1'}, on the gradients "
            "averaged across ranks; this call would update every parameter with this rank's gradients alone "
            "(the ranks would drift apart) and build full-size state. Call opt.step() inside that compiled "
            "step, after loss.backward() (with gradient accumulation: the compiled step runs the last "
            "micro-batch).")


def sharded_state(optimizer: torch.optim.Optimizer) -> ShardedOptimizer:
    """The ZeRO-1 state of `optimizer` on this rank (after the first compile of its step).

    Args:
        optimizer: the user's optimizer, as given in the step's options (a list of optimizers: that
            list).

    Returns:
        This rank's ``ShardedOptimizer``: the layout, the shard optimizer, ``state_bytes()``;
        with master_weights its fp32 masters (``master_pieces()``, ``master_bytes()``).

    Raises:
        OptpassError: the optimizer is not sharded (yet): its state is made when a step compiled
            with ``data_parallel="zero1"`` first runs (or by ``load_sharded_checkpoint``).
    """
    if isinstance(optimizer, (list, tuple)):
        optimizer = OptimizerList.of(optimizer)
    sharded = _SHARDED.get(optimizer)
    listed = next((key for key in _SHARDED.keys() if optimizer in optimizers_of(key)), None)
    if sharded is None and listed is not None:
        raise OptpassError(f"this optimizer is sharded as one of the list {listed!r} given to its step: "
                           "pass that list, e.g. sharded_state([opt_a, opt_b]).")
    if sharded is None:
        raise OptpassError("this optimizer is not sharded (yet): its state is created when a step "
                           "compiled with options={'optimizer': opt, 'data_parallel': 'zero1'} first runs.")
    return sharded


def _shortest(value: torch.Tensor) -> float:
    """A one-element tensor's value as the shortest float that rounds back to it in its dtype (a float32
    lr of 0.1 reads 0.1, not 0.10000000149011612); distinct values stay distinct."""
    exact = float(value)
    if not value.is_floating_point() or value.dtype == torch.float64:
        return exact
    for digits in range(1, 18):
        candidate = float(f"{exact:.{digits}g}")
        if torch.tensor(candidate, dtype=value.dtype) == value.detach().reshape(()).cpu():
            return candidate
    return exact


def signature(optimizer: torch.optim.Optimizer, partition: str, bucket_bytes: int,
              names: dict[int, str] | None = None,
              master_dtype: torch.dtype | None = None) -> list[tuple[str, Any]]:
    """What must be identical on every rank, as (what, value) pairs in a fixed order."""
    names = names or {}
    items: list[tuple[str, Any]] = [("optimizer class", repr(optimizer) if isinstance(optimizer, OptimizerList)
                                     else type(optimizer).__name__),
                                    ("partition", partition), ("bucket_bytes", bucket_bytes),
                                    ("master_weights", str(master_dtype)),
                                    ("param groups", len(optimizer.param_groups))]
    items += [(f"{type(member).__name__}'s quantization", repr(settings)) for member in optimizers_of(optimizer)
              if (settings := low_bit_states.constructor_settings(member))]
    for g, group in enumerate(optimizer.param_groups):
        settings = {k: (_shortest(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v)
                    for k, v in group.items() if k not in ("params", "initial_lr")}
        items += [(f"param group {g} {key!r}", repr(value)) for key, value in sorted(settings.items())]
        items.append((f"param group {g} size", len(group["params"])))
    for index, (g, p) in enumerate(trainable_params(optimizer)):
        label = names.get(id(p), f"#{index}")
        items.append((f"parameter {index} ({label}) of group {g}", (tuple(p.shape), str(p.dtype))))
    items.append(("the optimizer state held before sharding (parameter, keys, scalars; load the same "
                  "state on every rank)", state_summary(optimizer, [p for _, p in trainable_params(optimizer)])))
    return items


def _held_state_values(optimizer: torch.optim.Optimizer) -> list[tuple[str, Any]]:
    """ZeRO-1 takes each rank's rows of the full-size state the user's optimizer holds: every rank must
    hold the same values (under fsdp each rank holds its own shards' state, so this is zero1's alone)."""
    return [("a digest of the values of the optimizer state held before sharding (eager steps on each "
             "rank's own data, or different checkpoints, leave different state: load the same state on "
             "every rank, or compile the step with data_parallel='zero1' from the first step)",
             state_digest(optimizer, [p for _, p in trainable_params(optimizer)]))]


@torch.no_grad()
def broadcast_parameters(optimizer, pg: ProcessGroupInfo) -> None:
    """Start every rank from rank 0's parameters, as DDP does."""
    for _, p in trainable_params(optimizer):
        dist.broadcast(p.data, src=dist.get_global_rank(pg.group, 0), group=pg.group)
