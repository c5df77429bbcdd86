"""Pass legality: prove a requested rewrite legal on the captured step, or refuse it.

Precondition: a step graph (Dynamo level, where each parameter's raw gradient
is exactly ``autograd.grad(...)[i]`` and every node still carries the user's
source line), and a request for a rewrite that moves parameter updates
(optimizer_in_backward).

Proof, by dataflow rather than by pattern lists: every value after the traced
``autograd.grad`` is labelled with the set of parameters whose raw gradient
flows into it. Ordinary ops take the union of their inputs' labels; in-place
ops (``g.mul_(c)``, ``torch._foreach_mul_(grads, c)``) add the labels of their
other inputs to what they write, per list element for ``_foreach`` ops, so the
analysis sees mutation the way the program means it. A parameter's update may
run inside backward only if the gradient that becomes its ``.grad`` is labelled
with that parameter alone.

Refuses, with the user's source line, why, and what to do instead:
* any gradient that depends on another parameter's gradient: global
  ``clip_grad_norm_``, GradScaler's unscale/found_inf, any custom global-norm
  transform (they fail the test by construction, not by name); a
  ``clip_grad_norm_`` call is told the fix, the ``clip_grad_norm`` option with the
  call's max_norm (read off its traced ops);
* pipeline- or expert-parallel collectives in the graph (send/recv,
  all_to_all), or ``pipeline_parallel_degree`` / ``expert_parallel_degree`` > 1
  in the options;
* a step whose backward ran outside the graph (it cannot be proved on a step it
  could not see, docs/design.md §4).

``check_grad_scaler`` (options grad_scaler) proves, on the same labels, that the
step hands ``opt.step()`` its raw gradients (code between backward and the update
would see scaled ones) and refuses fp16 parameters without master_weights, gradient
accumulation with optimizer_in_backward and a GradScaler called in the step (naming the
option instead); a micro-step without ``opt.step()`` scales its backward.

    step graph                                   labels
      g0, g1 = autograd.grad(loss, [w0, w1])     g0:{w0}  g1:{w1}
      n = stack([norm(g0), norm(g1)]).norm()     n:{w0,w1}   <- clip_grad_norm_ (user line)
      g0.mul_(1/n); g1.mul_(1/n)                 g0:{w0,w1} -> refused
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import operator
import os
import traceback

import torch
import torch.fx

from optpass.capture import (OPTIMIZER_SPLIT, SUPPORTED_SHAPE, CapturedGraph, GraphKind, backward_outside_message,
                             is_existing_gradient, readable_source, source_name)
from optpass.errors import (OptpassError, SourceLine, node_user_line, stack_frames, user_line_from_frames,
                            warn_at_user_line)
from optpass.optim.elementwise import non_elementwise_ops
from optpass.options import optimizers_of
from optpass.precision.masters import step_outside_message
from optpass.tensor_parallel import context_parallel_active, context_parallel_message, has_partial, is_dtensor, placements_text, sharded

_PARALLEL_COLLECTIVE_NAMES = ("send", "recv", "all_to_all", "alltoall")


def check_optimizer_in_backward(captured: CapturedGraph, options) -> None:
    """Raise OptpassError unless every fused parameter's update depends on its own gradient only."""
    for degree in ("pipeline_parallel_degree", "expert_parallel_degree"):
        if getattr(options, degree, 1) > 1:
            raise OptpassError(
                f"optimizer_in_backward is not supported with {degree}={getattr(options, degree)}: "
                "pipeline and expert parallelism split or reroute a parameter's gradient across "
                "ranks and micro-batches, so it is not final inside this step's backward. "
                "Drop optimizer_in_backward for this model, or train it without pipeline/expert parallelism.")
    _refuse_backward_outside(captured, "optimizer_in_backward")
    if captured.kind is not GraphKind.STEP:
        return
    _refuse_unseen_gradient_transforms(captured, "optimizer_in_backward", options.optimizer)
    _refuse_parallel_collectives(captured.gm.graph)
    _refuse_coupled_gradients(captured, options.clip_grad_norm)
    if options.accumulation_steps == 1 and not ends_at_optimizer_step(captured):
        _refuse_update_without_optimizer_step(captured)


