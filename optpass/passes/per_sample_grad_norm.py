"""Pass per_sample_grad_norm: DP-SGD's per-sample Linear and Embedding weight gradients without
[B, out, in] / [B, vocab, d] tensors.

Precondition: a graph of a DP-SGD step written with ``torch.func.vmap(grad(...))``
(docs/design.md §31) in which a weight's per-sample gradient P is used only (through
views) by
  * its per-sample squared norm: ``sum(pow(view(P, [B, -1]), 2), dim=1)`` -> [B], and
  * the clipped sum ``einsum("b,b...->...", coef, P)``, lowered as a ``bmm`` that
    contracts the batch dimension (or as ``sum(mul(P, coef), dim=b)``),
where P is one of
  * Linear weight: ``P = bmm(Gᵀ [B, out, T], X [B, T, in]) -> [B, out, in]`` (with T = 1,
    Inductor's broadcast ``mul([B, out, 1], [B, 1, in])``);
  * Embedding weight: vmap's batched embedding backward, ONE scatter of the tokens' output
    gradients g [B, T, d] into [B·vocab, d] at rows ``x_bt + b·vocab`` (viewed [B, vocab, d]):
    ``embedding_dense_backward(g, x + offsets, B·vocab, -1, False)`` in the aten graph,
    ``_unsafe_masked_index_put_accumulate(zeros, mask, [x + offsets], g)`` in Inductor's graph
    (its decomposition), offsets = ``arange(0, B·vocab, vocab)`` viewed [B, 1, ..].
    ``nn.Embedding(padding_idx=p)`` shows up as a ``select_scatter`` of zeros into row p of
    the [B, vocab, d] view; it is followed and kept exact.

Rewrite, per such weight:
  * Linear: the squared norm becomes ``optpass::per_sample_grad_sq_norm(X, G, "auto")``
    (optpass/kernels): a fused Triton kernel on CUDA (direct, or ghost norm
    <X Xᵀ, G Gᵀ> when 2T² <= in·out, docs/design.md §32), a memory-bounded torch path on CPU;
    the clipped sum becomes ONE GEMM over B·T rows: ``(coef ⊙ G)ᵀ X``
    (book-keeping: no second backward).
    Book-keeping keeps the layer's X [B, T, in] and G [B, T, out] alive until the clip
    coefficients are known. With ``dp_materialize='auto'`` (the default) a layer where that is
    at least its per-sample gradient, T·(in+out) >= in·out (long sequences on narrow layers),
    is left materialized: no larger, and one GEMM cheaper (its clipped sum is a GEMV). fastDP's
    "mixed" book-keeping makes the same per-layer switch. ``dp_materialize='never'`` rewrites
    every Linear weight.
  * Embedding: the squared norm becomes ``optpass::embedding_per_sample_grad_sq_norm(x, g, p)``
    (optpass/kernels, plain torch, memory-bounded): the Gram form
    ||E_b||² = sum_{t,t'} [x_bt == x_bt' != p] <g_bt, g_bt'> for T <= 128 tokens, else
    the sum of each distinct id's g_bt (sort + index_add), squared; the clipped sum becomes
    ONE scatter of ``coef_b · g_bt`` over the B·T tokens into [vocab, d]: ``embedding_dense_backward(..,
    vocab, p, False)`` in the aten graph, ``index_put(zeros [vocab, d], [x], .., accumulate)``
    then ``select_scatter`` of zeros into row p in Inductor's graph (ops Inductor lowers).
  After both, P has no users and disappears: no [B, out, in] / [B, vocab, d] intermediate remains.
  * A weight used more than once (a tied embedding and output head, a Linear applied k times):
    its per-sample gradient is ``add(P1, P2)`` (a chain of them for k uses). Each part is a sum
    over its tokens of outer products
    g_tᵀ x_t — a Linear's G and X, an Embedding's one-hot ids and token gradients (padding
    tokens get a zero one-hot row) — so the sum is one over the tokens of all uses:
    ``X = cat(X1, X2, ..)``, ``G = cat(G1, G2, ..)`` along T, then the same norm op and ONE GEMM.
    The one-hot [B, T, vocab] is the size of the tied head's output gradient.

How uses are recognised: every view, permute, transpose, (un)squeeze or same-shape
expand of P is followed with dimension labels (b, r, c: sample, weight rows, weight
columns), so a consumer is known to reduce over exactly "everything but b" (the norm) or
to contract exactly b (the clipped sum), whatever chain of views the tracer produced.
An Embedding's rows are recognised by their offsets ``b·vocab`` (sample b owns rows
[b·vocab, (b+1)·vocab)); the ids must also index the forward ``embedding`` of a
[vocab, d] weight, whose run-time bounds check keeps each sample in its own rows.

A symbolic batch size (``torch._dynamo.mark_dynamic``, automatic dynamic) is rewritten the same
way: no decision depends on B (``dp_materialize='auto'`` compares per-sample sizes), and the
views and GEMM the rewrite emits take B (and B·T) from the graph's inputs (``StepGraph.emit``).
With Poisson sampling, vmap itself specializes B for ``cross_entropy`` and ``nn.Embedding``;
docs/dp_sgd.md's recipe pads batches to a few static sizes instead (``optpass.pad_batch``).

Effect: per-sample norms and the clipped sum cost O(B·T·(in + out)) memory instead of
O(B·out·in) for a Linear weight, and O(B·T·d) plus a bounded chunk (Gram: O(B·T²·d)
FLOPs; segment: O(B·T·d)) instead of O(B·vocab·d) for an Embedding weight, which is
rewritten only when T < vocab (else the tokens' gradients it keeps are no smaller);
numerics equal up to floating-point rounding.

Already cheap, kept as they are (checked on TinyLM's traced graphs): a Linear bias's
per-sample gradient is ``sum(G, dim=T)`` -> [B, out]; LayerNorm's weight and bias are
``sum(x̂ ⊙ g, dim=T)`` and ``sum(g, dim=T)`` -> [B, d]; a learned position table is a
``slice_backward`` -> [B, seq, d]. Each is B × (the parameter's size), computed from
[B, T, d] tensors the backward holds anyway — a per-sample gradient cannot be smaller —
so their norms and clipped sums (``bmm`` over B) stay.

Leaves alone (the outcome's notes say why): a Linear per-sample gradient kept by
``dp_materialize='auto'`` (above); a per-sample gradient with any other use
(e.g. returned, or clipped per layer); a weight used more than once with a use this pass
cannot rewrite (the sum stays materialized and exact); an Embedding with
``scale_grad_by_freq=True`` in the aten graph (the per-sample token counts are inside
``embedding_dense_backward``; in Inductor's graph the division is explicit and the
pattern is rewritten); an Embedding with T >= vocab tokens per sample (nothing to gain);
bmm's and scatters that are not per-sample gradients.

    before (Linear):                           after:
      P = bmm(t(G), X)          # [B, out, in]   n = per_sample_grad_sq_norm(X, G)
      n = sum(pow(view(P, [B, -1]), 2), [1])     w = mm(t(view(G * c, [B*T, out])), view(X, [B*T, in]))
      w = bmm(view(c, [1, 1, B]), view(P, [1, B, -1]))

    before (Embedding, aten graph):            after:
      P = embedding_dense_backward(g, x + b·V, B·V, -1, False)   # [B·V, d]
      P = select_scatter(view(P, [B, V, d]), 0, 1, pad)          n = embedding_per_sample_grad_sq_norm(x, g, pad)
      n = sum(pow(view(P, [B, -1]), 2), [1])     w = embedding_dense_backward(view(g * c, [B*T, d]), x, V, pad, False)
      w = bmm(view(c, [1, 1, B]), view(P, [1, B, -1]))
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.fx

from optpass.kernels import embedding_norm, per_sample_norm

_REGISTERS_OPS = (embedding_norm, per_sample_norm)   # importing them registers torch.ops.optpass.*
aten = torch.ops.aten
Labels = list[tuple[str, ...]]   # one tuple of atomic labels per dimension

_SAME_LABELS = {aten.clone.default, aten.alias.default, aten.detach.default}


@dataclasses.dataclass
class _Candidate:
    """A per-sample gradient (some view of [B, R, C]) and how to compute its two DP uses cheaply.

    Atoms of ``labels``: "b" the sample, "r" the weight's rows (out / vocab), "c" its columns (in / d).
    ``norm(state)`` emits the [B] squared norms, ``clipped_sum(coef, state)`` the [R, C] sum
    sum_b coef_b P_b, both at the graph's insert point. ``through`` lets a kind follow extra
    users that keep the labels (an Embedding's padding row); the state it returns reaches both.
    """
    what: str
    root: torch.fx.Node
    labels: Labels
    size_of: dict[str, int]
    norm: Callable[[object], torch.fx.Node]
    clipped_sum: Callable[[torch.fx.Node, object], torch.fx.Node]
    through: Callable | None = None
    refuse: str | None = None        # a DP pattern this pass knows it cannot rewrite exactly
    parts: tuple = ()                # for a sum of per-sample gradients: the roots summed
    tokens: object = None            # T, the tokens per sample summed over (an int, or symbolic)
    keep: str | None = None          # a DP pattern the policy keeps materialized (dp_materialize='auto')
    outer: Callable | None = None    # state -> (X [B, T, C], G [B, T, R]) with P = sum_t G_tᵀ X_t, emitted


def run(step, options) -> str | None:
    graph = step.graph
    rewritten = 0
    candidates = []
    for node in list(graph.nodes):
        if _is_outer_product_over_tokens(node):
            candidate = _linear_candidate(step, node, options.dp_materialize)
        else:
            candidate = _embedding_candidate(step, node)
        if candidate is not None:
            candidates.append(candidate)
    # A weight used k times (a tied embedding and output head, a layer applied twice or more): its
    # per-sample gradient is a chain of adds, rewritten as one over all uses' tokens.
    in_sums = set()
    shapes, named = _parameters_by_shape(step), set()
    for summed in _outermost_sums(step, candidates, options.dp_materialize):
        why_not = _rewrite(step, summed)
        in_sums.update(summed.parts)               # rewritten or kept, the sum's note speaks for its parts
        rewritten += why_not is None
        _note(step, summed, why_not, shapes, named)
    for candidate in candidates:
        if candidate.root in in_sums:
            continue
        why_not = _rewrite(step, candidate)
        rewritten += why_not is None
        _note(step, candidate, why_not, shapes, named)
    if candidates:
        _note_the_others(step, shapes, named)
    if not rewritten:
        return "; ".join(step.notes) or ("no per-sample weight gradient (Linear bmm of Gᵀ and X, "
                                         "Embedding scatter) used for norms")
    graph.eliminate_dead_code()
    return None


def _parameters_by_shape(step) -> dict[tuple[int, ...], list[str]]:
    found: dict[tuple[int, ...], list[str]] = {}
    for p in step.captured.params:
        if p.tensor is not None:
            found.setdefault(tuple(p.tensor.shape), []).append(p.name)
    return found


def _note(step, candidate: _Candidate, why_not: str | None, shapes, named: set[str]) -> None:
    """What explain says of a per-sample gradient: its layer (the parameter of its shape, [rows,
    columns], or [columns, rows] for a weight stored transposed such as Hugging Face's Conv1D)
    and whether it was rewritten, or why not."""
    rows, columns = candidate.size_of["r"], candidate.size_of["c"]
    names = []
    if isinstance(rows, int) and isinstance(columns, int):
        names = shapes.get((rows, columns)) or shapes.get((columns, rows)) or []
    named.update(names)
    kind = "Embedding" if "Embedding" in candidate.what else "Linear"
    layer = (f"{names[0]} ({kind} weight [{rows}, {columns}])" if len(names) == 1
             else f"{kind} weight [{rows}, {columns}]" + (f" (one of {', '.join(names)})" if names else ""))
    if why_not is None:
        step.notes.append(f"{layer}: rewritten (norms without the [B, {rows}, {columns}] per-sample gradient, "
                          "one clipped sum)")
    elif why_not:
        step.notes.append(f"{layer}: {why_not}")


def _note_the_others(step, shapes, named: set[str]) -> None:
    """The parameters no candidate stands for: their per-sample gradients are B x the parameter
    (a bias, a norm's weight, a position table's slice), made from tensors backward holds anyway."""
    others = [name for names in shapes.values() for name in names if name not in named]
    if others:
        step.notes.append(f"left as traced ({len(others)}): {', '.join(others[:12])}"
                          f"{' ...' if len(others) > 12 else ''}: no per-sample outer product or "
                          "scatter; a per-sample gradient of B x the parameter cannot be smaller")


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


def _val(node) -> torch.Tensor:
    return node.meta["val"]


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


# ---------------------------------------------------------------- the rewrite (both kinds)

def _rewrite(step, candidate: _Candidate) -> str | None:
    """Rewrite one per-sample gradient's norm and clipped-sum uses; '' if it is no DP pattern,
    a reason if it is one that cannot be rewritten, None when done."""
    reads = _labelled_uses(candidate.root, candidate.labels, candidate.size_of, candidate.through)
    uses = [(user, state, _classify(user, value, labels)) for user, value, labels, state in reads]
    if not any(kind for _, _, kind in uses):
        shared = next((user for user, _, labels, _ in reads
                       if _sum_feeds_dp_uses(user, labels, candidate.size_of)), None)
        if shared is not None:
            return (f"{candidate.what} is added to another per-sample gradient by {shared.name}: a weight "
                    "shared by two layers (e.g. a tied embedding and output head) or used twice, in a sum "
                    "with a use this pass cannot rewrite, so it is left as it was (exact)")
        return ""                                             # not a per-sample gradient norm
    if candidate.refuse:
        return f"{candidate.what}: {candidate.refuse}"
    other = next((user for user, _, kind in uses if kind is None), None)
    if other is not None:
        return (f"{candidate.what} is also used by {other.name} ({other.target}); only its squared "
                "norm and a coefficient-weighted sum over the batch can be computed without "
                "materializing it")
    if candidate.keep:
        return f"{candidate.what}: {candidate.keep}"

    graph, emit = step.graph, step.emit
    for _, state, kind in uses:
        if kind[0] == "norm":
            total = kind[1]
            with graph.inserting_before(total):
                norm = candidate.norm(state)
                if norm.meta["val"].dtype != total.meta["val"].dtype:
                    norm = emit(aten._to_copy.default, norm, dtype=total.meta["val"].dtype)
            total.replace_all_uses_with(norm)
        else:
            _, result, coef, layout = kind
            with graph.inserting_before(result):
                weight = candidate.clipped_sum(coef, state)                           # [R, C]
                if layout == ("c", "r"):
                    weight = _contiguous(emit, emit(aten.permute.default, weight, [1, 0]))
                if weight.meta["val"].dtype != result.meta["val"].dtype:
                    weight = emit(aten._to_copy.default, weight, dtype=result.meta["val"].dtype)
                new = emit(aten.view.default, weight, _shape(result))
            result.replace_all_uses_with(new)
    return None


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
                      outer=outer, tokens=tokens)


def _sum_feeds_dp_uses(user: torch.fx.Node, labels: Labels, size_of) -> bool:
    """Is ``user`` an add of this per-sample gradient (a view of it labelled ``labels``) and another
    same-shaped tensor, whose result is used by a squared norm or a clipped sum (a shared weight)?"""
    if user.target is not aten.add.Tensor or len(user.args) != 2 or not all(
            isinstance(a, torch.fx.Node) and _shape(a) == _shape(user) for a in user.args):
        return False
    return any(_classify(u, value, lab) for u, value, lab, _ in _labelled_uses(user, labels, size_of))


def _contiguous(emit, node):
    return emit(aten.clone.default, node, memory_format=torch.contiguous_format)


def _flat_view(emit, node, shape):
    """view(node, shape), copying first only if node's value is not contiguous."""
    if not node.meta["val"].is_contiguous():
        node = _contiguous(emit, node)
    return emit(aten.view.default, node, shape)


def _coef_column(emit, coef, batch):
    """coef (any [.., B, ..] view with ones elsewhere) as a contiguous [B, 1, 1]."""
    return emit(aten.view.default, _contiguous(emit, coef), [batch, 1, 1])


# ---------------------------------------------------------------- Linear weights: bmm(Gᵀ, X)

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
                      keep=keep, outer=outer, tokens=_shape(x)[1])


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


# ---------------------------------------------------------------- Embedding weights: a scatter into [B·vocab, d]

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
                      tokens=tokens)


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


def _classify(user: torch.fx.Node, value: torch.fx.Node, labels: Labels):
    """('norm', sum node) | ('sum', result node, coef node, (r, c) order) | None."""
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
    # clipped sum: bmm(coef [1, 1, B], v [1, B, r·c]) contracting b
    if user.target is aten.bmm.default and user.args[1] is value and len(labels) == 3 \
            and labels[0] == () and labels[1] == ("b",) and set(labels[2]) == {"r", "c"}:
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
            if set(rest) == {"r", "c"}:
                return ("sum", total, coef, rest)
    return None


def size_of_batch(labels: Labels, coef_shape: list[int], batch_dim: int) -> int:
    """coef must be [.., B, ..] with B at the batch dimension of v and 1 elsewhere; else -1."""
    if len(coef_shape) != len(labels) or any(size != 1 for d, size in enumerate(coef_shape) if d != batch_dim):
        return -1
    return coef_shape[batch_dim]
