"""Lowering: where the pass pipeline runs, and what runs the rewritten graph.

* ``inductor`` (default): ``compile_fx`` with the pipeline handed to Inductor as
  a ``post_grad_custom_pre_pass`` ``CustomGraphPass`` (docs/design.md §12). Inductor keeps
  its joint-graph passes and partitioner, and the ``uuid()`` (optpass's source,
  the selected passes, the graph's roles) keeps the FX graph cache hitting.
* ``eager``: AOTAutograd's aten graph, rewritten by the same pipeline, run as
  is (debugging, fast tests).
* ``dry`` (``optpass.explain``): trace to aten and run the pipeline, but run
  nothing: the callable returns zeros shaped like the real outputs, so
  explaining a step does not train the model.

Each lowering leaves activation-checkpointed regions to optpass: torch's own
rematerialization is off for its compiles, and the pipeline begins with
``checkpointed_regions.rematerialize`` (which also refuses, as an ``OptpassError``
naming the ops and the fix, random ops in a recomputed region).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import time
from typing import Any, Callable

import torch
import torch.fx
from torch._dynamo.exc import BackendCompilerFailed
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.runtime.cache_dir_utils import cache_dir

from optpass import cache_artifacts, passes
from optpass.passes import _row_chunks, outline_updates, reshard_after_forward
from optpass.analysis.memory import estimate_peak_memory
from optpass.capture import CapturedGraph, GraphKind
from optpass.checkpointed_regions import rematerialize, torch_remat_off
from optpass.errors import OptpassError
from optpass.fsdp import write_through
from optpass.progress import CompileClock
from optpass.random_draws import draw_randn_like_in_one_op
from optpass.report import GraphReport, keeping_graphs, record
from optpass.step import FORWARD, GRADIENT_KEY, REGION_KEY, StepGraph


def rewrite(graph: torch.fx.Graph, captured: CapturedGraph, options, report: GraphReport,
            context: dict | None = None) -> None:
    """Run the pass pipeline over one aten graph of a captured Dynamo graph, in place."""
    if _is_backward_graph(graph):
        return  # the backward of a forward-only capture: nothing of the step is visible here
    # activation checkpointing: checkpointed regions recomputed in backward, as torch would have
    # (optpass/checkpointed_regions.py: torch's own pass cannot take an fsdp step's backward)
    rematerialize(graph)
    step = StepGraph.build(graph, captured, context)
    keep = keeping_graphs()
    report.aten_ops_before = passes.count_ops(graph)
    gradient_names = step.gradient_buffer_names()

    def tag(node: torch.fx.Node) -> str | None:
        """What a buffer is, for the memory estimate's account of the peak: a gradient that becomes
        ``p.grad`` (or did, before a pass fused its update), else the region that made it."""
        if node.name in gradient_names or node.meta.get(GRADIENT_KEY):
            return "gradient"
        return node.meta.get(REGION_KEY, FORWARD)

    if keep:
        report.gradient_bytes = sum(_nbytes(step.gradient_nodes[n]) for n in step.gradient_nodes)
        report.largest_gradient_bytes = max((_nbytes(g) for g in step.gradient_nodes.values()), default=0)
        report.graph_before = _snapshot(graph)
        report.memory_before = _named_inputs(estimate_peak_memory(graph, tag=tag), step)
    report.passes = passes.run_pipeline(step, options)
    if options.lower == "inductor":
        _spell_out_alpha(step)
        if inductor_config.fallback_random:
            draw_randn_like_in_one_op(step.graph)
    step.annotate_regions()
    report.regions = step.region_sizes()
    report.aten_ops_after = passes.count_ops(graph)
    if keep:
        report.graph_after = _snapshot(graph)
        report.memory_after = _named_inputs(estimate_peak_memory(graph, tag=tag), step)
    if options.lower == "inductor" and options.outline_updates:
        # after the report's graphs: what a pass did is read there; this is how Inductor runs it
        report.outlined_updates = outline_updates.run(graph)


def _named_inputs(estimate, step: StepGraph):
    """The estimate with the placeholders of parameters and optimizer state named as the user knows
    them (``embed.weight``, ``embed.weight exp_avg``), not by the aten graph's ``arg0_1``."""
    names = {node.name: name for name, node in step.param_nodes.items()}
    by_index = {n.meta["desc"].idx: n for n in step.graph.nodes
                if n.op == "placeholder" and hasattr(n.meta.get("desc"), "idx")}
    for plan in step.context.values():
        for (param, key), index in getattr(plan, "state_index", {}).items():
            if index in by_index:
                names[by_index[index].name] = f"{param} {key}"
    return dataclasses.replace(estimate, live_at_peak=[(names.get(node, node), nbytes, tag)
                                                       for node, nbytes, tag in estimate.live_at_peak])


