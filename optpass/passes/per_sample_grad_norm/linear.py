"""per_sample_grad_norm for Linear weights: the per-sample outer product over tokens (bmm of Gᵀ and
X), a weight used several times as one sum, and when to keep one materialized."""

from __future__ import annotations

import torch
import torch.fx

from optpass.passes.per_sample_grad_norm.candidate import (_Candidate, _coef_column, _contiguous, _flat_view, _rank, _shape)
from optpass.passes.per_sample_grad_norm.labels import _labelled_uses

aten = torch.ops.aten


def _is_outer_product_over_tokens(node: torch.fx.Node) -> bool:
    """bmm([B, out, T], [B, T, in]); or, with T = 1, the broadcast mul([B, out, 1], [B, 1, in])
    that Inductor's decompositions turn such a bmm into."""
    if node.target is aten.bmm.default:
        return all(_rank(a) == 3 for a in (node, *node.args[:2]))
    if node.target is aten.mul.Tensor and all(_rank(a) == 3 for a in (node, *node.args[:2])):
        (b0, out, t0), (b1, t1, in_) = _shape(node.args[0]), _shape(node.args[1])
        return b0 == b1 and t0 == t1 == 1 and _shape(node) == [b0, out, in_]
    return False


def _outermost_sums(step, candidates: list[_Candidate], materialize: str) -> list[_Candidate]:
    """Sums of two per-sample gradients, then sums of those with a third, and so on: the sums that
    are not themselves part of a larger one, each with ``parts`` = every candidate root inside it."""
    pending, outermost = list(candidates), {}
    while True:
        sums = _sum_candidates(step, pending, materialize)
        if not sums:
            return list(outermost.values())
        used = {part for summed in sums for part in summed.parts}       # direct parts, before flattening
        for summed in sums:
            flat = []
            for part in summed.parts:
                inner = outermost.pop(part, None)
                flat.extend(inner.parts if inner is not None else (part,))
            summed.parts = tuple(flat)
            outermost[summed.root] = summed
        pending = [c for c in pending if c.root not in used] + sums


def _sum_candidates(step, candidates: list[_Candidate], materialize: str) -> list[_Candidate]:
    """A weight used twice: ``add(P1, P2)`` of two per-sample gradients (views of them with the same
    labels). Each is a sum over its tokens of outer products g_tᵀ x_t (a Linear's G and X; an
    Embedding's one-hot ids and token gradients), so their sum is one over the tokens of both:
    X = cat(X1, X2), G = cat(G1, G2) along T, and the norm op and the clipped GEMM apply as they are."""
    reaching: dict[torch.fx.Node, list] = {}
    for candidate in candidates:
        if candidate.outer is None or candidate.refuse:
            continue
        for user, value, labels, state in _labelled_uses(candidate.root, candidate.labels, candidate.size_of,
                                                         candidate.through):
            if user.target is aten.add.Tensor and len(user.args) == 2 and not user.kwargs:
                reaching.setdefault(user, []).append((candidate, value, labels, state))
    sums = []
    for add, parts in reaching.items():
        if len(parts) != 2 or {value for _, value, _, _ in parts} != set(add.args):
            continue
        (first, _, labels, state1), (second, _, labels2, state2) = parts
        if labels != labels2 or first.root is second.root or _shape(add) is None \
                or any(first.size_of[a] != second.size_of[a] for a in "brc"):
            continue
        sums.append(_summed_candidate(step, add, labels, first.size_of, ((first, state1), (second, state2)),
                                      materialize))
    return sums


