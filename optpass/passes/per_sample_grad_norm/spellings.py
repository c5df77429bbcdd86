"""per_sample_grad_norm's norm spellings: the ways a per-sample 2-norm is written, each read as the
[B] squared norm the pass computes without the per-sample gradient.

A per-sample gradient P (labelled: "b" the sample, the weight's atoms elsewhere) reaches its norm as

  * ``sum(pow(v, 2), dims)`` / ``sum(mul(v, v), dims)``, views allowed between the square and the sum
    (``g.flatten(1).pow(2).sum(1)``, ``g.square().sum((1, 2))``, ``(g * g).flatten(1).sum(1)``),
    and ``mul(v1, v2)`` of two views of P with the same labels (``g.flatten(1) * g.flatten(1)``);
  * ``linalg_vector_norm(v, 2, dims)`` (``g.norm(2, dim=...)``, ``torch.linalg.vector_norm``,
    ``torch.linalg.norm(g, dim=...)``, ``g.norm()`` inside the vmapped function): the square root;
  * ``bmm(v1 [B, 1, N], v2 [B, N, 1])`` of two views of P with the same atoms (``einsum("bi,bi->b")``);

where ``dims`` are exactly the dimensions that are not the sample's (keepdim or not). A norm over a
``cat`` / ``stack`` of per-sample tensors along a dimension that is not the batch's (Opacus's
flattened-and-concatenated spelling) is first split into the sum of each piece's squared norm
(``split_concatenated_norms``): the same value, without the concatenated copy, and each piece's
square then reads as above (docs/design.md §56).
"""

from __future__ import annotations

import torch
import torch.fx

from optpass.passes.per_sample_grad_norm.candidate import _shape, Labels

aten = torch.ops.aten

WORKING_SPELLINGS = ("norms are recognised written as g.flatten(1).pow(2).sum(1), (g * g).sum(dims), "
                     "torch.linalg.vector_norm(g.flatten(1), dim=1) or g.norm(2, dim=...) over every dimension "
                     "but the batch's, per weight or over a torch.stack / torch.cat of them, and the clipped sum "
                     "as torch.einsum('b,b...->...', coef, g) (docs/dp_sgd.md)")

_VECTOR_NORMS = {aten.linalg_vector_norm.default, aten.norm.ScalarOpt_dim}


def squared_norm_use(user: torch.fx.Node, value: torch.fx.Node, labels: Labels, size_of, follow):
    """('norm', consumer, root) if ``user`` (reading ``value``, labelled ``labels``) starts a per-sample
    norm spelled as this module lists for one value; ``root`` is True where the consumer is the norm
    (its square root), False where it is the squared norm. ``follow(node, labels)`` lists a labelled
    node's uses as ``_labelled_uses`` does. None otherwise."""
    if (user.target is aten.pow.Tensor_Scalar and user.args[0] is value and user.args[1] == 2) or (
            user.target is aten.mul.Tensor and user.args[0] is value and user.args[1] is value):
        return squared_then_summed(user, labels, size_of, follow)
    if user.target in _VECTOR_NORMS and user.args[0] is value and user.kwargs.get("dtype") is None:
        order = _arg(user, 1, "ord" if user.target is aten.linalg_vector_norm.default else "p", 2)
        if _is_two(order) and _over_all_but_the_sample(_arg(user, 2, "dim", None), labels):
            return ("norm", user, True)
    return None


def squared_then_summed(square: torch.fx.Node, labels: Labels, size_of, follow):
    """('norm', sum, False) if the elementwise square ``square`` (labelled as its operand) is read only,
    through views, by one sum over every dimension but the sample's; else None."""
    uses = follow(square, labels)
    if len(uses) != 1:
        return None
    total, _, total_labels, _ = uses[0]
    if total.target is aten.sum.dim_IntList and total.kwargs.get("dtype") is None \
            and _over_all_but_the_sample(total.args[1], total_labels):
        return ("norm", total, False)
    return None


