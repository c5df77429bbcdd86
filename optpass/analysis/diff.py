"""Graph text that stays the same from run to run, and diffs of it, for expect tests.

``str(graph)`` is a poor thing to compare against: node names carry FX's
uniquing counters (``sum_1``, ``add_3``), which shift whenever tracing or an
earlier pass creates one more node, and meta holds stack traces and file paths.
``graph_text`` prints one line per node with names that depend only on the
graph's structure:

* placeholders are ``in0, in1, ...`` in order;
* every other node is its op's short name plus a counter *per short name*, in
  order of appearance (``mm_0, relu_0, mm_1``). Inserting an ``add_`` node
  therefore renames only later ``add_`` nodes, so a pass's diff stays small.

A line reads ``mm_1: f32[8, 4] = aten.mm(t_0, in2)``: the name, the type from
``meta['val']`` (or Dynamo's ``meta['example_value']``) when ``shapes`` is on,
the compact target and the arguments. ``graph_diff`` is a unified diff of two
such texts.
"""

from __future__ import annotations

import builtins
import difflib
import enum
import math
import operator
import re
from typing import Any

import torch
import torch.fx

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_NOT_IDENTIFIER = re.compile(r"\W+")

_DTYPE_ABBREVIATIONS = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


def graph_text(graph_or_gm: torch.fx.Graph | torch.fx.GraphModule, *, shapes: bool = True) -> str:
    """One normalized line per node; stable across runs and FX renaming.

    Placeholders are ``in0, in1, ...``; every other node is its op's short name with a counter per
    short name (``mm_0, relu_0, mm_1``), so inserting a node renames only later nodes of the same
    op. A line reads ``mm_1: f32[8, 4] = aten.mm(t_0, in2)`` (see the module docstring).

    Args:
        graph_or_gm: the graph, or a GraphModule whose ``graph`` is printed.
        shapes: print each value's type (dtype and shape) from ``meta['val']`` or Dynamo's
            ``meta['example_value']``; False leaves it out.

    Returns:
        The lines, joined with newlines.

    Raises:
        TypeError: ``graph_or_gm`` is neither a ``torch.fx.Graph`` nor a ``GraphModule``.
    """
    graph = _as_graph(graph_or_gm)
    names = _normalized_names(graph)
    return "\n".join(_node_line(node, names, shapes) for node in graph.nodes)


def graph_diff(
    before: torch.fx.Graph | torch.fx.GraphModule,
    after: torch.fx.Graph | torch.fx.GraphModule,
    *,
    context: int = 3,
    shapes: bool = True,
) -> str:
    """Unified diff of the two graphs' ``graph_text``; "" when they print the same.

    Args:
        before: the graph (or GraphModule) before, labelled ``before`` in the diff.
        after: the graph (or GraphModule) after, labelled ``after``.
        context: lines of context around each change (as ``difflib.unified_diff``'s ``n``).
        shapes: as ``graph_text``'s: print each value's type.

    Returns:
        The unified diff, one line per line; "" when the two texts are the same.

    Raises:
        TypeError: ``before`` or ``after`` is neither a ``torch.fx.Graph`` nor a ``GraphModule``.
    """
    lines = difflib.unified_diff(
        graph_text(before, shapes=shapes).splitlines(),
        graph_text(after, shapes=shapes).splitlines(),
        fromfile="before",
        tofile="after",
        lineterm="",
        n=context,
    )
    return "\n".join(lines)


def _as_graph(graph_or_gm: torch.fx.Graph | torch.fx.GraphModule) -> torch.fx.Graph:
    if isinstance(graph_or_gm, torch.fx.GraphModule):
        return graph_or_gm.graph
    if isinstance(graph_or_gm, torch.fx.Graph):
        return graph_or_gm
    raise TypeError(f"expected a torch.fx.Graph or GraphModule, got {type(graph_or_gm).__name__}")


# --- names -------------------------------------------------------------------


def _normalized_names(graph: torch.fx.Graph) -> dict[torch.fx.Node, str]:
    names: dict[torch.fx.Node, str] = {}
    taken: set[str] = set()
    counters: dict[str, int] = {}
    placeholders = 0
    for node in graph.nodes:
        if node.op == "output":
            continue
        if node.op == "placeholder":
            name = f"in{placeholders}"
            placeholders += 1
        else:
            base = _short_name(node)
            # The guard against `taken` only matters for odd bases that end in
            # `_<digits>` and could meet another op's counter; it is
            # deterministic, so names stay stable.
            while True:
                count = counters.get(base, 0)
                counters[base] = count + 1
                name = f"{base}_{count}"
                if name not in taken:
                    break
        taken.add(name)
        names[node] = name
    return names


