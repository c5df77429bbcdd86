"""The step callable for master_weights: every update on the fp32 masters."""

from __future__ import annotations

import torch

from optpass.capture import CapturedGraph
from optpass.passes.master_weights import CONTEXT_KEY as MASTER_KEY, MasterPlan
from optpass.precision.masters import master_state
from optpass.runtime.fused_step import FusedStep


class MasterWeightsStep(FusedStep):
    """The step callable for master_weights (with or without optimizer_in_backward).

    Same life cycle as FusedStep, but the update is the master
    optimizer's (``precision/masters.py``: the user's class and hyper-parameters
    over fp32 masters): the ``master_weights`` pass casts each bf16/fp16 gradient
    to fp32, runs torch.optim's harvested update on the master, and copies the
    rounded master into the parameter, inside backward (optimizer_in_backward) or
    after it. The masters are extra inputs of the fused graph, like the state; only
    the parameters the step updates have them (made when a step first updates them).
    """

    feature = "master_weights"

    def __init__(self, gm, captured: CapturedGraph, options, plain, compile_fn):
        self.masters = master_state(options.optimizer, options.master_weights)
        super().__init__(gm, captured, options, plain, compile_fn)

    def __call__(self, *args):
        self.masters.adopt_loaded()          # a checkpoint loaded before optpass knew the optimizer
        self.masters.refresh()
        return super().__call__(*args)

    def _find_fused_parameters(self) -> None:
        self.masters.sync_groups()           # add_param_group: the new group gets masters
        super()._find_fused_parameters()

    @torch._dynamo.disable
    def _compile_fused(self, args):
        self.masters.sync_settings()         # harvest the update the user's optimizer describes now
        return super()._compile_fused(args)

    def _update_source(self):
        # a parameter this step updates for the first time gets its master now (none for the others)
        master_of = self.masters.masters_for(self.fused.values())
        return self.masters.master_optimizer, {name: master_of[id(p)] for name, p in self.fused.items()}

    def _separate_params(self, names):
        return [name for name, master in names.items() if master is not self.fused[name]]

    def _make_plan(self, harvested, lr_index, state_index, param_index):
        return MASTER_KEY, MasterPlan(harvested, lr_index, state_index, param_index,
                                      in_backward=self.options.optimizer_in_backward,
                                      clip_grad_norm=self.options.clip_grad_norm)
