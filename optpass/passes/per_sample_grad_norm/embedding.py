"""per_sample_grad_norm for Embedding weights: the per-sample scatter of token gradients into
[B·vocab, d], through the padding row."""

from __future__ import annotations

import math

import torch
import torch.fx

from optpass.passes.per_sample_grad_norm.candidate import (_Candidate, _coef_column, _flat_view, _rank, _shape, _val)
from optpass.passes.per_sample_grad_norm.labels import _REGROUPING, _SKIP

aten = torch.ops.aten


_SCATTERS = {aten.embedding_dense_backward.default, aten._unsafe_masked_index_put_accumulate.default}


def _embedding_candidate(step, node: torch.fx.Node) -> _Candidate | None:
    """vmap's batched embedding backward: the B samples' [vocab, d] gradients as ONE scatter of the
    tokens' output gradients into [B·vocab, d] at rows ``x_bt + b·vocab``. Two traced forms:
      * aten graph:      embedding_dense_backward(values, x + offsets, B·vocab, -1, scale_grad_by_freq)
      * Inductor graph:  _unsafe_masked_index_put_accumulate(zeros, mask, [x + offsets], values)
                         (embedding_dense_backward decomposed)
    with offsets = arange(0, B·vocab, vocab) viewed [B, 1, ..]. nn.Embedding's padding_idx is not
    in the scatter (vmap passes -1): it is a select_scatter of zeros into row padding_idx of the
    [B, vocab, d] view, which ``through`` follows."""
    if node.target not in _SCATTERS or _rank(node) != 2:
        return None
    args = node.args
    refuse, mask, zeros = None, None, None
    if node.target is aten.embedding_dense_backward.default:
        values, index, _, padding_idx, scale_grad_by_freq = args[:5]
        if padding_idx != -1:
            return None                                       # not vmap's batched form
        if scale_grad_by_freq:
            refuse = ("scale_grad_by_freq=True divides by token counts inside embedding_dense_backward; "
                      "left as it was")
    else:
        zeros, mask, indices, values = args[:4]
        if len(indices) != 1:
            return None
        index = indices[0]
    if zeros is not None and not _is_zeros(zeros):
        return None
    split = _split_sample_offsets(index)
    if split is None:
        return None
    local, batch, vocab = split
    if not _looked_up(local, vocab):
        return None
    rows, dim = _shape(node)
    index_shape, values_shape = _shape(index), _shape(values)
    if rows != batch * vocab or index_shape is None or values_shape != index_shape + [dim]:
        return None
    if mask is not None and (_shape(mask) is None
                             or list(torch.broadcast_shapes(_shape(mask), values_shape)) != values_shape):
        return None
    tokens = math.prod(index_shape[1:])
    if tokens >= vocab and refuse is None:
        # The rewrite keeps the tokens' [B, T, d] gradients alive instead of [B, vocab, d]: a gain
        # only when T < vocab (e.g. a position table indexed by all its rows gains nothing).
        refuse = (f"{tokens} tokens per sample >= vocab {vocab}: the [B, vocab, d] tensor is no larger "
                  "than the tokens' gradients the rewrite would keep; left as it was")
    graph, emit = step.graph, step.emit
    prepared = {}

    def ids_and_values():
        """[B, T] token ids (0 <= id < vocab: _looked_up) and [B, T, d] the values scattered
        (masked-out tokens zeroed). Emitted once, before the scatter, where all their inputs exist."""
        if not prepared:
            with graph.inserting_before(node):
                ids = local
                if _shape(ids) != index_shape:
                    ids = emit(aten.expand.default, ids, index_shape)
                ids = _flat_view(emit, ids, [batch, tokens])
                vals = values if mask is None else emit(aten.mul.Tensor, values, mask)
                vals = _flat_view(emit, vals, [batch, tokens, dim])
            prepared.update(ids=ids, vals=vals)
        return prepared["ids"], prepared["vals"]

    def norm(padding_idx):
        ids, vals = ids_and_values()
        pad = -1 if padding_idx is None else padding_idx
        return emit(torch.ops.optpass.embedding_per_sample_grad_sq_norm.default, ids, vals, pad, "auto")

    def clipped_sum(coef, padding_idx):
        ids, vals = ids_and_values()
        c = _coef_column(emit, coef, batch)
        if c.meta["val"].dtype != vals.meta["val"].dtype:
            c = emit(aten._to_copy.default, c, dtype=vals.meta["val"].dtype)
        scaled = emit(aten.view.default, emit(aten.mul.Tensor, vals, c), [batch * tokens, dim])
        flat_ids = emit(aten.view.default, ids, [batch * tokens])
        if node.target is aten.embedding_dense_backward.default:     # padding handled by the op itself
            pad = -1 if padding_idx is None else padding_idx
            return emit(aten.embedding_dense_backward.default, scaled, flat_ids, vocab, pad, False)
        value = _val(node)
        like = dict(dtype=value.dtype, layout=torch.strided, device=value.device, pin_memory=False)
        total = emit(aten.index_put.default, emit(aten.full.default, [vocab, dim], 0, **like),
                     [flat_ids], scaled, True)
        if padding_idx is not None:
            total = emit(aten.select_scatter.default, total, emit(aten.full.default, [dim], 0, **like),
                         0, padding_idx)
        return total

    def through(user, value, labels, padding_idx):
        return _through_padding(user, value, labels, padding_idx, vocab)

    def outer(padding_idx):
        """(values [B, T, d], one_hot(ids) [B, T, vocab]): the scatter as an outer product over tokens,
        for a sum with a Linear per-sample gradient (a tied head). The one-hot is as large as that
        head's output gradient [B, T, vocab]; the padding row's tokens get a zero row."""
        ids, vals = ids_and_values()
        # prims (not aten.arange / _to_copy): Inductor's post-grad graph has lowerings for these
        rows = emit(torch.ops.prims.iota.default, vocab, start=0, step=1, dtype=_val(ids).dtype,
                    device=_val(vals).device, requires_grad=False)
        hot = emit(aten.eq.Tensor, emit(aten.unsqueeze.default, ids, -1), rows)                    # [B, T, vocab]
        if padding_idx is not None:
            hot = emit(aten.logical_and.default, hot, emit(aten.ne.Scalar, rows, padding_idx))
        return vals, emit(torch.ops.prims.convert_element_type.default, hot, _val(vals).dtype)

    return _Candidate(what=f"Embedding per-sample gradient [B={batch}, vocab={vocab}, d={dim}]", root=node,
                      labels=[("b", "r"), ("c",)], size_of={"b": batch, "r": vocab, "c": dim},
                      norm=norm, clipped_sum=clipped_sum, through=through, refuse=refuse, outer=outer,
                      tokens=tokens, uses=(("Embedding", local, None),))


