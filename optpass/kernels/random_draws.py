"""Several ``randn_like`` draws as one op, in their order, from torch's generator.

With ``fallback_random`` (optpass's Inductor lowering on CPU) every random op is an aten call on
torch's generator, and Inductor chains each one to the one before it (``control_deps``, its
post-grad ``_chain_random_ops_for_ordering``) so that they draw in program order. Those chain links
cost fusions far from the draws (seen in Inductor's generated code, torch 2.13, CPU: DP-SGD on a
2-layer transformer at T = 512 with one ``randn_like`` per parameter, 29 draws: each softmax over
[64, 512, 512] split into two kernels, every LayerNorm recomputed in a kernel of its own, 43 C++
kernels against 39 without the chain). One op that draws them all leaves nothing to chain.

API:
  torch.ops.optpass.randn_like_in_order(likes: list[Tensor]) -> list[Tensor]
      ``[torch.randn_like(t) for t in likes]``: the same calls on the same generator in the same
      order, so the same numbers as the separate draws. Tagged ``nondeterministic_seeded`` (a
      random op to Inductor and to ``reorder_for_locality``, which never moves one); an opaque
      custom op: Inductor calls it as one extern kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["randn_like_in_order"]


@torch.library.custom_op("optpass::randn_like_in_order", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def randn_like_in_order(likes: list[Tensor]) -> list[Tensor]:
    return [torch.randn_like(t) for t in likes]


@randn_like_in_order.register_fake
def _(likes: list[Tensor]) -> list[Tensor]:
    return [torch.empty_like(t) for t in likes]
