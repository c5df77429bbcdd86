"""Pass update_keeps_parameters_at_zero_lr: an optimizer's compiled step leaves its parameters as
they are at lr = 0, as eager torch.optim does.

Precondition: the graph of ``opt.step()`` compiled on its own (``GraphKind.UPDATE``: the update is
not fused into the step), with a tensor lr (a graph input; a float lr is a constant and each value
compiles again), writing each parameter in place (``copy_`` into its placeholder).

Rewrite: where a parameter's new value divides by something computed from its group's lr (torch's
capturable Adam and AdamW, the formulation every compiled Adam takes: ``denom = sqrt(v) / (bc2 *
-step_size) + eps / -step_size`` with ``step_size = lr / bias_correction1``), its write becomes
``where(lr == 0, param, new value)`` (``optim.harvest.keep_parameters_at_zero_lr``, which the
fused update's harvest applies too). State writes are left alone: they do not read lr.

Effect: at lr = 0 (the first step of a warmup schedule that starts at 0) an entry whose gradient
and second moment are zero was 0/0 = NaN, in the parameter and then in every loss; now it keeps its
value, which is what eager Adam computes. Any other lr: the same value (one ``where`` Inductor fuses
into the update's kernel). docs/design.md §53.

Refuses: nothing; skips an update graph with no tensor lr or no division by it.

    before:                                        after:
      neg = neg(div(lr, bc1))                        neg = neg(div(lr, bc1))
      denom = add(div(sqrt(v), mul(bc2, neg)), ...)  denom = add(div(sqrt(v), mul(bc2, neg)), ...)
      new = add(p, div(m, denom))                    new = add(p, div(m, denom))
      copy_(p, new)                                  kept = where(eq(lr, 0), p, new)
                                                     copy_(p, kept)
"""

from __future__ import annotations

import torch

from optpass.optim.harvest import keep_parameters_at_zero_lr


def run(step, options) -> str | None:
    lr_indices = {index for index, source in step.captured.hyperparameter_inputs.items()
                  if source.endswith("['lr']")}
    lrs = {node for node in step.graph.nodes if node.op == "placeholder"
           and getattr(node.meta.get("desc"), "idx", None) in lr_indices}
    if not lrs:
        return "no tensor lr among the update's inputs"
    params = set(step.param_nodes.values())
    writes = {node.args[0]: node.args[1] for node in step.graph.nodes
              if node.target is torch.ops.aten.copy_.default and node.args[0] in params}
    kept = keep_parameters_at_zero_lr(step.graph, writes, params, lrs)
    if not kept:
        return "no parameter's update divides by lr"
    step.notes.append(f"{len(kept)} parameter(s) kept at lr == 0 (their update divides by lr)")
    return None