def paired_squared_norm(user: torch.fx.Node, reads, size_of, follow):
    """('norm', consumer, False) for a user that reads two different views of one per-sample gradient
    (``reads``: its (value, labels) pairs): ``mul(v1, v2)`` with the same labels then summed, or
    ``bmm(v1 [B, 1, N], v2 [B, N, 1])`` of the same atoms (einsum's self dot product). None otherwise."""
    if len(reads) != 2 or len(user.args) < 2 or set(user.args[:2]) != {value for value, _ in reads}:
        return None
    by_value = dict(reads)
    first, second = by_value[user.args[0]], by_value[user.args[1]]
    if user.target is aten.mul.Tensor and first == second:
        return squared_then_summed(user, first, size_of, follow)
    if user.target is aten.bmm.default and len(first) == len(second) == 3 and first[0] == second[0] == ("b",) \
            and first[1] == () == second[2] and first[2] == second[1] and first[2]:
        return ("norm", user, False)
    return None


def split_concatenated_norms(step, concatenations) -> bool:
    """Rewrite each norm over all but dimension 0 of ``cat(pieces, d)`` / ``stack(pieces, d)``, d != 0,
    as the sum of the pieces' squared norms (its square root for a norm): the same value without the
    concatenated copy. ``concatenations`` are cat/stack nodes one of whose pieces is a per-sample
    gradient with the sample at dimension 0. Only a concatenation read by nothing but such norms is
    split. Returns whether anything changed."""
    changed = False
    for joined in concatenations:
        pieces, dim = joined.args[0], joined.args[1] if len(joined.args) > 1 else joined.kwargs.get("dim", 0)
        shape = _shape(joined)
        if shape is None or len(shape) < 2 or dim % len(shape) == 0 or not all(
                isinstance(piece, torch.fx.Node) and (_shape(piece) or [None])[0] == shape[0] for piece in pieces):
            continue
        labels = [("b",)] + [(f"x{d}",) for d in range(1, len(shape))]
        sizes = {"b": shape[0], **{f"x{d}": size for d, size in enumerate(shape) if d}}
        norms = [squared_norm_use(user, joined, labels, sizes, _direct_users) for user in joined.users]
        if not norms or None in norms:
            continue
        for _, consumer, root in {id(n[1]): n for n in norms}.values():
            with step.graph.inserting_before(consumer):
                total = None
                for piece in pieces:
                    squares = step.emit(aten.pow.Tensor_Scalar, piece, 2)
                    part = step.emit(aten.sum.dim_IntList, squares, list(range(1, len(_shape(piece)))))
                    total = part if total is None else step.emit(aten.add.Tensor, total, part)
                replace_norm(step.emit, consumer, total, root)
            step.graph.erase_node(consumer)
        for square in [user for user in joined.users if not user.users]:
            step.graph.erase_node(square)
        step.graph.erase_node(joined)                  # read by nothing now: no longer a use of its pieces
        changed = True
    return changed


def replace_norm(emit, consumer: torch.fx.Node, squared: torch.fx.Node, root: bool) -> None:
    """Have ``consumer``'s readers read ``squared`` (the [B] squared norms, emitted at the insert point)
    in its place: its square root where the consumer is the norm, viewed to the consumer's shape
    (keepdim, einsum's [B, 1, 1]) and cast to its dtype."""
    if root:
        squared = emit(aten.sqrt.default, squared)
    if _shape(squared) != _shape(consumer):
        squared = emit(aten.view.default, squared, _shape(consumer))
    if squared.meta["val"].dtype != consumer.meta["val"].dtype:
        squared = emit(aten._to_copy.default, squared, dtype=consumer.meta["val"].dtype)
    consumer.replace_all_uses_with(squared)


def _direct_users(node, labels):
    """A concatenation's square is summed directly (no views followed): (user, node, labels, None)."""
    return [(user, node, labels, None) for user in node.users]


def _arg(node, index, name, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _is_two(order) -> bool:
    return isinstance(order, (int, float)) and not isinstance(order, bool) and order == 2


def _over_all_but_the_sample(dims, labels: Labels) -> bool:
    """Do ``dims`` (an int or a list) reduce exactly the dimensions that are not the sample's, with the
    sample alone in its dimension?"""
    if dims is None or dims == []:                       # None and [] reduce every dimension
        return False
    dims = [dims] if isinstance(dims, int) else list(dims)
    batch = [d for d, group in enumerate(labels) if "b" in group]
    if len(batch) != 1 or labels[batch[0]] != ("b",) or not all(isinstance(d, int) for d in dims):
        return False
    return {d % len(labels) for d in dims} == set(range(len(labels))) - set(batch) and len(set(dims)) == len(dims)
