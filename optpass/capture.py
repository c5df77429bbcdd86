"""Capture: what Dynamo hands the backend, and the role of each of its values.

A training step compiles into several Dynamo graphs (docs/design.md §1-§3):

* a **step** graph: forward + ``torch.autograd.grad`` (the traced
  ``loss.backward()``) + gradient transforms; each new gradient is an output
  that Dynamo assigns to ``p.grad`` after the graph runs;
* a **forward** graph: forward only, when ``backward()`` graph-broke (docs/design.md §4);
  the backward then runs from eager autograd, outside optpass's reach;
* a **model** graph: a forward with no ``backward()`` in the compiled code (the model
  compiled alone, an evaluation): nothing to warn of or rewrite;
* an **update** graph: ``optimizer.step()``; gradients are placeholders
  (``param_groups[g]['params'][i].grad``), parameters and optimizer state are
  ``get_attr`` tensors mutated in place;
* anything else (epilogues such as ``loss.detach()``).

``capture(gm)`` classifies a Dynamo graph and names its values: parameters by
module path (``layers.0.attn.wq.weight``, parsed from Dynamo's sources; prefixed with
the step's variable, ``G.0.weight``, where two models' paths coincide), which
output is which parameter's gradient, which update-graph placeholder is which
parameter's gradient. Parameters are remembered by identity across graphs, so
the update graph's gradients are linked to the step graph's outputs.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import enum
import inspect
import linecache
import os
import re
import sys
import textwrap
import traceback
import warnings
from typing import Any

import torch
import torch.fx
from torch.utils.weak import WeakIdKeyDictionary

from optpass import dynamo_scope
from optpass.errors import OptpassError, SourceLine, node_user_line, user_line_from_frames, warn_at_user_line

# Names of parameters seen in step graphs, by tensor identity, so that an
# update graph (where parameters appear as `param_groups[g]['params'][i]`)
# reports the same module-path names.
_PARAM_NAMES: WeakIdKeyDictionary = WeakIdKeyDictionary()
_WARNED_LINES: set[tuple[str, int]] = set()
# Update-graph compiles per optimizer (keyed by its parameters' identities).
_UPDATE_COMPILES: dict[tuple[int, ...], int] = {}
_WARNED_UPDATES: set[tuple[int, ...]] = set()


def enable_backward_capture() -> None:
    """Make Dynamo trace `loss.backward()` into an optpass step's graph (docs/design.md §1), skip
    logging calls in the code it compiles (§5) and drop its note on torch.optim's record_function:
    each only while Dynamo traces for an optpass backend (optpass/dynamo_scope.py), so every other
    compile in the process behaves as if optpass were not loaded."""
    dynamo_scope.install()


def ignore_logging_calls() -> None:
    """Calls of logging.Logger's message methods in code an optpass compile traces are skipped, not
    graph breaks (again, if someone replaced Dynamo's ignore set since)."""
    dynamo_scope.install()


class GraphKind(str, enum.Enum):
    """What a Dynamo graph of a compiled step holds (a ``str`` enum: ``GraphKind.STEP == "step"``).

    Attributes:
        STEP: forward + backward (+ gradient transforms).
        FORWARD: forward only; a graph break before backward() put backward outside the graph.
        MODEL: a forward with no backward() in the compiled code (a model compiled alone).
        UPDATE: optimizer.step().
        OTHER: anything else.
    """

    STEP = "step"          # forward + backward (+ gradient transforms)
    FORWARD = "forward"    # forward only; a graph break before backward() put it outside the graph
    MODEL = "model"        # a forward with no backward() in the compiled code (a model compiled alone)
    UPDATE = "update"      # optimizer.step()
    OTHER = "other"


@dataclasses.dataclass
class Parameter:
    name: str
    tensor: torch.Tensor | None      # None in a report's light copy (see without_tensors)
    input_index: int | None = None   # flat placeholder index (step/forward graphs)
    attr: str | None = None          # get_attr target (update graphs)
    nbytes: int = 0

    def __post_init__(self) -> None:
        if self.tensor is not None:
            self.nbytes = self.tensor.numel() * self.tensor.element_size()


@dataclasses.dataclass
class CapturedGraph:
    """One Dynamo graph and the roles of its values."""

    gm: torch.fx.GraphModule | None     # None in a report's light copy
    kind: GraphKind
    compile_id: str
    split_reason: str | None              # why Dynamo ended the graph here (a graph break), if it did
    split_line: SourceLine | None         # where it broke: the innermost frame outside torch
    backward_line: SourceLine | None      # the user's loss.backward() line
    params: list[Parameter]
    # step graphs: parameter name -> index of the Dynamo output that becomes p.grad
    gradient_outputs: dict[str, int] = dataclasses.field(default_factory=dict)
    # step graphs: parameter names whose output accumulates into an existing .grad
    accumulating: set[str] = dataclasses.field(default_factory=set)
    # update graphs: parameter name -> placeholder index of p.grad
    gradient_inputs: dict[str, int] = dataclasses.field(default_factory=dict)
    # update graphs: get_attr targets of optimizer-state tensors
    state_attrs: list[str] = dataclasses.field(default_factory=list)
    # update graphs: placeholder index -> Dynamo source of a hyper-parameter input (e.g. lr)
    hyperparameter_inputs: dict[int, str] = dataclasses.field(default_factory=dict)
    # a break inside a function the compiled step calls (the model's forward, a library):
    # the step's own line that called into it; None when the break is in the step's own code
    split_caller: SourceLine | None = None
    # a break after backward() that a returned tensor lived across, which made Dynamo break at
    # backward() instead (Tensor.item(), print, ...): Dynamo's reason; None when there was none
    # or it was torch.optim's own break (the step shape)
    later_break: str | None = None
    # the break's source line could not be read (a script on stdin, some REPLs): optpass cannot
    # tell the step shape from a break in code the step calls
    split_source_unread: bool = False
    # an nn.RNN/GRU/LSTM met since the previous graph for which Dynamo skipped the function around it
    # (inside torch.func's vmap/grad), which ran eagerly: Dynamo's description of the module; None if none
    skipped_recurrent: str | None = None
    # forward graphs that end at a backward() Dynamo did not trace because the loss's forward ran
    # outside the frame: what ran it there (FSDP2, DDP, a graph break in the model); None otherwise
    forward_outside: str | None = None
    # a backward() declined in a frame that held nothing before it (so no graph ended there), seen
    # at the next graph captured: that backward's forward-kind view, for the warning and the refusal
    backward_declined: "CapturedGraph | None" = None
    # seconds optpass spent naming the graph's values and checking it before lowering (progress)
    checks_seconds: float = 0.0

    @property
    def param_by_name(self) -> dict[str, Parameter]:
        return {p.name: p for p in self.params}

    @property
    def dynamo_ops(self) -> int:
        return self._dynamo_ops if self.gm is None else sum(
            1 for n in self.gm.graph.nodes if n.op.startswith("call"))

    def without_tensors(self) -> "CapturedGraph":
        """A copy that keeps names and counts but no graph or tensors (for the report log)."""
        light = dataclasses.replace(
            self, gm=None, params=[dataclasses.replace(p, tensor=None) for p in self.params])
        light._dynamo_ops = self.dynamo_ops
        return light

    def roles_digest(self) -> str:
        """A stable summary of the roles (part of the Inductor cache key of a rewrite)."""
        return repr((self.kind.value, sorted((p.name, p.input_index, p.attr) for p in self.params),
                     sorted(self.gradient_outputs.items()), sorted(self.accumulating),
                     sorted(self.gradient_inputs.items())))


# ---------------------------------------------------------------- names

_ROOT = re.compile(r"^[LG]\['([^']*)'\]")
_CLOSURE_CELL = re.compile(r"^.*\.cell_contents")
_PART = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]|\.(\w+)|\['([^']+)'\]|\[(\d+)\]")


