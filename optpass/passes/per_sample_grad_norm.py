"""Pass per_sample_grad_norm: DP-SGD's per-sample Linear gradients without [B, out, in] tensors.

Precondition: a graph of a DP-SGD step written with ``torch.func.vmap(grad(...))``
(DESIGN.md fact 17): each Linear weight's per-sample gradient is
``P = bmm(Gᵀ [B, out, T], X [B, T, in]) -> [B, out, in]``, and P is used only
(through views) by
  * its per-sample squared norm: ``sum(pow(view(P, [B, -1]), 2), dim=1)`` -> [B], and
  * the clipped sum ``einsum("b,b...->...", coef, P)``, lowered as a ``bmm`` that
    contracts the batch dimension (or as ``sum(mul(P, coef), dim=b)``).

Rewrite, per such weight:
  * the squared norm becomes ``optpass::per_sample_grad_sq_norm(X, G, "auto")``
    (optpass/kernels): a fused Triton kernel on CUDA (direct, or ghost norm
    <X Xᵀ, G Gᵀ> when 2T² <= in·out, fact 18), a memory-bounded torch path on CPU;
  * the clipped sum becomes ONE GEMM over B·T rows: ``(coef ⊙ G)ᵀ X``
    (book-keeping: no second backward).
  After both, P has no users and disappears: no [B, out, in] intermediate remains.

How uses are recognised: every view, permute, transpose, (un)squeeze or same-shape
expand of P is followed with dimension labels (b, o, i), so a consumer is known to
reduce over exactly "everything but b" (the norm) or to contract exactly b (the
clipped sum), whatever chain of views the tracer produced.

Effect: per-sample norms and the clipped sum cost O(B·T·(in + out)) memory instead
of O(B·out·in); numerics equal up to floating-point rounding.

Leaves alone (the outcome's notes say why): a per-sample gradient with any other use
(e.g. returned, or clipped per layer), and bmm's that are not per-sample gradients.
Bias / LayerNorm / Embedding per-sample gradients are already cheap in the traced
graph (sums over T, no [B, out, in]) and are kept as they are.

    before:                                    after:
      P = bmm(t(G), X)          # [B, out, in]   n = per_sample_grad_sq_norm(X, G)
      n = sum(pow(view(P, [B, -1]), 2), [1])     w = mm(t(view(G * c, [B*T, out])), view(X, [B*T, in]))
      w = bmm(view(c, [1, 1, B]), view(P, [1, B, -1]))
"""

from __future__ import annotations

import math

import torch
import torch.fx

import optpass.kernels.per_sample_norm  # noqa: F401  (registers torch.ops.optpass.*)

aten = torch.ops.aten
Labels = list[tuple[str, ...]]   # one tuple of atomic labels per dimension

_SAME_LABELS = {aten.clone.default, aten.alias.default, aten.detach.default}


def run(step, options) -> str | None:
    graph = step.graph
    rewritten = 0
    for node in list(graph.nodes):
        if _is_outer_product_over_tokens(node):
            why_not = _rewrite(step, node)
            if why_not is None:
                rewritten += 1
            elif why_not:
                step.notes.append(f"{node.name}: {why_not}")
    if not rewritten:
        return "; ".join(step.notes) or "no per-sample weight gradient (bmm of Gᵀ and X) used for norms"
    graph.eliminate_dead_code()
    return None


def _is_outer_product_over_tokens(node: torch.fx.Node) -> bool:
    """bmm([B, out, T], [B, T, in]); or, with T = 1, the broadcast mul([B, out, 1], [B, 1, in])
    that Inductor's decompositions turn such a bmm into."""
    if node.target is aten.bmm.default:
        return all(_rank(a) == 3 for a in (node, *node.args[:2]))
    if node.target is aten.mul.Tensor and all(_rank(a) == 3 for a in (node, *node.args[:2])):
        (b0, out, t0), (b1, t1, in_) = _shape(node.args[0]), _shape(node.args[1])
        return b0 == b1 and t0 == t1 == 1 and _shape(node) == [b0, out, in_]
    return False


def _shape(node) -> list[int] | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return list(value.shape) if isinstance(value, torch.Tensor) else None


def _rank(node) -> int:
    shape = _shape(node)
    return -1 if shape is None else len(shape)


# ---------------------------------------------------------------- labels through views

def _sizes(labels: Labels, size_of: dict[str, int]) -> list[int]:
    return [math.prod(size_of[a] for a in group) for group in labels]


def _regroup(labels: Labels, shape: list[int], size_of: dict[str, int]) -> Labels | None:
    """Labels after a view/reshape to `shape`: merge or keep atomic labels, never split one."""
    atoms = [a for group in labels for a in group]
    result, index = [], 0
    for size in shape:
        group, product = [], 1
        while product < size and index < len(atoms):
            group.append(atoms[index])
            product *= size_of[atoms[index]]
            index += 1
        if product != size:
            return None
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