def check_hyperparameter_writes(captured: CapturedGraph, fused: bool) -> None:
    """A step that writes an optimizer's tensor hyper-parameter in place (``group["lr"].fill_(v)``).

    Before backward(), Dynamo drops the step's traced backward from the graph (the parameters did not
    move at all, with or without optpass's rewrites, under any backend once backward is traced). With
    a fused update (``fused``) any write is refused: the update reads the hyper-parameters when the
    step starts, so a write after backward() would reach it one step late."""
    if captured.kind is GraphKind.UPDATE:
        return
    nodes = list(captured.gm.graph.nodes)
    backward = next((n for n in nodes if n.op == "call_function" and n.target is torch.autograd.grad), None)
    if backward is None:
        # No backward traced: harmless alone (a function that sets the lr), but in a graph that also runs
        # the model's forward Dynamo dropped the step's backward (measured: no autograd.grad, no update)
        if not any(isinstance(v := n.meta.get("example_value"), torch.Tensor) and v.requires_grad
                   for n in nodes if n.op != "placeholder"):
            return
        backward = nodes[-1]
    order = {n: i for i, n in enumerate(nodes)}
    for node in nodes:
        source = source_name(node) if node.op == "placeholder" else None
        if source is None or "param_groups" not in source:
            continue
        for user in node.users:
            name = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", "")
            writes = name.endswith("_") and not name.endswith("__") and user.args and user.args[0] is node
            if writes and (fused or order[user] < order[backward]):
                where = node_user_line(user)
                what = readable_source(source)
                why = ("before backward(), where Dynamo then drops the step's backward from the graph: the "
                       "parameters get no gradient and do not move" if order[user] < order[backward] else
                       "after backward(), where the update fused into backward has already read it: it would "
                       "apply one step late")
                raise OptpassError(
                    f"the compiled step writes {what} in place ({name}{f' at {where}' if where else ''}), {why}. "
                    "Fix: change it outside the compiled step, before calling it (an LR scheduler's "
                    "sched.step(), or opt.param_groups[0]['lr'].fill_(v) between steps): the next step reads it.")


def _refuse_update_without_optimizer_step(captured: CapturedGraph) -> None:
    """A compiled step that does not call opt.step() must not update: eager PyTorch would leave its
    gradients in .grad (a micro-step of gradient accumulation), the fused update would apply them."""
    where = f" (backward() at {captured.backward_line})" if captured.backward_line else ""
    raise OptpassError(
        f"optimizer_in_backward: this compiled step does not call opt.step(){where}, yet its backward would "
        "update the parameters and drop their gradients; eager PyTorch keeps them in .grad (a micro-step of "
        "gradient accumulation). Fix: for gradient accumulation, compile this micro-step with "
        "options={..., 'optimizer_in_backward': True, 'accumulation_steps': K}: optpass applies the update "
        "at the K-th call of each window, and no step function with opt.step() is needed. Otherwise "
        f"call the optimizer in the compiled step: `{SUPPORTED_SHAPE}`.")


def _refuse_backward_outside(captured: CapturedGraph, feature: str) -> None:
    """A rewrite that needs backward in the graph is never proved on a step whose backward is not."""
    if captured.kind is GraphKind.FORWARD:
        if (captured.split_caller is not None or captured.later_break is not None   # not the step shape
                or captured.forward_outside is not None
                or captured.split_source_unread):                                   # or cannot tell
            message = backward_outside_message(captured).removeprefix("optpass: ")
            raise OptpassError(f"{feature} needs backward() inside the compiled step. {message[0].upper()}{message[1:]}")
        where = f" ({captured.split_line})" if captured.split_line else ""
        if "GradScaler." in (captured.split_reason or ""):
            raise OptpassError(grad_scaler_in_step_message(captured, feature))
        returned = "returned tensor's grad_fn" in (captured.split_reason or "")
        cause = (" A tensor of the forward that the step returns or reads after opt.step() (loss, logits, a "
                 "model output) still holds its autograd graph: detach every value to return before "
                 "opt.step() (`logits = logits.detach()` beside `out = loss.detach()`)." if returned else "")
        raise OptpassError(
            f"{feature} needs backward() inside the compiled step, but the step stops "
            f"before it{where} because of: {captured.split_reason}.{cause} Fix the step shape: "
            f"`{SUPPORTED_SHAPE}`.")


def grad_scaler_in_step_message(captured: CapturedGraph, feature: str) -> str:
    where = f" ({captured.split_line})" if captured.split_line else ""
    return (
        f"{feature} needs backward() inside the compiled step, but the step stops before it{where} "
        f"because of: {captured.split_reason}. The step shape is not the cause: torch.amp.GradScaler "
        "cannot be traced. Give the scaler to optpass instead, and write the plain step: "
        "options={'optimizer': opt, 'grad_scaler': scaler, ...} with "
        f"`{SUPPORTED_SHAPE}` (no scaler.scale/step/update in it). optpass then scales backward, "
        "unscales the gradients, skips the step on inf/nan and updates the scale inside the compiled "
        "step, with GradScaler's semantics; the scale stays in your scaler (scaler.get_scale(), "
        "scaler.state_dict()).")


