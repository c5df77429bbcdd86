"""Harvest an optimizer's update as an aten graph, from torch.optim's own code.

The update math is never rewritten by optpass: ``torch.compile(opt.step)`` with
a backend that records the graph and runs nothing (DESIGN.md fact 5) yields
torch.optim's update for every parameter, and AOTAutograd turns it into a
functional aten graph whose in-place writes are ``copy_`` into the parameter
and state placeholders. optpass then slices that graph per parameter.

While harvesting, each param group is switched to the single-tensor
implementation (``foreach=False``, ``fused=False``: per-parameter ops that can
be sliced) and a float ``lr`` becomes a 0-d tensor so that the update reads lr
as an input (a scheduler can change it without a recompile). Everything is
restored afterwards; parameters and state are not touched by the no-op run.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch
import torch.fx
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

from optpass.errors import OptpassError



@dataclasses.dataclass
class ParameterUpdate:
    """One parameter's slice of the harvested update graph."""

    name: str
    group: int
    param: torch.fx.Node                       # placeholder in the harvested graph
    gradient: torch.fx.Node                    # placeholder
    states: dict[str, torch.fx.Node]           # state key -> placeholder
    nodes: list[torch.fx.Node]                 # the slice, in graph order
    writes: dict[torch.fx.Node, torch.fx.Node]  # placeholder (param or state) -> its new value
    lr: dict[torch.fx.Node, int]               # lr placeholder the slice reads -> its param group


@dataclasses.dataclass
class HarvestedUpdate:
    graphs: list[torch.fx.Graph]               # one per graph torch.optim's step compiled to
    updates: dict[str, ParameterUpdate]        # by parameter name

    @property
    def groups(self) -> list[int]:
        """The param groups whose lr the update reads (each becomes one input)."""
        return sorted({g for update in self.updates.values() for g in update.lr.values()})


def _zeros_like(example):
    from optpass.lowering import _zeros_like

    return _zeros_like(example)


@contextlib.contextmanager
def _harvest_setup(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> Iterator[None]:
    saved_groups = [dict(g) for g in optimizer.param_groups]
    saved_grads = [(p, p.grad) for p in params]
    try:
        for group in optimizer.param_groups:
            for key in ("foreach", "fused"):
                if key in group:
                    group[key] = False
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float64)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        yield
    finally:
        for group, saved in zip(optimizer.param_groups, saved_groups):
            group.update(saved)
        for p, grad in saved_grads:
            p.grad = grad


def _record_update_graphs(optimizer, role_of: dict[int, tuple]) -> list[tuple[torch.fx.GraphModule, list, dict]]:
    recorded: list[tuple[torch.fx.GraphModule, list, dict]] = []

    def recorder(gm, example_inputs):
        # Dynamo drops the placeholders' examples after the backend returns: read them now.
        roles = {}
        for index, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
            grapharg = node.meta.get("grapharg")
            example = grapharg.example if grapharg is not None else None
            source = grapharg.source.name if grapharg is not None and grapharg.source is not None else node.name
            roles[index] = role_of.get(id(example), ("unknown", source))
        recorded.append((gm, list(example_inputs), roles))
        output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        examples = [a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a
                    for a in output.args[0]]
        return lambda *args: tuple(_zeros_like(e) for e in examples)

    # Some optimizers (SGD) compile one graph per param group; static shapes keep each graph
    # free of symbolic sizes, so each one lowers to aten on its own.
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        torch.compile(optimizer.step, backend=recorder)()
    graphs = [r for r in recorded if any(n.op == "call_function" for n in r[0].graph.nodes)]
    # Dynamo keeps the backend (and so this list) alive for the life of the process: drop the
    # example inputs (the zero gradients, a model's worth of memory) as soon as we have them.
    recorded.clear()
    if not graphs:
        raise OptpassError(
            f"{type(optimizer).__name__}.step() compiled to no graph, so its update cannot be moved "
            "into the step graph.")
    return graphs


