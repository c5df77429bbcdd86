"""What optpass needs to know of a tensor-parallel model's DTensor parameters.

A model prepared with ``torch.distributed.tensor.parallel.parallelize_module`` (ColwiseParallel,
RowwiseParallel, SequenceParallel, ...) holds its parameters as DTensors: each rank keeps a local
tensor, a shard (``Shard(dim)``) or a whole copy (``Replicate()``) of the parameter, on a device
mesh. Dynamo traces the step over the DTensors and AOTAutograd flattens each one into its local
tensor and its mesh (``DTensor.__tensor_flatten__``), so the aten graph optpass rewrites computes
with the local tensors, with DTensor's collectives (all-gathers, reduce-scatters, all-reduces of
the plan) left in it as functional collectives (docs/design.md §64).

That is what makes the update in backward right on each rank's local tensors: an elementwise
optimizer's update of a shard is the shard of the update. What is not local is said here:

* ``norm_groups``: over which process groups a local gradient's squared norm is summed to give its
  share of the global norm (a shard's over the ranks holding the other shards; a replicated
  gradient's is counted once);
* ``sharded``: whether an update that mixes a parameter's elements (Muon, Adafactor) would see only
  part of it;
* ``context_parallel_active``: whether torch's ``context_parallel`` has replaced SDPA.
"""

from __future__ import annotations

import dataclasses
import sys

import torch


def is_dtensor(value) -> bool:
    """`value` is a ``torch.distributed.tensor.DTensor``."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def placements_text(value) -> str:
    """``Shard(0)`` / ``Replicate()`` / ``(Shard(0), Replicate())`` as DTensor prints them."""
    placements = tuple(value.placements)
    return repr(placements[0]) if len(placements) == 1 else repr(placements)


def sharded(value) -> bool:
    """A DTensor split over some dimension of its mesh (each rank holds part of its elements)."""
    return is_dtensor(value) and any(p.is_shard() for p in value.placements)


def has_partial(value) -> bool:
    """A DTensor whose local tensors are partial sums (``Partial()``): not a value on its own."""
    return is_dtensor(value) and any(p.is_partial() for p in value.placements)


@dataclasses.dataclass(frozen=True)
class TensorParallelLayout:
    """How a DTensor's local tensor is the DTensor: its mesh, placements, global shape and stride."""

    mesh: object
    placements: tuple
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @staticmethod
    def of(value) -> "TensorParallelLayout | None":
        """`value`'s layout (sizes as numbers: a fake DTensor of Dynamo's may hold SymInts); None for a
        plain tensor."""
        if not is_dtensor(value):
            return None
        return TensorParallelLayout(value.device_mesh, tuple(value.placements),
                                    tuple(int(size) for size in value.shape), tuple(int(s) for s in value.stride()))

    def as_dtensor(self, local: torch.Tensor) -> torch.Tensor:
        """The DTensor around `local` (differentiable: its gradient is the local one's)."""
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=torch.Size(self.shape), stride=self.stride)

    def local_of(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor of the whole tensor `whole` (DTensor's split: ``torch.chunk``)."""
        for dim, placement in enumerate(self.placements):
            if placement.is_shard():
                whole = torch.chunk(whole, self.mesh.size(dim), dim=placement.dim)[self.mesh.get_local_rank(dim)]
        return whole

    @property
    def norm_groups(self) -> tuple[str, ...]:
        """The groups a local squared norm is summed over: one per mesh dimension that shards it."""
        return tuple(self.mesh.get_group(dim).group_name for dim, p in enumerate(self.placements) if p.is_shard())


def norm_groups(value) -> tuple[str, ...]:
    """The process groups over which `value`'s local squared norm is summed into the global one:
    one per mesh dimension that shards it ((): a plain tensor or a replicated DTensor, whose local
    tensor is the whole of it on every rank)."""
    layout = TensorParallelLayout.of(value)
    return layout.norm_groups if layout is not None else ()


def context_parallel_active() -> bool:
    """torch's ``context_parallel`` context is entered: SDPA is replaced by its ring attention (the
    monkey-patch dispatch mode) or DTensor dispatches SDPA to it (the module-wrapper mode)."""
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:
        return False
    if torch.nn.functional.scaled_dot_product_attention in _attention._replaced_functions:
        return True
    handlers = getattr(DTensor._op_dispatcher, "_custom_op_handlers", {})
    return any(op in handlers for op in getattr(_attention, "custom_ops", {}))


def context_parallel_message() -> str:
    """Why a step inside torch's ``context_parallel`` is refused, and what works instead."""
    return ("optpass: this step runs inside torch's context_parallel (torch.distributed.tensor.experimental."
            "context_parallel): its ring attention shards the sequence across ranks inside SDPA, and optpass "
            "has not been shown to train it equal to one process (torch's own context parallel fails on CPU: "
            "no sharding strategy for _scaled_dot_product_flash_attention_for_cpu; on CUDA it is untested "
            "under optpass). What works today: tensor and sequence parallelism (parallelize_module with "
            "ColwiseParallel / RowwiseParallel / SequenceParallel) compiled with optpass, or context "
            "parallelism without optpass (backend='inductor', where torch supports it).")


def note_context_parallel(_args) -> None:
    """A Dynamo compile-end callback: an error raised while Dynamo traces a step inside torch's
    ``context_parallel`` (before any backend sees a graph: on CPU, DTensor has no sharding strategy
    for SDPA) carries optpass's word on context parallelism as a note, which Python prints after it."""
    error = sys.exc_info()[1]
    if isinstance(error, Exception) and context_parallel_active():
        note = context_parallel_message()
        if note not in getattr(error, "__notes__", ()):
            error.add_note(note)
