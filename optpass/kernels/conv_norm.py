"""Per-sample squared norms of a convolution's weight gradient, a bounded chunk of samples at a time.

vmap batches a convolution's weight gradient as ONE grouped ``convolution_backward`` over the
samples (groups = B·groups, sample b owning channel blocks b): [B·out, in/groups, *k], every
sample's gradient at once. For sample b with input x_b [N, in, *S] and output gradient
g_b [N, out, *S'] (N = the rows the model sees per sample, 1 for ``x.unsqueeze(0)``) the weight
gradient of group j is a sum over the N·L output positions of outer products g_tᵀ u_t, with u_t the
unfolded input patch [in/groups · prod(k)] (Opacus's ``grad_sample/conv.py``). So its squared
norm has a Linear's two forms (docs/design.md §32), over T = N·L positions:

* direct — the chunk's per-sample gradients, by the same grouped ``convolution_backward``, squared
  and summed: ~2·B·T·(in/groups)·prod(k)·out FLOPs, as the traced graph spends.
* ghost  — <U Uᵀ, G Gᵀ> per sample and group from the unfolded patches U [T, in/groups·prod(k)]
  and the output gradients G [T, out/groups], by ``per_sample_grad_sq_norm(.., "ghost")``
  (Triton on CUDA): Conv1d and Conv2d (``unfold`` is 2-D; a Conv1d is one with a height of 1).
* auto   — ``choose_norm_method(T, in/groups·prod(k), out/groups)``: the Linear rule.

API:
  torch.ops.optpass.conv_per_sample_grad_sq_norm(x, g, kernel_size, stride, padding, dilation,
                                                 groups, method="auto") -> [B]
      x [B, N, in, *S], g [B, N, out, *S'] (sample-major); fp32 for fp32/bf16/fp16 inputs
      (computed in fp32), fp64 for fp64. At most ``CHUNK_BYTES`` of per-chunk temporaries
      (the chunk's inputs in the compute dtype, its per-sample gradients or unfolded patches) live
      at once; one sample is the floor. An opaque custom op: Inductor sees one node.
  conv_norm_method(positions, in_per_group, out_per_group, spatial_dims, method) -> "direct" | "ghost"
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from optpass.kernels.per_sample_norm import METHODS, choose_norm_method, per_sample_grad_sq_norm

__all__ = ["CHUNK_BYTES", "conv_norm_method", "conv_per_sample_grad_sq_norm"]

# At most this many bytes of a chunk's temporaries live at once. Tests shrink it.
CHUNK_BYTES = 256 * 2**20


def conv_norm_method(positions: int, in_per_group: int, out_per_group: int, spatial_dims: int,
                     method: str = "auto") -> str:
    """The norm's form: ``method`` itself, or for "auto" the Linear rule over the output positions
    (ghost when 2·T² <= in·out); direct for a Conv3d (no unfold)."""
    if method not in METHODS:
        raise ValueError(f"conv_per_sample_grad_sq_norm: method must be one of {METHODS}, got {method!r}")
    if spatial_dims > 2:
        return "direct"
    return choose_norm_method(positions, in_per_group, out_per_group) if method == "auto" else method


def _direct(x: Tensor, g: Tensor, kernel_size, stride, padding, dilation, groups) -> Tensor:
    """[c] squared norms: the chunk's per-sample gradients as vmap computes them, squared and summed."""
    c, n, cin = x.shape[:3]
    cout = g.shape[2]
    batched_x = x.transpose(0, 1).reshape(n, c * cin, *x.shape[3:])
    batched_g = g.transpose(0, 1).reshape(n, c * cout, *g.shape[3:])
    weight = x.new_empty(()).expand(c * cout, cin // groups, *kernel_size)
    # cuDNN computes convolutions in TF32 by default (torch.backends.cudnn.allow_tf32): 1e-4 off on
    # CUDA. The norms decide which samples are clipped and equal Opacus's (unfold + matmul, fp32).
    tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False
    try:
        per_sample = torch.ops.aten.convolution_backward(
            batched_g, batched_x, weight, None, stride, padding, dilation, False, [0] * len(stride),
            c * groups, [False, True, False])[1]
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    return per_sample.reshape(c, -1).pow(2).sum(1)


def _ghost(x: Tensor, g: Tensor, kernel_size, stride, padding, dilation, groups) -> Tensor:
    """[c] squared norms in Gram form over the unfolded patches, per sample and group."""
    c, n, cin = x.shape[:3]
    cout = g.shape[2]
    if x.dim() == 4:                                   # Conv1d as a Conv2d of height 1
        x, g = x.unsqueeze(3), g.unsqueeze(3)
        kernel_size, stride, padding, dilation = ((1, *a) for a in (kernel_size, stride, padding, dilation))
        padding = (0, padding[1])
    patches = F.unfold(x.reshape(c * n, cin, *x.shape[3:]), kernel_size, dilation, padding, stride)
    positions = patches.shape[2]
    patches = patches.view(c, n, groups, -1, positions).permute(0, 2, 1, 4, 3).reshape(c * groups, n * positions, -1)
    grads = g.reshape(c, n, groups, cout // groups, positions).permute(0, 2, 1, 4, 3)
    grads = grads.reshape(c * groups, n * positions, cout // groups)
    return per_sample_grad_sq_norm(patches, grads, "ghost").view(c, groups).sum(1)


def _chunk_samples(x: Tensor, g: Tensor, kernel_size, groups, method: str, dtype: torch.dtype) -> int:
    """Samples per chunk so that its temporaries stay within CHUNK_BYTES (at least one)."""
    n, cin = x.shape[1:3]
    cout, positions = g.shape[2], math.prod(g.shape[3:])
    inputs = x[0].numel() + g[0].numel()
    if method == "direct":
        temporaries = cout * (cin // groups) * math.prod(kernel_size)
    else:                                              # patches and grads rearranged, Grams' row blocks
        temporaries = n * positions * (cin * math.prod(kernel_size) + cout)
    return max(1, CHUNK_BYTES // (dtype.itemsize * (2 * inputs + 2 * temporaries)))


@torch.library.custom_op("optpass::conv_per_sample_grad_sq_norm", mutates_args=())
def conv_per_sample_grad_sq_norm(x: Tensor, g: Tensor, kernel_size: list[int], stride: list[int],
                                 padding: list[int], dilation: list[int], groups: int,
                                 method: str = "auto") -> Tensor:
    """[B] squared Frobenius norms of each sample's convolution weight gradient.

    Args:
        x: the convolution's input, [B, N, in, *S].
        g: its output gradient, [B, N, out, *S'].
        kernel_size, stride, padding, dilation, groups: the convolution's.
        method: "direct", "ghost" or "auto" (``conv_norm_method``).
    """
    batch, n, cin = x.shape[:3]
    cout = g.shape[2]
    positions = n * math.prod(g.shape[3:])
    chosen = conv_norm_method(positions, cin // groups * math.prod(kernel_size), cout // groups,
                              len(kernel_size), method)
    dtype = torch.float64 if torch.float64 in (x.dtype, g.dtype) else torch.float32
    out = torch.zeros(batch, dtype=dtype, device=x.device)
    chunk = _chunk_samples(x, g, kernel_size, groups, chosen, dtype)
    norm = _direct if chosen == "direct" else _ghost
    for s in range(0, batch, chunk):
        out[s:s + chunk] = norm(x[s:s + chunk].to(dtype), g[s:s + chunk].to(dtype),
                                kernel_size, stride, padding, dilation, groups)
    return out


@conv_per_sample_grad_sq_norm.register_fake
def _conv_per_sample_grad_sq_norm_fake(x, g, kernel_size, stride, padding, dilation, groups, method="auto"):
    if method not in METHODS:
        raise ValueError(f"conv_per_sample_grad_sq_norm: method must be one of {METHODS}, got {method!r}")
    dtype = torch.float64 if torch.float64 in (x.dtype, g.dtype) else torch.float32
    return x.new_empty((x.shape[0],), dtype=dtype)
