"""Pass reshard_after_forward: backward gathers each fully sharded parameter again (ZeRO-3, not ZeRO-2).

Precondition: a step graph compiled with ``data_parallel="fsdp"``, whose model ``optpass.fully_shard``
sharded: forward reads each parameter through an all-gather of its shard (``all_gather_into_tensor``
of a parameter placeholder, ``wait_tensor``, a slice and a view to the parameter's shape:
``optpass/fsdp/gather.py``; under a mixed-precision policy the placeholder is first cast to the
policy's ``param_dtype``; a torchao float8 weight for FSDP2's float8 all-gather sends float8 bytes
cast from it with the scale of the ranks' amax, all-reduced), and backward reads the gathered value
again (a Linear's input gradient multiplies by its weight).
Rewrite: for each such gather whose parameter was sharded with ``reshard_after_forward=True``, a
copy of the whole chain (what computes the bytes sent from the shard, if anything, the all-gather,
its wait and the views) is put before the first backward
node that reads it, and every backward read is pointed at the copy. Then, on every backend but
gloo (``COALESCE_UNITS``), the gathers of one unit (``unit_of``: a block of a ModuleList/Sequential,
``model.layers.3``, else a parameter's module) that follow each other in forward, and again in
backward, become one ``all_gather_into_tensor_coalesced`` of their shards at the first one's place
(one collective per unit, as FSDP2's; every shard keeps its own output, so a parameter is still a
slice of it, no copy in the graph). Not on gloo: its coalesced all-gather goes through one flat
buffer of the whole unit and copies out of it, which raised the 8 x 2048^2 MLP's peak by one unit
(264.7 -> 280.6 MiB at 2 ranks) for no step time gained (``bench/fsdp.py``, docs/fsdp.md). Then
(``PREFETCH``) the gathers are prefetched one ahead, in forward and in backward: each all-gather
(each unit's) starts just before the previous one's first wait, so the next travels while this one
is used. On gloo too: there the shards' collectives run on a twin of the user's group with one
worker thread (``optpass.process_groups``), which runs them one after another; on gloo's usual two
threads, two collectives in flight with an all-gather among them corrupt the process's heap
(torch 2.13; docs/design.md §45).
Each reduce-scatter's wait (``DEFER_REDUCE_SCATTER_WAITS``) moves down to just before the next
reduce-scatter starts, with what reads its result (the division by the ranks, the shard's update
in backward): the gradient is reduced while backward makes the next one, where a wait right after
its start stalled backward on every gradient (on a 4-layer Llama, 2 gloo ranks, two runs back to
back: 999 -> 756 ms a step blocked in waits, step time -5%, the same peak; ``bench/fsdp.py``; docs/design.md §55).
A reduce-scatter still in flight at the graph's estimated peak (``WAIT_REDUCTIONS_BEFORE_GATHERS_AT_THE_PEAK``;
the estimate holds a collective's input alive until its wait) where a parameter's all-gather started
after it is waited for just before that gather instead: its input, the whole gradient, is freed
before the gathered parameter arrives (the norm pass's last gradient under clipping in backward, the
embedding's, was being reduced while the second backward gathered the head, both vocabulary-sized;
on gloo each collective also holds a scratch buffer of its size while it runs).
A parameter read by forward's last unit and by backward's first, with no other unit's parameter gathered
in between (``KEEP_GATHER_INTO_ADJACENT_BACKWARD``: a language model's head, an MLP's last layer),
is not gathered again for that first backward: forward's copy serves it, as FSDP2 keeps its root
unit's parameters from forward into backward; a regather would bring the same bytes back right
after they died, and a prefetched one arrived while forward's copy was still alive (the head twice
at the step's peak). A later backward (the clip's second pass) still gathers its own.
Backward's first read of each regathered parameter moves up to just after its other inputs
(``HOIST_FIRST_READER``): backward may make a weight's gradient before its input's gradient from
the same output gradient (a bias-free head's does), and the parameter gathered again for the input
gradient would then arrive beside that whole-parameter gradient (and gloo's copy of it while it
arrives): a language model's head-sized tensor more at the peak.
Under Inductor's lowering, each forward lookup in a gathered parameter (an embedding's rows) is also
copied into a buffer of its own (``optpass::clone_after``, ``MATERIALIZE_LOOKUPS``): Inductor computes
an index load where it is read, so the residual stream's adds and norms, in forward and in backward,
would each look the rows up again and keep the whole gathered parameter alive to the end of backward
(one vocabulary-sized tensor more at a language model's peak than the eager lowering holds).
Effect: a gathered parameter dies after its last forward use and lives again only around its
backward use, so at most the parameters in flight and in use are whole at any time (docs/design.md
§39: the one graph holds forward and backward, so this is the recompute decision, taken the same way
on every rank because every rank's graph is the same). One more all-gather per unit; numerics
unchanged (the same shards gathered twice). The gradients are reduce-scattered one by one, each as
soon as it is final.
Refuses: nothing; skips a step that gathers no sharded parameter.

    before:                                    after:
      ag = all_gather_into_tensor(w_shard)       ag = all_gather_into_tensor(w_shard)
      w = view(slice(wait_tensor(ag)))           w = view(slice(wait_tensor(ag)))
      y = mm(x, t(w))                            y = mm(x, t(w))
      ...                                        ...
      gx = mm(gy, w)     # w alive until here    ag2 = all_gather_into_tensor(w_shard)
                                                 w2 = view(slice(wait_tensor(ag2)))
                                                 gx = mm(gy, w2)
"""

