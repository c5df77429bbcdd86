"""Pass update_keeps_parameters_at_zero_lr: an optimizer's compiled step leaves its parameters as
they are at lr = 0, as eager torch.optim does.

Precondition: the graph of ``opt.step()`` compiled on its own (``GraphKind.UPDATE``: the update is
not fused into the step), with a tensor lr (a graph input) or a float lr (a constant: each value
compiles again, so a graph compiled at lr = 0 runs only at lr = 0), writing each parameter in place
(``copy_`` into its placeholder).

Rewrite: where a parameter's new value divides by something computed from its group's lr (torch's
capturable Adam and AdamW, the formulation every compiled Adam takes: ``denom = sqrt(v) / (bc2 *
-step_size) + eps / -step_size`` with ``step_size = lr / bias_correction1``), its write becomes
``where(lr == 0, param, new value)`` (``optim.harvest.keep_parameters_at_zero_lr``, which the
fused update's harvest applies too). With a float lr of 0 in the parameter's group (read from the
optimizer whose ``step`` Dynamo is tracing), a write that divides by an exact zero made from that
constant becomes the parameter itself (``keep_parameters_dividing_by_a_zero_lr``). State writes are
left alone: they do not read lr.

Effect: at lr = 0 (the first step of a warmup schedule that starts at 0) an entry whose gradient
and second moment are zero was 0/0 = NaN, in the parameter and then in every loss; now it keeps its
value, which is what eager Adam computes. Any other lr: the same value (one ``where`` Inductor fuses
into the update's kernel). docs/design.md §53.

Refuses: nothing; skips an update graph with no tensor lr and no float lr of 0, or no division by it.

    before:                                        after:
      neg = neg(div(lr, bc1))                        neg = neg(div(lr, bc1))
      denom = add(div(sqrt(v), mul(bc2, neg)), ...)  denom = add(div(sqrt(v), mul(bc2, neg)), ...)
      new = add(p, div(m, denom))                    new = add(p, div(m, denom))
      copy_(p, new)                                  kept = where(eq(lr, 0), p, new)
                                                     copy_(p, kept)
"""

from __future__ import annotations

import torch

from optpass.dynamo_scope import _current_trace
from optpass.optim.harvest import keep_parameters_at_zero_lr, keep_parameters_dividing_by_a_zero_lr


def run(step, options) -> str | None:
    lr_indices = {index for index, source in step.captured.hyperparameter_inputs.items()
                  if source.endswith("['lr']")}
    lrs = {node for node in step.graph.nodes if node.op == "placeholder"
           and getattr(node.meta.get("desc"), "idx", None) in lr_indices}
    params = set(step.param_nodes.values())
    writes = {node.args[0]: node.args[1] for node in step.graph.nodes
              if node.target is torch.ops.aten.copy_.default and node.args[0] in params}
    if lrs:
        kept = keep_parameters_at_zero_lr(step.graph, writes, params, lrs)
        if not kept:
            return "no parameter's update divides by lr"
        step.notes.append(f"{len(kept)} parameter(s) kept at lr == 0 (their update divides by lr)")
        return None
    at_zero = _parameters_at_a_float_zero_lr(step)
    if not at_zero:
        return "no tensor lr among the update's inputs, and no float lr of 0"
    kept = keep_parameters_dividing_by_a_zero_lr(step.graph, writes, at_zero & params)
    if not kept:
        return "no parameter's update divides by its float lr of 0"
    step.graph.eliminate_dead_code()
    step.notes.append(f"{len(kept)} parameter(s) kept at a float lr of 0 (their update divided by it)")
    return None


def _parameters_at_a_float_zero_lr(step) -> set:
    """The placeholders of the parameters whose group has a float lr of 0, in the optimizer whose
    ``step()`` Dynamo is tracing (the frame this update graph comes from); empty if none is found."""
    trace = _current_trace()
    optimizer = trace.f_locals.get("self") if trace is not None else None
    if not isinstance(optimizer, torch.optim.Optimizer):
        return set()
    zero = {id(p) for group in optimizer.param_groups
            if not isinstance(group.get("lr"), torch.Tensor) and group.get("lr") == 0 for p in group["params"]}
    return {step.param_nodes[p.name] for p in step.captured.params
            if p.tensor is not None and id(p.tensor) in zero and p.name in step.param_nodes}
