"""Whether an optimizer's update is elementwise: what sharding it over flat buckets (ZeRO-1) needs.

optpass's ZeRO-1 (``zero1/``) updates this rank's piece of each flat bucket with an
optimizer of the user's class over that flat piece. That is the user's update only if
each element's new value depends on nothing but that element's parameter, gradient and
state, and on scalars (lr, the step counter): SGD, Adam(W), Adagrad, RMSprop, NAdam,
RAdam, Adamax, Adadelta, Rprop, ASGD. It is not for Adafactor (second moments factored
over rows and columns, a relative step from the parameter's RMS), Muon (orthogonalised
matrices) or an optimizer with a per-parameter trust ratio (LAMB, LARS: a norm of the
whole parameter): over a flat piece they compute something else, silently (measured,
Adafactor on 2 ranks: 2.3% off single-process training after 5 steps).

The check runs the same trace the step's update comes from (``optim/harvest.py``): the update of
a stand-in optimizer of the user's class, param-group settings and dtype, over one small
2-D parameter per group, as an aten graph. Every op there that reads or makes a
parameter-sized tensor must be pointwise (``torch.Tag.pointwise``), a copy, a view that
keeps the shape, or a scalar broadcast; a reduction, a matmul or a reshape is named in the
refusal.

torchao's low-bit optimizers are not elementwise (a scale per block of a parameter's elements) and
are not checked here: ZeRO-1's layout keeps each of their blocks whole on one rank
(``zero1/layout.py``), which makes a chunk's update the one-process update block for block.
"""

from __future__ import annotations

import inspect
import operator

import torch
import torch.fx

from optpass.errors import OptpassError
from optpass.optim import low_bit_states
from optpass.optim.harvest import harvest_update

STAND_IN_SHAPE = (3, 4)         # 2-D (Adafactor factors it, Muon accepts it), and no scalar has 12 elements
_SIZE = STAND_IN_SHAPE[0] * STAND_IN_SHAPE[1]

aten = torch.ops.aten
_COPIES = {aten.copy.default, aten.copy_.default, aten.clone.default, aten._to_copy.default,
           aten.alias.default, aten.lift_fresh_copy.default, aten.detach.default}
_SHAPE_KEEPING = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_CREATIONS = {aten.full.default, aten.full_like.default, aten.zeros.default, aten.zeros_like.default,
              aten.empty.memory_format, aten.empty_like.default, aten.ones_like.default,
              aten.scalar_tensor.default, aten.empty_strided.default}

_VERDICTS: dict[tuple, list[str]] = {}


def non_elementwise_ops(optimizer: torch.optim.Optimizer, dtype: torch.dtype | None = None) -> list[str]:
    """The ops of `optimizer`'s update that mix a parameter's elements ([] for an elementwise update).

    `dtype`: the dtype the sharded update runs in (the fp32 masters'), else each group's own."""
    key = _verdict_key(optimizer, dtype)
    if key not in _VERDICTS:
        _VERDICTS[key] = _find_non_elementwise_ops(optimizer, dtype)
    return _VERDICTS[key]


def _verdict_key(optimizer, dtype) -> tuple:
    groups = tuple(tuple(sorted((k, type(v).__name__ if isinstance(v, torch.Tensor) else repr(v))
                                for k, v in group.items() if k not in ("params", "param_names")))
                   + (str(dtype or group["params"][0].dtype), group["params"][0].device.type)
                   for group in optimizer.param_groups if group["params"])
    return (type(optimizer), groups)


def _find_non_elementwise_ops(optimizer, dtype) -> list[str]:
    stand_in = _stand_in_optimizer(optimizer, dtype)
    if stand_in is None:
        return []          # the class cannot be built this way: the sharded one's build says why
    names = {f"group{g}": group["params"][0] for g, group in enumerate(stand_in.param_groups)}
    try:
        harvested = harvest_update(stand_in, names)
    except OptpassError:
        return []          # its step cannot be traced: the sharded update's harvest says why
    found: list[str] = []
    for update in harvested.updates.values():
        for node in update.nodes:
            if node.op == "call_function" and not _keeps_elements_apart(node) and str(node.target) not in found:
                found.append(str(node.target))
    return found


def _stand_in_optimizer(optimizer, dtype):
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = []
    for group in optimizer.param_groups:
        if not group["params"]:
            continue
        like = group["params"][0]
        param = torch.nn.Parameter(torch.zeros(STAND_IN_SHAPE, dtype=dtype or like.dtype, device=like.device))
        groups.append({**{k: v for k, v in group.items() if k not in ("params", "param_names")},
                       "params": [param]})
    try:
        return cls(groups, **defaults)
    except (TypeError, ValueError):
        return None


def _numel(node) -> int | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.numel() if isinstance(val, torch.Tensor) else None


def _keeps_elements_apart(node: torch.fx.Node) -> bool:
    """Whether `node` computes each element of a parameter-sized tensor from the same element alone."""
    if node.target is operator.getitem:
        return True
    inputs = [_numel(a) for a in node.all_input_nodes]
    sized = [n == _SIZE for n in inputs] + [_numel(node) == _SIZE]
    if not any(sized):
        return True                           # scalar math (lr, the step counter, bias corrections)
    tags = getattr(node.target, "tags", ())
    if torch.Tag.pointwise in tags or node.target in _COPIES or node.target in _CREATIONS:
        return True
    if node.target in _SHAPE_KEEPING or node.target is aten.expand.default:
        source = node.all_input_nodes[0].meta.get("val")
        out = node.meta.get("val")
        return source.numel() == 1 or tuple(source.shape) == tuple(out.shape)
    return False


def refuse_non_elementwise(optimizer: torch.optim.Optimizer, dtype: torch.dtype | None) -> None:
    """data_parallel='zero1' over an optimizer whose update is not elementwise: an error that says
    which ops and what to do (raised on every rank alike, before any collective)."""
    if low_bit_states.is_low_bit(optimizer):
        # quantized in blocks: ZeRO-1's layout keeps each block on one rank (zero1/layout.py), so the
        # update of a rank's chunk is, block for block, the one-process update
        if dtype is not None:
            raise OptpassError(
                f"data_parallel='zero1' with torchao's {type(optimizer).__name__} and master_weights: not "
                "supported. torchao keeps bf16 parameters without fp32 masters (bf16_stochastic_round=True "
                "rounds their updates without bias); use that, or torch.optim.AdamW with master_weights.")
        return
    found = non_elementwise_ops(optimizer, dtype)
    if found:
        name = type(optimizer).__name__
        raise OptpassError(
            f"data_parallel='zero1': {name}'s update is not elementwise: it computes "
            f"{', '.join(found[:4])} over a whole parameter, and ZeRO-1 updates each rank's flat piece "
            f"of a bucket with its own {name} over that piece, which would compute something else. "
            "Train with an elementwise optimizer (SGD, Adam, AdamW, ...) under zero1 (in a list of "
            f"optimizers, each one), or drop data_parallel='zero1' (optimizer_in_backward keeps each "
            f"parameter's update whole; a list with {name} in it trains so on one device).")