def check_grad_scaler(captured: CapturedGraph, options) -> None:
    """grad_scaler: the update runs in the step graph on unscaled gradients and is skipped on inf/nan.
    Prove the step hands opt.step() its raw gradients: code between backward() and opt.step() would
    see scaled gradients (eager GradScaler users call scaler.unscale_(opt) before it)."""
    fp16 = any(p.dtype == torch.float16 for g in options.optimizer.param_groups for p in g["params"])
    if fp16 and options.master_weights is None:
        raise OptpassError(
            "grad_scaler with float16 parameters needs master_weights=torch.float32: GradScaler does not "
            "unscale fp16 gradients (eagerly it raises 'Attempting to unscale FP16 gradients'), since the "
            "unscaled values underflow fp16. Use options={'optimizer': opt, 'master_weights': torch.float32, "
            "'grad_scaler': scaler} (Megatron's fp16 training), or fp32 parameters with "
            "torch.autocast(device, dtype=torch.float16) around the forward.")
    _refuse_backward_outside(captured, "grad_scaler")
    in_optimizer = {id(p) for g in options.optimizer.param_groups for p in g["params"]}
    if captured.kind is GraphKind.UPDATE:
        fed = [p.name for p in captured.params
               if p.name in captured.gradient_inputs and id(p.tensor) in in_optimizer]
        if fed:
            raise OptpassError(
                f"grad_scaler: opt.step() was called with gradients on {len(fed)} parameter(s) outside the "
                "step compiled with options={'grad_scaler': scaler}: they are scaled gradients that would "
                "update the parameters unscaled and unchecked. Call opt.step() inside that compiled step, "
                "after loss.backward().")
    if captured.kind is not GraphKind.STEP:
        return
    _refuse_unseen_gradient_transforms(captured, "grad_scaler", options.optimizer)
    # Without optimizer_in_backward a step without opt.step() is a micro-step of gradient
    # accumulation: it scales its backward and leaves the scaled gradients in .grad
    # (runtime/scaled_micro_step.py); the next whole step unscales and checks their sum.
    if options.optimizer_in_backward and captured.accumulating:
        raise OptpassError(
            "grad_scaler with optimizer_in_backward: this step accumulates into existing .grad tensors "
            f"({', '.join(sorted(captured.accumulating)[:3])}), which the update inside backward would "
            "unscale and check one micro-step at a time. Gradient accumulation with grad_scaler needs the "
            "update after backward: drop optimizer_in_backward, compile the micro-steps (backward without "
            "opt.step()) and the step with the same options.")
    transform = _first_gradient_transform(captured)
    if transform is not None:
        where = node_user_line(transform)
        raise OptpassError(
            f"grad_scaler refused: the step transforms gradients before opt.step() at "
            f"{where or transform.name}. With grad_scaler the gradients there are still scaled (eager "
            "GradScaler code calls scaler.unscale_(opt) first). For global-norm clipping remove "
            "clip_grad_norm_ from the step and pass options={..., 'clip_grad_norm': max_norm}: optpass "
            "clips the unscaled gradients (fp32 with master_weights), after the inf/nan check; otherwise "
            "remove the transform (e.g. scale the loss instead).")


def _first_gradient_transform(captured: CapturedGraph) -> torch.fx.Node | None:
    """The first op between backward() and the step graph's end that reads a gradient, other than
    Dynamo's copy of each gradient into .grad."""
    labels, _ = gradient_labels(captured)
    return next((node for node in captured.gm.graph.nodes
                 if node in labels and not _is_gradient_plumbing(node)), None)


def _refuse_unseen_gradient_transforms(captured: CapturedGraph, feature: str, optimizer=None) -> None:
    """A step graph must end at opt.step() or at return: a graph break after backward() hides
    whatever it does to the gradients (GradScaler's unscale_, a custom transform) from the proof."""
    if captured.split_reason is None or captured.split_reason.startswith(OPTIMIZER_SPLIT):
        return
    # a list of optimizers (options.OptimizerList): the first member whose step() was traced inline
    inline, optimizer = next(((line, member) for member in optimizers_of(optimizer)
                              if (line := _optimizer_step_traced_inline(captured, member)) is not None),
                             (None, optimizer))
    if inline is not None:
        cls = type(optimizer).__name__
        raise OptpassError(
            f"{feature} refused: {cls}.step() ran inside the compiled step's graph (at {inline}), and "
            f"the graph ended later, at {captured.split_line}. optpass takes an optimizer's update from "
            "a graph of its own, which every torch.optim optimizer makes by breaking the graph where its "
            "step() begins (its @torch.optim.optimizer._use_grad_for_differentiable); this optimizer's "
            f"step() has no such break. Add torch._dynamo.graph_break() as the first line of "
            f"{cls}.step() ({inline.file}:{_step_code(optimizer).co_firstlineno}; a no-op outside torch.compile), or "
            f"drop {feature}.")
    raise OptpassError(
        f"{feature} refused: the compiled step ends after backward() at "
        f"{captured.split_line}, because of: {captured.split_reason}. What runs after that point "
        "(e.g. GradScaler.unscale_, a gradient transform with .item()) could change or couple the "
        "gradients, and optpass does not prove a rewrite on code it cannot see. Make everything "
        "between loss.backward() and opt.step() compile (no graph breaks), or drop "
        f"{feature}.")


