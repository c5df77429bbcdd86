"""Triton kernels for per-sample squared gradient norms of a Linear layer.

For sample i with input X_i [T, in] and output gradient G_i [T, out], both
kernels compute n_i = ||G_i^T X_i||_F^2 without writing the [B, out, in]
per-sample gradients anywhere:

* ``_direct_sq_norm_kernel`` — one program per (sample, out-tile x in-tile).
  It accumulates the tile of G_i^T X_i over T in BLOCK_T steps with ``tl.dot``
  (fp32 accumulator), squares it in registers and reduces the tile to one
  scalar. Cost ~2·B·T·in·out FLOPs, reads X_i and G_i once per tile.
* ``_ghost_sq_norm_kernel`` — uses n_i = <X_i X_i^T, G_i G_i^T>_F (docs/design.md
  §32). One program per (sample, t-block x s-block) tile of the [T, T] Gram
  matrices: both Gram tiles are built in registers with ``tl.dot`` over the in
  and out dimensions, multiplied elementwise and reduced. The Grams are
  symmetric, so only tiles with s-block >= t-block do work and off-diagonal
  tiles count twice. Cost ~2·B·T²·(in+out) FLOPs (half that with the symmetry)
  and no T x T buffer at all.

Which is cheaper is the cost model of docs/design.md §32: ghost when
2·T² <= in·out (``choose_norm_method`` in per_sample_norm.py).

Why no atomics: every program writes its own slot of a [B, n_tiles] fp32
partials buffer and the host sums it with ``torch.sum``. The result is
deterministic (no float atomics whose order varies run to run) and there is no
Split-K barrier — the seed's fused kernel lost to plain materialisation at long
sequences partly because of its atomic_add + spin-wait reduction
(docs/design.md §33). The partials buffer is
tiny (B x n_tiles floats) next to the inputs.

Inputs are fp32, bf16 or fp16; 16-bit tiles go to ``tl.dot`` as they are
(exact products, fp32 accumulation), fp32 tiles use input_precision="ieee" so
results are not rounded to TF32. Everything else is cast to fp32 first.

These kernels run on whatever device the tensors live on: on CUDA normally, on
CPU tensors under ``TRITON_INTERPRET=1`` (set before triton is imported; docs/design.md
§29) — that is how the tests check them on machines without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DOT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _direct_sq_norm_kernel(
    x_ptr, g_ptr, partial_ptr,
    T, IN, OUT,
    stride_xb, stride_xt, stride_xi,
    stride_gb, stride_gt, stride_go,
    n_tiles_in, n_tiles,
    BLOCK_T: tl.constexpr, BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    # 1-D grid, sample-major: one sample's tiles run next to each other and share its X, G in L2.
    # (Not a 2-D grid: CUDA caps grid axes 1 and 2 at 65535.)
    pid = tl.program_id(0).to(tl.int64)  # int64: b * stride overflows int32 on large inputs
    b = pid // n_tiles
    tile = pid % n_tiles
    offs_o = (tile // n_tiles_in) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    offs_i = (tile % n_tiles_in) * BLOCK_IN + tl.arange(0, BLOCK_IN)
    offs_t = tl.arange(0, BLOCK_T)
    x_base = x_ptr + b * stride_xb
    g_base = g_ptr + b * stride_gb
    acc = tl.zeros((BLOCK_OUT, BLOCK_IN), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + offs_t
        # G_i^T tile [BLOCK_OUT, BLOCK_T], loaded transposed; masked entries are 0 and add nothing.
        g_tile = tl.load(g_base + offs_o[:, None] * stride_go + t[None, :] * stride_gt,
                         mask=(offs_o[:, None] < OUT) & (t[None, :] < T), other=0.0)
        x_tile = tl.load(x_base + t[:, None] * stride_xt + offs_i[None, :] * stride_xi,
                         mask=(t[:, None] < T) & (offs_i[None, :] < IN), other=0.0)
        if UPCAST:
            g_tile, x_tile = g_tile.to(tl.float32), x_tile.to(tl.float32)
        acc = tl.dot(g_tile, x_tile, acc, input_precision=INPUT_PRECISION)
    tile_sq = tl.sum(tl.sum(acc * acc, axis=1), axis=0)
    tl.store(partial_ptr + b * n_tiles + tile, tile_sq)


@triton.jit
def _ghost_sq_norm_kernel(
    x_ptr, g_ptr, partial_ptr,
    T, IN, OUT,
    stride_xb, stride_xt, stride_xi,
    stride_gb, stride_gt, stride_go,
    n_tiles_t,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // (n_tiles_t * n_tiles_t)
    tile = pid % (n_tiles_t * n_tiles_t)
    pid_t = tile // n_tiles_t
    pid_s = tile % n_tiles_t
    # Both Grams are symmetric: tiles below the diagonal run zero iterations and
    # store 0; tiles above it stand for their mirror image too (weight 2).
    upper = (pid_s >= pid_t).to(tl.int32)
    weight = tl.where(pid_s > pid_t, 2.0, 1.0)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_s = pid_s * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    x_base = x_ptr + b * stride_xb
    g_base = g_ptr + b * stride_gb

    gram_x = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)  # (X X^T)[t-block, s-block]
    for k0 in range(0, IN * upper, BLOCK_K):
        k = k0 + offs_k
        x_t = tl.load(x_base + offs_t[:, None] * stride_xt + k[None, :] * stride_xi,
                      mask=(offs_t[:, None] < T) & (k[None, :] < IN), other=0.0)
        x_s = tl.load(x_base + k[:, None] * stride_xi + offs_s[None, :] * stride_xt,
                      mask=(k[:, None] < IN) & (offs_s[None, :] < T), other=0.0)
        if UPCAST:
            x_t, x_s = x_t.to(tl.float32), x_s.to(tl.float32)
        gram_x = tl.dot(x_t, x_s, gram_x, input_precision=INPUT_PRECISION)

    gram_g = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)  # (G G^T)[t-block, s-block]
    for k0 in range(0, OUT * upper, BLOCK_K):
        k = k0 + offs_k
        g_t = tl.load(g_base + offs_t[:, None] * stride_gt + k[None, :] * stride_go,
                      mask=(offs_t[:, None] < T) & (k[None, :] < OUT), other=0.0)
        g_s = tl.load(g_base + k[:, None] * stride_go + offs_s[None, :] * stride_gt,
                      mask=(k[:, None] < OUT) & (offs_s[None, :] < T), other=0.0)
        if UPCAST:
            g_t, g_s = g_t.to(tl.float32), g_s.to(tl.float32)
        gram_g = tl.dot(g_t, g_s, gram_g, input_precision=INPUT_PRECISION)

    tile_sum = tl.sum(tl.sum(gram_x * gram_g, axis=1), axis=0)
    tl.store(partial_ptr + b * (n_tiles_t * n_tiles_t) + tile, tile_sum * weight)


def _upcast_dot(x: torch.Tensor) -> bool:
    # triton 3.9's interpreter multiplies bf16 tiles as their raw uint16 bit patterns in tl.dot
    # (garbage); under it, bf16 tiles are widened to fp32 first, which is exact. Compiled
    # kernels feed bf16 to tl.dot unchanged (tensor cores, fp32 accumulation).
    return x.dtype == torch.bfloat16 and not isinstance(_direct_sq_norm_kernel, triton.runtime.JITFunction)


def _block(dim: int, preferred: int) -> int:
    # tl.dot needs every block dimension >= 16 (16-bit K on NVIDIA); small dims get one small block.
    return max(16, min(preferred, triton.next_power_of_2(max(dim, 1))))


def _prepare(x: torch.Tensor, g: torch.Tensor):
    if x.dim() != g.dim() or x.dim() not in (2, 3):
        raise ValueError("x and g must both be [B, in]/[B, out] or [B, T, in]/[B, T, out]; "
                         f"got {tuple(x.shape)} and {tuple(g.shape)}")
    if x.dim() == 2:
        x, g = x.unsqueeze(1), g.unsqueeze(1)
    if x.shape[:2] != g.shape[:2]:
        raise ValueError(f"x {tuple(x.shape)} and g {tuple(g.shape)} disagree on batch or sequence length")
    if x.device != g.device:
        raise ValueError(f"x is on {x.device} and g on {g.device}")
    if x.dtype != g.dtype or x.dtype not in _DOT_DTYPES:
        x, g = x.float(), g.float()
    return x, g


def direct_sq_norm(x: torch.Tensor, g: torch.Tensor, *, block_t: int | None = None, block_out: int | None = None,
                   block_in: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """fp32 [B]: ||G_i^T X_i||_F^2 per sample, tiled over (out, in), reduced over T in registers."""
    x, g = _prepare(x, g)
    B, T, IN = x.shape
    OUT = g.shape[2]
    if B == 0 or T == 0 or IN == 0 or OUT == 0:
        return torch.zeros(B, dtype=torch.float32, device=x.device)
    block_t = block_t or _block(T, 32)
    block_out = block_out or _block(OUT, 64)
    block_in = block_in or _block(IN, 64)
    n_tiles_in = triton.cdiv(IN, block_in)
    n_tiles = triton.cdiv(OUT, block_out) * n_tiles_in
    partials = torch.empty((B, n_tiles), dtype=torch.float32, device=x.device)
    _direct_sq_norm_kernel[(B * n_tiles,)](
        x, g, partials, T, IN, OUT,
        x.stride(0), x.stride(1), x.stride(2), g.stride(0), g.stride(1), g.stride(2),
        n_tiles_in, n_tiles,
        BLOCK_T=block_t, BLOCK_OUT=block_out, BLOCK_IN=block_in, INPUT_PRECISION="ieee",
        UPCAST=_upcast_dot(x), num_warps=num_warps,
    )
    return partials.sum(dim=1)


def ghost_sq_norm(x: torch.Tensor, g: torch.Tensor, *, block_t: int | None = None, block_k: int | None = None,
                  num_warps: int = 4) -> torch.Tensor:
    """fp32 [B]: <X_i X_i^T, G_i G_i^T>_F per sample, tiled over the [T, T] Gram matrices."""
    x, g = _prepare(x, g)
    B, T, IN = x.shape
    OUT = g.shape[2]
    if B == 0 or T == 0 or IN == 0 or OUT == 0:
        return torch.zeros(B, dtype=torch.float32, device=x.device)
    block_t = block_t or _block(T, 64)
    block_k = block_k or _block(max(IN, OUT), 32)
    n_tiles_t = triton.cdiv(T, block_t)
    partials = torch.empty((B, n_tiles_t * n_tiles_t), dtype=torch.float32, device=x.device)
    _ghost_sq_norm_kernel[(B * n_tiles_t * n_tiles_t,)](
        x, g, partials, T, IN, OUT,
        x.stride(0), x.stride(1), x.stride(2), g.stride(0), g.stride(1), g.stride(2),
        n_tiles_t,
        BLOCK_T=block_t, BLOCK_K=block_k, INPUT_PRECISION="ieee",
        UPCAST=_upcast_dot(x), num_warps=num_warps,
    )
    return partials.sum(dim=1)
