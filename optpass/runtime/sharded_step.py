"""The step callable for data_parallel='zero1', and the sharded optimizer it is made with."""

from __future__ import annotations

import torch.fx

from optpass.capture import CapturedGraph, models_read, module_buffers
from optpass.errors import OptpassError
from optpass.passes.shard_optimizer import CONTEXT_KEY as SHARD_KEY, ShardPlan, choose_collectives
from optpass.runtime.fused_step import FusedStep
from optpass.zero1.agreement import failed_step_error
from optpass.zero1.layout import gradient_order, trainable_params
from optpass.zero1.state import sharded_optimizer


def shard_the_optimizer(gm: torch.fx.GraphModule, captured: CapturedGraph, options):
    """This rank's ZeRO-1 state of ``options.optimizer`` (``zero1.state.sharded_optimizer``), made at the
    first compile of any step graph that uses it, a micro-step's included: the ranks agree on the model and
    take rank 0's parameters before any gradient is computed, and the optimizer refuses an eager
    ``opt.step()`` from then on. Buckets follow the order in which this graph's backward makes the
    gradients final (every step graph of the program runs the same backward)."""
    names_by_id = {id(p.tensor): p.name for p in captured.params}
    placeholder_of = {id(p.tensor): p.input_index for p in captured.params if p.input_index is not None}
    trainable = trainable_params(options.optimizer)
    order = gradient_order(gm.graph, {i: placeholder_of[id(p)] for i, (_, p) in enumerate(trainable)
                                      if id(p) in placeholder_of}, len(trainable))
    return sharded_optimizer(options.optimizer, options.process_group, options.partition,
                             options.bucket_bytes, names_by_id, options.master_weights, order,
                             step=options.across_ranks(), replicated=replicated_tensors(gm, captured, trainable))


def replicated_tensors(gm: torch.fx.GraphModule, captured: CapturedGraph, trainable) -> dict[str, torch.Tensor]:
    """What DDP broadcasts from rank 0 when it wraps the model, besides the parameters zero1 trains:
    the frozen parameters and the buffers this graph reads, and every other parameter and buffer
    registered in the models it reads (a buffer read only in evaluation, a frozen layer the step
    skips), by name, each tensor once."""
    trained = {id(p) for _, p in trainable}
    found = {p.name: p.tensor for p in captured.params if not p.tensor.requires_grad}
    found.update(module_buffers(gm))
    for root, model in models_read(gm).items():
        found.update({f"{root}.{n}": p for n, p in model.named_parameters() if id(p) not in trained
                      and f"{root}.{n}" not in found})
        found.update({f"{root}.{n}": b for n, b in model.named_buffers() if f"{root}.{n}" not in found})
    once: dict[int, tuple[str, torch.Tensor]] = {}
    for name, tensor in found.items():
        once.setdefault(id(tensor), (name, tensor))
    return dict(once.values())