def _optimizer_step_traced_inline(captured: CapturedGraph, optimizer) -> SourceLine | None:
    """The user's line inside ``type(optimizer).step`` that a node of the step graph came from:
    Dynamo traced that step into the graph (a user-defined optimizer without torch.optim's break)."""
    code = _step_code(optimizer)
    if code is None or code.co_filename.startswith(os.path.dirname(torch.__file__) + os.sep):
        return None
    lines = {line for _, _, line in code.co_lines() if line is not None}
    for node in captured.gm.graph.nodes:
        for frame in stack_frames(node.meta.get("stack_trace")):
            if frame.file == code.co_filename and frame.function == code.co_name and frame.line in lines:
                return frame
    return None


def _step_code(optimizer):
    """The code of the optimizer class's own step(), under torch.optim's profiling wrapper."""
    return getattr(inspect.unwrap(type(optimizer).step), "__code__", None)


def ends_at_optimizer_step(captured: CapturedGraph) -> bool:
    """The step graph stops where opt.step() begins (torch.optim is always a graph of its own)."""
    return captured.split_reason is not None and captured.split_reason.startswith(OPTIMIZER_SPLIT)


def check_master_weights(captured: CapturedGraph, options) -> None:
    """master_weights applies every update inside the step graph (from the gradients it returns):
    refuse a step whose backward, or whatever follows it before opt.step(), the graph does not hold."""
    _refuse_backward_outside(captured, "master_weights")
    if captured.kind is GraphKind.STEP:
        _refuse_unseen_gradient_transforms(captured, "master_weights", options.optimizer)
    if captured.kind is GraphKind.UPDATE:
        # opt.step() with gradients present: the fused step left none, so they come from elsewhere
        # (a compiled micro-step) and this update would bypass the masters
        in_optimizer = {id(p) for g in options.optimizer.param_groups for p in g["params"]}
        fed = [p.tensor for p in captured.params
               if p.name in captured.gradient_inputs and id(p.tensor) in in_optimizer]
        if fed:
            raise OptpassError(step_outside_message(fed))


def _refuse_parallel_collectives(graph: torch.fx.Graph) -> None:
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", str(node.target)).lower()
        if any(c in name for c in _PARALLEL_COLLECTIVE_NAMES):
            where = node_user_line(node)
            raise OptpassError(
                f"optimizer_in_backward refused: the step contains a pipeline/expert-parallel "
                f"collective ({name}) at {where or node.name}. Such collectives move activations or "
                "gradients between ranks, so a parameter's gradient is not known to be final where "
                "backward produces it. Drop optimizer_in_backward for this step.")


def gradient_labels(captured: CapturedGraph) -> tuple[dict[torch.fx.Node, frozenset[str]], dict]:
    """Label each node after autograd.grad with the parameters whose raw gradient flows into it.

    Returns (labels of each gradient output node by parameter name, the node
    where each label set first grew beyond one parameter).
    """
    graph = captured.gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    param_of_node = {placeholders[p.input_index]: p.name for p in captured.params}
    labels: dict[torch.fx.Node, frozenset[str]] = {}
    element_labels: dict[torch.fx.Node, list[frozenset[str]]] = {}
    first_mix: dict[frozenset[str], torch.fx.Node] = {}

    def label_of(value) -> frozenset[str]:
        found: set[str] = set()
        torch.fx.node.map_arg(value, lambda n: found.update(labels.get(n, ())))
        return frozenset(found)

    def set_label(node, new, at=None):
        # `at`: the op that did it, when `node` is written in place (its line is the user's
        # `p.grad.add_(...)`, not the backward() that made the gradient)
        labels[node] = new
        if len(new) > 1:
            first_mix.setdefault(new, at if at is not None else node)

    for node in graph.nodes:
        if node.op != "call_function" and node.op != "call_method":
            continue
        if node.target is torch.autograd.grad:
            inputs = node.args[1] if len(node.args) > 1 else node.kwargs["inputs"]
            element_labels[node] = [frozenset([param_of_node[i]]) if i in param_of_node else frozenset()
                                    for i in inputs]
            continue
        if node.target is operator.getitem and node.args[0] in element_labels:
            set_label(node, element_labels[node.args[0]][node.args[1]])
            continue
        incoming = label_of((node.args, node.kwargs))
        if _is_foreach(node):
            _label_foreach(node, labels, element_labels, label_of, set_label)
        elif _is_inplace(node) and isinstance(node.args[0], torch.fx.Node):
            target = node.args[0]
            if not incoming and target not in labels:
                continue             # no gradient flows into it (BatchNorm's num_batches_tracked.add_(1))
            set_label(target, labels.get(target, frozenset()) | incoming, at=node)
            set_label(node, labels[target])
        elif incoming:
            set_label(node, incoming)
    return labels, first_mix


def _is_foreach(node: torch.fx.Node) -> bool:
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name.startswith("_foreach_")


def _is_inplace(node: torch.fx.Node) -> bool:
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.endswith("__") or node.target in (operator.iadd, operator.imul,
                                                                              operator.isub, operator.itruediv)


