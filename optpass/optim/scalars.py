"""Harvest an update that computes Python scalars from tensors (Adafactor), as tensor ops.

Precondition: torch.optim's step reads tensor values into Python numbers
(``step_t.item()``, ``param.norm().item()``) and branches on them with ``min`` /
``max``. Traced the usual way that is a graph break (docs/design.md §18 needs
one graph); traced with ``capture_scalar_outputs`` the numbers are unbacked
SymFloats, and a float ``lr`` compared with them has to be symbolic too
(``specialize_float=False``), or ``min(lr, ...)`` bakes it in.

Rewrite (``tensorize_scalars``), on Dynamo's graph, before AOTAutograd: every
Python number computed from a tensor becomes a float64 0-d tensor (Python's
float is a double), so the update is tensor ops only — no ``.item()``, no
data-dependent guards, nothing for Inductor to sync on:

* ``t.item()`` -> ``t.to(float64)``; ``+ - * / ** neg`` stay (they work on
  tensors); ``sym_min`` / ``sym_max`` -> ``minimum`` / ``maximum``;
* a hyper-parameter that Dynamo made a graph input (``beta2_decay``, ``eps``,
  ``d``) -> a constant (the fused step checks they do not change); ``lr`` stays
  an input, as in every harvested update;
* where a number feeds a tensor op: ``add_(x, y, alpha=a)`` -> ``add_(x, y * a)``,
  ``addcmul_/addcdiv_(..., value=v)`` likewise; any other number argument
  -> a 0-d tensor of the op's dtype (as torch casts a Python scalar).

Effect: the same update, in the same precision, as one graph the optimizer
passes can slice per parameter.
"""

from __future__ import annotations

import ast
import math
import operator
import re

import torch
import torch.fx

from optpass.errors import OptpassError

# Dynamo's source name of a param-group entry: L['self'].param_groups[0]['eps'][1]
_GROUP_ENTRY = re.compile(r"param_groups\[(\d+)\]((?:\[[^\]]+\])+)$")

_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.truediv, operator.pow,
               operator.neg, operator.abs, operator.floordiv}
_MIN_MAX = {torch.sym_min: torch.minimum, torch.sym_max: torch.maximum, min: torch.minimum,
            max: torch.maximum}
_SQRT = {math.sqrt, torch._sym_sqrt}


def group_entry_role(source: str) -> tuple | None:
    """("lr", group) or ("hyper", (group, path)) for a param-group entry Dynamo made an input."""
    match = _GROUP_ENTRY.search(source)
    if match is None:
        return None
    group = int(match.group(1))
    path = tuple(ast.literal_eval(key) for key in re.findall(r"\[([^\]]+)\]", match.group(2)))
    return ("lr", group) if path == ("lr",) else ("hyper", (group, path))


def tensorize_scalars(gm: torch.fx.GraphModule, example_inputs: list, roles: dict[int, tuple],
                      optimizer: torch.optim.Optimizer) -> tuple[list, dict[int, tuple]]:
    """Rewrite `gm` in place (see the module docstring); returns its new inputs and their roles."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    numbers: set[torch.fx.Node] = set()          # nodes whose value is now a float64 0-d tensor
    kept_inputs, kept_roles = [], {}

    def constant(value, before: torch.fx.Node) -> torch.fx.Node:
        with graph.inserting_before(before):
            return graph.call_function(torch.scalar_tensor, (float(value),), {"dtype": torch.float64})

    for index, node in enumerate(placeholders):
        role = roles[index]
        if role[0] == "hyper":
            group, path = role[1]
            value = optimizer.param_groups[group]
            for key in path:
                value = value[key]
            node.replace_all_uses_with(constant(value, first_op))
            graph.erase_node(node)
        else:
            kept_roles[len(kept_inputs)] = role
            kept_inputs.append(example_inputs[index])

    def as_tensor_args(node: torch.fx.Node) -> None:
        node.args = tuple(a if isinstance(a, torch.fx.Node) else constant(a, node) for a in node.args)

    for node in list(graph.nodes):
        if node.op == "call_method" and node.target == "item":
            node.target, node.args = "to", (node.args[0], _item_dtype(node))
            numbers.add(node)
            continue
        reads_number = any(a in numbers for a in node.all_input_nodes)
        if not reads_number or node.op == "output":
            continue
        if node.op == "call_function" and node.target in _ARITHMETIC:
            numbers.add(node)                     # Python operators work on 0-d tensors as they are
        elif node.op == "call_function" and node.target in _MIN_MAX:
            as_tensor_args(node)
            node.target = _MIN_MAX[node.target]
            numbers.add(node)
        elif node.op == "call_function" and node.target in _SQRT:
            node.target = torch.sqrt
            numbers.add(node)
        elif node.op == "call_function" and node.target is torch.scalar_tensor:
            # Dynamo wraps a number it returns: it already is a tensor
            node.target, node.args = "to", (node.args[0], node.kwargs.get("dtype", torch.float64))
            node.op, node.kwargs = "call_method", {}
        else:
            _number_into_tensor_op(graph, node, numbers)
    for node in graph.nodes:                      # their SymFloats belong to the harvest's trace
        node.meta.pop("unbacked_bindings", None)
        if node in numbers or not isinstance(node.meta.get("example_value"), torch.Tensor):
            node.meta.pop("example_value", None)
    graph.lint()
    gm.recompile()
    return kept_inputs, kept_roles


def _item_dtype(node: torch.fx.Node) -> torch.dtype:
    value = node.meta.get("example_value")
    if isinstance(value, (torch.SymBool, bool)):
        return torch.bool
    if isinstance(value, (torch.SymInt, int)):
        return torch.int64
    return torch.float64


def _number_into_tensor_op(graph: torch.fx.Graph, node: torch.fx.Node, numbers: set) -> None:
    """A tensor op reads a number (now a 0-d float64 tensor): pass it as torch would a scalar."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    name = name.rstrip("_")
    dtype = next((a.meta["example_value"].dtype for a in node.args
                  if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("example_value"), torch.Tensor)),
                 None)
    if dtype is None:
        raise OptpassError(f"optimizer update: cannot express {node.format_node()} with tensor ops.")

    def cast(value: torch.fx.Node) -> torch.fx.Node:
        with graph.inserting_before(node):
            return graph.call_method("to", (value, dtype))

    kwargs = dict(node.kwargs)
    scale_key = "alpha" if name in ("add", "sub") else "value" if name in ("addcmul", "addcdiv") else None
    if scale_key is not None and kwargs.get(scale_key) in numbers:
        # add_(x, y, alpha=a) -> add_(x, y * a); addcmul_(x, a, b, value=v) -> add_(x, a * b * v)
        scale = cast(kwargs.pop(scale_key))
        self_, *rest = node.args
        with graph.inserting_before(node):
            term = rest[0] if scale_key == "alpha" else graph.call_function(
                operator.mul if name == "addcmul" else operator.truediv, (rest[0], rest[1]))
            scaled = graph.call_function(operator.mul, (term, scale))
        if scale_key == "value":
            in_place = node.op == "call_method" and node.target.endswith("_")
            node.op, node.target = "call_method", "add_" if in_place else "add"
        node.args, node.kwargs = (self_, scaled), kwargs
        return
    node.args = tuple(cast(a) if a in numbers else a for a in node.args)
    node.kwargs = {k: cast(v) if v in numbers else v for k, v in node.kwargs.items()}