def module_path(source: str) -> str:
    """`G['model']._modules['0']._parameters['weight']` -> `0.weight`."""
    rest = _CLOSURE_CELL.sub("", _ROOT.sub("", source))      # a model a nested function closes over
    parts = [next(g for g in m.groups() if g is not None) for m in _PART.finditer(rest)]
    return ".".join(parts) if parts else source


def rooted_path(source: str) -> str:
    """`G['model']._modules['0']._parameters['weight']` -> `model.0.weight` (the step's variable first)."""
    root = _ROOT.match(source)
    path = module_path(source)
    if root is None or path == source:
        return source
    return f"{root.group(1)}.{path}"


def readable_source(source: str) -> str:
    """`G['opt'].param_groups[0]['lr']` -> `opt.param_groups[0]['lr']` (as the step's code spells it)."""
    return _ROOT.sub(r"\1", source)


def source_name(node: torch.fx.Node) -> str | None:
    """Dynamo's source of a placeholder (``G['model']._modules['0']._parameters['weight']``), if any."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    return source.name if source is not None else None


def _example(node: torch.fx.Node) -> Any:
    grapharg = node.meta.get("grapharg")
    if grapharg is not None:
        return grapharg.example
    return node.meta.get("example_value")


# ---------------------------------------------------------------- capture

def capture(gm: torch.fx.GraphModule) -> CapturedGraph:
    """Classify a Dynamo graph and name the roles of its values."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    grad_calls = [n for n in nodes if n.op == "call_function" and n.target is torch.autograd.grad]
    reason = getattr(gm, "compile_subgraph_reason", None)
    split = reason if reason is not None and reason.graph_break else None
    compile_id = str(gm.meta.get("dynamo_compile_id", "?"))

    breaks = _graph_breaks_since_last_capture()
    common = dict(
        gm=gm, compile_id=compile_id,
        split_reason=_split_reason(split) if split else None,
        split_line=user_line_from_frames(split.user_stack) if split else None,
        split_caller=_calling_step_line(split) if split else None,
        later_break=_later_break(split, breaks) if split else None,
        split_source_unread=bool(split and _source_unread(split)),
        skipped_recurrent=_skipped_recurrent(breaks),
    )
    # the breaks of the model's code (Dynamo's counters; a graph before a break inside a nested call
    # does not reach optpass as split) and of this graph, for a message about a forward broken off
    _RECENT_BREAKS.extend((_first_lines(b), None) for b in breaks
                          if not b.startswith((_BACKWARD_WITHOUT_LEAVES, _LEAKED_GRAD_FN)) and _TORCH_DIR not in b)
    if split is not None and not common["split_reason"].startswith((OPTIMIZER_SPLIT, _BACKWARD_WITHOUT_LEAVES,
                                                                      _LEAKED_GRAD_FN)):
        _RECENT_BREAKS.append((common["split_reason"], common["split_line"]))
    if grad_calls:
        return _capture_step(placeholders, grad_calls, nodes, **common)
    if any(_is_grad_source(source_name(p)) and "param_groups" in (source_name(p) or "") for p in placeholders):
        return _capture_update(placeholders, **common)
    params = _parameters_of(placeholders)
    outputs_need_grad = any(
        isinstance(v, torch.Tensor) and v.requires_grad for v in _output_examples(nodes))
    kind = GraphKind.OTHER
    if params and outputs_need_grad:
        # ended by a graph break: backward() was in the compiled code and Dynamo left it out;
        # ended by its return: a forward compiled alone (the model, an evaluation), nothing to warn of
        kind = GraphKind.FORWARD if split else GraphKind.MODEL
    forward_outside, declined = None, dynamo_scope.take_declined_backward()
    if split is not None and split.reason.startswith(_BACKWARD_WITHOUT_LEAVES):
        # backward() of a loss whose forward ran outside this frame (optpass/dynamo_scope.py)
        kind, forward_outside = GraphKind.FORWARD, _forward_outside(declined)
        declined = None
    backward_line = common["split_line"] if kind is GraphKind.FORWARD else None
    captured = CapturedGraph(kind=kind, backward_line=backward_line, params=params,
                             forward_outside=forward_outside, **common)
    if declined is not None:
        # ... whose frame held nothing before backward(): no graph ended there, this one follows it
        line = SourceLine(declined.file, declined.line, declined.function,
                          linecache.getline(declined.file, declined.line))
        captured.backward_declined = dataclasses.replace(
            captured, kind=GraphKind.FORWARD, split_line=line, backward_line=line, split_caller=None,
            later_break=None, split_reason=_BACKWARD_WITHOUT_LEAVES, forward_outside=_forward_outside(declined))
    return captured