def _through_padding(user, value, labels, padding_idx, vocab):
    """nn.Embedding's padding_idx under vmap: ``select_scatter(P [B, vocab, d], zeros, 1, pad)`` keeps
    P's labels with row ``pad`` of every sample zeroed (the state becomes pad). The ``select`` that
    only feeds a ``fill`` (the zeros' shape) reads no value of P: skipped."""
    if user.target is aten.select_scatter.default and user.args[0] is value:
        src, dim, index = user.args[1:4]
        dim %= len(labels)
        index %= vocab
        if labels[dim] == ("r",) and _is_zeros(src) and padding_idx in (None, index):
            return labels, index
        return None
    if user.target is aten.select.int and user.args[0] is value and user.users \
            and all(u.target is aten.fill.Scalar for u in user.users):
        return _SKIP
    return None


def _is_zeros(node) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    if node.target in (aten.full.default, aten.full_like.default, aten.fill.Scalar):
        return node.args[1] == 0
    if node.target is aten.new_full.default:
        return node.args[2] == 0
    return node.target in (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default)


def _strip_views(node):
    while isinstance(node, torch.fx.Node) and node.target in _REGROUPING:
        node = node.args[0]
    return node


def _looked_up(ids: torch.fx.Node, vocab: int) -> bool:
    """Do the same ids (some view of them) index a forward ``embedding`` of a [vocab, d] weight?
    That lookup checks 0 <= id < vocab at run time, so sample b's tokens land in its own rows
    [b·vocab, (b+1)·vocab) of the batched scatter."""
    base = _strip_views(ids)
    views, stack = set(), [base]
    while stack:
        node = stack.pop()
        views.add(node)
        stack.extend(u for u in node.users if u.target in _REGROUPING and u.args[0] is node and u not in views)
    return any(user.target is aten.embedding.default and user.args[1] is view
               and (_shape(user.args[0]) or [None])[0] == vocab
               for view in views for user in view.users)


def _split_sample_offsets(index) -> tuple[torch.fx.Node, int, int] | None:
    """index = add(x, offsets) with offsets = [0, V, 2V, ..] along dim 0 ([B, 1, .., 1]):
    (x, B, V), else None. This is how vmap batches an embedding lookup's rows (sample b owns
    rows [bV, (b+1)V))."""
    if not isinstance(index, torch.fx.Node) or index.target is not aten.add.Tensor or len(index.args) != 2:
        return None
    index_shape = _shape(index)
    if index_shape is None or not index_shape or index.kwargs.get("alpha", 1) != 1:
        return None
    batch = index_shape[0]
    for offsets, local in (index.args, index.args[::-1]):
        if _shape(offsets) != [batch] + [1] * (len(index_shape) - 1) or _shape(local) is None:
            continue
        base = _strip_views(offsets)
        if base.target is aten.arange.start_step and base.args[0] == 0 and len(base.args) >= 3:
            step = base.args[2]
        elif base.target is torch.ops.prims.iota.default and base.kwargs.get("start") == 0:
            step = base.kwargs.get("step")
        else:
            continue
        if _shape(base) != [batch] or not isinstance(step, int) or step <= 0:
            continue
        if list(torch.broadcast_shapes(_shape(local), _shape(offsets))) != index_shape:
            continue
        return local, batch, step
    return None
