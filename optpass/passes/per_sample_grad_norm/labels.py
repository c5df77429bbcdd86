"""per_sample_grad_norm's labels: which dimensions of a value are the sample, the weight's rows
and columns, followed through views, and what each use of a per-sample gradient is."""

from __future__ import annotations

import math

import torch
import torch.fx

from optpass.passes.per_sample_grad_norm.candidate import _shape, Labels
from optpass.passes.per_sample_grad_norm.spellings import squared_norm_use

aten = torch.ops.aten


_SAME_LABELS = {aten.clone.default, aten.alias.default, aten.detach.default}


def _sizes(labels: Labels, size_of: dict[str, int]) -> list[int]:
    return [math.prod(size_of[a] for a in group) for group in labels]


def _regroup(labels: Labels, shape: list[int], size_of: dict[str, int]) -> Labels | None:
    """Labels after a view/reshape to `shape`: merge or keep atomic labels, never split one."""
    atoms = [a for group in labels for a in group]
    result, index = [], 0
    for position, size in enumerate(shape):
        group, product = [], 1
        while product < size and index < len(atoms):
            group.append(atoms[index])
            product *= size_of[atoms[index]]
            index += 1
        if product != size:
            return None
        # atoms of size 1 (a 1x1 kernel's) after a full group join it, unless a size-1 dimension comes next
        # to take them; at the last dimension every one left joins it
        if size != 1 and (position + 1 == len(shape) or shape[position + 1] != 1):
            while index < len(atoms) and size_of[atoms[index]] == 1:
                group.append(atoms[index])
                index += 1
        result.append(tuple(group))
    return result if index == len(atoms) else None


def _follow(node: torch.fx.Node, labels: Labels, size_of) -> Labels | None:
    """The labels of a view-like user of a labelled tensor, or None if it is not view-like."""
    target, args, shape = node.target, node.args, _shape(node)
    if shape is None:
        return None
    if target in _SAME_LABELS or (target is aten.expand.default and shape == _sizes(labels, size_of)):
        return labels
    if target in _REGROUPING:               # views, (un)squeeze: regroup the same atoms in order
        return _regroup(labels, shape, size_of)
    if target is aten.permute.default:
        return [labels[d] for d in args[1]]
    if target is aten.transpose.int:
        d0, d1 = args[1] % len(labels), args[2] % len(labels)
        out = list(labels)
        out[d0], out[d1] = out[d1], out[d0]
        return out
    return None


_REGROUPING = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
               aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default}


_SKIP = "skip"


def _labelled_uses(root: torch.fx.Node, labels: Labels, size_of, through=None):
    """(user, value it reads, that value's labels, state) for every non-view use of root's view
    closure. ``through(user, node, labels, state)`` may continue the walk past a user that keeps
    the labels (returning (labels, state)) or declare a use irrelevant (returning _SKIP)."""
    stack, uses = [(root, labels, None)], []
    while stack:
        node, node_labels, state = stack.pop()
        for user in node.users:
            followed = _follow(user, node_labels, size_of) if user.args and user.args[0] is node else None
            if followed is not None:
                stack.append((user, followed, state))
                continue
            special = through(user, node, node_labels, state) if through is not None else None
            if special == _SKIP:
                continue
            if special is not None:
                stack.append((user, *special))
            else:
                uses.append((user, node, node_labels, state))
    return uses


def _sum_feeds_dp_uses(user: torch.fx.Node, labels: Labels, size_of) -> bool:
    """Is ``user`` an add of this per-sample gradient (a view of it labelled ``labels``) and another
    same-shaped tensor, whose result is used by a squared norm or a clipped sum (a shared weight)?"""
    if user.target is not aten.add.Tensor or len(user.args) != 2 or not all(
            isinstance(a, torch.fx.Node) and _shape(a) == _shape(user) for a in user.args):
        return False
    return any(_classify(u, value, lab, size_of) for u, value, lab, _ in _labelled_uses(user, labels, size_of))


def _classify(user: torch.fx.Node, value: torch.fx.Node, labels: Labels, size_of):
    """('norm', consumer, root) | ('sum', result node, coef node, order of the weight's atoms) | None.
    A norm is any spelling ``spellings.squared_norm_use`` reads; ``root``: the consumer is the norm,
    not its square."""
    norm = squared_norm_use(user, value, labels, size_of,
                            lambda node, node_labels: _labelled_uses(node, node_labels, size_of))
    if norm is not None:
        return norm
    # clipped sum: bmm(coef [1, 1, B], v [1, B, r·c]) contracting b
    if user.target is aten.bmm.default and user.args[1] is value and len(labels) == 3 \
            and labels[0] == () and labels[1] == ("b",) and _weight_atoms(labels[2]):
        coef = user.args[0]
        coef_shape = _shape(coef)
        if coef_shape is not None and coef_shape[:2] == [1, 1]:
            return ("sum", user, coef, labels[2])
    # clipped sum on a GPU under Inductor, whose joint-graph pattern bmm_to_mm turns that batch-1 bmm
    # into squeezes and an mm: mm(coef [1, B], v [B, r·c])
    if user.target is aten.mm.default and user.args[1] is value and len(labels) == 2 \
            and labels[0] == ("b",) and _weight_atoms(labels[1]):
        coef = user.args[0]
        coef_shape = _shape(coef)
        if coef_shape is not None and coef_shape[0] == 1:
            return ("sum", user, coef, labels[1])
    # clipped sum, decomposed: sum(mul(v, coef broadcast along b), dim=b)
    if user.target is aten.mul.Tensor and value in user.args[:2] and len(user.users) == 1:
        coef = user.args[1] if user.args[0] is value else user.args[0]
        total = next(iter(user.users))
        batch_dims = [d for d, group in enumerate(labels) if group == ("b",)]
        coef_shape = _shape(coef)
        if (len(batch_dims) == 1 and coef_shape is not None and total.target is aten.sum.dim_IntList
                and math.prod(coef_shape) == size_of_batch(labels, coef_shape, batch_dims[0])
                and {d % len(labels) for d in total.args[1]} == set(batch_dims)):
            rest = tuple(a for d, group in enumerate(labels) if d != batch_dims[0] for a in group)
            if _weight_atoms(rest):
                return ("sum", total, coef, rest)
    return None


def _weight_atoms(atoms) -> bool:
    """Are ``atoms`` a whole weight's: rows, columns and a convolution's kernel dimensions (k0, k1, ..),
    without the sample? (Views keep every atom, so these are all of the weight's.)"""
    return {"r", "c"} <= set(atoms) and all(a in ("r", "c") or a.startswith("k") for a in atoms)


def size_of_batch(labels: Labels, coef_shape: list[int], batch_dim: int) -> int:
    """coef must be [.., B, ..] with B at the batch dimension of v and 1 elsewhere; else -1."""
    if len(coef_shape) != len(labels) or any(size != 1 for d, size in enumerate(coef_shape) if d != batch_dim):
        return -1
    return coef_shape[batch_dim]
