"""The optpass backend: options -> capture -> pass pipeline -> lowering.

``torch.compile(step, backend="optpass", options={...})`` finds this function
through the ``torch_dynamo_backends`` entry point (no ``import optpass``
needed) and calls it once per Dynamo graph of the step.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import torch.distributed as dist
import torch.fx
from torch.utils.weak import WeakIdKeyDictionary

from optpass import lowering
from optpass.capture import (CapturedGraph, GraphKind, capture, enable_backward_capture, ignore_logging_calls,
                             module_buffers, warn_backward_outside, warn_if_update_recompiles,
                             warn_optimizer_step_in_loop, warn_recurrent_fallback)
from optpass.dp_model_checks import refuse_batch_norm_in_vmaps, warn_frozen_parameters_differentiated
from optpass.dpsgd import note_an_empty_vmap
from optpass.dynamo_scope import keep_compile_end_callback, mark_optpass_backend
from optpass.errors import OptpassError, name_list, warn_at_user_line
from optpass.fsdp.materialize import finish_all as finish_initialization_of
from optpass.fsdp.shard import adopt_optimizer, optimizer_group, replaced_name, shard_spec
from optpass.legality import (check_every_update_is_handled, check_tensor_parallel, check_fsdp, check_grad_scaler,
                              check_hyperparameter_writes, check_master_weights, check_optimizer_in_backward,
                              check_zero1, ends_at_optimizer_step)
from optpass.optim.bitsandbytes_refusal import refuse_bitsandbytes
from optpass.optim.elementwise import non_elementwise_ops
from optpass.options import Options, optimizers_of
from optpass.passes.shard_optimizer import EXPLAIN_KEY as SHARD_EXPLAINED
from optpass.precision.masters import master_state, refuse_without_low_precision
from optpass.report import GraphReport, record
from optpass.tensor_parallel import is_dtensor, note_context_parallel
from optpass.runtime.fused_step import FusedStep, refuse_update_during_accumulation
from optpass.runtime.master_weights_step import MasterWeightsStep
from optpass.runtime.scaled_micro_step import ScaledMicroStep
from optpass.runtime.sharded_step import ShardedStep, shard_the_optimizer
from optpass.zero1.agreement import (RanksDisagree, agree, announce_refusal, announce_undistributed, failed_step_error,
                                     several_ranks)
from optpass.zero1.state import ProcessGroupInfo, Replicas, sharded_state, signature

# Looking the backend up (torch.compile(..., backend="optpass")) imports this
# module before Dynamo traces anything, so backward() is captured from the first call.
enable_backward_capture()
# Dynamo's error for a vmap over an empty batch (before any graph reaches optpass) names pad_batch.
keep_compile_end_callback(note_an_empty_vmap)
# A step inside torch's context_parallel that fails while Dynamo traces: the error names context parallelism.
keep_compile_end_callback(note_context_parallel)
# A BatchNorm under torch.func fails while Dynamo traces: for an optpass compile, an OptpassError naming it.
refuse_batch_norm_in_vmaps()


@mark_optpass_backend
def optpass_backend(gm, example_inputs, options=None, mode=None):
    """Compile one Dynamo graph of a step: capture it, run the pass pipeline, lower it.

    Users do not call this function: ``torch.compile(step, backend="optpass", options={...})``
    finds it through the ``torch_dynamo_backends`` entry point and calls it once per Dynamo graph
    of the step. A refusal raised on one rank of a data-parallel step is announced to the other
    ranks, so that ranks waiting for this one in a collective fail too.

    Args:
        gm: the ``torch.fx.GraphModule`` Dynamo captured.
        example_inputs: the graph's example inputs, as Dynamo hands them to a backend.
        options: the dict given as ``torch.compile(..., options=...)``; None: every option at its
            default. The options, their defaults and what they do: ``optpass.options_help()`` or
            the README's options table.
        mode: ``torch.compile``'s ``mode``; only None or ``"default"`` is accepted (optpass is
            configured with ``options``).

    Returns:
        The callable that runs the graph: Inductor's (or, with ``lower="eager"``, the aten
        graph's) code, or for a step whose update is fused into the graph the step runtime that
        the options select.

    Raises:
        OptpassError: an unknown option, a value of the wrong type or a refused combination of
            options; a ``mode`` other than None or ``"default"``; a step that a requested rewrite
            cannot be applied to (the message names the line and the fix).
    """
    try:
        return _compile(gm, example_inputs, options, mode)
    except RanksDisagree:
        raise                            # every rank raised it
    except OptpassError as error:
        if _asks_for_data_parallel(options):
            announce_refusal(str(error))     # ranks waiting for this one in the step fail now
        raise


def _asks_for_data_parallel(options) -> bool:
    """The user's options (a dict, an Options, or None) set data_parallel: a refusal of this compile
    takes the place of the ranks' agreement on the step."""
    value = options.get("data_parallel") if isinstance(options, dict) else getattr(options, "data_parallel", None)
    return value is not None


