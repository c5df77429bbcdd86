"""A model built on the meta device, sharded, then materialized and initialized shard by shard.

FSDP2's recipe for a model no rank can hold whole::

    with torch.device("meta"):
        model = Model(config)
    optpass.fully_shard(model)          # shards on the meta device: shapes only, no values
    model.to_empty(device="cpu")        # each rank allocates its shards only
    torch.manual_seed(0)                # the same seed on every rank
    model.init_weights()                # or reset_parameters() per module, model.apply(fn), post_init()

How the model's own initialization writes the shards: between ``to_empty`` and the end of
initialization, reading a sharded parameter through its module (``linear.weight``, what every
init function does) gathers its current value into a full temporary (a collective; every rank runs
the same init code in the same order) that the init function fills in place; when the temporary
dies, right after the init function returns, this rank's rows of it are copied into the shard. So
the shards hold exactly the rows of what the same initialization under the same seed gives the
unsharded model, and no rank holds more than its shards and the one full parameter being
initialized.

Every rank must draw the same random numbers for this to give one process's model: each rank
keeps its rows of its own full draw. The random generator's state at the first gather is compared
across the ranks when initialization ends; where the ranks drew random numbers from different
states, a ``RanksSeededDifferentlyWarning`` says so (the model is a valid random initialization,
but not the one a single process under one seed gives).

Initialization ends at the model's first compiled step, or ``full_state_dict``, or
``load_full_state_dict``, whichever comes first (``finish_initialization``): every temporary still
alive is written back, and a shard or floating-point buffer that nothing wrote since ``to_empty``
(``to_empty`` fills them with NaN) is an error naming it: never garbage. Buffers are then made rank
0's on every rank, as ``fully_shard`` does.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from optpass.errors import OptpassError, warn_at_user_line

# shard -> ShardSpec, for the shards materialized from the meta device and not yet initialized
_INITIALIZING: WeakIdKeyDictionary = WeakIdKeyDictionary()
# root module -> [(qualified name, module, buffer name)] of its buffers that were on the meta device
_META_BUFFERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_ALIVE: WeakIdKeyDictionary = WeakIdKeyDictionary()    # temporaries alive -> True (identity, see below)
# shard -> its version counter after optpass last wrote it: a write that is not optpass's (through
# ``model.parameters()``, which yields the shards) drew values for the shard's shape, not the full one's
_VERSION: WeakIdKeyDictionary = WeakIdKeyDictionary()
# shards an init wrote directly (keyed by identity: a WeakSet of tensors compares them with ==, which
# raises for a tensor of more than one element)
_WRITTEN_DIRECTLY: WeakIdKeyDictionary = WeakIdKeyDictionary()
# every module passed to fully_shard, in the order of the calls (the same on every rank)
_ROOTS: "list[weakref.ref[torch.nn.Module]]" = []


# the CPU random generator's state at the first gather of the initialization window (None: none yet)
_RNG_AT_FIRST_GATHER: list = [None]


class RanksSeededDifferentlyWarning(UserWarning):
    """The ranks drew random numbers for a meta-built model's initialization from different generator
    states: each rank's rows come from a different draw (see the module docstring)."""


def mark_written(shard: torch.Tensor, loaded: bool = False) -> None:
    """optpass wrote ``shard`` (a write-back, or with ``loaded`` a checkpoint's rows, which replace
    whatever an initialization wrote before): not a direct write."""
    if shard in _INITIALIZING:
        _VERSION[shard] = shard._version
        if loaded:
            _WRITTEN_DIRECTLY.pop(shard, None)


class _WrittenBack(torch.Tensor):
    """A full parameter gathered for initialization: this rank's rows go back to the shard when it
    dies (or at ``finish_initialization``). Operations on it give plain tensors."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __getattr__(self, name):
        """An attribute an init function set on the parameter before (Hugging Face's
        ``_is_hf_initialized``) is read from the shard, where ``__setattr__`` put it."""
        shard = self.__dict__.get("_optpass_target", (None,))[0]
        if shard is None or name.startswith("_optpass"):
            raise AttributeError(name)
        return getattr(shard, name)

    def __setattr__(self, name, value):
        shard = self.__dict__.get("_optpass_target", (None,))[0]
        if shard is None or name.startswith("_optpass") or hasattr(torch.Tensor, name):
            super().__setattr__(name, value)
        else:
            setattr(shard, name, value)     # outlives this temporary, as it would on the parameter

    @property
    def data(self):
        """Itself (it never requires grad): ``module.weight.data.normal_()`` must write into the
        temporary that writes back, not into a tensor outliving it."""
        return self

    @data.setter
    def data(self, value):
        with torch.no_grad():
            self.copy_(value)

    def write_back(self) -> None:
        shard, offset, valid = getattr(self, "_optpass_target", (None, 0, 0))
        if shard is None:
            return
        self._optpass_target = (None, 0, 0)
        with torch.no_grad():
            rows = self.as_subclass(torch.Tensor).reshape(-1, *shard.shape[1:]) if self.dim() else \
                self.as_subclass(torch.Tensor).reshape(1)
            if shard in _VERSION and shard._version != _VERSION[shard]:
                _WRITTEN_DIRECTLY[shard] = True      # an init drew values for the shard's shape: the random
            shard[:valid].copy_(rows[offset:offset + valid])    # stream differs from one device's from there on
            mark_written(shard)

    def __del__(self):
        self.write_back()


def initializing(shard: torch.Tensor) -> bool:
    """``shard`` was materialized from the meta device and its model's initialization has not ended."""
    return shard in _INITIALIZING


