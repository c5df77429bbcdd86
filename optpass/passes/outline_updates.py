"""Pass outline_updates: each parameter's update becomes one call of an update compiled once per kind.

Precondition: a rewritten step graph about to be lowered by Inductor, whose update nodes carry
``REGION_KEY == UPDATE`` (``optimizer_in_backward``, ``master_weights``, ``shard_optimizer``,
``loss_scaling`` place them).

Rewrite: the update nodes are split into pieces connected through values of more than one element
(one parameter's update, or one row chunk's; a one-element value such as the step count joins the
one piece that reads it, and stays inline when several do), less the views of values made outside
them (a row chunk ``p[a:b]`` stays in the step graph). A piece that only reads values made outside
it, writes its results into values made outside it (the parameter, its state: ``copy_`` or another
in-place op) and is used by nothing outside it, whose nodes are all aten or prims ops with no
collective and no random draw, is replaced by one node ``optpass::outlined_update(key, written,
read, computed_before)`` at the place of the piece's last node (``kernels/outlined_update.py``).
``key`` names the piece's *kind*: its aten graph with canonical names and each input's shape,
strides, dtype and device. Other pieces stay inline.

Effect: Inductor schedules and generates code for one call per parameter instead of its update's
kernels; each kind of update is compiled once in a process (the first time it runs) and reused by
every parameter of that kind, every layer and every later compile of the step (a new sequence
length). The order the pipeline chose is kept (the call sits where the piece ended, after the reads
of the old values it was placed after), so each gradient still dies at its update.

    before:                                           after:
      g1 = mm(t(dy), x1)                                g1 = mm(t(dy), x1)
      m1 = lerp(exp_avg1, g1, 0.1); ...                 outlined_update("3f9c...", [w1, exp_avg1, ...],
      copy_(w1, w1'); copy_(exp_avg1, m1); ...                          [g1, lr, step1])
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from optpass.kernels import outlined_update
from optpass.step import REGION_KEY, UPDATE, is_view, view_base

def run(graph: torch.fx.Graph) -> int:
    """Outline every update piece that can be; return how many were."""
    outlined = 0
    position = {n: i for i, n in enumerate(graph.nodes)}
    for piece in _pieces(graph):
        if _outline(graph, piece, position):
            outlined += 1
    if outlined:
        graph.lint()
    return outlined


def _pieces(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    """The update nodes, split into pieces (each in graph order) that are connected through values
    of more than one element. A one-element value (the step count, a bias correction, a found-inf
    flag) joins the piece that reads it when exactly one does (else the one its inputs come from);
    one read by several pieces stays inline, outside every piece: the row chunks of one parameter's
    update all read its new step count, and as one piece every chunk's gradient waited for the
    last (measured: a TinyLM head's chunked update held its whole 8 MiB gradient again)."""
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.meta.get(REGION_KEY) == UPDATE]
    in_region = set(nodes)
    parent = {n: n for n in nodes}

    def find(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    def union(a, b):
        a, b = find(a), find(b)
        if a is not b:
            parent[a] = b

    large = [n for n in nodes if not _one_element(n)]
    for n in large:
        for source in n.all_input_nodes:
            if source in in_region and not _one_element(source):
                union(n, source)
    # which large pieces each one-element value reaches through one-element values
    readers: dict[torch.fx.Node, set] = {}
    for n in reversed(nodes):
        if _one_element(n):
            readers[n] = set()
            for user in n.users:
                if user in in_region:
                    readers[n] |= readers[user] if _one_element(user) else {find(user)}
    placed: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in nodes:
        if not _one_element(n):
            continue
        owners = {find(r) for r in readers[n]}
        if not owners:    # a write (copy_ into the step count): where its inputs went
            owners = {placed[source] for source in n.all_input_nodes if source in placed} | \
                     {find(source) for source in n.all_input_nodes if source in in_region and not _one_element(source)}
            if any(source in in_region and _one_element(source) and source not in placed for source in n.all_input_nodes):
                owners.add(None)
        if len(owners) == 1 and None not in owners:
            placed[n] = next(iter(owners))
    pieces: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in nodes:
        owner = find(n) if not _one_element(n) else placed.get(n)
        if owner is not None:
            pieces.setdefault(find(owner), []).append(n)
    return list(pieces.values())


def _one_element(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return not isinstance(value, torch.Tensor) or value.numel() == 1


def _outlinable_op(node: torch.fx.Node) -> bool:
    if node.target is operator.getitem:
        return True
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    if node.target.namespace not in ("aten", "prims"):
        return False
    return not (torch.Tag.nondeterministic_seeded in node.target.tags)


def _static_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and all(isinstance(d, int) for d in (*value.shape, *value.stride()))


def _written_inputs(node: torch.fx.Node, members: set) -> list[torch.fx.Node]:
    """The values made outside the piece that ``node`` writes (a view of one is itself made outside
    the piece: ``_outside_views_left_out``)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return []
    return [value for argument, value in zip(node.target._schema.arguments, node.args)
            if argument.alias_info is not None and argument.alias_info.is_write
            and isinstance(value, torch.fx.Node) and value not in members]


def _outside_views_left_out(piece: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The piece without its views of values made outside it (a row chunk ``p[a:b]`` of the
    parameter, of its state): those stay in the step graph and the call writes the view. Inside
    the outlined graph a write into a view of an input is a write of the whole input (AOTAutograd
    makes it a scatter into a copy of it): every chunk's call copied the whole parameter and its
    state (measured: a step of a TinyLM with an 8 MiB embedding grew 38.8 MiB, against 2.8 inline)."""
    members = set(piece)
    left_out = []
    for n in piece:                         # graph order: a view of a view left out is left out too
        if is_view(n) and all(source not in members for source in n.all_input_nodes):
            members.discard(n)
            left_out.append(n)
    # A view whose source the piece reads as well stays in it: two inputs of the call would alias
    # (an 8-bit moment's scales, written, and their [-1, 1] view, read), and AOTAutograd's
    # synthetic base for aliased inputs sized the compiled kind's input from the first call's base.
    changed = True
    while changed:
        inputs = {source for n in members for source in n.all_input_nodes if source not in members}
        pulled = [v for v in left_out if v not in members and v in inputs and _view_sources(v) & inputs]
        members.update(pulled)
        changed = bool(pulled)
    return [n for n in piece if n in members]


def _view_sources(view: torch.fx.Node) -> set[torch.fx.Node]:
    """What a chain of views reads, down to the value it starts from (not `view` itself)."""
    sources = set()
    node = view
    while is_view(node) and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
        sources.add(node)
    return sources


def _outline(graph: torch.fx.Graph, piece: list[torch.fx.Node], position: dict) -> bool:
    piece = _outside_views_left_out(piece)
    if not piece:
        return False
    members = set(piece)
    if not all(_outlinable_op(n) for n in piece):
        return False
    if any(user not in members for n in piece for user in n.users):
        return False  # a value of the update is read after it (e.g. a shard to gather)
    inputs: list[torch.fx.Node] = []
    for n in piece:
        for source in n.all_input_nodes:
            if source not in members and source not in inputs:
                inputs.append(source)
    if not all(_static_tensor(n.meta.get("val")) for n in inputs):
        return False  # a symbolic size or another non-tensor input: keep it inline
    roots = [view_base(n) for n in inputs]
    if len(set(roots)) != len(roots):
        return False  # two inputs alias (views of one value that neither reads through the other)
    written = []
    for n in piece:
        for value in _written_inputs(n, members):
            if value not in written:
                written.append(value)
    if not written:
        return False
    read = [n for n in inputs if n not in written]
    sub, values = _subgraph(piece, written + read)
    key = outlined_update.graph_key(sub, values)
    outlined_update.register(key, sub)
    with graph.inserting_after(piece[-1]):
        call = graph.call_function(torch.ops.optpass.outlined_update.default,
                                   (key, written, read, _computed_before(written, piece, position)))
    position[call] = position[piece[-1]]
    call.meta["val"] = None
    call.meta[REGION_KEY] = UPDATE
    for n in reversed(piece):
        graph.erase_node(n)
    return True


# ops Inductor runs as a kernel of their own (extern), computed where they stand: their inputs are
# read there, so nothing after them can read an old value late
_COMPUTED_IN_PLACE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                      torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default,
                      torch.ops.aten.convolution_backward.default}


def _computed_before(written: list[torch.fx.Node], piece: list[torch.fx.Node], position: dict) -> list[torch.fx.Node]:
    """Values made before the piece from the old values of `written` and still alive after it.

    Inductor computes a pointwise value when a later node needs it: an opaque op that writes an
    input, lowered in between, would run first and the late computation read the new value (seen: a
    bf16 weight's ``dx = dy @ w`` with one output row, a pointwise product fused into a kernel after
    the update of ``w``). Each value on a path from an old value to a node after the piece, that is
    alive across it, is passed to the call so that Inductor computes it before: alive there anyway,
    so no lifetime grows. The walk stops at ops that run where they stand (GEMMs, convolutions)."""
    start = position[piece[0]]
    members = set(piece)
    alive_across, stack, seen = [], list(written), set()
    while stack:
        value = stack.pop()
        for user in value.users:
            if user in members or user in seen or position.get(user, start) >= start:
                continue
            seen.add(user)
            if user.op != "call_function" or user.target in _COMPUTED_IN_PLACE:
                continue
            if not is_view(user) and isinstance(user.meta.get("val"), torch.Tensor) and any(
                    u not in members and position.get(u, start) >= start for u in user.users):
                alive_across.append(user)
            else:
                stack.append(user)
    return sorted(alive_across, key=position.__getitem__)


def _subgraph(piece: list[torch.fx.Node], inputs: list[torch.fx.Node]):
    """The piece as a standalone aten GraphModule with canonical names; its example input values."""
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, n in enumerate(inputs):
        env[n] = sub.placeholder(f"in{i}")
    for n in piece:
        env[n] = sub.call_function(n.target, *torch.fx.map_arg((n.args, n.kwargs), env.__getitem__))
    sub.output(())
    gm = torch.fx.GraphModule(torch.nn.Module(), sub)
    return gm, [n.meta["val"] for n in inputs]
