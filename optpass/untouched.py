"""What a dry run (``optpass.explain``) must leave as it was, and putting it back.

explain compiles the step and runs none of its graphs (each returns zeros), but
the step's Python around the graphs does run, and Dynamo writes state there that
nothing can stop from outside Dynamo:

* Dynamo applies, after each graph, what the traced code assigned: ``p.grad =``
  the (zero) gradient outputs, SGD's ``state[p]["momentum_buffer"] =`` the (zero)
  buffer its first update creates, an LR scheduler's ``_opt_called``;
* while tracing ``opt.step()`` Dynamo runs torch.optim's ``_init_group`` for real
  (Adam's moments and ``step`` appear in ``opt.state``), marks parameters and
  state as static inputs (attributes on the tensors), and on CUDA sets
  ``capturable`` in the param groups of an optimizer without state.

optpass's own compile of a fused step adds to that: the harvest of torch.optim's
update (``optim/harvest.py``) runs ``_init_group`` too, ``master_weights`` makes the
fp32 masters and their optimizer (hooks on the user's optimizer, its state moved
into the masters'), a ``grad_scaler``'s scale is created lazily.

``Untouched()`` records, before the run, everything of that kind in the process:
every live torch.optim optimizer (its attributes, ``state`` down to each state
tensor, ``param_groups``, hooks, ``defaults``), every LR scheduler's and
GradScaler's attributes, every parameter (a leaf tensor that requires grad, or
an optimizer's: its ``.grad`` and its attributes), optpass's own per-optimizer and per-scaler
records (masters, ZeRO-1 shards, accumulation windows, skip counters), and the
random number generators (torch's CPU generator, every CUDA device's once CUDA
is initialised, Python's ``random``, NumPy's global one). ``restore()`` puts
each container's contents back in place (the same dict, list and tensor objects:
no copies of tensors, identities kept), removes what was added, resets the
generators, and checks that no tensor it recorded was written in place (the
dry run writes none; a 0-d one, e.g. a scaler's scale, is put back from a copy,
any other written one is an error naming it).
"""

from __future__ import annotations

import gc
import random
import sys
from typing import Any

import torch

from optpass.errors import OptpassError
from optpass.precision import grad_scaler, masters
from optpass.runtime import fused_step
from optpass.zero1 import state as zero1_state

# How deep containers are followed from an object's attributes: optimizer.__dict__ -> param_groups
# -> a group -> its params list; optimizer.__dict__ -> state -> a parameter's state dict -> tensors.
_DEPTH = 4


def _registries() -> list:
    """optpass's per-object records (weak dictionaries keyed by the user's optimizer or scaler)."""
    return [masters._STORES, masters._SHARDED_MASTERS, zero1_state._SHARDED, fused_step._SESSIONS,
            grad_scaler._SKIPS, grad_scaler._MICRO_STEPS]


def _live_objects() -> tuple[list, list]:
    """(objects whose attributes are recorded, parameters), from every object the garbage collector
    tracks (torch tensors included): optimizers, LR schedulers, GradScalers, and every plain tensor
    or nn.Parameter that is a leaf requiring grad or an optimizer's parameter (fp32 masters)."""
    from torch.optim.lr_scheduler import LRScheduler

    kinds = (torch.optim.Optimizer, LRScheduler, torch.amp.GradScaler)
    objects, leaves = [], {}
    for obj in gc.get_objects():
        if _real(obj):
            if obj.requires_grad and obj.is_leaf:
                leaves[id(obj)] = obj
        elif issubclass(type(obj), kinds):
            objects.append(obj)
    for obj in objects:
        if isinstance(obj, torch.optim.Optimizer):
            leaves.update((id(p), p) for group in obj.param_groups for p in group["params"])
    return objects, list(leaves.values())


def _real(value) -> bool:
    """A plain tensor or an nn.Parameter (not one of Dynamo's fake tensors or another subclass)."""
    cls = type(value)                     # type(), not isinstance(): no __class__ property runs
    return cls is torch.Tensor or issubclass(cls, torch.nn.Parameter)


class Untouched:
    """A record of the training state of this process, to put back with ``restore()``."""

    def __init__(self) -> None:
        self._containers: dict[int, tuple[Any, Any]] = {}   # id -> (container, shallow copy)
        self._tensors: dict[int, tuple[torch.Tensor, int, torch.Tensor | None]] = {}
        self._names: dict[int, str] = {}
        objects, leaves = _live_objects()
        self._grads = [(t, t.grad) for t in leaves]
        for t in leaves:
            self._tensor(t, "a parameter")
            if t.grad is not None:
                self._tensor(t.grad, "a parameter's .grad")
            self._container(vars(t))
        for obj in objects:              # their attributes, and what the attributes hold
            self._follow(vars(obj), _DEPTH, type(obj).__name__)
        self._registries = [(r, dict(r.items())) for r in _registries()]
        for registry, entries in self._registries:
            for value in entries.values():
                if hasattr(value, "__dict__"):
                    self._follow(vars(value), _DEPTH, type(value).__name__)
        self._rng = _rng_state()

    # ------------------------------------------------------------ record

    def _container(self, container) -> bool:
        if id(container) in self._containers:
            return False
        copy = list(container) if isinstance(container, list) else \
            set(container) if isinstance(container, set) else dict(container)
        self._containers[id(container)] = (container, copy)
        return True

    def _follow(self, value, depth: int, where: str) -> None:
        if isinstance(value, torch.Tensor):
            self._tensor(value, where)
        elif isinstance(value, (dict, list, set)) and depth >= 0 and self._container(value):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                self._follow(item, depth - 1, f"{where}[{key!r}]" if isinstance(key, (str, int)) else where)

    def _tensor(self, t: torch.Tensor, where: str) -> None:
        if id(t) in self._tensors or not _real(t):
            return
        saved = t.detach().clone() if t.dim() == 0 else None
        self._tensors[id(t)] = (t, t._version, saved)
        self._names[id(t)] = f"{where} {tuple(t.shape)}"

    # ------------------------------------------------------------ restore

    def restore(self) -> None:
        """Everything recorded, back as it was; raises if a recorded tensor was written in place."""
        for registry, entries in self._registries:
            for key in [k for k in list(registry.keys()) if k not in entries]:
                del registry[key]
            for key, value in entries.items():
                if registry.get(key) is not value:
                    registry[key] = value
        for container, copy in self._containers.values():
            if isinstance(container, list):
                container[:] = copy
            else:
                container.clear()
                container.update(copy)
        for t, grad in self._grads:
            if t.grad is not grad:
                t.grad = grad
        _set_rng_state(self._rng)
        written = []
        for t, version, saved in self._tensors.values():
            if t._version == version:
                continue
            if saved is not None:
                with torch.no_grad():
                    t.copy_(saved)
            else:
                written.append(self._names[id(t)])
        if written:
            raise OptpassError(
                f"explain: the step's code that runs outside its compiled graphs wrote {len(written)} "
                f"tensor(s) in place ({', '.join(written[:3])}); explain cannot put them back. Explain a "
                "step whose in-place writes are inside the compiled graph (no graph break before them).")


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["random"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])
