"""Pass clip_grad_norm_in_backward: exact global-norm clipping of fused updates' gradients.

Precondition: ``options={"clip_grad_norm": max_norm}`` and a fused update in
this compile (optimizer_in_backward, master_weights or grad_scaler: the update
runs in the step graph); the step itself does not clip (legality refuses a step
that couples gradients before a fused update).

Rewrite, inside backward (optimizer_in_backward): a global norm needs every
gradient before any update, but the fused updates free each gradient as soon as
it exists. So, like LOMO's two backward passes, the backward is run twice: a
first, norm-only copy of it (every node that leads from the forward to a fused
gradient; ``first_backward``, shared with loss_scaling's inf/nan check) reduces
each gradient to its squared norm as soon as it is computed and drops it, giving

    clip_coef = clamp(max_norm / (sqrt(sum of squared norms) + 1e-6), max=1)

(``torch.nn.utils.clip_grad_norm_``'s formula); the real backward then
multiplies each gradient by ``clip_coef`` before the fused update reads it.
With the updates after backward (master_weights or grad_scaler without
optimizer_in_backward) no copy is needed: the norm is taken from the gradients
themselves, at the end of the step graph.

With master_weights the gradients of the parameters that have an fp32 master are
cast to fp32 first, so the norm and the clipping are those of the fp32 gradients
(Megatron's main gradients); with grad_scaler they are already unscaled
(Megatron's order: unscale, check for inf/nan, clip, update).

Effect: the same parameters as eager ``clip_grad_norm_(params, max_norm)``
followed by ``opt.step()`` (of the fp32 master gradients with master_weights),
with gradient memory still about one gradient inside backward; that costs one
extra backward (measured in bench/optimizer_in_backward.py).

    before:                              after (inside backward):
      g0 = mm(t(dx), x0)                   g0' = mm(t(dx'), x0); s0 = sum(g0' * g0')   # norm pass
      ... update(w0, g0)                   c = clamp(max_norm / (sqrt(s0 + s1) + 1e-6), max=1)
                                           g0 = mm(t(dx), x0); ... update(w0, g0 * c)
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.fx

from optpass.passes.optimizer_in_backward import CONTEXT_KEY, gradient_value
from optpass.step import BACKWARD, GRADIENT_TRANSFORM

aten = torch.ops.aten
convert_element_type = torch.ops.prims.convert_element_type.default

FIRST_BACKWARD = "first_backward"


def run(step, options) -> str | None:
    if options.clip_grad_norm is None:
        return "not requested (options clip_grad_norm)"
    plan = fused_update_plan(step)
    if plan is None:
        return "no fused update in this compile (first step or accumulation micro-step)"
    masters = set(getattr(plan, "master_index", ()))
    clip_fused_gradients(step, list(plan.harvested.updates), float(options.clip_grad_norm),
                         in_backward=plan.in_backward, to_fp32=masters)
    return None


def fused_update_plan(step):
    """The update plan of this compile: optimizer_in_backward's or master_weights' (None: no fused update)."""
    from optpass.passes.master_weights import CONTEXT_KEY as MASTER_KEY

    return step.context.get(CONTEXT_KEY) or step.context.get(MASTER_KEY)


def clip_fused_gradients(step, names: list[str], max_norm: float, in_backward: bool = True,
                         to_fp32: set[str] = frozenset()) -> None:
    graph = step.graph
    emit = step.emit
    for name in names:                         # Megatron clips the masters' fp32 gradients
        value = gradient_value(step.gradient_nodes[name])
        if name in to_fp32 and value.meta["val"].dtype != torch.float32:
            with graph.inserting_before(value.next), replacing_gradient(step, name, value) as replace:
                replace(emit(convert_element_type, value, torch.float32))
    values = {name: gradient_value(step.gradient_nodes[name]) for name in names}
    readers = {name: set(value.users) for name, value in values.items()}
    step.annotate_regions()
    if in_backward:
        # The norm-only backward: each gradient's copy squared and summed as soon as it exists.
        first = first_backward(step, list(values.values()))
        squares = [reduce_after(step, copy, squared_norm) for copy in in_graph_order(
            graph, [first.copies[value] for value in values.values()])]
        at = first.end
    else:
        squares = [reduce_after(step, value, squared_norm) for value in in_graph_order(graph, values.values())]
        at = step.output_node
    with graph.inserting_before(at):
        coef = clip_coefficient(emit, emit(aten.sqrt.default, sum_all(emit, squares)), max_norm)
    # Each fused gradient is scaled before its update reads it: inside backward right after the
    # gradient (every reader of it reads the clipped one); after backward at the end, where only
    # the update reads it (Dynamo's copy into .grad, before it, is dropped with the gradient output).
    for name, value in values.items():
        with graph.inserting_before(value.next if in_backward else at):
            clipped = emit(aten.mul.Tensor, value, coef)
        if in_backward:
            value.replace_all_uses_with(clipped, delete_user_cb=readers[name].__contains__)
        if step.gradient_nodes[name] is value or not in_backward:
            step.gradient_nodes[name] = clipped
    step.annotate_regions()


@contextlib.contextmanager
def replacing_gradient(step, name: str, value: torch.fx.Node):
    """``with replacing_gradient(step, name, value) as replace: replace(new)``: `new`, computed from
    `value` inside the block, becomes what every earlier reader of `value` reads (Dynamo's copy into
    ``.grad`` included), and the gradient the fused update of `name` reads."""
    readers = set(value.users)

    def replace(new: torch.fx.Node) -> None:
        value.replace_all_uses_with(new, delete_user_cb=readers.__contains__)
        if step.gradient_nodes[name] is value:
            step.gradient_nodes[name] = new
    yield replace


@dataclasses.dataclass
class FirstBackward:
    """A copy of the backward that leads to the fused gradients, run before the real one."""

    copies: dict[torch.fx.Node, torch.fx.Node]    # original node -> its copy
    end: torch.fx.Node                            # the real backward's first node (the copy precedes it)


def first_backward(step, targets: list[torch.fx.Node]) -> FirstBackward:
    """The first backward that computes `targets` (made once per compile, shared by the passes that
    need every gradient before any update: loss scaling's inf/nan check, global-norm clipping).
    Callers reduce each copied target right after it (``reduce_after``), so it dies there."""
    made = step.context.get(FIRST_BACKWARD)
    if made is not None and all(t in made.copies for t in targets):
        return made
    graph = step.graph
    to_copy = _backward_cone(step, targets)
    end = next(n for n in graph.nodes if n in to_copy)
    # The copy reads forward values that the graph may define after `end` (see define_inputs_before).
    step.define_inputs_before(to_copy, end, "the norm-only first backward that options 'clip_grad_norm' "
                                            "and 'grad_scaler' run inside backward")
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    with graph.inserting_before(end):
        for node in list(graph.nodes):
            if node in to_copy:
                env[node] = graph.node_copy(node, lambda n: env.get(n, n))
    made = FirstBackward(env, end)
    step.context[FIRST_BACKWARD] = made
    return made


def in_graph_order(graph: torch.fx.Graph, nodes) -> list[torch.fx.Node]:
    """`nodes` in the order the graph computes them (the order their norms are summed in)."""
    wanted = set(nodes)
    return [n for n in graph.nodes if n in wanted]


def reduce_after(step, value: torch.fx.Node, reduce) -> torch.fx.Node:
    """`reduce(emit, value)` inserted right after `value`, so that `value` can die there."""
    with step.graph.inserting_before(value.next):
        return reduce(step.emit, value)


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
