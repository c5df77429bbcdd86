"""The optimizer state a user's optimizer already holds when ZeRO-1 shards it.

A run can reach its first zero1 step with full-size state in ``opt.state``: eager steps
before it, ``opt.load_state_dict(...)`` of a plain torch.optim checkpoint (a run without
zero1, DDP's), or state the optimizer made in its constructor (Adagrad's ``sum``). A
sharded optimizer (``state.py``) that started from fresh state and left the user's in
place would restart a resumed AdamW's moments and bias corrections (measured: 8.5% off an
uninterrupted run after 3 more steps), and every rank would keep the full-size tensors.

So, when the optimizer is sharded:

* each rank copies its rows of every per-element state tensor (the tensor has the
  parameter's shape) into its shard's state, cast to the shard's dtype (the fp32 masters'
  with master_weights); a scalar entry (``step``, ASGD's ``eta``/``mu``, NAdam's
  ``mu_product``) is the bucket's, so every parameter of a bucket must hold the same value;
* state that only the constructor made (it equals the shard optimizer's own, rounded to
  the parameter's dtype: Adagrad's ``initial_accumulator_value``) is not copied: the
  shard keeps its own, unrounded;
* the user's optimizer keeps no state for the parameters zero1 updates (the full-size
  tensors are freed);
* the ranks must agree (``state_summary`` is part of ``state.signature``): load the same
  state on every rank, as for DDP.

A checkpoint of a master_weights run without zero1 holds its parameters' state, and their
fp32 masters, under one entry (``precision.masters.STATE_DICT_KEY``): both are taken the same
way, the masters' rows into this rank's master shards (which are then not re-read from the
bf16 parameters). Before, that entry was ignored: the run restarted its moments from zero
and its masters from the rounded parameters (0.045 off after 3 steps, AdamW, bf16).
"""

from __future__ import annotations

import hashlib
from typing import Any
from weakref import WeakKeyDictionary

import torch

from optpass.errors import OptpassError
from optpass.optim import low_bit_states
from optpass.precision.masters import STATE_DICT_KEY, is_rounded_copy

# a master_weights checkpoint's fp32 masters, between the ranks' agreement and the sharding
_UNPACKED_MASTERS: WeakKeyDictionary = WeakKeyDictionary()

# 0-d state entries that are scalars of the update, not elements of a 0-d parameter
_SCALAR_KEYS = {"step", "eta", "mu", "mu_product"}


def _is_scalar_entry(key: str, value: Any, param: torch.Tensor) -> bool:
    if not isinstance(value, torch.Tensor):
        return True
    if tuple(value.shape) != tuple(param.shape):
        if value.numel() != 1:
            raise OptpassError(
                f"data_parallel='zero1': optimizer state {key!r} has shape {tuple(value.shape)}, neither the "
                f"parameter's {tuple(param.shape)} nor a scalar, so it cannot be sharded by elements.")
        return True
    return param.dim() == 0 and key in _SCALAR_KEYS


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value