def _specialize_symbolic_floats(gm) -> None:
    """Ask Dynamo to trace again with every symbolic float input a constant.

    With ``dynamic=True`` Dynamo makes the step's Python floats (a param group's betas and eps, which
    the captured ``opt.step()`` reads) symbolic inputs. AOTAutograd's pass that turns them into
    tensors cannot take them all and asks Dynamo to restart with them specialized: Dynamo can
    restart only while it compiles, and optpass lowers a fused step later, at its first call
    (measured: ``TensorifyScalarRestartAnalysis`` raised from the first step). The same request,
    made here, is the one AOTAutograd would make (torch's ``TensorifyState``)."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._dynamo.symbolic_convert import TensorifyState

    from torch._guards import detect_fake_mode
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    fake_mode = detect_fake_mode([n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"])
    shape_env = getattr(fake_mode, "shape_env", None)
    if shape_env is None:
        return
    names = [str(symbol) for symbol in shape_env.backed_var_to_val if symbol_is_type(symbol, SymT.FLOAT)]
    new = [name for name in names if not TensorifyState.should_specialize(name)]
    if new:
        for name in new:
            TensorifyState.specialize(name)
        raise TensorifyScalarRestartAnalysis


def _compile(gm, example_inputs, options, mode):
    started = time.perf_counter()
    # A typo in options is an error now, not a silently different compile.
    options = Options.from_user(options)
    if mode not in (None, "default"):
        raise OptpassError(f"optpass takes no mode ({mode!r}); configure it with options=. ")
    # Someone may have replaced Dynamo's ignore set since the backend was looked up.
    ignore_logging_calls()
    # Name every value: parameters, the gradients that become p.grad, optimizer state.
    captured = capture(gm)
    # A step whose backward() graph-broke cannot be rewritten: say so once, with the fix.
    if captured.kind is GraphKind.FORWARD and options.warn_on_graph_break:
        warn_backward_outside(captured)
    # A DP-SGD step that differentiates frozen parameters (Opacus clips the trainable ones): say so, naming them.
    warn_frozen_parameters_differentiated(captured)
    # An nn.LSTM inside vmap(grad): Dynamo skipped the DP step around it, which ran eagerly: say so, with the fix.
    if captured.skipped_recurrent is not None and options.warn_on_graph_break:
        warn_recurrent_fallback(captured)
    # opt.step() in a for loop: Dynamo ran the whole step uncompiled: say so (refuse under data_parallel).
    warn_optimizer_step_in_loop(captured, options)
    # A float lr changed by a scheduler recompiles the optimizer every step: say so, with the fix.
    warn_if_update_recompiles(captured)
    # DTensor parameters (tensor parallelism): trained on each rank's local tensors; what cannot be
    # (context parallel, data_parallel over them, a non-elementwise update of a shard) refused.
    check_tensor_parallel(captured, options)
    # Parameters sharded by fully_shard: trained with data_parallel='fsdp' only, and all of them.
    check_fully_sharded(captured, options)
    # An optimizer's step() over parameters that no optimizer in options holds: refused under
    # data_parallel (it would update this rank's shard as if it were the parameter), else warned.
    check_every_update_is_handled(captured, options)
    runtime = next((r for r in STEP_RUNTIMES if r.requested(options)), None)
    # bitsandbytes' optimizers: AOTAutograd cannot compile their step; refused with what works instead.
    refuse_bitsandbytes(captured, options, fused=runtime is not None)
    # A training step on one of several ranks, not data-parallel: say so (ranks that wait for it fail).
    _warn_undistributed(captured, options)
    # A backward() Dynamo did not trace, in a frame with nothing before it (so no graph ended at it):
    # warned, and refused by a rewrite that needs the whole step, as a graph ending there would be.
    if captured.backward_declined is not None:
        if options.warn_on_graph_break:
            warn_backward_outside(captured.backward_declined)
        if runtime is not None:
            runtime.check(gm, captured.backward_declined, options)
    # A step that writes the lr in place: the update would not see it (silently), refuse with the fix.
    check_hyperparameter_writes(captured, fused=runtime is not None)
    # A rewrite that fuses the update into the step graph: prove it legal on this graph, then run
    # the step through that rewrite's callable (STEP_RUNTIMES: the first whose options are set).
    captured.checks_seconds = time.perf_counter() - started     # the compile's first phase (progress)
    if runtime is None or captured.kind in (GraphKind.OTHER, GraphKind.MODEL):
        return _with_rank_zeros_buffers(lowering.lower(gm, example_inputs, {}, captured=captured, options=options),
                                        gm, captured, options)
    runtime.check(gm, captured, options)
    captured.checks_seconds = time.perf_counter() - started
    lower = functools.partial(lowering.lower, captured=captured, options=options)
    if captured.kind is GraphKind.STEP and (options.optimizer_in_backward or ends_at_optimizer_step(captured)):
        # torch.compile(dynamic=True): Python floats made symbolic are specialized now, while Dynamo
        # can still restart (this step is lowered at its first call, too late for that); a graph
        # lowered here restarts through AOTAutograd itself when it must
        _specialize_symbolic_floats(gm)
        plain = gm.forward if options.accumulation_steps == 1 else lower(gm, example_inputs, {})
        return _with_rank_zeros_buffers(runtime.step(gm, captured, options, plain, lower), gm, captured, options)
    # a micro-step of gradient accumulation (backward, no opt.step()): its gradients stay in .grad
    # for the step that follows; under a grad_scaler its backward is of loss * scale
    micro_step = (ScaledMicroStep(gm, captured, options, lower) if _scaled_micro_step(captured, options)
                  else lower(gm, example_inputs, {}))
    if options.data_parallel == "zero1" and captured.kind is GraphKind.STEP:
        replicas = sharded_state(options.optimizer).replicas
        return lambda *args: replicas.run(micro_step, args, micro_step=True)   # rank 0's buffers, as DDP
    return _with_rank_zeros_buffers(micro_step, gm, captured, options, micro=True)


_warned_undistributed = False


def _warn_undistributed(captured, options) -> None:
    """A step with backward compiled without data_parallel while torch.distributed runs several
    ranks: each rank trains alone, its gradients are not averaged. Warn once (each rank may train
    a model of its own on purpose), and tell ranks that wait for this one in a data-parallel step."""
    global _warned_undistributed
    if options.data_parallel is not None or captured.kind is not GraphKind.STEP or not several_ranks():
        return
    meshes = [p.tensor.device_mesh for p in captured.params if is_dtensor(p.tensor)]
    if meshes and max(mesh.size() for mesh in meshes) == dist.get_world_size():
        return                     # tensor parallel over every rank: the ranks train one model together
    where = captured.backward_line
    announce_undistributed(f"its step at {where}" if where is not None else "its step")
    if not _warned_undistributed:
        _warned_undistributed = True
        warn_at_user_line(
            f"optpass: torch.distributed runs {dist.get_world_size()} ranks, but this training step is compiled "
            "without data_parallel: this rank trains on its own batches, its gradients are not averaged "
            "across ranks. To train data-parallel pass options={..., 'data_parallel': 'zero1'} on every rank.",
            UserWarning, where)


def check_fully_sharded(captured, options) -> None:
    """A step over parameters ``optpass.fully_shard`` sharded needs data_parallel='fsdp' (another
    data_parallel would average the averaged shards again, none would skip the reshard); with it,
    every parameter the step trains is a shard, and so is every parameter of the optimizer (one
    built before fully_shard holds the replaced full parameters, which nothing would update). The
    ranks agree on the optimizer and the options before the first step's collectives."""
    sharded = [p.name for p in captured.params if p.tensor is not None and shard_spec(p.tensor) is not None]
    # a model materialized from the meta device: its initialization ends at its first compiled step
    finish_initialization_of([p.tensor for p in captured.params if p.tensor is not None])
    if options.data_parallel != "fsdp":
        if sharded and captured.kind is GraphKind.STEP:
            raise OptpassError(
                f"this step trains parameters sharded by optpass.fully_shard ({', '.join(sharded[:3])}) "
                f"{'with data_parallel=' + repr(options.data_parallel) if options.data_parallel else 'without data_parallel'}"
                ": compile it with options={..., 'optimizer': opt, 'data_parallel': 'fsdp'}, which gathers "
                "each parameter again in backward and checks what the step does with the sharded gradients.")
        return
    check_fsdp(captured, options)
    for optimizer in optimizers_of(options.optimizer):    # its state_dict() in FSDP2's language (DTensors)
        adopt_optimizer(optimizer)
    if captured.kind is not GraphKind.STEP:
        return
    if not sharded:
        raise OptpassError(
            "data_parallel='fsdp' on a model that was not passed to optpass.fully_shard: call "
            "optpass.fully_shard(model) on every rank after building the model and before building the "
            "optimizer (each rank then keeps its shard of every parameter).")
    whole = [p.name for p in captured.params if p.tensor is not None and p.tensor.requires_grad
             and shard_spec(p.tensor) is None]
    if whole:
        raise OptpassError(
            f"data_parallel='fsdp': parameter(s) {', '.join(whole[:3])} get gradients in this step but are not "
            "sharded (another model, or one built after optpass.fully_shard, or a part of the model left out "
            "when fully_shard was called on its blocks only): their gradients would stay this rank's own. Pass "
            "every model the step trains to optpass.fully_shard, each whole: optpass.fully_shard(model) alone (it "
            "finds the units, the blocks of a ModuleList, itself), or FSDP2's way, fully_shard(block) for each "
            "block and then fully_shard(model) on the whole model.")
    params = [p for group in options.optimizer.param_groups for p in group["params"]]
    replaced = [replaced_name(p) for p in params if replaced_name(p) is not None]
    if replaced:
        raise OptpassError(
            f"data_parallel='fsdp': the optimizer holds the full parameters that optpass.fully_shard replaced "
            f"({name_list(replaced, 3)}): it was built before fully_shard, and nothing would update them. Build "
            "the optimizer after optpass.fully_shard(model): opt = torch.optim.AdamW(model.parameters(), ...).")
    foreign = [tuple(p.shape) for p in params if shard_spec(p) is None]
    if foreign:
        raise OptpassError(
            f"data_parallel='fsdp': {len(foreign)} parameter(s) of the optimizer are not shards made by "
            f"optpass.fully_shard (shapes {foreign[:3]}): pass every model it trains to optpass.fully_shard "
            "before building the optimizer.")
    _agree_on_the_fsdp_step(captured, options)


