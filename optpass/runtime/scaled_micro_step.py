"""The step callable of a micro-step of gradient accumulation under grad_scaler."""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.fx

from optpass.capture import CapturedGraph
from optpass.passes import loss_scaling
from optpass.precision import grad_scaler
from optpass.runtime.fused_step import append_placeholders, symbolic_inputs


class ScaledMicroStep:
    """A micro-step of gradient accumulation under grad_scaler (backward, no ``opt.step()``, the update
    after backward): its graph differentiates ``loss * scale`` (``loss_scaling.scale_loss``, the
    scaler's scale an extra input read at every call), so ``.grad`` accumulates scaled gradients, as
    ``scaler.scale(loss).backward()`` leaves them; it returns what the step returns (the unscaled
    loss). The step that follows, compiled with the same options, unscales, checks and applies the
    sum (``grad_scaler.check_accumulated`` refuses a sum no scaled micro-step made)."""

    def __init__(self, gm: torch.fx.GraphModule, captured: CapturedGraph, options,
                 compile_fn: Callable[[torch.fx.GraphModule, list, dict], Callable]):
        self.gm, self.scaler, self.compile_fn = gm, options.grad_scaler, compile_fn
        self.device = captured.params[0].tensor.device if captured.params else torch.device("cpu")
        self._run: Callable | None = None

    def __call__(self, *args):
        scale = grad_scaler.graph_inputs(self.scaler, self.device)[0]
        if self._run is None:
            self._run = self._compile(list(args), scale)
        outputs = self._run(*args, scale)
        grad_scaler.note_micro_step(self.scaler)
        return outputs

    @torch._dynamo.disable
    def _compile(self, args: list, scale: torch.Tensor) -> Callable:
        gm = torch.fx.GraphModule(self.gm, copy.deepcopy(self.gm.graph))
        index = append_placeholders(gm, ["optpass_scale"])
        loss_scaling.scale_loss(gm, [n for n in gm.graph.nodes if n.op == "placeholder"][index])
        return self.compile_fn(gm, symbolic_inputs(self.gm, args, [scale]), {})
