"""What a pass that splices updates shares for a large parameter: its gradient made and applied in
row chunks, so no more than one chunk of that gradient is ever alive.

A Linear weight's gradient is one GEMM, ``mm(permute(dY), X)`` (``[out, in]`` from ``[tokens, out]``
and ``[tokens, in]``), and an elementwise update (SGD, Adam(W), ...: docs/design.md §28) of rows
``a:b`` reads only rows ``a:b`` of the parameter, its gradient and its state. So the update can run
chunk by chunk: rows ``a:b`` of the gradient are ``mm(permute(dY)[a:b], X)``, the update's
parameter-shaped values are computed on ``p[a:b]``, ``state[a:b]`` and that chunk, and written back
with ``copy_(slice(p, 0, a, b), new_rows)``, which Inductor stores into the parameter's rows (a
functional ``slice_scatter`` would not be made in place: docs/design.md §47). The update's scalars
(the ``step`` counter and the bias corrections made from it) are computed once, and ``step`` is
written once, after the last chunk. The largest gradient of an untied language model, its output
head's ``[vocab, d]``, made at the start of backward while every activation is alive, then costs
one chunk there instead of the whole (docs/design.md §46).

An embedding's gradient (Inductor's decomposition: a masked scatter-add of the looked-up rows'
gradients into zeros, or into a tied head's GEMM after ``accumulate_gradient_in_place``) has rows
just as separable: rows ``a:b`` are the tokens whose index falls in ``a:b`` scattered into
``[b - a, d]`` zeros (or the GEMM's rows ``a:b``), written in place (``index_put_``). Its zero
rows come from ``optpass::zeros_after`` the previous chunk's row write, which keeps the chunks
one after another in Inductor's schedule (``kernels/after.py``; a tied weight's chunk, scattered
into its GEMM's rows, reads its token indices copied after that write). The largest gradient of a
language model with a large vocabulary, its embedding's (tied or not), made at the end of
backward, then costs one chunk instead of the whole.
"""

from __future__ import annotations

import torch
import torch.fx

from optpass.kernels import after  # noqa: F401  (registers optpass::zeros_after, optpass::clone_after)
from optpass.passes._graph_utils import copy_node, is_elementwise, is_transpose, tensor_value as _val

aten = torch.ops.aten
_MASKED_SCATTER = aten._unsafe_masked_index_put_accumulate.default

# A gradient of more than twice this many bytes is made and applied in chunks of about this many.
ROW_CHUNK_BYTES = 2 * 2 ** 20
# At most this many chunks: each one reads the GEMM's other input again, and adds to the graph.
MAX_CHUNKS = 16


