"""Pass per_sample_grad_norm: DP-SGD's per-sample Linear, Embedding and convolution weight gradients
without [B, out, in] / [B, vocab, d] / [B, out, in/groups, *k] tensors.

Precondition: a graph of a DP-SGD step written with ``torch.func.vmap(grad(...))``
(docs/design.md §31) in which a weight's per-sample gradient P is used only (through
views) by
  * its per-sample squared norm: ``sum(pow(view(P, [B, -1]), 2), dim=1)`` -> [B], and
  * the clipped sum ``einsum("b,b...->...", coef, P)``, lowered as a ``bmm`` that
    contracts the batch dimension (or as ``sum(mul(P, coef), dim=b)``, or on a GPU under
    Inductor, whose ``bmm_to_mm`` pattern squeezes that batch-1 bmm, as ``mm(coef [1, B], P [B, -1])``),
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
  * Conv1d/2d/3d weight: vmap's batched weight gradient, ONE grouped
    ``convolution_backward(g [N, B·out, *S'], x [N, B·in, *S], .., groups=B·groups)`` viewed
    [B, out, in/groups, *k] (sample b owns channel blocks b; any stride, padding, dilation, groups).

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
  * Convolution: the squared norm becomes ``optpass::conv_per_sample_grad_sq_norm(x, g, ..)``
    (optpass/kernels/conv_norm.py) on x and g viewed [B, N, C, *S]: a bounded chunk of samples at a
    time, direct (the chunk's per-sample gradients) or ghost (Gram form over the unfolded patches,
    Conv1d/2d), by the Linear rule over the output positions; the clipped sum becomes ONE weight
    gradient ``convolution_backward(coef ⊙ g, x, .., groups)`` over the B·N rows. With
    ``dp_materialize='auto'`` a convolution whose input and output gradient outweigh its weight
    per sample (early CNN layers: few channels, a large image) is left materialized.
  After each, P has no users and disappears: no [B, out, in] / [B, vocab, d] intermediate remains.
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
rewritten only when T < vocab (else the tokens' gradients it keeps are no smaller), and
for a convolution weight the layer's input and output gradient (which the backward holds)
kept until the clip factors plus a bounded chunk, instead of O(B·out·in/groups·prod(k));
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
pattern is rewritten); an Embedding with T >= vocab tokens per sample (nothing to gain); a
convolution kept by ``dp_materialize='auto'``; a transposed convolution (no rewrite for it);
bmm's and scatters that are not per-sample gradients.

    before (Linear):                           after:
      P = bmm(t(G), X)          # [B, out, in]   n = per_sample_grad_sq_norm(X, G)
      n = sum(pow(view(P, [B, -1]), 2), [1])     w = mm(t(view(G * c, [B*T, out])), view(X, [B*T, in]))
      w = bmm(view(c, [1, 1, B]), view(P, [1, B, -1]))

    before (Conv2d):                           after:
      P = view(convolution_backward(g, x, .., groups=B)[1], [B, out, in, kh, kw])
      n = sum(pow(view(P, [B, -1]), 2), [1])     n = conv_per_sample_grad_sq_norm(x', g', k, stride, ..)
      w = bmm(view(c, [1, 1, B]), view(P, [1, B, -1]))   w = convolution_backward(g' * c, x', .., groups=1)[1]

    before (Embedding, aten graph):            after:
      P = embedding_dense_backward(g, x + b·V, B·V, -1, False)   # [B·V, d]
      P = select_scatter(view(P, [B, V, d]), 0, 1, pad)          n = embedding_per_sample_grad_sq_norm(x, g, pad)
      n = sum(pow(view(P, [B, -1]), 2), [1])     w = embedding_dense_backward(view(g * c, [B*T, d]), x, V, pad, False)
      w = bmm(view(c, [1, 1, B]), view(P, [1, B, -1]))
"""

from __future__ import annotations

import torch
import torch.fx

