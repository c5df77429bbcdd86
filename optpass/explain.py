"""optpass.explain: what optpass captures from a step and what its passes do, without training.

    report = optpass.explain(train_step, x, y, options={...})
    print(report)            # for a person
    report.to_dict()         # for tests and tools

The step is compiled with optpass's capture and pass pipeline, traced to aten
and analysed, but nothing it computes runs: every compiled graph returns zeros.
Like ``torch._dynamo.explain`` it resets Dynamo's caches before and after.

explain leaves the process as it found it: parameters (values, ``.grad``, None
staying None), every optimizer's ``state`` (no new entries or keys, tensors
unwritten), ``param_groups``, hooks and attributes, LR schedulers and
GradScalers, optpass's own records (fp32 masters, ZeRO-1 shards, accumulation
windows, skip counters) and the random number generators. Some of that is
written while the step is traced and cannot be prevented from outside Dynamo
(Dynamo stores the dry graphs' zeros where the step assigns them, e.g. SGD's
first momentum buffer, and runs torch.optim's ``_init_group`` for real), so it
is recorded before and put back after, completely and exactly: the same dict,
list and tensor objects, nothing copied but 0-d tensors (``untouched.py``).
The Python of the step itself runs as Python does (a ``print`` prints; an
attribute your own code sets is set).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch

from optpass.backend import explaining_backend
from optpass.capture import GraphKind, backward_outside_message
from optpass.dynamo_scope import mark_optpass_backend
from optpass.options import Options
from optpass.report import GraphReport, clear_reports, keep_graphs, recent_reports
from optpass.untouched import Untouched

_KIND_TEXT = {
    GraphKind.STEP: "forward + backward + gradient transforms",
    GraphKind.FORWARD: "forward only: backward() ran outside the compiled graph",
    GraphKind.UPDATE: "optimizer update",
    GraphKind.MODEL: "forward only: no backward() in the compiled code (a model compiled alone)",
    GraphKind.OTHER: "other",
}


@dataclasses.dataclass
class Explanation:
    """What ``optpass.explain`` found: one report per graph Dynamo compiled, in compile order.

    ``print()`` it for a person; ``to_dict()`` gives the same content as plain data for tests
    and tools.

    Attributes:
        graphs: a ``GraphReport`` per compiled graph: its kind (``GraphKind``), the parameters,
            gradients and optimizer state captured, each pass's outcome and, where estimated,
            the peak memory before and after the passes.
    """

    graphs: list[GraphReport]

    @property
    def warnings(self) -> list[str]:
        """The warnings a real compile would give: one per graph whose backward() ran outside it.

        Returns:
            One message per ``GraphKind.FORWARD`` graph, with the line that broke the graph and
            the fix.
        """
        return [backward_outside_message(g.captured) for g in self.graphs if g.kind is GraphKind.FORWARD]

    def of_kind(self, kind: GraphKind) -> list[GraphReport]:
        """The reports of the graphs of one kind.

        Args:
            kind: the ``GraphKind`` to keep (e.g. ``GraphKind.STEP``).

        Returns:
            The reports of ``graphs`` whose kind is ``kind``, in compile order.
        """
        return [g for g in self.graphs if g.kind is kind]

    def to_dict(self) -> dict[str, Any]:
        """The explanation as plain data (for tests and tools).

        Returns:
            ``{"graphs": [GraphReport.to_dict(), ...], "warnings": [str, ...]}``.
        """
        return {"graphs": [g.to_dict() for g in self.graphs], "warnings": self.warnings}

    def __str__(self) -> str:
        lines = [f"optpass explain: {len(self.graphs)} graph(s) captured"]
        for index, graph in enumerate(self.graphs):
            lines += _describe(index, graph)
        for warning in self.warnings:
            lines.append(f"WARNING: {warning}")
        return "\n".join(lines)


def explain(step_fn: Callable, *args: Any, options: dict | None = None, **kwargs: Any) -> Explanation:
    """Capture ``step_fn(*args, **kwargs)`` with optpass and report, without running its math.

    The step is compiled with optpass's capture and pass pipeline, traced to aten and analysed;
    every compiled graph returns zeros. Dynamo's caches are reset before and after. Parameters,
    gradients, optimizer state, LR schedulers, GradScalers, optpass's own records and the random
    number generators are left exactly as they were, also after a refusal (see the module
    docstring for what is recorded and put back).

    Args:
        step_fn: the training step, as it would be given to ``torch.compile``.
        *args: the positional arguments to call it with (e.g. a batch).
        options: the options the step would be compiled with (as ``torch.compile``'s
            ``options=``); None: every option at its default. See ``optpass.options_help()``.
        **kwargs: the keyword arguments to call it with.

    Returns:
        An ``Explanation``: one ``GraphReport`` per captured graph, with the legality verdict on
        each rewrite the options ask for (a refused rewrite is reported there, not raised).

    Raises:
        OptpassError: the options are invalid (raised before anything is traced), or the step is
            refused while it is captured (e.g. a parameter with a post-accumulate-grad hook).
    """
    Options.from_user(dict(options) if options else None)  # a bad option fails here, not mid-trace
    untouched = Untouched()
    torch._dynamo.reset()
    clear_reports()
    backend = mark_optpass_backend(functools.partial(explaining_backend, options=dict(options) if options else None))
    try:
        with keep_graphs():
            torch.compile(step_fn, backend=backend)(*args, **kwargs)
    finally:
        torch._dynamo.reset()
        untouched.restore()         # what the trace wrote, back as it was (also after a refusal)
    return Explanation(recent_reports())


# what each tag of the memory estimate holds (lowering.rewrite tags every buffer)
_TAG_TEXT = {"gradient": "gradients", "input": "parameters, optimizer state and inputs", "forward": "activations",
             "backward": "backward temporaries", "gradient_transform": "gradient-transform temporaries",
             "update": "update temporaries", "other": "other"}


def _sizes(*nbytes: int) -> list[str]:
    """Byte counts that are read side by side, in one unit: the one that fits the largest."""
    scale, unit = next(((s, u) for s, u in ((2**30, "GB"), (2**20, "MB"), (2**10, "KB"))
                        if max(nbytes, default=0) >= 2 * s), (1, "B"))
    return [f"{n} B" if scale == 1 else f"{n / scale:.2f} {unit}" for n in nbytes]


def _mb(nbytes: int) -> str:
    return _sizes(nbytes)[0]


def _peak_set_by_the_forward(before: dict, after: dict) -> bool:
    """Are both estimates' peaks within 1% of each other, with gradients under 1% of each?"""
    close = abs(before["peak_bytes"] - after["peak_bytes"]) * 100 <= before["peak_bytes"]
    return close and all(e["bytes_by_tag_at_peak"].get("gradient", 0) * 100 < e["peak_bytes"] for e in (before, after))