def _short_name(node: torch.fx.Node) -> str:
    target = node.target
    if node.op == "call_method":
        return _identifier(target)
    if node.op in ("call_module", "get_attr"):
        return _identifier(str(target))
    if isinstance(target, torch._ops.OpOverload):
        return target._opname
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    if isinstance(target, torch._ops.HigherOrderOperator):
        return _identifier(target.name())
    return _identifier(getattr(target, "__name__", None) or type(target).__name__)


def _identifier(text: str) -> str:
    # Trailing underscores stay: `mul_` (in place) and `mul` are different ops.
    return _NOT_IDENTIFIER.sub("_", text) or "node"


# --- lines -------------------------------------------------------------------


def _node_line(node: torch.fx.Node, names: dict[torch.fx.Node, str], shapes: bool) -> str:
    if node.op == "output":
        return f"return {_format_output(node.args[0], names)}"

    head = names[node]
    if shapes:
        value_type = _value_type(node)
        if value_type:
            head = f"{head}: {value_type}"

    if node.op == "placeholder":
        return f"{head} = placeholder"
    if node.op == "get_attr":
        return f"{head} = get_attr {node.target!r}"

    arguments = [_format_arg(a, names) for a in node.args]
    arguments += [f"{k}={_format_arg(v, names)}" for k, v in node.kwargs.items()]
    return f"{head} = {_format_target(node)}({', '.join(arguments)})"


def _format_output(value: Any, names: dict[torch.fx.Node, str]) -> str:
    # Whether a tracer returned a list or a tuple says nothing about the graph.
    if isinstance(value, (list, tuple)):
        return _format_sequence(value, names, "(", ")")
    return _format_arg(value, names)


def _format_target(node: torch.fx.Node) -> str:
    target = node.target
    if node.op == "call_method":
        return f".{target}"
    if node.op == "call_module":
        return f"call_module {target!r}"
    if isinstance(target, torch._ops.OpOverload):
        packet = f"{target.namespace}.{target._opname}"
        if target._overloadname == "default":
            return packet
        return f"{packet}.{target._overloadname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.replace("::", ".")
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name()
    return _function_name(target)


def _function_name(function: Any) -> str:
    name = getattr(function, "__name__", None)
    if name is None:
        return _ADDRESS.sub("0x?", repr(function))
    # operator.getitem and builtins read better bare, the way one writes them.
    if getattr(operator, name, None) is function or getattr(builtins, name, None) is function:
        return name
    if getattr(torch, name, None) is function:
        return f"torch.{name}"
    try:
        return torch.fx.node._get_qualified_name(function)
    except Exception:
        return f"{getattr(function, '__module__', None) or '?'}.{name}"


def _format_arg(value: Any, names: dict[torch.fx.Node, str]) -> str:
    if isinstance(value, torch.fx.Node):
        return names[value]
    if isinstance(value, tuple):
        return _format_sequence(value, names, "(", ")")
    if isinstance(value, list):
        return _format_sequence(value, names, "[", "]")
    if isinstance(value, dict):
        items = (f"{_format_arg(k, names)}: {_format_arg(v, names)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, slice):
        parts = (_format_arg(p, names) for p in (value.start, value.stop, value.step))
        return f"slice({', '.join(parts)})"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f"float({str(value)!r})"
    if isinstance(value, (bool, int, str, type(None))):
        return repr(value)
    if isinstance(value, torch.device):
        return f"device({str(value)!r})"
    if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
        return str(value)
    if isinstance(value, torch.Tensor):
        return f"<tensor {_tensor_type(value)}>"
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if value is Ellipsis:
        return "..."
    return _ADDRESS.sub("0x?", repr(value))


def _format_sequence(values, names, open_: str, close: str) -> str:
    inner = ", ".join(_format_arg(v, names) for v in values)
    if open_ == "(" and len(values) == 1:
        inner += ","
    return f"{open_}{inner}{close}"


# --- types -------------------------------------------------------------------


def _value_type(node: torch.fx.Node) -> str | None:
    value = node.meta.get("val", node.meta.get("example_value"))
    return _type_of(value)


def _type_of(value: Any) -> str | None:
    if isinstance(value, torch.Tensor):
        return _tensor_type(value)
    if isinstance(value, (list, tuple)):
        parts = [_type_of(v) or "_" for v in value]
        if not parts:
            return None
        return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"Sym({value})"
    return None


def _tensor_type(tensor: torch.Tensor) -> str:
    dtype = _DTYPE_ABBREVIATIONS.get(tensor.dtype) or str(tensor.dtype).removeprefix("torch.")
    return f"{dtype}[{', '.join(str(size) for size in tensor.shape)}]"