from optpass.dp_model_checks import FROZEN_FIX, DPSGDModelWarning, differentiated_parameters, refuse_batch_norm_nodes
from optpass.kernels import conv_norm, embedding_norm, per_sample_norm
from optpass.passes.per_sample_grad_norm.candidate import _Candidate, _contiguous, _shape
from optpass.passes.per_sample_grad_norm.labels import _classify, _labelled_uses, _sum_feeds_dp_uses
from optpass.passes.per_sample_grad_norm.linear import (_is_outer_product_over_tokens, _linear_candidate, _outermost_sums)
from optpass.passes.per_sample_grad_norm.conv import _conv_candidate
from optpass.passes.per_sample_grad_norm.embedding import _embedding_candidate
from optpass.passes.per_sample_grad_norm.spellings import (WORKING_SPELLINGS, paired_squared_norm, replace_norm,
                                                           split_concatenated_norms)
from optpass.passes.per_sample_grad_norm.weights import contracted_parameters, parameter_of

aten = torch.ops.aten


_REGISTERS_OPS = (conv_norm, embedding_norm, per_sample_norm)   # importing them registers torch.ops.optpass.*


def run(step, options) -> str | None:
    graph = step.graph
    rewritten = 0
    candidates = []
    for node in list(graph.nodes):
        if _is_outer_product_over_tokens(node):
            candidate = _linear_candidate(step, node, options.dp_materialize)
        else:
            candidate = _embedding_candidate(step, node) or _conv_candidate(step, node, options.dp_materialize)
        if candidate is not None:
            candidates.append(candidate)
    if candidates:
        refuse_batch_norm_nodes(step)            # a DP-SGD graph: no batch statistics
    # a norm over a torch.cat / torch.stack of per-sample gradients: the sum of each one's squared norm
    changed = split_concatenated_norms(step, {
        user: None for candidate in candidates for user, _, labels, _ in _labelled_uses(
            candidate.root, candidate.labels, candidate.size_of, candidate.through)
        if user.target in (aten.cat.default, aten.stack.default) and labels and labels[0] == ("b",)})
    # A weight used k times (a tied embedding and output head, a layer applied twice or more): its
    # per-sample gradient is a chain of adds, rewritten as one over all uses' tokens.
    in_sums = set()
    names = _Names(step)
    per_sample = False     # a per-sample gradient was found (rewritten or not): not every batched GEMM is one
    for summed in _outermost_sums(step, candidates, options.dp_materialize):
        why_not = _rewrite(step, summed)
        in_sums.update(summed.parts)               # rewritten or kept, the sum's note speaks for its parts
        rewritten += why_not is None
        per_sample |= why_not != ""
        names.note(summed, why_not)
    for candidate in candidates:
        if candidate.root in in_sums:
            continue
        why_not = _rewrite(step, candidate)
        rewritten += why_not is None
        per_sample |= why_not != ""
        names.note(candidate, why_not)
    if per_sample:
        names.note_the_others()
    step.notes.extend(names.lines())
    names.warn()
    if changed or rewritten:
        graph.eliminate_dead_code()
    if not rewritten:
        return "; ".join(step.notes) or ("no per-sample weight gradient (Linear bmm of Gᵀ and X, "
                                         "Embedding scatter) used for norms")
    return None