def _label_foreach(node, labels, element_labels, label_of, set_label) -> None:
    """_foreach ops work per list index: element k reads element k of every list argument."""
    lists = [a for a in node.args if isinstance(a, (list, tuple))]
    scalars = [a for a in node.args if not isinstance(a, (list, tuple))]
    shared = label_of((scalars, node.kwargs))
    length = len(lists[0]) if lists else 0
    per_element = [shared | label_of([lst[k] for lst in lists if k < len(lst)]) for k in range(length)]
    name = node.target if isinstance(node.target, str) else node.target.__name__
    if name.endswith("_") and lists:            # in place: writes the first list, element by element
        for target, label in zip(lists[0], per_element):
            if isinstance(target, torch.fx.Node):
                set_label(target, labels.get(target, frozenset()) | label, at=node)
    else:                                        # returns a new list: getitem k reads element k
        element_labels[node] = per_element
    for label in per_element:
        if len(label) > 1:
            set_label(node, label)


def _refuse_coupled_gradients(captured: CapturedGraph, clip_option: float | None = None) -> None:
    labels, first_mix = gradient_labels(captured)
    output = next(n for n in reversed(captured.gm.graph.nodes) if n.op == "output")
    for name, index in captured.gradient_outputs.items():
        gradient = output.args[0][index]
        label = labels.get(gradient, frozenset())
        others = sorted(label - {name})
        if not others:
            continue
        culprit = first_mix.get(label) or next(
            (node for mixed, node in first_mix.items() if mixed <= label and len(mixed) > 1), None)
        where = node_user_line(culprit) if culprit is not None else None
        clip = _clip_grad_norm_call(captured, culprit)
        what_to_do = (_clip_grad_norm_fix(clip, clip_option) if clip is not None else
                      "What to do: keep the global transform (clip_grad_norm_, GradScaler, ...) and drop "
                      "optimizer_in_backward, or remove the transform (per-parameter transforms such as "
                      "p.grad.mul_(c) or per-parameter clipping stay legal).")
        raise OptpassError(
            f"optimizer_in_backward refused: the gradient of {name!r} depends on the gradients of "
            f"other parameters ({', '.join(others[:3])}{' ...' if len(others) > 3 else ''}), "
            f"combined at {where or (culprit.name if culprit is not None else 'an unknown node')}. "
            "Fusing each update into backward would apply it before the other gradients exist "
            "(torchtitan's optimizer-in-backward silently made clip_grad_norm_ a no-op this way). "
            + what_to_do)


@dataclasses.dataclass(frozen=True)
class _ClipCall:
    """A torch.nn.utils.clip_grad_norm_ traced into the step: the arguments read off its ops."""

    max_norm: float | None          # None: not a constant (a tensor)
    norm_type: float


_CLIP_GRAD_FILE = os.path.join("torch", "nn", "utils", "clip_grad.py")


def _clip_grad_norm_call(captured: CapturedGraph, culprit: torch.fx.Node | None) -> _ClipCall | None:
    """The clip_grad_norm_ call (or get_total_norm + clip_grads_with_norm_) that computed `culprit`;
    None if torch's clip_grad.py did not, or clipped nothing. max_norm is the constant its
    ``max_norm / (total_norm + 1e-6)`` divides, norm_type the order of its ``vector_norm``/``_foreach_norm``."""
    def functions(node):
        return {f.function for f in stack_frames(node.meta.get("stack_trace")) if f.file.endswith(_CLIP_GRAD_FILE)}

    if culprit is None or not functions(culprit):
        return None
    clips, max_norm, norm_type = False, None, 2.0
    norms = ("linalg_vector_norm", "_foreach_norm")
    for node in captured.gm.graph.nodes:
        called = functions(node)
        clips = clips or "_clip_grads_with_norm_" in called
        if max_norm is None and "_clip_grads_with_norm_" in called and node.target is operator.truediv \
                and isinstance(node.args[0], (int, float)):
            max_norm = node.args[0]
        if "_get_total_norm" in called and getattr(node.target, "__name__", "") in norms \
                and len(node.args) > 1 and isinstance(node.args[1], (int, float)):
            norm_type = float(node.args[1])
    return _ClipCall(max_norm, norm_type) if clips else None


def _clip_grad_norm_fix(clip: _ClipCall, clip_option: float | None) -> str:
    """What to do about a clip_grad_norm_ in a step with optimizer_in_backward: the clip_grad_norm
    option, spelled with the call's max_norm."""
    if clip_option is not None:
        return (f"What to do: options 'clip_grad_norm': {clip_option!r} already clips by the global norm "
                "inside backward; remove the clip_grad_norm_ call from the step (optpass.grad_norm(opt) "
                "gives the norm it returned).")
    max_norm = repr(clip.max_norm) if clip.max_norm is not None else "max_norm"
    spelled = f"options={{..., 'optimizer_in_backward': True, 'clip_grad_norm': {max_norm}}}"
    if clip.norm_type != 2.0:
        return (f"What to do: the option 'clip_grad_norm' clips by the 2-norm and this call uses "
                f"norm_type={clip.norm_type:g}: keep the call and drop optimizer_in_backward, or clip by "
                f"the 2-norm with {spelled} instead of the call.")
    return (f"What to do: remove the clip_grad_norm_ call from the step and pass {spelled}: optpass clips "
            "by the global norm inside backward (clip_grad_norm_'s formula, from a norm-only first "
            "backward), and optpass.grad_norm(opt) gives the norm the call returned. Or keep the call "
            "and drop optimizer_in_backward.")


