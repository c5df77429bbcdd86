"""Per-sample squared gradient norms of an Embedding weight, without the [B, vocab, d] tensor.

For sample b with token ids x_b [T] and output gradients g_b [T, d] (the
gradient reaching the embedding's output), the per-sample gradient of the
[vocab, d] weight is E_b = sum_t onehot(x_bt) g_btᵀ: row v holds the sum of
the g_bt of the tokens with id v. After tracing ``vmap(grad(loss))`` the graph
materialises all B of them as one scatter into [B·vocab, d] (docs/design.md §31);
DP-SGD only needs ||E_b||² and the clipped sum
sum_b c_b E_b. Two exact ways to get ||E_b||² from the tokens alone:

* ghost   — the Gram form over the sample's tokens
                ||E_b||²_F = sum_{t, t'} [x_bt == x_bt'] <g_bt, g_bt'>
            O(T²·d) FLOPs (a GEMM) and T² memory per sample (row-blocked).
* segment — sort the sample's ids, sum the g_bt of each distinct id (index_add),
            square: only E_b's non-zero rows, O(T·d + T log T) work, T·d memory.
* auto    — ghost for T <= GHOST_MAX_TOKENS (128), else segment (measured
            crossover on CPU; ghost's T² grows past segment's sort + scatter).

Both are exact up to rounding. Tokens whose id equals ``padding_idx`` (when >= 0)
contribute nothing, as ``nn.Embedding(padding_idx=...)`` gives them no gradient.

API:
  torch.ops.optpass.embedding_per_sample_grad_sq_norm(ids, g, padding_idx=-1, method="auto") -> [B]
      ids [B, T] integer token ids, g [B, T, d]. Result fp32 for fp32/bf16/fp16
      g (computed in fp32), fp64 for fp64. An opaque custom op with one
      plain-torch body for every device, chunked over the batch (ghost also over
      rows of the [T, T] Gram matrix when one sample does not fit) so at most
      ``per_sample_norm.CPU_CHUNK_BYTES`` of temporaries live at once (the same
      knob as the Linear op; segment's floor is one sample). Fake kernel for
      tracing; autograd (w.r.t. g) through
      ``optpass::embedding_per_sample_grad_sq_norm_backward``.
  choose_embedding_norm_method(T) -> "ghost" | "segment"
  embedding_clipped_grad(ids, g, coef, num_embeddings, padding_idx=-1) -> [vocab, d]
      sum_b coef_b E_b as ONE index_add over the B·T tokens (reference for tests;
      the DP pass emits the same sum with the graph's own scatter op).

No data-dependent shapes. Deterministic on CPU; on CUDA segment's index_add uses
atomics, so its sums may differ between runs in the last bits (ghost does not).
"""

from __future__ import annotations

import torch
from torch import Tensor

from optpass.kernels import per_sample_norm as _psn

__all__ = ["GHOST_MAX_TOKENS", "METHODS", "choose_embedding_norm_method", "embedding_per_sample_grad_sq_norm",
           "embedding_clipped_grad"]

METHODS = ("ghost", "segment", "auto")

# "auto" picks ghost up to this many tokens per sample. Measured on a 2-core CPU (B = 16,
# d = 64..512): ghost is faster up to T ~ 128, segment from T ~ 256 (T = 1024, d = 512:
# ghost 137 ms, segment 29 ms).
GHOST_MAX_TOKENS = 128


def _check(ids: Tensor, g: Tensor, name: str = "embedding_per_sample_grad_sq_norm") -> None:
    if ids.dim() != 2 or g.dim() != 3 or tuple(ids.shape) != tuple(g.shape[:2]):
        raise ValueError(f"{name}: ids must be [B, T] and g [B, T, d]; got {tuple(ids.shape)} and {tuple(g.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{name}: ids must be an integer tensor, got {ids.dtype}")


def _compute_dtype(g: Tensor) -> torch.dtype:
    return torch.float64 if g.dtype == torch.float64 else torch.float32


