"""The global gradient norm of a step compiled with ``options={"clip_grad_norm": max_norm}``.

Eager code logs what ``clip_grad_norm_`` returns (nanoGPT: ``norm = clip_grad_norm_(...)``). With the
option, the clipping pass computes that norm inside the step graph; the step writes it into a fresh
0-d tensor, an extra input of the fused graph (``out``), and the runtime keeps the last one per
optimizer (``record``). ``grad_norm(opt)`` hands it out: no host sync in the step, and a tensor of
its own for every step, so norms kept in a list stay each step's.
"""

from __future__ import annotations

import functools
from weakref import WeakKeyDictionary

import torch

from optpass.errors import OptpassError
from optpass.options import OptimizerList, optimizers_of

_LAST: WeakKeyDictionary = WeakKeyDictionary()     # optimizer -> the last clipped step's norm


def out(parameters) -> torch.Tensor:
    """An empty 0-d tensor for one step's norm: on the parameters' device, fp32 (wider when a
    parameter is, e.g. fp64, so the norm is the one clip_grad_norm_ returns)."""
    parameters = list(parameters)
    dtype = functools.reduce(torch.promote_types, [p.dtype for p in parameters if p.is_floating_point()],
                             torch.float32)
    return torch.empty((), dtype=dtype, device=parameters[0].device)


def record(optimizer, norm: torch.Tensor) -> None:
    """`norm` (written by the step that just ran) is the last clipped step's norm of `optimizer`
    (of a list of optimizers, ``options.OptimizerList``: of the list and of each member, the norm
    over all their gradients, as ``clip_grad_norm_(model.parameters())`` returns)."""
    for each in {optimizer, *optimizers_of(optimizer)}:
        _LAST[each] = norm


def grad_norm(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The global gradient norm of the last step compiled with ``options={"optimizer": optimizer,
    "clip_grad_norm": max_norm}``, before clipping: what ``torch.nn.utils.clip_grad_norm_`` returns
    for that step (the 2-norm of every fused gradient: the fp32 master gradients with
    master_weights, the unscaled ones with grad_scaler, the averaged ones under data_parallel).

    Reading it does not wait for the step; ``.item()`` or printing it does. Each step writes a
    tensor of its own.

    Args:
        optimizer: the optimizer given as the ``optimizer`` option of the clipped step, or any
            optimizer of the list given there (the norm is over every listed optimizer's gradients).

    Returns:
        A 0-d tensor on the parameters' device (fp32, or the parameters' wider dtype).

    Raises:
        OptpassError: no step compiled with ``clip_grad_norm`` and this optimizer has updated yet.

    Example:
        step = torch.compile(train_step, backend="optpass",
                             options={"optimizer": opt, "optimizer_in_backward": True, "clip_grad_norm": 1.0})
        loss = step(x, y)
        norm = optpass.grad_norm(opt)          # as ``norm = clip_grad_norm_(...)`` in eager
    """
    if isinstance(optimizer, (list, tuple)):
        optimizer = OptimizerList.of(optimizer)
    norm = _LAST.get(optimizer)
    if norm is None:
        raise OptpassError(
            "optpass.grad_norm(opt): no step compiled with options={'optimizer': opt, 'clip_grad_norm': "
            "max_norm} has updated this optimizer yet (the norm exists after the first such step; an "
            "accumulation micro-step takes none). Call it after the step, with the optimizer of that step.")
    return norm
