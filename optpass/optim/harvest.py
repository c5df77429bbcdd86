"""Harvest an optimizer's update as an aten graph, from torch.optim's own code.

The update math is torch.optim's (one guard aside, below): ``torch.compile(opt.step)`` with
a backend that records the graph and runs nothing (docs/design.md §18) yields
torch.optim's update for every parameter, and AOTAutograd turns it into a
functional aten graph whose in-place writes are ``copy_`` into the parameter
and state placeholders. optpass then slices that graph per parameter.

While harvesting, each param group is switched to the single-tensor
implementation (``foreach=False``, ``fused=False``: per-parameter ops that can
be sliced) and a float ``lr`` becomes a 0-d tensor so that the update reads lr
as an input (a scheduler can change it without a recompile); its products round
as the float's do (``optim/float_lr.py``). Everything is restored afterwards;
parameters are not touched by the no-op run.

The one guard: a parameter whose new value divides by something made from lr (torch's compiled
Adam, whose update is 0/0 at lr = 0) is written as ``where(lr == 0, param, new value)``, the eager
result at lr = 0 (``keep_parameters_at_zero_lr``, docs/design.md §53).

**The first update is harvested too.** torch.optim creates its state lazily,
at the first ``step()``, in two ways, and the harvest keeps both torch.optim's own:

* ``_init_group`` allocates state (Adam's ``exp_avg``, ``step``; NAdam's
  ``mu_product``) — Dynamo runs it for real while tracing, so after the harvest
  that state exists, exactly as torch.optim made it, and the graph reads it;
* the update itself creates state from the gradient (SGD's first momentum
  buffer *is* the gradient: ``buf = clone(grad)``) — Dynamo traces that as a
  graph output that it stores into ``opt.state``. The harvest finds which
  output became which state entry (the no-op run hands back distinct
  stand-ins, then looks them up in ``opt.state``), removes the stand-ins, and
  turns each such output into an in-place write of a new state input
  (``copy_(new_state, value)``): the runtime allocates that input before the
  step and stores it into ``opt.state`` after it (``HarvestedUpdate.created``).

The gradients the no-op run needs are stand-ins that own no memory (a 0-d zero
expanded to the parameter's shape), so harvesting never holds a model's worth
of gradients: the whole run's peak is the fused step's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import types
from typing import Callable, Iterator

import torch
import torch.fx
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

from optpass.analysis.diff import graph_text
from optpass.errors import OptpassError
from optpass.optim import low_bit_states
from optpass.optim.float_lr import keep_float_lr_rounding
from optpass.optim.scalars import group_entry_role, tensorize_scalars
from optpass.options import OptimizerList
from optpass.step import VALUE_ATTRIBUTES, local_tensor_base
from optpass.tensor_parallel import TensorParallelLayout



@dataclasses.dataclass
class ParameterUpdate:
    """One parameter's slice of the harvested update graph."""

    name: str
    group: int
    param: torch.fx.Node                       # placeholder in the harvested graph
    gradient: torch.fx.Node                    # placeholder
    states: dict[str, torch.fx.Node]           # state key -> placeholder
    nodes: list[torch.fx.Node]                 # the slice, in graph order
    writes: dict[torch.fx.Node, torch.fx.Node]  # placeholder (param or state) -> its new value
    lr: dict[torch.fx.Node, int]               # lr placeholder the slice reads -> its param group


