"""Ops that run after given values are made: an embedding gradient's row chunks one after another.

An embedding's gradient is a scatter into a zero-filled ``[vocab, d]`` tensor. Made and applied in
row chunks (``optpass/passes/_row_chunks.py``), chunk ``a:b`` is a scatter into ``[b - a, d]``
zeros followed by the update of rows ``a:b``. The zero fills read nothing, so Inductor's C++
backend runs every chunk's fill, scatter and update as one group of kernels with every chunk's
buffer allocated at its start (torch 2.13: the same peak as the whole gradient; docs/design.md
§47). Allocated by an op that reads the previous chunk's row write, chunk ``k``'s zeros cannot
exist before chunk ``k - 1`` is written, and an extern call separates the chunks' kernels. A tied
weight's chunk scatters into its GEMM's rows instead of zeros; the GEMMs read nothing of the
previous chunk either, and Inductor fused every chunk's scatter and update into one kernel with
every GEMM's rows computed before it: the chunk's token indices, copied after the previous
chunk's write, order those chunks the same way.

API:
  torch.ops.optpass.zeros_after(size: list[int], dtype, device, after: list[Tensor]) -> Tensor
      ``torch.zeros(size, dtype=dtype, device=device)``; ``after`` is only read (ordering).
  torch.ops.optpass.clone_after(value: Tensor, after: list[Tensor]) -> Tensor
      ``value.clone()`` (meant for small values: a chunk's token indices); ``after`` is only read.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["clone_after", "zeros_after"]


@torch.library.custom_op("optpass::zeros_after", mutates_args=())
def zeros_after(size: list[int], dtype: torch.dtype, device: torch.device, after: list[Tensor]) -> Tensor:
    return torch.zeros(size, dtype=dtype, device=device)


@zeros_after.register_fake
def _(size: list[int], dtype: torch.dtype, device: torch.device, after: list[Tensor]) -> Tensor:
    return torch.empty(size, dtype=dtype, device=device)


@torch.library.custom_op("optpass::clone_after", mutates_args=())
def clone_after(value: Tensor, after: list[Tensor]) -> Tensor:
    return value.clone()


@clone_after.register_fake
def _(value: Tensor, after: list[Tensor]) -> Tensor:
    return torch.empty_like(value)
