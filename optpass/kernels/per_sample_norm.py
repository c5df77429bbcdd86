"""Per-sample squared gradient norms of a Linear layer, without the [B, out, in] tensor.

For sample i with input X_i [T, in] and output gradient G_i [T, out] the
per-sample weight gradient is G_i^T X_i [out, in]. DP-SGD only needs its
squared Frobenius norm n_i and, later, the clipped sum sum_i c_i G_i^T X_i.
After tracing ``vmap(grad(loss))`` the graph materialises all B gradients with
a ``bmm`` (docs/design.md §31); the DP pass swaps that for this op and one GEMM.

Two ways to get n_i (docs/design.md §32):

* direct — n_i = sum over (o, j) of (G_i^T X_i)[o, j]^2, computed tile by tile.
  ~2·B·T·in·out FLOPs; memory: one tile (Triton) or a bounded chunk (CPU).
* ghost  — n_i = <X_i X_i^T, G_i G_i^T>_F, two [T, T] Gram matrices.
  ~2·B·T²·(in+out) FLOPs and B·T² memory if materialised (the Triton kernel
  keeps Gram tiles in registers, the CPU path bounds its chunk).
* auto   — ghost when 2·T² <= in·out, else direct (``choose_norm_method``; the
  rule fastDP and private-transformers use). Short sequences on wide layers
  go ghost, long sequences go direct.

API:
  torch.ops.optpass.per_sample_grad_sq_norm(x, g, method="auto") -> [B]
      x [B, T, in] / [B, in], g [B, T, out] / [B, out] (2-D means T = 1).
      Result fp32 for fp32/bf16/fp16 inputs (computed in fp32); fp64 inputs
      give fp64 (computed in fp64, with torch also on CUDA). An opaque custom
      op: Inductor sees one node.
      - CPU (and any non-CUDA device): plain torch, chunked over the batch so
        at most ``CPU_CHUNK_BYTES`` of temporaries live at once; when one
        sample does not fit, it runs in row blocks (of G^T X for direct, of
        the Grams for ghost). The floor is one sample's inputs in fp32.
      - CUDA: the Triton kernels of ``_triton_per_sample_norm.py``.
      - fake kernel for tracing; autograd through
        ``optpass::per_sample_grad_sq_norm_backward`` (plain torch, chunked
        over the batch only: a chunk holds one sample's [out, in] or 2 [T, T]).
  choose_norm_method(T, in_features, out_features) -> "direct" | "ghost"
  per_sample_clipped_weight_grad(x, g, coef) -> [out, in]  (book-keeping: one GEMM)
  triton_per_sample_grad_sq_norm(x, g, method) — the Triton kernels on the
      tensors' own device (CUDA, or CPU under TRITON_INTERPRET=1).

Why a ``custom_op`` whose CUDA kernel calls Triton, and not a ``triton_op``
with a CPU kernel: under torch.compile a ``triton_op``'s Triton body is traced
even for CPU tensors and fails with "0 active drivers" (docs/design.md §30). The
opaque op dispatches by device at run time, so the CPU path never touches
Triton and importing this module does not import triton.

No atomics anywhere: the Triton kernels write per-(sample, tile) partials that
are summed with torch (deterministic; see the Triton module's docstring), and
the CPU path reduces chunk by chunk.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "CPU_CHUNK_BYTES", "METHODS", "choose_norm_method", "per_sample_grad_sq_norm",
    "per_sample_clipped_weight_grad", "triton_per_sample_grad_sq_norm",
]

# At most this many bytes of temporaries (fp32/fp64 copies of the inputs, products,
# Gram matrices) live at once in the plain-torch path. Tests shrink it.
CPU_CHUNK_BYTES = 64 * 2**20

METHODS = ("direct", "ghost", "auto")


def _compute_dtype(x: Tensor, g: Tensor) -> torch.dtype:
    # fp32 for fp32/bf16/fp16 inputs; fp64 inputs keep fp64 (parity tests run in fp64).
    return torch.float64 if torch.float64 in (x.dtype, g.dtype) else torch.float32


def choose_norm_method(T: int, in_features: int, out_features: int) -> str:
    """"ghost" iff 2·T² <= in·out (ghost's T² Gram work beats direct's in·out tile work), else "direct"."""
    return "ghost" if 2 * T * T <= in_features * out_features else "direct"


def _as_3d(x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    if x.dim() != g.dim() or x.dim() not in (2, 3):
        raise ValueError(
            f"per_sample_grad_sq_norm: x and g must both be [B, in]/[B, out] or [B, T, in]/[B, T, out]; "
            f"got {tuple(x.shape)} and {tuple(g.shape)}")
    if x.shape[:-1] != g.shape[:-1]:
        raise ValueError(f"per_sample_grad_sq_norm: x {tuple(x.shape)} and g {tuple(g.shape)} "
                         "disagree on batch or sequence length")
    if x.dim() == 2:
        return x.unsqueeze(1), g.unsqueeze(1)
    return x, g


def _resolve(method: str, T: int, in_features: int, out_features: int) -> str:
    if method not in METHODS:
        raise ValueError(f"per_sample_grad_sq_norm: method must be one of {METHODS}, got {method!r}")
    return choose_norm_method(T, in_features, out_features) if method == "auto" else method


def _budget_rows(total_rows: int, bytes_per_row: int, fixed_bytes: int) -> int:
    """How many rows of a per-sample temporary fit next to ``fixed_bytes`` (at least 1)."""
    return max(1, min(total_rows, (CPU_CHUNK_BYTES - fixed_bytes) // max(bytes_per_row, 1)))


# ----------------------------------------------------------------------------
# plain-torch path (CPU and any device without Triton): fp32 (fp64), memory-bounded
# ----------------------------------------------------------------------------

def _direct_chunk(x: Tensor, g: Tensor, rows: int, dtype: torch.dtype) -> Tensor:
    x, g = x.to(dtype), g.to(dtype)
    acc = torch.zeros(x.shape[0], dtype=dtype, device=x.device)
    for r in range(0, g.shape[2], rows):
        # [c, rows, in] block of G^T X, squared and reduced; nothing of it outlives the line.
        acc += torch.bmm(g[:, :, r:r + rows].transpose(1, 2), x).flatten(1).pow(2).sum(1)
    return acc


def _ghost_chunk(x: Tensor, g: Tensor, rows: int, dtype: torch.dtype) -> Tensor:
    x, g = x.to(dtype), g.to(dtype)
    acc = torch.zeros(x.shape[0], dtype=dtype, device=x.device)
    for r in range(0, x.shape[1], rows):
        gram_x = torch.bmm(x[:, r:r + rows], x.transpose(1, 2))  # rows [r, r+rows) of X X^T
        acc += (gram_x * torch.bmm(g[:, r:r + rows], g.transpose(1, 2))).sum((1, 2))
        del gram_x  # or it would live next to the next block's
    return acc


def _torch_sq_norm(x: Tensor, g: Tensor, method: str) -> Tensor:
    x3, g3 = _as_3d(x, g)
    B, T, IN = x3.shape
    OUT = g3.shape[2]
    method = _resolve(method, T, IN, OUT)
    dtype = _compute_dtype(x, g)
    out = torch.zeros(B, dtype=dtype, device=x.device)
    if out.numel() == 0 or T * IN * OUT == 0:
        return out
    size = dtype.itemsize
    inputs = size * T * (IN + OUT)  # one sample's inputs in the compute dtype
    if method == "direct":
        # a block of G^T X and its square: 2 x rows x in elements per sample
        rows = _budget_rows(OUT, 2 * size * IN, inputs)
        per_sample, chunk_fn = inputs + 2 * size * rows * IN, _direct_chunk
    else:
        # a row block of each Gram matrix and their product: 3 x rows x T elements per sample
        rows = _budget_rows(T, 3 * size * T, inputs)
        per_sample, chunk_fn = inputs + 3 * size * rows * T, _ghost_chunk
    # Only full samples are chunked when one sample fits; otherwise one sample at a
    # time in row blocks. One sample's own inputs are the floor of the bound.
    chunk = max(1, CPU_CHUNK_BYTES // per_sample)
    for s in range(0, B, chunk):
        out[s:s + chunk] = chunk_fn(x3[s:s + chunk], g3[s:s + chunk], rows, dtype)
    return out


def _backward_chunk(grad: Tensor, x: Tensor, g: Tensor, method: str) -> tuple[Tensor, Tensor]:
    dtype = _compute_dtype(x, g)
    x, g = x.to(dtype), g.to(dtype)
    scale = 2 * grad.to(dtype)[:, None, None]
    if method == "direct":
        m = torch.bmm(g.transpose(1, 2), x)  # [c, out, in]
        return scale * torch.bmm(g, m), scale * torch.bmm(x, m.transpose(1, 2))
    return scale * torch.bmm(torch.bmm(g, g.transpose(1, 2)), x), scale * torch.bmm(torch.bmm(x, x.transpose(1, 2)), g)


def _torch_sq_norm_backward(grad: Tensor, x: Tensor, g: Tensor, method: str) -> tuple[Tensor, Tensor]:
    """dn_i/dX_i = 2 G_i M_i and dn_i/dG_i = 2 X_i M_i^T with M_i = G_i^T X_i,
    or in Gram form 2 (G_i G_i^T) X_i and 2 (X_i X_i^T) G_i; scaled by grad_i."""
    x3, g3 = _as_3d(x, g)
    B, T, IN = x3.shape
    OUT = g3.shape[2]
    method = _resolve(method, T, IN, OUT)
    grad_x = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    grad_g = torch.empty(g3.shape, dtype=g.dtype, device=g.device)
    size = _compute_dtype(x, g).itemsize
    inputs = 2 * size * T * (IN + OUT)  # inputs and results in the compute dtype
    per_sample = inputs + size * (OUT * IN if method == "direct" else 2 * T * T)
    chunk = max(1, CPU_CHUNK_BYTES // max(per_sample, 1))
    for s in range(0, B, chunk):
        grad_x[s:s + chunk], grad_g[s:s + chunk] = _backward_chunk(grad[s:s + chunk], x3[s:s + chunk], g3[s:s + chunk], method)
    return grad_x.view(x.shape), grad_g.view(g.shape)


# ----------------------------------------------------------------------------
# the custom ops
# ----------------------------------------------------------------------------

@torch.library.custom_op("optpass::per_sample_grad_sq_norm", mutates_args=())
def per_sample_grad_sq_norm(x: Tensor, g: Tensor, method: str = "auto") -> Tensor:
    """[B] ||G_i^T X_i||_F^2 per sample (fp32; fp64 for fp64 inputs).

    This body is the kernel for CPU and every non-CUDA device: plain torch, memory-bounded.
    """
    return _torch_sq_norm(x, g, method)


@per_sample_grad_sq_norm.register_kernel("cuda")
def _per_sample_grad_sq_norm_cuda(x: Tensor, g: Tensor, method: str = "auto") -> Tensor:
    if _compute_dtype(x, g) == torch.float64:
        return _torch_sq_norm(x, g, method)  # the Triton kernels compute in fp32; fp64 asks for more
    return triton_per_sample_grad_sq_norm(x, g, method)


@per_sample_grad_sq_norm.register_fake
def _per_sample_grad_sq_norm_fake(x: Tensor, g: Tensor, method: str = "auto") -> Tensor:
    x3, _ = _as_3d(x, g)
    if method not in METHODS:
        raise ValueError(f"per_sample_grad_sq_norm: method must be one of {METHODS}, got {method!r}")
    return x.new_empty((x3.shape[0],), dtype=_compute_dtype(x, g))


@torch.library.custom_op("optpass::per_sample_grad_sq_norm_backward", mutates_args=())
def per_sample_grad_sq_norm_backward(grad: Tensor, x: Tensor, g: Tensor, method: str = "auto") -> tuple[Tensor, Tensor]:
    """Gradients of per_sample_grad_sq_norm w.r.t. x and g (plain torch on every device, batch-chunked)."""
    return _torch_sq_norm_backward(grad, x, g, method)


@per_sample_grad_sq_norm_backward.register_fake
def _per_sample_grad_sq_norm_backward_fake(grad: Tensor, x: Tensor, g: Tensor, method: str = "auto") -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(g)


def _setup_context(ctx, inputs, output):
    x, g, method = inputs
    ctx.save_for_backward(x, g)
    ctx.method = method


def _backward(ctx, grad):
    x, g = ctx.saved_tensors
    grad_x, grad_g = torch.ops.optpass.per_sample_grad_sq_norm_backward(grad, x, g, ctx.method)
    return grad_x, grad_g, None


per_sample_grad_sq_norm.register_autograd(_backward, setup_context=_setup_context)


def triton_per_sample_grad_sq_norm(x: Tensor, g: Tensor, method: str = "auto", **blocks) -> Tensor:
    """The Triton kernels on whatever device x and g live on (CUDA; CPU only under TRITON_INTERPRET=1).

    ``blocks`` are passed to the kernel wrapper (block_t/block_out/block_in for direct,
    block_t/block_k for ghost, num_warps) — tests use them to force several tiles.
    """
    from optpass.kernels import _triton_per_sample_norm as kernels  # triton loads only when asked for

    x3, g3 = _as_3d(x, g)
    method = _resolve(method, x3.shape[1], x3.shape[2], g3.shape[2])
    if method == "direct":
        return kernels.direct_sq_norm(x3, g3, **blocks)
    return kernels.ghost_sq_norm(x3, g3, **blocks)


def per_sample_clipped_weight_grad(x: Tensor, g: Tensor, coef: Tensor) -> Tensor:
    """sum_i coef_i · G_i^T X_i [out, in] as ONE GEMM over the B·T rows (book-keeping, docs/design.md §32).

    coef [B] (e.g. min(1, C / ||grad_i||)) scales each sample's rows of G; the
    result has g's dtype (coef is cast to it), like the weight gradient it replaces.
    """
    x3, g3 = _as_3d(x, g)
    B, T, IN = x3.shape
    if coef.shape != (B,):
        raise ValueError(f"per_sample_clipped_weight_grad: coef must be [B] = [{B}], got {tuple(coef.shape)}")
    scaled = g3 * coef.to(g3.dtype)[:, None, None]
    return scaled.reshape(B * T, g3.shape[2]).t() @ x3.reshape(B * T, IN)