def lower(gm, example_inputs, context, *, captured, options):
    """Lower: Inductor runs the pipeline as a post-grad pass; eager runs the rewritten aten graph."""
    report = record(GraphReport(captured, options.lower))
    clock, rewrite_fn = _timed_rewrite(report, captured, options, context,
                                       after="inductor" if options.lower == "inductor" else None)
    if options.lower == "eager":
        compiled = lower_eager(gm, example_inputs, rewrite_fn)
        clock.end()
        return _after_released_writes(compiled, options)
    # What a pass reads from the context changes the rewritten graph (e.g. this rank's shard).
    key = repr((options.digest(), captured.roles_digest(),
                sorted((k, getattr(v, "digest", lambda: "")()) for k, v in context.items()),
                reshard_after_forward.settings(captured), _row_chunks.ROW_CHUNK_BYTES))
    # A pass's plan may need Inductor to keep the order it emits (e.g. collectives during backward).
    patches = {k: v for plan in context.values() for k, v in getattr(plan, "inductor_config", {}).items()}
    if options.data_parallel == "fsdp" and captured.kind is GraphKind.STEP:
        patches.update(reshard_after_forward.INDUCTOR_CONFIG)
    compiled = lower_inductor(gm, example_inputs, rewrite_fn, key, patches)
    pipeline_record = _PipelineRecord(gm, example_inputs, key)
    if report.aten_ops_before is None:       # Inductor's cache served the graph: the passes did not run here
        clock.rename("cached compile")
        clock.end()
        pipeline_record.load_into(report)
    else:
        clock.end()
        pipeline_record.save(report)
    return _after_released_writes(compiled, options)


def _timed_rewrite(report: GraphReport, captured: CapturedGraph, options, context, after: str | None):
    """The pipeline as the lowering calls it, timed: ``aten trace`` until it is called, ``passes``
    while it runs, then ``after`` (Inductor's work; None: nothing is timed after it). The clock
    counts optpass's checks before lowering (``captured.checks_seconds``) as the first phase."""
    clock = CompileClock(report, started=time.perf_counter() - captured.checks_seconds)
    if captured.checks_seconds:
        report.phase_seconds["checks"] = captured.checks_seconds
    clock.begin("aten trace")

    def rewrite_fn(graph):
        if _is_backward_graph(graph):
            return rewrite(graph, captured=captured, options=options, report=report, context=context)
        clock.begin("passes")
        rewrite(graph, captured=captured, options=options, report=report, context=context)
        if after is None:
            clock.end()
        else:
            clock.begin(after)
    return clock, rewrite_fn


def _after_released_writes(compiled, options):
    """Under fsdp, writes into parameters read outside the step reach the shards before the step reads
    them (``optpass.fsdp.write_through``). Keeps the callable's calling convention (boxed or not)."""
    if options.data_parallel != "fsdp":
        return compiled
    def run(*args):
        write_through.before_compiled_run()
        return compiled(*args)
    if hasattr(compiled, "_boxed_call"):
        run._boxed_call = compiled._boxed_call
    return run


class _PipelineRecord:
    """What the pipeline did to a graph, kept beside Inductor's cache, so that a compile the cache
    serves (the pipeline does not run) still reports the passes that its code carries.

    Keyed by what decides the rewrite: optpass's source, the options and roles (``key``), the
    Dynamo graph's code and its inputs' shapes, strides and dtypes. A graph compiled before
    records existed (or whose record was removed) reports ``from_cache`` with no passes."""

    def __init__(self, gm, example_inputs, key: str):
        inputs = [(tuple(map(str, x.shape)), tuple(map(str, x.stride())), str(x.dtype), x.device.type)
                  if isinstance(x, torch.Tensor) else repr(type(x)) for x in example_inputs]
        digest = hashlib.sha256(repr((_source_hash().hex(), key, gm.code, inputs)).encode()).hexdigest()
        self.path = os.path.join(cache_dir(), "optpass_pipeline", digest[:40] + ".json")

    def save(self, report: GraphReport) -> None:
        data = {"passes": [dataclasses.asdict(p) for p in report.passes], "regions": report.regions,
                "aten_ops_before": report.aten_ops_before, "aten_ops_after": report.aten_ops_after,
                "outlined_updates": report.outlined_updates}
        content = json.dumps(data).encode()
        try:
            cache_artifacts.write_atomically(self.path, content)
        except OSError:
            return                        # a read-only cache: the next cache hit reports no passes
        cache_artifacts.record(self.path, content)

    def load_into(self, report: GraphReport) -> None:
        report.from_cache = True
        try:
            with open(self.path, "rb") as f:
                content = f.read()
            data = json.loads(content)
        except (OSError, ValueError):
            return
        cache_artifacts.record(self.path, content)
        report.passes = [passes.PassOutcome(**p) for p in data["passes"]]
        for outcome in report.passes:
            passes.warn_outcome(outcome)             # what the pipeline warned when it ran
        report.regions = data["regions"]
        report.aten_ops_before, report.aten_ops_after = data["aten_ops_before"], data["aten_ops_after"]
        report.outlined_updates = data.get("outlined_updates")