from __future__ import annotations

import bisect
import operator

import torch
import torch.distributed as dist
import torch.fx

from optpass.errors import name_list
from optpass.fsdp.shard import shard_spec
from optpass.process_groups import backend_for_device
from optpass.passes._graph_utils import FIRST_BACKWARD, KEEP_EMITTED_ORDER
from optpass.step import BACKWARD, FORWARD, REGION_KEY, StepGraph, is_view

_c10d = torch.ops._c10d_functional
# Inductor keeps the order this pass emits: its locality reordering would move every gather next to
# its first use and its peak-memory reordering every wait next to its start (as for ZeRO-1, §25).
INDUCTOR_CONFIG = KEEP_EMITTED_ORDER

# Whether a unit's gathers become one coalesced all-gather: "auto" (every backend but gloo: above),
# True or False.
COALESCE_UNITS: bool | str = "auto"
# Whether each all-gather starts before the previous one's wait.
PREFETCH: bool = True
# Whether a lookup in a gathered parameter (an embedding) is copied into a buffer of its own under
# Inductor's lowering, so the gathered parameter dies after the lookup (``_materialize_lookups``).
MATERIALIZE_LOOKUPS: bool = True
# Whether backward's first read of a regathered parameter moves up to just after its other inputs
# (``_hoist``): before a weight gradient made from the same output gradient, not beside it.
HOIST_FIRST_READER: bool = True
# Whether a prefetched all-gather that is in flight at the step graph's estimated peak (its result
# alive there before anything reads it) starts after that peak instead (``_keep_prefetches_off_the_peak``).
KEEP_PREFETCH_OFF_THE_PEAK: bool = True
# Whether each reduce-scatter's wait (and what reads its result: the shard's update in backward)
# moves down to just before the next reduce-scatter starts (``_defer_reduce_scatter_waits``).
DEFER_REDUCE_SCATTER_WAITS: bool = True
# Whether a parameter read by forward's last unit and backward's first (a language model's head) keeps
# forward's gather for that first backward instead of being gathered again (``_adjacent``).
KEEP_GATHER_INTO_ADJACENT_BACKWARD: bool = True
# Whether a reduce-scatter still in flight at the estimated peak, where a parameter's all-gather
# started after it, is waited for just before that gather starts (``_wait_reductions_before_gathers``).
WAIT_REDUCTIONS_BEFORE_GATHERS_AT_THE_PEAK: bool = True


