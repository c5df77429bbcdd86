"""FSDP2's mixed-precision policy for ``optpass.fully_shard``: fp32 shards, compute in ``param_dtype``.

``torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype,
cast_forward_inputs)`` means, for FSDP2 and here alike:

* the shards, and so the optimizer's state and update, stay in the parameters' own dtype (fp32);
* each parameter is cast to ``param_dtype`` before its all-gather (bf16: half the bytes sent) and
  the gathered parameter, so the module's computation, is in ``param_dtype``;
* its gradient is reduced across the ranks in ``reduce_dtype`` (None: ``param_dtype``), then cast
  to the shard's dtype;
* the floating-point tensors among the forward's inputs of the module ``fully_shard`` was called on
  are cast to ``param_dtype`` (``cast_forward_inputs``, default True), its outputs to
  ``output_dtype`` when that is given.

Outside a compiled step, a parameter read during the forward of a module sharded with a policy is
gathered in ``param_dtype`` (the module computes in it, as in the step); read anywhere else
(``model.head.weight`` to inspect or write it) it is gathered in the shard's own dtype, as FSDP2's
parameters are fp32 DTensors between forwards.

The casts of parameters and gradients live in ``optpass/fsdp/gather.py`` (inside the step's graph);
the inputs' and outputs' are forward hooks on the module, which Dynamo traces into the step. This
is a different program from the option ``master_weights`` (bf16 parameters beside fp32 masters,
Megatron's step): here the parameters themselves are fp32 and only their gathered copies are not.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.utils import _apply_to_tensors

from optpass.errors import OptpassError

_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")


def _check(policy) -> None:
    if policy is not None and not all(hasattr(policy, f) for f in _FIELDS):
        raise OptpassError(f"optpass.fully_shard: mp_policy={policy!r} is not a mixed-precision policy: pass "
                           "torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...).")
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        value = getattr(policy, field, None)
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise OptpassError(f"optpass.fully_shard: mp_policy.{field}={value!r} is not a floating-point dtype.")


def dtypes(policy) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(param_dtype, reduce_dtype) of a policy (None, None without one); reduce_dtype defaults to
    param_dtype, as FSDP2's."""
    _check(policy)
    if policy is None:
        return None, None
    return policy.param_dtype, policy.reduce_dtype or policy.param_dtype


def _cast(dtype: torch.dtype, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor


def _cast_inputs(dtype, _module, args, kwargs):
    cast = functools.partial(_cast, dtype)
    return _apply_to_tensors(cast, args), _apply_to_tensors(cast, kwargs)


def _cast_outputs(dtype, _module, _args, output):
    return _apply_to_tensors(functools.partial(_cast, dtype), output)


_FORWARD_DEPTH = [0]       # forwards of modules sharded with a policy running eagerly, nested


def in_forward() -> bool:
    """Whether the eager forward of a module sharded with a policy is running: a parameter read now is
    computed with, so it is gathered in the policy's ``param_dtype``."""
    return _FORWARD_DEPTH[0] > 0


def _enter_forward(_module, _args):
    if not torch.compiler.is_compiling():
        _FORWARD_DEPTH[0] += 1


def _leave_forward(_module, _args, _output):
    if not torch.compiler.is_compiling():
        _FORWARD_DEPTH[0] = max(0, _FORWARD_DEPTH[0] - 1)


def cast_forward_inputs_and_outputs(module: torch.nn.Module, policy) -> None:
    """The policy's casts of ``module``'s forward inputs and outputs, as forward hooks, and the hooks
    that tell a parameter read in its eager forward from one outside it (``in_forward``)."""
    if policy is None:
        return
    if policy.param_dtype is not None:
        module.register_forward_pre_hook(_enter_forward)
        module.register_forward_hook(_leave_forward, always_call=True)
    if policy.param_dtype is not None and policy.cast_forward_inputs:
        module.register_forward_pre_hook(functools.partial(_cast_inputs, policy.param_dtype), with_kwargs=True)
    if policy.output_dtype is not None:
        module.register_forward_hook(functools.partial(_cast_outputs, policy.output_dtype))
