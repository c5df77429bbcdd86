"""Pass clip_grad_norm_in_backward: exact global-norm clipping that keeps no gradients.

Precondition: optimizer_in_backward is on (this pass runs right before it),
``options={"clip_grad_norm": max_norm}``, and the step itself does not clip
(legality refuses a step that couples gradients).

Rewrite: a global norm needs every gradient before any update, but the fused
updates free each gradient as soon as it exists. So, like LOMO's two backward
passes, the backward is run twice: a first, norm-only copy of it (every node
that leads from the forward to a fused gradient) reduces each gradient to its
squared norm as soon as it is computed and drops it, giving

    clip_coef = clamp(max_norm / (sqrt(sum of squared norms) + 1e-6), max=1)

(``torch.nn.utils.clip_grad_norm_``'s formula); the real backward then
multiplies each gradient by ``clip_coef`` before the fused update reads it.

Effect: the same parameters as eager ``clip_grad_norm_(params, max_norm)``
followed by ``opt.step()``, with gradient memory still about one gradient; it
costs one extra backward (measured in bench/optimizer_in_backward.py).

    before:                              after:
      g0 = mm(t(dx), x0)                   g0' = mm(t(dx'), x0); s0 = sum(g0' * g0')   # norm pass
      ... update(w0, g0)                   c = clamp(max_norm / (sqrt(s0 + s1) + 1e-6), max=1)
                                           g0 = mm(t(dx), x0); ... update(w0, g0 * c)
"""

from __future__ import annotations

import torch
import torch.fx

from optpass.passes.optimizer_in_backward import CONTEXT_KEY, gradient_value
from optpass.step import BACKWARD, GRADIENT_TRANSFORM

aten = torch.ops.aten


def run(step, options) -> str | None:
    if options.clip_grad_norm is None:
        return "not requested (options clip_grad_norm)"
    plan = step.context.get(CONTEXT_KEY)
    if plan is None:
        return "no fused update in this compile (first step or accumulation micro-step)"
    clip_fused_gradients(step, list(plan.harvested.updates), float(options.clip_grad_norm))
    return None


def clip_fused_gradients(step, names: list[str], max_norm: float) -> None:
    graph = step.graph
    emit = step.emit
    values = {name: gradient_value(step.gradient_nodes[name]) for name in names}
    to_copy = _backward_cone(step, list(values.values()))
    first_backward = next(n for n in graph.nodes if n in to_copy)

    # The norm-only backward: a copy of every backward node leading to a fused gradient, each
    # gradient squared and summed as soon as it exists so it can be freed right away.
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    squares = []
    wanted = {value: name for name, value in values.items()}
    with graph.inserting_before(first_backward):
        for node in list(graph.nodes):
            if node not in to_copy:
                continue
            env[node] = graph.node_copy(node, lambda n: env.get(n, n))
            if node in wanted:
                squares.append(squared_norm(emit, env[node]))
        coef = clip_coefficient(emit, emit(aten.sqrt.default, sum_all(emit, squares)), max_norm)
    # The real backward: each fused gradient is scaled before its update reads it.
    for name, value in values.items():
        with graph.inserting_after(value):
            clipped = emit(aten.mul.Tensor, value, coef)
        value.replace_all_uses_with(clipped, delete_user_cb=lambda user: user is not clipped)
        if step.gradient_nodes[name] is value:
            step.gradient_nodes[name] = clipped
    step.annotate_regions()


def squared_norm(emit, value: torch.fx.Node) -> torch.fx.Node:
    """sum(value * value): a 0-d tensor."""
    return emit(aten.sum.default, emit(aten.mul.Tensor, value, value))


def sum_all(emit, values: list[torch.fx.Node]) -> torch.fx.Node:
    """values[0] + values[1] + ...: adds, not stack (stack is decomposed before post-grad passes)."""
    total = values[0]
    for value in values[1:]:
        total = emit(aten.add.Tensor, total, value)
    return total


def clip_coefficient(emit, norm: torch.fx.Node, max_norm: float) -> torch.fx.Node:
    """torch.nn.utils.clip_grad_norm_'s coefficient: clamp(max_norm / (norm + 1e-6), max=1)."""
    scale = emit(aten.mul.Tensor, emit(aten.reciprocal.default, emit(aten.add.Tensor, norm, 1e-6)), max_norm)
    return emit(aten.clamp_max.default, scale, 1.0)


def _backward_cone(step, gradients: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """Nodes after the forward that a fused gradient depends on."""
    cone, stack = set(), list(gradients)
    while stack:
        node = stack.pop()
        if node in cone or step.region_of(node) not in (BACKWARD, GRADIENT_TRANSFORM):
            continue
        cone.add(node)
        stack.extend(node.all_input_nodes)
    return cone