_FSDP_AGREED: WeakIdKeyDictionary = WeakIdKeyDictionary()     # optimizer -> its ranks agreed


def _agree_on_the_fsdp_step(captured, options) -> None:
    """Every rank runs the same collectives and the same math: the optimizer, its hyper-parameters
    and the options agree at the first compile (a later one, e.g. a last, smaller batch, may happen
    on some ranks only); an update that reads a whole parameter is refused on every rank alike."""
    optimizer = options.optimizer
    if optimizer in _FSDP_AGREED:
        return
    group = optimizer_group(optimizer)
    found_by_member = [(type(member).__name__, non_elementwise_ops(member, options.master_weights))
                       for member in optimizers_of(optimizer)]
    names = {id(p.tensor): p.name for p in captured.params if p.tensor is not None}
    agree(group, "fsdp", signature(optimizer, "", 0, names, options.master_weights) + options.across_ranks()
          + [("non-elementwise ops of the update", found_by_member)])
    name, found = next(((n, ops) for n, ops in found_by_member if ops), (None, []))
    if found:
        raise OptpassError(
            f"data_parallel='fsdp': {name}'s update is not elementwise: it computes {', '.join(found[:4])} over a "
            f"whole parameter, and each rank updates only its shard (its rows of each parameter) with {name}. "
            "Train with an elementwise optimizer (SGD, Adam, AdamW, ...) under fsdp (in a list of optimizers, "
            f"each one), or train the parameters of {name} without data_parallel.")
    _FSDP_AGREED[optimizer] = True