class _Names:
    """What explain says of the per-sample gradients: one line per weight, named by dataflow
    (``weights.parameter_of``); where the dataflow does not say, by shape, with the same lines of
    same-shape weights counted once. A differentiated parameter that does not require grad is named:
    it enters every clip factor and gets a ``.grad``, which Opacus (it clips the trainable parameters)
    does not do."""

    def __init__(self, step):
        self.step = step
        self.by_shape: dict[tuple[int, ...], list[str]] = {}
        for p in step.captured.params:
            if p.tensor is not None:
                self.by_shape.setdefault(tuple(p.tensor.shape), []).append(p.name)
        self.frozen = {p.name for p in step.captured.params if p.tensor is not None and not p.tensor.requires_grad}
        self.shapes = {p.name: tuple(p.tensor.shape) for p in step.captured.params if p.tensor is not None}
        self.differentiated = differentiated_parameters(step.captured)
        self.named: set[str] = set()
        self.counts: dict[str, int] = {}          # line -> how many per-sample gradients it stands for
        self.materialized: list[str] = []         # weights whose [B, *shape] per-sample gradient stays, and why

    def note(self, candidate: _Candidate, why_not: str | None) -> None:
        """One per-sample gradient's line: its weight and whether it was rewritten, or why not."""
        if why_not == "":
            return                                                # no DP pattern
        dims = [candidate.size_of[a] for group in candidate.labels for a in group if a != "b"]
        shape = ", ".join(map(str, dims))
        kinds = {kind for kind, _, _ in candidate.uses}
        kind = ("Embedding weight" if "Embedding" in kinds else f"Conv{len(dims) - 2}d weight" if "Conv" in kinds
                else "Linear weight")
        tied = ", tied to a Linear (an output head)" if kinds == {"Embedding", "Linear"} else ""
        name = parameter_of(self.step, candidate.uses)
        if name is not None:
            self.named.add(name)
            frozen = ", requires_grad=False" if name in self.frozen else ""
            layer = f"{name} ({kind} [{shape}]{tied}{frozen})"
        else:
            same = []
            if all(isinstance(d, int) for d in dims):
                same = self.by_shape.get(tuple(dims)) or self.by_shape.get(tuple(dims[::-1])) or []
            self.named.update(same)
            layer = f"{kind} [{shape}]{tied}" + (f" (one of {', '.join(same)})" if same else "")
        outcome = (f"rewritten (norms without the [B, {shape}] per-sample gradient, one clipped sum)"
                   if why_not is None else why_not)
        line = f"{layer}: {outcome}"
        self.counts[line] = self.counts.get(line, 0) + 1
        if why_not is not None and why_not != f"{candidate.what}: {candidate.keep}":    # not the policy's choice
            self.materialized.append(f"{layer}: {why_not}")

    def note_the_others(self) -> None:
        """The differentiated parameters no candidate stands for, each named once, grouped by module:
        1-D ones (biases, norm scales), whose per-sample gradients are [B, C] sums of tensors backward
        holds anyway, and the others (a position table's slice, a transposed convolution), whose
        per-sample gradients stay in the graph because this pass has no rewrite for them."""
        known = self.differentiated if self.differentiated is not None else \
            [name for names in self.by_shape.values() for name in names]
        others = [name for name in known if name not in self.named]
        vectors = [name for name in others if len(self.shapes.get(name, ())) <= 1]
        if vectors:
            self.counts[f"left as traced ({len(vectors)}): {_by_module(vectors)}: 1-D (biases, norm scales): "
                        "each per-sample gradient is a [B, C] sum over tokens or positions of tensors the backward "
                        "holds anyway; there is nothing smaller to compute"] = 1
        tables = [name for name in others if name not in vectors]
        contracted = contracted_parameters(self.step)
        self.materialized.extend(f"{name} {list(self.shapes[name])}: no rewrite for this layer (e.g. a transposed "
                                 "convolution)" for name in tables if name in contracted)
        if tables:
            shapes = ", ".join(f"{name} {list(self.shapes[name])}" for name in tables)
            self.counts[f"materialized, not rewritten ({len(tables)}): {shapes}: not a Linear, Embedding or "
                        "Conv1d/2d/3d weight whose per-sample gradient is used only for norms and a clipped sum "
                        "(e.g. a position table's slice, a transposed convolution): its [B, *shape] per-sample "
                        "gradient stays in the graph"] = 1

    def warn(self) -> None:
        """The weights whose per-sample gradient stays materialized for want of a rewrite, warned once per
        compile (``optpass.DPSGDModelWarning``, given by the pipeline, and again on a cache hit); the
        frozen parameters a step differentiates are warned by ``dp_model_checks`` at every compile."""
        if self.materialized:
            hint = f" ({WORKING_SPELLINGS})"
            entries = [entry.replace(hint, "") for entry in self.materialized]
            self.step.warnings.append((DPSGDModelWarning,
                "optpass: per-sample gradients left materialized ([B, *shape] each, as without optpass): "
                + "; ".join(entries) + (f".{hint}" if any(hint in entry for entry in self.materialized) else "")))

    def lines(self) -> list[str]:
        """The notes, a line that stands for k same-shape per-sample gradients saying so once."""
        lines = [line if count == 1 else f"{count} per-sample gradients: {line}" for line, count in self.counts.items()]
        frozen = [name for name in self.differentiated or () if name in self.frozen]
        if frozen:
            lines.append(
                f"per-sample gradients of parameters that do not require grad (requires_grad=False): "
                f"{', '.join(frozen)}: they enter every per-sample norm and clip factor, and p.grad is set "
                f"for them; Opacus leaves them out (it clips the trainable parameters only). {FROZEN_FIX}")
        return lines


