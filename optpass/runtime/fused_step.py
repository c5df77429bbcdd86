"""The step callable whose graph runs the update: torch.optim's update fused into the step graph,
inside backward (options optimizer_in_backward) or after it (a grad_scaler's step).

``FusedStep`` is also the base of the steps that update on fp32 masters
(``master_weights_step.py``) and on this rank's ZeRO-1 shard (``sharded_step.py``).
Dynamo calls this object in place of the step graph. Each call is one
micro-step; with ``accumulation_steps=K`` micro-steps 1..K-1 of a window run
the plain graph (gradients accumulate into ``.grad``) and micro-step K runs the
fused graph. A window follows what the user does with the gradients: it starts
at the first call after the fused parameters' ``.grad`` were cleared (all None,
as the fused step and ``opt.zero_grad()`` leave them, or all zeroed by
``opt.zero_grad(set_to_none=False)``) or after an ``opt.step()`` the user took
outside the compiled step (the end-of-epoch flush); ``.grad`` the user left in
place is part of the window (``_Session``).

Every update is fused, the first one included: the update is harvested from
torch.optim (``optim/harvest.py``) for the optimizer's state *as it is now*, the step
graph gets the optimizer's state tensors and each group's lr as extra inputs
(docs/design.md §19), and the ``optimizer_in_backward`` pass splices each parameter's
update in after its gradient is final. So no step of the run holds more than a
few gradients at once — the whole run's peak is the fused step's:

* **first step** — torch.optim creates its state lazily. What ``_init_group``
  allocates (Adam's moments, ``step``) is created by the harvest, as torch.optim
  makes it, before the step runs; what the update itself creates from the
  gradient (SGD's first momentum buffer *is* the gradient) is allocated here,
  written by the fused graph, and stored into ``opt.state`` after the call;
* **state changed** — the graph that ran depends on which state exists (SGD's
  first step reads no momentum buffer, the second does). Each call computes the
  state's layout (keys, shapes, dtypes); a new layout — the second step, a
  ``load_state_dict`` of another shape of state, a param group added with
  ``add_param_group`` — harvests and compiles again (usually twice a run at most).

With a ``grad_scaler`` the graph also gets the scaler's tensors (scale, growth
tracker, optpass's skip flag and count: ``precision/grad_scaler.py``), its loss is
multiplied by the scale (``loss_scaling.scale_loss``), and the update is fused
even without optimizer_in_backward (after backward: a skipped step must skip it
in the same graph). State a skipped first update created is not stored: eager
GradScaler skips ``opt.step()`` entirely.

With ``clip_grad_norm`` the graph also gets a fresh 0-d tensor at every call, into which it writes
the global gradient norm before clipping; after the call it is the optimizer's last norm
(``runtime/grad_norm.py``, ``optpass.grad_norm(opt)``).

Either way the fused parameters' gradient outputs are ``None``: ``p.grad`` is
None after the step and the ``opt.step()`` in the step has nothing to do
(docs/design.md §17). State lives in ``opt.state`` as always, read afresh at every call, so
``state_dict()``/``load_state_dict()`` keep working. A float lr is copied into
a 0-d tensor input at every call (a scheduler never causes a recompile); any
other hyper-parameter is part of the harvested update, so changing it is an
error rather than a silently stale update.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from typing import Any, Callable
from weakref import WeakKeyDictionary

import torch
import torch.fx

from optpass.capture import CapturedGraph, GraphKind
from optpass.errors import OptpassError, warn_at_user_line
from optpass.fsdp.shard import optimizer_shard_spec
from optpass.optim.harvest import CreatedState, HarvestedUpdate, harvest_update
from optpass.optim.low_bit_states import layout_of, state_value
from optpass.passes import loss_scaling
from optpass.passes._graph_utils import GRAD_NORM_OUTPUT, keep_updates_where_gradients_die
from optpass.passes.optimizer_in_backward import CONTEXT_KEY
from optpass.precision import grad_scaler
from optpass.runtime import grad_norm
from optpass.runtime.gradient_clearing import check_gradients_cleared
from optpass.tensor_parallel import norm_groups

# Per optimizer: its accumulation window (shared by the step's graphs: accumulation compiles two).
_SESSIONS: WeakKeyDictionary = WeakKeyDictionary()


@dataclasses.dataclass
class _Session:
    """Where an optimizer's accumulation window stands (accumulation_steps > 1), made at the first
    micro-step. ``left``: each fused parameter's ``.grad`` as the last micro-step left it (a weak
    reference and its version), so the next one can tell whether the user cleared or changed it."""

    micro_steps: int = 0              # micro-steps in the current window
    left: dict = dataclasses.field(default_factory=dict)   # id(parameter) -> (weakref to .grad, version)
    stepped: bool = False             # the user called opt.step() since the last micro-step
    warned: bool = False              # a partial window's gradients were cleared (warned once)


def _session(optimizer: torch.optim.Optimizer) -> _Session:
    session = _SESSIONS.get(optimizer)
    if session is None:
        session = _SESSIONS[optimizer] = _Session()
        optimizer.register_step_post_hook(_note_user_step)
    return session


def _note_user_step(optimizer, args, kwargs) -> None:
    """An opt.step() the user took (the flush of a partial window) ends the window. A step traced by
    Dynamo (the harvest, a compiled step) is not the user's: nothing is noted, nothing is traced."""
    if torch.compiler.is_compiling():
        return
    session = _SESSIONS.get(optimizer)
    if session is not None:
        session.stepped = True