def check_zero1(captured: CapturedGraph, options) -> None:
    """data_parallel='zero1' averages raw gradients across ranks inside the update: prove the step
    hands it raw gradients (the ops between backward() and opt.step() would see this rank's
    gradients only, where DDP's would see averaged ones), and only gradients of the optimizer's
    parameters (any other would keep this rank's own)."""
    _refuse_backward_outside(captured, "data_parallel='zero1'")
    if captured.kind is not GraphKind.STEP:
        return
    _refuse_unseen_gradient_transforms(captured, "data_parallel='zero1'", options.optimizer)
    _refuse_parallel_collectives(captured.gm.graph)
    _refuse_gradients_outside_the_optimizer(captured, options)
    # Gradient accumulation (after backward only): a micro-step (backward, no opt.step()) keeps this
    # rank's gradients in .grad, as DDP's no_sync() does; the step that follows adds its own to them
    # and averages the sums across ranks (shard_optimizer reads old + new, gradient_value).
    if options.optimizer_in_backward and captured.accumulating:
        raise OptpassError(
            "data_parallel='zero1' with optimizer_in_backward: this step accumulates into existing .grad "
            f"tensors ({', '.join(sorted(captured.accumulating)[:3])}), which the update inside backward "
            "would average and apply one micro-step at a time. Gradient accumulation with zero1 needs the "
            "update after backward: drop optimizer_in_backward, and compile the micro-steps (backward "
            "without opt.step()) and the step with the same options.")
    labels, _ = gradient_labels(captured)
    for node in captured.gm.graph.nodes:
        if node not in labels or _is_gradient_plumbing(node):
            continue
        where = node_user_line(node)
        raise OptpassError(
            f"data_parallel='zero1' refused: the step transforms gradients before opt.step() at "
            f"{where or node.name}. zero1 averages gradients across ranks inside the update, so this "
            "code would see one rank's gradients, not the averaged ones DDP gives it (clipping would "
            "clip the wrong norm). For global-norm clipping remove clip_grad_norm_ from the step and "
            "pass options={..., 'clip_grad_norm': max_norm}; otherwise remove the transform (e.g. "
            "scale the loss instead), or train without data_parallel.")


def check_fsdp(captured: CapturedGraph, options) -> None:
    """data_parallel='fsdp': the gradients the step sees are this rank's shards, averaged over the
    ranks. A transform that works element by element on one gradient is right on a shard
    (``p.grad.mul_(0.5)``, a clamp); one that reduces a gradient or mixes parameters (a norm,
    ``clip_grad_norm_``, a sum) would see 1/N of each gradient, so it is refused with its line."""
    _refuse_backward_outside(captured, "data_parallel='fsdp'")
    if captured.kind is not GraphKind.STEP:
        return
    _refuse_unseen_gradient_transforms(captured, "data_parallel='fsdp'", options.optimizer)
    _refuse_parallel_collectives(captured.gm.graph)
    shapes = {p.name: tuple(p.tensor.shape) for p in captured.params if p.tensor is not None}
    labels, _ = gradient_labels(captured)
    for node in captured.gm.graph.nodes:
        if node not in labels or _is_gradient_plumbing(node):
            continue
        label = labels[node]
        value = node.meta.get("example_value")
        shard_shape = shapes.get(next(iter(label))) if len(label) == 1 else None
        if shard_shape is not None and isinstance(value, torch.Tensor) and tuple(value.shape) == shard_shape:
            continue
        where = node_user_line(node)
        raise OptpassError(
            f"data_parallel='fsdp' refused: the step computes on gradients at {where or node.name} in a way "
            "that reads a whole gradient or mixes parameters (a norm, a sum, clip_grad_norm_). Under fsdp "
            "each rank holds 1/N of every gradient (its shard, averaged over the ranks), so this code would "
            "see one rank's part only. Element-by-element transforms of p.grad are fine (p.grad.mul_, "
            "clamp_). For global-norm clipping remove clip_grad_norm_ and pass options={..., "
            "'clip_grad_norm': max_norm} (the norm of every rank's shards, the update in or after backward); "
            "otherwise remove the transform (scale the loss instead).")


