"""fp32 master weights for bf16/fp16 parameters (``options={"master_weights": torch.float32}``).

Megatron-LM's mixed-precision step keeps an fp32 "main" copy of every
half-precision parameter: the gradient is cast to fp32, the optimizer updates
the fp32 copy, and the result is rounded back into the model's parameter. An
update smaller than half a bf16 ulp of the weight (below ~0.004 for a weight of
1.0) is then kept in the master instead of being rounded away.

This module holds what lives outside the step graph, per user optimizer:

* **the masters** — one fp32 tensor per bf16/fp16 parameter that a compiled step
  updates (``p.detach()`` cast to fp32 when a step first updates it, so a parameter
  unfrozen mid-run gets its master from its value then); a parameter that is already
  fp32 (or float64) is its own master and is updated as it is. A parameter that
  never gets a gradient (a frozen base under LoRA, in the optimizer or not) has no
  master and no state, as torch.optim allocates none for it;
* **the master optimizer** — a torch.optim optimizer of the user's class and
  hyper-parameters over the masters, in the same param groups (each holds the
  masters made so far of its group). It is the one
  whose update optpass harvests (``optim/harvest.py``) and fuses into the step, so its
  state is created by torch.optim itself, in fp32. The user's optimizer never
  steps and never holds state; lr is read from the user's param groups at every
  step, so LR schedulers keep working;
* **checkpoints** — ``opt.state_dict()`` carries the masters and the fp32 state
  under ``state["optpass.master_weights"]`` (``{"masters": {i: tensor},
  "state": {i: {key: tensor}}}``, ``i`` the parameter's index as in
  ``param_groups[g]["params"]``, for the parameters that have masters; state
  torch.optim holds for a parameter without one stays under its index). torch.optim's ``load_state_dict`` copies a
  non-parameter entry of ``state`` as it is — it would cast parameter state to
  the parameter's bf16 — so the fp32 values survive a load in a fresh process
  even before optpass has seen the optimizer; optpass adopts them at the next
  step (or right away, through a load hook, once it knows the optimizer);
* **a guard** — ``opt.step()`` called with gradients present (outside the compiled
  step, e.g. after a compiled micro-step) would update the parameters directly,
  bypassing the masters and their state: it raises instead.

``optpass.master_weights(opt)`` returns ``{parameter: master}`` for the parameters updated so far.

With ``data_parallel="zero1"`` none of this is made: each rank keeps only the
masters of its shard, as the shard optimizer's parameters (``zero1/state.py``), saved by
``optpass.save_sharded_checkpoint``; ``master_weights(opt)`` then says so.
"""

from __future__ import annotations

import inspect
from typing import Iterator
from weakref import WeakKeyDictionary

import torch

from optpass.errors import OptpassError

LOW_PRECISION = (torch.bfloat16, torch.float16)
STATE_DICT_KEY = "optpass.master_weights"

_STORES: WeakKeyDictionary = WeakKeyDictionary()
# optimizer -> the number of ranks its fp32 masters are sharded over (data_parallel='zero1' notes it)
_SHARDED_MASTERS: WeakKeyDictionary = WeakKeyDictionary()