def lower_for_explain(gm, example_inputs, context, *, captured, options, report):
    """optpass.explain's lowering: the pipeline runs on the aten graph, nothing runs (``lower_dry``)."""
    clock, rewrite_fn = _timed_rewrite(report, captured, options, context, after=None)
    compiled = lower_dry(gm, example_inputs, rewrite_fn)
    clock.end()
    return compiled


def _spell_out_alpha(step: StepGraph) -> None:
    """``add(a, b, alpha=k)`` -> ``add(a, mul(b, k))`` (and ``sub``) in the updates the passes spliced in.

    Inductor's post-grad passes, which run after ours, fuse ``add(mm(x, y), b, alpha=k)`` into
    ``addmm`` and drop ``alpha`` (torch 2.13; measured: SGD's weight decay ``grad.add(param,
    alpha=wd)`` on a Linear weight's gradient, fused into backward, applied wd = 1). An update
    graph of its own never puts a gradient's ``mm`` next to the add; a fused one does."""
    aten = torch.ops.aten
    for node in list(step.graph.nodes):
        alpha = node.kwargs.get("alpha", 1)
        if node.target not in (aten.add.Tensor, aten.sub.Tensor) or alpha == 1:
            continue
        if step.region_of(node) != "update":
            continue
        with step.graph.inserting_before(node):
            scaled = step.emit(aten.mul.Tensor, node.args[1], alpha)
            plain = step.emit(node.target, node.args[0], scaled)
        scaled.meta[REGION_KEY] = plain.meta[REGION_KEY] = node.meta[REGION_KEY]
        node.replace_all_uses_with(plain)
        step.graph.erase_node(node)


def _nbytes(node: torch.fx.Node) -> int:
    value = node.meta.get("val")
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _is_backward_graph(graph: torch.fx.Graph) -> bool:
    descs = (type(n.meta.get("desc")).__name__ for n in graph.nodes if n.op == "placeholder")
    return any("Tangent" in d or "Saved" in d for d in descs)


def _snapshot(graph: torch.fx.Graph) -> torch.fx.Graph:
    copy = torch.fx.Graph()
    output = copy.graph_copy(graph, {})
    copy.output(output)
    return copy


# ---------------------------------------------------------------- eager

def lower_eager(gm, example_inputs, rewrite_fn: Callable[[torch.fx.Graph], None]):
    def compile_rewritten(aten_gm: torch.fx.GraphModule, _inputs):
        rewrite_fn(aten_gm.graph)
        aten_gm.recompile()
        return make_boxed_func(aten_gm.forward)

    def compile_backward(aten_gm: torch.fx.GraphModule, _inputs):
        return make_boxed_func(aten_gm.forward)

    with torch_remat_off():
        return aot_module_simplified(gm, example_inputs, fw_compiler=compile_rewritten,
                                     bw_compiler=compile_backward, keep_inference_input_mutations=True)


# ---------------------------------------------------------------- inductor

_PACKAGE_DIR = os.path.dirname(__file__)


@functools.lru_cache(maxsize=1)
def _source_hash() -> bytes:
    files = [os.path.join(root, f) for root, _, names in os.walk(_PACKAGE_DIR)
             for f in sorted(names) if f.endswith(".py")]
    return get_hash_for_files(tuple(sorted(files)))


