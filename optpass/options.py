"""The options a user passes as ``torch.compile(..., backend="optpass", options={...})``.

Every key is declared once in ``OPTIONS`` with its type, default and a one-line
description; that table is the single source for validation, for the error a
typo gets, for the defaults of ``Options`` and for the README's options table
(``options_table()``).

This module is a leaf of the package (it imports nothing of optpass but its errors): what it
validates against is declared here, the pass names (``PASS_NAMES``, the pipeline's, in order;
a test keeps them equal to ``optpass.passes.PASSES``) and the collective plans of data_parallel
(``COLLECTIVE_PLANS``, which ``optpass.passes.shard_optimizer`` fills).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import weakref
from typing import Any

import torch

from optpass.errors import OptpassError

LOWERINGS = ("inductor", "eager")
# The passes of the pipeline, in its order (optpass.passes.PASSES; a test keeps the two equal).
PASS_NAMES = ("loss_scaling", "clip_grad_norm_in_backward", "accumulate_gradient_in_place", "optimizer_in_backward",
              "master_weights", "logits_gradient_in_chunks", "logits_gradient_in_place",
              "embedding_gradient_rows", "reshard_after_forward", "shard_optimizer", "per_sample_grad_norm", "update_keeps_parameters_at_zero_lr",
              "eliminate_dead_code")
# The collective plans of data_parallel by name: optpass.passes.shard_optimizer registers its own
# when optpass loads (its PLANS is this dict); option 'collectives' is 'auto' or one of them.
COLLECTIVE_PLANS: dict[str, type] = {}


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    types: tuple[type, ...]
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None


def _optimizer_type() -> type:
    return torch.optim.Optimizer


def _dtype_type() -> type:
    return torch.dtype


def _grad_scaler_type() -> type:
    return torch.amp.GradScaler


OPTIONS: tuple[Option, ...] = (
    Option("lower", (str,), "inductor",
           "how the rewritten graph runs: 'inductor' (compile_fx) or 'eager' (the aten graph as is)",
           choices=LOWERINGS),
    Option("outline_updates", (bool,), True,
           "with lower='inductor': each parameter's update compiled once per kind (shape, dtype, "
           "update) and called from the step graph, so a recompile or a deeper model adds no update "
           "code; False: Inductor lowers every update inline in the step graph"),
    Option("passes", (list, tuple, type(None)), None,
           "names of the passes to run, in pipeline order (None: every pass that is on by default)"),
    Option("disable_passes", (list, tuple), (),
           "names of passes not to run"),
    Option("warn_on_graph_break", (bool,), True,
           "warn once, with the line and the fix, when backward() runs outside the compiled step"),
    Option("optimizer", (type(None), "optimizer", list, tuple), None,
           "the torch.optim optimizer the step uses (needed by optimizer_in_backward), or a list of them "
           "when the step steps several (Muon for the hidden matrices, AdamW for the rest): each parameter "
           "in one of them"),
    Option("optimizer_in_backward", (bool,), False,
           "run each parameter's update inside backward as soon as its gradient is final; free the gradient"),
    Option("logits_in_chunks", (bool,), False,
           "with optimizer_in_backward: an untied fp32 head's logits and their gradient made in vocabulary "
           "chunks beside its chunked update (less memory at the loss, one more logits GEMM per step)"),
    Option("master_weights", (type(None), "dtype"), None,
           "torch.float32: keep an fp32 master copy of every bf16/fp16 parameter; torch.optim's own update "
           "runs on the master (gradient cast to fp32) and the rounded result is copied into the parameter; "
           "with data_parallel='zero1' each rank keeps only the masters of its shard"),
    Option("accumulation_steps", (int,), 1,
           "with optimizer_in_backward: micro-steps 1..K-1 of a window accumulate into .grad, micro-step K "
           "applies the update; a window starts once .grad is cleared or after your own opt.step() (the "
           "flush of a partial window)"),
    Option("grad_scaler", (type(None), "grad_scaler"), None,
           "a torch.amp.GradScaler: dynamic loss scaling with its semantics inside the step (backward seeded "
           "with the scale, gradients unscaled in fp32, the whole update skipped on inf/nan, the scale backed "
           "off or grown); the scale and growth tracker stay in the scaler"),
    Option("clip_grad_norm", (type(None), float, int), None,
           "exact global-norm clipping to this max norm, for a fused update (it needs optimizer_in_backward, "
           "data_parallel, master_weights or grad_scaler; without them call clip_grad_norm_ in the step): "
           "with optimizer_in_backward one "
           "extra backward, with data_parallel one all-reduce of a scalar; with master_weights the fp32 "
           "gradients are clipped, with grad_scaler the unscaled ones (Megatron's order); after each step "
           "optpass.grad_norm(opt) is the norm before clipping (what clip_grad_norm_ returns); float('inf') "
           "only reports that norm (never clips: no extra backward)"),
    Option("data_parallel", (type(None), str), None,
           "'zero1': data-parallel over torch.distributed ranks, optimizer state sharded, collectives in the graph; "
           "'fsdp': a model passed to optpass.fully_shard, parameters, gradients and state sharded, each "
           "parameter gathered just before its use in forward and again in backward",
           choices=(None, "zero1", "fsdp")),
    Option("process_group", (object,), None,
           "with data_parallel: the torch.distributed process group (None: the default WORLD group)"),
    Option("partition", (str,), "even",
           "with data_parallel: 'even' (flat buckets split evenly) or 'greedy' (whole parameters, sorted-greedy)",
           choices=("even", "greedy")),
    Option("bucket_bytes", (type(None), int), None,
           "with data_parallel: most bytes of gradients per bucket, counted in the dtype they are summed in (fp32 "
           "for bf16/fp16 parameters with master_weights; one reduce and one gather per bucket); None: DDP's 25 MiB, lowered to a quarter "
           "of the model's reduced bytes (not below 1 MiB) for a smaller model, so that most of the reduction "
           "runs during backward"),
    Option("collectives", (str,), "auto",
           "with data_parallel: 'reduce_scatter' (reduce_scatter + all_gather per bucket), 'all_reduce' "
           "(all_reduce + a broadcast per rank's shard), or 'auto': all_reduce on gloo, reduce_scatter "
           "on NCCL and other backends"),
    Option("dp_materialize", (str,), "auto",
           "DP-SGD (per_sample_grad_norm): 'auto' keeps a Linear weight's [B, out, in] per-sample gradient "
           "where it is no larger than the [B, T, in] + [B, T, out] tensors book-keeping would keep "
           "(T·(in+out) >= in·out; it also saves a GEMM); 'never' rewrites every one",
           choices=("auto", "never")),
    Option("pipeline_parallel_degree", (int,), 1,
           "declared pipeline-parallel degree (optimizer_in_backward refuses > 1)"),
    Option("expert_parallel_degree", (int,), 1,
           "declared expert-parallel degree (optimizer_in_backward refuses > 1)"),
)

_BY_NAME = {o.name: o for o in OPTIONS}


class OptimizerList:
    """Several torch.optim optimizers of one step (``options={"optimizer": [muon, adamw]}``), seen as
    one where optpass reads an optimizer: ``param_groups`` are the members' groups in order (the
    same dicts: a scheduler's lr is seen), ``state[p]`` is the state of ``p`` in the member that
    holds it. Each member's update is harvested from that member (``optim/harvest.py``); zero1
    builds one shard optimizer per member (of its class, over its buckets), master_weights refuses
    a list.

    ``OptimizerList.of`` gives the same object for the same members, so what optpass keeps per
    optimizer (the ranks' agreement, a grad norm) is kept once per list."""

    # members' ids -> the list, while something (a compiled step's options) holds it
    _MADE: "weakref.WeakValueDictionary[tuple[int, ...], OptimizerList]" = weakref.WeakValueDictionary()

    def __init__(self, optimizers: tuple):
        self.optimizers = optimizers
        self.state = _StateOfSeveral(optimizers)

    @staticmethod
    def of(optimizers) -> "OptimizerList | torch.optim.Optimizer":
        """The members, checked (optimizers, each parameter in one); one member: that optimizer."""
        optimizers = tuple(optimizers)
        if not optimizers:
            raise OptpassError("optpass option 'optimizer' is an empty list: pass the optimizer the step "
                               "uses, or a list of the optimizers it steps.")
        for index, member in enumerate(optimizers):
            if not isinstance(member, torch.optim.Optimizer):
                raise OptpassError(
                    f"optpass option 'optimizer': element {index} of the list is a {type(member).__name__}, not "
                    "a torch.optim.Optimizer. Pass the optimizers the step steps: "
                    "options={'optimizer': [muon, adamw], ...}.")
        holder: dict[int, int] = {}
        for index, member in enumerate(optimizers):
            for group in member.param_groups:
                for p in group["params"]:
                    first = holder.setdefault(id(p), index)
                    if first != index:
                        raise OptpassError(
                            f"optpass option 'optimizer': a parameter of shape {list(p.shape)} is in "
                            f"optimizer {first} ({type(optimizers[first]).__name__}) and in optimizer {index} "
                            f"({type(member).__name__}) of the list: both would update it. Give each "
                            "parameter to one optimizer (modded-nanogpt: the 2-D hidden matrices to Muon, "
                            "every other parameter to AdamW).")
        if len(optimizers) == 1:
            return optimizers[0]
        key = tuple(id(o) for o in optimizers)
        made = OptimizerList._MADE.get(key)
        if made is None:
            made = OptimizerList._MADE[key] = OptimizerList(optimizers)
        return made

    @property
    def param_groups(self) -> list[dict]:
        return [group for member in self.optimizers for group in member.param_groups]

    @property
    def defaults(self) -> dict:
        return {k: v for member in self.optimizers for k, v in member.defaults.items()}

    def member_of_group(self, group: int) -> tuple[torch.optim.Optimizer, int]:
        """The member that holds param group `group` (an index into ``param_groups``), and the
        group's index in that member."""
        for member in self.optimizers:
            if group < len(member.param_groups):
                return member, group
            group -= len(member.param_groups)
        raise IndexError(group)

    def __repr__(self) -> str:
        return f"[{', '.join(type(o).__name__ for o in self.optimizers)}]"


class _StateOfSeveral:
    """``OptimizerList.state``: the state of each parameter in the member that holds it."""

    def __init__(self, optimizers: tuple):
        self.optimizers = optimizers

    def _member(self, p):
        return next((o for o in self.optimizers for g in o.param_groups for q in g["params"] if q is p), None)

    def __contains__(self, p) -> bool:
        return any(p in o.state for o in self.optimizers)

    def __getitem__(self, p) -> dict:
        member = self._member(p)
        if member is None:
            raise KeyError(p)
        return member.state[p]

    def get(self, p, default=None):
        return next((o.state[p] for o in self.optimizers if p in o.state), default)

    def pop(self, p, default=None):
        return next((o.state.pop(p) for o in self.optimizers if p in o.state), default)

    def __setitem__(self, p, values: dict) -> None:
        member = self._member(p)
        if member is None:
            raise KeyError(p)
        member.state[p] = values

    def values(self):
        return [values for o in self.optimizers for values in o.state.values()]

    def items(self):
        return [item for o in self.optimizers for item in o.state.items()]

    def keys(self):
        return [p for o in self.optimizers for p in o.state.keys()]

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return sum(len(o.state) for o in self.optimizers)


def optimizers_of(optimizer) -> tuple:
    """The torch.optim optimizers option 'optimizer' names: () for None, the members of a list."""
    if optimizer is None:
        return ()
    return optimizer.optimizers if isinstance(optimizer, OptimizerList) else (optimizer,)


def _default(name: str) -> Any:
    return _BY_NAME[name].default


@dataclasses.dataclass(frozen=True)
class Options:
    """The validated options (``from_user``); every default is ``OPTIONS``'."""

    lower: str = _default("lower")
    outline_updates: bool = _default("outline_updates")
    passes: tuple[str, ...] | None = _default("passes")
    disable_passes: tuple[str, ...] = _default("disable_passes")
    warn_on_graph_break: bool = _default("warn_on_graph_break")
    optimizer: Any = _default("optimizer")
    optimizer_in_backward: bool = _default("optimizer_in_backward")
    logits_in_chunks: bool = _default("logits_in_chunks")
    master_weights: Any = _default("master_weights")
    grad_scaler: Any = _default("grad_scaler")
    accumulation_steps: int = _default("accumulation_steps")
    clip_grad_norm: float | None = _default("clip_grad_norm")
    data_parallel: str | None = _default("data_parallel")
    process_group: Any = _default("process_group")
    partition: str = _default("partition")
    bucket_bytes: int | None = _default("bucket_bytes")
    collectives: str = _default("collectives")
    dp_materialize: str = _default("dp_materialize")
    pipeline_parallel_degree: int = _default("pipeline_parallel_degree")
    expert_parallel_degree: int = _default("expert_parallel_degree")

    @staticmethod
    def from_user(user: dict[str, Any] | None) -> "Options":
        """Validate a user's options dict; unknown keys and wrong types are errors."""
        if user is None:
            return Options()
        if isinstance(user, Options):
            return user
        if not isinstance(user, dict):
            raise OptpassError(f"options must be a dict, got {type(user).__name__}.\n{options_help()}")
        values = {}
        for key, value in user.items():
            option = _BY_NAME.get(key)
            if option is None:
                raise OptpassError(f"unknown optpass option {key!r}{did_you_mean(key, _BY_NAME)} The options "
                                   f"are: {', '.join(_BY_NAME)} (what each does: optpass.options.options_help()).")
            _check_type(option, value)
            if key == "optimizer" and isinstance(value, (list, tuple)):
                value = OptimizerList.of(value)
            elif isinstance(value, list):
                value = tuple(value)
            if key == "grad_scaler" and value is not None and not value.is_enabled():
                _refuse_scaler_disabled_by_torch(value)
                value = None        # GradScaler(enabled=False) does nothing: neither does optpass
            values[key] = value
        options = Options(**values)
        _check_pass_names(options)
        _check_combinations(options)
        return options

    def across_ranks(self) -> list[tuple[str, Any]]:
        """What about these options every rank of a data-parallel step must share: what changes its
        collectives or its math, as (what, value) pairs (compared at the first compile)."""
        scaler = self.grad_scaler
        return [(f"option {name}", value) for name, value in (
            ("optimizer_in_backward", self.optimizer_in_backward),
            ("clip_grad_norm", self.clip_grad_norm),
            ("accumulation_steps", self.accumulation_steps),
            ("grad_scaler", None if scaler is None else repr(sorted(scaler.state_dict().items()))),
            ("collectives", self.collectives),
            ("lower", self.lower),
            ("passes", self.passes),
            ("disable_passes", tuple(sorted(self.disable_passes))))]

    def digest(self) -> str:
        """What about these options changes the rewritten graph (for Inductor's cache key)."""
        return repr((self.passes, tuple(sorted(self.disable_passes)), self.clip_grad_norm,
                     self.data_parallel, self.partition, self.bucket_bytes, self.collectives,
                     self.dp_materialize, str(self.master_weights), self.grad_scaler is not None,
                     self.logits_in_chunks, self.outline_updates))


def _check_type(option: Option, value: Any) -> None:
    named = {"optimizer": _optimizer_type, "dtype": _dtype_type, "grad_scaler": _grad_scaler_type}
    types = tuple(named[t]() if isinstance(t, str) else t for t in option.types)
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        expected = " or ".join("None" if t is type(None) else t.__name__ for t in types)
        raise OptpassError(
            f"optpass option {option.name!r} must be {expected}, got {type(value).__name__} {value!r}. "
            f"{option.name}: {option.help} (default {option.default!r}).")
    if option.choices is not None and value not in option.choices:
        raise OptpassError(
            f"optpass option {option.name!r} must be one of {', '.join(map(repr, option.choices))}, "
            f"got {value!r}{did_you_mean(value, option.choices)}")
    if option.name in ("passes", "disable_passes") and value is not None:
        if not all(isinstance(v, str) for v in value):
            raise OptpassError(f"optpass option {option.name!r} must list pass names (str), got {value!r}")


def _check_combinations(options: Options) -> None:
    if options.optimizer_in_backward and options.optimizer is None:
        raise OptpassError("optimizer_in_backward needs the optimizer: "
                           "options={'optimizer': opt, 'optimizer_in_backward': True}")
    fused_update = (options.optimizer_in_backward or options.data_parallel or options.master_weights is not None
                    or options.grad_scaler is not None)
    needs_closure = [o for o in optimizers_of(options.optimizer) if _step_needs_a_closure(o)]
    if fused_update and needs_closure:
        name = type(needs_closure[0]).__name__
        raise OptpassError(
            f"{name}.step() needs a closure: it evaluates the loss and runs backward() itself, several times per "
            "step, outside the step's graph, so optpass cannot fuse or guard its update (optimizer_in_backward, "
            "master_weights, grad_scaler and data_parallel would silently do nothing). Compile the step "
            "without those options, or use an optimizer whose step() takes no closure.")
    if options.clip_grad_norm is not None and (not fused_update or options.clip_grad_norm <= 0):
        raise OptpassError("clip_grad_norm is a positive max norm for optimizer_in_backward, data_parallel, "
                           "master_weights or grad_scaler; without them call torch.nn.utils.clip_grad_norm_ "
                           "in the step")
    if options.clip_grad_norm is not None and options.data_parallel != "zero1":
        if not _pass_selected(options, "clip_grad_norm_in_backward"):
            raise OptpassError("clip_grad_norm is applied by the pass clip_grad_norm_in_backward; without it the "
                               "step would not clip. Keep the pass, or leave out option 'clip_grad_norm'.")
    if isinstance(options.optimizer, OptimizerList):
        _check_several_optimizers(options)
    if options.data_parallel == "fsdp":
        _check_fsdp(options)
    if options.data_parallel == "zero1":
        if options.optimizer is None:
            raise OptpassError("data_parallel='zero1' needs the optimizer: "
                               "options={'optimizer': opt, 'data_parallel': 'zero1'}")
        if options.accumulation_steps > 1:
            raise OptpassError("data_parallel='zero1' does not support accumulation_steps (optimizer_in_backward "
                               "would average and apply each micro-step's gradients). Accumulate with the update "
                               "after backward: drop optimizer_in_backward and accumulation_steps, and compile "
                               "the micro-steps (backward without opt.step()) with the step's options")
        if options.clip_grad_norm is not None and options.optimizer_in_backward:
            raise OptpassError(
                "clip_grad_norm with data_parallel='zero1' and optimizer_in_backward is not supported: "
                "the global norm needs every bucket's averaged gradients before any update, which "
                "undoes the in-backward placement. Use one of the two with clip_grad_norm.")
        if options.bucket_bytes is not None and options.bucket_bytes < 1:
            raise OptpassError(f"bucket_bytes must be >= 1, got {options.bucket_bytes}")
        if options.collectives not in ("auto", *COLLECTIVE_PLANS):
            known = ("auto", *COLLECTIVE_PLANS)
            raise OptpassError(f"optpass option 'collectives' must be one of "
                               f"{', '.join(map(repr, known))}, got {options.collectives!r}"
                               f"{did_you_mean(options.collectives, known)}")
        _require_pass(options, "shard_optimizer", "data_parallel='zero1'")
    if options.master_weights is not None:
        _check_master_weights(options)
    if options.grad_scaler is not None:
        _check_grad_scaler(options)
    if options.accumulation_steps < 1:
        raise OptpassError(f"accumulation_steps must be >= 1, got {options.accumulation_steps}")
    if options.accumulation_steps > 1 and not options.optimizer_in_backward:
        raise OptpassError("accumulation_steps is for optimizer_in_backward; without it, accumulate "
                           "as usual (call opt.step() every K micro-steps)")


def _check_several_optimizers(options: Options) -> None:
    """A list of optimizers: what builds an optimizer of the user's class over its own tensors (fp32
    masters), or keeps per-optimizer windows, takes one optimizer. zero1 builds one per member."""
    unsupported = [feature for feature, asked in (
        ("master_weights", options.master_weights is not None),
        ("grad_scaler", options.grad_scaler is not None),
        ("accumulation_steps > 1", options.accumulation_steps > 1)) if asked]
    if unsupported:
        raise OptpassError(
            f"optpass option 'optimizer' lists {len(options.optimizer.optimizers)} optimizers "
            f"({options.optimizer!r}); {', '.join(unsupported)} takes one optimizer (it builds one of your "
            "optimizer's class over its own tensors, or keeps one window). Several optimizers train "
            "with optimizer_in_backward and with data_parallel='fsdp' or 'zero1' (elementwise ones); for "
            f"{unsupported[0]} use one optimizer (param groups for different settings).")


def _check_fsdp(options: Options) -> None:
    if options.optimizer is None:
        raise OptpassError("data_parallel='fsdp' needs the optimizer (built after optpass.fully_shard(model)): "
                           "options={'optimizer': opt, 'data_parallel': 'fsdp'}")
    _require_pass(options, "reshard_after_forward", "data_parallel='fsdp'")


def _refuse_scaler_disabled_by_torch(scaler) -> None:
    """GradScaler("cuda") on a machine without CUDA disables itself (torch warns once): taking it as
    'no scaling' would train fp16 unscaled and unchecked, which the user did not ask for."""
    if getattr(scaler, "_device", None) == "cuda" and torch.cuda.amp.common.amp_definitely_not_available():
        raise OptpassError(
            "grad_scaler is a torch.amp.GradScaler('cuda') on a machine without CUDA, which torch disabled "
            "(scale 1.0, no inf/nan check): fp16 would train unscaled. Make it for the device your parameters "
            "are on: torch.amp.GradScaler('cpu') (or GradScaler(next(model.parameters()).device.type)). To "
            "train without loss scaling on purpose, leave grad_scaler out (a GradScaler('cuda', enabled=False) "
            "on this machine cannot be told apart from one torch disabled).")


def _step_needs_a_closure(optimizer) -> bool:
    """torch.optim.LBFGS and other optimizers whose step(closure) has no default."""
    closure = inspect.signature(type(optimizer).step).parameters.get("closure") if optimizer is not None else None
    return closure is not None and closure.default is inspect.Parameter.empty


def _check_master_weights(options: Options) -> None:
    if options.master_weights is not torch.float32:
        raise OptpassError(
            f"master_weights must be torch.float32 (the dtype of the master copies), got "
            f"{options.master_weights}: fp32 masters are what keeps small updates of bf16/fp16 "
            "parameters from being rounded away. Use options={'optimizer': opt, 'master_weights': torch.float32}.")
    if options.optimizer is None:
        raise OptpassError("master_weights needs the optimizer whose update runs on the masters: "
                           "options={'optimizer': opt, 'master_weights': torch.float32}")
    if options.data_parallel != "zero1":        # with zero1, shard_optimizer updates the master shards
        _require_pass(options, "master_weights", "master_weights")


def _pass_selected(options: Options, name: str) -> bool:
    """Whether an opt-in pass that an option asks for runs: listed in 'passes' (None: every pass
    runs that is asked for) and not in 'disable_passes'."""
    return (options.passes is None or name in options.passes) and name not in options.disable_passes


def _require_pass(options: Options, name: str, feature: str) -> None:
    """The pass that applies every update: without it the step's gradients would be dropped."""
    if not _pass_selected(options, name):
        raise OptpassError(
            f"{feature} needs the pass {name} (it applies every update, and the step hands optpass its "
            "gradients); do not leave it out with options 'passes' / 'disable_passes'.")


def _check_grad_scaler(options: Options) -> None:
    if options.optimizer is None:
        raise OptpassError("grad_scaler needs the optimizer whose update it skips on inf/nan: "
                           "options={'optimizer': opt, 'grad_scaler': scaler}")
    if options.accumulation_steps > 1:
        raise OptpassError(
            "grad_scaler with accumulation_steps > 1 is not supported yet: inside backward each update would "
            "check one micro-step's gradients, not their sum. Accumulate with the update after backward: drop "
            "optimizer_in_backward and accumulation_steps, and compile the micro-steps (backward without "
            "opt.step()) and the step with the same options.")
    if not _pass_selected(options, "loss_scaling"):
        raise OptpassError(
            "grad_scaler needs the pass loss_scaling (it scales backward, unscales the gradients and skips "
            "the update on inf/nan); do not leave it out with options 'passes' / 'disable_passes'.")


def _check_pass_names(options: Options) -> None:
    known = list(PASS_NAMES)
    for name in (options.passes or ()) + tuple(options.disable_passes):
        if name not in known:
            raise OptpassError(f"unknown optpass pass {name!r}{did_you_mean(name, known)} The passes are: "
                               f"{', '.join(known)}.")


def did_you_mean(given: Any, known) -> str:
    """``; did you mean 'x'?`` for the closest known name, or ``.`` when none is close."""
    names = [k for k in known if isinstance(k, str)]
    close = difflib.get_close_matches(given, names, n=1) if isinstance(given, str) else []
    return f"; did you mean {close[0]!r}?" if close else "."


def options_help() -> str:
    """Every option with what it does and its default, for a person to read.

    The same options as the README's options table (``options_table()``). Options that are not a
    dict are refused with this text; the refusal of an unknown option points at it.

    Returns:
        "Valid optpass options:" and one line per option: its name, what it does and its default.
    """
    lines = ["Valid optpass options:"]
    for o in OPTIONS:
        lines.append(f"  {o.name:<20} {o.help} (default {o.default!r})")
    return "\n".join(lines)


def options_table() -> str:
    """The options as a Markdown table (the README's table is generated from this)."""
    rows = ["| option | default | what it does |", "|---|---|---|"]
    rows += [f"| `{o.name}` | `{o.default!r}` | {o.help} |" for o in OPTIONS]
    return "\n".join(rows)