# Dynamo's break at a backward() that optpass's scoped trace_autograd_ops declined to trace: the
# frame holds no parameter (docs/design.md §49)
_BACKWARD_WITHOUT_LEAVES = "Unsupported Tensor.backward() call"


def _forward_outside(declined) -> str:
    """What computed a loss outside the frame that calls its backward(): torch.distributed's wrappers
    the frame reaches (their forward is never compiled into the step), else a graph break in the model
    (the last one Dynamo met, with its reason and line, where one reached optpass)."""
    wrappers = declined.wrappers if declined is not None else ()
    if not wrappers:
        if not _RECENT_BREAKS:
            return _AFTER_A_BREAK
        reason, line = _RECENT_BREAKS[-1]
        return f"{_AFTER_A_BREAK} (the last: {reason}{f', at {line}' if line else ''})"
    return f"the forward of modules wrapped by {' and '.join(wrappers)}, which Dynamo does not compile into the step"


_AFTER_A_BREAK = "the model's forward, broken off by a graph break inside it"
# a break whose reason names a file of torch itself (a compiled function Dynamo met) is not the model's
_TORCH_DIR = os.path.dirname(torch.__file__)
# the last graph breaks of the user's code (not torch.optim's, not at backward()) that reached optpass
_RECENT_BREAKS: collections.deque = collections.deque(maxlen=4)


OPTIMIZER_SPLIT = "optimizer.step()"
# Dynamo's graph-break counter at the last capture, and its counts then
_breaks_seen: tuple[Any, dict[str, int]] = (None, {})
_LEAKED_GRAD_FN = "autograd.grad consumed returned tensor's grad_fn"
# torch.optim's own breaks (its step wrapper calls torch._dynamo.graph_break(); a parameter whose
# .grad the same graph set is a pending mutation): the tutorial step shape, not a user's break
_OPTIMIZER_BREAKS = ("Call to `torch._dynamo.graph_break()`", "pending mutation")


