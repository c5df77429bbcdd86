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

Under data_parallel='fsdp' each gradient is this rank's shard (averaged over the ranks): the sum
of squared norms is all-reduced (one scalar) before the coefficient, so every rank clips by the
global norm. Under tensor parallelism each sharded gradient's squares are summed over the ranks
holding its other shards, a replicated gradient's counted once.

The pre-clip global norm, what ``clip_grad_norm_`` returns, is copied into a 0-d input that the
runtime passes (``GRAD_NORM_OUTPUT``; ``optpass.grad_norm(opt)`` hands it to the user after the step).

``max_norm = inf`` (``clip_grad_norm=float("inf")``) never clips, as ``clip_grad_norm_``'s
coefficient is 1 there: the norm is only reported (``optpass.grad_norm``), reduced from each
gradient as the one backward makes it, with no norm-only backward and no multiplication.

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

import math

import torch
import torch.fx

from optpass.errors import OptpassError
from optpass.fsdp.shard import shard_spec
from optpass.tensor_parallel import norm_groups
from optpass.passes._graph_utils import (MASTER_UPDATE, OPTIMIZER_UPDATE, clip_coefficient, first_backward,
                                         gradient_value, in_graph_order, reduce_after, replacing_gradient,
                                         squared_norm, sum_all, write_grad_norm)

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
convert_element_type = torch.ops.prims.convert_element_type.default


def run(step, options) -> str | None:
    if options.clip_grad_norm is None:
        return "not requested (options clip_grad_norm)"
    plan = fused_update_plan(step)
    if plan is None:
        return "no fused update in this compile (first step or accumulation micro-step)"
    masters = set(getattr(plan, "master_index", ()))
    clip_fused_gradients(step, list(plan.harvested.updates), float(plan.clip_grad_norm),
                         in_backward=plan.in_backward, to_fp32=masters,
                         eager_order=optimizer_order(step, options.optimizer) if options.lower == "eager" else None)
    return None


def optimizer_order(step, optimizer) -> list[str]:
    """The names of the step's parameters in the optimizer's ``param_groups`` order (of a list, the
    members' in turn): the order of the norms ``clip_grad_norm_(params)`` stacks."""
    name_of = {id(p.tensor): p.name for p in step.captured.params if p.tensor is not None}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"] if id(p) in name_of]


def summed_over_the_ranks(step, names: list[str], squares: dict[str, torch.fx.Node]) -> torch.fx.Node:
    """The global squared norm from each gradient's local one (`squares`, in graph order).

    Under data_parallel='fsdp' each gradient here is this rank's shard: the sum is all-reduced over the
    shards' group (one scalar; the padding is zero). A tensor-parallel gradient (a DTensor parameter's
    local tensor) is summed over the groups of the mesh dimensions that shard it, a replicated one is
    counted once (``tensor_parallel.norm_groups``): one all-reduce per such group. Else a plain sum."""
    tensors = {p.name: p.tensor for p in step.captured.params if p.tensor is not None}
    specs = [shard_spec(tensors.get(name)) for name in names]
    if any(spec is not None for spec in specs):
        groups = {spec.group_name for spec in specs if spec is not None}
        if len(groups) > 1 or None in specs:
            raise OptpassError("clip_grad_norm with data_parallel='fsdp': the clipped parameters are sharded over "
                               "several process groups, or some are not sharded; shard every model the step trains "
                               "with one optpass.fully_shard process group.")
    by_groups: dict[tuple[str, ...], list[torch.fx.Node]] = {}
    for name, square in squares.items():
        by_groups.setdefault(_norm_groups(tensors.get(name)), []).append(square)
    return sum_all(step.emit, [_all_reduced(step, sum_all(step.emit, part), groups)
                               for groups, part in by_groups.items()])


def _norm_groups(tensor) -> tuple[str, ...]:
    """The groups a gradient's local squares are summed over: its fsdp shard's group and, on a 2-D mesh,
    the tensor-parallel groups that shard it; a tensor-parallel DTensor's."""
    spec = shard_spec(tensor)
    if spec is None:
        return norm_groups(tensor)
    return (spec.group_name,) + (spec.tensor_parallel.norm_groups if spec.tensor_parallel is not None else ())


def _all_reduced(step, local: torch.fx.Node, groups) -> torch.fx.Node:
    """`local` summed over the ranks of each process group in `groups`, in turn."""
    for group in sorted(groups):
        local = step.emit(_c10d.wait_tensor.default, step.emit(_c10d.all_reduce.default, local, "sum", group))
    return local


def two_norm(emit, value: torch.fx.Node) -> torch.fx.Node:
    """linalg_vector_norm(value, 2): the op clip_grad_norm_ computes each norm with (``_foreach_norm``
    on CPU is this op per tensor)."""
    return emit(aten.linalg_vector_norm.default, value, 2.0)


def _sharded(step, names: list[str]) -> bool:
    tensors = {p.name: p.tensor for p in step.captured.params if p.tensor is not None}
    return any(shard_spec(tensors.get(name)) is not None or norm_groups(tensors.get(name)) for name in names)


def fused_update_plan(step):
    """The update plan of this compile: optimizer_in_backward's or master_weights' (None: no fused update)."""
    return step.context.get(OPTIMIZER_UPDATE) or step.context.get(MASTER_UPDATE)


def clip_fused_gradients(step, names: list[str], max_norm: float, in_backward: bool = True,
                         to_fp32: set[str] = frozenset(), eager_order: list[str] | None = None) -> None:
    """Scale each fused gradient of `names` by clip_grad_norm_'s coefficient.

    With `eager_order` (the eager lowering) the norm is computed with ``clip_grad_norm_``'s own ATen
    ops, each gradient's 2-norm then the 2-norm of those stacked in that order, so that it rounds as
    eager's bitwise; else as a sum of squared norms, which Inductor fuses into each gradient's kernel
    (``linalg_vector_norm`` is decomposed into that before Inductor's post-grad passes). A norm over
    fsdp's shards is a sum of squares in either lowering (one all-reduce of a scalar)."""
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
    exact = eager_order is not None and not _sharded(step, names)
    reduce = two_norm if exact else squared_norm
    # max_norm = inf never clips (the coefficient is 1): the norm is only reported, so it is taken from
    # the gradients as backward makes them, with no norm-only backward before
    report_only = math.isinf(max_norm)
    if in_backward and not report_only:
        # The norm-only backward: each gradient's copy reduced to its norm as soon as it exists.
        first = first_backward(step, list(values.values()))
        reduced = {value: reduce_after(step, first.copies[value], reduce) for value in values.values()}
        at = first.end
    else:
        reduced = {value: reduce_after(step, value, reduce) for value in values.values()}
        at = step.output_node
    with graph.inserting_before(at):
        if exact:
            ordered = [values[name] for name in eager_order if name in values]
            ordered += [value for value in in_graph_order(graph, values.values()) if value not in ordered]
            norm = two_norm(emit, emit(aten.stack.default, [reduced[value] for value in ordered]))
        else:
            name_of = {value: name for name, value in values.items()}
            squares = {name_of[value]: reduced[value] for value in in_graph_order(graph, values.values())}
            total = summed_over_the_ranks(step, names, squares)
            norm = emit(aten.sqrt.default, total)
        coef = None if report_only else clip_coefficient(emit, norm, max_norm)
    write_grad_norm(step, norm)              # what clip_grad_norm_ returns: optpass.grad_norm(opt)
    if report_only:
        step.annotate_regions()
        return
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

