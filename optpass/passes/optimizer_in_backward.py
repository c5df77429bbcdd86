"""Pass optimizer_in_backward: each parameter's update runs as soon as its gradient is final.

Precondition: a step graph whose legality was proved (``optpass/legality.py``: every
fused parameter's gradient depends on its own raw gradient only), the
optimizer's update harvested from torch.optim itself (``optim/harvest.py``), and the
optimizer's state tensors and per-group lr as extra inputs of the step graph
(``runtime/fused_step.py`` adds them).

Rewrite: for each fused parameter ``p``, the harvested slice that updates ``p``
and its state is copied into the step graph, its placeholders bound to
``p``, ``p``'s final gradient, ``p``'s state inputs and its group's lr, and
placed right after the last node that the update must follow: the node that
makes the gradient final (every contribution accumulated, e.g. tied weights)
and every read of ``p``'s old value, views included (docs/design.md §22). The slice
ends with in-place ``copy_`` writes into ``p`` and its state; ``p``'s gradient
output slot becomes ``None``.

With a grad_scaler and no optimizer_in_backward (``UpdatePlan.in_backward`` False)
the same slices are placed after backward, at the end of the step graph, one
after the other: a skipped step (inf/nan) must skip the update in the graph that
finds the inf (``loss_scaling.py``).

A large gradient made by one GEMM (a Linear weight's, e.g. a language model's output head) or by
an embedding's scatter (Inductor's lowering; tied to a head or not) whose update is elementwise is
made and applied in row chunks of about 2 MiB (``_row_chunks.py``): rows ``a:b`` of the gradient,
then the update of rows ``a:b`` of the parameter and its state.

Effect: the gradient's last use is its update, so it dies there: at most a few
gradients are live at a time instead of all of them, and of a chunked one only a chunk; ``p.grad`` is None after
the step and ``opt.step()`` has nothing to do (docs/design.md §17).

Refuses (via legality): coupled gradients (global clipping, GradScaler),
pipeline/expert parallelism, a step whose backward ran outside the graph.

    before:                                  after:
      g1 = mm(t(dy), x1)                       g1 = mm(t(dy), x1)
      dx = mm(dy, w1)     # reads w1           dx = mm(dy, w1)
      g0 = mm(t(dx), x0)                       w1' = <AdamW(w1, g1, state1, lr)>; copy_(w1, w1')
      return (loss, g0, g1)                    g0 = mm(t(dx), x0)
                                               w0' = <AdamW(w0, g0, state0, lr)>; copy_(w0, w0')
                                               return (loss, None, None)
"""

from __future__ import annotations

from optpass.passes._row_chunks import copy_slice_in_row_chunks, row_chunks
from optpass.passes._graph_utils import (OPTIMIZER_UPDATE, copy_slice, last_node_update_must_follow,
                                         placeholders_by_dynamo_index, take_gradient_outputs)
from optpass.step import REGION_KEY, UPDATE

CONTEXT_KEY = OPTIMIZER_UPDATE


def run(step, options) -> str | None:
    plan = step.context.get(CONTEXT_KEY)
    if plan is None and options.master_weights is not None and options.optimizer_in_backward:
        return "the updates run on fp32 masters: pass master_weights places them inside backward"
    if plan is None:
        return "not requested (options optimizer_in_backward)" if not options.optimizer_in_backward \
            else "this compile keeps gradients (first step or accumulation micro-step)"
    splice_updates(step, plan)
    if not plan.in_backward:
        step.notes.append(f"{len(plan.harvested.updates)} updates after backward, in the step graph "
                          "(grad_scaler: skipped on inf/nan)")
    return None


def splice_updates(step, plan) -> None:
    """Insert each parameter's harvested update after its gradient is final; drop the gradient output."""
    graph = step.graph
    inputs = placeholders_by_dynamo_index(graph)
    gradient_values = take_gradient_outputs(step, list(plan.harvested.updates))
    # Positions of the original nodes, once: every node an update must follow is one of them
    # (a slice reads only its own parameter), so later insertions do not change the answer.
    position = {n: i for i, n in enumerate(graph.nodes)}
    end = step.output_node.prev
    for name, update in plan.harvested.updates.items():
        env = {update.param: step.param_nodes[name], update.gradient: gradient_values[name]}
        env.update({ph: inputs[plan.state_index[(name, key)]] for key, ph in update.states.items()})
        env.update({ph: inputs[plan.lr_index[group]] for ph, group in update.lr.items()})
        anchor = (last_node_update_must_follow(position, step.param_nodes[name], gradient_values[name])
                  if plan.in_backward else end)
        # a large gradient made by one GEMM or scatter, with an elementwise update: made and applied in row chunks
        chunks = row_chunks(update, gradient_values[name]) if plan.in_backward else None
        with graph.inserting_before(anchor.next):  # keeps the slice's order
            inserted = (copy_slice_in_row_chunks(step, update, env, gradient_values[name], chunks) if chunks
                        else copy_slice(step, update, env))
        if chunks:
            step.notes.append(f"{name}: gradient made and applied in {len(chunks)} row chunks")
        for node in inserted:
            node.meta[REGION_KEY] = UPDATE
        if not plan.in_backward:
            end = inserted[-1]
    step.gradient_nodes.clear()