class OptpassPostGradPass(CustomGraphPass):
    """The optpass pipeline as an Inductor post-grad pass, with a cache-stable uuid."""

    def __init__(self, rewrite_fn: Callable[[torch.fx.Graph], None], key: str, user_pass: Any = None):
        self.rewrite_fn = rewrite_fn
        self.key = key
        self.user_pass = user_pass  # a post_grad_custom_pre_pass the user configured runs after ours

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.rewrite_fn(graph)
        if self.user_pass is not None:
            self.user_pass(graph)

    def uuid(self) -> Any:
        if keeping_graphs():
            return None  # a cache hit would skip the passes, and the graphs to keep with them
        user = self.user_pass.uuid() if hasattr(self.user_pass, "uuid") else None
        return (_source_hash().hex(), self.key, user)


def lower_inductor(gm, example_inputs, rewrite_fn, key: str, config_patches: dict | None = None):
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    graph_pass = OptpassPostGradPass(rewrite_fn, key, inductor_config.post_grad_custom_pre_pass)
    patches = {**(config_patches or {}), "post_grad_custom_pre_pass": graph_pass}
    if _all_on_cpu(example_inputs):
        # Inductor's own CPU random kernels are ~5x slower than aten's generator (measured:
        # randn_like over 3.1M elements, 180 ms vs 33 ms); DP-SGD's noise makes that most of a
        # step. With aten's generator the stream is also eager PyTorch's for the same seed.
        patches["fallback_random"] = True
    with torch_remat_off(), compiled_in_this_process(), optpass_errors_unwrapped():
        return compile_fx(gm, example_inputs, config_patches=patches)


@contextlib.contextmanager
def optpass_errors_unwrapped():
    """A refusal raised by a pass inside Inductor reaches the user as the OptpassError it is.

    Inductor lets an OptpassError through on most of its paths; the one that compiles without
    its FX graph cache wraps every exception in an InductorError."""
    try:
        yield
    except BackendCompilerFailed as error:
        if isinstance(error.inner_exception, OptpassError):
            raise error.inner_exception from None
        raise


@contextlib.contextmanager
def compiled_in_this_process():
    """Inductor compiles optpass's graphs in this process, whatever ``TORCHINDUCTOR_FX_COMPILE_MODE`` says.

    The pipeline is a post-grad pass that closes over live objects (the optimizer, its masters
    and shards, the report), so it cannot travel: Inductor's out-of-process modes (``SUBPROCESS``,
    ``async+``, ``progressive+``; torch 2.13) pickle the graph and the *portable* config, which
    leaves ``post_grad_custom_pre_pass`` out, and compile there without it. Measured before this
    guard: a float32 step with ``optimizer_in_backward`` compiled in the child ran torch.optim's
    update after backward, every gradient alive, and no pass ran (the report listed none);
    ``data_parallel="zero1"`` failed in the child (``Can't get attribute
    'torch.contiguous_format'``). A graph the child cannot take (the bf16 steps tried, a Llama's
    too: Inductor's pickler refuses ``prims`` ops) already fell back to this process. Other graphs of the same
    program (Dynamo's, compiled by other backends) keep the mode the user chose."""
    from torch._inductor import compile_fx as module

    saved = {name: getattr(module, name) for name in _COMPILE_MODE_SETTINGS if hasattr(module, name)}
    if "fx_compile_mode" in saved:
        module.fx_compile_mode = module.FxCompileMode.NORMAL
    for name in ("fx_compile_async", "fx_compile_progressive"):
        if name in saved:
            setattr(module, name, False)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


_COMPILE_MODE_SETTINGS = ("fx_compile_mode", "fx_compile_async", "fx_compile_progressive")


def _all_on_cpu(example_inputs) -> bool:
    devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
    return devices <= {"cpu"}


# ---------------------------------------------------------------- dry (explain)

def lower_dry(gm, example_inputs, rewrite_fn):
    """Trace to aten and rewrite, but return a callable that computes nothing."""
    def record_only(aten_gm, _inputs):
        rewrite_fn(aten_gm.graph)
        return make_boxed_func(aten_gm.forward)

    with torch_remat_off():
        aot_module_simplified(gm, example_inputs, fw_compiler=record_only, bw_compiler=record_only,
                              keep_inference_input_mutations=True)
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    examples = [a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a
                for a in output.args[0]]

    def zeros(*_args):
        return tuple(_zeros_like(e) for e in examples)

    return zeros


def _zeros_like(example: Any) -> Any:
    if not isinstance(example, torch.Tensor):
        return example
    shape = [int(s) if not isinstance(s, torch.SymInt) else s.node.hint for s in example.shape]
    return torch.zeros(shape, dtype=example.dtype, device=example.device).requires_grad_(
        example.requires_grad)