def _graph_breaks_since_last_capture() -> list[str]:
    """Dynamo's reasons for the graph breaks it met since the previous graph reached optpass.

    Dynamo counts each break's reason (``counters['graph_break']``) as it traces; a frame whose
    first trace broke after backward() with ``loss`` still alive is traced again with the break
    moved to backward(), and both reasons are counted before the first graph reaches the backend."""
    global _breaks_seen
    counter = torch._dynamo.utils.counters["graph_break"]
    last_counter, seen = _breaks_seen
    if last_counter is not counter:                     # someone cleared Dynamo's counters: a new one
        seen = {}
    _breaks_seen = (counter, dict(counter))
    return [reason for reason, count in counter.items() if count > seen.get(reason, 0)]


def _later_break(split, breaks: list[str]) -> str | None:
    """The break after backward() that made Dynamo move a break to backward(), if it was the user's."""
    if not split.reason.startswith(_LEAKED_GRAD_FN):
        return None
    others = [b for b in breaks if not b.startswith(_LEAKED_GRAD_FN)]
    if not others or any(marker in b for b in others for marker in _OPTIMIZER_BREAKS):
        return None
    return "; ".join(_first_lines(b) for b in others)


_RECURRENT = "Attempted to wrap RNN, GRU, or LSTM"
_SKIPPED_FRAME = "Skipping frame"
_MODULE_CONTEXT = re.compile(r"Developer debug context: ((?:RNN|GRU|LSTM)\(.*\))")


def _skipped_recurrent(breaks: list[str]) -> str | None:
    """Dynamo's description of an nn.RNN/GRU/LSTM it refused and, for it, skipped the whole function
    around it (as inside torch.func's vmap/grad, which cannot break the graph), e.g.
    ``LSTM(5, 8, batch_first=True)``; None if no such break was met."""
    recurrent = [b for b in breaks if b.startswith(_RECURRENT) and _SKIPPED_FRAME in b]
    if not recurrent:
        return None
    found = _MODULE_CONTEXT.search(recurrent[0])
    return found.group(1) if found else "an nn.RNN, GRU or LSTM"


def _first_lines(reason: str) -> str:
    """Dynamo's reason in one line: its title, and its explanation where the title is generic."""
    lines = [line.strip() for line in reason.strip().splitlines()]
    explanation = next((line.removeprefix("Explanation:").strip() for line in lines
                        if line.startswith("Explanation:")), "")
    return f"{lines[0]} ({explanation.rstrip('.')})" if explanation else lines[0]


def _split_reason(split) -> str:
    optim_dir = f"torch{os.sep}optim{os.sep}"
    if optim_dir in split.reason or any(optim_dir in frame.filename for frame in split.user_stack):
        return OPTIMIZER_SPLIT + " (torch.optim always compiles as a graph of its own)"
    first = split.reason.strip().splitlines()[0]
    skipped = _SKIPPED_FUNCTION.search(split.reason)
    if skipped and "marked as skipped" in first:
        return f"{first}: `{skipped.group(1)}` (Dynamo does not trace it)"
    return first


# Dynamo's explanation of a call it will not trace (torch.amp's GradScaler, some library code)
_SKIPPED_FUNCTION = re.compile(r"marked that the function `([^`]+)`")


def _calling_step_line(split) -> SourceLine | None:
    """For a break in code the step calls (the model's forward, a library), the user's line
    that called into it; None for a break at the step's own backward() (the step shape).

    Dynamo compiles the broken function as a frame of its own, so the break's stack holds that
    function only; the caller is the innermost user frame on the stack that is compiling it."""
    if not split.user_stack or "backward(" in (split.user_stack[-1].line or "") or _source_unread(split):
        return None
    if any(f"torch{os.sep}optim{os.sep}" in f.filename for f in split.user_stack):
        return None
    inner = split.user_stack[-1]
    callers = [f for f in traceback.extract_stack()[:-1]
               if (f.filename, f.lineno) != (inner.filename, inner.lineno)]
    return user_line_from_frames(callers)


def _source_unread(split) -> bool:
    """The break's own source line is unreadable (``<stdin>``, some REPLs): which call broke is unknown."""
    return bool(split.user_stack) and not (split.user_stack[-1].line or "").strip()


def _is_grad_source(name: str | None) -> bool:
    return name is not None and name.endswith(".grad")


def is_existing_gradient(node: torch.fx.Node) -> bool:
    """An input of the graph that is a parameter's existing ``.grad`` (the step accumulates into it)."""
    return node.op == "placeholder" and _is_grad_source(source_name(node))