def settings(captured=None) -> tuple:
    """The module's switches and the units the user named (``fully_shard`` per block), for the
    compiled-graph cache's key: a graph rewritten under other switches or units must not be served
    from the cache."""
    named_units = sorted((p.name, spec.unit) for p in (captured.params if captured is not None else ())
                         if p.tensor is not None and (spec := shard_spec(p.tensor)) is not None
                         and spec.unit is not None)
    return (COALESCE_UNITS, PREFETCH, MATERIALIZE_LOOKUPS, HOIST_FIRST_READER, DEFER_REDUCE_SCATTER_WAITS,
            KEEP_PREFETCH_OFF_THE_PEAK, WAIT_REDUCTIONS_BEFORE_GATHERS_AT_THE_PEAK, KEEP_GATHER_INTO_ADJACENT_BACKWARD,
            tuple(named_units))


def run(step: StepGraph, options) -> str | None:
    if options.data_parallel != "fsdp":
        return "data_parallel is not 'fsdp'"
    gathers = parameter_gathers(step)
    if not gathers:
        return "the step gathers no parameter sharded by optpass.fully_shard"
    order = {node: i for i, node in enumerate(step.graph.nodes)}
    regathered, hoisted, kept_across = [], [], []
    unit_gathered = {start: unit_of(name, spec) for start, name, spec in gathers}
    for start, name, spec in gathers:
        if not spec.reshard_after_forward:
            continue
        for copy in _regather_for_backward(step, start, order, hoisted.append, name, unit_gathered,
                                           kept_across.append) or ():
            regathered.append((copy, name))
            unit_gathered[copy] = unit_gathered[start]
        order = {node: i for i, node in enumerate(step.graph.nodes)}   # a reader may have moved up
    looked_up = (_materialize_lookups(step, gathers, order)
                 if options.lower == "inductor" and MATERIALIZE_LOOKUPS else [])
    on_gloo = _on_gloo(gathers[0][2], gathers[0][0])
    coalesce = not on_gloo if COALESCE_UNITS == "auto" else bool(COALESCE_UNITS)
    prefetch = bool(PREFETCH)
    specs = {name: spec for _, name, spec in gathers}
    forward_units = _gather_units(step, [(start, name) for start, name, _ in gathers], coalesce, specs)
    backward_units = _gather_units(step, regathered, coalesce, specs)
    if prefetch:
        prefetched = _prefetch_one_ahead(step, forward_units) + _prefetch_one_ahead(step, backward_units)
        if KEEP_PREFETCH_OFF_THE_PEAK:
            _keep_prefetches_off_the_peak(step, prefetched)
    if DEFER_REDUCE_SCATTER_WAITS:
        _defer_reduce_scatter_waits(step)
    waited_early = (_wait_reductions_before_gathers(step, set(forward_units) | set(backward_units))
                    if WAIT_REDUCTIONS_BEFORE_GATHERS_AT_THE_PEAK else [])
    kept = [name for _, name, spec in gathers if not spec.reshard_after_forward]
    reduced = sum(1 for n in step.graph.nodes if n.target is _c10d.reduce_scatter_tensor.default)
    per = (f"one per unit: {_names(forward_units.values())}" if coalesce else
           "one per parameter: units are coalesced on every backend but gloo")
    when = ("each started before the previous one's wait" if prefetch else
            "each started after the previous one's wait (PREFETCH off)")
    step.notes.append(f"all-gathered in forward just before first use, {len(forward_units)} collective(s) for "
                      f"{len(gathers)} parameters ({per}), {when}: "
                      f"{_names(name for _, name, _ in gathers)}")
    step.notes.append(f"all-gathered again in backward just before backward reads them (the forward's copy "
                      f"died after its last forward use), {len(backward_units)} collective(s): "
                      f"{_names(name for _, name in regathered) or 'none'}")
    if hoisted:
        step.notes.append(f"backward's first read moved up to just after its other inputs, so the parameter is "
                          f"gathered, read and freed before the gradients made from the same output gradient: "
                          f"{_names(hoisted)}")
    if looked_up:
        step.notes.append(f"rows looked up in a gathered parameter made a buffer of their own (Inductor would "
                          f"look them up again in every later kernel that reads them, keeping the whole "
                          f"parameter alive through backward): {_names(looked_up)}")
    if kept_across:
        step.notes.append(f"kept from forward into backward, which reads it next with no other unit's parameter "
                          f"gathered in between (no regather): {_names(kept_across)}")
    if waited_early:
        step.notes.append(f"reduce-scatter(s) in flight at the step's estimated peak waited for before the "
                          f"all-gather that started after them, so the whole gradient each holds is freed "
                          f"before the gathered parameter arrives: {_names(waited_early)}")
    if kept:
        step.notes.append(f"kept from forward to backward (reshard_after_forward=False): {_names(kept)}")
    step.notes.append(f"reduce-scattered onto this rank's shard as each gradient is final in backward: "
                      f"{reduced} reduce-scatter(s)" + (", each waited for just before the next one starts"
                                                        if DEFER_REDUCE_SCATTER_WAITS else ""))
    step.graph.lint()
    return None


