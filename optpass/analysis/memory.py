"""Peak memory of an FX graph, estimated from the liveness of its buffers.

The graph is run in order on paper. Each node either allocates new buffers or
refers to buffers that already exist; a buffer is freed right after the last
node that uses it, directly or through any alias. The estimate is what the
graph's own code would hold if every buffer were freed at that point, which is
what FX's generated code (``x = None`` after last use) and Inductor aim for.

What counts:

* **Sizes** come from ``node.meta['val']`` (FakeTensor or Tensor, or a
  list/tuple of them for multi-output ops such as ``_foreach_norm`` or
  ``var_mean``), else ``node.meta['example_value']`` (Dynamo graphs). A tensor
  weighs its untyped storage's ``nbytes()``, falling back to
  ``numel * element_size``. Symbolic sizes use their hint, without adding
  guards; a size with no hint weighs 0. Nodes without either meta entry
  allocate nothing.
* **Views allocate nothing.** A functional collective's ``wait_tensor`` neither: it returns the
  buffer its collective allocated. For other OpOverloads the schema decides: a return
  with alias info aliases the argument in the same alias set, whether it is a
  view (``aten.view``, ``t``, ``expand``, ``reshape``...) or an in-place/out
  write (``add_``, ``copy_``, ``add.out``); ``_unsafe_view`` has no alias info
  and so is a new buffer. Ops that return nothing (``_foreach_mul_``)
  allocate nothing. A view keeps its base alive until the view's last use.
* **getitem** picks the element's buffers out of a multi-output node; all of
  them live until the last getitem, as the tuple does in generated code.
  getitem on a tensor is basic indexing (a view), unless the index holds a
  tensor (advanced indexing: a copy).
* **Other targets** (Dynamo's torch functions, ``call_method``,
  ``call_module``) allocate new buffers, except obvious views (``view``, ``t``,
  ``permute``, ``transpose``, ``expand``, ``detach``, ``__getitem__``...) and
  in-place calls named with a trailing underscore (``add_``,
  ``torch._foreach_mul_``), which alias their first argument.
* **Inputs**: placeholders and ``get_attr`` tensors (module state) exist before
  the graph starts and live to its end, since the caller holds them; with
  ``count_inputs=False`` they, and anything aliasing them, weigh nothing.
  Graph outputs live to the end.

``timeline[i]`` is what is live right after node ``i`` runs, before its dead
inputs are freed: the node's inputs and its new outputs both count, and a
buffer nobody uses counts at its own node only. The peak is the timeline's
maximum (the first node reaching it). Cost is linear in nodes plus buffers.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

import torch
import torch.fx

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint as _optimization_hint
except ImportError:  # older torch: fall back on the SymNode's own hint
    _optimization_hint = None

_UNTAGGED = "other"
_MIB = 1 << 20

# Tensor methods and torch functions that return a view of their first argument.
_VIEW_NAMES = frozenset({
    "view", "view_as", "t", "permute", "transpose", "swapaxes", "movedim",
    "expand", "expand_as", "detach", "unsqueeze", "squeeze", "narrow",
    "select", "as_strided", "unflatten", "unfold", "diagonal", "split", "chunk",
    "unbind", "real", "imag", "view_as_real", "view_as_complex", "__getitem__",
})

# `x += y` on tensors, as Dynamo records it.
_IN_PLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
})

Tagger = Callable[[torch.fx.Node], "str | None"]


@dataclasses.dataclass
class MemoryEstimate:
    """The liveness-based peak of an FX graph (``estimate_peak_memory``); ``print()`` it.

    Attributes:
        peak_bytes: the bytes live at the peak.
        peak_node: the name of the first node at which the peak is reached ("" for an empty graph).
        live_at_peak: the buffers live at the peak, largest first, as (allocating node, bytes, tag).
        timeline: (node name, bytes live right after it runs) for every node, in graph order.
        bytes_by_tag_at_peak: the bytes live at the peak per tag (untagged buffers under "other").
    """

    peak_bytes: int
    peak_node: str
    live_at_peak: list[tuple[str, int, str | None]]  # (allocating node, bytes, tag), largest first
    timeline: list[tuple[str, int]]                   # (node, live bytes right after it), every node
    bytes_by_tag_at_peak: dict[str, int]

    def largest(self, k: int = 5) -> list[tuple[str, int, str | None]]:
        """The largest buffers live at the peak.

        Args:
            k: how many.

        Returns:
            Up to ``k`` (allocating node, bytes, tag) tuples, largest first.
        """
        return self.live_at_peak[:k]

    def __str__(self) -> str:
        lines = [
            f"peak {self.peak_bytes / _MIB:.2f} MiB ({self.peak_bytes} bytes)"
            f" after {self.peak_node or '(empty graph)'}, {len(self.live_at_peak)} tensors live"
        ]
        for name, nbytes, tag in self.largest(5):
            tag_text = f"  [{tag}]" if tag else ""
            lines.append(f"  {_readable_bytes(nbytes):>10}  {name}{tag_text}")
        return "\n".join(lines)


def _readable_bytes(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def estimate_peak_memory(
    graph_or_gm: torch.fx.Graph | torch.fx.GraphModule,
    *,
    count_inputs: bool = True,
    tag: Tagger | None = None,
    collective_inputs_until_wait: bool = False,
) -> MemoryEstimate:
    """Liveness-based peak of the bytes the graph holds; see the module docstring.

    The graph is run in order on paper: each node allocates new buffers or aliases existing ones,
    and a buffer is freed right after the last node that uses it, directly or through an alias.

    Args:
        graph_or_gm: the graph, or a GraphModule whose ``graph`` is estimated.
        count_inputs: count placeholders and ``get_attr`` tensors (which live for the whole graph);
            False weighs them, and anything aliasing them, as nothing.
        tag: a function from a node to a tag (or None) for the buffers it allocates; the estimate
            sums the bytes live at the peak per tag. None: no tags.
        collective_inputs_until_wait: a functional collective's inputs stay alive until its
            ``wait_tensor`` (the collective's work holds them until it completes, on every backend:
            a reduce-scatter's whole gradient lives until its wait, not until its start).

    Returns:
        A ``MemoryEstimate``: the peak, the node where it is reached, the buffers live there, and
        the whole timeline.
    """
    graph = graph_or_gm.graph if isinstance(graph_or_gm, torch.fx.GraphModule) else graph_or_gm
    nodes = list(graph.nodes)
    if not nodes:
        return MemoryEstimate(0, "", [], [], {})

    buffers = _Buffers(tag)
    values: dict[torch.fx.Node, _Value] = {}
    for index, node in enumerate(nodes):
        values[node] = _value_of(node, index, values, buffers, count_inputs)

    end = len(nodes) - 1
    for buffer in buffers.all:
        if buffer.is_input:
            buffer.freed_after = end
    # A node's value keeps every buffer it refers to alive until the node's last
    # user; going by node first keeps this linear for wide multi-output nodes.
    position = {node: index for index, node in enumerate(nodes)}
    held_until = _collective_waits(nodes, position) if collective_inputs_until_wait else {}
    for node, value in values.items():
        if not node.users:
            continue
        last_user = max(held_until.get(user, position[user]) for user in node.users)
        for buffer_id in value.refs:
            buffer = buffers.all[buffer_id]
            buffer.freed_after = max(buffer.freed_after, last_user)

    change = [0] * (len(nodes) + 1)
    for buffer in buffers.all:
        change[buffer.allocated_at] += buffer.nbytes
        change[buffer.freed_after + 1] -= buffer.nbytes
    timeline = []
    live = 0
    for index, node in enumerate(nodes):
        live += change[index]
        timeline.append((node.name, live))

    peak_index = max(range(len(nodes)), key=lambda i: (timeline[i][1], -i))
    # Ties keep allocation order, so the listing is stable.
    live_buffers = sorted(
        (b for b in buffers.all if b.allocated_at <= peak_index <= b.freed_after and b.nbytes > 0),
        key=lambda b: -b.nbytes,
    )
    by_tag: dict[str, int] = {}
    for buffer in live_buffers:
        key = buffer.tag if buffer.tag is not None else _UNTAGGED
        by_tag[key] = by_tag.get(key, 0) + buffer.nbytes
    return MemoryEstimate(
        peak_bytes=timeline[peak_index][1],
        peak_node=nodes[peak_index].name,
        live_at_peak=[(b.name, b.nbytes, b.tag) for b in live_buffers],
        timeline=timeline,
        bytes_by_tag_at_peak=by_tag,
    )


def _collective_waits(nodes: list[torch.fx.Node], position: dict) -> dict[torch.fx.Node, int]:
    """Each functional collective start -> the position of its last ``wait_tensor`` (through the
    getitems of a coalesced one), where it is later than the start."""
    held = {}
    for node in nodes:
        if (node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload)
                or node.target.namespace != "_c10d_functional" or node.target._schema.name in _RETURNS_ITS_INPUT):
            continue
        results = [node] + [u for u in node.users if u.target is operator.getitem]
        waits = [position[w] for r in results for w in r.users if w.target is torch.ops._c10d_functional.wait_tensor.default]
        if waits and max(waits) > position[node]:
            held[node] = max(waits)
    return held


# --- buffers and the values that refer to them -------------------------------


@dataclasses.dataclass
class _Buffer:
    name: str
    nbytes: int
    tag: str | None
    allocated_at: int
    freed_after: int
    is_input: bool


@dataclasses.dataclass
class _Value:
    """The buffers a node's result keeps alive, and per element for tuple/list results."""

    refs: list[int]
    parts: list["_Value"] | None = None


_NOTHING = _Value([])


class _Buffers:
    def __init__(self, tag: Tagger | None):
        self.all: list[_Buffer] = []
        self._tag = tag
        self._tags: dict[torch.fx.Node, str | None] = {}

    def allocate(
        self, node: torch.fx.Node, index: int, example: Any, *, is_input: bool = False, name: str | None = None
    ) -> _Value:
        """A value with a new buffer for every tensor in `example`, named after `node`."""
        name = name or node.name
        if isinstance(example, torch.Tensor):
            # Inputs exist before the graph starts: the caller holds them.
            allocated_at = 0 if is_input else index
            nbytes = tensor_bytes(example)
            self.all.append(_Buffer(name, nbytes, self._tag_of(node), allocated_at, allocated_at, is_input))
            return _Value([len(self.all) - 1])
        if isinstance(example, (list, tuple)):
            return _combined([
                self.allocate(node, index, e, is_input=is_input, name=f"{name}[{i}]") for i, e in enumerate(example)
            ])
        return _NOTHING

    def _tag_of(self, node: torch.fx.Node) -> str | None:
        if self._tag is None:
            return None
        if node not in self._tags:
            self._tags[node] = self._tag(node)
        return self._tags[node]


def _combined(parts: list[_Value]) -> _Value:
    return _Value([ref for part in parts for ref in part.refs], parts)


def _example(node: torch.fx.Node) -> Any:
    if "val" in node.meta:
        return node.meta["val"]
    return node.meta.get("example_value")


# --- what each node's result is ----------------------------------------------


def _value_of(node, index, values, buffers: _Buffers, count_inputs: bool) -> _Value:
    if node.op in ("placeholder", "get_attr"):
        if not count_inputs:
            return _NOTHING
        return buffers.allocate(node, index, _example(node), is_input=True)
    if node.op == "output":
        return _NOTHING

    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        return _op_overload_value(node, index, values, buffers)
    if node.op == "call_function" and target is operator.getitem:
        return _getitem_value(node, index, values, buffers)

    name = target if node.op == "call_method" else getattr(target, "__name__", None)
    if node.op == "call_module" or not isinstance(name, str) or not node.args:
        return buffers.allocate(node, index, _example(node))
    is_torch_function = (
        node.op == "call_method" or getattr(torch, name, None) is target or getattr(torch.Tensor, name, None) is target
    )
    if name in _VIEW_NAMES and is_torch_function:
        return _alias_of(node.args[0], _example(node), values)
    if _is_in_place(name, target):
        return _alias_of(node.args[0], _example(node), values)
    return buffers.allocate(node, index, _example(node))


def _is_in_place(name: str, target: Any) -> bool:
    if any(target is op for op in _IN_PLACE_OPERATORS):
        return True
    return name.endswith("_") and not name.endswith("__")


# Ops whose result is their first argument's buffer though the schema says nothing of it: a functional
# collective's wait returns the tensor the collective allocated.
_RETURNS_ITS_INPUT = ("_c10d_functional::wait_tensor",)


def _op_overload_value(node, index, values, buffers: _Buffers) -> _Value:
    schema = node.target._schema
    if schema.name in _RETURNS_ITS_INPUT and node.args and isinstance(node.args[0], torch.fx.Node):
        return _alias_of(node.args[0], _example(node), values)
    returns = schema.returns
    if not returns:
        return _NOTHING
    if all(r.alias_info is None for r in returns):
        return buffers.allocate(node, index, _example(node))

    example = _example(node)
    if len(returns) == 1:
        return _return_value(node, returns[0], example, index, values, buffers)
    examples = example if isinstance(example, (list, tuple)) else [None] * len(returns)
    parts = [
        _return_value(node, r, e, index, values, buffers, name=f"{node.name}[{i}]")
        for i, (r, e) in enumerate(zip(returns, examples))
    ]
    return _combined(parts)


def _return_value(node, returned, example, index, values, buffers: _Buffers, name=None) -> _Value:
    if returned.alias_info is None:
        return buffers.allocate(node, index, example, name=name)
    aliased = _aliased_argument(node, returned.alias_info)
    return _alias_of(aliased, example, values)


def _aliased_argument(node: torch.fx.Node, alias_info) -> Any:
    """The argument a schema return aliases: the one sharing its alias set."""
    schema = node.target._schema
    annotated = []
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None:
            continue
        if argument.kwarg_only or position >= len(node.args):
            value = node.kwargs.get(argument.name)
        else:
            value = node.args[position]
        if alias_info.before_set & argument.alias_info.before_set:
            return value
        annotated.append(value)
    # List returns (`Tensor(a)[]`) carry their alias set on the element type,
    # which Python does not expose; fall back on the annotated arguments.
    return annotated[0] if annotated else (node.args[0] if node.args else None)


def _getitem_value(node, index, values, buffers: _Buffers) -> _Value:
    parent, key = node.args[0], node.args[1]
    if not isinstance(parent, torch.fx.Node):
        return buffers.allocate(node, index, _example(node))
    parent_value = values[parent]
    if parent_value.parts is not None and isinstance(key, int):
        try:
            return parent_value.parts[key]
        except IndexError:
            return _NOTHING
    if _holds_tensor(key):
        return buffers.allocate(node, index, _example(node))
    return _alias_of(parent, _example(node), values)


def _holds_tensor(key: Any) -> bool:
    if isinstance(key, torch.fx.Node):
        return isinstance(_example(key), torch.Tensor)
    if isinstance(key, (list, tuple)):
        return any(_holds_tensor(k) for k in key)
    return isinstance(key, torch.Tensor)


def _alias_of(argument: Any, example: Any, values) -> _Value:
    """A value sharing `argument`'s buffers; list results alias it element by element."""
    if isinstance(argument, torch.fx.Node):
        base = values.get(argument, _NOTHING)
    elif isinstance(argument, (list, tuple)):
        base = _combined([_alias_of(a, None, values) for a in argument])
    else:
        return _NOTHING
    if base.parts is None and isinstance(example, (list, tuple)):
        # e.g. split: each piece is a view of the whole base.
        return _Value(base.refs, [_Value(base.refs) for _ in example])
    return base


# --- sizes -------------------------------------------------------------------


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor`'s storage (a symbolic size read by its hint, without adding a guard)."""
    try:
        return _hint(tensor.untyped_storage().nbytes())
    except Exception:
        pass
    numel = 1
    for size in tensor.shape:
        numel *= _hint(size)
    return numel * tensor.element_size()


def _hint(size: Any) -> int:
    """A concrete int for a possibly symbolic size, without adding guards."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        # int(size) would install a guard, specializing the caller's graph.
        try:
            if _optimization_hint is not None:
                return int(_optimization_hint(size, fallback=0))
            constant = size.node.maybe_as_int()
            if constant is not None:
                return constant
            return int(size.node.hint) if size.node.hint is not None else 0
        except Exception:
            return 0
    try:
        return int(size)
    except Exception:
        return 0


# ---------------------------------------------------------------- measured (not estimated)

@dataclasses.dataclass
class MeasuredPeak:
    """Live CPU tensor bytes while a block ran: the absolute peak, and the block's own growth.

    Attributes:
        peak_bytes: the highest point of live CPU tensor bytes: what was alive at entry plus the
            block's growth (``live_at_entry_bytes + growth_bytes``). What decides whether the block
            fits, the CPU twin of ``torch.cuda.max_memory_allocated()`` over the block; bytes per
            parameter are ``peak_bytes / n_params``.
        growth_bytes: the block's own peak above what was alive at its entry (what it allocated
            and had not freed at its highest point), counted on every thread.
        live_at_entry_bytes: CPU tensor storages alive when the block started, counted once each:
            parameters, optimizer state, buffers, compiled graphs' constants, the user's tensors
            (every tensor reachable from a Python object; a tensor only C++ holds, such as one
            saved by autograd for a backward not yet run, is not seen).
        end_bytes: what the block left allocated (negative: it freed more).
        allocations: the number of CPU memory events (allocations and frees) counted in the block.
        counted_by: ``"allocator"`` (every thread: the counting allocator) or ``"profiler"``
            (torch.profiler's memory events, the fallback where the allocator cannot be built:
            only the block's own thread, see ``measure_tensor_peak``).
    """

    peak_bytes: int = 0
    growth_bytes: int = 0
    live_at_entry_bytes: int = 0
    end_bytes: int = 0
    allocations: int = 0
    counted_by: str = ""


class MemoryMeasurementWarning(UserWarning):
    """``measure_tensor_peak`` fell back to torch.profiler's memory events, which see only the
    thread that opened the block: allocations and frees on other threads (gloo's workers, a data
    loader thread) are missed, so a step with collectives may be misstated."""


class measure_tensor_peak:
    """``with optpass.measure_tensor_peak() as m: ...``: ``m.peak_bytes`` is the block's peak of live
    CPU tensor bytes, ``m.growth_bytes`` the part the block allocated.

    The CPU twin of ``torch.cuda.max_memory_allocated()``: ``peak_bytes`` is what was alive at the
    block's entry (every CPU tensor storage reachable from Python, counted once) plus the block's
    growth. The growth is counted by a c10 CPU allocator that adds each tensor's bytes when it is
    allocated and takes them off when it dies, on whatever thread either happens (gloo's worker
    threads, where a collective's buffers live and die, included): bytes handed to tensors by eager
    ops, Inductor's buffers and optimizer state, not glibc's heap or what a compile allocates as
    Python objects (RSS moves with those).

    The allocator is built from C++ the first time (``torch.utils.cpp_extension``: a C++ compiler
    and ninja, about 20 s, then cached) and stays installed for the rest of the process (64 bytes
    more per CPU tensor). Each block's entry hands it the tensors allocated before it was installed
    that Python can reach (no copy), so a block that frees them counts their frees, the first time
    it is entered as every time after; a tensor only C++ holds (saved by autograd for a backward not
    yet run) is neither counted at entry nor its free in the block.
    Where it cannot be built, the growth comes from torch.profiler's memory events, which see only
    the calling thread, with a ``MemoryMeasurementWarning``; ``m.counted_by`` says which counted.
    Memory that torch's CPU allocator did not hand out is counted at entry but not in the growth:
    a NumPy array wrapped by ``torch.from_numpy``, shared memory (a DataLoader worker's batches,
    ``share_memory_()``, which also frees the tensor's allocator memory: a negative ``end_bytes``),
    a memory-mapped file. A collective's buffer dies on gloo's thread a moment after the step that
    used it returned: a block that ends right after a step may still count it in ``end_bytes``.
    Finding the live tensors at entry collects garbage first (tensors only a reference cycle holds,
    such as a compile leaves behind, are freed, not counted) and walks every Python object
    (``gc.get_objects``): for tests and reports, not for timing.

    Returns:
        ``with ... as m`` binds a ``MeasuredPeak``; its fields are filled in when the block exits.

    Example:
        with optpass.measure_tensor_peak() as m:
            step(x, y)
        print(m.peak_bytes / n_params, "bytes per parameter at the step's peak;",
              m.growth_bytes, "allocated by the step at its highest point")
    """

    def __enter__(self) -> MeasuredPeak:
        import gc

        from optpass.analysis.counting_allocator import counting_allocator, why_unavailable

        self._allocator = counting_allocator()
        gc.collect()        # garbage in reference cycles (a compile leaves some) is not alive
        # tensors made before the allocator was installed are handed to it: their frees count
        adopt = self._allocator.adopt if self._allocator is not None else None
        self.result = MeasuredPeak(live_at_entry_bytes=live_cpu_tensor_bytes(adopt))
        if self._allocator is not None:
            self.result.counted_by = "allocator"
            self._window = self._allocator.open_window()
            return self.result
        import warnings

        from torch.profiler import ProfilerActivity, profile

        warnings.warn(f"optpass.measure_tensor_peak counts with torch.profiler's memory events, which see "
                      f"only this thread (a collective's buffers on gloo's threads are missed): the counting "
                      f"allocator is not available ({why_unavailable()}). Install a C++ compiler and "
                      f"`pip install ninja` for a count on every thread.", MemoryMeasurementWarning, stacklevel=2)
        self.result.counted_by = "profiler"
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self.result

    def __exit__(self, *exc) -> None:
        if self._allocator is not None:
            start, peak, live, events, _ = self._allocator.close_window(self._window)
            self.result.growth_bytes, self.result.end_bytes = peak - start, live - start
            self.result.allocations = events
        else:
            self._profile.__exit__(*exc)
            events = [e for e in self._profile.profiler.kineto_results.events()
                      if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU]
            live = 0
            for event in sorted(events, key=lambda e: e.start_ns()):
                live += event.nbytes()
                self.result.growth_bytes = max(self.result.growth_bytes, live)
            self.result.end_bytes, self.result.allocations = live, len(events)
        self.result.peak_bytes = self.result.live_at_entry_bytes + self.result.growth_bytes


def live_cpu_tensor_bytes(adopt=None) -> int:
    """Bytes of the CPU tensor storages reachable from Python objects now, each storage once
    (``adopt``: called with a tensor of each, the counting allocator's ``adopt``)."""
    import gc
    import warnings

    from torch._subclasses.fake_tensor import FakeTensor

    seen: dict[int, int] = {}
    with warnings.catch_warnings():         # isinstance() on deprecated torch aliases warns
        warnings.simplefilter("ignore")
        # issubclass of the type, not isinstance: a weakref.proxy to a dead tensor passes isinstance
        tensors = [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]
    for obj in tensors:
        if isinstance(obj, FakeTensor) or obj.device.type != "cpu":
            continue
        for part in _dense_parts(obj):
            try:
                storage = part.untyped_storage()
                pointer = storage.data_ptr()
            except (RuntimeError, NotImplementedError):   # no real storage (a wrapper subclass)
                continue
            if pointer:
                if adopt is not None and pointer not in seen:
                    adopt(part)
                seen[pointer] = max(seen.get(pointer, 0), storage.nbytes())
    return sum(seen.values())


def _dense_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The strided tensors that hold a tensor's memory: itself, or a sparse tensor's indices and values."""
    layout = tensor.layout
    try:
        if layout is torch.sparse_coo:
            return [tensor._indices(), tensor._values()]
        if layout in (torch.sparse_csr, torch.sparse_bsr):
            return [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
        if layout in (torch.sparse_csc, torch.sparse_bsc):
            return [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
    except (RuntimeError, NotImplementedError):
        return []
    return [tensor]