def _alive_by_kind(estimate: dict) -> str:
    """``activations 4.67 KB, gradients 1.00 KB``: what is alive at an estimate's peak, largest first."""
    by_kind = sorted(estimate["bytes_by_tag_at_peak"].items(), key=lambda kv: -kv[1])
    return ", ".join(f"{_TAG_TEXT.get(tag, tag)} {_sizes(n)[0]}" for tag, n in by_kind if n)   # each in its unit


def _dp_growth_line(before: dict, after: dict) -> str:
    """A DP-SGD graph's estimated growth: its peak without the parameters, optimizer state and inputs
    (what bench/dp.py's live-tensor peak measures), before the passes (every per-sample gradient
    materialized: the program as plain Inductor runs it) and after."""
    grown_before = before["peak_bytes"] - before["bytes_by_tag_at_peak"].get("input", 0)
    grown_after = after["peak_bytes"] - after["bytes_by_tag_at_peak"].get("input", 0)
    ratio = f" ({grown_after / grown_before:.2f}x)" if grown_before > 0 else ""
    shown_before, shown_after = _sizes(grown_before, grown_after)
    return (f"    estimated growth (the step's own tensors at its peak, without parameters and inputs): "
            f"{shown_before} unrewritten (this program under plain Inductor) -> {shown_after} rewritten{ratio}")