def _grad_mark(grad: torch.Tensor | None) -> tuple | None:
    return None if grad is None else (weakref.ref(grad), grad._version)


def _as_left(mark: tuple | None, grad: torch.Tensor | None) -> bool:
    if mark is None or grad is None:
        return mark is None and grad is None
    return mark[0]() is grad and grad._version == mark[1]


@dataclasses.dataclass
class UpdatePlan:
    """What the optimizer_in_backward pass needs: the harvest and where its inputs are."""

    harvested: HarvestedUpdate
    lr_index: dict[int, int]                  # param group -> Dynamo input index
    state_index: dict[tuple[str, str], int]   # (parameter, state key) -> Dynamo input index
    in_backward: bool = True                  # False: after backward (grad_scaler without optimizer_in_backward)
    clip_grad_norm: float | None = None       # the global norm clip_grad_norm_in_backward clips to

    def digest(self) -> str:
        """What changes the rewritten graph beyond the step's roles (Inductor cache key)."""
        return f"{self.harvested.digest()}-in_backward={self.in_backward}"

    @property
    def inductor_config(self) -> dict:
        """Inductor keeps each update where its gradient dies (``keep_updates_where_gradients_die``)."""
        return keep_updates_where_gradients_die(self.in_backward)


@dataclasses.dataclass
class _FusedGraph:
    """One compiled fused step, for one layout of the optimizer's state."""

    run: Callable
    extras: Callable[[], list]                # lr and state inputs, read afresh at every call
    created: dict[tuple[str, str], CreatedState]
    hyperparameters: list[dict]
    grad_norm_at: int | None = None           # clip_grad_norm: where in the extras the step writes the norm


