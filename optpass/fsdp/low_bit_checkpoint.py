"""torchao's quantized moments (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``) in a fully sharded model's
DCP checkpoint: saved as their codes and block scales, loaded on any number of ranks.

Under ``data_parallel="fsdp"`` torchao quantizes each rank's moments over the rank's shard (``chunk``
rows, padding included), in blocks counted from the shard's first element. A shard it quantizes holds
a whole number of blocks, so rank r's first element ``r * chunk * cols`` is on one of the parameter's
own block boundaries, and the shards' blocks are the blocks of the whole parameter in one flat order.

Save: each quantized moment as its inner tensors, ``state.<name>.exp_avg.codes`` and ``.scale``, each
a 1-D ``ShardedTensor`` of the parameter's elements times the inner tensor's ratio (1 for 8-bit and
FP8 codes, 1/2 for packed 4-bit codes, 1/block for scales; rounded up where the last block also covers
padding), this rank's valid part as its piece. Codes and scales are copied, not requantized: a signed
8-bit moment dequantized and quantized again moves codes (design §63).

Load, on any number of ranks (each rank's shard quantized or not by torchao's rule for its own size):

* saved quantized, quantized here: this rank's codes and scales are read in place, bit for bit;
* saved quantized, fp32 here (a shard under 4096 elements, or one the block size does not divide): the
  whole parameter's codes and scales are read, dequantized, and this rank's rows kept;
* saved fp32, quantized here: this rank's rows are read and quantized into the new moment.

A checkpoint saved with another quantization (another optimizer class or ``block_size``) is refused.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from optpass.errors import OptpassError
from optpass.fsdp.shard import ShardSpec
from optpass.optim import low_bit_states


def _elements_per_row(spec: ShardSpec) -> int:
    return spec.numel // spec.rows if spec.rows else 0


def _flat_range(spec: ShardSpec, rank: int, ratio: Fraction) -> tuple[int, int]:
    """Rank `rank`'s valid elements of a flat inner tensor, [start, stop), in the whole parameter's."""
    per_row = _elements_per_row(spec)
    first = min(rank * spec.chunk, spec.rows)
    last = min(first + spec.chunk, spec.rows)
    start = first * per_row * ratio
    if start.denominator != 1:
        raise OptpassError(f"fsdp checkpoint: {spec.name}'s shard {rank} does not start on a quantization block "
                           "boundary of the parameter.")
    return int(start), math.ceil(last * per_row * ratio)


def _flat_sharded(piece: torch.Tensor, spec: ShardSpec, ratio: Fraction) -> ShardedTensor:
    """A 1-D ShardedTensor of ``ceil(numel * ratio)`` elements; this rank's valid part of `piece` (a flat
    inner tensor of its shard's moment) its local shard."""
    placements, mine = [], None
    for rank in range(spec.world):
        start, stop = _flat_range(spec, rank, ratio)
        if stop <= start:
            continue
        placement = ShardMetadata([start], [stop - start], f"rank:{dist.get_global_rank(spec.group, rank)}/{piece.device}")
        placements.append(placement)
        if rank == spec.rank:
            mine = placement
    total = math.ceil(spec.numel * ratio)
    metadata = ShardedTensorMetadata(placements, torch.Size([total]),
                                     TensorProperties(dtype=piece.dtype, requires_grad=False))
    local = [Shard(piece[:mine.shard_sizes[0]], mine)] if mine is not None else []
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata, process_group=spec.group)


def saved_pieces(value: torch.Tensor, spec: ShardSpec, key: str) -> dict[str, ShardedTensor]:
    """A quantized moment's entries: ``{"exp_avg.codes": ..., "exp_avg.scale": ...}``."""
    return {f"{key}.{inner}": _flat_sharded(getattr(value, inner).reshape(-1), spec, ratio)
            for inner, ratio in low_bit_states.inner_rows(value).items()}


