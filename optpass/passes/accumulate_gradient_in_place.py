"""Pass accumulate_gradient_in_place: a gradient summed from a GEMM and an embedding's scatter is
built in one buffer, the GEMM computed where the sum is.

Precondition: ``optimizer_in_backward`` (the update of each parameter follows its final
gradient), and a parameter whose gradient is the sum of two contributions, one of them an
embedding's backward: a zero-filled ``[num_embeddings, dim]`` tensor that the looked-up rows'
output gradients are scattered into (``embedding_dense_backward``, or Inductor's decomposition
``_unsafe_masked_index_put_accumulate(full(0), mask, [indices], values)``), the other anything of
the same shape and dtype that nothing else reads. That is a weight tied between the input
embedding and the output head (GPT-2's ``lm_head.weight = wte.weight``): autograd adds the head's
contribution, made first in backward, to the embedding's, made last.

Rewrite: the scatter writes into the other contribution instead of into zeros, and the add
goes. When that contribution is a computation whose inputs are smaller than its result (the
head's GEMM ``mm(dlogits^T, x)``: a [vocab, dim] result from [tokens, vocab] and [tokens, dim]
inputs), it and the views feeding only it move to just before the scatter: its inputs stay
alive through backward instead of its result.

Effect: a tied weight's gradient is one buffer, alive only at the end of backward, where three
were (the head's contribution from the start of backward, the zero-filled scatter, their sum)
(measured on a GPT with vocab 8192, d=768: the step's peak falls by two [vocab, dim] buffers;
``docs/optimizer_in_backward.md``). Numerics: the scattered rows are added to the head's
contribution one by one rather than summed first (rounding only; tested against eager).

Refuses: nothing. Skips a sum whose scatter scales by frequency (``scale_grad_by_freq``) or
changes dtype, or whose other contribution is read elsewhere or reads a value the step writes in
place.

    before:                                      after:
      g_head = mm(permute(dlogits), x)             ... (rest of backward) ...
      ... (rest of backward) ...                   g_head = mm(permute(dlogits), x)
      zeros = full([V, d], 0)                      g = index_put_acc(g_head, mask, [idx], dx)
      g_emb = index_put_acc(zeros, mask, [idx], dx)
      g = add(g_head, g_emb)
"""

from __future__ import annotations

import torch
import torch.fx

from optpass.analysis.memory import tensor_bytes
from optpass.passes._graph_utils import gradient_value
from optpass.step import GRADIENT_KEY, is_view

aten = torch.ops.aten
_MASKED_SCATTER = aten._unsafe_masked_index_put_accumulate.default


def run(step, options) -> str | None:
    if not options.optimizer_in_backward:
        return "not requested (options optimizer_in_backward)"
    rewritten = []
    for name, gradient in step.gradient_nodes.items():
        total = gradient_value(gradient)
        if total.target is not aten.add.Tensor or len(total.args) != 2 or total.kwargs.get("alpha", 1) != 1:
            continue
        for scatter, other in ((total.args[1], total.args[0]), (total.args[0], total.args[1])):
            if _scatters_into_zeros(scatter, total) and _may_accumulate_into(other, total):
                _accumulate_into(step, total, scatter, other)
                rewritten.append(name)
                break
    if not rewritten:
        return "no gradient sums an embedding's scatter with another contribution (no tied weight)"
    step.notes.append(f"gradient of {', '.join(rewritten)} accumulated in one buffer (embedding scatter into "
                      "the other contribution, computed at the end of backward)")
    return None


def _scatters_into_zeros(node, total: torch.fx.Node) -> bool:
    """An embedding's backward whose only reader is `total`, of `total`'s shape and dtype."""
    if not isinstance(node, torch.fx.Node) or list(node.users) != [total] or not _same_tensor_type(node, total):
        return False
    if node.target is aten.embedding_dense_backward.default:
        return len(node.args) >= 5 and not node.args[4]          # scale_grad_by_freq=False
    if node.target is _MASKED_SCATTER:
        zeros = node.args[0]
        return (isinstance(zeros, torch.fx.Node) and zeros.target is aten.full.default and zeros.args[1] == 0
                and list(zeros.users) == [node])
    return False


def _may_accumulate_into(other, total: torch.fx.Node) -> bool:
    return (isinstance(other, torch.fx.Node) and other.op == "call_function" and list(other.users) == [total]
            and _same_tensor_type(other, total))


def _same_tensor_type(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype
            and va.shape == vb.shape)


def _accumulate_into(step, total: torch.fx.Node, scatter: torch.fx.Node, other: torch.fx.Node) -> None:
    graph = step.graph
    with graph.inserting_before(total):
        if scatter.target is _MASKED_SCATTER:
            _, mask, indices, values = scatter.args
        else:                                   # embedding_dense_backward, decomposed as Inductor does it
            values, indices, num_weights, padding_idx = scatter.args[:4]
            if indices.meta["val"].dtype != torch.long:
                indices = step.emit(aten._to_copy.default, indices, dtype=torch.long)
            valid = step.emit(aten.bitwise_and.Tensor, step.emit(aten.ge.Scalar, indices, 0),
                              step.emit(aten.lt.Scalar, indices, num_weights))
            mask = step.emit(aten.bitwise_and.Tensor, valid, step.emit(aten.ne.Scalar, indices, padding_idx))
            mask = step.emit(aten.unsqueeze.default, mask, -1)
            indices = [indices]
        accumulated = step.emit(_MASKED_SCATTER, other, mask, indices, values)
    accumulated.meta.update({k: v for k, v in scatter.meta.items() if k in ("stack_trace", "autograd_backward")})
    accumulated.meta[GRADIENT_KEY] = True
    total.replace_all_uses_with(accumulated)
    for name, node in list(step.gradient_nodes.items()):
        if node is total:
            step.gradient_nodes[name] = accumulated
    graph.erase_node(total)
    zeros = scatter.args[0] if scatter.target is _MASKED_SCATTER else None
    graph.erase_node(scatter)
    if isinstance(zeros, torch.fx.Node) and not zeros.users:
        graph.erase_node(zeros)
    _compute_late(graph, other, accumulated)


def _compute_late(graph: torch.fx.Graph, result: torch.fx.Node, user: torch.fx.Node) -> None:
    """Move `result` (and the views that feed only it) to just before its one `user`, when the
    values it reads are fewer bytes than it makes and none of them is written in place."""
    chain, inputs = [result], []
    for node in chain:
        for arg in node.all_input_nodes:
            if is_view(arg) and list(arg.users) == [node] and arg.op == "call_function":
                chain.append(arg)
            else:
                inputs.append(arg)
    if any(_written_in_place(arg) for arg in inputs):
        return
    if sum(_bytes(arg) for arg in dict.fromkeys(inputs)) >= _bytes(result):
        return
    position = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(chain, key=position.__getitem__):
        user.prepend(node)


def _written_in_place(node: torch.fx.Node) -> bool:
    return node.op == "placeholder" or any(
        isinstance(u.target, torch._ops.OpOverload) and u.target._schema.is_mutable for u in node.users)


def _bytes(node: torch.fx.Node) -> int:
    value = node.meta.get("val")
    return tensor_bytes(value) if isinstance(value, torch.Tensor) else 0