class ShardedStep(FusedStep):
    """The step callable for data_parallel='zero1' (with or without optimizer_in_backward).

    Same life cycle as FusedStep, but the update is this rank's
    shard optimizer's (``zero1/state.py``): from the first update on, the ``shard_optimizer``
    pass puts reduce-scatter, shard update and all-gather into the step graph (the
    shard optimizer's state is created 1/N-sized, as torch.optim's first step would).
    With master_weights the fp32 master shards are extra inputs of the fused graph,
    like the state, and the graph updates them in place.
    """

    feature = "data_parallel='zero1'"

    def __init__(self, gm, captured: CapturedGraph, options, plain, compile_fn):
        names_by_id = {id(p.tensor): p.name for p in captured.params}
        self.sharded = shard_the_optimizer(gm, captured, options)
        super().__init__(gm, captured, options, plain, compile_fn)
        self.names = {i: names_by_id.get(id(p)) for i, (_, p) in enumerate(self.sharded.params)}
        sharded_ids = {id(p) for _, p in self.sharded.params}
        unsharded = [name for name, p in self.fused.items() if id(p) not in sharded_ids]
        if unsharded:
            raise OptpassError(
                f"data_parallel='zero1': parameter(s) {', '.join(unsharded[:3])} get gradients in this step "
                "but did not require grad when the optimizer was sharded (at its first compiled step: "
                "unfrozen since?). ZeRO-1 buckets and shards the parameters that require grad then, and "
                "cannot add one later: its gradient would be dropped. Set requires_grad on every parameter "
                "to train before the first step, or build a new optimizer (and compile the step with it) "
                "after unfreezing.")
        missing = [name or self._optimizer_position(i) for i, name in self.names.items()
                   if name not in self.fused]
        if missing:
            raise OptpassError(
                f"data_parallel='zero1': {len(missing)} parameter(s) in the optimizer require grad but get no "
                f"gradient in this step: {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}. ZeRO-1 "
                "reduces and updates every parameter of its optimizer at every step, so a parameter that a "
                "step does not use (on every rank, or on some: what DDP's find_unused_parameters=True "
                "allows) is not supported. Set requires_grad=False on parameters the step never uses, or "
                "leave them out of the optimizer; a model whose steps use different parameters "
                "(alternating heads, a branch per rank) cannot train under zero1.")

    def _optimizer_position(self, index: int) -> str:
        """A parameter the graph does not name: where it is in the optimizer, and its shape."""
        group, p = self.sharded.params[index]
        position = next(k for k, q in enumerate(self.optimizer.param_groups[group]["params"]) if q is p)
        return f"opt.param_groups[{group}]['params'][{position}] of shape {list(p.shape)}"

    def __call__(self, *args):
        self.sharded.refresh_masters()       # a checkpoint without masters was loaded
        try:
            return self.sharded.replicas.run(super().__call__, args)    # rank 0's buffers first
        except OptpassError:
            raise
        except RuntimeError as error:
            raise failed_step_error("zero1", self.sharded.pg.group, error, self.optimizer) from error

    def _find_fused_parameters(self) -> None:
        if self._membership is not None:
            raise OptpassError(
                "data_parallel='zero1': the optimizer's param groups changed (add_param_group?) after "
                "the parameters were bucketed and sharded over the ranks. Build the optimizer with every "
                "param group before the first step.")
        super()._find_fused_parameters()

    def _update_source(self):
        shard_optimizer = self.sharded.shard_optimizer
        if shard_optimizer is None:
            return None, {}
        return shard_optimizer, {self.sharded.shard_name(b): self.sharded.shards[b.index]
                                 for b in self.sharded.layout.buckets if b.index in self.sharded.shards}

    def _lr(self, group: int):
        return self.optimizer.param_groups[self.sharded.user_group[group]]["lr"]

    def _separate_params(self, names):
        """The fp32 master shards (master_weights): they persist, so they are inputs of the graph."""
        buckets = {self.sharded.shard_name(b): b for b in self.sharded.layout.buckets}
        return [name for name in names if self.sharded.has_master(buckets[name])]

    def _scaled_gradients(self, harvested, separate):
        """Every bucketed parameter's own gradient: each rank unscales and checks its gradients before
        the reduction (unscaling is exact: the scale is a power of two), into fp32 for the buckets
        updated on fp32 masters (they are reduced in fp32 anyway)."""
        layout = self.sharded.layout
        return ([self.names[i] for i in layout.parameters()],
                {self.names[i] for b in layout.buckets if self.sharded.has_master(b) for i in b.params})

    def _found_inf_group(self):
        """An inf/nan in one rank's gradients reaches every rank's averaged gradients: every rank
        skips. One all_reduce of the local flags decides (Megatron: of found_inf over the DP group)."""
        return self.sharded.pg.name

    def _make_plan(self, harvested, lr_index, state_index, param_index):
        device = self.sharded.params[0][1].device
        return SHARD_KEY, ShardPlan(self.sharded, self.names, harvested, lr_index, state_index,
                                    in_backward=self.options.optimizer_in_backward,
                                    clip_grad_norm=self.options.clip_grad_norm, master_index=param_index,
                                    collectives=choose_collectives(self.options.collectives,
                                                                   self.sharded.pg.backend_for(device)))