def _refuse_gradients_outside_the_optimizer(captured, options) -> None:
    """DDP averages the gradient of every trainable parameter; zero1 averages the optimizer's (in its
    update). Another trainable parameter would keep this rank's gradient in .grad, a different one
    on every rank: refused, with the fix."""
    in_optimizer = {id(p) for group in options.optimizer.param_groups for p in group["params"]}
    by_name = captured.param_by_name
    outside = [name for name in captured.gradient_outputs
               if name in by_name and id(by_name[name].tensor) not in in_optimizer]
    if outside:
        raise OptpassError(
            f"data_parallel='zero1': parameter(s) {', '.join(outside[:3])}{' ...' if len(outside) > 3 else ''} "
            f"get gradients in this step but are not in the optimizer ({len(outside)} in all). zero1 "
            "averages across ranks the gradients its optimizer updates; these would keep this rank's "
            "gradient in .grad (DDP would average them), and an optimizer of their own stepped in the step "
            "(Muon beside AdamW) would update them from this rank's gradient. Freeze what you do not train "
            "(p.requires_grad_(False): it also saves their backward), or put them in the optimizer "
            "(another param group for other settings), or list their optimizer: options={'optimizer': "
            "[opt, other_opt], ...} (each one elementwise: zero1 shards the state of each).")


def _is_gradient_plumbing(node: torch.fx.Node) -> bool:
    """getitem of autograd.grad's result, Dynamo's empty_like(p).copy_(g) into p.grad, and, for
    gradient accumulation, an existing p.grad (an input) and Dynamo's p.grad.add_(that copy)."""
    if node.op == "placeholder":
        return is_existing_gradient(node)
    if node.target is operator.getitem:
        return getattr(node.args[0], "target", None) is torch.autograd.grad
    if node.target is torch.empty_like:
        return True
    if node.target in ("copy_", torch.Tensor.copy_) and isinstance(node.args[0], torch.fx.Node):
        return node.args[0].target is torch.empty_like and node.args[1].target is operator.getitem
    if node.target in ("add_", torch.Tensor.add_) and isinstance(node.args[0], torch.fx.Node):
        return (is_existing_gradient(node.args[0]) and len(node.args) == 2 and not node.kwargs
                and getattr(node.args[1], "target", None) in (torch.empty_like, operator.getitem))
    return False


_WARNED_UNLISTED: set[tuple[str, int] | None] = set()


def check_tensor_parallel(captured: CapturedGraph, options) -> None:
    """Parameters that are DTensors (``parallelize_module``'s tensor and sequence parallelism): the
    step trains on each rank's local tensors, with DTensor's collectives in the graph
    (``optpass/tensor_parallel.py``). Refused, with the reason and what works: torch's context
    parallelism (its ring attention), a parameter that is a partial sum, data_parallel over a
    tensor-parallel model, and an update that mixes a sharded parameter's elements (Muon, Adafactor:
    each rank would update its shard as if it were the whole parameter). torch's FSDP2 holds DTensors
    too, but Dynamo never compiles its forward into the step (backward runs eagerly, docs/design.md
    §49): refused or warned where that is found."""
    if captured.forward_outside is not None:
        return                      # refused or warned with the wrapper that ran the forward (FSDP2, DDP)
    if context_parallel_active():      # any graph: one compiled beside it would run SDPA the same way
        raise OptpassError(context_parallel_message())
    dtensors = {p.name: p.tensor for p in captured.params if is_dtensor(p.tensor)}
    if not dtensors:
        return
    partial = [name for name, t in dtensors.items() if has_partial(t)]
    if partial:
        raise OptpassError(
            f"tensor parallelism: parameter(s) {', '.join(partial[:3])} are DTensors with a Partial placement "
            f"({placements_text(dtensors[partial[0]])}): each rank's local tensor is a part of a sum, not a value "
            "an optimizer can update. Distribute parameters as Shard(dim) or Replicate() (parallelize_module's "
            "ColwiseParallel / RowwiseParallel / SequenceParallel do).")
    if options.data_parallel is not None:
        raise OptpassError(
            f"data_parallel={options.data_parallel!r} over a tensor-parallel model whose parameters are DTensors "
            f"({', '.join(list(dtensors)[:3])}): "
            + ("optpass.fully_shard was not called on it. FSDP + tensor parallel is a 2-D mesh: mesh = "
               "init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')); parallelize_module(model, "
               "mesh['tp'], plan); optpass.fully_shard(block, mesh=mesh['dp']) for each block, then "
               "optpass.fully_shard(model, mesh=mesh['dp']); then build the optimizer."
               if options.data_parallel == "fsdp" else
               "zero1 shards flat buckets of plain parameters and is not built for tensor-parallel ones. Use "
               "data_parallel='fsdp' on a 2-D mesh (optpass.fully_shard(block, mesh=mesh['dp']) over the plan on "
               "mesh['tp']), or tensor parallelism alone."))
    if captured.kind is not GraphKind.STEP or options.optimizer is None:
        return
    names = {id(t): name for name, t in dtensors.items()}
    for member in optimizers_of(options.optimizer):
        shards = [names[id(p)] for g in member.param_groups for p in g["params"]
                  if id(p) in names and sharded(p)]
        found = non_elementwise_ops(member, options.master_weights) if shards else []
        if found:
            name = shards[0]
            raise OptpassError(
                f"tensor parallelism: {type(member).__name__}'s update is not elementwise (it computes "
                f"{', '.join(found[:4])} over a whole parameter), and parameter {name} is sharded "
                f"({placements_text(dtensors[name])}): each rank would update its local shard as if it were "
                f"the whole parameter. Train the sharded parameters with an elementwise optimizer (SGD, Adam, "
                f"AdamW, ...), or keep {name} replicated in the tensor-parallel plan, or train without optpass's "
                "fused update (no 'optimizer' in options).")