def _prelude(start: torch.fx.Node, placeholders, source: torch.fx.Node | None = None
             ) -> tuple[torch.fx.Node | None, list[torch.fx.Node]]:
    """The parameter placeholder an all-gather sends (``source``: one of a coalesced one's inputs)
    and the nodes that compute what it sends from it, in graph order: none for a plain shard; its
    cast to a mixed-precision policy's param_dtype; for a float8 all-gather (``optpass.fsdp.gather``)
    the shard's amax, its all-reduce, the scale and the cast to float8 bytes. (None, []) when what it
    sends is not computed from one parameter placeholder alone."""
    source = start.args[0] if source is None else source
    if not isinstance(source, torch.fx.Node):
        return None, []
    found, nodes, frontier = set(), {}, [source]
    while frontier:
        node = frontier.pop()
        if node in nodes or node in found:
            continue
        if node.op == "placeholder":
            if node not in placeholders:
                return None, []
            found.add(node)
            continue
        if node.op != "call_function":
            return None, []
        nodes[node] = None
        frontier.extend(node.all_input_nodes)
    if len(found) != 1:
        return None, []
    if not nodes:                       # a plain shard: no graph order to compute
        return found.pop(), []
    order = {node: i for i, node in enumerate(start.graph.nodes)}
    return found.pop(), sorted(nodes, key=lambda n: order[n])


def parameter_gathers(step: StepGraph) -> list[tuple[torch.fx.Node, str, object]]:
    """(all_gather node, parameter name, ShardSpec) for each forward all-gather of a sharded
    parameter's placeholder (or of its cast to the policy's param_dtype), in graph order."""
    tensors = {p.name: p.tensor for p in step.captured.params if p.tensor is not None}
    by_placeholder = {node: name for name, node in step.param_nodes.items()}
    found = []
    for node in step.graph.nodes:
        if node.target is not _c10d.all_gather_into_tensor.default or step.region_of(node) != FORWARD:
            continue
        placeholder, _ = _prelude(node, by_placeholder)
        name = by_placeholder.get(placeholder)
        spec = shard_spec(tensors.get(name)) if name is not None else None
        if spec is not None:
            found.append((node, name, spec))
    return found


def unit_of(name: str, spec=None) -> str:
    """The unit a parameter is gathered with: the block the user called ``fully_shard`` on before
    the whole model (``spec.unit``: FSDP2's per-block calls), else its name up to the first index of
    a ModuleList or Sequential (a transformer block, ``model.layers.3``; a Sequential's layer, ``0``),
    else its module's name (``lm_head``, ``model.norm``)."""
    if spec is not None and spec.unit is not None:
        return spec.unit
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1])


def _first_wait(start: torch.fx.Node, order: dict) -> torch.fx.Node | None:
    """The first wait on an all-gather's result (on any of a coalesced one's results)."""
    outputs = [start] if start.target is _c10d.all_gather_into_tensor.default else \
        [u for u in start.users if u.target is operator.getitem]
    waits = [w for out in outputs for w in out.users if w.target is _c10d.wait_tensor.default]
    return min(waits, key=lambda n: order[n]) if waits else None


def _on_gloo(spec, start: torch.fx.Node) -> bool:
    return backend_for_device(dist.get_backend(spec.group), start.meta["val"].device.type) == "gloo"