@dataclasses.dataclass(frozen=True)
class CreatedState:
    """A state tensor the update creates (SGD's first momentum buffer): allocated by the runtime."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    # a tensor-parallel parameter's state: a DTensor laid out as the parameter (its local tensor is `shape`)
    distributed_like: TensorParallelLayout | None = None

    def allocate(self) -> torch.Tensor:
        local = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return local if self.distributed_like is None else self.distributed_like.as_dtensor(local)


@dataclasses.dataclass
class HarvestedUpdate:
    graphs: list[torch.fx.Graph]               # one per graph torch.optim's step compiled to
    updates: dict[str, ParameterUpdate]        # by parameter name
    # (parameter, state key) -> what to allocate, for state this update creates (first step)
    created: dict[tuple[str, str], CreatedState] = dataclasses.field(default_factory=dict)

    def digest(self) -> str:
        """The update's text and the state it creates: two layouts of the state (SGD's first step
        creates its momentum buffer, later steps read it) give different fused graphs from the same
        step graph, so this is part of the Inductor cache key of the rewrite. Its text does not
        depend on FX's node names, which differ between a process that traced the step cold and one
        that AOTAutograd's cache served (the same update: Inductor's cache missed every step graph
        on the second run of a program, measured)."""
        text = "\n".join(graph_text(g) for g in self.graphs) + repr(sorted(self.created))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def groups(self) -> list[int]:
        """The param groups whose lr the update reads (each becomes one input)."""
        return sorted({g for update in self.updates.values() for g in update.lr.values()})


def _stand_in(like: torch.Tensor) -> torch.Tensor:
    """A zero tensor of `like`'s shape, dtype and device that owns one element (stride 0); of a DTensor,
    a DTensor laid out as `like` (its gradient's placements are the parameter's: Dynamo's ``.grad`` is
    ``empty_like(p).copy_(g)``)."""
    layout = TensorParallelLayout.of(like)
    if layout is not None:
        local = torch.zeros((), dtype=like.dtype, device=like.device)
        return layout.as_dtensor(local.expand([int(size) for size in like._local_tensor.shape]))
    return torch.zeros((), dtype=like.dtype, device=like.device).expand(like.shape)


@contextlib.contextmanager
def _harvest_setup(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> Iterator[list[float]]:
    """Single-tensor implementation, lr as a 0-d tensor, stand-in gradients; all restored after.

    Yields each group's float lr (None where the user's lr already is a tensor)."""
    saved_groups = [dict(g) for g in optimizer.param_groups]
    saved_grads = [(p, p.grad) for p in params]
    try:
        float_lrs = []
        for group in optimizer.param_groups:
            for key in ("foreach", "fused"):
                if key in group:
                    group[key] = False
            lr = group["lr"]
            float_lrs.append(None if isinstance(lr, torch.Tensor) else float(lr))
            if not isinstance(lr, torch.Tensor):
                group["lr"] = torch.tensor(float(lr), dtype=torch.float64)
        for p in params:
            if p.grad is None:
                p.grad = _stand_in(p)
        yield float_lrs
    finally:
        for group, saved in zip(optimizer.param_groups, saved_groups):
            group.update(saved)
        for p, grad in saved_grads:
            p.grad = grad


@dataclasses.dataclass
class _Recorded:
    gm: torch.fx.GraphModule
    example_inputs: list
    placeholder_roles: dict[int, tuple]      # Dynamo input index -> role
    outputs: list                            # the stand-ins the no-op run handed back


# What Dynamo raises when a fullgraph trace fails (a graph break, an error in fake propagation)
_TRACE_ERRORS = (torch._dynamo.exc.Unsupported, torch._dynamo.exc.TorchRuntimeError,
                 torch._dynamo.exc.UserError)


def _record_update_graphs(optimizer, params, float_lrs, roles) -> tuple[list[_Recorded], bool]:
    """Compile opt.step as one graph with a backend that records it and runs nothing.

    Returns the recorded graphs and whether they compute Python numbers from tensors
    (``scalars``: Adafactor's ``step.item()``), which the usual trace cannot hold.
    `roles()` names every tensor the update may read, by identity; it is asked while
    Dynamo compiles, after torch.optim's ``_init_group`` created any missing state."""
    try:
        return _record(optimizer, roles), False
    except _TRACE_ERRORS as error:
        first_error = error
    # lr as a symbolic float: a 0-d lr tensor compared with a Python number (min(lr, ...)) is a
    # data-dependent branch
    for group, lr in zip(optimizer.param_groups, float_lrs):
        if lr is not None:
            group["lr"] = lr
    try:
        with _scalar_trace_setup(params, optimizer), torch._dynamo.config.patch(
                capture_scalar_outputs=True, specialize_float=False, assume_static_by_default=False):
            return _record(optimizer, roles, scalars=True), True
    except _TRACE_ERRORS:
        raise OptpassError(_untraceable_message(optimizer, first_error)) from first_error


def _record(optimizer, roles: Callable[[], dict[int, tuple]], scalars: bool = False) -> list[_Recorded]:
    recorded: list[_Recorded] = []

    def recorder(gm, example_inputs):
        # Dynamo drops the placeholders' examples after the backend returns: read them now.
        role_of, placeholder_roles = roles(), {}
        for index, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
            grapharg = node.meta.get("grapharg")
            example = grapharg.example if grapharg is not None else None
            source = grapharg.source.name if grapharg is not None and grapharg.source is not None else node.name
            role = role_of.get(id(example))
            if role is None and scalars:
                role = group_entry_role(source)       # a float hyper-parameter made an input
            placeholder_roles[index] = role or ("unknown", source)
        outputs: list = []      # what the no-op run hands back (Dynamo keeps this closure alive)
        recorded.append(_Recorded(gm, list(example_inputs), placeholder_roles, outputs))
        output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        examples = [a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a
                    for a in output.args[0]]

        def no_op(*_args):
            # distinct stand-ins: where Dynamo stores each one (opt.state) says what it is
            outputs[:] = [_stand_in(e) if isinstance(e, torch.Tensor) else e for e in examples]
            return tuple(outputs)
        return no_op

    # Static shapes keep the graph free of symbolic sizes, so it lowers to aten on its own; also
    # when the user's torch.compile(dynamic=True) is what runs this (its config would make every
    # float of a param group symbolic, and torch.optim reads betas with .item()).
    static = {} if scalars else {"assume_static_by_default": True}
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, **static), _one_graph():
        torch.compile(_step_with_a_cache_of_its_own(optimizer), backend=recorder, fullgraph=True)()
    graphs = [r for r in recorded if any(n.op in ("call_function", "call_method") for n in r.gm.graph.nodes)]
    # Dynamo keeps the backend (and so this list) alive for the life of the process.
    recorded.clear()
    if not graphs:
        raise OptpassError(
            f"{type(optimizer).__name__}.step() compiled to no graph, so its update cannot be moved "
            "into the step graph.")
    return graphs


