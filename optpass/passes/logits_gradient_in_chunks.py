"""Pass logits_gradient_in_chunks: a language model's logits gradient is made a vocabulary chunk at a
time, beside its output head's chunked update, and never whole.

Precondition: asked for (``logits_in_chunks``), ``optimizer_in_backward`` (or ``master_weights`` in backward) made and applied the output
head's ``[vocab, d]`` gradient in row chunks (``_row_chunks.py``): chunk ``a:b`` is a GEMM over
``permute(dY)[a:b]`` (Inductor's lowering) or ``dY[:, a:b]`` (the eager lowering's transposed form),
where ``dY`` is the ``[tokens, vocab]`` gradient of the logits. ``dY`` is made by pointwise ops
(with expands and reshapes that keep the vocabulary as the last dimension) from the logits GEMM
``mm(x, t(W))``, index constants (the one-hot's ``iota``), weights and per-token values
(``[tokens, 1]``: the log-sum-exp, the loss's scale). Its other readers are GEMMs ``mm(dY, W)`` with
``W`` ``[vocab, d]`` (the gradient of the head's input), made before the first chunk and read only
after the last one. The chunks cover the vocabulary in order.

Rewrite: before the GEMM of chunk ``a:b``, ``dY``'s pointwise computation is copied onto columns
``a:b`` (each input whose last dimension is the vocabulary sliced, each expand and reshape
narrowed), which makes ``dY[:, a:b]``; the chunk's GEMM reads it, and each ``mm(dY, W)`` becomes the
running sum of ``mm(dY[:, a:b], W[a:b])`` (``W``'s rows are read before the chunk's update writes
them).

The forward's logits ``mm(x, t(W))`` and what the loss makes of them pointwise are made again on
each chunk from ``W``'s rows (one more GEMM over the step: the logits need not stay alive for
backward), and the one-hot from slices of its ``iota``; a chunk reads no ``[tokens, vocab]``
activation, or the gradient is left whole.

Effect: the head's gradient is alive one chunk at a time (its row chunks); with this pass its
input, the ``[tokens, vocab]`` logits gradient, is too, and the logits die in the forward (on a Llama with
vocab 32000 and 128 tokens: two 15.6 MiB buffers, the step's peak; docs/design.md §46). The
chunks depend on each other through the head's weight (chunk k's logits read rows that chunk k-1's
update has written beside them), so Inductor cannot fuse their pointwise kernels into one that
allocates every chunk at once.
Numerics: the gradient of the head's input is summed over the vocabulary in chunks (rounding only;
tested against eager).

Refuses: nothing. Skips a logits gradient with another reader, a random or side-effecting op
among what makes it, an input it reads that the step writes in place before the last chunk, an
input gradient read before the last chunk, and a gradient in half precision (each chunk's share of
the input gradient would be rounded to half precision before the sum).

    before:                                        after:
      dY = sub(mul(onehot, s), mul(exp(ls), t))      (dY's whole computation: unread, dropped)
      dx = mm(dY, W)                                 dY0 = sub(mul(onehot[:, 0:8000], s), ...)
      g0 = mm(permute(dY)[0:8000], x); <update 0>     dx0 = mm(dY0, W[0:8000])
      g1 = mm(permute(dY)[8000:16000], x); ...        g0 = mm(permute(dY0), x); <update 0>
      ... read dx                                    dY1 = ...; dx1 = add(dx0, mm(dY1, W[8000:16000]))
                                                     g1 = mm(permute(dY1), x); ...
                                                     ... read dx_last
"""

from __future__ import annotations

import torch
import torch.fx

from optpass.passes._graph_utils import (copy_node, has_fused_loss_backward, is_elementwise, is_random_or_effectful,
                                        is_transpose, live_users, tensor_value as _val)
from optpass.step import FORWARD, is_view, view_base as _base

aten = torch.ops.aten