def _gather_units(step: StepGraph, starts: list[tuple[torch.fx.Node, str]], coalesce: bool,
                  specs: dict) -> dict[torch.fx.Node, str]:
    """With ``coalesce``, merge each run of all-gathers (in graph order) of one unit, one dtype and
    one group into one ``all_gather_into_tensor_coalesced`` at the run's first; {collective: unit},
    in graph order."""
    order = {node: i for i, node in enumerate(step.graph.nodes)}
    starts = sorted(starts, key=lambda item: order[item[0]])
    if not coalesce:
        return {start: name for start, name in starts}
    runs: list[tuple[tuple, list[torch.fx.Node]]] = []      # (unit, dtype, world, group), its gathers
    for start, name in starts:
        key = (unit_of(name, specs.get(name)), start.meta["val"].dtype, start.args[1], start.args[2])
        if runs and runs[-1][0] == key:
            runs[-1][1].append(start)
        else:
            runs.append((key, [start]))
    return {(_coalesce(step, members) if len(members) > 1 else members[0]): key[0] or "(root)"
            for key, members in runs}


def _coalesce(step: StepGraph, members: list[torch.fx.Node]) -> torch.fx.Node:
    """One coalesced all-gather of the members' shards, placed at the first member; each member's
    wait reads its own output."""
    graph, first = step.graph, members[0]
    with graph.inserting_before(first):
        merged = graph.call_function(_c10d.all_gather_into_tensor_coalesced.default,
                                     ([m.args[0] for m in members], first.args[1], first.args[2]))
        merged.meta.update(first.meta)
        merged.meta["val"] = [m.meta["val"] for m in members]
        for k, member in enumerate(members):
            item = graph.call_function(operator.getitem, (merged, k))
            item.meta.update(member.meta)
            member.replace_all_uses_with(item)
    for member in members:
        graph.erase_node(member)
    return merged


def _chain(wait: torch.fx.Node) -> list[torch.fx.Node]:
    """The wait and every view of it (views of views too), in graph order."""
    chain, frontier = [wait], [wait]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if is_view(user) and user.args and user.args[0] is node and user not in chain:
                chain.append(user)
                frontier.append(user)
    return chain


def _regather_for_backward(step: StepGraph, start: torch.fx.Node, order: dict, hoisted, name: str,
                           unit_gathered: dict, kept_across) -> list[torch.fx.Node] | None:
    wait = _first_wait(start, order)
    if wait is None:
        return None
    chain = sorted(_chain(wait), key=lambda n: order[n])
    members = set(chain)
    readers = {(node, user) for node in chain for user in node.users
               if user not in members and step.region_of(user) == BACKWARD}
    if not readers:
        return None
    # A norm-only first backward (clip_grad_norm, grad_scaler in backward) reads the parameter in
    # a backward of its own: it gets a gather of its own, so none lives from one backward to the next.
    first_pass = set(getattr(step.context.get(FIRST_BACKWARD), "copies", {}).values())
    starts, earliest = [], True
    for cluster in (True, False):
        mine = {(node, user) for node, user in readers if (user in first_pass) is cluster}
        if not mine:
            continue
        first = min((user for _, user in mine), key=lambda n: order[n])
        keep = (KEEP_GATHER_INTO_ADJACENT_BACKWARD and earliest
                and _adjacent(start, chain, first, order, unit_gathered, step))
        earliest = False                # only the backward that reads it first can follow forward
        if keep:
            kept_across(name)           # that backward's reads use forward's copy: no regather
            continue
        if HOIST_FIRST_READER and _hoist(first, members, step):
            hoisted(name)
        mapping: dict[torch.fx.Node, torch.fx.Node] = {}
        with step.graph.inserting_before(first):
            # backward casts its own copy (to param_dtype, or to float8): none lives from forward
            for node in _prelude(start, step.param_nodes.values())[1]:
                mapping[node] = step.graph.node_copy(node, lambda n: mapping.get(n, n))
            mapping[start] = step.graph.node_copy(start, lambda n: mapping.get(n, n))
            for node in chain:
                mapping[node] = step.graph.node_copy(node, lambda n: mapping.get(n, n))
        for node in mapping.values():
            node.meta[REGION_KEY] = BACKWARD
        for node, user in mine:
            user.replace_input_with(node, mapping[node])
        starts.append(mapping[start])
    for node in reversed(chain):      # views of the forward's gather that only backward read: now read by none
        if is_view(node) and not node.users:
            step.graph.erase_node(node)
    return starts