_FSDP_BUFFERS: WeakIdKeyDictionary = WeakIdKeyDictionary()     # optimizer -> its step's Replicas


def _with_rank_zeros_buffers(call, gm, captured, options, micro: bool = False):
    """Under data_parallel='fsdp' the buffers a training step writes (BatchNorm's running
    statistics) are rank 0's before every step, as DDP keeps them (and zero1): made at the first
    compile of a step, which every rank reaches together, and kept for the optimizer's later
    compiles (a recompile may happen on some ranks only). A step that fails (a collective broke off:
    a rank failed or was lost) raises ``failed_step_error``: the lost rank named, saves refused."""
    if options.data_parallel != "fsdp" or captured.kind is not GraphKind.STEP:
        return call
    group = optimizer_group(options.optimizer)
    replicas = _FSDP_BUFFERS.get(options.optimizer)
    if replicas is None:
        replicas = _FSDP_BUFFERS[options.optimizer] = Replicas(ProcessGroupInfo.of(group), module_buffers(gm))

    def run(*args):
        try:
            return replicas.run(call, args, micro_step=micro)
        except OptpassError:
            raise
        except RuntimeError as error:        # a collective broke off: another rank failed, or is lost
            raise failed_step_error("fsdp", group, error, options.optimizer) from error
    return run


