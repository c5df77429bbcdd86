"""The step callable that runs the optimizer inside backward (options optimizer_in_backward).

Dynamo calls this object in place of the step graph. Each call is one
micro-step; with ``accumulation_steps=K`` calls 1..K-1 run the plain graph
(gradients accumulate into ``.grad``) and call K runs the fused graph:

* **first update** — torch.optim creates its state during its first step (SGD's
  momentum buffer *is* the first gradient), so the first update runs the plain
  graph and ``opt.step()`` eagerly, here, on the gradients it produced;
* **afterwards** — the update is harvested from torch.optim (``harvest.py``),
  the step graph gets the optimizer's state tensors and each group's lr as
  extra inputs (fact 22), and the ``optimizer_in_backward`` pass splices each
  parameter's update in after its gradient is final.

Either way the fused parameters' gradient outputs are ``None``: ``p.grad`` is
None after the step and the ``opt.step()`` in the step has nothing to do
(fact 4). State lives in ``opt.state`` as always, read afresh at every call, so
``state_dict()``/``load_state_dict()`` keep working. A float lr is copied into
a 0-d tensor input at every call (a scheduler never causes a recompile); any
other hyper-parameter is part of the harvested update, so changing it is an
error rather than a silently stale update.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable
from weakref import WeakKeyDictionary

import torch
import torch.fx

from optpass.capture import CapturedGraph
from optpass.errors import OptpassError
from optpass.harvest import HarvestedUpdate, harvest_update
from optpass.passes.optimizer_in_backward import CONTEXT_KEY

# Per optimizer: micro-steps seen and whether torch.optim has created its state.
_SESSIONS: WeakKeyDictionary = WeakKeyDictionary()


@dataclasses.dataclass
class _Session:
    micro_steps: int = 0
    updated_once: bool = False


@dataclasses.dataclass
class UpdatePlan:
    """What the optimizer_in_backward pass needs: the harvest and where its inputs are."""

    harvested: HarvestedUpdate
    lr_index: dict[int, int]                  # param group -> Dynamo input index
    state_index: dict[tuple[str, str], int]   # (parameter, state key) -> Dynamo input index


class OptimizerInBackwardStep:
    def __init__(self, gm: torch.fx.GraphModule, captured: CapturedGraph, options, plain: Callable,
                 compile_fn: Callable[[torch.fx.GraphModule, list, dict], Callable]):
        self.gm, self.captured, self.options, self.compile_fn = gm, captured, options, compile_fn
        self.plain = plain
        self.optimizer: torch.optim.Optimizer = options.optimizer
        in_optimizer = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        self.fused = {p.name: p.tensor for p in captured.params
                      if p.name in captured.gradient_outputs and id(p.tensor) in in_optimizer}
        if not self.fused:
            raise OptpassError("optimizer_in_backward: none of the parameters that get gradients in "
                               "this step are in options['optimizer'].")
        self.fused_slots = [captured.gradient_outputs[name] for name in self.fused]
        self.session = _SESSIONS.setdefault(self.optimizer, _Session())
        self._fused: Callable | None = None
        self._extras: Callable[[], list] | None = None
        self._hyperparameters: list[dict] | None = None

    def __call__(self, *args):
        self.session.micro_steps += 1
        if self.session.micro_steps % self.options.accumulation_steps:
            return self.plain(*args)                       # accumulate into .grad
        if not self.session.updated_once:
            outputs = list(self.plain(*args))
            self._step_eagerly(outputs)                    # torch.optim creates its state
            self.session.updated_once = True
            return self._without_fused_gradients(outputs)
        if self._fused is None:
            self._compile_fused(list(args))
        self._check_hyperparameters()
        return self._without_fused_gradients(list(self._fused(*args, *self._extras())))

    # -------------------------------------------------------------- plain

    def _without_fused_gradients(self, outputs: list) -> list:
        for slot in self.fused_slots:
            outputs[slot] = None
        return outputs

    @torch._dynamo.disable
    def _step_eagerly(self, outputs: list) -> None:
        for name, slot in zip(self.fused, self.fused_slots):
            self.fused[name].grad = outputs[slot]
        if self.options.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(self.fused.values()), self.options.clip_grad_norm)
        self.optimizer.step()
        for p in self.fused.values():
            p.grad = None

    # -------------------------------------------------------------- fused

    @torch._dynamo.disable
    def _compile_fused(self, args: list) -> None:
        harvested = harvest_update(self.optimizer, self.fused)
        groups = sorted(harvested.lr)
        state_keys = [(name, key) for name, update in harvested.updates.items() for key in update.states]
        gm = torch.fx.GraphModule(self.gm, copy.deepcopy(self.gm.graph))
        first_extra = _append_placeholders(gm, [f"optpass_lr_{g}" for g in groups] +
                                           [f"optpass_state_{n}_{k}".replace(".", "_") for n, k in state_keys])
        plan = UpdatePlan(
            harvested,
            lr_index={g: first_extra + i for i, g in enumerate(groups)},
            state_index={nk: first_extra + len(groups) + i for i, nk in enumerate(state_keys)})
        float_lr = {g: torch.zeros((), dtype=torch.float64) for g in groups
                    if not isinstance(self.optimizer.param_groups[g]["lr"], torch.Tensor)}
        params = {name: self.fused[name] for name, _ in state_keys}

        def extras() -> list:
            lrs = []
            for g in groups:
                lr = self.optimizer.param_groups[g]["lr"]
                lrs.append(lr if isinstance(lr, torch.Tensor) else float_lr[g].fill_(lr))
            return lrs + [self.optimizer.state[params[name]][key] for name, key in state_keys]

        self._extras = extras
        self._hyperparameters = self._hyperparameter_snapshot()
        self._fused = self.compile_fn(gm, args + extras(), {CONTEXT_KEY: plan})

    def _hyperparameter_snapshot(self) -> list[dict]:
        keys = [k for k in self.optimizer.defaults if k not in ("lr", "foreach", "fused")]
        return [{k: copy.deepcopy(g.get(k)) for k in keys} for g in self.optimizer.param_groups]

    def _check_hyperparameters(self) -> None:
        now = self._hyperparameter_snapshot()
        for index, (then, current) in enumerate(zip(self._hyperparameters, now)):
            changed = [k for k in then if not _same(then[k], current[k])]
            if changed:
                key = changed[0]
                raise OptpassError(
                    f"optimizer_in_backward: hyper-parameter {key!r} of param group {index} changed "
                    f"from {then[key]!r} to {current[key]!r} after the update was compiled into "
                    "backward. Only lr may change between steps (it is a graph input); e.g. use "
                    "OneCycleLR(cycle_momentum=False), or drop optimizer_in_backward.")


def refuse_update_during_accumulation(captured: CapturedGraph, options) -> None:
    """With accumulation_steps > 1 optpass applies the update; an opt.step() in the step would too."""
    from optpass.capture import GraphKind

    if captured.kind is not GraphKind.UPDATE or options.accumulation_steps == 1:
        return
    fused = {id(p) for g in options.optimizer.param_groups for p in g["params"]}
    if any(id(p.tensor) in fused for p in captured.params):
        raise OptpassError(
            f"accumulation_steps={options.accumulation_steps} with optimizer_in_backward: optpass "
            "applies the update inside backward at every K-th call of the compiled micro-step, but "
            "this step also calls opt.step() with gradients present, which would update every "
            "micro-step. Remove opt.step()/opt.zero_grad() from the micro-step function.")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _append_placeholders(gm: torch.fx.GraphModule, names: list[str]) -> int:
    """Add inputs after the existing ones; returns the index of the first new one."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_before(placeholders[-1].next):
        for name in names:
            node = gm.graph.placeholder(name)
            node._dynamo_source = None  # AOTAutograd checks Dynamo metadata of every placeholder
    gm.recompile()
    return len(placeholders)