def _summed_candidate(step, add, labels, size_of, parts, materialize: str) -> _Candidate:
    emit = step.emit
    batch, rows, columns = size_of["b"], size_of["r"], size_of["c"]
    made = {}

    def outer(_):
        if not made:                              # both uses' tensors exist before the add
            with step.graph.inserting_before(add):
                pieces = [candidate.outer(state) for candidate, state in parts]
                made["x"] = emit(aten.cat.default, [x for x, _ in pieces], 1)
                made["g"] = emit(aten.cat.default, [g for _, g in pieces], 1)
        return made["x"], made["g"]

    tokens = sum(candidate.tokens for candidate, _ in parts)
    keep = _keep_materialized(tokens, columns, rows, materialize)
    what = (f"per-sample gradient [B={batch}, {rows}, {columns}] of a weight used more than once "
            f"({parts[0][0].root.name} + {parts[1][0].root.name})")
    return _Candidate(what=what, root=add, labels=labels, size_of=size_of,
                      norm=lambda state: _outer_norm(emit, *outer(state)),
                      clipped_sum=lambda coef, state: _outer_clipped_sum(emit, *outer(state), coef),
                      keep=keep, parts=tuple(candidate.root for candidate, _ in parts),
                      outer=outer, tokens=tokens, uses=tuple(use for candidate, _ in parts for use in candidate.uses))


def _linear_candidate(step, bmm: torch.fx.Node, materialize: str = "auto") -> _Candidate:
    g_t, x = bmm.args[0], bmm.args[1]                       # [B, out, T], [B, T, in]
    batch, out_features, in_features = _shape(bmm)
    emit = step.emit
    keep = _keep_materialized(_shape(x)[1], in_features, out_features, materialize)

    def outer(state):
        return x, emit(aten.permute.default, g_t, [0, 2, 1])                             # [B, T, in], [B, T, out]

    return _Candidate(what=f"per-sample gradient [B={batch}, {out_features}, {in_features}]", root=bmm,
                      labels=[("b",), ("r",), ("c",)],
                      size_of={"b": batch, "r": out_features, "c": in_features},
                      norm=lambda state: _outer_norm(emit, *outer(state)),
                      clipped_sum=lambda coef, state: _outer_clipped_sum(emit, *outer(state), coef),
                      keep=keep, outer=outer, tokens=_shape(x)[1], uses=(("Linear", x, g_t),))


def _outer_norm(emit, x, g):
    """[B] squared norms of sum_t g_tᵀ x_t, x [B, T, C], g [B, T, R]: the norm op."""
    return emit(torch.ops.optpass.per_sample_grad_sq_norm.default, x, g, "auto")


def _outer_clipped_sum(emit, x, g, coef):
    """sum_b coef_b sum_t g_btᵀ x_bt [R, C] as ONE GEMM over the B·T rows (book-keeping)."""
    batch, tokens, columns = _shape(x)
    rows_of_g = _shape(g)[2]
    c = _coef_column(emit, coef, batch)
    scaled = emit(aten.view.default, _contiguous(emit, emit(aten.mul.Tensor, g, c)), [batch * tokens, rows_of_g])
    rows = _flat_view(emit, x, [batch * tokens, columns])                               # no copy when contiguous
    return emit(aten.mm.default, emit(aten.permute.default, scaled, [1, 0]), rows)       # [R, C]


def _keep_materialized(tokens, in_features, out_features, materialize: str) -> str | None:
    """dp_materialize='auto': why a Linear's [B, out, in] per-sample gradient is better left as it is,
    or None. Book-keeping keeps the layer's X [B, T, in] and G [B, T, out] alive until the clip
    coefficients are known (after the whole backward) and pays one more weight-gradient GEMM; the
    per-sample gradient costs B·out·in and its clipped sum is a GEMV. So when T·(in+out) >= in·out
    (long sequences on narrow layers, fastDP's "mixed" choice) materializing is no larger AND faster
    (bench/dp.py, T = 128: materializing the 256x256 layers, a tie, made the step 1.44x -> 1.25x of
    non-private at the same memory)."""
    if materialize != "auto" or not all(isinstance(v, int) for v in (tokens, in_features, out_features)):
        return None                                          # 'never', or symbolic sizes: rewrite (bounded memory)
    kept, materialized = tokens * (in_features + out_features), out_features * in_features
    if kept < materialized:
        return None
    return (f"kept materialized (dp_materialize='auto'): per sample, out·in = {materialized} elements is "
            f"no more than the T·(in+out) = {kept} of X and G that book-keeping keeps until the clip "
            "coefficients are known, and it saves one GEMM; options={'dp_materialize': 'never'} "
            "rewrites it anyway")
