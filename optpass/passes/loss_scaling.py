"""Pass loss_scaling: dynamic loss scaling with torch.amp.GradScaler's semantics, inside the step.

Precondition: ``options={"optimizer": opt, "grad_scaler": scaler, ...}``; a step
graph with backward inside it that hands its raw gradients to ``opt.step()``
(legality: no gradient transform in the step, no GradScaler called in it); a
fused update in this compile (the update runs in the step graph: after backward,
or inside it with optimizer_in_backward; ``runtime/fused_step.py``), and the scaler's
tensors as extra inputs of the step graph: scale (fp32), growth tracker (int32),
and optpass's "last step skipped" flag and skipped-step count
(``precision/grad_scaler.py``). The loss is already multiplied by the scale: ``scale_loss``
does that on the Dynamo graph, as ``scaler.scale(loss)`` computes it, because
Inductor's post-grad graph has folded backward's seed (ones) into the loss's
backward by the time this pass runs.

Rewrite, before the updates are spliced in (the pass runs first):

    inv_scale = convert(reciprocal(convert(scale, f64)), f32)    # GradScaler's inv_scale
    u_i = convert(g_i, f32) * inv_scale        # each fused gradient, right after it is final
                                               # (back to its dtype when it has no fp32 master)
    found_inf = any(not |g_i| < inf) or ...     # the scaled gradients, as unscale_ checks them
    <every update write: copy_(t, where(found_inf, t, new))>    # StepGraph.write_update
    scale', tracker' = _amp_update_scale(scale, tracker, found_inf, growth, backoff, interval)
    copy_(scale, scale'); copy_(tracker, tracker'); copy_(skipped, found_inf); count += found_inf

After backward, the inf/nan check of each gradient runs right after it and the flags
are combined at the end. Inside backward (optimizer_in_backward) the first update
would run before the last gradient exists, so the check runs in a first, check-only
copy of the backward (``_graph_utils.first_backward``, shared with
global-norm clipping), which reduces each gradient to a flag as soon as it exists.

Effect: torch.amp.GradScaler's step, as ``scaler.scale(loss).backward();
scaler.unscale_(opt); scaler.step(opt); scaler.update()`` runs it, in one graph with
no host sync: the gradients are unscaled in fp32 (Megatron: into the fp32 main
gradients), a step with an inf/nan gradient changes no parameter, master or
optimizer state (``step`` counters included), and the scale backs off or grows by
``torch._amp_update_scale_``'s own kernel. The returned ``loss.detach()`` is the
unscaled loss (the scaled one only feeds backward). Inside backward it costs one
extra backward (bench/optimizer_in_backward.py, variant optpass-scaler).

With data_parallel='zero1' (``ScalingPlan.agree_group``): each rank unscales and
checks its own gradients before they are reduced (unscaling by a power of two is
exact, so before or after the average is the same number), and one all_reduce of
the ranks' flags decides: an inf/nan on one rank reaches every rank's average, so
every rank skips (Megatron all-reduces found_inf over the data-parallel group).
The shard update's new value is guarded too (``shard_optimizer.rewrite._emit_update``): a
skipped step gathers the shards as they were.

Gradient accumulation: a micro-step (no ``opt.step()``) compiled with the same options
differentiates ``loss * scale`` too (``runtime/scaled_micro_step.py``, ``scale_loss``
only, this pass has no plan there); the step that follows unscales and checks
``.grad + its gradients``, the gradient outputs of its graph.

Refuses (``options.py``, ``optpass/legality.py``, ``grad_scaler.check_accumulated``):
accumulation with optimizer_in_backward, a step adding to ``.grad`` that no scaled
micro-step made, fp16 parameters without master_weights (GradScaler refuses to unscale
fp16 gradients), a gradient transform or a GradScaler call in the step.

    before:                                   after (after backward, SGD on fp16 + masters):
      loss = mse_loss(...); l = mul(loss, s)    (the same)
      g0 = mm(t(dy), x0)                        g0 = mm(t(dy), x0); u0 = convert(g0, f32) * inv_scale
      return (loss, g0)                         f0 = any(not |g0| < inf); ...
                                                copy_(m0, where(f0, m0, m0 - lr * u0)); copy_(w0, where(...))
                                                copy_(s, _amp_update_scale(s, tracker, f0, ...)[0]) ...
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from optpass.errors import OptpassError
from optpass.passes._graph_utils import (first_backward, gradient_value, in_graph_order, placeholders_by_dynamo_index,
                                         reduce_after, replacing_gradient)
from optpass.step import REGION_KEY, UPDATE

CONTEXT_KEY = "loss_scaling"

aten = torch.ops.aten
functional = torch.ops._c10d_functional
convert_element_type = torch.ops.prims.convert_element_type.default


@dataclasses.dataclass
class ScalingPlan:
    """What the pass needs: where the scaler's tensors are, which gradients it unscales."""

    scale_index: int                 # Dynamo input index of the scale; tracker, skipped, count follow it
    names: list[str]                 # parameters whose update is fused (their gradients are unscaled)
    fp32_gradients: set[str]         # of those, the ones updated on an fp32 master: unscaled into fp32
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    in_backward: bool
    agree_group: str | None = None   # zero1: the ranks' flags are all-reduced in this process group

    def digest(self) -> str:
        return repr((self.growth_factor, self.backoff_factor, self.growth_interval, self.in_backward,
                     sorted(self.fp32_gradients), self.agree_group))