class MasterWeights:
    """The fp32 masters of one user optimizer's parameters that get gradients, and their optimizer.

    Masters are made lazily, as torch.optim makes state: a parameter gets its master (from its
    current value) and its place in the master optimizer the first time a compiled step updates
    it. A parameter that never gets a gradient (a frozen base under LoRA) has neither, however
    many the user's optimizer holds."""

    def __init__(self, optimizer: torch.optim.Optimizer, dtype: torch.dtype):
        self.optimizer, self.dtype = optimizer, dtype
        # id(parameter) -> (parameter, master) for every parameter updated so far (an fp32 parameter
        # is its own master); the parameters are the user's optimizer's, alive as long as it is
        self._pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._sizes = [len(g["params"]) for g in optimizer.param_groups]
        self.master_optimizer = self._build_master_optimizer()
        self._stale: set[int] = set()          # ids of parameters whose master must be re-read
        optimizer.register_state_dict_post_hook(_add_masters_to_state_dict)
        optimizer.register_load_state_dict_post_hook(_adopt_after_load)
        optimizer.register_step_pre_hook(refuse_step_outside_the_compiled_step)
        self.adopt_loaded()

    # ------------------------------------------------------------ masters

    def _master_for(self, p: torch.Tensor) -> torch.Tensor:
        if p.dtype not in LOW_PRECISION:
            return p                           # fp32 (or wider): its own master
        return p.detach().to(self.dtype, copy=True)

    def _build_master_optimizer(self) -> torch.optim.Optimizer:
        """The user's class and hyper-parameters, one (empty) group per user group: masters join it
        as their parameters first get gradients."""
        return self._construct([self._master_group(g, []) for g in self.optimizer.param_groups])

    def _construct(self, groups: list[dict]) -> torch.optim.Optimizer:
        cls = type(self.optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        defaults = {k: v for k, v in self.optimizer.defaults.items() if k in accepted}
        try:
            return cls(groups, **defaults)
        except (TypeError, ValueError) as error:
            raise OptpassError(f"master_weights: could not build a {cls.__name__} over the fp32 masters "
                               f"({error}).") from error

    @staticmethod
    def _master_group(group: dict, masters: list[torch.Tensor]) -> dict:
        settings = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        return {**settings, "params": masters}

    def sync_groups(self) -> None:
        """A param group the user added (add_param_group) gets its (empty) group of masters."""
        user, mine = self.optimizer.param_groups, self.master_optimizer.param_groups
        for index, group in enumerate(user):
            if index >= len(mine):
                self.master_optimizer.add_param_group(self._master_group(group, []))
                self._sizes.append(len(group["params"]))
            elif len(group["params"]) != self._sizes[index]:
                raise OptpassError(
                    f"master_weights: param group {index} of the optimizer changed its parameters after "
                    "the step was compiled with fp32 masters. Add parameters with opt.add_param_group(...), "
                    "not by editing a group.")

    def sync_settings(self) -> None:
        """The user's hyper-parameters (a load_state_dict replaces the user's param groups): the
        update harvested next is the one the user's optimizer describes."""
        for user, mine in zip(self.optimizer.param_groups, self.master_optimizer.param_groups):
            mine.update({k: v for k, v in user.items() if k not in ("params", "param_names")})

    def masters_for(self, params) -> dict[int, torch.Tensor]:
        """``{id(p): master}`` for `params` (the parameters a step updates). A parameter updated for
        the first time gets its master now, from its current value (unfrozen mid-run: its value
        then), with any state the user's optimizer holds for it (eager steps, a checkpoint)."""
        new = [p for p in params if id(p) not in self._pairs]
        if new:
            self._add(new)
            self.adopt_loaded()
            self._stale.difference_update(id(p) for p in new)     # just read from the parameters
        return {id(p): self._pairs[id(p)][1] for p in params}

    def _add(self, params: list[torch.Tensor]) -> None:
        """Masters for `params` (none has one yet), into their param groups of the master optimizer,
        with the state a fresh optimizer of the user's class gives them (Adagrad's initial sum)."""
        self.sync_groups()                     # a group added since (a checkpoint loaded into it)
        group_of = {id(p): g for g, group in enumerate(self.optimizer.param_groups) for p in group["params"]}
        by_group: dict[int, list[torch.Tensor]] = {}
        for p in params:
            by_group.setdefault(group_of[id(p)], []).append(p)
        for g, members in by_group.items():
            masters = [self._master_for(p) for p in members]
            made = self._construct([self._master_group(self.optimizer.param_groups[g], masters)]).state
            self.master_optimizer.param_groups[g]["params"].extend(masters)
            for p, m in zip(members, masters):
                self._pairs[id(p)] = (p, m)
                if m in made:
                    self.master_optimizer.state[m] = made[m]

    def pairs(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, master) for every parameter of the user's optimizer that has a master, in its order."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) in self._pairs:
                    yield p, self._pairs[id(p)][1]

    def master_of(self) -> dict[int, torch.Tensor]:
        return {id(p): m for p, m in self.pairs()}

    def refresh(self) -> None:
        """Re-read the masters of parameters whose optimizer state was loaded without masters."""
        if self._stale:
            with torch.no_grad():
                for p, m in self.pairs():
                    if id(p) in self._stale and m is not p:
                        m.copy_(p)
            self._stale.clear()

    # ------------------------------------------------------------ checkpoints

    def _indexed(self) -> list[tuple[int, torch.Tensor, torch.Tensor | None]]:
        """(state_dict index, parameter, master or None) for every parameter of the user's optimizer."""
        everything = [p for group in self.optimizer.param_groups for p in group["params"]]
        return [(i, p, self._pairs[id(p)][1] if id(p) in self._pairs else None) for i, p in enumerate(everything)]

    def state_dict_entry(self) -> dict:
        """The masters and the master optimizer's state, by the parameters' state_dict indices (only
        the parameters that have masters: those a step updated)."""
        masters, state = {}, {}
        for index, p, m in self._indexed():
            if m is None:
                continue
            if m is not p:
                masters[index] = m
            if m in self.master_optimizer.state:
                state[index] = dict(self.master_optimizer.state[m])
        return {"masters": masters, "state": state}

    def adopt_loaded(self) -> None:
        """Move what opt.load_state_dict put into the user's optimizer into the masters.

        ``state[STATE_DICT_KEY]`` (a checkpoint with masters) is taken as it is: each parameter it
        holds a master or state of gets its master now. State torch.optim holds for a parameter
        that has a master (a checkpoint without masters, or eager steps before) becomes the master
        optimizer's, in fp32, and that master is re-read from the parameter at the next step; a
        parameter without a master keeps its state where torch.optim put it (the user's optimizer),
        until a step first updates it. Tensors are taken, not copied, as torch.optim's
        load_state_dict takes them.

        State the user's optimizer made in its constructor (Adagrad's ``sum``, filled with
        ``initial_accumulator_value`` in the parameter's bf16) is the master optimizer's own,
        rounded: the master keeps its fp32 one (0.1, not bf16's 0.10009765625)."""
        state = self.optimizer.state
        saved = state.pop(STATE_DICT_KEY, None)
        if saved is not None:
            self._load_entry(saved)
        plain = [(p, m, state.pop(p)) for p, m in self.pairs() if p in state]
        for p, m, values in plain:
            if is_rounded_copy(self.master_optimizer.state.get(m), values):
                continue
            self.master_optimizer.state[m] = {k: _as_master_state(k, v, m) for k, v in values.items()}
            if m is not p:
                self._stale.add(id(p))

    def _load_entry(self, saved: dict) -> None:
        indexed = self._indexed()
        held = {int(i) for i in saved.get("masters", {})} | {int(i) for i in saved.get("state", {})}
        self._add([indexed[i][1] for i in sorted(held) if indexed[i][2] is None])
        masters = self.master_of()
        with torch.no_grad():
            for index, master in saved.get("masters", {}).items():
                p = indexed[int(index)][1]
                m = masters[id(p)]
                if m is p:
                    raise OptpassError(
                        f"master_weights: the checkpoint has an fp32 master for parameter {index}, which "
                        f"is {p.dtype} here (its own master). Build the model in the dtypes it was saved with.")
                m.copy_(master)
                self._stale.discard(id(p))
        for index, values in saved.get("state", {}).items():
            m = masters[id(indexed[int(index)][1])]
            self.master_optimizer.state[m] = {k: _as_master_state(k, v, m) for k, v in values.items()}


def refuse_without_low_precision(params: list[torch.Tensor], step_params: list[torch.Tensor] = ()) -> None:
    """master_weights where neither the optimizer (`params`) nor the step (`step_params`) has a bf16/fp16
    parameter: the model was not cast. fp32 parameters trained beside a bf16 model (LoRA adapters
    kept in fp32 over a frozen bf16 base) are their own masters: nothing to refuse."""
    if any(p.dtype in LOW_PRECISION for p in [*params, *step_params]):
        return
    dtypes = sorted({str(p.dtype) for p in [*params, *step_params]})
    raise OptpassError(
        f"master_weights: every parameter of the optimizer and of the step is {', '.join(dtypes)}, none is "
        "bfloat16 or float16, so there is nothing to keep an fp32 master copy of. To train in bf16 with "
        "fp32 masters, cast the model (model.to(torch.bfloat16)) before compiling the step; to train "
        "in fp32, drop master_weights.")


def is_rounded_copy(master_state: dict | None, values: dict) -> bool:
    """Whether ``values`` are ``master_state`` rounded to their dtypes, entry by entry."""
    if not master_state or master_state.keys() != values.keys():
        return False
    for key, value in values.items():
        mine = master_state[key]
        if isinstance(value, torch.Tensor) != isinstance(mine, torch.Tensor):
            return False
        if not isinstance(value, torch.Tensor):
            if value != mine:
                return False
        elif value.shape != mine.shape or not torch.equal(mine.to(device=value.device, dtype=value.dtype), value):
            return False
    return True


def _as_master_state(key, value, master: torch.Tensor):
    """torch.optim's load policy, for the master: ``step`` as it is, floating state in its dtype."""
    if not isinstance(value, torch.Tensor) or key == "step":
        return value
    if value.is_floating_point():
        return value.to(dtype=master.dtype, device=master.device)
    return value.to(device=master.device)


# ---------------------------------------------------------------- hooks (on the user's optimizer)

def _add_masters_to_state_dict(optimizer, state_dict: dict) -> None:
    store = _STORES.get(optimizer)
    if store is not None:
        store.adopt_loaded()
        # the masters' optimizer holds the state of every parameter with a master: its entry replaces
        # theirs; a parameter without one keeps what torch.optim holds for it, as torch.optim saves it
        entry = store.state_dict_entry()
        mastered = {index for index, p, m in store._indexed() if m is not None}
        kept = {k: v for k, v in state_dict["state"].items() if k != STATE_DICT_KEY and k not in mastered}
        state_dict["state"] = {**kept, STATE_DICT_KEY: entry}


def _adopt_after_load(optimizer) -> None:
    store = _STORES.get(optimizer)
    if store is not None:
        store.adopt_loaded()


def refuse_step_outside_the_compiled_step(optimizer, args, kwargs) -> None:
    """An eager opt.step() with gradients present. While Dynamo traces opt.step() (inside the
    compiled step, where the gradients it sees are still pending) this checks nothing: an update
    graph that receives gradients is refused by the backend (legality.check_master_weights)."""
    if torch.compiler.is_compiling():
        return
    fed = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if fed:
        raise OptpassError(step_outside_message(fed))


def step_outside_message(params: list[torch.Tensor]) -> str:
    dtypes = ", ".join(sorted({str(p.dtype) for p in params}))
    return (f"master_weights: opt.step() was called with gradients on {len(params)} parameter(s) ({dtypes}). "
            "This optimizer's update runs on fp32 master weights inside the step compiled with "
            "options={'optimizer': opt, 'master_weights': torch.float32}; this call would update the "
            "parameters directly, and the masters and their optimizer state would not see it. Call "
            "opt.step() inside that compiled step, after loss.backward(). To end a partial window of "
            "accumulation_steps (the last micro-batches of an epoch), drop it with opt.zero_grad(), or make "
            "each epoch a multiple of accumulation_steps micro-batches.")


# ---------------------------------------------------------------- access

def master_state(optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> MasterWeights:
    """The masters of `optimizer` (created at the first compile of a step that uses them)."""
    store = _STORES.get(optimizer)
    if store is None:
        store = MasterWeights(optimizer, dtype)
        _STORES[optimizer] = store
    elif store.dtype != dtype:
        raise OptpassError(f"master_weights: this optimizer already has {store.dtype} masters; compile every "
                           f"step that uses it with master_weights={store.dtype}.")
    return store


def master_weights(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, torch.Tensor]:
    """``{parameter: master}`` for every parameter of `optimizer` that a compiled step has updated
    (an fp32 parameter is its own master; a parameter that never got a gradient has none).

    The masters are the tensors the fused step updates (in place); the model's bf16/fp16
    parameters are their rounded copies. Available once a step compiled with
    ``options={"optimizer": optimizer, "master_weights": torch.float32}`` has run. State that
    ``opt.load_state_dict`` put into the user's optimizer is moved into the masters first.

    Args:
        optimizer: the user's optimizer, as given in the step's options.

    Returns:
        ``{parameter: master}``, in the optimizer's parameter order.

    Raises:
        OptpassError: no step compiled with master_weights has run for this optimizer yet; its
            masters are sharded over the ranks of ``data_parallel="zero1"`` (the message says
            where they are); or a loaded checkpoint has an fp32 master for a parameter that is
            fp32 here (its own master).
    """
    store = _STORES.get(optimizer)
    if store is None:
        _refuse_sharded_masters(optimizer)
        raise OptpassError(
            "this optimizer has no master weights (yet): they are made from the parameters when a step "
            "compiled with options={'optimizer': opt, 'master_weights': torch.float32} first runs.")
    store.adopt_loaded()
    store.refresh()
    return {p: m for p, m in store.pairs()}


def note_sharded_masters(optimizer: torch.optim.Optimizer, world: int) -> None:
    """data_parallel='zero1' keeps `optimizer`'s fp32 masters sharded over `world` ranks."""
    _SHARDED_MASTERS[optimizer] = world


def _refuse_sharded_masters(optimizer: torch.optim.Optimizer) -> None:
    """With data_parallel='zero1' no rank holds every master: {parameter: master} cannot be had."""
    world = _SHARDED_MASTERS.get(optimizer)
    if world is not None:
        raise OptpassError(
            f"master_weights(opt): this optimizer's fp32 masters are sharded over the {world} "
            "ranks of data_parallel='zero1' (rank r holds the masters of its chunk of each bucket, with "
            "the optimizer state), so no rank has a full master of every parameter. This rank's pieces: "
            "optpass.zero1.sharded_state(opt).master_pieces() ({parameter index: [(start, stop, fp32 "
            "view)]}); all of them: optpass.save_sharded_checkpoint(path, opt) (entry 'master' per "
            "parameter).")