def _plan(T: int, D: int, dtype: torch.dtype, per_row: int, whole_samples: bool = False) -> tuple[int, int]:
    """(samples per chunk, token rows per block) so that one sample's inputs and a block of
    ``rows`` rows of ``per_row`` bytes each, times the samples of a chunk, fit CPU_CHUNK_BYTES.
    ``whole_samples``: the method cannot split a sample (rows = T; one sample is the floor)."""
    inputs = dtype.itemsize * T * D + 8 * T            # one sample's g in the compute dtype, its ids
    rows = T if whole_samples else max(1, min(T, (_psn.CPU_CHUNK_BYTES - inputs) // per_row))
    chunk = max(1, _psn.CPU_CHUNK_BYTES // (inputs + per_row * rows))
    return chunk, rows


def _same_token(ids: Tensor, r: int, rows: int, padding_idx: int) -> Tensor:
    """[c, rows, T] bool: token r+i of each sample has the same id as token j (and is not padding)."""
    block = ids[:, r:r + rows, None]
    same = block == ids[:, None, :]
    if padding_idx >= 0:
        same &= block != padding_idx                   # if t matches t' and t is not padding, neither is t'
    return same


def _resolve(method: str, T: int) -> str:
    if method not in METHODS:
        raise ValueError(f"embedding_per_sample_grad_sq_norm: method must be one of {METHODS}, got {method!r}")
    if method == "auto":
        return choose_embedding_norm_method(T)
    return method


def choose_embedding_norm_method(T: int) -> str:
    """"ghost" (O(T²·d) GEMM work) for T <= GHOST_MAX_TOKENS, else "segment" (O(T·d) scatter work)."""
    return "ghost" if T <= GHOST_MAX_TOKENS else "segment"


def _ghost_chunk(ids: Tensor, g: Tensor, rows: int, padding_idx: int) -> Tensor:
    acc = torch.zeros(ids.shape[0], dtype=g.dtype, device=g.device)
    for r in range(0, ids.shape[1], rows):
        gram = torch.bmm(g[:, r:r + rows], g.transpose(1, 2))          # rows [r, r+rows) of g gᵀ
        acc += gram.mul_(_same_token(ids, r, rows, padding_idx)).sum((1, 2))
        del gram
    return acc


def _groups(ids: Tensor) -> Tensor:
    """[c, T] -> [c·T] group of each token: tokens of the same sample with the same id share one
    group, groups of different samples never meet (sample s owns groups [s·T, (s+1)·T))."""
    c, T = ids.shape
    sorted_ids, order = ids.sort(dim=1)
    starts = torch.ones(c, T, dtype=torch.long, device=ids.device)
    starts[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    in_order = starts.cumsum(1) - 1 + torch.arange(c, device=ids.device)[:, None] * T
    return torch.empty_like(in_order).scatter_(1, order, in_order).reshape(c * T)


def _segment_sums(ids: Tensor, g: Tensor, padding_idx: int) -> tuple[Tensor, Tensor]:
    """(groups [c·T], sums [c·T, d]): each (sample, id) group's sum of g (padding tokens left out)."""
    c, T, D = g.shape
    if padding_idx >= 0:
        g = g.masked_fill((ids == padding_idx)[..., None], 0)
    groups = _groups(ids)
    return groups, torch.zeros(c * T, D, dtype=g.dtype, device=g.device).index_add_(0, groups, g.reshape(c * T, D))


def _segment_chunk(ids: Tensor, g: Tensor, rows: int, padding_idx: int) -> Tensor:
    _, sums = _segment_sums(ids, g, padding_idx)
    return sums.pow_(2).sum(1).view(ids.shape).sum(1)


def _torch_sq_norm(ids: Tensor, g: Tensor, padding_idx: int, method: str) -> Tensor:
    _check(ids, g)
    B, T, D = g.shape
    method = _resolve(method, T)
    dtype = _compute_dtype(g)
    out = torch.zeros(B, dtype=dtype, device=g.device)
    if B * T * D == 0:
        return out
    if method == "ghost":   # a block of Gram rows, multiplied in place by a bool mask of the same shape
        chunk, rows = _plan(T, D, dtype, (dtype.itemsize + 1) * T)
        chunk_fn = _ghost_chunk
    else:                   # a masked copy of g and the group sums; sort/group index vectors
        chunk, rows = _plan(T, D, dtype, 2 * dtype.itemsize * D + 6 * 8, whole_samples=True)
        chunk_fn = _segment_chunk
    for s in range(0, B, chunk):
        out[s:s + chunk] = chunk_fn(ids[s:s + chunk], g[s:s + chunk].to(dtype), rows, padding_idx)
    return out


def _torch_sq_norm_backward(grad: Tensor, ids: Tensor, g: Tensor, padding_idx: int, method: str) -> Tensor:
    """d n_b / d g_bt = 2 E_b[x_bt] = 2 sum_t' [x_bt == x_bt' != padding] g_bt', scaled by grad_b."""
    _check(ids, g)
    B, T, D = g.shape
    method = _resolve(method, T)
    dtype = _compute_dtype(g)
    result = torch.zeros(g.shape, dtype=g.dtype, device=g.device)
    if B * T * D == 0:
        return result
    if method == "ghost":   # a bool mask block, its cast, and two [rows, d] products
        chunk, rows = _plan(T, D, dtype, (dtype.itemsize + 1) * T + 2 * dtype.itemsize * D)
    else:                   # the segment sums, their gather back to the tokens, its scaled copy
        chunk, rows = _plan(T, D, dtype, 4 * dtype.itemsize * D + 6 * 8, whole_samples=True)
    for s in range(0, B, chunk):
        x, y = ids[s:s + chunk], g[s:s + chunk].to(dtype)
        scale = 2 * grad[s:s + chunk].to(dtype)[:, None, None]
        if method == "segment":
            groups, sums = _segment_sums(x, y, padding_idx)
            row = sums.index_select(0, groups).view(y.shape)
            if padding_idx >= 0:
                row.masked_fill_((x == padding_idx)[..., None], 0)
            result[s:s + chunk] = scale * row
            continue
        for r in range(0, T, rows):
            same = _same_token(x, r, rows, padding_idx).to(dtype)
            result[s:s + chunk, r:r + rows] = scale * torch.bmm(same, y)
    return result


@torch.library.custom_op("optpass::embedding_per_sample_grad_sq_norm", mutates_args=())
def embedding_per_sample_grad_sq_norm(ids: Tensor, g: Tensor, padding_idx: int = -1, method: str = "auto") -> Tensor:
    """[B] ||sum_t onehot(ids_bt) g_btᵀ||²_F per sample (fp32; fp64 for fp64 g). Plain torch, memory-bounded."""
    return _torch_sq_norm(ids, g, padding_idx, method)


@embedding_per_sample_grad_sq_norm.register_fake
def _embedding_per_sample_grad_sq_norm_fake(ids: Tensor, g: Tensor, padding_idx: int = -1,
                                            method: str = "auto") -> Tensor:
    _check(ids, g)
    _resolve(method, ids.shape[1])
    return g.new_empty((g.shape[0],), dtype=_compute_dtype(g))


@torch.library.custom_op("optpass::embedding_per_sample_grad_sq_norm_backward", mutates_args=())
def embedding_per_sample_grad_sq_norm_backward(grad: Tensor, ids: Tensor, g: Tensor, padding_idx: int = -1,
                                               method: str = "auto") -> Tensor:
    """Gradient of embedding_per_sample_grad_sq_norm w.r.t. g (plain torch, memory-bounded)."""
    return _torch_sq_norm_backward(grad, ids, g, padding_idx, method)


@embedding_per_sample_grad_sq_norm_backward.register_fake
def _embedding_per_sample_grad_sq_norm_backward_fake(grad: Tensor, ids: Tensor, g: Tensor,
                                                      padding_idx: int = -1, method: str = "auto") -> Tensor:
    return torch.empty_like(g)


def _setup_context(ctx, inputs, output):
    ids, g, padding_idx, method = inputs
    ctx.save_for_backward(ids, g)
    ctx.padding_idx, ctx.method = padding_idx, method


def _backward(ctx, grad):
    ids, g = ctx.saved_tensors
    grad_g = torch.ops.optpass.embedding_per_sample_grad_sq_norm_backward(grad, ids, g, ctx.padding_idx, ctx.method)
    return None, grad_g, None, None


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
