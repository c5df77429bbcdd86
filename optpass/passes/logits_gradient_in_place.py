"""Pass logits_gradient_in_place: a loss's gradient of the logits is written over the logits.

Precondition: Inductor's lowering (there the backward of ``cross_entropy`` is pointwise ops), and
a backward value ``dY`` of at least 1 MiB that a GEMM reads (the gradient of a language model's
``[tokens, vocab]`` logits, read by the head's weight- and input-gradient GEMMs), made by pointwise
ops and index-keeping views (its cone) from exactly one value ``L`` of its size and dtype that is
made in the step (the logits GEMM's result), and from smaller values (the per-token max and
log-sum-exp, the targets). Nothing reads ``L``, or what the cone makes of it, after ``dY``, once
the forward values that do and need nothing made after ``dY`` move before it.

Inductor allocates ``dY`` beside ``L`` although ``dY``'s kernel is ``L``'s last reader: its
in-place reuse of a dying input refuses a buffer that a later in-place write of the weight
``L`` was made from (the head's update, in backward or after it) is ordered after (a "fake" weak
dependency on ``L``, Inductor's scheduler, torch 2.13), and a kernel fused with the reductions
that read ``L`` at other indices. So two ``[tokens, vocab]`` buffers are alive at once: the step's
peak on a language model whose head is updated in backward (HF Llama, vocab 32000, 128 tokens:
2 x 15.6 MiB).

Rewrite: right after ``dY``, ``copy_(view(L), view(dY))`` (a view as the destination: Inductor
writes a copy into a view through the buffer's storage, where a copy into an intermediate buffer
itself only renames the source's buffer), and ``dY``'s readers read the written ``L``. Inductor
orders the write after every earlier reader of ``L`` and computes ``dY`` into ``L``'s storage.

Effect: one ``[tokens, vocab]`` buffer instead of two at the loss's backward (Llama above: the
step's live peak falls by 15.6 MiB; bench/lm_memory.py), with the same kernels (the write is
fused into ``dY``'s). Numerics: unchanged (the same ops).

Refuses: nothing. Skips (with the reason) the eager lowering, a gradient under 1 MiB, a cone with
a random op, two or no sources of ``dY``'s size, a source that is an input or a view, a reader of
``L`` after ``dY`` that needs a value made after ``dY`` (a forward value the graph computes late,
such as the loss's picked log-probability with the update after backward, moves before ``dY``),
a returned value that reads ``L``, and another ``[tokens, vocab]`` value made from ``L`` besides
the loss (a softmax of the logits for a metric: Inductor's C++ backend failed to compile the write
beside it, torch 2.13).

    before:                                      after:
      L = mm(x, t(W))                              L = mm(x, t(W))
      m = amax(L); s = sum(exp(L - m))             m = amax(L); s = sum(exp(L - m))
      dY = exp(L - m - log(s)) - onehot(y)         dY = exp(L - m - log(s)) - onehot(y)
      dW = mm(permute(dY), x)                      dL = view(copy_(view(L, [1, T, V]), view(dY, [1, T, V])), [T, V])
                                                   dW = mm(permute(dL), x)
"""

from __future__ import annotations

import torch
import torch.fx

from optpass.passes._graph_utils import (has_fused_loss_backward, is_elementwise, is_random_or_effectful, live_users,
                                        tensor_value)
from optpass.step import BACKWARD, REGION_KEY, is_view

aten = torch.ops.aten

MIN_BYTES = 2 ** 20          # a smaller logits gradient is not worth a rewrite in the graph a reader sees
# Views Inductor inlines with the element's index kept (a contiguous tensor's reshape, an expand of
# a per-token value along the vocabulary).
_INDEX_KEEPING_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
                        aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default}
_GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default}


def run(step, options) -> str | None:
    if options.lower != "inductor":
        return f"Inductor's lowering only (lower={options.lower!r} keeps the loss's backward one op)"
    candidates = [n for n in step.graph.nodes if _is_realized_backward_gradient(step, n)]
    rewritten, reasons = 0, []
    for gradient in candidates:
        reason = _rewrite(step, gradient)
        if reason is None:
            rewritten += 1
        else:
            reasons.append(f"{gradient.name}: {reason}")
    if not rewritten:
        if not reasons and has_fused_loss_backward(step.graph):
            return ("the loss's backward is one op in this graph (the aten graph optpass.explain sees); Inductor's "
                    "lowering decomposes it into pointwise ops, where this pass writes the logits gradient over the "
                    "logits")
        return "; ".join(reasons) or f"no pointwise gradient of {MIN_BYTES // 2 ** 20} MiB or more read by a GEMM"
    step.notes.append(f"{rewritten} logits gradient(s) written over the logits")
    return None


def _is_realized_backward_gradient(step, node: torch.fx.Node) -> bool:
    """A pointwise backward value of at least MIN_BYTES that a GEMM reads (so Inductor makes it a
    buffer of its own)."""
    value = tensor_value(node)
    return (step.region_of(node) == BACKWARD and is_elementwise(node) and value is not None
            and value.is_floating_point() and value.numel() * value.element_size() >= MIN_BYTES
            and _read_by_gemm(node))