def full_for_initialization(shard: torch.Tensor, spec) -> torch.Tensor:
    """The full parameter gathered eagerly from every rank's shard, as a temporary whose rows go back
    to ``shard`` when it dies: what reading ``module.weight`` gives while the model is initialized."""
    for older in list(_ALIVE):        # one still alive (held by a reference cycle) writes back first,
        if older.__dict__.get("_optpass_target", (None,))[0] is shard:      # not over this one later
            older.write_back()
    if _RNG_AT_FIRST_GATHER[0] is None:
        _RNG_AT_FIRST_GATHER[0] = torch.random.get_rng_state()
    pieces = torch.empty(spec.chunk * spec.world, *shard.shape[1:], dtype=shard.dtype, device=shard.device)
    with torch.no_grad():
        # one broadcast per rank into its rows of the full tensor: nothing but the full tensor is
        # allocated (gloo's all-gather copies through a second full buffer)
        pieces[spec.rank * spec.chunk:(spec.rank + 1) * spec.chunk].copy_(shard)
        for rank in range(spec.world):
            dist.broadcast(pieces[rank * spec.chunk:(rank + 1) * spec.chunk],
                           dist.get_global_rank(spec.group, rank), group=spec.group)
    full = pieces[:spec.rows].reshape(spec.shape)
    temporary = torch.Tensor._make_subclass(_WrittenBack, full, False)
    temporary._optpass_target = (shard, spec.offset, spec.valid)
    _ALIVE[temporary] = True
    return temporary


def materialized(root: torch.nn.Module, shards_before: dict, specs: WeakIdKeyDictionary) -> None:
    """After ``root._apply`` (``to_empty``, ``.to``, ``.float()``...): each module holds a new object
    for each shard; key the specs by the new objects, and when the shards came off the meta device,
    fill them and the former meta buffers with NaN and start the initialization window. Tied
    parameters come out as separate objects, as ``Module._apply`` leaves them without sharding (tie
    them again after ``to_empty``: Hugging Face's ``tie_weights()`` in ``init_weights()`` does)."""
    for (module, name), old in shards_before.items():
        canonical = module._parameters[name]
        if canonical is old:
            continue
        if old in specs:
            specs[canonical] = specs[old]
        if old.is_meta and not canonical.is_meta:
            with torch.no_grad():
                if canonical.is_floating_point():
                    canonical.fill_(float("nan"))
                canonical[specs[canonical].valid:].zero_()          # the padding rows stay zero
            _INITIALIZING[canonical] = specs[canonical]
            mark_written(canonical)
    for _, module, name in _META_BUFFERS.get(root, ()):
        buffer = module._buffers.get(name)
        if buffer is not None and not buffer.is_meta and buffer.is_floating_point():
            with torch.no_grad():
                buffer.fill_(float("nan"))


def remember_meta_buffers(root: torch.nn.Module) -> None:
    _META_BUFFERS[root] = [(f"{q}.{n}" if q else n, m, n) for q, m in root.named_modules()
                           for n, b in m._buffers.items() if b is not None and b.is_meta]


def refuse_meta(root: torch.nn.Module) -> None:
    """A model sharded on the meta device and not materialized (``to_empty`` not called): an error
    that says so, instead of meta tensors handed on as values."""
    on_meta = [n for n, t in (*root.named_parameters(), *root.named_buffers()) if t.is_meta]
    if on_meta:
        raise OptpassError(meta_message(f"{len(on_meta)} parameter(s) or buffer(s) of {root.__class__.__name__} "
                                        f"({', '.join(on_meta[:4])}{', ...' if len(on_meta) > 4 else ''}) are"))


def meta_message(what: str) -> str:
    return (f"optpass: {what} still on the meta device: shapes without values. After optpass.fully_shard(model), "
            "call model.to_empty(device='cpu') (each rank allocates its shards), then initialize them (the model's "
            "init_weights() / post_init(), reset_parameters() of each module, model.apply(fn)) or load them "
            "(optpass.load_full_state_dict(model, checkpoint)).")