def module_buffers(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """The registered module buffers the graph reads (BatchNorm's running statistics, a rotary
    table), by the path from the step's variable (``model.1.running_mean``)."""
    found = {}
    for node in gm.graph.nodes:
        source = source_name(node) if node.op == "placeholder" else None
        example = _example(node) if source is not None else None
        if "._buffers[" in (source or "") and isinstance(example, torch.Tensor):
            found[rooted_path(source)] = example
    return found


def models_read(gm: torch.fx.GraphModule) -> dict[str, torch.nn.Module]:
    """The outermost modules behind the graph's parameters and buffers, by the step's expression for
    them (``model``, ``self.model``), read from the frame Dynamo is compiling: so that a caller can
    reach what the graph does not read (a buffer read only in evaluation). Empty outside a Dynamo
    compile; a source Dynamo spells with its own helpers stops at the last module reached before it."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:           # no frame is being compiled
        return {}
    found: dict[int, tuple[str, torch.nn.Module]] = {}
    for node in gm.graph.nodes:
        source = getattr(node.meta.get("grapharg"), "source", None) if node.op == "placeholder" else None
        chain = []
        while source is not None:
            chain.append(source)
            source = getattr(source, "base", None)
        cache: dict = {}
        for part in reversed(chain):        # from the frame's variable outward to the tensor
            scope = {"G": tx.f_globals, "L": tx.f_locals}
            try:
                value = part.get_value(scope, dict(scope), cache)
            except Exception:  # noqa: BLE001  (a helper of Dynamo's guards: no module reached this way)
                break
            if isinstance(value, torch.nn.Module):
                found.setdefault(id(value), (readable_source(part.name), value))
                break
    return {name: module for name, module in found.values()}


def _parameters_of(placeholders: list[torch.fx.Node]) -> list[Parameter]:
    """The graph's parameters, each named by a path unique among them (see ``unique_names``)."""
    found = [(index, node, _example(node)) for index, node in enumerate(placeholders)
             if isinstance(_example(node), torch.nn.Parameter)]
    names = unique_names([source_name(node) or node.name for _, node, _ in found])
    params = []
    for (index, _, example), name in zip(found, names):
        _PARAM_NAMES[example] = name
        params.append(Parameter(name, example, input_index=index))
    return params


def unique_names(sources: list[str]) -> list[str]:
    """Names for the parameters behind Dynamo sources, one per parameter: the module path
    (``0.weight``, what ``model.named_parameters()`` calls it) where that path is unique among
    them, else the path from the step's frame (``G.0.weight`` and ``D.0.weight`` for two models
    whose layers share names), else the source itself. Every role (gradient, state, master,
    shard) is keyed by this name, so two parameters must never share one."""
    short = [module_path(s) for s in sources]
    rooted = [rooted_path(s) for s in sources]
    names = [n if short.count(n) == 1 else r for n, r in zip(short, rooted)]
    return [n if names.count(n) == 1 else s for n, s in zip(names, sources)]


def _output_examples(nodes: list[torch.fx.Node]) -> list[Any]:
    output = nodes[-1]
    return [a.meta.get("example_value") if isinstance(a, torch.fx.Node) else None
            for a in torch.fx.node.map_aggregate(output.args[0], lambda a: a) or ()]


def _capture_step(placeholders, grad_calls, nodes, **common) -> CapturedGraph:
    params = _parameters_of(placeholders)
    _refuse_post_accumulate_grad_hooks(params)
    by_node = {placeholders[p.input_index]: p for p in params}
    by_source = {source_name(placeholders[p.input_index]): p for p in params}
    gradient_outputs, accumulating = {}, set()
    for index, value in enumerate(nodes[-1].args[0]):
        if not isinstance(value, torch.fx.Node):
            continue
        if value.op == "call_function" and value.target is torch.empty_like and value.args[0] in by_node:
            gradient_outputs[by_node[value.args[0]].name] = index       # first gradient: new tensor
        elif value.op == "placeholder" and _is_grad_source(source_name(value)):
            param = by_source.get(source_name(value)[: -len(".grad")])
            if param is not None:                                         # accumulation: .grad.add_(g)
                gradient_outputs[param.name] = index
                accumulating.add(param.name)
    return CapturedGraph(
        kind=GraphKind.STEP, params=params, backward_line=node_user_line(grad_calls[0]),
        gradient_outputs=gradient_outputs, accumulating=accumulating, **common)


def _refuse_post_accumulate_grad_hooks(params: list[Parameter]) -> None:
    hooked = [p.name for p in params if getattr(p.tensor, "_post_accumulate_grad_hooks", None)]
    if hooked:
        # a traced backward skips these hooks (docs/design.md §6)
        raise OptpassError(
            f"parameter(s) {', '.join(hooked)} have post-accumulate-grad hooks "
            "(Tensor.register_post_accumulate_grad_hook). When backward() is traced into the "
            "compiled step these hooks do not run, so training would silently "
            "differ. Remove the hooks (for optimizer-in-backward use "
            "options={'optimizer_in_backward': True}), or run this step without torch.compile.")


def _capture_update(placeholders, gm, **common) -> CapturedGraph:
    params, state_attrs = [], []
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target, None)
        if isinstance(value, torch.nn.Parameter):
            params.append(Parameter(_PARAM_NAMES.get(value, node.target), value, attr=node.target))
        elif isinstance(value, torch.Tensor):
            state_attrs.append(node.target)
    # names from step graphs are unique within each step graph; an optimizer may hold parameters
    # that no single step graph named together: those keep their attribute names
    taken = [p.name for p in params]
    params = [p if taken.count(p.name) == 1 else dataclasses.replace(p, name=p.attr) for p in params]
    gradient_inputs, hyperparameters = {}, {}
    for index, node in enumerate(placeholders):
        source, example = source_name(node) or "", _example(node)
        if _is_grad_source(source):
            owner = next((p for p in params if p.tensor.grad is example), None)
            if owner is not None:
                gradient_inputs[owner.name] = index
        elif "param_groups" in source:
            hyperparameters[index] = source
    return CapturedGraph(
        kind=GraphKind.UPDATE, backward_line=None, params=params, gradient_inputs=gradient_inputs,
        state_attrs=state_attrs, hyperparameter_inputs=hyperparameters, gm=gm, **common)