def _adjacent(start: torch.fx.Node, chain: list, first_backward_reader: torch.fx.Node, order: dict,
              unit_gathered: dict, step: StepGraph) -> bool:
    """Whether no other unit's parameter is gathered (``unit_gathered``: each parameter gather and
    its unit) between forward's last read of this gather and backward's first read of it (a Float8
    Linear's bias, gathered after its weight's GEMM, is of the same unit). Then the last unit of
    forward is the first of backward (a language model's head): a regather would bring the same
    parameter back right after it died, and a prefetched one would arrive while forward's copy is
    still alive (two copies of the head at the step's peak, measured on a Llama on dp 2 x tp 2).
    FSDP2 keeps its root unit's parameters gathered from forward into backward for the same reason."""
    members = set(chain)
    forward_reads = [order[user] for node in chain for user in node.users
                     if user not in members and step.region_of(user) != BACKWARD]
    if not forward_reads:
        return False
    last_forward, first, unit = max(forward_reads), order[first_backward_reader], unit_gathered.get(start)
    return not any(last_forward < order[other] < first for other, other_unit in unit_gathered.items()
                   if other_unit != unit and other in order)


def _hoist(reader: torch.fx.Node, gathered: set, step: StepGraph) -> bool:
    """Move `reader` (backward's first read of a gathered parameter) up to just after the latest
    node it must follow: one of its inputs other than the gathered chain, or a node with an effect
    (a mutation, a collective, an optpass op, anything impure), or the start of backward. Backward
    computes a weight's gradient and its input's gradient from one output gradient in either order;
    when the weight's gradient comes first, the regathered parameter (and gloo's copy while it
    arrives) would be gathered beside that whole-parameter gradient. Read first, the parameter is
    gathered, read and freed before the gradient is made. Whether it moved past a computation (views
    of the gathered parameter, which backward's copy replaces, do not count).

    A view of the parameter as the first read (``t(W)`` before ``mm(dY, t(W))``) computes nothing:
    the view chain moves down to its reader, that reader is what moves up, and the chain lands just
    before it; alone, a view has no other input and would rise to the start of backward, taking the
    regather with it, beside the forward's own gathered copy and the loss. A chain read by more than
    one node stays where it is, unhoisted."""
    views = []
    while is_view(reader) and _movable(reader) and len(reader.users) == 1:
        views.append(reader)
        reader = next(iter(reader.users))
    if views and is_view(reader):
        return False
    if views:
        for view in views:
            reader.prepend(view)
        passed = _hoist(reader, gathered | set(views), step)
        for view in views:
            reader.prepend(view)
        return passed
    if not _movable(reader):
        return False
    inputs = set(reader.all_input_nodes) - gathered
    place, passed = reader.prev, False
    while place.op == "call_function" and place not in inputs and _movable(place) \
            and step.region_of(place) == BACKWARD:
        passed = passed or place not in gathered
        place = place.prev
    if place is not reader.prev:
        place.append(reader)
    return passed


def _movable(node: torch.fx.Node) -> bool:
    """A pure computation: no effect, no collective, no optpass op (whose order may be its point)."""
    target = node.target
    if node.op != "call_function" or node.is_impure() or not isinstance(target, torch._ops.OpOverload):
        return False
    return target.namespace not in ("_c10d_functional", "optpass", "c10d") and not target._schema.is_mutable


# Ops that read rows of their first argument at indices: Inductor inlines them into their readers.
_LOOKUPS = {torch.ops.aten.embedding.default, torch.ops.aten.index.Tensor, torch.ops.aten._unsafe_index.Tensor,
            torch.ops.aten.index_select.default}


