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
        return (reduce_gradient_onto_shard(ctx, grad), None, None, None, None, None, None)


def reduce_gradient_onto_shard(ctx, grad: torch.Tensor) -> torch.Tensor:
    """The full gradient padded with zero rows, reduce-scattered (sum) onto this rank's rows and
    divided by the ranks; in the reduce dtype, then the shard's (``ctx``: rows, world, group_name,
    shard_dtype, reduce_dtype)."""
    rows = grad.reshape(ctx.rows, *grad.shape[1:]) if grad.dim() else grad.reshape(1)
    reduce_dtype = ctx.reduce_dtype or (torch.float32 if grad.dtype in HALF else grad.dtype)
    rows = rows.to(reduce_dtype)
    per_rank = rows_per_rank(ctx.rows, ctx.world)
    if per_rank * ctx.world != ctx.rows:
        rows = torch.cat([rows, rows.new_zeros(per_rank * ctx.world - ctx.rows, *rows.shape[1:])])
    summed = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(rows, "sum", ctx.world, ctx.group_name))
    return (summed / ctx.world).to(ctx.shard_dtype)


def rows_per_rank(rows: int, world: int) -> int:
    """A shard's rows: ``ceil(rows / world)`` (at least 1: a 0-d parameter counts as one row)."""
    return max(1, -(-rows // world))


class _ReduceOntoShard(torch.autograd.Function):
    """Forward: a stand-in for the full parameter (a zero expanded to its shape: no memory) whose
    gradient, in backward, is reduce-scattered onto the shard as ``_GatherShard``'s is. What the
    forward reads is elsewhere (``_gather_in_float8``); this carries the gradient."""

    @staticmethod
    def forward(ctx, shard, rows: int, shape: tuple, world: int, group_name: str, dtype: torch.dtype,
                reduce_dtype: torch.dtype | None):
        ctx.rows, ctx.world, ctx.group_name = rows, world, group_name
        ctx.shard_dtype, ctx.reduce_dtype = shard.dtype, reduce_dtype
        return shard.new_zeros((), dtype=dtype).expand(shape)

    @staticmethod
    def backward(ctx, grad):
        return (reduce_gradient_onto_shard(ctx, grad), None, None, None, None, None, None)


class _Float8Weight(torch.autograd.Function):
    """torchao's ``Float8TrainingTensor`` of gathered float8 bytes and their scale, standing for
    ``stand_in`` (the full parameter): its high-precision gradient passes to ``stand_in`` as is, as
    torchao's own cast (``_ToFloat8ConstrFunc``) passes it."""

    @staticmethod
    def forward(ctx, stand_in, data, scale, mm_config):
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        return Float8TrainingTensor(data, scale, stand_in.dtype, mm_config, gemm_input_role=GemmInputRole.WEIGHT)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def _gather_in_float8(shard, rows, shape, world, group_name, param_dtype, reduce_dtype, float8):
    """FSDP2's float8 all-gather (torchao's ``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather``
    and ``fsdp_post_all_gather``): the weight's amax is the max of the ranks' shard amaxes (one
    all-reduce of a scalar), each rank casts its shard to float8 with the scale of that amax, the
    float8 bytes are all-gathered, and the full weight is torchao's ``Float8TrainingTensor`` of them
    (the GEMM's weight operand, cast already). Equal, bit for bit, to gathering the weight and casting
    it with the whole weight's amax, as the Float8Linear does; a quarter of fp32's bytes on the wire."""
    from torchao.float8.float8_scaling_utils import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_training_tensor import GemmInputRole
    from torchao.float8.float8_utils import amax_to_scale

    float8_dtype, mm_config = float8
    with torch.no_grad():
        values = shard.detach()
        amax = _c10d.wait_tensor(_c10d.all_reduce(torch.max(torch.abs(values)), "max", group_name))
        scale = amax_to_scale(amax, float8_dtype)
        bits = hp_tensor_and_scale_to_float8(values, scale, float8_dtype, mm_config, GemmInputRole.WEIGHT)._data
        full = _c10d.wait_tensor(_c10d.all_gather_into_tensor(bits.view(torch.uint8), world, group_name))
        data = full.view(float8_dtype)[:rows].view(shape)
    stand_in = _ReduceOntoShard.apply(shard, rows, shape, world, group_name, param_dtype or shard.dtype, reduce_dtype)
    return _Float8Weight.apply(stand_in, data, scale, mm_config)


def gather(shard: torch.Tensor, rows: int, shape: tuple, world: int, group_name: str,
           param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
           float8: tuple | None = None) -> torch.Tensor:
    """The full parameter (``shape``, ``rows`` rows along dim 0; 1 for a 0-d one) gathered from the
    ``world`` ranks' shards of the process group ``group_name``; backward reduces its gradient onto
    ``shard``, averaged.

    Mixed precision (FSDP2's ``MixedPrecisionPolicy``): with ``param_dtype`` the shard is cast before
    the all-gather (half the bytes on the wire for bf16) and the full parameter is in that dtype; the
    gradient is reduced in ``reduce_dtype`` (None: fp32 for a bf16/fp16 gradient, else its own
    dtype) and arrives on the shard in the shard's dtype.

    Float8 (``float8``: the float8 dtype and torchao's ``LinearMMConfig`` of a ``Float8Linear``'s
    weight converted with ``enable_fsdp_float8_all_gather=True``): the shard is cast to float8 and
    the float8 bytes are gathered; the full parameter is torchao's ``Float8TrainingTensor``."""
    if float8 is not None:
        return _gather_in_float8(shard, rows, shape, world, group_name, param_dtype, reduce_dtype, float8)
    return _GatherShard.apply(shard, rows, shape, world, group_name, param_dtype, reduce_dtype)
