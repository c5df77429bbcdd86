"""StepGraph: an aten graph of a training step with the role of each value.

Passes run on the aten graph that AOTAutograd produces (the ``lower="eager"``
path) or on Inductor's post-grad graph (the default path). Neither carries
names: placeholders and outputs only carry AOTAutograd descriptors
(``PlainAOTInput(idx)``, ``ParamAOTInput(target)``, ``PlainAOTOutput(idx)``)
that point back at the Dynamo graph. ``StepGraph`` joins those descriptors with
the roles ``capture`` found at the Dynamo level (docs/design.md §21: the mapping must come
from there, not from shapes):

* ``param_nodes[name]``     the placeholder holding parameter ``name``
* ``gradient_nodes[name]``  the value in the output slot that becomes ``name``'s ``.grad``
* ``gradient_inputs[name]`` (update graphs) the placeholder holding ``name``'s ``.grad``
* ``state_nodes``           (update graphs) optimizer-state placeholders
* ``region_of(node)``       forward / backward / gradient_transform / update

Regions are dataflow facts: AOTAutograd marks every node the traced
``autograd.grad`` produced with ``meta["autograd_backward"]``; an unmarked node
that depends on a backward node transforms gradients; everything else before is
forward. Nodes a pass inserts to update parameters tag themselves ``update``.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Iterable

import sympy
import torch
import torch.fx
from torch._guards import detect_fake_mode

from optpass.capture import CapturedGraph, GraphKind
from optpass.errors import OptpassError, node_user_line

FORWARD, BACKWARD, GRADIENT_TRANSFORM, UPDATE, INPUT, OUTPUT = (
    "forward", "backward", "gradient_transform", "update", "input", "output")
REGION_KEY = "optpass_region"
# meta key of a node a pass made that holds a parameter's whole gradient (e.g. a tied weight's sum)
GRADIENT_KEY = "optpass_gradient"


@dataclasses.dataclass
class StepGraph:
    """An aten graph of a training step with the role of each value; what passes rewrite.

    Made by ``StepGraph.build`` from an aten graph and the roles ``capture`` found at the Dynamo
    level (see the module docstring).

    Attributes:
        graph: the aten graph, rewritten in place by the passes.
        captured: the ``CapturedGraph`` of the Dynamo graph it was traced from.
        param_nodes: parameter name -> the placeholder holding it.
        gradient_nodes: parameter name -> the value in the output slot that becomes its ``.grad``.
        gradient_slots: parameter name -> the position of its gradient in the output tuple.
        gradient_inputs: (update graphs) parameter name -> the placeholder holding its ``.grad``.
        state_nodes: (update graphs) the optimizer-state placeholders.
        context: what the backend hands to passes for this compile (e.g. the harvested
            optimizer update).
        notes: what passes want a reader to know beyond applied/skipped (explain shows them).
        warnings: (warning category, message) pairs a pass wants the user to hear at compile; the
            pipeline warns them, and again when Inductor's cache serves the graph.
        skip_update: a 0-d bool value: when true, every update write keeps its target's old
            value (loss scaling's found_inf: the step is skipped); set by the loss_scaling pass,
            read by ``write_update``. None: no guard.
    """

    graph: torch.fx.Graph
    captured: CapturedGraph
    param_nodes: dict[str, torch.fx.Node]
    gradient_nodes: dict[str, torch.fx.Node]
    gradient_slots: dict[str, int]                 # position in the output tuple
    gradient_inputs: dict[str, torch.fx.Node]
    state_nodes: list[torch.fx.Node]
    # What the backend hands to passes for this compile (e.g. the harvested optimizer update).
    context: dict = dataclasses.field(default_factory=dict)
    # What passes want a reader to know beyond applied/skipped (explain shows them).
    notes: list[str] = dataclasses.field(default_factory=list)
    warnings: list[tuple[type, str]] = dataclasses.field(default_factory=list)
    # A 0-d bool value: when true, every update write keeps its target's old value (loss scaling's
    # found_inf: the step is skipped). Set by the loss_scaling pass, read by write_update.
    skip_update: torch.fx.Node | None = None

    @property
    def kind(self) -> GraphKind:
        """The ``GraphKind`` of the captured Dynamo graph."""
        return self.captured.kind

    @functools.cached_property
    def fake_mode(self):
        """The FakeTensorMode of the graph's placeholder values (``meta['val']``)."""
        return detect_fake_mode([n.meta.get("val") for n in self.graph.nodes if n.op == "placeholder"])

    def set_fake_value(self, node: torch.fx.Node) -> None:
        """Later Inductor passes read meta['val'] of every node (docs/design.md §20): run the op on fake inputs.

        Args:
            node: a call_function node whose arguments carry ``meta['val']``; its own
                ``meta['val']`` is set.
        """
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = node.target(*args, **kwargs)

    def emit(self, target, *args, **kwargs) -> torch.fx.Node:
        """A new call_function node at the graph's insert point, with its meta['val'].

        A symbolic size among the arguments (a SymInt read off a fake value's shape, e.g. a
        batch size Dynamo made dynamic) becomes a graph value (``size_arg``): a SymInt object
        in an FX argument would print as its symbol (``s17``), which the graph's code does not
        define.

        Args:
            target: the op to call (e.g. ``torch.ops.aten.mul.Tensor``).
            *args: its positional arguments (nodes, constants or symbolic sizes).
            **kwargs: its keyword arguments.

        Returns:
            The new node.

        Raises:
            OptpassError: a symbolic size among the arguments is not a value of this graph (see
                ``size_arg``).
        """
        args, kwargs = torch.fx.node.map_aggregate(
            (args, kwargs), lambda a: self.size_arg(a) if isinstance(a, torch.SymInt) else a)
        node = self.graph.call_function(target, args, kwargs)
        self.set_fake_value(node)
        return node

    def write_update(self, target: torch.fx.Node, value: torch.fx.Node) -> torch.fx.Node:
        """An update's in-place write ``copy_(target, value)`` at the insert point; with a
        ``skip_update`` guard, ``copy_(target, where(skip, target, value))``: a skipped step leaves
        parameters, masters and optimizer state (``step`` counters included) as they were.

        Args:
            target: the node written in place (a parameter, master or optimizer-state value).
            value: the node holding its new value.

        Returns:
            The ``copy_`` node.
        """
        if self.skip_update is not None:
            value = self.emit(torch.ops.aten.where.self, self.skip_update, target, value)
        return self.emit(torch.ops.aten.copy_.default, target, value)

    def size_arg(self, size):
        """``size`` as an FX argument: an int as is; a symbolic size as a node computing it from the
        graph's inputs (a SymInt placeholder, or ``sym_size`` of an input tensor), with
        ``operator.mul`` / ``operator.add`` for products and sums of them (``B·T``, ``B·vocab``).

        Args:
            size: an int or a ``torch.SymInt``.

        Returns:
            ``size`` itself (an int, or a SymInt that is a constant, as an int), or the node that
            computes it.

        Raises:
            OptpassError: no input of the graph has the symbolic size, nor is it a product or sum
                of the inputs' sizes.
        """
        if not isinstance(size, torch.SymInt):
            return size
        constant = size.node.maybe_as_int()
        return constant if constant is not None else self._expr_arg(size.node.expr)

    def _expr_arg(self, expr):
        if expr.is_Integer:
            return int(expr)
        if isinstance(expr, (sympy.Mul, sympy.Add)):
            op = operator.mul if isinstance(expr, sympy.Mul) else operator.add
            terms = [self._expr_arg(a) for a in expr.args]
            value = terms[0]
            for term in terms[1:]:
                value = self.emit(op, value, term)
            return value
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        for node in placeholders:                                      # a SymInt input of the graph
            value = node.meta.get("val")
            if isinstance(value, torch.SymInt) and value.node.expr == expr:
                return node
        for node in placeholders:                                      # a dimension of an input tensor
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                for dim, size in enumerate(value.shape):
                    if isinstance(size, torch.SymInt) and size.node.expr == expr:
                        return self.emit(torch.ops.aten.sym_size.int, node, dim)
        raise OptpassError(
            f"a pass needs the symbolic size {expr} as a graph value, and no input of this graph has it "
            "(nor is it a product or sum of the inputs' sizes). Make that dimension static "
            "(torch._dynamo.mark_static, or torch.compile(..., dynamic=False)), or disable the pass "
            "(options={'disable_passes': [...]}); and please report the step.")

    def define_inputs_before(self, nodes: set[torch.fx.Node], at: torch.fx.Node, needed_by: str) -> None:
        """Make every value that `nodes` read from outside `nodes` defined before `at`, so that copies
        of `nodes` can be inserted there.

        A graph's order is one topological order, not "forward, then backward": Inductor's post-grad
        graph has forward values after backward ops (seen: a Llama's label reshape after the loss's
        first backward op, GPT-2's LayerNorm ``rsqrt`` among backward ops), and its pattern rewrites
        insert unmarked nodes (cross-entropy's one-hot as ``iota == label``) in the middle of
        backward, which count as forward (no backward input). Those values, and the
        values they read, are moved up to `at`, in their order. A value read from outside `nodes`
        reads nothing of `nodes` (`nodes` are all that leads from the forward to what is copied), and
        moving a pure value earlier changes nothing it computes; a node with a side effect or a
        random draw is not moved but refused (`needed_by`: what needs the copy, and the options
        that ask for it).

        Args:
            nodes: the nodes that will be copied.
            at: the node before which the copies will be inserted.
            needed_by: what needs the copy, and the options that ask for it (for the refusal).

        Raises:
            OptpassError: a value `nodes` read comes only later in the graph and cannot move
                earlier (it depends on what is copied, has a side effect or draws random numbers).
        """
        position = {n: i for i, n in enumerate(self.graph.nodes)}
        limit = position[at]
        late: set[torch.fx.Node] = set()
        stack = [a for n in nodes for a in n.all_input_nodes if a not in nodes]
        while stack:
            node = stack.pop()
            if node in late or position[node] < limit:
                continue
            if node in nodes or node.op not in ("call_function", "get_attr") or node.is_impure():
                where = node_user_line(node)
                reason = ("it depends on what is copied" if node in nodes
                          else "it has a side effect or draws random numbers")
                raise OptpassError(
                    f"{needed_by} reads {node.name} ({node.target}), which this graph computes only later and "
                    f"which cannot move earlier: {reason}{f' (from {where})' if where else ''}. This is a limit "
                    "of optpass; please report the step. Until it is lifted, leave out those options.")
            late.add(node)
            stack.extend(node.all_input_nodes)
        for node in sorted(late, key=position.__getitem__):
            at.prepend(node)

    @property
    def output_node(self) -> torch.fx.Node:
        """The graph's output node."""
        return next(n for n in reversed(self.graph.nodes) if n.op == "output")

    @staticmethod
    def build(graph: torch.fx.Graph, captured: CapturedGraph, context: dict | None = None) -> "StepGraph":
        """Join an aten graph's AOTAutograd descriptors with the roles ``capture`` found.

        Args:
            graph: the aten graph (AOTAutograd's, or Inductor's post-grad graph).
            captured: the ``CapturedGraph`` of the Dynamo graph it was traced from.
            context: what the backend hands to passes for this compile (copied); None: nothing.

        Returns:
            The ``StepGraph``, with every node's region annotated.
        """
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        by_input_index, by_attr = {}, {}
        for node in placeholders:
            desc = local_tensor_base(node.meta.get("desc"))
            if hasattr(desc, "idx"):
                by_input_index[desc.idx] = node
            elif hasattr(desc, "target"):
                by_attr[desc.target] = node
        param_nodes = {}
        for p in captured.params:
            node = by_input_index.get(p.input_index) if p.input_index is not None else by_attr.get(p.attr)
            if node is not None:
                param_nodes[p.name] = node
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        slot_of_dynamo_output = _output_slots(output)
        gradient_nodes, gradient_slots = {}, {}
        for name, dynamo_index in captured.gradient_outputs.items():
            slot = slot_of_dynamo_output.get(dynamo_index)
            if slot is not None and isinstance(output.args[0][slot], torch.fx.Node):
                gradient_nodes[name] = output.args[0][slot]
                gradient_slots[name] = slot
        gradient_inputs = {name: by_input_index[i] for name, i in captured.gradient_inputs.items()
                           if i in by_input_index}
        state_nodes = [by_attr[a] for a in captured.state_attrs if a in by_attr]
        step = StepGraph(graph, captured, param_nodes, gradient_nodes, gradient_slots,
                         gradient_inputs, state_nodes, dict(context or {}))
        step.annotate_regions()
        return step

    # ------------------------------------------------------------ regions

    def annotate_regions(self) -> None:
        """Tag every node with its region (``meta["optpass_region"]``), from the dataflow.

        Backward: what the traced ``autograd.grad`` produced (and Dynamo's copy into ``p.grad``);
        gradient_transform: an unmarked node that depends on a backward node; update: a node a
        pass tagged so, or every node of an update graph; everything else is forward.
        """
        after_backward: set[torch.fx.Node] = set()
        for node in self.graph.nodes:
            if node.op == "placeholder":
                region = INPUT
            elif node.op == "output":
                region = OUTPUT
            elif node.meta.get(REGION_KEY) == UPDATE or self.kind is GraphKind.UPDATE:
                region = UPDATE
            elif node.meta.get("autograd_backward") or _materializes_gradient(node):
                region = BACKWARD
            elif any(a in after_backward for a in node.all_input_nodes):
                region = GRADIENT_TRANSFORM
            else:
                region = FORWARD
            if region in (BACKWARD, GRADIENT_TRANSFORM):
                after_backward.add(node)
            node.meta[REGION_KEY] = region

    def region_of(self, node: torch.fx.Node) -> str:
        """The region of `node`: "forward" (also for an untagged node), "backward",
        "gradient_transform", "update", "input" or "output"."""
        return node.meta.get(REGION_KEY, FORWARD)

    def region_sizes(self) -> dict[str, int]:
        """The number of nodes per region, placeholders and the output left out.

        Returns:
            region -> node count, for the regions that have nodes.
        """
        sizes: dict[str, int] = {}
        for node in self.graph.nodes:
            if node.op not in ("placeholder", "output"):
                sizes[self.region_of(node)] = sizes.get(self.region_of(node), 0) + 1
        return sizes

    def nodes_in(self, region: str) -> Iterable[torch.fx.Node]:
        """The nodes of one region, in graph order.

        Args:
            region: "forward", "backward", "gradient_transform", "update", "input" or "output".

        Returns:
            A generator over the graph's nodes in that region.
        """
        return (n for n in self.graph.nodes if self.region_of(n) == region)

    def gradient_buffer_names(self) -> set[str]:
        """Names of the nodes that allocate the gradients that become p.grad.

        Names, not nodes: they survive graph copies and rewrites, so the memory
        estimate can count the same gradients before and after a pass. A gradient
        materialized by Dynamo's `empty_like(p).copy_(g)` counts with its source `g`.

        Returns:
            The node names.
        """
        names = set()
        for node in self.gradient_nodes.values():
            names.add(node.name)
            if node.target is torch.ops.aten.copy.default and isinstance(node.args[1], torch.fx.Node):
                names.add(view_base(node.args[1]).name)  # the buffer is allocated where the view chain starts
        return names


def is_view(node: torch.fx.Node) -> bool:
    """An aten op whose result aliases an input without writing it (t, view, permute, ...)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    returns = node.target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def view_base(node):
    """The value a chain of views (``is_view``) starts from: `node` itself when it is no view."""
    while isinstance(node, torch.fx.Node) and is_view(node) and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _materializes_gradient(node: torch.fx.Node) -> bool:
    """Dynamo's `empty_like(p).copy_(g)` that turns a traced gradient into `p.grad` (docs/design.md §1)."""
    aten = torch.ops.aten
    if node.target is aten.empty_like.default:
        return bool(node.users) and all(u.target is aten.copy.default and u.args[0] is node
                                        for u in node.users)
    return (node.target is aten.copy.default and isinstance(node.args[0], torch.fx.Node)
            and node.args[0].target is aten.empty_like.default)


def _output_slots(output: torch.fx.Node) -> dict[int, int]:
    """Dynamo output index -> position in this graph's output tuple (via AOT descriptors)."""
    descs = output.meta.get("desc")
    if not descs:
        return {}
    return {d.idx: slot for slot, d in ((slot, local_tensor_base(d)) for slot, d in enumerate(descs))
            if type(d).__name__ == "PlainAOTOutput"}


# The inner tensor that holds a wrapper subclass's values: a DTensor's local tensor, and the weight of
# torchao's float8 training for FSDP2's float8 all-gather (WeightWithDynamicFloat8CastTensor._tensor)
VALUE_ATTRIBUTES = ("_local_tensor", "_tensor")


def local_tensor_base(desc):
    """A DTensor's local tensor stands for the DTensor (its input or output of the Dynamo graph):
    AOTAutograd flattens a DTensor into ``_local_tensor`` and its ``device_mesh``, the local tensor
    is what the aten graph computes with; so for a subclass whose values are one inner tensor
    (``VALUE_ATTRIBUTES``). Any other descriptor is returned as it is."""
    if type(desc).__name__ in ("SubclassGetAttrAOTInput", "SubclassGetAttrAOTOutput") and desc.attr in VALUE_ATTRIBUTES:
        return desc.base
    return desc