def harvest_update(optimizer: torch.optim.Optimizer, names: dict[str, torch.Tensor]) -> HarvestedUpdate:
    """The update of the parameters in `names` (name -> parameter), as a sliced aten graph."""
    params = list(names.values())
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    with _harvest_setup(optimizer, params):
        # Every tensor the update can read, by identity: Dynamo hands it over as an attribute
        # (get_attr) or as an input, depending on where the optimizer's frames broke.
        role_of: dict[int, tuple] = {}
        for name, p in names.items():
            role_of[id(p)] = ("param", name)
            role_of[id(p.grad)] = ("gradient", name)
            for key, t in optimizer.state.get(p, {}).items():
                if isinstance(t, torch.Tensor):
                    role_of[id(t)] = ("state", (name, key))
        for g, group in enumerate(optimizer.param_groups):
            role_of[id(group["lr"])] = ("lr", g)
        updates: dict[str, ParameterUpdate] = {}
        graphs = []
        for gm, example_inputs, placeholder_roles in _record_update_graphs(optimizer, role_of):
            attr_roles = {n.target: role_of.get(id(getattr(gm, n.target, None)), ("unknown", n.target))
                          for n in gm.graph.nodes if n.op == "get_attr"}
            aten = _to_aten(gm, example_inputs)
            graphs.append(aten)
            updates.update(_slice_per_parameter(aten, placeholder_roles, attr_roles, group_of, names))
    missing = [name for name in names if name not in updates]
    if missing:
        raise OptpassError(f"optimizer_in_backward: no update for parameter {missing[0]!r} was found in "
                           "the optimizer's step (is it in this optimizer's param_groups?).")
    return HarvestedUpdate(graphs, {name: updates[name] for name in names})


def _to_aten(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.Graph:
    from torch._inductor.decomposition import select_decomp_table

    captured: list[torch.fx.Graph] = []

    def keep(aten_gm, _inputs):
        captured.append(aten_gm.graph)
        return make_boxed_func(aten_gm.forward)

    # Inductor's decompositions: the slice lands in Inductor's post-grad graph as ops it knows.
    aot_module_simplified(gm, example_inputs, fw_compiler=keep, decompositions=select_decomp_table(),
                          keep_inference_input_mutations=True)
    return captured[0]


def _slice_per_parameter(graph, placeholder_roles, attr_roles, group_of, names):
    param_ph, grad_ph, state_ph, lr_ph = {}, {}, {}, {}
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        desc = node.meta.get("desc")
        if type(desc).__name__ == "PlainAOTInput":
            role, value = placeholder_roles[desc.idx]
        elif hasattr(desc, "target"):                      # ParamAOTInput / BufferAOTInput
            role, value = attr_roles.get(desc.target, ("unknown", desc.target))
        else:
            role, value = "unknown", str(desc)
        if role == "param":
            param_ph[value] = node
        elif role == "gradient":
            grad_ph[value] = node
        elif role == "state":
            state_ph.setdefault(value[0], {})[value[1]] = node
        elif role == "lr":
            lr_ph[value] = node
        else:
            raise OptpassError(f"optimizer_in_backward: the update graph reads {value!r}, an input "
                               "optpass does not know how to provide inside backward.")
    # New values of mutated inputs: in-graph copy_ (state), or outputs that AOTAutograd
    # copies back (parameters: they require grad, so their mutation is an output).
    writes: dict[torch.fx.Node, torch.fx.Node] = {}
    placeholder_of_desc = {n.meta.get("desc"): n for n in graph.nodes if n.op == "placeholder"}
    for node in graph.nodes:
        if node.target is torch.ops.aten.copy_.default and node.args[0].op == "placeholder":
            writes[node.args[0]] = node.args[1]
        elif node.op == "output":
            for value, desc in zip(node.args[0], node.meta.get("desc") or ()):
                if type(desc).__name__ == "InputMutationAOTOutput":
                    writes[placeholder_of_desc[desc.mutated_input]] = value
    order = {n: i for i, n in enumerate(graph.nodes)}
    updates = {}
    lr_group = {node: group for group, node in lr_ph.items()}
    for name in names:
        if name not in param_ph or name not in grad_ph:
            continue                                       # updated by another of the step's graphs
        states = [state_ph.get(name, {})[key] for key in sorted(state_ph.get(name, {}))]
        own = {param_ph[name], grad_ph[name], *states}
        # a fixed order (state, then the parameter) keeps the rewritten graph stable run to run
        own_writes = {p: writes[p] for p in [*states, param_ph[name]] if p in writes}
        nodes = _ancestors(list(own_writes.values()))
        foreign = {n for n in nodes if n.op == "placeholder"} - own - set(lr_ph.values())
        if foreign:
            raise OptpassError(
                f"optimizer_in_backward: the update of {name!r} reads other parameters' values "
                f"({', '.join(sorted(n.name for n in foreign))}); only per-parameter optimizers can "
                "run inside backward.")
        updates[name] = ParameterUpdate(
            name, group_of[id(names[name])], param_ph[name], grad_ph[name], state_ph.get(name, {}),
            sorted((n for n in nodes if n.op != "placeholder"), key=order.__getitem__), own_writes,
            {n: lr_group[n] for n in nodes if n in lr_group})
    return updates


def _ancestors(roots: list[torch.fx.Node]) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen
