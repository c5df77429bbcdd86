"""The optpass pass pipeline: named, ordered, selectable, disable-able.

Each pass lives in its own file and states its precondition, rewrite, effect
and what it refuses in the module docstring; no pass imports another (what they
share is in ``_graph_utils.py`` and ``_row_chunks.py``). The pipeline, in order:

| pass                  | file                     | on by default | changes numerics |
|-----------------------|--------------------------|---------------|------------------|
| loss_scaling          | loss_scaling.py          | when asked    | no (torch.amp.GradScaler's step) |
| clip_grad_norm_in_backward | clip_grad_norm_in_backward.py | when asked | no (clip_grad_norm_'s formula, exact) |
| accumulate_gradient_in_place | accumulate_gradient_in_place.py | with optimizer_in_backward | no (rounding only: a tied weight's two contributions summed in another order) |
| optimizer_in_backward | optimizer_in_backward.py | when asked    | no (torch.optim's own update, moved) |
| master_weights        | master_weights.py        | when asked    | yes: the update runs on fp32 masters |
| logits_gradient_in_chunks | logits_gradient_in_chunks.py | when asked    | no (rounding only: the head's input gradient summed over vocabulary chunks) |
| logits_gradient_in_place | logits_gradient_in_place.py | yes (Inductor's lowering) | no (the same ops; the logits gradient written over the logits) |
| embedding_gradient_rows | embedding_gradient_rows.py | yes           | no (the same sums, for the rows kept) |
| reshard_after_forward | reshard_after_forward.py | when asked    | no (the same shards gathered again) |
| shard_optimizer       | shard_optimizer/       | when asked    | no (torch.optim's own update, 1/N of it); with master_weights as master_weights |
| per_sample_grad_norm  | per_sample_grad_norm/  | yes           | no (rounding only) |
| update_keeps_parameters_at_zero_lr | update_keeps_parameters_at_zero_lr.py | yes (an update graph) | no (the eager value at lr = 0, no NaN) |
| eliminate_dead_code   | eliminate_dead_code.py   | yes           | no               |

Legality (``optpass/legality.py``) is not a pass: it proves a requested rewrite legal on the
Dynamo-level step graph (where raw gradients and user source lines are exact)
before any aten graph exists, and refuses with an error.

A pass is a function ``(step: StepGraph, options: Options) -> str | None`` that
mutates ``step.graph`` in place and returns ``None`` when it did its work, or a
one-line reason when it did not apply (recorded, logged, shown by
``optpass.explain``). A pass that finds the program illegal raises
``OptpassError`` naming the user's line; it never silently does less.

``options={"passes": [...]}`` picks passes by name (still run in pipeline
order), ``options={"disable_passes": [...]}`` drops passes by name.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch
import torch.fx

from optpass.capture import GraphKind
from optpass.dp_model_checks import DPSGDModelWarning
from optpass.errors import OptpassError, node_user_line, warn_at_user_line
from optpass.passes import (accumulate_gradient_in_place, clip_grad_norm_in_backward, eliminate_dead_code,
                            embedding_gradient_rows,
                            logits_gradient_in_chunks, logits_gradient_in_place, loss_scaling, master_weights,
                            optimizer_in_backward, per_sample_grad_norm, reshard_after_forward, shard_optimizer,
                            update_keeps_parameters_at_zero_lr)

log = logging.getLogger("optpass")


@dataclasses.dataclass(frozen=True)
class GraphPass:
    """One pass of the pipeline (``optpass.PASSES`` lists them in the order they run).

    Attributes:
        name: the name that ``options={"passes": [...]}`` and ``"disable_passes"`` use.
        run: ``(StepGraph, Options) -> str | None``: rewrites ``step.graph`` in place and returns
            None, or the one-line reason it did not apply; raises ``OptpassError`` on an illegal
            program.
        applies_to: the ``GraphKind`` values it runs on (others are skipped).
        on_by_default: runs unless disabled (False: only when an option asks for it).
        changes_numerics: its result may differ from the unrewritten step's beyond rounding.
        asked_by: the option that asks for the pass ("": it runs unless disabled).
    """

    name: str
    run: Callable  # (StepGraph, Options) -> str | None (reason it did not apply)
    applies_to: tuple[GraphKind, ...]
    on_by_default: bool = True
    changes_numerics: bool = False
    asked_by: str = ""     # the option that asks for the pass ("": it runs unless disabled)


PASSES: tuple[GraphPass, ...] = (
    # fp16 loss scaling (GradScaler's semantics): scaled backward, fp32 unscale, skip on inf/nan (opt-in).
    GraphPass("loss_scaling", loss_scaling.run, applies_to=(GraphKind.STEP,), asked_by="grad_scaler"),
    # Global-norm clipping for fused updates: a norm-only backward first (opt-in).
    GraphPass("clip_grad_norm_in_backward", clip_grad_norm_in_backward.run, applies_to=(GraphKind.STEP,),
              asked_by="clip_grad_norm"),
    # A tied weight's gradient (head GEMM + embedding scatter) built in one buffer at the end of backward.
    GraphPass("accumulate_gradient_in_place", accumulate_gradient_in_place.run, applies_to=(GraphKind.STEP,),
              asked_by="optimizer_in_backward"),
    # Moves each parameter's torch.optim update to right after its gradient is final (opt-in).
    GraphPass("optimizer_in_backward", optimizer_in_backward.run, applies_to=(GraphKind.STEP,),
              asked_by="optimizer_in_backward"),
    # bf16/fp16 parameters: torch.optim's update on fp32 masters, rounded into the parameters (opt-in).
    GraphPass("master_weights", master_weights.run, applies_to=(GraphKind.STEP,), changes_numerics=True,
              asked_by="master_weights"),
    # A language model's [tokens, vocab] logits gradient made in vocabulary chunks beside its head's chunked update.
    GraphPass("logits_gradient_in_chunks", logits_gradient_in_chunks.run, applies_to=(GraphKind.STEP,),
              asked_by="logits_in_chunks"),
    # A loss's [tokens, vocab] logits gradient written over the logits (a kernel of its own under Inductor).
    GraphPass("logits_gradient_in_place", logits_gradient_in_place.run, applies_to=(GraphKind.STEP,)),
    # Tensor parallel: a vocabulary-parallel embedding's gradient made for this rank's rows, not the whole table.
    GraphPass("embedding_gradient_rows", embedding_gradient_rows.run, applies_to=(GraphKind.STEP,)),
    # FSDP: each sharded parameter gathered again for backward, gathers prefetched one ahead (opt-in).
    GraphPass("reshard_after_forward", reshard_after_forward.run, applies_to=(GraphKind.STEP,),
              asked_by="data_parallel"),
    # ZeRO-1: per bucket a reduce during backward, this rank's shard update, a gather, in the graph (opt-in).
    GraphPass("shard_optimizer", shard_optimizer.run, applies_to=(GraphKind.STEP,), asked_by="data_parallel"),
    # DP-SGD: per-sample Linear gradients used only for norms and a clipped sum are never built.
    GraphPass("per_sample_grad_norm", per_sample_grad_norm.run,
              applies_to=(GraphKind.STEP, GraphKind.FORWARD, GraphKind.MODEL, GraphKind.OTHER)),
    # opt.step() compiled on its own: a parameter whose update divides by lr keeps its value at lr == 0.
    GraphPass("update_keeps_parameters_at_zero_lr", update_keeps_parameters_at_zero_lr.run,
              applies_to=(GraphKind.UPDATE,)),
    # Drops values nothing reads; runs last so it cleans up after the rewrites above it.
    GraphPass("eliminate_dead_code", eliminate_dead_code.run,
              applies_to=(GraphKind.STEP, GraphKind.UPDATE, GraphKind.FORWARD, GraphKind.MODEL, GraphKind.OTHER)),
)


@dataclasses.dataclass
class PassOutcome:
    """What one pass did to one graph (``GraphReport.passes``; ``str()`` it for one line).

    Attributes:
        name: the pass's name.
        status: "applied", or "skipped" (a pass that refuses the program raises instead).
        reason: why it was skipped (None when applied).
        ops_before: call nodes in the graph before the pass.
        ops_after: call nodes after it.
        notes: what the pass wants a reader to know beyond applied/skipped.
        warnings: (category name, message) of the warnings it gave at compile (``warn_outcome``
            gives them again when Inductor's cache serves the graph and the pass does not run).
    """

    name: str
    status: str                 # "applied" | "skipped"
    reason: str | None
    ops_before: int
    ops_after: int
    notes: list[str] = dataclasses.field(default_factory=list)
    warnings: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    @property
    def op_delta(self) -> int:
        """``ops_after - ops_before``."""
        return self.ops_after - self.ops_before

    def __str__(self) -> str:
        if self.status == "applied":
            return f"{self.name}: applied, ops {self.ops_before} -> {self.ops_after} ({self.op_delta:+d})"
        return f"{self.name}: {self.status} ({self.reason})"


def selected_passes(options) -> list[GraphPass]:
    if options.passes is not None:
        chosen = [p for p in PASSES if p.name in options.passes]
    else:
        chosen = [p for p in PASSES if p.on_by_default]
    return [p for p in chosen if p.name not in options.disable_passes]


def count_ops(graph: torch.fx.Graph) -> int:
    return sum(1 for n in graph.nodes if n.op in ("call_function", "call_method", "call_module"))


def run_pipeline(step, options) -> list[PassOutcome]:
    """Run the selected passes over one StepGraph, in order; log and trace each."""
    outcomes = []
    for graph_pass in selected_passes(options):
        if step.kind not in graph_pass.applies_to:
            outcomes.append(PassOutcome(graph_pass.name, "skipped",
                                        f"does not apply to {_an(step.kind.value)} graph", 0, 0))
            continue
        before = count_ops(step.graph)
        _trace_graph(f"optpass_before_{graph_pass.name}", step.graph)
        reason = graph_pass.run(step, options)
        after = count_ops(step.graph)
        status = "applied" if reason is None else "skipped"
        outcome = PassOutcome(graph_pass.name, status, reason, before, after, list(step.notes),
                              [(category.__name__, message) for category, message in step.warnings])
        step.notes.clear()
        step.warnings.clear()
        warn_outcome(outcome)
        _trace_graph(f"optpass_after_{graph_pass.name}", step.graph)
        check_well_formed(step.graph, graph_pass)
        log.info("optpass %s graph %s: %s", step.kind.value, step.captured.compile_id, outcome)
        outcomes.append(outcome)
    return outcomes


_WARNING_CATEGORIES = {DPSGDModelWarning.__name__: DPSGDModelWarning}


def warn_outcome(outcome: PassOutcome) -> None:
    """Give the warnings a pass recorded in ``outcome``, at the user's line."""
    for category, message in outcome.warnings:
        warn_at_user_line(message, _WARNING_CATEGORIES.get(category, UserWarning))


def check_well_formed(graph: torch.fx.Graph, graph_pass: GraphPass) -> None:
    """An OptpassError naming the pass and the two nodes when `graph_pass` left a node that reads a
    value defined after it (or not in the graph), or a graph that ``Graph.lint`` rejects. Short on
    purpose: with TORCH_TRACE set, the graph is in the ``optpass_after_<pass>`` artifact."""
    defined: set[torch.fx.Node] = set()
    for node in graph.nodes:
        for arg in node.all_input_nodes:
            if arg not in defined:
                where = node_user_line(node)
                state = "only after it" if arg in set(graph.nodes) else "nowhere in the graph"
                _ill_formed(graph_pass, f"node {node.name} ({node.target}) reads {arg.name} ({arg.target}), "
                                        f"which is defined {state}{f' (from {where})' if where else ''}")
        defined.add(node)
    try:
        graph.lint()
    except RuntimeError as e:
        _ill_formed(graph_pass, (str(e).splitlines() or [type(e).__name__])[0])


def _ill_formed(graph_pass: GraphPass, what: str):
    instead = (f"leave out option {graph_pass.asked_by!r}" if graph_pass.asked_by
               else f"options={{'disable_passes': [{graph_pass.name!r}]}}")
    raise OptpassError(f"optpass's pass {graph_pass.name} produced an ill-formed graph: {what}. This is a bug "
                       f"in optpass; please report the step (TORCH_TRACE=<dir> records the graph before and "
                       f"after each pass). Until it is fixed: {instead}.") from None


def _trace_graph(name: str, graph: torch.fx.Graph) -> None:
    """With TORCH_TRACE set, write the graph as a trace_structured artifact (tlparse shows it)."""
    from torch._logging import trace_structured

    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "string"},
        payload_fn=lambda: graph.python_code("self").src,
    )


def _an(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"