def _step_with_a_cache_of_its_own(optimizer) -> Callable[[], object]:
    """``type(optimizer).step`` (the class's: an lr scheduler wraps the instance's in a function
    Dynamo skips) bound to `optimizer`, over a copy of its code object.

    Dynamo caches what it compiles per code object and, under ``fullgraph=True``, fails the
    compile that would exceed ``recompile_limit`` (8). Every torch.optim class's step is the same
    code object (``Optimizer.profile_hook_step``'s ``wrapper``), guarded on the optimizer's
    identity: the ninth harvest of a process failed (the fifth model of a sweep, a notebook cell
    run a fifth time). A copy's cache is its own, and goes when the copy does."""
    step = type(optimizer).step
    fresh = types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__,
                               step.__defaults__, step.__closure__)
    fresh.__kwdefaults__ = step.__kwdefaults__
    return types.MethodType(fresh, optimizer)


@contextlib.contextmanager
def _scalar_trace_setup(params: list[torch.Tensor], optimizer) -> Iterator[None]:
    """With assume_static_by_default off (floats become symbolic), keep every tensor's shape
    static, and every number read from optimizer state unbacked (a value, not a constant)."""
    from torch._subclasses import fake_tensor

    state = [t for p in params for t in optimizer.state.get(p, {}).values() if isinstance(t, torch.Tensor)]
    tensors = [t for p in params for t in (p, p.grad)] + state
    before = [(t, set(t.__dict__)) for t in tensors]
    for t in tensors:
        torch._dynamo.mark_static(t)
    # Dynamo gives a 0-d CPU float64/int64 input a *backed* .item() with its current value as
    # hint (fake_tensor.py, "item_memo"): a float64 `step` of 0 then fails step ** -0.8 while
    # tracing. State values are data, read at every step: make their .item() unbacked.
    plain = fake_tensor._is_plain_tensor

    def is_state(t: torch.Tensor) -> bool:        # asked while tracing: _init_group made it by then
        return t.dim() == 0 and any(t is v for p in params for v in optimizer.state.get(p, {}).values())

    fake_tensor._is_plain_tensor = lambda t: plain(t) and not is_state(t)
    try:
        yield
    finally:
        fake_tensor._is_plain_tensor = plain
        for t, keys in before:                     # the markers mark_static set, nothing else
            for key in set(t.__dict__) - keys:
                delattr(t, key)


def _untraceable_message(optimizer, error: Exception) -> str:
    """Dynamo's reason and the optimizer's line where its step cannot be one graph."""
    name = type(optimizer).__name__
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    # Dynamo's stack of the traced code (the Python traceback holds only Dynamo's own frames):
    # the optimizer's frames, torch.optim's or the user's subclass, not torch internals
    frames = [f for f in getattr(error, "real_stack", None) or []
              if "/torch/" not in f.filename or "/torch/optim/" in f.filename]
    where = f" at {frames[-1].filename}:{frames[-1].lineno} ({(frames[-1].line or '').strip()})" if frames else ""
    return (f"optimizer_in_backward: {name}.step() cannot be traced as one graph{where}: Dynamo: "
            f"{reason}. optpass moves the optimizer's own update into the step graph, so it needs "
            f"all of it; use an optimizer whose step compiles with torch.compile(opt.step, "
            f"fullgraph=True), or drop optimizer_in_backward.")


@contextlib.contextmanager
def _one_graph() -> Iterator[None]:
    """torch.optim's two deliberate ``torch._dynamo.graph_break()`` calls (around the update,
    for AOTAutograd's no_grad handling) become no-ops: the step is one graph, traced with
    ``fullgraph=True``, so any other break raises while tracing, before anything runs."""
    saved = torch._dynamo.graph_break
    torch._dynamo.graph_break = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch._dynamo.graph_break = saved


