"""The user's torch.amp.GradScaler, as the fused step uses it (``options={"grad_scaler": scaler}``).

GradScaler's state stays GradScaler's. Its ``_scale`` (fp32, 0-d) and
``_growth_tracker`` (int32, 0-d) are inputs of the fused step graph, read afresh
at every call and written in place by it (``passes/loss_scaling.py``), so
``scaler.get_scale()``, ``scaler.state_dict()`` and ``scaler.load_state_dict()``
work as they do for eager training, and a new scale never recompiles anything.
GradScaler creates those tensors lazily, in ``scaler.scale(loss)``, which a step
written for optpass never calls: optpass creates them the same way
(``_lazy_init_scale_growth_tracker``) on the parameters' device. The growth
and backoff factors and the growth interval are compiled into the graph; a
changed one (``load_state_dict`` of another scaler's state) compiles again.

Beside GradScaler's state optpass keeps, per scaler, two tensors the graph
writes: whether the last step was skipped (fp32 0-d, 1.0 or 0.0) and how many
steps were skipped (int64 0-d). ``skipped_steps(scaler)`` reads the count
(``optpass.skipped_steps``); GradScaler users also see a skip as the scale
dropping (``scaler.get_scale()``).

Gradient accumulation: a micro-step (backward, no ``opt.step()``) compiled with the
same options runs backward of ``loss * scale`` into ``.grad``, as
``scaler.scale(loss).backward()`` does (``runtime/scaled_micro_step.py``). optpass
counts those micro-steps per scaler; a step whose graph adds to existing ``.grad``
tensors is refused when no scaled micro-step made them (``check_accumulated``).
"""

from __future__ import annotations

import dataclasses
from weakref import WeakKeyDictionary

import torch

from optpass.errors import OptpassError


@dataclasses.dataclass
class _Skips:
    last: torch.Tensor                   # 1.0 if the last step was skipped (found inf/nan), else 0.0
    count: torch.Tensor                  # steps skipped so far


_SKIPS: WeakKeyDictionary = WeakKeyDictionary()
_MICRO_STEPS: WeakKeyDictionary = WeakKeyDictionary()   # scaler -> scaled micro-steps since its last step


def graph_inputs(scaler: torch.amp.GradScaler, device: torch.device) -> list[torch.Tensor]:
    """[scale, growth tracker, last step skipped, skipped steps]: what the fused graph reads and writes."""
    if scaler._scale is None:
        scaler._lazy_init_scale_growth_tracker(device)   # what scaler.scale(loss) does first
    if scaler._scale.device != device:
        raise OptpassError(
            f"grad_scaler: the scaler's scale lives on {scaler._scale.device}, the parameters on {device}. "
            "Use one GradScaler per device, made for the parameters' device (torch.amp.GradScaler(device.type)).")
    skips = _SKIPS.get(scaler)
    if skips is None or skips.last.device != device:
        skips = _Skips(torch.zeros((), device=device), torch.zeros((), dtype=torch.int64, device=device))
        _SKIPS[scaler] = skips
    return [scaler._scale, scaler._growth_tracker, skips.last, skips.count]


def settings(scaler: torch.amp.GradScaler) -> tuple[float, float, int]:
    """What the graph bakes in: (growth factor, backoff factor, growth interval)."""
    return float(scaler._growth_factor), float(scaler._backoff_factor), int(scaler._growth_interval)


def last_step_skipped(scaler: torch.amp.GradScaler) -> bool:
    skips = _SKIPS.get(scaler)
    return skips is not None and bool(skips.last.item())


def skipped_steps(scaler: torch.amp.GradScaler) -> int:
    """How many steps compiled with ``options={"grad_scaler": scaler}`` were skipped (inf/nan found)
    in this process. Reading it waits for the step (``.item()``).

    Args:
        scaler: the ``torch.amp.GradScaler`` given as the ``grad_scaler`` option.

    Returns:
        The number of skipped steps (0 when no step has run with this scaler).
    """
    skips = _SKIPS.get(scaler)
    return 0 if skips is None else int(skips.count.item())


def note_micro_step(scaler: torch.amp.GradScaler) -> None:
    """A scaled micro-step put ``loss * scale``'s gradients into ``.grad``."""
    _MICRO_STEPS[scaler] = _MICRO_STEPS.get(scaler, 0) + 1


def check_accumulated(scaler: torch.amp.GradScaler, accumulating: set[str]) -> None:
    """Before a step that unscales and checks ``.grad + this step's gradients``: the ``.grad`` it adds
    to must come from scaled micro-steps (the same scale), or unscaling would divide them by it."""
    pending = _MICRO_STEPS.pop(scaler, 0)
    if accumulating and not pending:
        names = ", ".join(sorted(accumulating)[:3])
        raise OptpassError(
            f"grad_scaler: this step adds to existing .grad tensors ({names}) that no micro-step compiled "
            "with options={..., 'grad_scaler': scaler} made: they are not scaled, and the step would "
            "unscale them. Compile the micro-steps (backward without opt.step()) with the same options "
            "as the step, or call opt.zero_grad() before the step.")
