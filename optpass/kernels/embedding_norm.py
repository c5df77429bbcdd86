"""Per-sample squared gradient norms of an Embedding weight, without the [B, vocab, d] tensor.

For sample b with token ids x_b [T] and output gradients g_b [T, d] (the
gradient reaching the embedding's output), the per-sample gradient of the
[vocab, d] weight is E_b = sum_t onehot(x_bt) g_btᵀ: row v holds the sum of
the g_bt of the tokens with id v. After tracing ``vmap(grad(loss))`` the graph
materialises all B of them as one scatter into [B·vocab, d] (DESIGN fact 17's
Embedding counterpart); DP-SGD only needs ||E_b||² and the clipped sum
sum_b c_b E_b. The norm is a Gram ("ghost") form over the sample's tokens:

    ||E_b||²_F = sum_{t, t'} [x_bt == x_bt'] <g_bt, g_bt'>

O(T²·d) FLOPs and T² memory per sample instead of vocab·d memory; exact up to
rounding. Tokens whose id equals ``padding_idx`` (when >= 0) contribute
nothing, as ``nn.Embedding(padding_idx=...)`` gives them no gradient.

API:
  torch.ops.optpass.embedding_per_sample_grad_sq_norm(ids, g, padding_idx=-1) -> [B]
      ids [B, T] integer token ids, g [B, T, d]. Result fp32 for fp32/bf16/fp16
      g (computed in fp32), fp64 for fp64. An opaque custom op with one
      plain-torch body for every device, chunked over the batch (and over rows
      of the [T, T] Gram matrix when one sample does not fit) so at most
      ``per_sample_norm.CPU_CHUNK_BYTES`` of temporaries live at once (the same
      knob as the Linear op). Fake kernel for tracing; autograd (w.r.t. g)
      through ``optpass::embedding_per_sample_grad_sq_norm_backward``.
  embedding_clipped_grad(ids, g, coef, num_embeddings, padding_idx=-1) -> [vocab, d]
      sum_b coef_b E_b as ONE index_add over the B·T tokens (reference for tests;
      the DP pass emits the same sum with the graph's own scatter op).

No atomics and no data-dependent shapes: the result is deterministic.
"""

from __future__ import annotations

import torch
from torch import Tensor

from optpass.kernels import per_sample_norm as _psn

__all__ = ["embedding_per_sample_grad_sq_norm", "embedding_clipped_grad"]


def _check(ids: Tensor, g: Tensor, name: str = "embedding_per_sample_grad_sq_norm") -> None:
    if ids.dim() != 2 or g.dim() != 3 or tuple(ids.shape) != tuple(g.shape[:2]):
        raise ValueError(f"{name}: ids must be [B, T] and g [B, T, d]; got {tuple(ids.shape)} and {tuple(g.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{name}: ids must be an integer tensor, got {ids.dtype}")


def _compute_dtype(g: Tensor) -> torch.dtype:
    return torch.float64 if g.dtype == torch.float64 else torch.float32