def _materialize_lookups(step: StepGraph, gathers, order: dict) -> list[str]:
    """Make each forward lookup in a gathered parameter (an embedding) a buffer of its own.

    Inductor computes an index load where it is read, so a lookup's readers (the residual stream's
    adds and norms, in forward and in backward) each look the rows up again in the gathered
    parameter, which then lives until the last of them, in backward: a whole vocabulary-sized
    parameter beside the backward's peak, for a [tokens, d] activation. An opaque copy of the lookup
    (``optpass::clone_after`` with nothing to wait for) makes Inductor write the rows once; the gathered
    parameter's last reader is then the lookup. Returns the parameters whose lookups were copied."""
    from optpass.kernels import after  # noqa: F401  (registers optpass::clone_after)

    names = []
    for start, name, _ in gathers:
        wait = _first_wait(start, order)
        if wait is None:
            continue
        lookups = [user for node in _chain(wait) for user in node.users
                   if user.target in _LOOKUPS and user.args[0] is node and step.region_of(user) == FORWARD]
        for lookup in lookups:
            with step.graph.inserting_after(lookup):
                rows = step.emit(torch.ops.optpass.clone_after.default, lookup, [])
            rows.meta[REGION_KEY] = FORWARD
            lookup.replace_all_uses_with(rows, delete_user_cb=lambda user, rows=rows: user is not rows)
        if lookups:
            names.append(name)
    return names


def _prefetch_one_ahead(step: StepGraph, starts) -> list[tuple[torch.fx.Node, list[torch.fx.Node], torch.fx.Node]]:
    """Start each all-gather (in graph order) just before the previous one's first wait, where that
    wait comes before it (its inputs are placeholders, or computed from them alone: a cast to the
    policy's param_dtype, a float8 cast with its amax's all-reduce; these move along, so it may
    start anywhere; a coalesced one takes its results' getitems along). Returns each gather moved,
    its nodes (prelude, start, getitems) in graph order, and the gather it was moved ahead of."""
    order = {node: i for i, node in enumerate(step.graph.nodes)}
    placeholders = set(step.param_nodes.values())
    starts = sorted(starts, key=lambda n: order[n])
    moved = []
    for previous, start in zip(starts, starts[1:]):
        wait = _first_wait(previous, order)
        if wait is not None and order[wait] < order[start]:
            sources = start.args[0] if isinstance(start.args[0], (list, tuple)) else [start.args[0]]
            preludes = {n for source in sources for n in _prelude(start, placeholders, source)[1]
                        if order[n] > order[wait]}
            items = [u for u in start.users if u.target is operator.getitem]
            nodes = [*sorted(preludes, key=lambda n: order[n]), start, *sorted(items, key=lambda n: order[n])]
            for node in nodes:
                wait.prepend(node)
            moved.append((start, nodes, previous))
    return moved


def _keep_prefetches_off_the_peak(step: StepGraph, prefetched, rounds: int = 64) -> None:
    """A prefetch must not make the step's peak once the unit it overlaps is done: while the
    graph's estimated peak (liveness, ``estimate_peak_memory``) falls where a prefetched all-gather
    is in flight (started, its result not yet read) and after the last read of the unit it was
    moved ahead of, that gather (with its prelude and getitems) starts just after the peak instead.

    Prefetching one ahead starts a unit's gather at the previous unit's first wait, to travel while
    that unit computes. Where something that is no gathered unit runs after it (the norm pass's
    embedding gradient under clipping in backward, vocabulary-sized), the gather would sit beside
    it: on a 132M Llama on dp 2 x tp 2, the second backward's first gather (the head's shard, 31 MiB)
    was alive at the step's peak. A peak while the previous unit still computes is what
    prefetching costs, and stays. Starting a gather later only shortens its result's life, so no
    point of the timeline rises; each round lowers the peak by one gather or ends."""
    for _ in range(rounds):
        nodes, order, peak = _estimated_peak(step)
        if peak is None:
            return
        in_flight = []
        for start, group, previous in prefetched:
            wait = _first_wait(start, order)
            if (wait is not None and order[start] < order[peak] < order[wait] and peak not in group
                    and _last_reader(previous, order) < order[peak]):
                in_flight.append(group)
        if not in_flight:
            return
        for group in in_flight:
            anchor = peak
            for node in group:
                anchor.append(node)
                anchor = node


