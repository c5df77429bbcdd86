"""per_sample_grad_norm's candidate: a per-sample gradient and how to compute its two DP uses
cheaply, with the shape helpers its kinds share."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.fx

aten = torch.ops.aten


Labels = list[tuple[str, ...]]   # one tuple of atomic labels per dimension


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
    # per use of the weight, what ties it to the forward: ("Linear", X, Gᵀ) or ("Embedding", ids, None)
    uses: tuple = ()


def _shape(node) -> list[int] | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return list(value.shape) if isinstance(value, torch.Tensor) else None


def _rank(node) -> int:
    shape = _shape(node)
    return -1 if shape is None else len(shape)


def _val(node) -> torch.Tensor:
    return node.meta["val"]


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
