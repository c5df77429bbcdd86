"""torchao's low-bit optimizers (``AdamW8bit``, ``Adam4bit``, ``AdamWFp8``, ...), made traceable for
the harvest, with their state kept as torchao's tensor subclasses.

torchao's ``_AdamBase.step`` keeps each moment as a tensor subclass (``OptimState8bit``: uint8
``codes``, one fp32 ``scale`` per block of 256, a 256-entry ``qmap``; ``OptimState4bit`` packs two
codes a byte; ``OptimStateFp8`` holds float8 codes) and, per parameter, calls
``torch.compile(single_param_adam)``, which dequantizes, steps and requantizes. Traced whole by
Dynamo (the harvest, ``optim/harvest.py``), that step is one graph once two things are out of the way:

* **state creation.** torchao creates a parameter's state inside ``step`` (not in an
  ``_init_group`` that Dynamo runs eagerly, as torch.optim does), and building a quantization map
  reads ``tolist()``, which Dynamo cannot trace. optpass creates the missing state before tracing,
  with torchao's own ``_new_buffer`` and the values torchao's first step gives it (``step`` 0,
  zero moments), exactly as that step would;
* **``torch._dynamo.utils.disable_cache_limit()``**, a context manager Dynamo skips (a graph break
  under ``fullgraph=True``), around the per-parameter calls: a no-op while tracing (the harvest
  compiles nothing for real).

The nested ``torch.compile(single_param_adam)`` is inlined by Dynamo. AOTAutograd flattens each
subclass state into its inner tensors, so the harvested graph reads and writes ``codes`` and
``scale`` as plain tensors; the harvest names them ``"exp_avg.codes"``, ``"exp_avg.scale"``
(``state_value`` reads such a key from ``opt.state``). The fused step then passes the inner
tensors, and Inductor fuses dequantize, update and requantize into the step's backward, right
after each gradient.
"""

from __future__ import annotations

import contextlib
import sys
from fractions import Fraction
from typing import Callable, Iterator

import torch


def _adam_base() -> type | None:
    """torchao's base class of its low-bit Adam optimizers, if torchao's optimizers are loaded (a
    user's optimizer of that class has imported them; optpass never imports torchao itself)."""
    module = sys.modules.get("torchao.optim.adam")
    return getattr(module, "_AdamBase", None) if module is not None else None


def is_low_bit(optimizer) -> bool:
    base = _adam_base()
    return base is not None and isinstance(optimizer, base)


def per_parameter_classes() -> tuple[type, ...]:
    """torchao's low-bit Adam classes whose update is per parameter (one ``single_param_adam`` each):
    two parameters alike in group, shape and state layout get the same update graph."""
    base = _adam_base()
    if base is None:
        return ()
    module = sys.modules["torchao.optim.adam"]
    names = ("Adam8bit", "AdamW8bit", "Adam4bit", "AdamW4bit", "AdamFp8", "AdamWFp8")
    return tuple(getattr(module, n) for n in names if isinstance(getattr(module, n, None), type))


def block_size(optimizer, p: torch.Tensor) -> int | None:
    """The block size `optimizer` quantizes `p`'s moments in; None where torchao keeps them fp32
    (``_new_buffer``: fewer than 4096 elements, or a size the block size does not divide), or where
    `optimizer` is not one of torchao's low-bit optimizers."""
    if not is_low_bit(optimizer):
        return None
    numel = p.numel()
    return optimizer.block_size if numel >= 4096 and numel % optimizer.block_size == 0 else None


def constructor_settings(optimizer) -> dict:
    """The keyword arguments of a low-bit optimizer's constructor that are not in its ``defaults``
    (``block_size``, ``bf16_stochastic_round``): an optimizer of its class built from ``defaults``
    alone would quantize in other blocks or round otherwise. {} for any other optimizer."""
    if not is_low_bit(optimizer):
        return {}
    return {"block_size": optimizer.block_size, "bf16_stochastic_round": optimizer.bf16_stochastic_round}


def create_missing_state(optimizer, params: list[torch.Tensor],
                         quantized: Callable[[torch.Tensor], bool] | None = None) -> None:
    """The state torchao's first ``step`` creates for each of `params` that has none: ``step`` a 0-d
    0.0, ``exp_avg`` (signed) and ``exp_avg_sq`` (unsigned) from torchao's ``_new_buffer`` (a
    quantized subclass for a tensor of 4096 elements or more whose size the block size divides, else
    fp32 zeros), and ``max_exp_avg_sq`` where the group has amsgrad.

    `quantized` decides instead of ``_new_buffer``'s rule (ZeRO-1: a rank's flat piece of a bucket
    is quantized exactly where the parameters in it are, whatever the piece's own size)."""
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    for p in params:
        if not optimizer.state.get(p):
            optimizer.state[p] = new_state(optimizer, p, group_of[id(p)], quantized)