def _plan(T: int, D: int, dtype: torch.dtype, per_row: int) -> tuple[int, int]:
    """(samples per chunk, token rows per block) so that one sample's inputs and a block of
    ``rows`` rows of ``per_row`` bytes each, times the samples of a chunk, fit CPU_CHUNK_BYTES."""
    inputs = dtype.itemsize * T * D + 8 * T            # one sample's g in the compute dtype, its ids
    rows = max(1, min(T, (_psn.CPU_CHUNK_BYTES - inputs) // per_row))
    chunk = max(1, _psn.CPU_CHUNK_BYTES // (inputs + per_row * rows))
    return chunk, rows


def _same_token(ids: Tensor, r: int, rows: int, padding_idx: int) -> Tensor:
    """[c, rows, T] bool: token r+i of each sample has the same id as token j (and is not padding)."""
    block = ids[:, r:r + rows, None]
    same = block == ids[:, None, :]
    if padding_idx >= 0:
        same &= block != padding_idx                   # if t matches t' and t is not padding, neither is t'
    return same


def _torch_sq_norm(ids: Tensor, g: Tensor, padding_idx: int) -> Tensor:
    _check(ids, g)
    B, T, D = g.shape
    dtype = _compute_dtype(g)
    out = torch.zeros(B, dtype=dtype, device=g.device)
    if B * T * D == 0:
        return out
    # a block of Gram rows (multiplied in place by) a bool mask of the same shape
    chunk, rows = _plan(T, D, dtype, (dtype.itemsize + 1) * T)
    for s in range(0, B, chunk):
        x, y = ids[s:s + chunk], g[s:s + chunk].to(dtype)
        acc = torch.zeros(x.shape[0], dtype=dtype, device=g.device)
        for r in range(0, T, rows):
            gram = torch.bmm(y[:, r:r + rows], y.transpose(1, 2))      # rows [r, r+rows) of g gᵀ
            acc += gram.mul_(_same_token(x, r, rows, padding_idx)).sum((1, 2))
            del gram
        out[s:s + chunk] = acc
    return out


def _torch_sq_norm_backward(grad: Tensor, ids: Tensor, g: Tensor, padding_idx: int) -> Tensor:
    """d n_b / d g_bt = 2 sum_t' [x_bt == x_bt' != padding] g_bt' (= 2 E_b[x_bt]), scaled by grad_b."""
    _check(ids, g)
    B, T, D = g.shape
    dtype = _compute_dtype(g)
    result = torch.zeros(g.shape, dtype=g.dtype, device=g.device)
    if B * T * D == 0:
        return result
    # a bool mask block, its cast, and two [rows, d] products
    chunk, rows = _plan(T, D, dtype, (dtype.itemsize + 1) * T + 2 * dtype.itemsize * D)
    for s in range(0, B, chunk):
        x, y = ids[s:s + chunk], g[s:s + chunk].to(dtype)
        scale = 2 * grad[s:s + chunk].to(dtype)[:, None, None]
        for r in range(0, T, rows):
            same = _same_token(x, r, rows, padding_idx).to(dtype)
            result[s:s + chunk, r:r + rows] = scale * torch.bmm(same, y)
    return result


@torch.library.custom_op("optpass::embedding_per_sample_grad_sq_norm", mutates_args=())
def embedding_per_sample_grad_sq_norm(ids: Tensor, g: Tensor, padding_idx: int = -1) -> Tensor:
    """[B] ||sum_t onehot(ids_bt) g_btᵀ||²_F per sample (fp32; fp64 for fp64 g). Plain torch, memory-bounded."""
    return _torch_sq_norm(ids, g, padding_idx)


@embedding_per_sample_grad_sq_norm.register_fake
def _embedding_per_sample_grad_sq_norm_fake(ids: Tensor, g: Tensor, padding_idx: int = -1) -> Tensor:
    _check(ids, g)
    return g.new_empty((g.shape[0],), dtype=_compute_dtype(g))


@torch.library.custom_op("optpass::embedding_per_sample_grad_sq_norm_backward", mutates_args=())
def embedding_per_sample_grad_sq_norm_backward(grad: Tensor, ids: Tensor, g: Tensor, padding_idx: int = -1) -> Tensor:
    """Gradient of embedding_per_sample_grad_sq_norm w.r.t. g (plain torch, memory-bounded)."""
    return _torch_sq_norm_backward(grad, ids, g, padding_idx)


@embedding_per_sample_grad_sq_norm_backward.register_fake
def _embedding_per_sample_grad_sq_norm_backward_fake(grad: Tensor, ids: Tensor, g: Tensor,
                                                      padding_idx: int = -1) -> Tensor:
    return torch.empty_like(g)


def _setup_context(ctx, inputs, output):
    ids, g, padding_idx = inputs
    ctx.save_for_backward(ids, g)
    ctx.padding_idx = padding_idx


def _backward(ctx, grad):
    ids, g = ctx.saved_tensors
    return None, torch.ops.optpass.embedding_per_sample_grad_sq_norm_backward(grad, ids, g, ctx.padding_idx), None


embedding_per_sample_grad_sq_norm.register_autograd(_backward, setup_context=_setup_context)


def embedding_clipped_grad(ids: Tensor, g: Tensor, coef: Tensor, num_embeddings: int, padding_idx: int = -1) -> Tensor:
    """sum_b coef_b E_b [num_embeddings, d] as one index_add over the B·T tokens; the padding row stays 0."""
    _check(ids, g, "embedding_clipped_grad")
    B, T, D = g.shape
    if coef.shape != (B,):
        raise ValueError(f"embedding_clipped_grad: coef must be [B] = [{B}], got {tuple(coef.shape)}")
    scaled = (g * coef.to(g.dtype)[:, None, None]).reshape(B * T, D)
    result = g.new_zeros((num_embeddings, D)).index_add_(0, ids.reshape(B * T), scaled)
    if padding_idx >= 0:
        result[padding_idx] = 0
    return result