def _read_by_gemm(node: torch.fx.Node) -> bool:
    return any(u.target in _GEMMS or (is_view(u) and _read_by_gemm(u)) for u in node.users)


def _rewrite(step, gradient: torch.fx.Node) -> str | None:
    cone, sources = _cone(gradient)
    if cone is None:
        return sources
    value = tensor_value(gradient)
    same_size = [s for s in sources if _size_of(s, value)]
    if len(same_size) != 1:
        return f"{len(same_size)} values of its size make it (one, the logits, is overwritten)"
    logits = same_size[0]
    if logits.op != "call_function" or is_view(logits):
        return f"made from {logits.name}, an input or a view, which it cannot overwrite"
    if not tensor_value(logits).is_contiguous() or not value.is_contiguous():
        return f"{logits.name} or the gradient is not contiguous"
    made_from_gradient, made_from_logits = _descendants(gradient), _descendants(logits)
    before_gradient = _ancestors(gradient)
    position = {n: i for i, n in enumerate(step.graph.nodes)}
    # what reads the logits' buffer when it runs: the logits, their views, and the cone's values
    # made from them (Inductor inlines those into their readers)
    holders = {logits} | _views_of(logits) | (cone & made_from_logits)
    for reader in {u for n in holders for u in live_users(n)} - holders - made_from_gradient:
        if reader.op == "output":
            return "the step returns a value that reads the logits after their gradient is made"
        if position[reader] > position[gradient] and not _move_before(reader, gradient, position, made_from_gradient):
            return f"{reader.name} reads the logits after their gradient is made, and needs what is made after it"
        if reader not in before_gradient and _size_of(reader, value):
            # another use of the whole logits (a softmax, a copy): Inductor's C++ backend failed to
            # compile such a step with the write (a KeyError in its outer-loop fusion, torch 2.13)
            return (f"{reader.name} ({reader.target}) makes another [tokens, vocab] value of the logits "
                    "besides the loss")
    shape = list(value.shape)
    with step.graph.inserting_before(gradient.next):
        # A view (not the buffer itself) as the destination: Inductor writes a copy into a view
        # through the buffer's storage, where a copy into an intermediate buffer itself only
        # renames the source's buffer.
        written = step.emit(aten.copy_.default, step.emit(aten.view.default, logits, [1, *shape]),
                            step.emit(aten.view.default, gradient, [1, *shape]))
        result = step.emit(aten.view.default, written, shape)
    for node in (written, result, *written.args):
        node.meta[REGION_KEY] = BACKWARD
    for user in list(gradient.users):
        if user is not written.args[1]:
            user.replace_input_with(gradient, result)
    return None


def _cone(gradient: torch.fx.Node):
    """(the pointwise ops and index-keeping views that make `gradient`, the values they read from
    outside), or (None, why it is not such a value)."""
    cone, sources, stack = set(), set(), [gradient]
    while stack:
        node = stack.pop()
        if node in cone or node in sources:
            continue
        if is_elementwise(node) or node.target in _INDEX_KEEPING_VIEWS:
            if is_random_or_effectful(node):
                return None, f"{node.name} ({node.target}) draws random numbers or has a side effect"
            cone.add(node)
            stack.extend(node.all_input_nodes)
        else:
            sources.add(node)
    return cone, sources


def _views_of(node: torch.fx.Node) -> set[torch.fx.Node]:
    return _reachable(node, lambda n: [u for u in n.users if is_view(u)])


def _size_of(node: torch.fx.Node, like: torch.Tensor) -> bool:
    value = tensor_value(node)
    return value is not None and value.numel() == like.numel() and value.dtype == like.dtype


def _descendants(node: torch.fx.Node) -> set[torch.fx.Node]:
    return _reachable(node, lambda n: n.users)


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    return _reachable(node, lambda n: n.all_input_nodes)


def _reachable(node: torch.fx.Node, neighbours) -> set[torch.fx.Node]:
    found, stack = set(), [node]
    while stack:
        for other in neighbours(stack.pop()):
            if other not in found:
                found.add(other)
                stack.append(other)
    return found


def _move_before(node: torch.fx.Node, anchor: torch.fx.Node, position: dict, made_from_anchor: set) -> bool:
    """Move `node`, and what it reads that comes after `anchor`, to just before `anchor` (a forward
    value the graph computes late, such as the loss's picked log-probability when the update runs
    after backward); False, moving nothing, if any of it is made from `anchor`."""
    late, stack = [], [node]
    while stack:
        current = stack.pop()
        if current in late or position[current] < position[anchor]:
            continue
        if current in made_from_anchor or current is anchor or current.op != "call_function" or current.is_impure():
            return False
        late.append(current)
        stack.extend(current.all_input_nodes)
    for moved in sorted(late, key=position.__getitem__):
        anchor.prepend(moved)
    order = {n: i for i, n in enumerate(anchor.graph.nodes)}
    position.update(order)
    return True