def _by_module(names: list[str]) -> str:
    """``4.weight, 4.bias, 8.bias`` as ``4 (weight, bias), 8.bias``: each module once, in order."""
    modules: dict[str, list[str]] = {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        modules.setdefault(module, []).append(leaf)
    parts = []
    for module, leaves in modules.items():
        if not module:                                   # parameters of the model itself
            parts.extend(leaves)
        else:
            parts.append(f"{module}.{leaves[0]}" if len(leaves) == 1 else f"{module} ({', '.join(leaves)})")
    return ", ".join(parts)


def _rewrite(step, candidate: _Candidate) -> str | None:
    """Rewrite one per-sample gradient's norm and clipped-sum uses; '' if it is no DP pattern,
    a reason if it is one that cannot be rewritten, None when done."""
    reads = _labelled_uses(candidate.root, candidate.labels, candidate.size_of, candidate.through)
    uses = _paired(reads, [(user, state, _classify(user, value, labels, candidate.size_of))
                           for user, value, labels, state in reads], candidate.size_of)
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
                f"materializing it ({WORKING_SPELLINGS})")
    if candidate.keep:
        return f"{candidate.what}: {candidate.keep}"

    graph, emit = step.graph, step.emit
    done = set()
    for _, state, kind in uses:
        if kind[0] == "paired" or kind[1] in done:
            continue
        done.add(kind[1])
        if kind[0] == "norm":
            _, consumer, root = kind
            with graph.inserting_before(consumer):
                replace_norm(emit, consumer, candidate.norm(state), root)
        else:
            _, result, coef, layout = kind
            with graph.inserting_before(result):
                weight = candidate.clipped_sum(coef, state)                 # [R, C] or [R, C, *k]
                order = tuple(a for group in candidate.labels for a in group if a != "b")
                if layout != order:
                    weight = _contiguous(emit, emit(aten.permute.default, weight, [order.index(a) for a in layout]))
                if weight.meta["val"].dtype != result.meta["val"].dtype:
                    weight = emit(aten._to_copy.default, weight, dtype=result.meta["val"].dtype)
                new = emit(aten.view.default, weight, _shape(result))
            result.replace_all_uses_with(new)
    return None


def _paired(reads, uses, size_of):
    """``uses`` with each user that reads two views of the per-sample gradient as one square
    (``spellings.paired_squared_norm``: ``g.flatten(1) * g.flatten(1)``, einsum's self dot product)
    classified: the first read as the norm, the second as ("paired",)."""
    by_user: dict[torch.fx.Node, list] = {}
    for (user, value, labels, _), (_, _, kind) in zip(reads, uses):
        if kind is None:
            by_user.setdefault(user, []).append((value, labels))
    paired = {}
    for user, values in by_user.items():
        kind = paired_squared_norm(user, values, size_of, lambda node, labels: _labelled_uses(node, labels, size_of))
        if kind is not None:
            paired[user] = kind
    result = []
    for user, state, kind in uses:
        if user in paired and kind is None:
            kind, paired[user] = paired[user], ("paired",)
        result.append((user, state, kind))
    return result