def scale_loss(gm: torch.fx.GraphModule, scale: torch.fx.Node) -> None:
    """On the Dynamo graph: backward differentiates ``loss * scale`` (``scaler.scale(loss)``: an fp16
    loss times the fp32 scale is fp32, and its gradient reaches the loss rounded to fp16, as in eager)."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.autograd.grad]
    for call in calls:
        loss = call.args[0]
        if not isinstance(loss, torch.fx.Node):
            raise OptpassError("grad_scaler: the step calls backward on several outputs at once "
                               "(torch.autograd.backward([...])); call loss.backward() on one loss.")
        with gm.graph.inserting_before(call):
            scaled = gm.graph.call_function(operator.mul, (loss, scale))
        call.args = (scaled,) + tuple(call.args[1:])
    gm.recompile()


def run(step, options) -> str | None:
    plan: ScalingPlan | None = step.context.get(CONTEXT_KEY)
    if plan is None:
        return ("not requested (options grad_scaler)" if options.grad_scaler is None
                else "no fused update in this compile")
    graph, emit = step.graph, step.emit
    inputs = placeholders_by_dynamo_index(graph)
    scale, tracker, skipped, count = (inputs[plan.scale_index + i] for i in range(4))
    with graph.inserting_before(_first_op(graph)):
        # GradScaler._unscale_grads_: inv_scale = scale.double().reciprocal().float()
        inv_scale = emit(convert_element_type, emit(aten.reciprocal.default,
                                                    emit(convert_element_type, scale, torch.float64)),
                         torch.float32)
    raw = {name: gradient_value(step.gradient_nodes[name]) for name in plan.names}
    unscaled = {}
    for name, value in raw.items():
        with graph.inserting_before(value.next), replacing_gradient(step, name, value) as replace:
            unscaled[name] = _unscale(emit, value, inv_scale, fp32=name in plan.fp32_gradients)
            replace(unscaled[name])
    step.annotate_regions()
    if plan.in_backward:
        # every update needs the verdict before it runs: take it in a check-only first backward
        first = first_backward(step, list(unscaled.values()))
        flags = [reduce_after(step, copy, non_finite)
                 for copy in in_graph_order(graph, [first.copies[value] for value in raw.values()])]
        combine_at = first.end
    else:
        flags = [reduce_after(step, value, non_finite) for value in in_graph_order(graph, raw.values())]
        combine_at = step.output_node
    with graph.inserting_before(combine_at):
        found_inf = flags[0]
        for flag in flags[1:]:
            found_inf = emit(aten.logical_or.default, found_inf, flag)
        if plan.agree_group is not None:
            found_inf = agreed_by_every_rank(emit, found_inf, plan.agree_group)
    step.skip_update = found_inf
    with graph.inserting_before(step.output_node):
        found = emit(convert_element_type, found_inf, torch.float32)
        updated = emit(aten._amp_update_scale.default, scale, tracker, found, plan.growth_factor,
                       plan.backoff_factor, plan.growth_interval)
        writes = [emit(aten.copy_.default, scale, emit(operator.getitem, updated, 0)),
                  emit(aten.copy_.default, tracker, emit(operator.getitem, updated, 1)),
                  emit(aten.copy_.default, skipped, found),
                  emit(aten.copy_.default, count,
                       emit(aten.add.Tensor, count, emit(convert_element_type, found_inf, torch.int64)))]
    for node in writes:
        node.meta[REGION_KEY] = UPDATE
    step.annotate_regions()
    step.notes.append(f"{len(raw)} gradients unscaled{' into fp32' if plan.fp32_gradients else ''}; "
                      f"the update is skipped on inf/nan (checked {'in a first backward' if plan.in_backward else 'after backward'})")
    return None


def agreed_by_every_rank(emit, found_inf: torch.fx.Node, group: str) -> torch.fx.Node:
    """True on every rank when any rank found an inf/nan: one all_reduce of the local flags (as fp32:
    gloo sums no bools). Every rank then skips, or none does, and the scales stay equal."""
    local = emit(convert_element_type, found_inf, torch.float32)
    total = emit(functional.wait_tensor.default, emit(functional.all_reduce.default, local, "sum", group))
    return emit(aten.gt.Scalar, total, 0)


def _unscale(emit, gradient: torch.fx.Node, inv_scale: torch.fx.Node, fp32: bool) -> torch.fx.Node:
    """g * inv_scale computed in fp32, as torch._amp_foreach_non_finite_check_and_unscale_ does; kept in
    fp32 for an fp32 master, else rounded back to the gradient's dtype (unscale_ works in place)."""
    dtype = gradient.meta["val"].dtype
    wide = gradient if dtype == torch.float32 else emit(convert_element_type, gradient, torch.float32)
    result = emit(aten.mul.Tensor, wide, inv_scale)
    return result if fp32 or dtype == torch.float32 else emit(convert_element_type, result, dtype)


def non_finite(emit, gradient: torch.fx.Node) -> torch.fx.Node:
    """A 0-d bool: does `gradient` hold an inf or a nan. Spelled as torch's isfinite decomposes
    (|g| < inf is false for ±inf and nan): Inductor's CPU code for isinf | isnan was 7x slower."""
    finite = emit(aten.lt.Scalar, emit(aten.abs.default, gradient), float("inf"))
    return emit(aten.any.default, emit(aten.logical_not.default, finite))


def _first_op(graph: torch.fx.Graph) -> torch.fx.Node:
    return next(n for n in graph.nodes if n.op != "placeholder")
