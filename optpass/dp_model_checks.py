"""A DP-SGD model's mistakes named at compile time, as Opacus's ``ModuleValidator`` names them.

* **A frozen parameter differentiated** in the vmap (``requires_grad=False``, yet among what
  ``torch.func.grad`` differentiates) enters every clip factor and gets a ``.grad``, where Opacus
  clips the trainable parameters only: ``warn_frozen_parameters_differentiated`` warns at every compile
  (``DPSGDModelWarning``), naming them. Layers without a rewrite are warned by the per_sample_grad_norm
  pass, which knows them.
* **BatchNorm** (and InstanceNorm with ``track_running_stats=True``) in training mode normalizes with
  statistics of the batch and updates running statistics in place: in DP-SGD one sample's output
  would depend on the others', so Opacus refuses it and swaps in GroupNorm. Under
  ``torch.func.vmap(grad(...))`` its in-place running-statistics update fails while Dynamo traces the
  step, before any backend sees a graph; ``refuse_batch_norm_in_vmaps`` turns that error, for an
  optpass compile, into an ``OptpassError`` that names the layer, the user's line and the fix. A
  BatchNorm without running statistics traces (each vmapped sample is then normalized by its own
  statistics, a different model than the one without DP): ``refuse_batch_norm_nodes`` refuses it in
  the DP graph. A BatchNorm in eval mode (fixed running statistics, no sample mixing) is accepted.

Why the error is changed in place rather than raised: docs/design.md §57. The callback is registered
at import and kept across ``torch._dynamo.reset()`` (``dynamo_scope.keep_compile_end_callback``).
"""

from __future__ import annotations

import os
import re
import sys

import torch
import torch.fx

from optpass.capture import rooted_path
from optpass.dynamo_scope import _is_optpass_backend, keep_compile_end_callback
from optpass.errors import OptpassError, node_user_line, user_line_from_frames, warn_at_user_line

aten = torch.ops.aten

_NORM_FILES = (f"nn{os.sep}modules{os.sep}batchnorm.py", f"nn{os.sep}modules{os.sep}instancenorm.py")
_NORM_FUNCTIONS = ("batch_norm", "instance_norm")
FIX = ("DP-SGD cannot use it (Opacus's ModuleValidator refuses it too). Replace each BatchNorm with GroupNorm "
       "(nn.GroupNorm(num_groups, num_channels), e.g. 32 or fewer groups dividing the channels), LayerNorm or "
       "InstanceNorm without running statistics: opacus.validators.ModuleValidator.fix(model) swaps every "
       "BatchNorm for a GroupNorm; a BatchNorm in eval mode (model.eval() on it, fixed statistics) mixes no "
       "samples and is accepted")


class DPSGDModelWarning(UserWarning):
    """A DP-SGD step compiled by optpass does something Opacus would not, or keeps a per-sample gradient
    materialized: a parameter that does not require grad is differentiated (it enters every clip factor
    and gets a ``.grad``), or a weight has no rewrite (a transposed convolution, a position table, a
    norm spelled in a way the pass cannot read). Warned once per compile at the user's line; filter it
    with ``warnings.filterwarnings("ignore", category=optpass.DPSGDModelWarning)``. A ``UserWarning``."""


def refuse_batch_norm_in_vmaps() -> None:
    """Register the Dynamo compile-end callback that turns a BatchNorm's failure under ``torch.func``
    into an ``OptpassError``, for optpass compiles only; kept across ``torch._dynamo.reset()``."""
    keep_compile_end_callback(_refuse_batch_norm)


def _refuse_batch_norm(_args) -> None:
    error = sys.exc_info()[1]
    if not isinstance(error, RuntimeError) or isinstance(error, OptpassError) or not _compiling_for_optpass():
        return
    frames = list(getattr(error, "real_stack", None) or ())
    text = str(error)
    in_norm = any(frame.filename.endswith(_NORM_FILES) for frame in frames) or any(
        f"<function {name} at" in text for name in _NORM_FUNCTIONS)
    under_functorch = "grad (vjp, jvp, grad, etc) transform" in text or "BatchedTensor(" in text \
        or "GradTrackingTensor(" in text
    if not (in_norm and under_functorch):
        return
    where = user_line_from_frames(frames)
    layer = "an InstanceNorm with track_running_stats=True" if any(
        frame.filename.endswith(_NORM_FILES[1]) for frame in frames) else "a BatchNorm layer"
    module = _traced_norm_module(error)
    if module is not None:
        layer = f"{layer}, {module},"
    _become_optpass_error(error, (
        f"optpass: {layer} in a per-sample gradient step (torch.func.vmap(grad(...)))"
        + (f", called at {where}" if where else "")
        + ": in training mode it normalizes with statistics over the batch and updates running statistics "
        f"in place, which mixes samples and which torch.func cannot do per sample. {FIX}.\n\n"
        f"torch's error: {text.splitlines()[0] if text else type(error).__name__}"))


def _module_stack_path(text: str) -> str:
    """An ``nn_module_stack`` entry's path, ``getattr(G['model'], '1')``, as ``model.1``."""
    while (nested := re.fullmatch(r"getattr\((.*), '([^']+)'\)", text)) is not None:
        text = f"{nested.group(1)}._modules['{nested.group(2)}']"
    return rooted_path(text)