def state_summary(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> tuple:
    """What every rank must agree on: which parameters hold state, its keys and its scalars."""
    _unpack_master_weights_entry(optimizer)
    summary = [("fp32 masters", len(_UNPACKED_MASTERS.get(optimizer, {})))]
    for index, p in enumerate(params):
        values = optimizer.state.get(p)
        if values:
            summary.append((index, tuple(sorted(values)),
                            tuple((k, _scalar(v)) for k, v in sorted(values.items()) if _is_scalar_entry(k, v, p))))
    return tuple(summary)


@torch.no_grad()
def state_digest(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> str | None:
    """A digest of the bytes of every state tensor held for `params` before sharding (and of a
    master_weights checkpoint's fp32 masters); None when there is none. Ranks that took eager steps
    on their own data before their first zero1 step hold state alike in keys and step counts but not
    in values, and sharding would take each rank's rows of its own state (measured: 7.4e-3 off one
    process after 3 more steps, silently). Bytes, not sums: a sum's rounding can depend on threads."""
    _unpack_master_weights_entry(optimizer)
    tensors = [t for p in params for _, v in sorted((optimizer.state.get(p) or {}).items())
               for t in low_bit_states.stored_tensors(v)]
    tensors += list(_UNPACKED_MASTERS.get(optimizer, {}).values())
    if not tensors:
        return None
    digest = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        digest.update(tensor.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().data)
    return digest.hexdigest()


@torch.no_grad()
def adopt_unsharded_state(sharded) -> None:
    """Move what ``sharded.optimizer.state`` holds for the trainable parameters into this rank's
    shard state (see the module docstring); `sharded` is a ``state.ShardedOptimizer``."""
    user = sharded.optimizer.state
    params = [p for _, p in sharded.params]
    _unpack_master_weights_entry(sharded.optimizer)
    masters = _UNPACKED_MASTERS.pop(sharded.optimizer, {})
    if masters and sharded.master_dtype is not None:
        _take_master_rows(sharded, masters)
    if not any(p in user for p in params):
        return
    for bucket in sharded.layout.buckets:
        held = [i for i in bucket.params if user.get(params[i])]
        if not held:
            continue
        _refuse_unequal_bucket(bucket, held, params, user)
        shard = sharded.shards.get(bucket.index)
        if shard is None:
            continue                                   # no rows of this bucket on this rank
        made = sharded.shard_optimizer.state.get(shard, {})
        segments = bucket.segments[sharded.rank]
        if any(low_bit_states.is_quantized(v) for v in made.values()):
            sharded.shard_optimizer.state[shard] = _quantized_rows(made, user, params, segments, params[held[0]])
            continue
        if made and all(_is_rounded(made, user[params[s.param]], params[s.param], s) for s in segments):
            continue                                   # the constructor's state: the shard keeps its own
        first = params[held[0]]
        state: dict = {}
        for key, value in user[first].items():
            if _is_scalar_entry(key, value, first):
                state[key] = value.clone() if isinstance(value, torch.Tensor) else value
                continue
            flat = torch.zeros_like(shard)
            for s in segments:
                source = user[params[s.param]][key].reshape(-1)[s.start:s.stop]
                flat[s.offset:s.offset + s.numel].copy_(source)
            state[key] = flat
        sharded.shard_optimizer.state[shard] = state
    for p in params:
        user.pop(p, None)


def _quantized_rows(made: dict, user, params: list[torch.Tensor], segments, first: torch.Tensor) -> dict:
    """This rank's rows of a torchao optimizer's state, into the shard's quantized moments (made in the
    parameters' blocks, ``state.ShardedOptimizer``): each moment's codes and block scales are copied
    as they are (a segment is whole blocks); requantizing the dequantized rows would not give a
    signed moment's codes back."""
    state = dict(made)
    for key, value in user[first].items():
        if _is_scalar_entry(key, value, first):
            state[key] = value.clone() if isinstance(value, torch.Tensor) else value
            continue
        target = made.get(key)
        for s in segments:
            source = user[params[s.param]][key]
            if not (low_bit_states.is_quantized(target) and type(source) is type(target)):
                raise OptpassError(
                    f"data_parallel='zero1': optimizer state {key!r} of parameter #{s.param} is a "
                    f"{type(source).__name__}, where this optimizer quantizes it as {type(target).__name__}; "
                    "load state saved by the same optimizer class and block size.")
            for name, ratio in low_bit_states.inner_rows(target).items():
                rows = getattr(target, name).reshape(-1)[int(s.offset * ratio): int((s.offset + s.numel) * ratio)]
                rows.copy_(getattr(source, name).reshape(-1)[int(s.start * ratio): int(s.stop * ratio)])
    return state


def _unpack_master_weights_entry(optimizer) -> None:
    """Move a master_weights checkpoint's entry (state and fp32 masters by parameter index, in
    param-group order) to the parameters' own state entries, and its masters aside
    (``_UNPACKED_MASTERS``, {parameter: master}) until the optimizer is sharded."""
    saved = optimizer.state.pop(STATE_DICT_KEY, None)
    if not saved:
        return
    everything = [p for group in optimizer.param_groups for p in group["params"]]
    for index, values in saved.get("state", {}).items():
        optimizer.state[everything[int(index)]] = dict(values)
    _UNPACKED_MASTERS[optimizer] = {everything[int(i)]: m for i, m in saved.get("masters", {}).items()}


@torch.no_grad()
def _take_master_rows(sharded, masters: dict[torch.Tensor, torch.Tensor]) -> None:
    """This rank's rows of the saved fp32 masters, into its master shards (kept from stale)."""
    params = [p for _, p in sharded.params]
    for bucket in sharded.layout.buckets:
        shard = sharded.shards.get(bucket.index)
        if shard is None or not sharded.has_master(bucket):
            continue
        segments = bucket.segments[sharded.rank]
        if not all(params[s.param] in masters for s in segments):
            continue                                   # re-read from the parameters, as before
        for s in segments:
            shard[s.offset:s.offset + s.numel].copy_(masters[params[s.param]].reshape(-1)[s.start:s.stop])
        sharded._stale_masters.discard(bucket.index)


def _refuse_unequal_bucket(bucket, held: list[int], params: list[torch.Tensor], user) -> None:
    """One bucket is one parameter of the shard optimizer: one set of keys, one value of each scalar."""
    reference = user[params[held[0]]]
    scalars = {k: _scalar(v) for k, v in reference.items() if _is_scalar_entry(k, v, params[held[0]])}
    for i in bucket.params:
        values = user.get(params[i]) or {}
        mine = {k: _scalar(v) for k, v in values.items() if _is_scalar_entry(k, v, params[i])}
        if set(values) != set(reference) or mine != scalars:
            raise OptpassError(
                f"data_parallel='zero1': parameters #{held[0]} and #{i} share a bucket, but the optimizer "
                f"state they hold differs ({sorted(reference)} with {scalars} against {sorted(values)} "
                f"with {mine}): ZeRO-1 keeps one state per bucket, with one step count. Start zero1 from "
                "state in which every parameter has taken the same steps (e.g. a checkpoint of a run that "
                "updated them all), or from none (opt.state.clear()).")


def _is_rounded(made: dict, values: dict, param: torch.Tensor, segment) -> bool:
    """Whether this rank's rows of `values` are the shard's constructor state rounded to their dtype."""
    if made.keys() != values.keys():
        return False
    scalars = {k for k, v in values.items() if _is_scalar_entry(k, v, param)}

    def rows(entries: dict, start: int) -> dict:
        return {k: v if k in scalars else v.reshape(-1)[start:start + segment.numel] for k, v in entries.items()}
    return is_rounded_copy(rows(made, segment.offset), rows(values, segment.start))