def _describe(index: int, g: GraphReport) -> list[str]:
    d = g.to_dict()
    per_sample = any(p.name == "per_sample_grad_norm" and (p.status == "applied" or p.notes) for p in g.passes)
    kind, text = ("dp-sgd", "per-sample gradients with torch.func (DP-SGD): each layer below is rewritten or "
                  "says why not") if per_sample else (g.kind.value, _KIND_TEXT[g.kind])
    lines = [f"[graph {index}] {kind} (Dynamo compile {d['compile_id']}): {text}"]
    if d["split_reason"]:
        lines.append(f"    split by a graph break at {d['split_line']}: {d['split_reason']}")
    if d["backward_line"]:
        lines.append(f"    backward(): {d['backward_line']}")
    if d["parameters"]:
        names = ", ".join(d["parameters"][:8]) + (" ..." if len(d["parameters"]) > 8 else "")
        lines.append(f"    parameters: {len(d['parameters'])} ({_mb(d['parameter_bytes'])}): {names}")
    if g.kind is GraphKind.STEP:
        accumulating = f", accumulating into existing .grad: {len(d['accumulating_gradients'])}" \
            if d["accumulating_gradients"] else ""
        lines.append(f"    gradients that become p.grad: {len(d['gradients'])}{accumulating}")
    if g.kind is GraphKind.UPDATE:
        lines.append(f"    gradients read: {len(d['gradients'])}; optimizer state tensors: "
                     f"{d['optimizer_state_tensors']}; hyper-parameter inputs: "
                     f"{', '.join(d['hyperparameter_inputs']) or 'none (constants baked in)'}")
    if d["aten_ops_before"] is not None:
        regions = ", ".join(f"{k} {v}" for k, v in d["regions"].items())
        lines.append(f"    aten ops: {d['aten_ops_before']} -> {d['aten_ops_after']}; regions: {regions}")
    if d["phase_seconds"]:
        lines.append("    compile phases: " + ", ".join(f"{name} {seconds:.1f} s"
                                                      for name, seconds in d["phase_seconds"].items()))
    if g.legality:
        lines.append(f"    legality: {g.legality}")
    for outcome in g.passes:
        lines.append(f"    pass {outcome}")
        lines.extend(f"        note: {note}" for note in outcome.notes)
    if g.memory_before is not None:
        before, after = d["memory_before"], d["memory_after"]
        grads_before = before["bytes_by_tag_at_peak"].get("gradient", 0)
        grads_after = after["bytes_by_tag_at_peak"].get("gradient", 0)
        peak_before, grads_before, peak_after, grads_after = _sizes(
            before["peak_bytes"], grads_before, after["peak_bytes"], grads_after)
        lines.append(f"    estimated peak memory: {peak_before} (gradients {grads_before}) "
                     f"before passes -> {peak_after} (gradients {grads_after}) after")
        if kind == "dp-sgd":
            lines.append(_dp_growth_line(before, after))
        for when, estimate in (("before", before), ("after", after)):
            lines.append(f"    alive at the estimated peak ({when}): {_alive_by_kind(estimate)}")
        if g.kind is GraphKind.STEP and _peak_set_by_the_forward(before, after):
            lines.append("        (about the same peak, with next to no gradient alive at it: it is set by what the "
                         "forward keeps for backward, which a rewrite of the gradients or the update cannot "
                         "lower; the rewrite acts later in backward)")
        if any(tag == "update" for tag in after["bytes_by_tag_at_peak"]):
            lines.append("        (the aten graph as the eager lowering runs it; Inductor fuses each update into "
                         "one kernel that writes in place: bench/lm_memory.py measures the compiled step)")
        largest = after["largest_at_peak"][:3]
        top = ", ".join(f"{name} ({_TAG_TEXT.get(kind, kind or 'other')}) {size}"
                        for (name, _, kind), size in zip(largest, _sizes(*(n for _, n, _ in largest))))
        lines.append(f"    largest live at the peak: {top}")
    return lines