def _check_zero1(gm, captured, options) -> None:
    """The step hands zero1 raw gradients (and, with master_weights, holds backward and every transform)."""
    check_zero1(captured, options)
    if options.master_weights is not None:
        check_master_weights(captured, options)
        _refuse_without_low_precision(captured, options)
    if options.optimizer_in_backward:
        check_optimizer_in_backward(captured, options)
    if captured.kind is GraphKind.STEP:
        # made now, a micro-step's compile included: rank 0's parameters before any gradient
        shard_the_optimizer(gm, captured, options)


def _check_master_weights(gm, captured, options) -> None:
    check_master_weights(captured, options)
    if options.grad_scaler is not None:
        check_grad_scaler(captured, options)
    _refuse_without_low_precision(captured, options)
    # made now (not at the first fused step; the masters are made as steps first update their
    # parameters): it guards opt.step() against running outside the compiled step, after a
    # micro-step too
    master_state(options.optimizer, options.master_weights)
    if options.optimizer_in_backward:
        check_optimizer_in_backward(captured, options)
        refuse_update_during_accumulation(captured, options)


def _refuse_without_low_precision(captured, options) -> None:
    """master_weights needs a bf16/fp16 parameter in the optimizer or in the step."""
    refuse_without_low_precision([p for group in options.optimizer.param_groups for p in group["params"]],
                                 [p.tensor for p in captured.params if p.tensor is not None])


