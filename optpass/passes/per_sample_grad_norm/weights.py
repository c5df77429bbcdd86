"""per_sample_grad_norm's names: which parameter a per-sample gradient belongs to, and which parameters
torch.func.grad differentiates, both read off the dataflow (docs/design.md §21: not from shapes).

* A Linear use ``P = Gᵀ X``: the layer's output gradient G meets its weight W in the input's
  gradient ``G W`` (every layer but one whose input needs no gradient, such as the first); its input
  X meets W in the forward ``X Wᵀ``. X alone can be shared (attention's q, k and v read one input),
  so G decides where it can.
* An Embedding use: the ids index the forward ``embedding(W, ids)``.
* A convolution use: its output gradient meets W in the input's gradient ``convolution_backward(g, x, W)``
  (every layer but the first); its input x meets W in the forward ``convolution(x, W)``.
(Which parameters ``torch.func.grad`` differentiates: ``optpass.dp_model_checks.differentiated_parameters``.)
"""

from __future__ import annotations

import torch
import torch.fx

from optpass.passes.per_sample_grad_norm.labels import _REGROUPING

aten = torch.ops.aten

_MATMULS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.matmul.default}
# what a weight or an activation passes through on its way to a matmul, besides views
_LAYOUT = _REGROUPING | {aten.permute.default, aten.t.default, aten.transpose.int, aten.expand.default,
                         aten.clone.default, aten.alias.default, aten.detach.default}


def parameter_of(step, uses: tuple[tuple[str, torch.fx.Node, torch.fx.Node | None], ...]) -> str | None:
    """The one parameter every use of a per-sample gradient reads, or None where the dataflow does not
    say (then explain falls back to the parameters of its shape).

    Args:
        step: the ``StepGraph`` being rewritten.
        uses: per use, ("Linear", X, G), ("Conv", x, g) or ("Embedding", ids, None).

    Returns:
        The parameter's name, or None.
    """
    by_node = {node: name for name, node in step.param_nodes.items()}
    found = set()
    for kind, first, second in uses:
        if kind == "Embedding":
            names = {by_node.get(_base(user.args[0])) for view in _views(first) for user in view.users
                     if user.target is aten.embedding.default and user.args[1] is view}
        elif kind == "Conv":
            names = _convolved_by_output_gradient(second, by_node) or _convolved_input(first, by_node)
        else:
            names = _weights_beside(second, by_node) or _weights_beside(first, by_node)
        names.discard(None)
        if len(names) != 1:
            return None
        found |= names
    return found.pop() if len(found) == 1 else None


_CONTRACTIONS = _MATMULS | {aten.convolution.default, aten.embedding.default, aten.linear.default,
                             aten.baddbmm.default, aten.einsum.default}


def contracted_parameters(step) -> set[str]:
    """The parameters some view of which a matmul, convolution or embedding reads: those whose per-sample
    gradient is a sum over tokens or positions of outer products, which can be far larger than the
    activations (an elementwise scale's, a position table's, is no larger than what backward holds)."""
    found = set()
    for name, node in step.param_nodes.items():
        if any(user.target in _CONTRACTIONS for view in _views(node) for user in view.users):
            found.add(name)
    return found


def _weights_beside(activation: torch.fx.Node | None, by_node) -> set[str]:
    """The parameters a matmul multiplies some view of ``activation`` with."""
    if activation is None:
        return set()
    views = _views(activation)
    return {by_node[_base(other)] for view in views for user in view.users if user.target in _MATMULS
            for other in user.args[:3] if isinstance(other, torch.fx.Node) and other not in views
            and _base(other) in by_node}


def _convolved_input(activation: torch.fx.Node, by_node) -> set[str]:
    """The parameters a forward convolution applies to some view of ``activation``."""
    views = _views(activation)
    return {by_node[_base(user.args[1])] for view in views for user in view.users
            if user.target is aten.convolution.default and user.args[0] is view and _base(user.args[1]) in by_node}


def _convolved_by_output_gradient(gradient: torch.fx.Node, by_node) -> set[str]:
    """The weights whose input gradient ``convolution_backward(g, x, W, ..)`` reads some view of g
    (vmap's weight-gradient call passes an empty stand-in for W, which no parameter is the base of)."""
    views = _views(gradient)
    return {by_node[_base(user.args[2])] for view in views for user in view.users
            if user.target is aten.convolution_backward.default and user.args[0] is view
            and _base(user.args[2]) in by_node}


def _base(node):
    while isinstance(node, torch.fx.Node) and node.target in _LAYOUT:
        node = node.args[0]
    return node


def _views(node: torch.fx.Node) -> set[torch.fx.Node]:
    """node's base and everything that only changes its layout, downwards from it."""
    seen, stack = set(), [_base(node)]
    while stack:
        current = stack.pop()
        seen.add(current)
        stack.extend(u for u in current.users if u.target in _LAYOUT and u.args[0] is current and u not in seen)
    return seen