def _labelled_uses(root: torch.fx.Node, labels: Labels, size_of):
    """(user, labels of the value it reads) for every non-view use of root's view closure."""
    stack, uses = [(root, labels)], []
    while stack:
        node, node_labels = stack.pop()
        for user in node.users:
            followed = _follow(user, node_labels, size_of) if user.args and user.args[0] is node else None
            if followed is not None:
                stack.append((user, followed))
            else:
                uses.append((user, node, node_labels))
    return uses


# ---------------------------------------------------------------- the rewrite

def _rewrite(step, bmm: torch.fx.Node) -> str | None:
    """Rewrite one bmm's norm and clipped-sum uses; '' if it is no DP pattern, a reason if it is
    one that cannot be rewritten, None when done."""
    g_t, x = bmm.args[0], bmm.args[1]                       # [B, out, T], [B, T, in]
    batch, out_features, in_features = _shape(bmm)
    size_of = {"b": batch, "o": out_features, "i": in_features}
    uses = [(user, _classify(user, value, labels))
            for user, value, labels in _labelled_uses(bmm, [("b",), ("o",), ("i",)], size_of)]
    if not any(kind for _, kind in uses):
        return ""                                             # not a per-sample gradient norm
    other = next((user for user, kind in uses if kind is None), None)
    if other is not None:
        return (f"per-sample gradient [B={batch}, {out_features}, {in_features}] is also used by "
                f"{other.name} ({other.target}); only its squared norm and a coefficient-weighted sum "
                "over the batch can be computed without materializing it")

    graph, emit = step.graph, step.emit

    def contiguous(node):
        return emit(aten.clone.default, node, memory_format=torch.contiguous_format)

    for _, kind in uses:
        if kind[0] == "norm":
            total = kind[1]
            with graph.inserting_before(total):
                g = emit(aten.permute.default, g_t, [0, 2, 1])                           # [B, T, out]
                norm = emit(torch.ops.optpass.per_sample_grad_sq_norm.default, x, g, "auto")
                if norm.meta["val"].dtype != total.meta["val"].dtype:
                    norm = emit(aten._to_copy.default, norm, dtype=total.meta["val"].dtype)
            total.replace_all_uses_with(norm)
        else:
            _, result, coef, layout = kind
            with graph.inserting_before(result):
                tokens = batch * _shape(x)[1]
                c = emit(aten.view.default, contiguous(coef), [batch, 1, 1])
                g = emit(aten.permute.default, g_t, [0, 2, 1])                           # [B, T, out]
                scaled = emit(aten.view.default, contiguous(emit(aten.mul.Tensor, g, c)), [tokens, out_features])
                rows = emit(aten.view.default, contiguous(x), [tokens, in_features])
                weight = emit(aten.mm.default, emit(aten.permute.default, scaled, [1, 0]), rows)  # [out, in]
                if layout == ("i", "o"):
                    weight = contiguous(emit(aten.permute.default, weight, [1, 0]))
                new = emit(aten.view.default, weight, _shape(result))
            result.replace_all_uses_with(new)
    return None


def _classify(user: torch.fx.Node, value: torch.fx.Node, labels: Labels):
    """('norm', sum node) | ('sum', result node, coef node, (o, i) order) | None."""
    # squared norm: pow(v, 2) or mul(v, v), then a sum over every dim but b
    if (user.target is aten.pow.Tensor_Scalar and user.args[1] == 2) or (
            user.target is aten.mul.Tensor and user.args[0] is value and user.args[1] is value):
        if len(user.users) != 1:
            return None
        total = next(iter(user.users))
        if total.target is aten.sum.dim_IntList and not (total.args[2:] and total.args[2]) \
                and not total.kwargs.get("keepdim", False):
            batch_dims = [d for d, group in enumerate(labels) if "b" in group]
            if len(batch_dims) == 1 and labels[batch_dims[0]] == ("b",):
                reduced = {d % len(labels) for d in total.args[1]}
                if reduced == set(range(len(labels))) - set(batch_dims):
                    return ("norm", total)
        return None
    # clipped sum: bmm(coef [1, 1, B], v [1, B, o·i]) contracting b
    if user.target is aten.bmm.default and user.args[1] is value and len(labels) == 3 \
            and labels[0] == () and labels[1] == ("b",) and set(labels[2]) == {"o", "i"}:
        coef = user.args[0]
        coef_shape = _shape(coef)
        if coef_shape is not None and coef_shape[:2] == [1, 1]:
            return ("sum", user, coef, labels[2])
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
            if set(rest) == {"o", "i"}:
                return ("sum", total, coef, rest)
    return None


def size_of_batch(labels: Labels, coef_shape: list[int], batch_dim: int) -> int:
    """coef must be [.., B, ..] with B at the batch dimension of v and 1 elsewhere; else -1."""
    if len(coef_shape) != len(labels) or any(size != 1 for d, size in enumerate(coef_shape) if d != batch_dim):
        return -1
    return coef_shape[batch_dim]