def _check_fused_update(gm, captured, options) -> None:
    if options.optimizer_in_backward:
        check_optimizer_in_backward(captured, options)
    if options.grad_scaler is not None:
        check_grad_scaler(captured, options)
    refuse_update_during_accumulation(captured, options)


@dataclasses.dataclass(frozen=True)
class StepRuntime:
    """How a rewrite that fuses the update into the step graph runs a step: when the options ask
    for it (``requested``), the legality it proves on every graph of the step and the state it
    keeps, made there (``check``: the masters, the shards), and the callable that runs a step
    that updates (``step``: one with optimizer_in_backward, or that ends at opt.step()).
    Micro-steps and the graphs around the step are lowered as they are (a grad_scaler's
    micro-step scales its loss)."""

    name: str
    requested: Callable[[Options], bool]
    check: Callable[[torch.fx.GraphModule, CapturedGraph, Options], None]
    step: type


def _fuses_the_update(options: Options) -> bool:
    """Whether the step graph runs torch.optim's update itself (in backward, or at its end)."""
    return (options.optimizer_in_backward or options.grad_scaler is not None
            or (options.data_parallel == "fsdp" and options.clip_grad_norm is not None))


# The first row whose options are set wins (zero1 keeps its own masters and runs its own scaler).
STEP_RUNTIMES = (
    # ZeRO-1: each rank updates its shard in the graph (with master_weights: its fp32 master shard)
    StepRuntime("data_parallel", lambda o: o.data_parallel == "zero1", _check_zero1, ShardedStep),
    # fp32 masters: every update on the masters, inside backward or after it; opt.step() is idle
    StepRuntime("master_weights", lambda o: o.master_weights is not None, _check_master_weights,
                MasterWeightsStep),
    # torch.optim's own update fused into backward; a grad_scaler's step fuses it too (after
    # backward without optimizer_in_backward): a skipped step must skip it in the same graph; so
    # does fsdp's clip_grad_norm (the norm of the shards, all-reduced, before the update)
    StepRuntime("optimizer_in_backward", _fuses_the_update, _check_fused_update, FusedStep),
)


def _scaled_micro_step(captured, options) -> bool:
    """A micro-step of gradient accumulation under grad_scaler: backward in the graph, no opt.step(),
    the update after backward (the step that follows unscales, checks and applies the sum)."""
    return (options.grad_scaler is not None and not options.optimizer_in_backward
            and captured.kind is GraphKind.STEP and not ends_at_optimizer_step(captured))