def warn_backward_outside(captured: CapturedGraph) -> None:
    """Warn once per source line that backward() runs outside the compiled step (docs/design.md §4)."""
    where = captured.split_line
    key = (where.file, where.line) if where else ("?", 0)
    if key in _WARNED_LINES:
        return
    _WARNED_LINES.add(key)
    warn_at_user_line(backward_outside_message(captured), BackwardOutsideGraphWarning, where)


class RecompilingUpdateWarning(UserWarning):
    """optimizer.step() compiles again for every new float hyper-parameter value.

    Warned once per optimizer, at the third compile of its update with the hyper-parameters
    baked in as constants (after Dynamo's recompile limit the optimizer would run eagerly); the
    message gives the fix (a tensor lr is a graph input). A ``UserWarning``.
    """


def warn_if_update_recompiles(captured: CapturedGraph) -> None:
    """An LR scheduler with a float lr that Dynamo specializes recompiles the update every step.

    After 8 recompiles Dynamo silently runs the optimizer eagerly; say so on the
    third compile of the same optimizer, with the fix (a tensor lr is a graph input, docs/design.md §18, §34).
    Two compiles are normal (the first step creates the optimizer's state), and
    Dynamo turns a changed float into an input once if it can (then the graph has
    a hyper-parameter input and nothing is wrong).
    """
    if captured.kind is not GraphKind.UPDATE:
        return
    optimizer_key = tuple(sorted(id(p.tensor) for p in captured.params))
    _UPDATE_COMPILES[optimizer_key] = compiles = _UPDATE_COMPILES.get(optimizer_key, 0) + 1
    if compiles < 3 or captured.hyperparameter_inputs or optimizer_key in _WARNED_UPDATES:
        return
    _WARNED_UPDATES.add(optimizer_key)
    warn_at_user_line(
        f"optpass: optimizer.step() is being compiled for the {compiles}{_ordinal_suffix(compiles)} time, "
        "with its hyper-parameters baked in as constants: a float lr that an LR "
        "scheduler changes makes every step recompile, and after torch._dynamo.config."
        "recompile_limit recompiles the optimizer silently runs eagerly. Fix: give the optimizer "
        "a tensor lr, e.g. torch.optim.SGD(model.parameters(), lr=torch.tensor(0.01)); schedulers "
        "update it in place and the update graph reads it as an input.",
        RecompilingUpdateWarning)


def _ordinal_suffix(n: int) -> str:
    return "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


class BackwardOutsideGraphWarning(UserWarning):
    """backward() graph-broke: the step's backward runs from eager autograd, not in optpass's graph.

    Warned once per source line, at the user's line, with the reason for the break and the fix,
    unless the option ``warn_on_graph_break`` is False. A ``UserWarning``.
    """


class RecurrentLayerFallbackWarning(BackwardOutsideGraphWarning):
    """An nn.RNN/GRU/LSTM inside ``torch.func.vmap(grad(...))`` (a DP-SGD step): Dynamo does not trace
    it, and skips the whole function around the vmap, which runs eagerly, uncompiled.

    Warned once per module description, with the fix (Opacus's ``DPLSTM``/``DPGRU``/``DPRNN``); a
    ``BackwardOutsideGraphWarning`` (the per-sample backward runs outside optpass's graph).
    """


_WARNED_RECURRENT: set[str] = set()
_OPACUS_LAYER = {"LSTM": "DPLSTM", "GRU": "DPGRU", "RNN": "DPRNN"}