def new_state(optimizer, p: torch.Tensor, group: dict,
              quantized: Callable[[torch.Tensor], bool] | None = None) -> dict:
    """The state torchao's first ``step`` gives `p` (of `group`): see ``create_missing_state``."""
    def buffer(signed: bool) -> torch.Tensor:
        if quantized is None:
            return optimizer._new_buffer(p, signed)
        if quantized(p):
            return optimizer._subclass_zeros(p, signed, optimizer.block_size)
        return torch.zeros_like(p)

    state = {"step": torch.tensor(0.0), "exp_avg": buffer(is_signed("exp_avg")),
             "exp_avg_sq": buffer(is_signed("exp_avg_sq"))}
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = buffer(False)
    return state


_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def as_loaded_moment(optimizer, p: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
    """A state entry about to be loaded for `p` (``load_state_dict`` of fp32 values): quantized as torchao
    keeps that moment of `p` (``_new_buffer``'s rule), so a resumed optimizer holds the state it would
    have made itself; `value` unchanged for a low-bit optimizer's other entries and any other optimizer."""
    size = block_size(optimizer, p)
    if size is None or key not in _MOMENTS or is_quantized(value) or tuple(value.shape) != tuple(p.shape):
        return value
    moment = optimizer._subclass_zeros(p.detach(), is_signed(key), size)
    with torch.no_grad():
        moment.copy_(value)
    return moment


def is_signed(key: str) -> bool:
    """Whether torchao quantizes the state entry `key` with its signed map (the first moment)."""
    return key == "exp_avg"


def is_quantized(value) -> bool:
    """Whether a state value is one of torchao's quantized subclasses (not a plain tensor)."""
    return isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor, torch.nn.Parameter) \
        and hasattr(value, "__tensor_flatten__")


# Inner tensors of torchao's quantized states that do not grow with the state (the quantization map)
_FIXED_INNER = ("qmap",)
# The inner tensors that hold a quantized state's elements (``inner_rows``): what a checkpoint saves of it
INNER_NAMES = ("codes", "scale")


def inner_rows(value) -> dict[str, Fraction]:
    """A quantized state's inner tensors that hold its elements, each with how many of its elements
    one element of the state takes: ``codes`` 1 (8-bit, FP8) or 1/2 (4-bit, two codes a byte),
    ``scale`` 1/block size. Elements [a, b) of the flattened state, a and b on block boundaries, are
    elements [a * r, b * r) of each inner tensor."""
    names, _ = value.__tensor_flatten__()
    return {name: Fraction(getattr(value, name).numel(), value.numel()) for name in names
            if name not in _FIXED_INNER}


def stored_tensors(value) -> list[torch.Tensor]:
    """The tensors a state value keeps its numbers in: a quantized one's inner tensors (codes, scales,
    map), a plain tensor itself, nothing for a non-tensor entry."""
    if not isinstance(value, torch.Tensor):
        return []
    if not is_quantized(value):
        return [value]
    names, _ = value.__tensor_flatten__()
    return [getattr(value, name) for name in names]


def stored_bytes(value) -> int:
    """Bytes a state value holds: a quantized one's inner tensors, not its nominal fp32 size."""
    return sum(t.numel() * t.element_size() for t in stored_tensors(value))


@contextlib.contextmanager
def traceable(optimizer) -> Iterator[None]:
    """While the harvest traces `optimizer`'s step, ``disable_cache_limit`` is a no-op (the harvest
    has created its state: ``create_missing_state``). Nothing for an optimizer that is not one of
    torchao's low-bit ones."""
    if not is_low_bit(optimizer):
        yield
        return
    import torch._dynamo.utils as dynamo_utils

    saved = dynamo_utils.disable_cache_limit
    dynamo_utils.disable_cache_limit = contextlib.nullcontext
    try:
        yield
    finally:
        dynamo_utils.disable_cache_limit = saved


def state_value(state: dict, key: str) -> torch.Tensor:
    """``state[key]``, where a key the harvest made for a tensor subclass's inner tensor
    (``"exp_avg.codes"``) reads that attribute of ``state["exp_avg"]``."""
    if key in state:
        return state[key]
    head, *attributes = key.split(".")
    value = state[head]
    for attribute in attributes:
        value = getattr(value, attribute)
    return value


def layout_of(value) -> tuple:
    """What the update graph depends on in a state value: a plain tensor's shape, dtype and device;
    a tensor subclass's type and its inner tensors' layouts (an 8-bit moment and fp32 zeros of one
    shape look alike from outside)."""
    if not isinstance(value, torch.Tensor):
        return type(value).__name__, repr(value)          # a DTensor's device mesh
    if type(value) in (torch.Tensor, torch.nn.Parameter) or not hasattr(value, "__tensor_flatten__"):
        return tuple(value.shape), value.dtype, value.device
    names, _ = value.__tensor_flatten__()
    return (type(value).__name__, tuple(value.shape), value.dtype,
            tuple((n, layout_of(getattr(value, n))) for n in names))