def explaining_backend(gm, example_inputs, options=None):
    """optpass.explain's backend: the same capture and passes, run on nothing (no training)."""
    started = time.perf_counter()
    options = Options.from_user(options)
    captured = capture(gm)
    report = record(GraphReport(captured, "explain (aten graph, not run)"))
    if options.optimizer_in_backward and captured.kind in (GraphKind.STEP, GraphKind.FORWARD):
        try:
            check_optimizer_in_backward(captured, options)
            report.legality = "optimizer_in_backward is legal: every gradient depends on its own parameter only"
        except OptpassError as error:
            report.legality = f"optimizer_in_backward refused: {error}"
    if options.data_parallel == "zero1" and captured.kind in (GraphKind.STEP, GraphKind.FORWARD):
        try:
            check_zero1(captured, options)
            verdict = ("data_parallel='zero1': a micro-step (no opt.step()): this rank's gradients add up in "
                       ".grad, as under DDP's no_sync(); the step after it averages their sums across ranks"
                       if captured.kind is GraphKind.STEP and not options.optimizer_in_backward
                       and not ends_at_optimizer_step(captured)
                       else "data_parallel='zero1' is legal: the step hands the update raw gradients")
        except OptpassError as error:
            verdict = f"data_parallel='zero1' refused: {error}"
        report.legality = f"{report.legality}\n{verdict}" if report.legality else verdict
    masters_legal = False
    if options.master_weights is not None and captured.kind in (GraphKind.STEP, GraphKind.FORWARD):
        try:
            check_master_weights(captured, options)
            _refuse_without_low_precision(captured, options)
            if options.data_parallel is None:     # zero1 keeps its masters sharded, made by its step
                master_state(options.optimizer, options.master_weights)
            verdict, masters_legal = ("master_weights is legal: the step graph holds backward and every "
                                      "gradient transform before opt.step()"), True
        except OptpassError as error:
            verdict = f"master_weights refused: {error}"
        report.legality = f"{report.legality}\n{verdict}" if report.legality else verdict
    scaler_legal = True
    if options.grad_scaler is not None and captured.kind in (GraphKind.STEP, GraphKind.FORWARD):
        try:
            check_grad_scaler(captured, options)
            verdict = ("grad_scaler: a micro-step (no opt.step()): backward of loss * scale, the scaled gradients "
                       "add up in .grad; the step after it unscales and checks their sum"
                       if _scaled_micro_step(captured, options)
                       else "grad_scaler is legal: the step hands opt.step() its raw gradients")
        except OptpassError as error:
            verdict, scaler_legal = f"grad_scaler refused: {error}", False
        report.legality = f"{report.legality}\n{verdict}" if report.legality else verdict
    in_backward_legal = "optimizer_in_backward is legal" in (report.legality or "")
    # The runtime the real step would run (STEP_RUNTIMES), where the legality above holds; zero1's
    # shards are not made for an explanation.
    runtime = next((r for r in STEP_RUNTIMES if r.requested(options)), None)
    fuse = (runtime is not None and runtime.step is not ShardedStep and scaler_legal
            and (masters_legal or runtime.step is not MasterWeightsStep)
            and (in_backward_legal if options.optimizer_in_backward else ends_at_optimizer_step(captured)))
    captured.checks_seconds = time.perf_counter() - started
    if fuse and captured.kind is GraphKind.STEP:
        # What the first real step compiles: torch.optim's update harvested and spliced in.
        compile_fn = functools.partial(lowering.lower_for_explain, captured=captured, options=options,
                                       report=report)
        return runtime.step(gm, captured, options, None, compile_fn).compile_for_explain(example_inputs)
    sharded = (options.data_parallel == "zero1" and captured.kind is GraphKind.STEP and "zero1' is legal"
               in (report.legality or "") and (options.optimizer_in_backward or ends_at_optimizer_step(captured)))
    context = {SHARD_EXPLAINED: True} if sharded else {}
    dry = lowering.lower_for_explain(gm, example_inputs, context, captured=captured, options=options, report=report)
    return _leaving_gradients_alone(gm, captured, dry)


def _leaving_gradients_alone(gm, captured, run):
    """explain trains nothing: a step that keeps its gradients (a micro-step) leaves .grad as it was,
    not zeros (a new gradient stays None, an accumulating step hands back the .grad it was given)."""
    if not captured.gradient_outputs or ends_at_optimizer_step(captured):
        return run                # opt.step() follows: its trace reads the (zero) gradients
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    returned = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    given = {i: placeholders.index(returned[i]) if returned[i] in placeholders else None
             for i in captured.gradient_outputs.values()}

    def run_leaving_gradients(*args):
        outputs = list(run(*args))
        for i, arg in given.items():
            outputs[i] = None if arg is None else args[arg]
        return tuple(outputs)
    return run_leaving_gradients