def _tensor_roles(optimizer: torch.optim.Optimizer, names: dict[str, torch.Tensor]) -> dict[int, tuple]:
    """Every tensor the update can read, by identity: Dynamo hands it over as an attribute
    (get_attr) or as an input, depending on where the optimizer's frames broke."""
    role_of: dict[int, tuple] = {}
    for name, p in names.items():
        role_of[id(p)] = ("param", name)
        role_of[id(p.grad)] = ("gradient", name)
        for key, t in optimizer.state.get(p, {}).items():
            if isinstance(t, torch.Tensor):
                role_of[id(t)] = ("state", (name, key))
    for g, group in enumerate(optimizer.param_groups):
        role_of[id(group["lr"])] = ("lr", g)
    return role_of


def _state_before(optimizer, names: dict[str, torch.Tensor]) -> dict[tuple[int, str], torch.Tensor]:
    """The state tensors that exist before the trace, by (id(parameter), key)."""
    return {(id(p), key): value for p in names.values() for key, value in optimizer.state.get(p, {}).items()
            if isinstance(value, torch.Tensor)}


def _take_created_state(optimizer, names: dict[str, torch.Tensor], entry: _Recorded,
                        before: dict[tuple[int, str], torch.Tensor]) -> dict[int, tuple[str, str]]:
    """Which of the graph's outputs Dynamo stored into opt.state (state the update creates).

    Removes those stand-ins from opt.state again: the fused step creates the real ones. An output
    stored under a key whose tensor existed before the trace is that tensor written in place and
    stored back (torchao's ``state["step"] += 1``): the graph's ``copy_`` into the input is its write,
    and the tensor goes back into opt.state. Returns Dynamo output index -> (parameter name, state key)."""
    index_of = {id(t): i for i, t in enumerate(entry.outputs) if isinstance(t, torch.Tensor)}
    created: dict[int, tuple[str, str]] = {}
    stored_back: set[int] = set()
    for name, p in names.items():
        state = optimizer.state.get(p)
        if not state:
            continue
        for key in [k for k, v in state.items() if id(v) in index_of]:
            index = index_of[id(state[key])]
            if (id(p), key) in before:
                state[key] = before[(id(p), key)]
                stored_back.add(index)
                continue
            created[index] = (name, key)
            del state[key]
        if not state:
            del optimizer.state[p]
    unplaced = [i for i, t in enumerate(entry.outputs)
                if isinstance(t, torch.Tensor) and i not in created and i not in stored_back]
    if unplaced:
        raise OptpassError(
            f"{type(optimizer).__name__}.step() returns {len(unplaced)} value(s) that are not optimizer "
            "state of the fused parameters, so its update cannot be moved into the step graph.")
    return created


def harvest_update(optimizer: torch.optim.Optimizer, names: dict[str, torch.Tensor]) -> HarvestedUpdate:
    """The update of the parameters in `names` (name -> parameter), as a sliced aten graph.

    Works before the first step too: see the module docstring (state torch.optim creates). Of an
    ``OptimizerList`` (several optimizers): each member's update, harvested from that member."""
    if isinstance(optimizer, OptimizerList):
        return _harvest_each_member(optimizer, names)
    # optpass.explain harvests while Dynamo compiles the user's step: outside that compile's tracing
    # context, or the harvest's sizes become symbols of the step's shape env, which has no source for
    # them (Dynamo failed creating the step's guards with torchao's moments of several shapes)
    with torch._guards.tracing(None):
        return _harvest(optimizer, names)


def _harvest(optimizer: torch.optim.Optimizer, names: dict[str, torch.Tensor]) -> HarvestedUpdate:
    _widen_step_counters(optimizer, list(names.values()))
    if low_bit_states.is_low_bit(optimizer):
        low_bit_states.create_missing_state(optimizer, list(names.values()))
    representative = _representatives(optimizer, names)
    if representative is not None:
        return _harvest_representatives(optimizer, names, representative)
    params = list(names.values())
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    updates: dict[str, ParameterUpdate] = {}
    graphs, created = [], {}
    with _harvest_setup(optimizer, params) as float_lrs, low_bit_states.traceable(optimizer):
        before = _state_before(optimizer, names)
        recorded, scalars = _record_update_graphs(optimizer, params, float_lrs,
                                                  lambda: _tensor_roles(optimizer, names))
        for entry in recorded:
            if scalars:
                entry.example_inputs, entry.placeholder_roles = tensorize_scalars(
                    entry.gm, entry.example_inputs, entry.placeholder_roles, optimizer)
            role_of = _tensor_roles(optimizer, names)
            attr_roles = {n.target: role_of.get(id(getattr(entry.gm, n.target, None)), ("unknown", n.target))
                          for n in entry.gm.graph.nodes if n.op == "get_attr"}
            output_roles = _take_created_state(optimizer, names, entry, before)
            entry.outputs.clear()
            aten = _to_aten(entry.gm, entry.example_inputs)
            graphs.append(aten)
            float_groups = {g for g, lr in enumerate(float_lrs) if lr is not None}
            sliced, new = _slice_per_parameter(aten, entry.placeholder_roles, attr_roles, output_roles,
                                               group_of, names, float_groups)
            updates.update(sliced)
            created.update(new)
    missing = [name for name in names if name not in updates]
    if missing:
        raise OptpassError(f"optimizer_in_backward: no update for parameter {missing[0]!r} was found in "
                           "the optimizer's step (is it in this optimizer's param_groups?).")
    return HarvestedUpdate(graphs, {name: updates[name] for name in names}, created)


