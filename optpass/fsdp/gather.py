"""The all-gather of a shard whose gradient is the reduce-scatter onto it, as one autograd function.

Forward: ``all_gather_into_tensor`` of every rank's shard (its rows of the parameter, along dim 0),
the padding rows cut off, in the parameter's shape. Backward: the full gradient padded with zero
rows, ``reduce_scatter_tensor`` (sum) onto this rank's rows, divided by the number of ranks (each rank's loss is a mean over its own
batch, so the average is the gradient of the mean over all of them, as DDP's). A bf16/fp16 gradient
is summed in fp32 (docs/design.md §27) and rounded once, unless a mixed-precision policy names the
reduce dtype; the gradient reaching the shard is in the shard's dtype.

Both are functional collectives (``torch.ops._c10d_functional``, §24): Dynamo traces them into the
step's graph, forward and backward, and they run through Inductor or the eager lowering on any
backend (gloo on CPU, NCCL on GPUs). Called outside a compiled step (evaluation under ``no_grad``)
they run eagerly, as collectives every rank must join.
"""

from __future__ import annotations

import torch

_c10d = torch.ops._c10d_functional
HALF = (torch.bfloat16, torch.float16)


class _GatherShard(torch.autograd.Function):

    @staticmethod
    def forward(ctx, shard, rows: int, shape: tuple, world: int, group_name: str,
                param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None):
        ctx.rows, ctx.world, ctx.group_name = rows, world, group_name
        ctx.shard_dtype, ctx.reduce_dtype = shard.dtype, reduce_dtype
        if param_dtype is not None:             # the spec's: set only where it differs from the shard's
            shard = shard.to(param_dtype)        # mixed precision: gathered (and computed) in param_dtype
        full = _c10d.wait_tensor(_c10d.all_gather_into_tensor(shard, world, group_name))
        return full[:rows].view(shape)

    @staticmethod
    def backward(ctx, grad):
        rows = grad.reshape(ctx.rows, *grad.shape[1:]) if grad.dim() else grad.reshape(1)
        reduce_dtype = ctx.reduce_dtype or (torch.float32 if grad.dtype in HALF else grad.dtype)
        rows = rows.to(reduce_dtype)
        per_rank = rows_per_rank(ctx.rows, ctx.world)
        if per_rank * ctx.world != ctx.rows:
            rows = torch.cat([rows, rows.new_zeros(per_rank * ctx.world - ctx.rows, *rows.shape[1:])])
        summed = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(rows, "sum", ctx.world, ctx.group_name))
        return (summed / ctx.world).to(ctx.shard_dtype), None, None, None, None, None, None


def rows_per_rank(rows: int, world: int) -> int:
    """A shard's rows: ``ceil(rows / world)`` (at least 1: a 0-d parameter counts as one row)."""
    return max(1, -(-rows // world))


def gather(shard: torch.Tensor, rows: int, shape: tuple, world: int, group_name: str,
           param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The full parameter (``shape``, ``rows`` rows along dim 0; 1 for a 0-d one) gathered from the
    ``world`` ranks' shards of the process group ``group_name``; backward reduces its gradient onto
    ``shard``, averaged.

    Mixed precision (FSDP2's ``MixedPrecisionPolicy``): with ``param_dtype`` the shard is cast before
    the all-gather (half the bytes on the wire for bf16) and the full parameter is in that dtype; the
    gradient is reduced in ``reduce_dtype`` (None: fp32 for a bf16/fp16 gradient, else its own
    dtype) and arrives on the shard in the shard's dtype."""
    return _GatherShard.apply(shard, rows, shape, world, group_name, param_dtype, reduce_dtype)