class FusedStep:
    """Runs a step whose graph applies torch.optim's update (see the module docstring)."""

    feature = "optimizer_in_backward"     # how error messages name the option that fused the update

    def __init__(self, gm: torch.fx.GraphModule, captured: CapturedGraph, options, plain: Callable,
                 compile_fn: Callable[[torch.fx.GraphModule, list, dict], Callable]):
        self.gm, self.captured, self.options, self.compile_fn = gm, captured, options, compile_fn
        self.plain = plain
        self.optimizer: torch.optim.Optimizer = options.optimizer
        self._membership: tuple | None = None
        self._compiled: dict[tuple, _FusedGraph] = {}
        self._find_fused_parameters()

    def _find_fused_parameters(self) -> None:
        """The step's parameters that the optimizer updates (again after add_param_group)."""
        self._membership = tuple(len(g["params"]) for g in self.optimizer.param_groups)
        in_optimizer = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        self.fused = {p.name: p.tensor for p in self.captured.params
                      if p.name in self.captured.gradient_outputs and id(p.tensor) in in_optimizer}
        if not self.fused:
            raise OptpassError("optimizer_in_backward: none of the parameters that get gradients in "
                               "this step are in options['optimizer'].")
        self.fused_slots = [self.captured.gradient_outputs[name] for name in self.fused]

    def __call__(self, *args):
        if tuple(len(g["params"]) for g in self.optimizer.param_groups) != self._membership:
            self._find_fused_parameters()                  # add_param_group
        if self.options.accumulation_steps > 1:
            session = _session(self.optimizer)
            session.micro_steps = self._micro_step_of_window(session)
            if session.micro_steps < self.options.accumulation_steps:
                outputs = self.plain(*args)                # accumulate into .grad
                # the outputs become .grad (Dynamo assigns them after this call)
                session.left = {id(p): _grad_mark(outputs[slot]) for p, slot in
                                zip(self.fused.values(), self.fused_slots)}
                return outputs
            session.micro_steps, session.left = 0, {}      # this call applies the update: .grad None after
            # the optimizer steps here without opt.step() being called: tell an LR scheduler, as torch's
            # wrapper of opt.step() does (else its first step() warns it ran before the optimizer's)
            self.optimizer._opt_called = True
        else:
            check_gradients_cleared(self.captured.backward_line, self.feature if self.options.optimizer_in_backward
                                    else "the update in the step graph", self.fused)
        if self.options.grad_scaler is not None:
            grad_scaler.check_accumulated(self.options.grad_scaler, self.captured.accumulating)
        fused, extras = self._compiled.get(self._state_layout()), None
        if fused is None:
            fused, extras = self._compile_fused(list(args))
            # the harvest created what torch.optim's _init_group creates: key by the layout after it
            self._compiled[self._state_layout()] = fused
        self._check_hyperparameters(fused.hyperparameters)
        return self._without_fused_gradients(list(self._run(fused, args, extras)))

    def _micro_step_of_window(self, session: _Session) -> int:
        """Which micro-step of its window this call is (1 starts a window): see the module docstring."""
        grads = [p.grad for p in self.fused.values()]
        if session.stepped or all(g is None for g in grads):
            starts = True
        elif all(_as_left(session.left.get(id(p)), p.grad) for p in self.fused.values()):
            starts = False                                 # .grad as the last micro-step left it
        else:                                              # the user changed .grad: zeroed, or added to
            starts = all(g is None or not bool(g.any()) for g in grads)
        if starts and session.micro_steps and not session.stepped and not session.warned:
            session.warned = True
            warn_at_user_line(
                f"accumulation_steps={self.options.accumulation_steps}: the gradients of {session.micro_steps} "
                "micro-step(s) were cleared before the update that ends their window, so they are dropped "
                "and a new window starts. To apply a partial window (the end of an epoch), call opt.step() "
                "before opt.zero_grad(); do not clear .grad between the micro-steps of a window.", UserWarning)
        session.stepped = False
        return 1 if starts else session.micro_steps + 1

    def _without_fused_gradients(self, outputs: list) -> list:
        for slot in self.fused_slots:
            outputs[slot] = None
        return outputs

    def compile_for_explain(self, example_inputs: list) -> Callable:
        """optpass.explain: compile the fused graph the first real step compiles (torch.optim's update
        harvested and spliced in, lowered by ``compile_fn``) and return what runs it: the step's
        outputs without the fused gradients, nothing stored into the optimizer's state."""
        fused, _ = self._compile_fused(list(example_inputs))
        return lambda *args: self._without_fused_gradients(list(fused.run(*args, *fused.extras())))

    # -------------------------------------------------------------- fused

    def _update_source(self) -> tuple[torch.optim.Optimizer | None, dict[str, torch.Tensor]]:
        """The optimizer whose update goes into the graph, and its parameters by name."""
        return self.optimizer, self.fused

    def _lr(self, group: int):
        """The current lr of param group `group` of the harvested optimizer (a scheduler changes it)."""
        return self.optimizer.param_groups[group]["lr"]

    def _make_plan(self, harvested, lr_index: dict, state_index: dict, param_index: dict) -> tuple[str, Any]:
        return CONTEXT_KEY, UpdatePlan(harvested, lr_index, state_index, in_backward=self.options.optimizer_in_backward,
                                       clip_grad_norm=self.options.clip_grad_norm)

    def _separate_params(self, names: dict[str, torch.Tensor]) -> list[str]:
        """Parameters whose update writes a tensor other than the step's parameter (an fp32 master):
        that tensor becomes an input of the fused graph."""
        return []

    def _scaled_gradients(self, harvested, separate: list[str]) -> tuple[list[str], set[str]]:
        """grad_scaler: the step's gradients that loss_scaling unscales and checks (the fused ones),
        and those it unscales into fp32 (the ones updated on an fp32 master)."""
        return list(harvested.updates), set(separate)

    def _found_inf_group(self) -> str | None:
        """grad_scaler: the process group whose ranks agree on the found-inf flag (None: one rank).
        Under data_parallel='fsdp' a rank checks its gradient shards only, and an inf in another
        rank's shard must skip this rank's update too: the flags are all-reduced in the shards' group."""
        spec = optimizer_shard_spec(self.options.optimizer) if self.options.data_parallel == "fsdp" else None
        if spec is not None:
            return spec.group_name
        # tensor parallelism: an inf in another rank's shard of a parameter skips this rank's update too
        groups = {group for p in self.fused.values() for group in norm_groups(p)}
        if len(groups) > 1:
            raise OptpassError("grad_scaler with parameters sharded over several mesh dimensions: the found-inf "
                               "flags would need agreeing over each; use one tensor-parallel mesh dimension.")
        return groups.pop() if groups else None

    def _state_layout(self) -> tuple:
        """Which state exists, of which shape and dtype: the harvested update depends on it (and on
        the grad_scaler's factors and interval, compiled in)."""
        optimizer, names = self._update_source()
        scaler = grad_scaler.settings(self.options.grad_scaler) if self.options.grad_scaler else None
        if optimizer is None:
            return self._membership, scaler
        state = optimizer.state
        return self._membership, scaler, tuple(
            tuple((k, _layout_of(v)) for k, v in state[p].items()) if p in state else ()
            for p in names.values())

    @torch._dynamo.disable
    def _run(self, fused: _FusedGraph, args, extras: list | None):
        extras = fused.extras() if extras is None else extras
        outputs = fused.run(*args, *extras)
        if fused.grad_norm_at is not None:
            grad_norm.record(self.optimizer, extras[fused.grad_norm_at])
        if fused.created and not (self.options.grad_scaler and grad_scaler.last_step_skipped(self.options.grad_scaler)):
            # state this (first) update created; a skipped step created none (eager's skips opt.step())
            optimizer, names = self._update_source()
            created = extras[-len(fused.created):]
            for (name, key), tensor in zip(fused.created, created):
                optimizer.state[names[name]][key] = tensor
        return outputs

    @torch._dynamo.disable
    def _compile_fused(self, args: list) -> tuple[_FusedGraph, list]:
        optimizer, names = self._update_source()
        harvested = harvest_update(optimizer, names) if names else None
        groups = harvested.groups if harvested else []
        # created state is stored into opt.state in the optimizer's parameter order, as torch.optim does
        position = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])} \
            if optimizer is not None else {}
        created = dict(sorted((harvested.created if harvested else {}).items(),
                              key=lambda item: position.get(id(names[item[0][0]]), 0)))
        state_keys = [(name, key) for name, update in harvested.updates.items()
                      for key in update.states if (name, key) not in created] if harvested else []
        # created state goes last: _run stores those inputs into opt.state after the call
        state_keys += list(created)
        separate = self._separate_params(names) if harvested else []
        # a zero1 rank that owns no shard (harvested None) still scales, checks and agrees on the flag
        scaler = self.options.grad_scaler
        scaler_names = ["optpass_scale", "optpass_growth_tracker", "optpass_skipped", "optpass_skip_count"] \
            if scaler else []
        gm = torch.fx.GraphModule(self.gm, copy.deepcopy(self.gm.graph))
        norm_names = ["optpass_grad_norm"] if self.options.clip_grad_norm is not None else []
        # extra inputs, in this order: each group's lr, the scaler's tensors, the norm clipping writes,
        # separate parameters (masters), state
        first_extra = append_placeholders(gm, [f"optpass_lr_{g}" for g in groups] + scaler_names + norm_names +
                                           [f"optpass_master_{n}".replace(".", "_") for n in separate] +
                                           [f"optpass_state_{n}_{k}".replace(".", "_") for n, k in state_keys])
        norm_at = len(groups) + len(scaler_names) if norm_names else None
        first_master = first_extra + len(groups) + len(scaler_names) + len(norm_names)
        first_state = first_master + len(separate)
        context_key, plan = self._make_plan(
            harvested,
            lr_index={g: first_extra + i for i, g in enumerate(groups)},
            state_index={nk: first_state + i for i, nk in enumerate(state_keys)},
            param_index={n: first_master + i for i, n in enumerate(separate)})
        context = {context_key: plan}
        if norm_at is not None:
            context[GRAD_NORM_OUTPUT] = first_extra + norm_at
        if scaler:
            scale_index = first_extra + len(groups)
            loss_scaling.scale_loss(gm, [n for n in gm.graph.nodes if n.op == "placeholder"][scale_index])
            device = next(iter(self.fused.values())).device
            unscaled, into_fp32 = self._scaled_gradients(harvested, separate)
            context[loss_scaling.CONTEXT_KEY] = loss_scaling.ScalingPlan(
                scale_index, unscaled, into_fp32, *grad_scaler.settings(scaler),
                in_backward=self.options.optimizer_in_backward, agree_group=self._found_inf_group())
        float_lr = {g: torch.zeros((), dtype=torch.float64) for g in groups
                    if not isinstance(self._lr(g), torch.Tensor)}
        existing = [(names[name], key) for name, key in state_keys if (name, key) not in created]

        def extras() -> list:
            lrs = []
            for g in groups:
                lr = self._lr(g)
                lrs.append(lr if isinstance(lr, torch.Tensor) else float_lr[g].fill_(lr))
            scaling = grad_scaler.graph_inputs(scaler, device) if scaler else []
            norm = [grad_norm.out(self.fused.values())] if norm_names else []
            return (lrs + scaling + norm + [names[n] for n in separate]
                    + [state_value(optimizer.state[p], key) for p, key in existing] + [spec.allocate() for spec in created.values()])

        inputs = extras()
        # Compile from the graph's own (fake, possibly symbolic) inputs, not from this call's
        # tensors: a size Dynamo made dynamic (sequence length, last batch) stays symbolic.
        run = self.compile_fn(gm, symbolic_inputs(self.gm, args, inputs), context)
        return _FusedGraph(run, extras, created, self._hyperparameter_snapshot(), norm_at), inputs

    def _hyperparameter_snapshot(self) -> list[dict]:
        """Each group's compiled-in hyper-parameters; none for an empty group, which has no update
        (tracing opt.step() sets its 'capturable' and leaves it so)."""
        keys = [k for k in self.optimizer.defaults if k not in ("lr", "foreach", "fused")]
        return [{k: copy.deepcopy(g.get(k)) for k in keys} if g["params"] else {} for g in self.optimizer.param_groups]

    def _check_hyperparameters(self, then_groups: list[dict]) -> None:
        now = self._hyperparameter_snapshot()
        for index, (then, current) in enumerate(zip(then_groups, now)):
            changed = [k for k in then if not _same(then[k], current[k])]
            if changed:
                key = changed[0]
                raise OptpassError(
                    f"{self.feature}: hyper-parameter {key!r} of param group {index} changed "
                    f"from {then[key]!r} to {current[key]!r} after the update was compiled into "
                    "the step. Only lr may change between steps (it is a graph input); e.g. use "
                    f"OneCycleLR(cycle_momentum=False), or drop {self.feature}.")


def symbolic_inputs(gm: torch.fx.GraphModule, args: list, extras: list) -> list:
    """Dynamo's example values of the step's inputs (fake tensors, SymInts) + fakes of the extras."""
    from torch._guards import detect_fake_mode

    examples = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([e for e in examples if isinstance(e, torch.Tensor)])
    if fake_mode is None or len(examples) != len(args) or any(e is None for e in examples):
        return list(args) + list(extras)                  # no fake values recorded: static compile
    with fake_mode:
        fakes = [fake_mode.from_tensor(t, static_shapes=True) if isinstance(t, torch.Tensor) else t
                 for t in extras]
    return examples + fakes


def _layout_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return layout_of(value)
    return type(value).__name__


def refuse_update_during_accumulation(captured: CapturedGraph, options) -> None:
    """With accumulation_steps > 1 optpass applies the update; an opt.step() in the step would too."""
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


def append_placeholders(gm: torch.fx.GraphModule, names: list[str]) -> int:
    """Add inputs after the existing ones; returns the index of the first new one."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_before(placeholders[-1].next):
        for name in names:
            node = gm.graph.placeholder(name)
            node._dynamo_source = None  # AOTAutograd checks Dynamo metadata of every placeholder
    gm.recompile()
    return len(placeholders)
