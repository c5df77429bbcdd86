"""What optpass captured and did, graph by graph: the data behind ``optpass.explain``.

Every backend call appends a ``GraphReport`` to a short process-wide log
(``recent_reports()``). Tests and ``explain`` read it; it holds names, counts
and estimates, plus the graphs (and through them the parameters) only while
``keep_graphs`` is on (explain), so normal compiles keep no model memory alive.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any, Iterator

import torch.fx

from optpass.capture import CapturedGraph, GraphKind

_LOG: collections.deque["GraphReport"] = collections.deque(maxlen=64)
_KEEP_GRAPHS = [False]


@dataclasses.dataclass
class GraphReport:
    """What optpass captured from one Dynamo graph and what its passes did to it.

    Attributes:
        captured: the ``CapturedGraph``: the graph's kind and the role of each value
            (parameters, gradients, optimizer state); outside ``keep_graphs()`` a light copy
            without tensors.
        lowering: how the graph is lowered: the ``lower`` option (``"inductor"`` or ``"eager"``),
            or explain's ``"explain (aten graph, not run)"``.
        passes: one ``PassOutcome`` per pass that ran: applied, skipped or refused, and why.
        regions: the number of aten nodes per region (forward, backward, gradient_transform,
            update).
        memory_before: the ``MemoryEstimate`` of the aten graph before the passes (only inside
            ``keep_graphs()``; else None).
        memory_after: the ``MemoryEstimate`` after the passes (only inside ``keep_graphs()``).
        aten_ops_before: aten ops before the passes (None: not traced to aten).
        aten_ops_after: aten ops after the passes.
        outlined_updates: how many updates Inductor runs as calls of an update compiled once per
            kind (option ``outline_updates``; ``graph_after`` shows them inline); None when
            Inductor did not lower the graph or the option is off.
        graph_before: a copy of the aten graph before the passes (only inside ``keep_graphs()``).
        graph_after: a copy of the aten graph after the passes (only inside ``keep_graphs()``).
        gradient_bytes: bytes of all gradients that become ``p.grad``, before the passes (only
            inside ``keep_graphs()``).
        largest_gradient_bytes: bytes of the largest of those gradients (idem).
        error: a failure message; None when none was recorded.
        legality: explain's verdict on each rewrite the options ask for (legal, or refused and why).
        from_cache: Inductor's cache served the compiled graph, so the passes did not run in this
            process; ``passes``, ``regions`` and the op counts are those recorded when the graph
            was compiled (empty if no record was kept).
        phase_seconds: seconds each phase of the graph's compile took, in order: ``checks``,
            ``aten trace``, ``passes``, ``inductor`` (``cached compile`` where Inductor's cache
            served it); ``optpass.progress`` logs them while a long compile runs.
    """

    captured: CapturedGraph
    lowering: str
    passes: list[Any] = dataclasses.field(default_factory=list)      # PassOutcome
    regions: dict[str, int] = dataclasses.field(default_factory=dict)
    memory_before: Any = None                                        # MemoryEstimate
    memory_after: Any = None
    aten_ops_before: int | None = None
    aten_ops_after: int | None = None
    outlined_updates: int | None = None
    graph_before: torch.fx.Graph | None = None
    graph_after: torch.fx.Graph | None = None
    gradient_bytes: int | None = None          # all gradients that become p.grad, before passes
    largest_gradient_bytes: int | None = None
    error: str | None = None
    legality: str | None = None                # explain: the verdict on a requested rewrite
    from_cache: bool = False
    phase_seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def kind(self) -> GraphKind:
        """The graph's ``GraphKind`` (step, forward, model, update or other)."""
        return self.captured.kind

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (names, counts and estimates; no graphs or tensors).

        Returns:
            A dict of str keys: the kind, compile id, lowering, graph-break reason and lines,
            op counts, regions, parameter and gradient names, the passes' outcomes, the memory
            estimates, the error and the legality verdict.
        """
        c = self.captured
        return {
            "kind": c.kind.value,
            "compile_id": c.compile_id,
            "lowering": self.lowering,
            "split_reason": c.split_reason,
            "split_line": str(c.split_line) if c.split_line else None,
            "backward_line": str(c.backward_line) if c.backward_line else None,
            "dynamo_ops": c.dynamo_ops,
            "aten_ops_before": self.aten_ops_before,
            "aten_ops_after": self.aten_ops_after,
            "outlined_updates": self.outlined_updates,
            "regions": dict(self.regions),
            "parameters": [p.name for p in c.params],
            "parameter_bytes": sum(p.nbytes for p in c.params),
            "gradients": sorted(c.gradient_outputs) if c.kind is GraphKind.STEP else sorted(c.gradient_inputs),
            "accumulating_gradients": sorted(c.accumulating),
            "optimizer_state_tensors": len(c.state_attrs),
            "hyperparameter_inputs": sorted(c.hyperparameter_inputs.values()),
            "passes": [dataclasses.asdict(p) for p in self.passes],
            "memory_before": _memory_dict(self.memory_before),
            "memory_after": _memory_dict(self.memory_after),
            "gradient_bytes": self.gradient_bytes,
            "largest_gradient_bytes": self.largest_gradient_bytes,
            "error": self.error,
            "legality": self.legality,
            "from_cache": self.from_cache,
            "phase_seconds": dict(self.phase_seconds),
        }


def _memory_dict(estimate) -> dict[str, Any] | None:
    if estimate is None:
        return None
    return {
        "peak_bytes": estimate.peak_bytes,
        "peak_node": estimate.peak_node,
        "largest_at_peak": [list(t) for t in estimate.largest(5)],
        "bytes_by_tag_at_peak": dict(estimate.bytes_by_tag_at_peak),
    }


def record(report: GraphReport) -> GraphReport:
    # The log outlives models and optimizers: outside keep_graphs() it holds names and
    # counts, not the Dynamo graph or the parameters (which would keep their memory alive).
    if not keeping_graphs():
        report.captured = report.captured.without_tensors()
    _LOG.append(report)
    return report


def recent_reports() -> list[GraphReport]:
    """The reports of the most recent compiles, oldest first.

    Every backend call appends one report to a process-wide log of the last 64. Outside
    ``keep_graphs()`` a report holds names, counts and estimates only (no graphs, no tensors),
    so normal compiles keep no model memory alive. A graph that Inductor's cache served (the
    passes did not run in this process) reports the passes recorded when it was compiled, with
    ``from_cache`` set.

    Returns:
        A new list of ``GraphReport``, oldest first.
    """
    return list(_LOG)


def clear_reports() -> None:
    _LOG.clear()


def keeping_graphs() -> bool:
    return _KEEP_GRAPHS[0]


@contextlib.contextmanager
def keep_graphs() -> Iterator[None]:
    """Keep copies of each graph before and after the passes (for explain and tests).

    Inside the ``with`` block every report records ``graph_before`` and ``graph_after`` and keeps
    its captured tensors; the previous setting is restored on exit (blocks nest).

    Yields:
        None (``with optpass.keep_graphs():`` binds nothing).
    """
    old = _KEEP_GRAPHS[0]
    _KEEP_GRAPHS[0] = True
    try:
        yield
    finally:
        _KEEP_GRAPHS[0] = old