def check_every_update_is_handled(captured: CapturedGraph, options) -> None:
    """An optimizer's ``step()`` compiled in the step (an update graph) over parameters that no
    optimizer of ``options['optimizer']`` holds: optpass neither fuses, shards nor checks that update.

    Under data_parallel the update would run on this rank's shard of each parameter (fsdp; zero1
    refuses such parameters at the step graph): an update that reads a whole parameter (Muon's
    Newton-Schulz on this rank's rows) computes something else, silently. Refused, with the fix.
    On one device it runs after backward as written: warned once per line, with the fix."""
    if captured.kind is not GraphKind.UPDATE or options.optimizer is None:
        return
    held = {id(p) for group in options.optimizer.param_groups for p in group["params"]}
    by_name = captured.param_by_name
    stepped = [name for name in captured.gradient_inputs
               if name in by_name and id(by_name[name].tensor) not in held]
    if not stepped:
        return
    where = _optimizer_step_line(captured)
    at = f" at {where}" if where is not None else ""
    names = f"{', '.join(stepped[:3])}{' ...' if len(stepped) > 3 else ''}"
    listed = repr(options.optimizer) if hasattr(options.optimizer, "optimizers") else type(options.optimizer).__name__
    stepper = _class_of_optimizer_holding(by_name[stepped[0]].tensor, options.optimizer)
    what = f"{stepper}{at}, an optimizer that is not in options['optimizer'] (which holds {listed}),"
    if options.data_parallel is not None:
        raise OptpassError(
            f"data_parallel={options.data_parallel!r}: {what} steps parameter(s) {names}: optpass neither shards "
            "nor checks its update, which would run on this rank's shard of each parameter: an update that reads "
            "a whole parameter (Muon's Newton-Schulz, Adafactor's factored moments) computes something else there. "
            "Put it in the list, options={'optimizer': [opt, other_opt], ...}: an elementwise optimizer (SGD, "
            "AdamW, ...) is then sharded, one that is not is refused with the reason. To train those parameters "
            "with Muon, train without data_parallel.")
    if options.clip_grad_norm is not None:
        raise OptpassError(
            f"clip_grad_norm: {what} steps parameter(s) {names}: options 'clip_grad_norm' clips the gradients of "
            f"the optimizers in options['optimizer'] only, by the norm of those alone: this optimizer's gradients "
            "would go unclipped and be left out of the norm. List both optimizers: options={'optimizer': "
            "[opt, other_opt], 'clip_grad_norm': max_norm, ...} (each parameter in one of them); the norm and "
            "the clipping then cover every listed optimizer's gradients, as clip_grad_norm_(model.parameters()).")
    key = (where.file, where.line) if where is not None else None
    if key in _WARNED_UNLISTED:
        return
    _WARNED_UNLISTED.add(key)
    warn_at_user_line(
        f"optpass: {what} steps parameter(s) {names}: "
        "optpass does not handle its update, which runs after backward as written (their gradients stay "
        "alive until then, and no option of optpass applies to it). Put it in the list: "
        "options={'optimizer': [opt, other_opt], ...} (each parameter in one of them).", UserWarning, where)


def _class_of_optimizer_holding(param: torch.Tensor, listed) -> str:
    """The class name of the live torch.optim optimizer, other than those listed, whose param_groups
    hold `param` (the update graph's sources name the optimizer only by Dynamo's frame variables,
    gone by now): one pass over the objects the garbage collector tracks, on this refusal or warning's
    path only. "an optimizer" if none is found."""
    skip = {id(o) for o in optimizers_of(listed)}
    for obj in gc.get_objects():
        if (issubclass(type(obj), torch.optim.Optimizer) and id(obj) not in skip
                and any(p is param for group in obj.param_groups for p in group["params"])):
            return type(obj).__name__
    return "an optimizer"


def _optimizer_step_line(captured: CapturedGraph) -> SourceLine | None:
    """The user's line that called the optimizer's step() an update graph comes from: the innermost
    user frame of the graph that calls ``.step(`` (the step's own line, not a line inside a
    user-defined optimizer), else the innermost user frame calling this compile."""
    for node in captured.gm.graph.nodes:
        frames = stack_frames(node.meta.get("stack_trace"))
        calls = [f for f in frames if ".step(" in f.code and _is_user_frame(f)]
        if calls:
            return calls[-1]
    # the step graph-broke before step(): Dynamo compiles the optimizer's step as a frame of its own,
    # called from the user's line, which is on the stack while it compiles
    return user_line_from_frames(traceback.extract_stack())


def _is_user_frame(frame: SourceLine) -> bool:
    return user_line_from_frames([traceback.FrameSummary(frame.file, frame.line, frame.function,
                                                         line=frame.code)]) is not None
