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

import math
from fractions import Fraction

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
    not one GEMM, or the update cannot run on rows alone (``row_layout``)."""
    value = _val(gradient)
    if value is None or value.dim() != 2 or gradient_rows(gradient, 0, 1) is None:
        return None
    rows, nbytes = value.shape[0], value.numel() * value.element_size()
    if not isinstance(rows, int) or nbytes <= 2 * ROW_CHUNK_BYTES:
        return None
    layout = row_layout(update, rows)
    if layout is None:
        return None
    # every chunk boundary a whole number of each value's leading entries (an 8-bit moment's scales:
    # one per block of 256 elements)
    align = math.lcm(*(f.denominator for f in layout.values()))
    count = min(MAX_CHUNKS, -(-nbytes // ROW_CHUNK_BYTES))
    per_chunk = -(-rows // count)                  # rounded up, then up to a multiple of align
    per_chunk = -(-per_chunk // align) * align
    if per_chunk >= rows:
        return None
    return [(start, min(start + per_chunk, rows)) for start in range(0, rows, per_chunk)]


def copy_slice_in_row_chunks(step, update, env: dict, gradient: torch.fx.Node, chunks: list[tuple[int, int]],
                             round_into: torch.fx.Node | None = None) -> list[torch.fx.Node]:
    """Insert the update of `update.param` chunk by chunk at the insert point (see the module
    docstring); `env` maps the slice's placeholders to graph values, `gradient` to the GEMM that
    makes the whole gradient (left for the caller to drop). With `round_into` (a bf16/fp16
    parameter whose fp32 master ``env[update.param]`` is), each chunk's gradient rows are cast to
    the master's dtype and the chunk's new master rows are rounded into the parameter's rows
    (master_weights). Returns the inserted nodes."""
    layout = row_layout(update, _val(update.param).shape[0])
    per_row = set(layout)
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
                f = layout[placeholder]
                chunk_env[placeholder] = _emit(step, inserted, aten.slice.Tensor, env[placeholder], 0,
                                               int(start * f), int(end * f))
        rows = gradient_rows(gradient, start, end, step, inserted, after=previous_write)
        master_dtype = _val(env[update.param]).dtype
        if _val(rows).dtype != master_dtype:
            rows = _emit(step, inserted, torch.ops.prims.convert_element_type.default, rows, master_dtype)
        chunk_env[update.gradient] = rows
        for node in update.nodes:
            if node in per_row:
                inserted.append(_copy_on_rows(step, node, chunk_env, int((end - start) * layout[node])))
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


_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_REDUCTIONS = {aten.amax.default, aten.amin.default, aten.sum.dim_IntList, aten.mean.dim}


def row_layout(update, rows: int) -> dict[torch.fx.Node, Fraction] | None:
    """Whether `update` can run on rows ``a:b`` of its parameter alone, and how: each of its values
    that holds rows (the parameter, its gradient, state, and what is made from them), mapped to
    its leading size over the parameter's rows. None when it cannot.

    Rows ``a:b`` of a ``[rows, ...]`` parameter are its elements ``a*n:b*n`` (``n`` a row's), and a
    value laid out in the same order under another shape holds them in its leading entries
    ``a*f:b*f`` (``f`` = its leading size / rows): an Adam moment ``f = 1``; torchao's 8-bit moment's
    scales, one per block of 256 elements, ``f = n / 256``; its codes, viewed ``[blocks, 256]``, too.
    Allowed on such values: elementwise ops (their other inputs scalars, or values that hold no
    rows and broadcast over the leading dimension), reshapes, reductions over other dimensions
    than the leading one, and lookups ``index(table, [codes])`` into a value that holds no rows
    (an 8-bit moment's quantization map, read whole). Every write of a value that holds rows is
    one, and no scalar is made from rows (a norm over the whole parameter cannot be cut)."""
    param, gradient = update.param, update.gradient
    rows = _static_int(rows)
    if rows is None:
        return None
    placeholders = [param, gradient, *update.states.values()]
    layout: dict[torch.fx.Node, Fraction] = {}
    for node in placeholders:
        value = _val(node)
        if value is None:
            return None
        if value.dim() >= 1 and value.numel() > 1 and not _only_looked_up(node, update):
            leading = _static_int(value.shape[0])
            if leading is None:
                return None                             # a symbolic size: no fixed chunks
            layout[node] = Fraction(leading, rows)
    if layout.get(param) != 1 or layout.get(gradient) != 1:
        return None
    for node in update.nodes:
        inputs = node.all_input_nodes
        held = [i for i in inputs if i in layout]
        if not held:
            continue                                    # holds no rows: made once, shared by the chunks
        factor = _rows_factor(node, held, layout)
        if factor is None:
            return None
        layout[node] = factor
    for target, value in update.writes.items():
        if layout.get(target) != layout.get(value):
            return None
    return layout


def _rows_factor(node: torch.fx.Node, held: list[torch.fx.Node], layout: dict) -> Fraction | None:
    """The leading size over rows of `node`, made from the row-holding inputs `held`; None where
    `node` would mix rows (or name the whole parameter's size in a way a chunk cannot keep)."""
    out = _val(node)
    if out is None or out.dim() == 0 or _static_int(out.shape[0]) is None:
        return None                                     # a scalar made from rows, or a symbolic size
    first = held[0]
    if is_elementwise(node) or node.target is aten.copy.default:
        factor = layout[first]
        if any(layout[i] != factor or _val(i).shape[0] != out.shape[0] for i in held):
            return None
        others = [i for i in node.all_input_nodes if i not in layout]
        if any(not _is_scalar(i) and _val(i).dim() >= out.dim() for i in others):
            return None                                 # a whole value along the leading dimension
        return factor
    if node.target in (aten.alias.default, aten.clone.default) and out.shape == _val(first).shape:
        return layout[first]
    if node.target in _VIEWS and node.args[0] is first:
        return Fraction(_static_int(out.shape[0]), _static_int(_val(first).shape[0])) * layout[first]
    if node.target in _REDUCTIONS and node.args[0] is first and len(held) == 1:
        dims = node.args[1] if len(node.args) > 1 else None
        if not dims or any(d % _val(first).dim() == 0 for d in dims) or out.shape[0] != _val(first).shape[0]:
            return None
        return layout[first]
    if node.target in (aten.unsqueeze.default, aten.squeeze.dim) and node.args[0] is first:
        dim = node.args[1] % (out.dim() if node.target is aten.unsqueeze.default else _val(first).dim())
        return layout[first] if dim != 0 and out.shape[0] == _val(first).shape[0] else None
    if node.target is aten.cat.default:
        return _cat_factor(node, layout, out)
    if node.target is aten.slice.Tensor and node.args[0] is first:
        return _strided_rows_factor(node, layout[first], _val(first), out)
    if node.target is aten.index.Tensor and node.args[0] not in layout:
        indices = node.args[1]
        if len(indices) == 1 and indices[0] in layout:
            return Fraction(_static_int(out.shape[0]), _static_int(_val(indices[0]).shape[0])) * layout[indices[0]]
    return None


def _cat_factor(node: torch.fx.Node, layout: dict, out) -> Fraction | None:
    """``cat(values, dim)`` along another dimension than the leading one, of values that all hold the
    same rows (4-bit codes: each byte's two codes side by side)."""
    values, dim = node.args[0], (node.args[1] if len(node.args) > 1 else 0)
    if dim % out.dim() == 0 or any(v not in layout for v in values):
        return None
    factors = {layout[v] for v in values}
    if len(factors) != 1 or any(_val(v).shape[0] != out.shape[0] for v in values):
        return None
    return factors.pop()


def _strided_rows_factor(node: torch.fx.Node, factor: Fraction, source, out) -> Fraction | None:
    """``slice(x, 0, start, end, step)`` over the whole leading dimension (``start < step``): every
    step-th entry (4-bit codes packed two a byte take the even and the odd ones). A chunk of
    ``x`` that starts on a multiple of `step` (the chunks' alignment sees to it: the factor's
    denominator) gives its own such entries."""
    dim, start, end, stride = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:])[:4]
    size = _static_int(source.shape[0])
    if dim % source.dim() != 0 or size is None or not isinstance(stride, int) or stride < 1:
        return None
    start = start or 0
    if not 0 <= start < stride or (end is not None and end < size):
        return None
    if _static_int(out.shape[0]) != -(-(size - start) // stride):
        return None
    return factor / stride


def _static_int(size) -> int | None:
    """A size as an int: a SymInt whose value is fixed (explain's fake values carry those) too."""
    if isinstance(size, int):
        return size
    return size.node.maybe_as_int() if isinstance(size, torch.SymInt) else None


def _only_looked_up(node: torch.fx.Node, update) -> bool:
    """A state input read only as a table (``index(table, ...)``, ``select(table, ...)``) and never
    written: an 8-bit moment's quantization map, read whole by every chunk."""
    if node in update.writes:
        return False
    users = [u for u in node.users if u in set(update.nodes)]
    return bool(users) and all(u.target in (aten.index.Tensor, aten.select.int) and u.args[0] is node
                               and node not in u.args[1:] for u in users)


def _copy_on_rows(step, node: torch.fx.Node, env: dict, leading: int) -> torch.fx.Node:
    """``copy_node`` for a value that holds rows; a reshape gets the chunk's leading size."""
    if node.target not in _VIEWS:
        return copy_node(step, node, env)
    size = list(node.args[1])
    if size[0] != -1:
        size[0] = leading
    copy = step.graph.call_function(node.target, (env[node.args[0]], size))
    copy.meta = {k: v for k, v in node.meta.items() if k in ("stack_trace", "original_aten")}
    step.set_fake_value(copy)
    env[node] = copy
    return copy


def _is_scalar(node: torch.fx.Node) -> bool:
    value = _val(node)
    return value is None or value.numel() == 1


def _emit(step, inserted: list, target, *args, **kwargs) -> torch.fx.Node:
    node = step.emit(target, *args, **kwargs)
    inserted.append(node)
    return node