def row_chunks(update, gradient: torch.fx.Node) -> list[tuple[int, int]] | None:
    """The row ranges to make and apply `gradient` in, or None when it is made whole: it is small,
    not one GEMM, or the update is not elementwise over parameter-shaped values."""
    value = _val(gradient)
    if value is None or value.dim() != 2 or gradient_rows(gradient, 0, 1) is None:
        return None
    rows, nbytes = value.shape[0], value.numel() * value.element_size()
    if not isinstance(rows, int) or nbytes <= 2 * ROW_CHUNK_BYTES or not _elementwise(update, tuple(value.shape)):
        return None
    count = min(MAX_CHUNKS, -(-nbytes // ROW_CHUNK_BYTES))
    per_chunk = -(-rows // count)
    return [(start, min(start + per_chunk, rows)) for start in range(0, rows, per_chunk)]


def copy_slice_in_row_chunks(step, update, env: dict, gradient: torch.fx.Node, chunks: list[tuple[int, int]],
                             round_into: torch.fx.Node | None = None) -> list[torch.fx.Node]:
    """Insert the update of `update.param` chunk by chunk at the insert point (see the module
    docstring); `env` maps the slice's placeholders to graph values, `gradient` to the GEMM that
    makes the whole gradient (left for the caller to drop). With `round_into` (a bf16/fp16
    parameter whose fp32 master ``env[update.param]`` is), each chunk's gradient rows are cast to
    the master's dtype and the chunk's new master rows are rounded into the parameter's rows
    (master_weights). Returns the inserted nodes."""
    shape = tuple(_val(update.param).shape)
    per_row = _parameter_shaped(update, shape)
    inserted = []
    shared = dict(env)
    for node in update.nodes:                       # the scalars, once
        if node not in per_row:
            inserted.append(copy_node(step, node, shared))
    row_targets = [t for t in update.writes if t is update.param or t in per_row]
    previous_write = None
    for start, end in chunks:
        chunk_env = dict(shared)
        for placeholder in per_row:
            if placeholder.op == "placeholder" and placeholder is not update.gradient:
                chunk_env[placeholder] = _emit(step, inserted, aten.slice.Tensor, env[placeholder], 0, start, end)
        rows = gradient_rows(gradient, start, end, step, inserted, after=previous_write)
        master_dtype = _val(env[update.param]).dtype
        if _val(rows).dtype != master_dtype:
            rows = _emit(step, inserted, torch.ops.prims.convert_element_type.default, rows, master_dtype)
        chunk_env[update.gradient] = rows
        for node in update.nodes:
            if node in per_row:
                inserted.append(copy_node(step, node, chunk_env))
        for target in row_targets:
            inserted.append(step.write_update(chunk_env[target], chunk_env[update.writes[target]]))
            previous_write = inserted[-1]
        if round_into is not None:
            rounded = _emit(step, inserted, torch.ops.prims.convert_element_type.default,
                            chunk_env[update.writes[update.param]], _val(round_into).dtype)
            inserted.append(step.write_update(_emit(step, inserted, aten.slice.Tensor, round_into, 0, start, end),
                                              rounded))
    for target, value in update.writes.items():     # the step counter: after every chunk read it
        if target not in row_targets:
            inserted.append(step.write_update(shared[target], shared[value]))
    return inserted


def gradient_rows(gradient: torch.fx.Node, start: int, end: int, step=None, inserted=None, after=None):
    """Rows start:end of a gradient made by one GEMM (``_gemm_rows``) or by an embedding's scatter
    (``_scatter_rows``), seen through a dtype cast; without `step`, only whether it has such a form
    (None if not). `after` is the previous chunk's last write (None for the first chunk)."""
    if gradient.target is torch.ops.prims.convert_element_type.default:
        if step is None:
            return gradient_rows(gradient.args[0], start, end)
        rows = gradient_rows(gradient.args[0], start, end, step, inserted, after)
        return _emit(step, inserted, gradient.target, rows, gradient.args[1])
    if gradient.target is _MASKED_SCATTER:
        return _scatter_rows(gradient, start, end, step, inserted, after)
    return _gemm_rows(gradient, start, end, step, inserted)


def _scatter_rows(gradient: torch.fx.Node, start: int, end: int, step, inserted, after):
    """Rows start:end of ``_unsafe_masked_index_put_accumulate(base, mask, [idx], values)`` (Inductor's
    decomposition of an embedding's backward; ``base`` zeros, or a tied head's GEMM after
    accumulate_gradient_in_place): the tokens whose index falls in start:end scattered into rows
    start:end of ``base``. Zero rows come from ``optpass::zeros_after`` the previous chunk's write
    (zero fills that read nothing let Inductor's C++ backend group every chunk's kernels and
    allocate every chunk at once; kernels/after.py), and the scatter writes into them in place; a
    GEMM base reads its token indices copied after that write (``optpass::clone_after``)."""
    base, mask, indices, values = gradient.args
    zeros = _zeros_shape(base)
    if len(indices) != 1 or not isinstance(indices[0], torch.fx.Node):
        return None
    if zeros is None and _gemm_rows(base, 0, 1) is None:
        return None
    if step is None:
        return gradient
    index = indices[0]
    after_values = [after] if after is not None else [values]
    if zeros is not None:
        base_rows = _emit(step, inserted, torch.ops.optpass.zeros_after.default, [end - start, *zeros[1:]],
                          _val(base).dtype, _val(base).device, after_values)
    else:
        base_rows = _gemm_rows(base, start, end, step, inserted)
        index = _emit(step, inserted, torch.ops.optpass.clone_after.default, index, after_values)
    in_rows = _emit(step, inserted, aten.bitwise_and.Tensor, _emit(step, inserted, aten.ge.Scalar, index, start),
                    _emit(step, inserted, aten.lt.Scalar, index, end))
    in_chunk = _emit(step, inserted, aten.bitwise_and.Tensor, mask,
                     _emit(step, inserted, aten.reshape.default, in_rows, list(_val(mask).shape)))
    row_zero = _emit(step, inserted, aten.scalar_tensor.default, 0, dtype=_val(index).dtype)
    shifted = _emit(step, inserted, aten.where.self, in_rows, _emit(step, inserted, aten.sub.Tensor, index, start),
                    row_zero)
    zero = _emit(step, inserted, aten.scalar_tensor.default, 0.0, dtype=_val(values).dtype)
    kept = _emit(step, inserted, aten.where.self, in_chunk, values, zero)
    return _emit(step, inserted, aten.index_put_.default, base_rows, [shifted], kept, True)


def _zeros_shape(node) -> list | None:
    """The size of ``full(size, 0)`` (a zero-filled gradient), else None."""
    if isinstance(node, torch.fx.Node) and node.target is aten.full.default and node.args[1] == 0 \
            and all(isinstance(n, int) for n in node.args[0]):
        return list(node.args[0])
    return None


def _gemm_rows(gradient: torch.fx.Node, start: int, end: int, step=None, inserted=None):
    """Rows start:end of a gradient made by one GEMM, seen through transposes: ``mm(A, B)`` ->
    ``mm(A[start:end], B)``; ``t(mm(A, B))`` (the eager lowering's, an odd number of transposes)
    -> ``t(mm(A, B[:, start:end]))``. Without `step`, only whether the gradient has that form
    (None if not)."""
    gemm, transposed = gradient, False
    while is_transpose(gemm):
        gemm, transposed = gemm.args[0], not transposed
    if not isinstance(gemm, torch.fx.Node) or gemm.target is not aten.mm.default:
        return None
    if step is None:
        return gemm
    a, b = gemm.args
    if transposed:
        rows = _emit(step, inserted, aten.mm.default, a, _emit(step, inserted, aten.slice.Tensor, b, 1, start, end))
        return _emit(step, inserted, aten.t.default, rows)
    return _emit(step, inserted, aten.mm.default, _emit(step, inserted, aten.slice.Tensor, a, 0, start, end), b)


def _parameter_shaped(update, shape: tuple) -> set[torch.fx.Node]:
    placeholders = [update.param, update.gradient, *update.states.values()]
    return {n for n in [*placeholders, *update.nodes] if _val(n) is not None and tuple(_val(n).shape) == shape}


def _elementwise(update, shape: tuple) -> bool:
    """Every parameter-shaped value is made elementwise from parameter-shaped values and scalars,
    no scalar is made from a parameter-shaped value, and every write is parameter-shaped or a scalar.

    Stricter than ``optim.elementwise`` (ZeRO-1's test, which harvests a new update for the shard's
    shape): each node here is copied onto a chunk as it is, so an op that names the parameter's
    shape (a ``full``, a ``view``) cannot be among them."""
    per_row = _parameter_shaped(update, shape)
    if update.param not in per_row or update.gradient not in per_row:
        return False
    for node in update.nodes:
        inputs = node.all_input_nodes
        if node in per_row:
            # an update's functional copy(param, value) is elementwise too
            pointwise = is_elementwise(node) or node.target is aten.copy.default
            if not pointwise or any(i not in per_row and not _is_scalar(i) for i in inputs):
                return False
        elif not _is_scalar(node) or any(i in per_row for i in inputs):
            return False
    return all(t in per_row or _is_scalar(t) for t in update.writes)


def _is_scalar(node: torch.fx.Node) -> bool:
    value = _val(node)
    return value is None or value.numel() == 1


def _emit(step, inserted: list, target, *args, **kwargs) -> torch.fx.Node:
    node = step.emit(target, *args, **kwargs)
    inserted.append(node)
    return node
