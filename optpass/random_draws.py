"""The aten graph's ``randn_like`` draws as one op, for Inductor with ``fallback_random``.

Precondition: Inductor lowers random ops to aten calls on torch's generator (``fallback_random``,
which optpass sets on CPU), and chains every random op to the one before it so that they draw in
program order; the chain links cost fusions (``optpass/kernels/random_draws.py`` says what was
seen).

Rewrite: each run of consecutive random ops (in graph order, no other random op between) that are
plain ``randn_like(t)`` becomes one ``optpass::randn_like_in_order([t, ...])`` and a ``getitem`` per
draw, placed right before the first reader of any of the draws (or before the next random op of
another kind, if that comes first); a draw whose input is computed after that place ends the run.

Effect: the same numbers (the same calls, in the same order, on the same generator), one random op
where there were many, so nothing to chain among them; the draws happen before their first
reader, as before. Not a pass of the pipeline: a detail of the Inductor lowering (``lowering.py``
runs it), with nothing to refuse.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from optpass.kernels import random_draws  # noqa: F401  (registers optpass::randn_like_in_order)

_RANDN_LIKE = torch.ops.aten.randn_like.default
# randn_like's keyword arguments at the values that make it randn_like(t) (a tensor like t).
_PLAIN_KWARGS = {"dtype": None, "layout": None, "device": None, "pin_memory": False, "memory_format": None}


def draw_randn_like_in_one_op(graph: torch.fx.Graph) -> int:
    """Rewrite every run of two or more plain ``randn_like`` draws; return the draws rewritten."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    randoms = [node for node in graph.nodes if _is_random(node)]
    runs, run = [], []
    for node in randoms:
        if not _is_plain_randn_like(node):
            runs.append((run, node))
            run = []
        elif run and not _input_before(node, _first_reader(run + [node], order), order):
            runs.append((run, node))
            run = [node]
        else:
            run.append(node)
    runs.append((run, None))
    rewritten = 0
    for members, next_random in runs:
        if len(members) < 2:
            continue
        place = _first_reader(members, order)
        if next_random is not None and (place is None or order[next_random] < order[place]):
            place = next_random
        _replace(graph, members, place)
        rewritten += len(members)
    return rewritten


def _is_random(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in node.target.tags)


def _is_plain_randn_like(node: torch.fx.Node) -> bool:
    return (node.target is _RANDN_LIKE and len(node.args) == 1
            and all(_PLAIN_KWARGS.get(k, "absent") == v for k, v in node.kwargs.items()))


def _first_reader(members: list[torch.fx.Node], order: dict) -> torch.fx.Node | None:
    readers = [user for node in members for user in node.users]
    return min(readers, key=order.__getitem__) if readers else None


def _input_before(node: torch.fx.Node, place: torch.fx.Node | None, order: dict) -> bool:
    return place is None or order[node.args[0]] < order[place]


def _replace(graph: torch.fx.Graph, members: list[torch.fx.Node], place: torch.fx.Node | None) -> None:
    """One ``randn_like_in_order`` before ``place`` (the output node when None) for ``members``."""
    place = place if place is not None else next(iter(graph.find_nodes(op="output")))
    with graph.inserting_before(place):
        draws = graph.call_function(torch.ops.optpass.randn_like_in_order.default,
                                    ([node.args[0] for node in members],))
        draws.meta["val"] = [node.meta.get("val") for node in members]
        draws.meta["stack_trace"] = members[0].meta.get("stack_trace")
        for i, node in enumerate(members):
            draw = graph.call_function(operator.getitem, (draws, i))
            draw.meta.update(node.meta)
            node.replace_all_uses_with(draw)
    for node in members:
        graph.erase_node(node)
