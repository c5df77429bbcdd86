"""Dynamo settings optpass needs, in force only while Dynamo traces a frame for an optpass compile.

optpass needs two Dynamo settings that torch only offers process-wide (docs/design.md §1, §5):

* ``trace_autograd_ops``: ``loss.backward()`` traced into the step's graph;
* ``ignore_logging_functions``: a model's ``logger.warning_once`` skipped instead of breaking the graph.

and one allowance torch offers only as a process-wide flag for every side effect
(``skip_fwd_side_effects_in_bwd_under_checkpoint``): Hugging Face's hub-kernel routing (the
``kernels`` package, a dependency of transformers >= 5.25) writes a module-level variable around
every attention layer's forward and restores it on the way out; inside a checkpointed block
(``checkpoint_wrapper``, torchtitan's activation checkpointing) Dynamo refuses that write ("HOP:
Unsafe side effect") and the forward breaks off the step. ``allow_hub_kernel_routing`` lets that one
write through, for optpass compiles: it is set and restored within the same forward, so nothing of
it outlives the block, and eager recomputation in backward would set and restore it again
(docs/design.md §65). Every other write inside a checkpointed block is still refused.

Set plainly, they change every other compile in the process: a model sharded by torch's FSDP2 or
wrapped in DDP and compiled with ``backend="eager"`` would have its backward traced, so the
gradient hooks those wrappers rely on never run (docs/design.md §36). ``torch.compile`` gives a
backend named by a string no hook that runs before tracing, so each setting here is a value whose
truth Dynamo asks at the moment it decides, and which answers for the compile that asks:

    torch._dynamo.config.trace_autograd_ops = ONLY_FOR_OPTPASS_COMPILES   # bool(...) per decision

``optpass_compile_in_progress()`` reads the backend of the frame Dynamo is tracing (its output
graph's compiler, unwrapped through torch.compile's and Dynamo's wrappers) and looks for the mark
``mark_optpass_backend`` puts on optpass's backends. Outside a trace, or for any other backend, the
settings read as torch's defaults.

Even for an optpass compile backward is traced only where the frame holds a tensor that can take a
gradient (a parameter, an input leaf): Dynamo 2.13 turns a ``loss.backward()`` whose frame holds
none, because the forward ran outside it (a graph break in the model, FSDP2's or DDP's forward,
which Dynamo never compiles), into nothing at all, and no gradient is made. Answering False there
makes Dynamo break the graph at backward() instead: backward runs from eager autograd, with every
hook, as it would without optpass.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

import torch

_MARK = "_optpass_traces_backward"
# stdlib logging methods, and the ones Hugging Face transformers adds to logging.Logger
_LOGGER_METHODS = ("debug", "info", "warning", "warn", "warning_once", "info_once", "warning_advice")
_WRAPPED_BACKEND_ATTRIBUTES = ("_torchdynamo_orig_backend", "compiler_fn", "func", "__wrapped__")


def mark_optpass_backend(backend):
    """Mark ``backend`` (a function or partial) as optpass's: Dynamo's traces for it capture backward."""
    setattr(backend, _MARK, True)
    return backend


def _current_trace():
    """The root instruction translator of the frame Dynamo is tracing on this thread, or None."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        return InstructionTranslator.current_tx()
    except AttributeError:              # no frame was ever traced on this thread
        return None


def _is_optpass_backend(backend) -> bool:
    for _ in range(8):                  # WrapBackendDebug -> torch.compile's wrapper -> partial -> ours
        if backend is None:
            return False
        if getattr(backend, _MARK, False):
            return True
        backend = next((getattr(backend, a) for a in _WRAPPED_BACKEND_ATTRIBUTES if hasattr(backend, a)), None)
    return False


def _optpass_trace():
    """The root instruction translator of the frame Dynamo is tracing on this thread for an optpass
    backend, or None (no trace, or another backend's)."""
    trace = _current_trace()
    return trace if trace is not None and _is_optpass_backend(getattr(trace.output, "compiler_fn", None)) else None


def optpass_compile_in_progress() -> bool:
    """Is Dynamo, on this thread, tracing a frame whose graph goes to an optpass backend?"""
    return _optpass_trace() is not None


def _frame_holds_a_gradient_leaf(trace) -> bool:
    """Does the traced frame hold a tensor backward() could give a gradient (Dynamo's own choice of
    backward()'s inputs: graph inputs and tensors made leaves in the frame, requiring grad, no grad_fn)?"""
    from torch._dynamo.variables.tensor import TensorVariable

    output = trace.output
    variables = [*getattr(output, "leaf_var_creation_order", ()), *output.input_source_to_var.values()]
    return any(isinstance(v, TensorVariable) and v.requires_grad and not v.has_grad_fn for v in variables)


@dataclasses.dataclass(frozen=True)
class DeclinedBackward:
    """A backward() optpass's setting declined to trace (its frame held no parameter): where it is,
    and what ran the loss's forward outside the frame (torch.distributed's wrappers it reaches)."""

    file: str
    line: int
    function: str
    wrappers: tuple[str, ...]


_DECLINED: list[DeclinedBackward] = []


def take_declined_backward() -> DeclinedBackward | None:
    """The last backward() declined since this was last asked (None: none)."""
    found = _DECLINED[-1] if _DECLINED else None
    _DECLINED.clear()
    return found


class _OnlyForOptpassCompiles:
    """``torch._dynamo.config.trace_autograd_ops``: true while Dynamo traces, for an optpass backend,
    a frame that holds a parameter or another leaf requiring grad; false otherwise (a declined
    backward() is remembered for the next graph optpass captures: ``take_declined_backward``)."""

    def __bool__(self) -> bool:
        trace = _optpass_trace()
        if trace is None:
            return False
        if _frame_holds_a_gradient_leaf(trace):
            return True
        _DECLINED.append(DeclinedBackward(trace.f_code.co_filename, getattr(trace, "lineno", 0) or 0,
                                          trace.f_code.co_name, _distributed_wrappers(trace)))
        return False

    def __repr__(self) -> str:
        return "optpass.dynamo_scope.ONLY_FOR_OPTPASS_COMPILES"

    def __reduce__(self):               # config hashes pickle it: one stable value
        return "ONLY_FOR_OPTPASS_COMPILES"

    def __deepcopy__(self, memo):
        return self

    def to_jsonable(self) -> str:       # Dynamo's compilation-metrics log writes its config as JSON
        return "only for optpass compiles"


ONLY_FOR_OPTPASS_COMPILES = _OnlyForOptpassCompiles()


def _distributed_wrappers(trace) -> tuple[str, ...]:
    """torch.distributed's wrappers whose forward Dynamo does not compile into a step (FSDP2, DDP)
    among the modules the traced frame reaches (its locals, the globals its code names)."""
    if not torch.distributed.is_available():
        return ()
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    kinds = ((FSDPModule, "torch's FSDP2 (torch.distributed.fsdp.fully_shard)"),
             (DistributedDataParallel, "DistributedDataParallel"))
    roots = [*trace.f_locals.values(), *(trace.f_globals.get(name) for name in trace.f_code.co_names)]
    return tuple(sorted({name for root in roots if isinstance(root, torch.nn.Module)
                         for module in root.modules() for kind, name in kinds if isinstance(module, kind)}))


class _LoggingMethodsForOptpass(set):
    """Dynamo's ignore set for logging calls: torch's own entries for every compile; for an optpass
    compile also logging.Logger's message methods, including those a library adds to logging.Logger
    after optpass was loaded (transformers does, when it is imported). Errors and exceptions are not
    skipped (logger.error / exception / critical still break)."""

    def __contains__(self, fn) -> bool:
        if set.__contains__(self, fn):
            return True
        name = getattr(fn, "__name__", None)
        return (name in _LOGGER_METHODS and getattr(logging.Logger, name, None) is fn
                and optpass_compile_in_progress())


class _OptimizerRecordFunctionNote(logging.Filter):
    """Drops Dynamo's "Profiler record function ... will be ignored" when optpass traces torch.optim.

    With backward captured, the supported step shape makes Dynamo trace ``opt.step()``, whose
    wrapper (``Optimizer.profile_hook_step`` in torch/optim/optimizer.py) opens a
    ``torch.autograd.profiler.record_function``; Dynamo then logs that note as a WARNING once per
    process (``ProfilerRecordFunctionContextVariable.create`` in
    torch/_dynamo/variables/ctx_manager.py). It is torch's own code and nothing a user can act on,
    so this drops exactly that record when the innermost function Dynamo is tracing for an optpass
    compile is in torch/optim; a ``record_function`` in the user's own code, or any other backend's
    compile, still gets the note.
    """

    MESSAGE = "Profiler record function %s will be ignored"

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != self.MESSAGE or not optpass_compile_in_progress():
            return True
        from torch._dynamo.symbolic_convert import InstructionTranslatorBase

        frame = sys._getframe()
        while frame is not None:       # the innermost translator: the function being traced
            tracer = frame.f_locals.get("self")
            if isinstance(tracer, InstructionTranslatorBase):
                return f"torch{os.sep}optim{os.sep}" not in tracer.f_code.co_filename
            frame = frame.f_back
        return True


_KEPT_CALLBACKS: list = []


def keep_compile_end_callback(callback) -> None:
    """Register ``callback`` among Dynamo's compile-end callbacks, and again whenever
    ``torch._dynamo.reset()`` clears them (optpass.explain resets Dynamo; so do test suites).

    An error Dynamo raises while it traces (before any backend runs) reaches optpass only through such
    a callback, so one dropped by a reset would leave the next compile's error unexplained. The
    callbacks kept here act on optpass's own errors only (``dp_model_checks``, ``dpsgd``); the handler's
    ``clear`` is wrapped on the instance to put them back after clearing.
    """
    handler = torch._dynamo.callback.callback_handler
    if callback not in _KEPT_CALLBACKS:
        _KEPT_CALLBACKS.append(callback)
    if callback not in handler.end_callbacks:
        handler.register_end_callback(callback)
    if not getattr(handler.clear, "_optpass_keeps_callbacks", False):
        clear = handler.clear

        def clear_keeping_optpass_callbacks() -> None:
            clear()
            for kept in _KEPT_CALLBACKS:
                if kept not in handler.end_callbacks:
                    handler.end_callbacks.append(kept)

        clear_keeping_optpass_callbacks._optpass_keeps_callbacks = True
        handler.clear = clear_keeping_optpass_callbacks


def _is_hub_kernel_routing(item) -> bool:
    """Is ``item`` (a Dynamo variable) the ``kernels`` package's routing variable
    (``kernels._internals.layer.layer._ACTIVE_KERNEL_FUNCS``, a ``CompileableContextVar``)?"""
    value = getattr(item, "__dict__", {}).get("value")   # not getattr: on some variables `value` is a property that fails
    kind = type(value)
    return kind.__name__ == "CompileableContextVar" and kind.__module__.split(".")[0] == "kernels"


def allow_hub_kernel_routing() -> None:
    """Let Dynamo trace, for optpass compiles, the hub-kernel routing's set-and-restore of its
    module-level variable inside a checkpointed block (see the module docstring). Idempotent."""
    from torch._dynamo.side_effects import SideEffects

    check = SideEffects.check_allowed_side_effect
    if getattr(check, "_optpass_allows_hub_kernel_routing", False):
        return

    def check_allowed_side_effect(self, item) -> bool:
        if _is_hub_kernel_routing(item) and optpass_compile_in_progress():
            return True
        return check(self, item)

    check_allowed_side_effect._optpass_allows_hub_kernel_routing = True
    SideEffects.check_allowed_side_effect = check_allowed_side_effect


def install() -> None:
    """Put the scoped settings in place (idempotent; again after someone replaced them).

    A ``trace_autograd_ops`` the user set to True themselves is left as they set it.
    """
    allow_hub_kernel_routing()
    config = torch._dynamo.config
    if config.trace_autograd_ops is False:
        config.trace_autograd_ops = ONLY_FOR_OPTPASS_COMPILES
    if not isinstance(config.ignore_logging_functions, _LoggingMethodsForOptpass):
        config.ignore_logging_functions = _LoggingMethodsForOptpass(config.ignore_logging_functions)
    logger = logging.getLogger("torch._dynamo.variables.ctx_manager")
    if not any(isinstance(f, _OptimizerRecordFunctionNote) for f in logger.filters):
        logger.addFilter(_OptimizerRecordFunctionNote())