def _traced_norm_module(error: BaseException) -> str | None:
    """``model.1 (BatchNorm2d(4, ...))``: the module whose forward Dynamo was tracing when ``error``
    was raised (the innermost translator of a batchnorm.py / instancenorm.py forward on the error's
    traceback), named by its path from the step's variable; None where it cannot be found."""
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase

    found = None
    traceback = error.__traceback__
    while traceback is not None:
        for name in ("self", "tx"):
            tracer = traceback.tb_frame.f_locals.get(name)
            if isinstance(tracer, InstructionTranslatorBase) and tracer.f_code.co_filename.endswith(_NORM_FILES):
                variable = tracer.symbolic_locals.get("self")
                module = getattr(variable, "value", None)
                if isinstance(module, torch.nn.Module):
                    source = getattr(variable, "source", None)
                    path = rooted_path(source.name) if source is not None else None
                    found = f"{path} ({module})" if path else repr(module)
        traceback = traceback.tb_next
    return found


def _become_optpass_error(error: RuntimeError, message: str) -> None:
    """Make the error Dynamo is raising an ``OptpassError`` with ``message``, in place: a compile-end
    callback must not raise (Dynamo would leave its pending-callback count up and refuse every later
    ``torch._dynamo.reset()``), so the error's class becomes one that derives from both."""
    kind = _AS_OPTPASS_ERROR.get(type(error))
    if kind is None:
        kind = type(f"OptpassError_{type(error).__name__}", (OptpassError, type(error)),
                     {"__module__": __name__, "__str__": OptpassError.__str__})
        _AS_OPTPASS_ERROR[type(error)] = kind
    error.__class__ = kind
    error.first_useful_frame = None                  # what ShortenTraceback's handlers read
    error.message = message
    error.args = (message,)


_AS_OPTPASS_ERROR: dict[type, type] = {}


def _compiling_for_optpass() -> bool:
    """Is the compile whose end this is, on this thread, one for an optpass backend? (Dynamo's
    ``_compile`` frame, still on the stack while its callbacks run, holds the backend.)"""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_compile" and "compiler_fn" in frame.f_locals:
            return _is_optpass_backend(frame.f_locals["compiler_fn"])
        frame = frame.f_back
    return False


def refuse_batch_norm_nodes(step) -> None:
    """Refuse a DP-SGD step that normalizes with batch statistics (a BatchNorm in training mode), read
    off Dynamo's graph (``F.batch_norm`` / ``torch.batch_norm`` with ``training=True``; an
    InstanceNorm calls ``instance_norm``), where every lowering still sees the call.

    Raises:
        OptpassError: naming the user's line and the fix (GroupNorm, LayerNorm, InstanceNorm).
    """
    gm = step.captured.gm
    if gm is None:
        return
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function" or node.target not in (torch.nn.functional.batch_norm, torch.batch_norm):
                continue
            training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False)
            if training is not True:
                continue
            where = node_user_line(node)
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            module = f", {_module_stack_path(stack[-1][0])} ({getattr(stack[-1][1], '__name__', stack[-1][1])})," \
                if stack else ""
            raise OptpassError(
                f"optpass: a BatchNorm in training mode{module} in a per-sample gradient step (torch.func.vmap(grad(...)))"
                + (f" at {where}" if where else "")
                + ": it normalizes with statistics of the batch (under vmap, of each sample alone: a different "
                f"model than the one you train without DP). {FIX}.")


def differentiated_parameters(captured) -> list[str] | None:
    """The parameters that ``torch.func.grad`` differentiates in this step (Dynamo's
    ``_autograd_grad`` inputs, traced back through functorch's wrapping and ``detach``), in
    parameter order; None where the Dynamo graph is not at hand or has no such call."""
    gm = captured.gm
    if gm is None:
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_node = {placeholders[p.input_index]: p.name for p in captured.params if p.input_index is not None}
    calls = [n for n in gm.graph.nodes if n.op == "call_function"
             and getattr(n.target, "__name__", "") == "_autograd_grad" and len(n.args) >= 2]
    if not calls:
        return None
    found = set()
    for call in calls:
        for node in call.args[1] if isinstance(call.args[1], (list, tuple)) else ():
            while isinstance(node, torch.fx.Node) and node not in by_node and node.args and _unwraps(node):
                node = node.args[0]
            if node in by_node:
                found.add(by_node[node])
    return [p.name for p in captured.params if p.name in found]


def _unwraps(node: torch.fx.Node) -> bool:
    """functorch's grad wrapping of a tensor, or a detach/alias of it: the same parameter's value."""
    name = getattr(node.target, "__name__", "") if node.op == "call_function" else node.target
    return name in ("_wrap_for_grad", "detach", "alias", "_set_tensor_requires_grad", "requires_grad_")


def _under_vmap(captured) -> bool:
    return captured.gm is not None and any(
        getattr(n.target, "__name__", "") == "_vmap_increment_nesting" for n in captured.gm.graph.nodes)


FROZEN_FIX = ("Differentiate the trainable ones: {k: v.detach() for k, v in model.named_parameters() "
              "if v.requires_grad} (docs/dp_sgd.md)")


def warn_frozen_parameters_differentiated(captured) -> None:
    """Warn (``DPSGDModelWarning``, at the user's line) when a per-sample gradient step
    (``vmap(grad(...))``) differentiates parameters that do not require grad, naming them."""
    differentiated = (differentiated_parameters(captured) or ()) if _under_vmap(captured) else ()
    frozen = [p.name for p in captured.params if p.name in differentiated
              and p.tensor is not None and not p.tensor.requires_grad]
    if frozen:
        warn_at_user_line(
            f"optpass: the DP-SGD step differentiates parameters that do not require grad: {', '.join(frozen)}. "
            "Their per-sample gradients enter every norm and clip factor (Opacus clips the trainable "
            f"parameters only) and they get a .grad. {FROZEN_FIX}", DPSGDModelWarning)