def finish_initialization(root: torch.nn.Module) -> None:
    """End the initialization window of ``root``'s shards: write back what is still alive, refuse
    what nothing initialized, make the buffers rank 0's. A no-op for a model that never was on the
    meta device or whose initialization ended before."""
    refuse_meta(root)
    shards = [(n, p) for n, p in root.named_parameters() if p in _INITIALIZING]
    buffers = _META_BUFFERS.get(root, [])
    if not shards and not buffers:
        return
    write_back_alive()
    direct = [n for n, p in shards if p in _WRITTEN_DIRECTLY or (p in _VERSION and p._version != _VERSION[p])]
    if direct:
        raise OptpassError(
            f"optpass: {len(direct)} sharded parameter(s) of {root.__class__.__name__} were written directly during "
            f"their initialization ({', '.join(direct[:4])}{', ...' if len(direct) > 4 else ''}), through "
            "model.parameters() / named_parameters(), which yield this rank's shards: an init function drew "
            "values for the shard's shape there, not the rows of the full parameter, so the model would not be "
            "what the same code gives on one device. "
            "Initialize through the module's attribute (module.weight, which writes the shards' rows), or load "
            "the weights: optpass.load_full_state_dict(model, checkpoint) after initializing, or build the "
            "model on the CPU and fully_shard it.")
    unset = [n for n, p in shards if p.is_floating_point() and _written_rows_have_nan(p, _INITIALIZING[p])]
    unset += [q for q, m, n in buffers if m._buffers.get(n) is not None
              and m._buffers[n].is_floating_point() and m._buffers[n].isnan().any()]
    if unset:
        raise OptpassError(
            f"optpass: {len(unset)} parameter(s) or buffer(s) of {root.__class__.__name__} were not initialized "
            f"after to_empty ({', '.join(unset[:4])}{', ...' if len(unset) > 4 else ''}): they hold no values. "
            "Initialize every parameter and buffer after model.to_empty(...) and before training (the model's "
            "init_weights() / post_init(), reset_parameters() of each module, model.apply(fn), or "
            "optpass.load_full_state_dict(model, checkpoint)); a buffer no checkpoint holds (a rotary table "
            "computed in the constructor) needs the model's own init before loading.")
    group = next((_INITIALIZING[p].group for _, p in shards), None)
    if group is not None:
        _check_ranks_drew_alike(root, group)
        with torch.no_grad():
            for buffer in root.buffers():
                dist.broadcast(buffer, dist.get_global_rank(group, 0), group=group)
    for _, p in shards:
        del _INITIALIZING[p]
    for module in root.modules():           # blocks sharded before it: their buffers are root's too
        _META_BUFFERS.pop(module, None)


def _check_ranks_drew_alike(root: torch.nn.Module, group) -> None:
    """Warn when some rank drew random numbers during the initialization and the ranks' generators
    were not in one state when it began (one all-gather of two numbers per rank)."""
    import zlib

    then, _RNG_AT_FIRST_GATHER[0] = _RNG_AT_FIRST_GATHER[0], None
    if then is None:
        return
    drew = not torch.equal(then, torch.random.get_rng_state())
    mine = torch.tensor([zlib.crc32(then.numpy().tobytes()), int(drew)], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    if any(int(t[1]) for t in every) and len({int(t[0]) for t in every}) > 1:
        warn_at_user_line(
            f"optpass: the ranks drew random numbers to initialize {root.__class__.__name__} from different "
            "random generator states: each rank kept its rows of its own draw, so the model is a valid random "
            "initialization but not the one a single process gives under one seed. To reproduce that one, "
            "seed every rank alike before the initialization (torch.manual_seed(seed) on every rank, after "
            "model.to_empty(...)), or load the weights (optpass.load_full_state_dict).",
            RanksSeededDifferentlyWarning)


def write_back_alive() -> None:
    """Write back (and disarm) every temporary gathered for initialization that is still alive, so
    that none writes stale rows later."""
    for temporary in list(_ALIVE):
        temporary.write_back()


def finish_all(shards) -> None:
    """End the initialization of every model a compiled step trains (its shards ``shards``): each
    outermost module passed to ``fully_shard`` (a block sharded before its model ends with it), in the
    order of the calls, so that every rank runs the buffers' broadcasts in the same order."""
    if not any(s in _INITIALIZING for s in shards):
        return
    roots = [r for r in (ref() for ref in _ROOTS) if r is not None
             and any(p in _INITIALIZING for p in r.parameters())]
    for root in roots:
        if not any(other is not root and any(m is root for m in other.modules()) for other in roots):
            finish_initialization(root)


def _written_rows_have_nan(shard: torch.Tensor, spec) -> bool:
    return bool(shard[:spec.valid].isnan().any())


def track_root(root: torch.nn.Module) -> None:
    """Remember a module passed to ``fully_shard`` (weakly), in call order."""
    _ROOTS[:] = [ref for ref in _ROOTS if ref() is not None]
    _ROOTS.append(weakref.ref(root))