def _widen_step_counters(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """A float64 parameter's ``step`` counter in float32 becomes float64, in ``opt.state``, where the
    default dtype is float64 (what torch.optim's single-tensor path, which the harvest traces, creates).

    torch keeps a fused (or capturable) optimizer's counters in float32, also when ``load_state_dict``
    loads float64 ones, and its fused kernel takes the bias corrections from them in double; the traced
    single-tensor path takes them in the counter's dtype, so a float32 counter rounded a float64 model's
    bias corrections: 8e-7 relative from eager fused AdamW after 3 steps resumed from a checkpoint (a
    Hugging Face Trainer's default optimizer is fused AdamW). A fresh harvest already makes them float64
    there, and the fused kernels take float64 counters (docs/design.md §69)."""
    if not isinstance(optimizer, _PER_PARAMETER_OPTIMIZERS) or torch.get_default_dtype() != torch.float64:
        return
    for p in params:
        step = optimizer.state.get(p, {}).get("step")
        if (p.dtype == torch.float64 and isinstance(step, torch.Tensor) and step.dim() == 0
                and step.dtype == torch.float32):
            optimizer.state[p]["step"] = step.to(torch.float64)


# torch.optim's optimizers whose single-tensor step updates each parameter from its own gradient,
# state and its group's hyper-parameters alone, with state whose first value depends on the
# parameter's shape and the group only: two parameters alike in those get the same update graph.
_PER_PARAMETER_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                             torch.optim.Adadelta, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
                             torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD)


def _representatives(optimizer, names: dict[str, torch.Tensor]) -> dict[str, str] | None:
    """Each parameter's representative: the first of `names` alike in group, shape, strides, dtype,
    device and state layout. None when every parameter is its own, or the optimizer is not one of
    torch.optim's per-parameter classes (exactly: a subclass may override step)."""
    if type(optimizer) not in _PER_PARAMETER_OPTIMIZERS + low_bit_states.per_parameter_classes():
        return None
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    first: dict[tuple, str] = {}
    representative = {}
    for name, p in names.items():
        state = tuple((key, (low_bit_states.layout_of(v), v.stride()) if isinstance(v, torch.Tensor)
                       else type(v).__name__) for key, v in sorted(optimizer.state.get(p, {}).items()))
        signature = (group_of.get(id(p)), tuple(p.shape), p.stride(), p.dtype, p.device, state, _placement_of(p))
        representative[name] = first.setdefault(signature, name)
    return None if len(first) == len(representative) else representative


def _distributed_like(param: torch.Tensor, local_shape: tuple, name: str, key: str) -> TensorParallelLayout | None:
    """How state the update creates for a DTensor parameter is laid out: as the parameter (SGD's
    momentum buffer is made from its gradient), else refused."""
    layout = TensorParallelLayout.of(param)
    if layout is None:
        return None
    if tuple(param._local_tensor.shape) != local_shape:
        raise OptpassError(f"optimizer_in_backward: the update creates state {key!r} of tensor-parallel parameter "
                           f"{name} with local shape {list(local_shape)}, not the parameter's "
                           f"{list(param._local_tensor.shape)}: optpass cannot tell how it is distributed.")
    return layout