# Ops that keep the vocabulary as the last dimension and are copied onto a chunk with their size
# argument narrowed (the last entry becomes the chunk's width).
_SIZED = {aten.expand.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def run(step, options) -> str | None:
    if not options.logits_in_chunks:
        return "not requested (options logits_in_chunks)"
    if not options.optimizer_in_backward:
        return "needs optimizer_in_backward (the head's update in row chunks)"
    rewritten, reasons = 0, []
    for logits_gradient, chunks in _chunked_gradients(step.graph).items():
        reason = _rewrite(step, logits_gradient, chunks)
        if reason is None:
            rewritten += 1
        else:
            reasons.append(f"{logits_gradient.name}: {reason}")
    half = any("torch.bfloat16" in r or "torch.float16" in r for r in reasons)
    if not rewritten and reasons and not half and has_fused_loss_backward(step.graph):
        return ("the loss's backward is one op in this graph (aten._log_softmax_backward_data: the aten graph that "
                "optpass.explain and lower='eager' see); Inductor's lowering (the default) decomposes it into "
                "pointwise ops, where this pass makes the head's logits gradient in vocabulary chunks (an fp32 "
                "head without a bias whose gradient is made in row chunks)")
    if not rewritten:
        return "; ".join(reasons) or "no gradient is made in row chunks from a [tokens, vocab] gradient"
    step.notes.append(f"{rewritten} logits gradient(s) made in vocabulary chunks beside the head's update")
    return None


def _chunked_gradients(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[tuple[int, int, torch.fx.Node]]]:
    """Each 2-D value whose column ranges feed GEMMs (a row-chunked head gradient's chunks), with
    those ranges and their slice nodes, in graph order."""
    found: dict[torch.fx.Node, list] = {}
    for node in graph.nodes:
        if node.target is not aten.slice.Tensor or len(node.args) != 4:
            continue
        source, dim, start, end = node.args
        if not isinstance(start, int) or not isinstance(end, int) or not isinstance(source, torch.fx.Node):
            continue
        if not node.users or any(u.target is not aten.mm.default for u in node.users):
            continue
        if dim == 0 and is_transpose(source):
            gradient = source.args[0]
        elif dim == 1 and _val(source) is not None and _val(source).dim() == 2:
            gradient = source
        else:
            continue
        found.setdefault(gradient, []).append((start, end, node))
    return found


def _rewrite(step, gradient: torch.fx.Node, chunks: list) -> str | None:
    value = _val(gradient)
    if value is None or value.dim() != 2 or not isinstance(value.shape[1], int):
        return "not a [tokens, vocab] tensor of static vocabulary"
    if value.dtype not in (torch.float32, torch.float64):
        # the input gradient's chunks would each be rounded to half precision before they are summed
        return f"a {value.dtype} gradient (the input gradient's sum over chunks needs fp32 or fp64)"
    vocab = value.shape[1]
    starts = [a for a, _, _ in chunks]
    if [a for a, _, _ in chunks[1:]] != [b for _, b, _ in chunks[:-1]] or starts[0] != 0 or chunks[-1][1] != vocab:
        return "its chunks do not cover the vocabulary in order"
    slices = {s for _, _, s in chunks}
    input_gradients = []
    for user in live_users(gradient):
        if user in slices or (is_transpose(user) and live_users(user) <= slices):
            continue
        if user.target is aten.mm.default and user.args[0] is gradient and _rows_are_vocab(user.args[1], vocab):
            input_gradients.append(user)
            continue
        return (f"the logits gradient is also read whole by {user.target} (node {user.name}: a head bias's "
                "gradient, or a term of its own), so it cannot be made in chunks")
    position = {n: i for i, n in enumerate(step.graph.nodes)}
    first, last = position[chunks[0][2]], position[chunks[-1][2]]
    for mm in input_gradients:
        if position[mm] > first or any(position[u] <= last for u in mm.users):
            return f"{mm.name} is read between its chunks"
    head_weights = {_base(mm.args[1]) for mm in input_gradients}
    cone, sources = _pointwise_cone(step, gradient, vocab, head_weights)
    if cone is None:
        return sources
    for source in sources:       # a chunk reads slices of weights and index constants, no activation
        if _along(source, vocab) and source.all_input_nodes and _base(source).op != "placeholder":
            return f"its chunks would keep {source.name} {tuple(_val(source).shape)} alive until the last one"
    # what the cone and the input gradients read must hold, at every chunk, what it held where it
    # was first read: nothing writes it in between, or only the chunks' own updates write the
    # head's rows, each after its chunk read them
    writes = _in_place_writes(step.graph, position, min(position[n] for n in cone), last)
    rows_written = {(a, b): position[s] for a, b, s in chunks}
    reads = [(source, _along(source, vocab)) for source in sources] + [(mm.args[1], False) for mm in input_gradients]
    for value, by_columns in reads:
        written = writes.get(_base(value), [])
        if written and not _reads_head_rows_before_they_are_written(value, by_columns, written, rows_written, position):
            return f"reads {value.name}, which the step writes in place before the last chunk"
    cone, sources = sorted(cone, key=position.__getitem__), sorted(sources, key=position.__getitem__)
    sums: dict[torch.fx.Node, torch.fx.Node] = {}
    for start, end, slice_node in chunks:
        with step.graph.inserting_before(slice_node):
            columns = _copy_onto_columns(step, cone, sources, vocab, start, end)
            chunk = columns[gradient]
            for mm in input_gradients:
                rows = step.emit(aten.slice.Tensor, mm.args[1], 0, start, end)
                part = step.emit(aten.mm.default, chunk, rows)
                sums[mm] = part if mm not in sums else step.emit(aten.add.Tensor, sums[mm], part)
            replacement = step.emit(aten.permute.default, chunk, [1, 0]) if slice_node.args[1] == 0 else chunk
        slice_node.replace_all_uses_with(replacement)
        step.graph.erase_node(slice_node)
    for mm in input_gradients:
        mm.replace_all_uses_with(sums[mm])
        step.graph.erase_node(mm)
    return None


def _pointwise_cone(step, gradient: torch.fx.Node, vocab: int, head_weights: set):
    """(the nodes that make `gradient` elementwise along the vocabulary, the inputs they read from
    outside), or (None, the reason it cannot be chunked).

    The cone holds backward's pointwise work and, of the forward, what is made again cheaply on a
    chunk's columns: the head's logits GEMM ``mm(x, t(W))`` (on ``W``'s rows of the chunk: one more
    GEMM in all, so that the logits need not stay alive until backward) and pointwise values of it
    and of index constants (the one-hot's ``iota``). Other forward values are inputs: they hold
    what backward read, and the cone does not make them live longer."""
    cone: set[torch.fx.Node] = set()
    sources: set[torch.fx.Node] = set()
    remade: dict[torch.fx.Node, bool] = {}

    def made_again(node: torch.fx.Node) -> bool:
        if node not in remade:
            remade[node] = _is_head_gemm(node, vocab, head_weights) or (
                _copyable_onto_columns(node, vocab) and not is_random_or_effectful(node) and
                all(not _along(i, vocab) or not i.all_input_nodes or made_again(i) for i in node.all_input_nodes))
        return remade[node]

    stack = [gradient]
    while stack:
        node = stack.pop()
        if node in cone or node in sources:
            continue
        if step.region_of(node) == FORWARD and _along(node, vocab) and made_again(node):
            cone.add(node)
            stack.extend(node.args[1:2] if _is_head_gemm(node, vocab, head_weights) else node.all_input_nodes)
            continue
        if not _along(node, vocab) or not _copyable_onto_columns(node, vocab) or step.region_of(node) == FORWARD:
            if node is gradient:
                return None, "not made by pointwise ops"
            sources.add(node)
            continue
        if is_random_or_effectful(node):
            return None, f"{node.name} ({node.target}) draws random numbers or has a side effect"
        cone.add(node)
        stack.extend(node.all_input_nodes)
    return cone, sources


def _is_head_gemm(node: torch.fx.Node, vocab: int, head_weights: set) -> bool:
    """``mm(x, B)`` with ``B`` a transposed view of the head's weight: the logits."""
    if node.target is not aten.mm.default or not _along(node, vocab) or _base(node.args[1]) not in head_weights:
        return False
    transposes = _transposes_to_base(node.args[1])
    return transposes is not None and transposes % 2 == 1


def _along(node, vocab: int) -> bool:
    """Whether `node`'s last dimension is the vocabulary (broadcasting aligns last dimensions)."""
    value = _val(node)
    return value is not None and value.dim() >= 1 and value.shape[-1] == vocab


def _copyable_onto_columns(node: torch.fx.Node, vocab: int) -> bool:
    if node.op != "call_function":
        return False
    if node.target in _SIZED:
        source = node.args[0]
        value = _val(source)
        return value is not None and value.dim() >= 1 and value.shape[-1] in (1, vocab) and \
            (node.target is aten.expand.default or value.shape[-1] == vocab)
    return is_elementwise(node)


def _copy_onto_columns(step, cone: list, sources: list, vocab: int, start: int, end: int) -> dict:
    """Copy `cone` (in graph order) at the insert point onto columns start:end; returns the map
    from each cone node to its copy."""
    env: dict = {}
    for source in sources:
        env[source] = step.emit(aten.slice.Tensor, source, _val(source).dim() - 1, start, end) \
            if _along(source, vocab) else source
    for node in cone:
        if node.target is aten.mm.default:                  # the head's logits GEMM, on the chunk's rows
            env[node] = step.emit(aten.mm.default, node.args[0], env[node.args[1]])
        elif node.target in _SIZED:
            sizes = list(node.args[1])
            env[node] = step.emit(node.target, env[node.args[0]], [*sizes[:-1], end - start], *node.args[2:])
        else:
            copy_node(step, node, env)
    return env


def _in_place_writes(graph: torch.fx.Graph, position: dict, after: int, until: int) -> dict:
    """The in-place writes (``copy_`` and other mutating ops) between two graph positions, by the
    base tensor they write."""
    writes: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if after < position[node] <= until and _mutates_first_argument(node):
            writes.setdefault(_base(node.args[0]), []).append(node)
    return writes


def _reads_head_rows_before_they_are_written(value, by_columns: bool, writes: list, rows_written: dict,
                                             position: dict) -> bool:
    """`value`, a view of a weight read by chunk rows (its columns if `by_columns`: a transposed
    view), is written only by row-chunk writes ``copy_(slice(W, 0, a, b), ...)`` of the chunks'
    own ranges, each after its chunk (which reads rows a:b before it)."""
    transposes = _transposes_to_base(value)
    if transposes is None or transposes % 2 != int(by_columns):
        return False
    for write in writes:
        rows = _row_range(write.args[0])
        if rows not in rows_written or write.args[0].args[0] is not _base(value) or \
                position[write] < rows_written[rows]:
            return False
    return True


def _transposes_to_base(view) -> int | None:
    """How many transposes lead from `view` to the tensor it views, or None if another view is
    among them."""
    count = 0
    while isinstance(view, torch.fx.Node) and is_view(view):
        if not is_transpose(view):
            return None
        view, count = view.args[0], count + 1
    return count


def _mutates_first_argument(node: torch.fx.Node) -> bool:
    if not isinstance(node.target, torch._ops.OpOverload) or not node.target._schema.arguments:
        return False
    alias = node.target._schema.arguments[0].alias_info
    return alias is not None and alias.is_write


def _row_range(view) -> tuple | None:
    """(a, b) of ``slice(base, 0, a, b)``, else None."""
    if view.target is aten.slice.Tensor and len(view.args) == 4 and view.args[1] == 0:
        return view.args[2], view.args[3]
    return None


def _rows_are_vocab(weight, vocab: int) -> bool:
    value = _val(weight)
    return value is not None and value.dim() == 2 and value.shape[0] == vocab