def _last_reader(start: torch.fx.Node, order: dict) -> int:
    """The position of the last node that reads what an all-gather gathered (through its waits,
    getitems and views)."""
    last, frontier, seen = order[start], [start], {start}
    while frontier:
        for user in frontier.pop().users:
            last = max(last, order[user])
            if user not in seen and (user.target in (operator.getitem, _c10d.wait_tensor.default) or is_view(user)):
                seen.add(user)
                frontier.append(user)
    return last


def _defer_reduce_scatter_waits(step: StepGraph) -> None:
    """Each reduce-scatter's wait, and every node after it that reads its result up to the next
    reduce-scatter's start (the division by the ranks, the update in backward, a norm's square-sum),
    moves to just before that start: the reduced gradient travels while backward makes the next
    one. Its input (the full gradient) lives that much longer; only later, never earlier: a shard's
    update still follows every read of the shard."""
    starts = [n for n in step.graph.nodes if n.target is _c10d.reduce_scatter_tensor.default]
    # numbered once: a node moved lands just before ``following``, still before every later start,
    # and never among a later wait's users (they come after that wait), so the numbers stay right
    # for every comparison below
    order = {node: i for i, node in enumerate(step.graph.nodes)}
    for start, following in zip(starts, starts[1:]):
        waits = [u for u in start.users if u.target is _c10d.wait_tensor.default]
        if len(waits) != 1 or order[waits[0]] > order[following]:
            continue
        moved, frontier = {waits[0]}, [waits[0]]
        while frontier:
            for user in frontier.pop().users:
                if user not in moved and order[user] < order[following] and user.op != "output":
                    moved.add(user)
                    frontier.append(user)
        for node in sorted(moved, key=order.__getitem__):
            following.prepend(node)


def _wait_reductions_before_gathers(step: StepGraph, gathers: set, rounds: int = 32) -> list[str]:
    """Where the graph's estimated peak (liveness, a collective's input held until its wait) falls
    while a reduce-scatter is in flight and a parameter's all-gather started after it, the
    reduce-scatter's wait moves up to just before that all-gather starts.

    A reduce-scatter's input is the whole gradient, held by the collective until it completes; a
    deferred wait (``_defer_reduce_scatter_waits``) keeps it so while backward goes on, and a
    gather prefetched meanwhile brings a whole parameter beside it (on gloo, each also with a
    scratch buffer of its full size while it runs). Measured on a Llama's step on dp 2 x tp 2 with
    clipping in backward: the norm pass's last gradient, the embedding's, was being reduced when
    the second backward gathered the head, both vocabulary-sized, at the step's peak. Waiting
    earlier only shortens the input's life (what reads the result stays where it was), so no point
    of the timeline rises; the cost is that backward waits for that one reduction there. Returns
    the reduce-scatters waited for earlier."""
    moved = []
    for _ in range(rounds):
        nodes, order, peak = _estimated_peak(step, collective_inputs_until_wait=True)
        if peak is None:
            break
        gathered_at = sorted(order[g] for g in gathers if g in order)
        changed = False
        for start in nodes[:order[peak]]:
            if start.target is not _c10d.reduce_scatter_tensor.default:
                continue
            waits = [u for u in start.users if u.target is _c10d.wait_tensor.default]
            if len(waits) != 1 or order[waits[0]] <= order[peak]:
                continue
            # the first parameter gather after the reduce-scatter's start, up to the peak
            after = bisect.bisect_right(gathered_at, order[start])
            if after < len(gathered_at) and gathered_at[after] <= order[peak]:
                nodes[gathered_at[after]].prepend(waits[0])
                moved.append(start.name)
                changed = True
        if not changed:
            break
    return moved


def _estimated_peak(step: StepGraph, **estimate_options) -> tuple[list, dict, torch.fx.Node | None]:
    """The graph's nodes, their positions, and the node where its estimated peak
    (``estimate_peak_memory`` with ``estimate_options``) is reached (None for an empty graph)."""
    from optpass.analysis.memory import estimate_peak_memory

    nodes = list(step.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    estimate = estimate_peak_memory(step.graph, **estimate_options)
    return nodes, order, next((n for n in nodes if n.name == estimate.peak_node), None)


def _names(names, most: int = 8) -> str:
    return name_list(list(dict.fromkeys(names)), most)