class LowBitLoad:
    """Where ``dcp.load`` reads a low-bit optimizer's state for a fully sharded model, and what is done
    with it after the read (``finish``). `fresh` is each shard's new state (torchao's rule for the shard)."""

    def __init__(self, optimizer, full_shape_sharded: Callable[[torch.Tensor, ShardSpec], ShardedTensor]) -> None:
        self.optimizer = optimizer
        self._full_shape_sharded = full_shape_sharded      # a shard's valid rows in the parameter's shape
        self._after: list[Callable[[], None]] = []
        self._whole: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

    def destination(self, fresh: dict, p: torch.Tensor, spec: ShardSpec, key: str, md):
        """What DCP reads `key` of `p`'s saved state into; None where it is no quantized moment's (the
        caller's own path: a scalar, or an fp32 moment saved and kept fp32)."""
        base, _, inner = key.rpartition(".")
        if base and base in fresh:
            return self._inner_destination(fresh, p, spec, base, inner, md)
        if key in fresh and low_bit_states.is_quantized(fresh[key]) and tuple(md.size) == spec.saved_shape:
            rows = torch.zeros(fresh[key].shape, dtype=fresh[key].dtype)         # saved fp32: quantized here
            self._after.append(lambda: fresh[key].copy_(rows))
            return self._full_shape_sharded(rows, spec)
        return None

    def _inner_destination(self, fresh, p, spec, base: str, inner: str, md):
        target = fresh[base]
        if low_bit_states.is_quantized(target):
            ratio = low_bit_states.inner_rows(target).get(inner)
            flat = getattr(target, inner).reshape(-1) if ratio is not None else None
            if flat is not None and self._matches(md, spec, ratio, flat.dtype):
                return _flat_sharded(flat, spec, ratio)               # read in place, bit for bit
            raise self._other_quantization(spec, base, inner, tuple(md.size), md.properties.dtype)
        # fp32 here: the whole parameter's codes and scales, dequantized once both are read
        whole = self._whole.setdefault((id(p), base), {})
        if not whole:
            self._after.append(lambda: target.copy_(self._dequantized_rows(whole, spec, base, target)))
        whole[inner] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        return whole[inner]

    @staticmethod
    def _matches(md, spec: ShardSpec, ratio: Fraction, dtype: torch.dtype) -> bool:
        return tuple(md.size) == (math.ceil(spec.numel * ratio),) and md.properties.dtype == dtype

    def _other_quantization(self, spec, base, inner, size: tuple, dtype) -> OptpassError:
        return OptpassError(
            f"fsdp checkpoint: {spec.name}'s {base}.{inner} was saved with another quantization ({size} "
            f"{dtype}) than this {type(self.optimizer).__name__}'s (block_size "
            f"{self.optimizer.block_size}): load it with the optimizer class and block_size it was saved with.")

    def _dequantized_rows(self, whole: dict, spec: ShardSpec, base: str, like: torch.Tensor) -> torch.Tensor:
        """This rank's rows (padded to the shard) of a whole saved moment, dequantized."""
        block = self.optimizer.block_size
        flat = torch.zeros(math.ceil(spec.numel / block) * block, dtype=like.dtype)
        moment = self.optimizer._subclass_zeros(flat, low_bit_states.is_signed(base), block)
        for inner, ratio in low_bit_states.inner_rows(moment).items():
            saved = whole.get(inner)
            if saved is None or not self._matches_whole(saved, spec, ratio, getattr(moment, inner).dtype):
                raise self._other_quantization(spec, base, inner, tuple(saved.shape) if saved is not None else (),
                                               saved.dtype if saved is not None else None)
            getattr(moment, inner).reshape(-1)[:saved.numel()].copy_(saved)
        values = moment.dequantize(like.dtype)[:spec.numel].reshape(spec.saved_shape)
        rows = torch.zeros(like.shape, dtype=like.dtype)
        rows[:spec.valid].copy_(values[spec.offset:spec.offset + spec.valid].reshape(spec.valid, *like.shape[1:]))
        return rows

    @staticmethod
    def _matches_whole(saved: torch.Tensor, spec, ratio: Fraction, dtype: torch.dtype) -> bool:
        return saved.numel() == math.ceil(spec.numel * ratio) and saved.dtype == dtype

    def finish(self) -> None:
        """After ``dcp.load``: quantize what was saved fp32, dequantize what is kept fp32 here."""
        with torch.no_grad():
            for after in self._after:
                after()