def _placement_of(p: torch.Tensor) -> tuple | None:
    """A DTensor parameter's placements and local shape (two parameters of one global shape sharded
    along other dimensions, a column- and a row-parallel Linear, have different local updates)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return None
    return tuple(p.placements), tuple(p._local_tensor.shape), p._local_tensor.stride()


def _harvest_representatives(optimizer, names: dict[str, torch.Tensor], representative: dict[str, str]) -> HarvestedUpdate:
    """Harvest one parameter of each kind (``_representatives``) and give every parameter its
    representative's slice: tracing torch.optim's step over every parameter of a deep model cost
    time that grew faster than its depth (59.5 s over a 32-layer Llama's first step and a recompile,
    bench/compile_overhead.py --hf). The state
    ``_init_group`` creates while tracing is created for the representatives; each parameter like
    one that had none gets a copy of its representative's first value."""
    mine = {name: p for name, p in names.items() if representative[name] == name}
    kept = {id(p) for p in mine.values()}
    had_state = {name for name, p in names.items() if optimizer.state.get(p)}
    saved = [group["params"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in kept]
        harvested = harvest_update(optimizer, mine)
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params
    copied = False
    for name, p in names.items():
        first = names[representative[name]]
        if name not in had_state and representative[name] != name and optimizer.state.get(first):
            optimizer.state[p] = {key: value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
                                  for key, value in optimizer.state[first].items()}
            copied = True
    if copied:              # opt.state in the parameters' order, as torch.optim's first step leaves it
        order = [p for group in optimizer.param_groups for p in group["params"] if p in optimizer.state]
        entries = {p: optimizer.state[p] for p in order}
        entries.update((p, s) for p, s in optimizer.state.items() if p not in entries)
        optimizer.state.clear()
        optimizer.state.update(entries)
    updates = {name: dataclasses.replace(harvested.updates[representative[name]], name=name) for name in names}
    created = {(name, key): spec for name in names for (owner, key), spec in harvested.created.items()
               if owner == representative[name]}
    return HarvestedUpdate(harvested.graphs, updates, created)


def _harvest_each_member(several: OptimizerList, names: dict[str, torch.Tensor]) -> HarvestedUpdate:
    """Each member's update of its parameters in `names`, its param groups numbered as in
    ``several.param_groups`` (the members' groups in order), so that each lr input is its group's."""
    graphs, updates, created, first_group = [], {}, {}, 0
    for member in several.optimizers:
        held = {id(p) for group in member.param_groups for p in group["params"]}
        mine = {name: p for name, p in names.items() if id(p) in held}
        if mine:
            harvested = harvest_update(member, mine)
            for update in harvested.updates.values():
                update.group += first_group
                update.lr = {node: group + first_group for node, group in update.lr.items()}
            graphs += harvested.graphs
            updates.update(harvested.updates)
            created.update(harvested.created)
        first_group += len(member.param_groups)
    missing = [name for name in names if name not in updates]
    if missing:
        raise OptpassError(f"optimizer_in_backward: parameter {missing[0]!r} is in none of the optimizers "
                           f"of options['optimizer'] ({several!r}).")
    return HarvestedUpdate(graphs, {name: updates[name] for name in names}, created)


def _to_aten(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.Graph:
    from torch._inductor.decomposition import select_decomp_table

    captured: list[torch.fx.Graph] = []

    def keep(aten_gm, _inputs):
        captured.append(aten_gm.graph)
        return make_boxed_func(aten_gm.forward)

    # Inductor's decompositions: the slice lands in Inductor's post-grad graph as ops it knows.
    aot_module_simplified(gm, example_inputs, fw_compiler=keep, decompositions=select_decomp_table(),
                          keep_inference_input_mutations=True)
    return captured[0]


def _input_role(desc, placeholder_roles, attr_roles) -> tuple:
    """What an input of the aten update graph is, from AOTAutograd's description of it. An inner
    tensor of a state that is a tensor subclass (torchao's quantized moments: ``codes``, ``scale``)
    is state too, under the key ``"<key>.<attribute>"`` (``low_bit_states.state_value`` reads it)."""
    kind = type(desc).__name__
    if kind == "PlainAOTInput":
        return placeholder_roles[desc.idx]
    if kind == "SubclassGetAttrAOTInput":
        role, value = _input_role(desc.base, placeholder_roles, attr_roles)
        if desc.attr in VALUE_ATTRIBUTES:               # a DTensor's local tensor, a float8 weight's values
            return role, value
        if desc.attr == "device_mesh":
            return "mesh", (role, value)
        if role == "state":
            return role, (value[0], f"{value[1]}.{desc.attr}")
        return "unknown", str(desc)
    if hasattr(desc, "target"):                      # ParamAOTInput / BufferAOTInput
        return attr_roles.get(desc.target, ("unknown", desc.target))
    return "unknown", str(desc)


def _sizes_as_constants(graph: torch.fx.Graph) -> None:
    """A tensor subclass's size or stride that AOTAutograd passed as an input of its own (under
    optpass.explain's trace, torchao's quantized moments came with symbolic sizes) becomes the
    number it stands for: the update of a parameter has fixed shapes."""
    for node in list(graph.nodes):
        if node.op != "placeholder" or type(node.meta.get("desc")).__name__ not in (
                "SubclassSizeAOTInput", "SubclassStrideAOTInput"):
            continue
        value = node.meta.get("val")
        number = value.node.hint if isinstance(value, torch.SymInt) else value
        if not isinstance(number, int):
            continue
        for user in list(node.users):
            user.args = torch.fx.map_arg(user.args, lambda n: number if n is node else n)
            user.kwargs = torch.fx.map_arg(user.kwargs, lambda n: number if n is node else n)
        graph.erase_node(node)


def _slice_per_parameter(graph, placeholder_roles, attr_roles, output_roles, group_of, names, float_groups):
    """Per parameter: the nodes that compute its new value and state, and what they write; a
    product with a float lr made a tensor rounds as the float's (``optim/float_lr.py``).

    Returns the slices and the state the update creates ((name, key) -> CreatedState)."""
    param_ph, grad_ph, state_ph, lr_ph = {}, {}, {}, {}
    _sizes_as_constants(graph)
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        role, value = _input_role(node.meta.get("desc"), placeholder_roles, attr_roles)
        if role == "param":
            param_ph[value] = node
        elif role == "gradient":
            grad_ph[value] = node
        elif role == "state":
            state_ph.setdefault(value[0], {})[value[1]] = node
        elif role == "lr":
            lr_ph[value] = node
        elif role == "mesh" and all(user.op == "output" for user in node.users):
            pass          # a DTensor's mesh, read by no op (an output's: a state the update creates)
        else:
            raise OptpassError(f"optimizer_in_backward: the update graph reads {value!r}, an input "
                               "optpass does not know how to provide inside backward.")
    keep_float_lr_rounding(graph, {node for group, node in lr_ph.items() if group in float_groups})
    # New values of mutated inputs: in-graph copy_ (state), or outputs that AOTAutograd
    # copies back (parameters: they require grad, so their mutation is an output).
    writes: dict[torch.fx.Node, torch.fx.Node] = {}
    created_outputs: dict[tuple[str, str], torch.fx.Node] = {}
    placeholder_of_desc = {n.meta.get("desc"): n for n in graph.nodes if n.op == "placeholder"}
    for node in graph.nodes:
        if node.target is torch.ops.aten.copy_.default and node.args[0].op == "placeholder":
            writes[node.args[0]] = node.args[1]
        elif node.op == "output":
            for value, desc in zip(node.args[0], node.meta.get("desc") or ()):
                if type(desc).__name__ == "InputMutationAOTOutput":
                    writes[placeholder_of_desc[desc.mutated_input]] = value
                elif type(base := local_tensor_base(desc)).__name__ == "PlainAOTOutput" and base.idx in output_roles:
                    created_outputs[output_roles[base.idx]] = value      # of a DTensor: its local tensor
    keep_parameters_at_zero_lr(graph, writes, set(param_ph.values()), set(lr_ph.values()))
    # State the update creates becomes a write into a new input, like any other state.
    created: dict[tuple[str, str], CreatedState] = {}
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for (name, key), value in created_outputs.items():
        with graph.inserting_after(last_placeholder):
            new_state = graph.placeholder(f"created_{name}_{key}".replace(".", "_"))
        state_ph.setdefault(name, {})[key] = new_state
        writes[new_state] = value
        val = value.meta["val"]
        created[(name, key)] = CreatedState(tuple(val.shape), val.dtype, val.device,
                                            _distributed_like(names[name], tuple(val.shape), name, key))
    order = {n: i for i, n in enumerate(graph.nodes)}
    updates = {}
    lr_group = {node: group for group, node in lr_ph.items()}
    for name in names:
        if name not in param_ph or name not in grad_ph:
            continue                                       # updated by another of the step's graphs
        states = [state_ph.get(name, {})[key] for key in sorted(state_ph.get(name, {}))]
        own = {param_ph[name], grad_ph[name], *states}
        # a fixed order (state, then the parameter) keeps the rewritten graph stable run to run
        own_writes = {p: writes[p] for p in [*states, param_ph[name]] if p in writes}
        nodes = _ancestors(list(own_writes.values()))
        foreign = {n for n in nodes if n.op == "placeholder"} - own - set(lr_ph.values())
        if foreign:
            raise OptpassError(
                f"optimizer_in_backward: the update of {name!r} reads other parameters' values "
                f"({', '.join(sorted(n.name for n in foreign))}); only per-parameter optimizers can "
                "run inside backward.")
        updates[name] = ParameterUpdate(
            name, group_of[id(names[name])], param_ph[name], grad_ph[name], state_ph.get(name, {}),
            sorted((n for n in nodes if n.op != "placeholder"), key=order.__getitem__), own_writes,
            {n: lr_group[n] for n in nodes if n in lr_group})
    return updates, created


_DIVISIONS = {torch.ops.aten.div.Tensor, torch.ops.aten.reciprocal.default, torch.ops.prims.div.default}


def keep_parameters_at_zero_lr(graph: torch.fx.Graph, writes: dict, params: set, lrs: set) -> list[torch.fx.Node]:
    """A parameter whose new value divides by something made from lr keeps its value at lr == 0.

    torch.optim's capturable Adam and AdamW (the path a compiled step takes) write the update as
    ``param + exp_avg / denom`` with ``denom = (sqrt(exp_avg_sq) / (bc2 * -step_size) + eps / -step_size)``
    and ``step_size = lr / bias_correction1``: at lr = 0 an entry with a zero gradient is 0/0, NaN (a
    warmup schedule's first step, lr = 0, turned a model's untouched embedding rows into NaN), where
    the eager path multiplies the update by lr and leaves the parameter as it was. Where such a division
    is found, the parameter's write becomes ``where(lr == 0, param, new value)``: the eager result at
    lr = 0, the same value otherwise. State is left alone: its update does not read lr.

    Updates ``writes`` and the graph in place; returns the parameters whose write is now kept."""
    kept_params = []
    for param in params & set(writes):
        value = writes[param]
        cone = _ancestors([value])
        divisors = [d for d in _divisors(cone) if isinstance(d, torch.fx.Node)]
        divided_by_lr = [lr for lr in lrs & cone if any(lr in _ancestors([d]) for d in divisors)]
        if not divided_by_lr:
            continue
        lr = divided_by_lr[0]
        with graph.inserting_after(value):
            at_zero = graph.call_function(torch.ops.aten.eq.Scalar, (lr, 0))
        with graph.inserting_after(at_zero):
            kept = graph.call_function(torch.ops.aten.where.self, (at_zero, param, value))
        with value.meta["val"].fake_mode:
            at_zero.meta["val"] = torch.ops.aten.eq.Scalar(lr.meta["val"], 0)
            kept.meta["val"] = torch.ops.aten.where.self(at_zero.meta["val"], param.meta["val"], value.meta["val"])
        _write_instead(graph, param, value, kept)
        writes[param] = kept
        kept_params.append(param)
    return kept_params


_ZERO_PRESERVING = {torch.ops.aten.neg.default, torch.ops.aten.clone.default, torch.ops.aten.view.default,
                    torch.ops.aten.alias.default, torch.ops.aten.expand.default}


def keep_parameters_dividing_by_a_zero_lr(graph: torch.fx.Graph, writes: dict, params: set) -> list[torch.fx.Node]:
    """A float lr of 0 is a constant in the update graph (``step_size = reciprocal(bc1) * 0.0``): a
    parameter whose new value divides by a product of it is 0/0 where its gradient and second moment are
    zero. For the parameters given (their group's lr is 0) whose write divides by such an exact zero,
    the write becomes the parameter itself, what eager torch.optim leaves at lr = 0.

    Exact zeros: ``mul`` by a literal 0 or by an exact zero, then ``neg``, views, ``div(zero, x)``.
    Updates ``writes`` and the graph in place; returns the parameters whose write is now kept."""
    zeros: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        args = node.args
        if node.target in (torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar) and any(
                (not isinstance(a, torch.fx.Node) and not isinstance(a, bool) and a == 0) or a in zeros
                for a in args[:2]):
            zeros.add(node)
        elif (node.target in _ZERO_PRESERVING or node.target is torch.ops.aten.div.Tensor) and args and args[0] in zeros:
            zeros.add(node)
    kept_params = []
    for param in params & set(writes):
        value = writes[param]
        if not any(divisor in zeros for divisor in _divisors(_ancestors([value]))):
            continue
        _write_instead(graph, param, value, param)
        writes[param] = param
        kept_params.append(param)
    return kept_params


def _divisors(nodes) -> list:
    """What the divisions among ``nodes`` divide by (a node or a constant)."""
    return [n.args[0] if n.target is torch.ops.aten.reciprocal.default else n.args[1]
            for n in nodes if n.op == "call_function" and n.target in _DIVISIONS]


def _write_instead(graph: torch.fx.Graph, param: torch.fx.Node, value: torch.fx.Node, new: torch.fx.Node) -> None:
    """The parameter's write (an output AOTAutograd copies back, or a ``copy_`` into it) writes ``new``
    instead of ``value``; a ``copy_`` of the parameter onto itself that nothing reads is dropped."""
    for user in list(value.users):
        if user.op == "output" or (user.target is torch.ops.aten.copy_.default and user.args[0] is param):
            if new is param and user.op != "output" and not user.users:
                graph.erase_node(user)
            else:
                user.replace_input_with(value, new)


def _ancestors(roots: list[torch.fx.Node]) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen
