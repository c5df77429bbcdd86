"""Pass master_weights: bf16/fp16 parameters updated through fp32 master copies (Megatron's step).

Precondition: ``options={"optimizer": opt, "master_weights": torch.float32}``; a
step graph with backward inside it (legality: no GradScaler, no graph break
between ``backward()`` and ``opt.step()``; with optimizer_in_backward also its
own proof); the master optimizer's update harvested from torch.optim
(``optim/harvest.py``; ``precision/masters.py`` holds the masters and that optimizer),
with each master, the master optimizer's state and each group's lr as extra
inputs of the step graph (``runtime/master_weights_step.py`` adds them).

Rewrite, for each parameter ``p`` the optimizer updates, with ``m`` its fp32 master:

    g32 = convert_element_type(grad_p, float32)
    m'  = <torch.optim update of (m, g32, state, lr)>;  copy_(m, m'); copy_(state, ...)
    copy_(p, convert_element_type(m', p.dtype))          # round to nearest even

A parameter that is already fp32 is its own master: its update is spliced as
optimizer_in_backward splices it (no casts). Placement: with optimizer_in_backward
right after ``p``'s gradient is final and every read of ``p``'s old value is done
(as that pass places it); without it, after the whole step graph (after any
gradient transform the step makes, e.g. ``clip_grad_norm_``), one parameter after
the other. Every updated parameter's gradient output slot becomes ``None``.

Effect: the update happens in fp32 on the master, so updates smaller than half a
ulp of a bf16 weight accumulate instead of being lost; the model's parameters are
the masters rounded. ``p.grad`` is None after the step and the step's
``opt.step()`` has nothing to do (docs/design.md §17). With optimizer_in_backward each
half-precision gradient dies at its update, and no fp32 gradient buffer exists
(one fp32 gradient at a time).

With ``data_parallel="zero1"`` this pass is skipped: each rank keeps only its
shard of the masters, and ``shard_optimizer`` updates them (see its docstring).

A gradient that arrives in fp32 already (unscaled by loss_scaling, or cast for
clip_grad_norm, which clips the fp32 gradients) is not cast again; every write
goes through ``StepGraph.write_update`` (skipped on inf/nan with a grad_scaler).

Refuses (``options.py``, ``optpass/legality.py``): a master dtype other than float32, no
optimizer, a GradScaler called in the step (the ``grad_scaler`` option is the way), an optimizer
over parameters none of which is bf16/fp16.

    before:                                   after (optimizer_in_backward):
      g1 = mm(t(dy), x1)          # bf16        g1 = mm(t(dy), x1)
      dx = mm(dy, w1)                           dx = mm(dy, w1)
      ...                                       g1f = convert_element_type(g1, f32)
      return (loss, g0, g1)                     m1' = <AdamW(m1, g1f, state1, lr)>; copy_(m1, m1')
                                                copy_(w1, convert_element_type(m1', bf16))
                                                ...
                                                return (loss, None, None)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from optpass.passes._graph_utils import (MASTER_UPDATE, copy_slice, last_node_update_must_follow,
                                         keep_updates_where_gradients_die, placeholders_by_dynamo_index,
                                         take_gradient_outputs)
from optpass.passes._row_chunks import copy_slice_in_row_chunks, row_chunks
from optpass.step import REGION_KEY, UPDATE

CONTEXT_KEY = MASTER_UPDATE

convert_element_type = torch.ops.prims.convert_element_type.default


@dataclasses.dataclass
class MasterPlan:
    """What the pass needs: the master optimizer's harvested update and where its inputs are."""

    harvested: object                          # HarvestedUpdate of the master optimizer
    lr_index: dict[int, int]                   # param group -> Dynamo input index
    state_index: dict[tuple[str, str], int]    # (parameter, state key) -> Dynamo input index
    master_index: dict[str, int]               # parameter -> Dynamo input index of its master
    in_backward: bool
    clip_grad_norm: float | None = None        # the global norm clip_grad_norm_in_backward clips to

    def digest(self) -> str:
        """What changes the rewritten graph beyond the step's roles (Inductor cache key)."""
        return f"{self.harvested.digest()}-masters={sorted(self.master_index)}-in_backward={self.in_backward}"

    @property
    def inductor_config(self) -> dict:
        """Inductor keeps each update where its gradient dies (``keep_updates_where_gradients_die``)."""
        return keep_updates_where_gradients_die(self.in_backward)


def run(step, options) -> str | None:
    plan = step.context.get(CONTEXT_KEY)
    if plan is None:
        if options.master_weights is None:
            return "not requested (options master_weights)"
        if options.data_parallel is not None:
            return "data_parallel='zero1': shard_optimizer updates this rank's fp32 master shards"
        return "this compile keeps gradients (a step without opt.step(), or an accumulation micro-step)"
    update_through_masters(step, plan)
    updates = plan.harvested.updates
    step.notes.append(f"{len(plan.master_index)} of {len(updates)} parameters updated on fp32 masters, "
                      f"{'inside' if plan.in_backward else 'after'} backward")
    return None


def update_through_masters(step, plan: MasterPlan) -> None:
    graph = step.graph
    inputs = placeholders_by_dynamo_index(graph)
    gradients = take_gradient_outputs(step, list(plan.harvested.updates))
    # Positions of the original nodes, once (as optimizer_in_backward: a slice reads its own parameter only).
    position = {n: i for i, n in enumerate(graph.nodes)}
    end = step.output_node.prev
    for name, update in plan.harvested.updates.items():
        param = step.param_nodes[name]
        anchor = last_node_update_must_follow(position, param, gradients[name]) if plan.in_backward else end
        with graph.inserting_before(anchor.next):  # keeps the emitted order
            inserted = _emit_update(step, plan, name, update, param, gradients[name], inputs)
        for node in inserted:
            node.meta[REGION_KEY] = UPDATE
        if not plan.in_backward:
            end = inserted[-1]
    step.gradient_nodes.clear()


def _emit_update(step, plan: MasterPlan, name: str, update, param, gradient, inputs) -> list[torch.fx.Node]:
    """The update of `param` at the insert point: through its master if it has one."""
    env = {ph: inputs[plan.state_index[(name, key)]] for key, ph in update.states.items()}
    env.update({ph: inputs[plan.lr_index[group]] for ph, group in update.lr.items()})
    chunks = row_chunks(update, gradient) if plan.in_backward else None
    if chunks:      # a large gradient made by one GEMM: made and applied in row chunks (_row_chunks.py)
        step.notes.append(f"{name}: gradient made and applied in {len(chunks)} row chunks")
    if name not in plan.master_index:                    # fp32: its own master
        env.update({update.param: param, update.gradient: gradient})
        return copy_slice_in_row_chunks(step, update, env, gradient, chunks) if chunks else copy_slice(step, update, env)
    master = inputs[plan.master_index[name]]
    if chunks:
        env.update({update.param: master, update.gradient: gradient})
        return copy_slice_in_row_chunks(step, update, env, gradient, chunks, round_into=param)
    inserted = []
    if gradient.meta["val"].dtype != master.meta["val"].dtype:     # fp32 already after unscaling / clipping
        gradient = step.emit(convert_element_type, gradient, master.meta["val"].dtype)
        inserted.append(gradient)
    env.update({update.param: master, update.gradient: gradient})
    inserted += copy_slice(step, update, env)                  # writes the master and its state
    rounded = step.emit(convert_element_type, env[update.writes[update.param]], param.meta["val"].dtype)
    return inserted + [rounded, step.write_update(param, rounded)]