def warn_recurrent_fallback(captured: CapturedGraph) -> None:
    """Warn once per module that an nn.RNN/GRU/LSTM under torch.func made Dynamo skip a function."""
    module = captured.skipped_recurrent
    if module is None or module in _WARNED_RECURRENT:
        return
    _WARNED_RECURRENT.add(module)
    layer = _OPACUS_LAYER.get(module.split("(")[0], "DPLSTM")
    warn_at_user_line(
        f"optpass: Dynamo does not trace {module} (torch.nn's RNN, GRU and LSTM) and skipped the whole "
        "function it was called from (inside torch.func.vmap/grad the graph cannot break around it): that "
        "function ran eagerly, uncompiled, outside anything optpass can see or rewrite; in a DP-SGD step, "
        "the per-sample gradients, their norms, clipping and noise (no per_sample_grad_norm). Fix: replace "
        "the layer with Opacus's drop-in "
        f"opacus.layers.{layer} (the same arguments and state_dict, made of nn.Linear layers), which "
        "compiles and is rewritten; torch._dynamo.config.allow_rnn=True does not trace it under vmap(grad).",
        RecurrentLayerFallbackWarning)


class OptimizerStepInLoopWarning(BackwardOutsideGraphWarning):
    """``for opt in optimizers: opt.step()`` in the compiled step: torch.optim's step() breaks the
    graph, Dynamo cannot resume a graph inside a loop, and it runs the whole step uncompiled
    (forward and backward from eager autograd); only each step() is compiled, as a graph of its own.

    Warned once per loop, at the loop's line, with the fix (each optimizer stepped on its own
    line, the optimizers listed in options); a ``BackwardOutsideGraphWarning``. Under
    data_parallel it is an error: each rank's update would read its own gradients.
    """


_WARNED_LOOPS: set[tuple[str, int]] = set()


def warn_optimizer_step_in_loop(captured: CapturedGraph, options) -> None:
    """An update graph compiled while the user's step that called it runs uncompiled, from a
    for/while loop around that ``.step(`` call: say so (see ``OptimizerStepInLoopWarning``)."""
    if captured.kind is not GraphKind.UPDATE:
        return
    found = _uncompiled_loop_calling_step()
    if found is None:
        return
    loop, call = found
    message = (
        f"optpass: the compiled step calls an optimizer's step() inside a loop, at {call} (the loop: "
        f"`{loop.code.strip()}`, line {loop.line}). torch.optim's step() breaks the graph, and Dynamo cannot resume a graph "
        "inside a for/while loop: it runs the whole step function uncompiled (forward and backward from "
        "eager autograd, outside anything optpass can see or rewrite) and compiles only each step(). Fix: "
        "step each optimizer on its own line (`opt_a.step()`, `opt_b.step()`, then the zero_grad() calls) "
        "and list them in options: options={'optimizer': [opt_a, opt_b], ...} (each parameter in one).")
    if options.data_parallel is not None:
        raise OptpassError(
            f"data_parallel={options.data_parallel!r} refused: {message.removeprefix('optpass: ')} Under "
            "data_parallel each rank's update would read its own gradients (no averaging): the ranks "
            "would drift apart.")
    key = (loop.file, loop.line)
    if key in _WARNED_LOOPS or not options.warn_on_graph_break:
        return
    _WARNED_LOOPS.add(key)
    warn_at_user_line(message, OptimizerStepInLoopWarning, loop)


def _uncompiled_loop_calling_step() -> tuple[SourceLine, SourceLine] | None:
    """The innermost user frame on the stack (the code that called the optimizer's step()), if its
    line calls ``.step(``, Dynamo holds no compiled code for it (it runs uncompiled) and that line
    is inside a for/while loop of its function: (the loop's line, the call's line)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        line = linecache.getline(code.co_filename, frame.f_lineno)
        summary = traceback.FrameSummary(code.co_filename, frame.f_lineno, code.co_name, line=line)
        if user_line_from_frames([summary]) is not None:
            break
        frame = frame.f_back
    if frame is None or ".step(" not in line or torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code):
        return None
    loop = _enclosing_loop(code, frame.f_lineno)
    if loop is None:
        return None
    return (SourceLine(code.co_filename, loop, code.co_name, linecache.getline(code.co_filename, loop)),
            SourceLine(code.co_filename, frame.f_lineno, code.co_name, line))


def _enclosing_loop(code, line: int) -> int | None:
    """The line of the innermost for/while loop of `code`'s function whose body holds `line`."""
    try:
        source = textwrap.dedent(inspect.getsource(code))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return None
    offset = code.co_firstlineno - 1
    loops = [node for node in ast.walk(tree) if isinstance(node, (ast.For, ast.AsyncFor, ast.While))
             and node.body[0].lineno + offset <= line <= node.end_lineno + offset]
    return max(node.lineno for node in loops) + offset if loops else None


SUPPORTED_SHAPE = ("loss.backward(); out = loss.detach(); opt.step(); opt.zero_grad(); return out")


def backward_outside_message(captured: CapturedGraph) -> str:
    where = f" at {captured.split_line}" if captured.split_line else ""
    reason = captured.split_reason or "a graph break"
    if captured.forward_outside is not None:
        return _forward_outside_message(captured.forward_outside, where)
    if captured.split_caller is not None:
        return (
            f"optpass: the compiled step stops before backward(): Dynamo broke the graph inside code "
            f"the step calls{where} (called from your step at {captured.split_caller}), because of: "
            f"{reason}. The step shape is not the cause. backward() and what follows it then run "
            "outside the captured graph, so optpass cannot see or rewrite them. Fix: make that code "
            "compile (`torch._dynamo.explain(step)(*batch)` lists every break and its reason), or move "
            "the call out of the step.")
    if captured.later_break is not None:
        return (
            f"optpass: the compiled step stops before backward(){where}: the step breaks the graph after "
            f"backward(), because of: {captured.later_break}; `loss` is still alive there, so Dynamo moved "
            "the break to backward(). backward() and what follows it (gradient clipping, the optimizer) then "
            "run outside the captured graph, so optpass cannot see or rewrite them. Fix: keep that call out "
            "of the compiled step: return the value as a tensor (`out = loss.detach()`) and call `.item()` "
            "or print it after the step returns, e.g. "
            f"`{SUPPORTED_SHAPE}` and `print(step(x, y).item())`.")
    if captured.split_source_unread:
        return (
            f"optpass: the compiled step stops before backward(){where}, because of: {reason}. "
            "backward() and what follows it (gradient clipping, the optimizer) then run outside the "
            "captured graph, so optpass cannot see or rewrite them. The step's source could not be read "
            "(a script on stdin or a REPL that keeps no source), so optpass cannot tell which of two "
            "causes it is: (1) the step shape: `loss` read after opt.step() (e.g. `return loss.detach()` "
            f"at the end); fix: take the value to return before the optimizer: `{SUPPORTED_SHAPE}`; "
            "(2) a break inside code the step calls (the model's forward, a library); fix: make that code "
            "compile (`torch._dynamo.explain(step)(*batch)` lists every break and its reason). Run the "
            "step from a file to get the exact cause.")
    if "GradScaler." in reason:
        return (
            f"optpass: the compiled step stops before backward(){where}, because of: {reason}. "
            "backward(), the unscale and the optimizer then run outside the captured graph. Fix: give "
            "the scaler to optpass, options={'optimizer': opt, 'grad_scaler': scaler, ...}, and write the "
            f"plain step `{SUPPORTED_SHAPE}`: optpass then scales, unscales, skips on inf/nan and updates "
            "the scale inside the compiled step, with GradScaler's semantics.")
    return (
        f"optpass: the compiled step stops before backward(){where}, because of: {reason}. "
        "backward() and what follows it (gradient clipping, the optimizer) then run outside the "
        "captured graph, so optpass cannot see or rewrite them. The usual cause is reading `loss`, or "
        "another tensor of the forward (logits, a model output), after opt.step() (e.g. `return "
        "loss.detach()` or `return out, logits.detach()` at the end). Fix: detach every value to "
        f"return before the optimizer: `{SUPPORTED_SHAPE}` (and `logits = logits.detach()` beside `out`).")


def _forward_outside_message(cause: str, where: str) -> str:
    """The loss's forward ran outside the compiled frame that calls backward(): by ``cause``."""
    fixes = []
    if "FSDP2" in cause:
        fixes.append("shard with optpass.fully_shard (FSDP2's call, per block then the root) and compile with "
                     "options={'optimizer': opt, 'data_parallel': 'fsdp', ...}: optpass gathers and reduces "
                     "inside the step's graph")
    if "DistributedDataParallel" in cause:
        fixes.append("compile the unwrapped model's step with options={'optimizer': opt, 'data_parallel': "
                     "'zero1', ...}: optpass averages the gradients inside the step's graph")
    if "HOP: Unsafe side effect" in cause:
        fixes.append("a checkpointed block (torch.utils.checkpoint, checkpoint_wrapper) writes state outside "
                     "itself, which Dynamo cannot trace: a Hugging Face model's KV cache is that, turn it off "
                     "for training with model.config.use_cache = False")
    if not fixes:
        fixes.append("make the model's forward compile (`torch._dynamo.explain(step)(*batch)` lists every "
                     "break and its reason)")
    return (
        f"optpass: the loss's backward(){where} runs outside the compiled step: the loss was computed "
        f"outside the compiled code, by {cause}; so backward() runs from eager autograd, as it would without optpass, and optpass cannot see or rewrite it or "
        "what follows it. Fix: " + "; or ".join(fixes) + ".")

