#!/usr/bin/env python3
"""Does ``optimizer_in_backward`` make a model fit in less memory, and what does it cost in step time?

What a user sees: the highest memory of the WHOLE run, because that decides
whether a model fits. In a plain training step the peak is the moment every
gradient is alive at once, and one such step is enough: on a GPU it is where the
OOM happens; on CPU glibc keeps those pages in RSS afterwards. A fused update
that only runs from the second step on saves nothing a user can see if the first
step still holds every gradient. So the headline is the whole-run peak and the
bytes per parameter at it; the steady-state peak is printed beside it.

The step: a large fp32 MLP (default: 12 ``Linear(2896, 2896)`` layers with ReLU
between them, about 100.7M parameters, batch 8, MSE loss) with fp32 AdamW
(lr 1e-4, weight decay 0.01) or SGD (lr 1e-3, momentum 0.9), in the supported
step shape::

    loss = F.mse_loss(model(x), y); loss.backward(); out = loss.detach(); opt.step(); opt.zero_grad(); return out

Variants, each named ``KIND/OPTIMIZER`` (``eager/adamw``, ``optpass/sgd``, ...):

* ``eager``    -- the step as plain eager PyTorch (no compile);
* ``inductor`` -- ``torch.compile(step, backend="inductor")``; optpass is imported,
  so ``torch._dynamo.config.trace_autograd_ops`` is on and backward is traced into
  the step graph: the same capture as optpass;
* ``optpass``  -- ``torch.compile(step, backend="optpass", options={"optimizer": opt,
  "optimizer_in_backward": True})``, Inductor lowering;
* ``optpass-clip`` (only with ``--variants``) -- optpass with ``clip_grad_norm=1.0``:
  what exact global-norm clipping (a norm-only backward first) costs;
* ``optpass-scaler`` (only with ``--variants``) -- optpass with ``grad_scaler`` (a
  torch.amp.GradScaler; fp32 parameters, so only the scaling's own cost shows): the inf/nan
  check of every gradient before any update, i.e. one extra, check-only backward;
* ``optpass-scaler-after`` (only with ``--variants``) -- ``grad_scaler`` without
  ``optimizer_in_backward``: the update after backward (every gradient alive), the
  alternative to paying the extra backward;
* ``optpass-inline`` (only with ``--variants``) -- optpass with ``outline_updates=False``: every
  update lowered inline in the step graph instead of one call per parameter of an update compiled
  once per kind (what outlining costs or saves in step time and memory);
* ``optpass-eager`` (only with ``--variants``) -- optpass with ``lower="eager"``: the
  rewritten aten graph run as is, for telling Inductor's part from the pass's.

Each variant runs in a FRESH subprocess (this script re-invoked with ``--child
KIND/OPTIMIZER``, its own empty ``TORCHINDUCTOR_CACHE_DIR``,
``torch.set_num_threads(--threads)`` and ``OMP_NUM_THREADS``). Every child imports
torch and optpass, reads its RSS (the *baseline*), builds the model, the optimizer
and the data, runs ``--warmup`` calls (every compile
is done by then, whichever call compiles the fused graph; the child fails if a
graph compiles during the measured steps), then ``--steps`` measured steps. The
graph-level estimate comes from one more child per optpass variant that warms up
inside ``optpass.keep_graphs()`` and is not measured (kept graphs are memory a
user's process would not hold). A measured child reports:

* **whole-run peak**: ``VmHWM`` from ``/proc/self/status``, the peak RSS since the
  process started (imports, compile, warm-up, measured steps). It is read after
  warm-up, before anything resets it, and again after the measured steps; the
  whole-run peak is the larger of the two. No ``malloc_trim``, no ``clear_refs``
  before it is read: no user calls them;
* **steady-state peak**: after warm-up, ``optpass.report.clear_reports()`` (drops the
  kept graphs), ``gc.collect()``, ``open("/proc/self/clear_refs", "w").write("5")``
  (VmHWM := current RSS), the measured steps, then ``VmHWM``;
* **bytes per parameter** (the headline): ``(peak - baseline) / parameters``, for the
  whole-run and the steady-state peak. The baseline is the RSS right after the
  imports, before the model is built, so B/param counts the parameters, the
  optimizer state, gradients, activations and temporaries, and also whatever
  compiling adds to the process (generated code, Dynamo and Inductor state:
  hundreds of MB, which dominates ``--quick``). Reference, before activations: fp32
  AdamW is 4 (parameter) + 8 (state) + 4 (gradient) = 16 B/param with every
  gradient alive, 12 when updates run in backward; SGD with momentum 12 and 8;
* **step time**: median (and minimum) of the measured steps (``time.perf_counter``);
* the **graph-level estimate** (``optpass.analysis.memory``) of the compile where
  ``optimizer_in_backward`` was applied, from whichever warm-up call made it:
  gradient bytes live at the estimated peak and the estimated peak, before vs after
  the passes.

On a GPU (``torch.cuda.is_available()`` in the child) the model and data live on
cuda and the memory headline is ``torch.cuda.max_memory_allocated()`` instead: over
the whole run (never reset) and, for the steady state, after
``torch.cuda.reset_peak_memory_stats()``; the baseline is ``memory_allocated()``
after the imports. VmHWM is still reported (host memory).

The parent runs every variant (for ``--repeats`` > 1 interleaved: eager, inductor,
optpass, eager, ...), takes medians, and prints per optimizer, with gradient bytes
= 4 x parameters (fp32):

* whole-run peak saved by optpass, as a fraction of the gradient bytes, vs inductor
  and vs eager (goal >= 0.90 each);
* step time optpass / inductor (goal <= 0.90);
* "met" / "NOT met" for each goal, the steady-state savings beside them.

``--malloc-mmap-threshold BYTES`` is a diagnostic, NOT what a user sees: it sets glibc's
``MALLOC_MMAP_THRESHOLD_`` in every child, so every buffer that big is mmap'ed and
unmapped on free and RSS follows the live tensors rather than the heap's high-water
mark.

Usage::

    python3 bench/optimizer_in_backward.py                  # 12 x 2896^2 = 100.7M params, AdamW and SGD (minutes)
    python3 bench/optimizer_in_backward.py --quick          # smoke run: 4 x 1024^2
    python3 bench/optimizer_in_backward.py --optimizers adamw --variants eager,inductor,optpass,optpass-eager
    python3 bench/optimizer_in_backward.py --variants optpass,optpass-clip   # cost of clip_grad_norm
    python3 bench/optimizer_in_backward.py --variants optpass,optpass-inline # what outlining the updates changes
    python3 bench/optimizer_in_backward.py --variants optpass,optpass-scaler,optpass-scaler-after  # grad_scaler
    python3 bench/optimizer_in_backward.py --json out.json

The parent never imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

from _measure import (child_command, child_env, cpu_busy_s, emit_result, empty_cache_dir, graph_count, median,
                      other_cores, print_json, proc_status_kib, reset_peak_rss, run_child, self_cpu_s, training_step)

DEFAULT_KINDS = ("eager", "inductor", "optpass")
ALL_KINDS = DEFAULT_KINDS + ("optpass-inline", "optpass-eager", "optpass-clip", "optpass-scaler", "optpass-scaler-after")
OPTIMIZERS = ("adamw", "sgd")
STATE_BYTES_PER_PARAM = {"adamw": 8, "sgd": 4}   # fp32 exp_avg + exp_avg_sq; momentum_buffer
MEMORY_GOAL = 0.90      # whole-run peak saved, as a fraction of the gradient bytes, vs inductor and vs eager
STEP_GOAL = 0.90        # optpass / inductor step time
_MB = 1e6


# ====================================================================== child side

def _make_optimizer(torch, name: str, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    raise SystemExit(f"unknown optimizer {name!r}; choose from {OPTIMIZERS}")


def _fused_report_estimate(optpass) -> dict | None:
    """The graph-level estimate of the compile where optimizer_in_backward was applied."""
    for report in reversed(optpass.recent_reports()):
        if report.graph_after is None or report.memory_after is None:
            continue
        if not any(p.name == "optimizer_in_backward" and p.status == "applied" for p in report.passes):
            continue
        before, after = report.memory_before, report.memory_after
        return {
            "kind": report.kind.value,
            "lowering": report.lowering,
            "passes": [f"{p.name}:{p.status}" for p in report.passes],
            "gradient_bytes": report.gradient_bytes,
            "largest_gradient_bytes": report.largest_gradient_bytes,
            "peak_before": before.peak_bytes,
            "peak_after": after.peak_bytes,
            "peak_node_before": before.peak_node,
            "peak_node_after": after.peak_node,
            "gradient_at_peak_before": before.bytes_by_tag_at_peak.get("gradient", 0),
            "gradient_at_peak_after": after.bytes_by_tag_at_peak.get("gradient", 0),
            "by_tag_at_peak_before": dict(before.bytes_by_tag_at_peak),
            "by_tag_at_peak_after": dict(after.bytes_by_tag_at_peak),
            "left_at_end_before": before.timeline[-1][1] if before.timeline else 0,
            "left_at_end_after": after.timeline[-1][1] if after.timeline else 0,
        }
    return None


def run_variant(args) -> None:
    import gc

    import torch

    torch.set_num_threads(args.threads)
    import torch.nn.functional as F

    import optpass  # every variant: same imports, trace_autograd_ops on (backward in the graph)
    from optpass.demo.models import MLP

    torch._dynamo.config.trace_autograd_ops = True
    kind, opt_name = args.child.split("/")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    rss_after_imports_kib = proc_status_kib("VmRSS")             # the baseline: before the model is built
    cuda_after_imports = torch.cuda.memory_allocated() if cuda else None

    def sync():
        if cuda:
            torch.cuda.synchronize()

    torch.manual_seed(0)
    model = MLP((args.width,) * (args.layers + 1)).to(device)
    opt = _make_optimizer(torch, opt_name, model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(args.batch, args.width, generator=g).to(device),
             torch.randn(args.batch, args.width, generator=g).to(device)) for _ in range(4)]

    train_step = training_step(lambda x, y: F.mse_loss(model(x), y), opt)
    if kind == "eager":
        step = train_step
    elif kind == "inductor":
        step = torch.compile(train_step, backend="inductor")
    elif kind.startswith("optpass"):
        options = {"optimizer": opt, "optimizer_in_backward": kind != "optpass-scaler-after"}
        if kind == "optpass-eager":
            options["lower"] = "eager"
        if kind == "optpass-inline":
            options["outline_updates"] = False
        if kind == "optpass-clip":   # exact global-norm clipping: one extra, norm-only backward
            options["clip_grad_norm"] = 1.0
        if kind.startswith("optpass-scaler"):   # loss scaling: inf/nan check before any update
            options["grad_scaler"] = torch.amp.GradScaler(device.type)
        step = torch.compile(train_step, backend="optpass", options=options)
    else:
        raise SystemExit(f"unknown variant kind {kind!r}; choose from {ALL_KINDS}")

    # Warm-up: every compile happens here, whichever call compiles the fused graph. A measured
    # child keeps no graphs (a user does not); an --estimate child (not measured) keeps them for
    # the graph-level memory estimate of the fused compile.
    warmup_s, losses = [], []
    optpass.report.clear_reports()
    keep = optpass.keep_graphs() if args.estimate else contextlib.nullcontext()
    with keep:
        for i in range(args.warmup):
            x, y = data[i % len(data)]
            t0 = time.perf_counter()
            out = step(x, y)
            sync()
            warmup_s.append(time.perf_counter() - t0)
            losses.append(float(out))
    hwm_warmup_kib = proc_status_kib("VmHWM")                   # since process start: nothing reset it yet
    cuda_peak_warmup = torch.cuda.max_memory_allocated() if cuda else None
    estimate = _fused_report_estimate(optpass) if kind.startswith("optpass") else None
    if args.estimate:
        emit_result({"variant": args.child, "estimate": estimate})
        return
    optpass.report.clear_reports()
    graphs = graph_count()
    grads_after_warmup = sum(p.grad is not None for p in model.parameters())

    # Steady state: reset the peak marks, run the measured steps.
    gc.collect()
    rss_before_steps_kib = proc_status_kib("VmRSS")
    reset_ok = reset_peak_rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    machine_before, self_before, wall_before = cpu_busy_s(), self_cpu_s(), time.perf_counter()
    times = []
    for i in range(args.steps):
        x, y = data[(args.warmup + i) % len(data)]
        t0 = time.perf_counter()
        out = step(x, y)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(out))
    hwm_steady_kib = proc_status_kib("VmHWM")
    cuda_peak_steady = torch.cuda.max_memory_allocated() if cuda else None
    rss_end_kib = proc_status_kib("VmRSS")
    machine_after, self_after, wall_after = cpu_busy_s(), self_cpu_s(), time.perf_counter()
    # CPUs kept busy by other processes while the measured steps ran (OpenMP threads that
    # share the cores with another process make steps several times slower)
    others = other_cores(None if machine_before is None or machine_after is None else machine_after - machine_before,
                         self_after - self_before, wall_after - wall_before)
    if graph_count() != graphs:
        raise SystemExit(f"{args.child}: {graph_count() - graphs} graph(s) compiled during the measured "
                         "steps (raise --warmup, or the step recompiles)")

    hwm_whole_kib = max(hwm_warmup_kib, hwm_steady_kib)
    if cuda:   # the headline is what the GPU allocator holds
        metric = "cuda.max_memory_allocated"
        baseline, whole, steady = cuda_after_imports, max(cuda_peak_warmup, cuda_peak_steady), cuda_peak_steady
    else:
        metric = "VmHWM"
        baseline, whole, steady = rss_after_imports_kib * 1024, hwm_whole_kib * 1024, hwm_steady_kib * 1024
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor))
    emit_result({
        "variant": args.child,
        "kind": kind,
        "optimizer": opt_name,
        "device": device.type,
        "n_params": n_params,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "optimizer_state_bytes": state_bytes,
        "optimizer_state_params": len(opt.state),
        "grads_not_none_after_warmup": grads_after_warmup,
        "grads_not_none_after_steps": sum(p.grad is not None for p in model.parameters()),
        # the headline, in bytes: VmHWM on CPU, cuda.max_memory_allocated on a GPU
        "memory_metric": metric,
        "baseline_bytes": baseline,
        "whole_run_peak_bytes": whole,
        "steady_peak_bytes": steady,
        "peak_in": "warm-up" if whole > steady else "steps",   # which part of the run set the whole-run peak
        "bytes_per_param_whole_run": (whole - baseline) / n_params,
        "bytes_per_param_steady": (steady - baseline) / n_params,
        # host memory, KiB
        "rss_after_imports_kib": rss_after_imports_kib,
        "vm_hwm_warmup_kib": hwm_warmup_kib,
        "vm_hwm_steady_kib": hwm_steady_kib,
        "vm_hwm_whole_run_kib": hwm_whole_kib,
        "rss_before_steps_kib": rss_before_steps_kib,
        "rss_end_kib": rss_end_kib,
        "peak_reset": reset_ok,
        "cuda_allocated_after_imports": cuda_after_imports,
        "cuda_peak_warmup": cuda_peak_warmup,
        "cuda_peak_steady": cuda_peak_steady,
        "warmup_call_s": warmup_s,
        "step_times_s": times,
        "median_step_s": statistics.median(times),
        "min_step_s": min(times),
        "other_cores_during_steps": others,
        "losses": losses,
        "graphs": graphs,
        "num_threads": torch.get_num_threads(),
        "estimate": estimate,
    })


# ====================================================================== parent side

def _spawn(args, variant: str, estimate: bool = False) -> dict:
    cmd = child_command(__file__, child=variant, layers=args.layers, width=args.width, batch=args.batch,
                        steps=args.steps, warmup=args.warmup, threads=args.threads, estimate=estimate)
    with empty_cache_dir(variant) as cache_dir:
        # --malloc-mmap-threshold (a diagnostic): a fixed threshold turns off glibc's dynamic one; every
        # buffer at least this big is mmap'ed and unmapped on free, so RSS follows the live tensors.
        env = child_env(args.threads, cache_dir, MALLOC_MMAP_THRESHOLD_=args.malloc_mmap_threshold)
        return run_child(cmd, env, args.child_timeout)


def _mb(nbytes: float) -> float:
    return nbytes / _MB


def _kib_mb(kib: float) -> float:
    return kib * 1024 / _MB


def _split(text: str, allowed: tuple, what: str) -> tuple:
    items = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [v for v in items if v not in allowed]
    if unknown or not items:
        raise SystemExit(f"unknown or no {what} {unknown}; choose from {', '.join(allowed)}")
    return items


def _summarize(rs: list[dict]) -> dict:
    return {
        "memory_metric": rs[0]["memory_metric"],
        "baseline_mb": _mb(median([r["baseline_bytes"] for r in rs])),
        "whole_run_peak_mb": _mb(median([r["whole_run_peak_bytes"] for r in rs])),
        "steady_peak_mb": _mb(median([r["steady_peak_bytes"] for r in rs])),
        "bytes_per_param_whole_run": median([r["bytes_per_param_whole_run"] for r in rs]),
        "bytes_per_param_steady": median([r["bytes_per_param_steady"] for r in rs]),
        "peak_in": sorted({r["peak_in"] for r in rs}),
        "vm_hwm_whole_run_mb": _kib_mb(median([r["vm_hwm_whole_run_kib"] for r in rs])),
        "vm_hwm_steady_mb": _kib_mb(median([r["vm_hwm_steady_kib"] for r in rs])),
        "median_step_ms": median([r["median_step_s"] for r in rs]) * 1e3,
        "min_step_ms": min(r["min_step_s"] for r in rs) * 1e3,
        "grads_not_none_after_steps": max(r["grads_not_none_after_steps"] for r in rs),
        "optimizer_state_mb": _mb(rs[0]["optimizer_state_bytes"]),
        "final_loss": rs[0]["losses"][-1],
    }


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def _compare(summary: dict, opt: str, grad_bytes: int) -> dict:
    """optpass/OPT against inductor/OPT and eager/OPT: the goals, and the steady-state numbers beside them."""
    o = summary.get(f"optpass/{opt}")
    out = {}
    if o is None:
        return out
    for base in ("inductor", "eager"):
        b = summary.get(f"{base}/{opt}")
        if b is None:
            continue
        saved = (b["whole_run_peak_mb"] - o["whole_run_peak_mb"]) * _MB / grad_bytes
        out[f"whole_run_saved_vs_{base}_fraction_of_gradients"] = saved
        out[f"whole_run_saved_vs_{base}_goal_met"] = saved >= MEMORY_GOAL
        out[f"steady_saved_vs_{base}_fraction_of_gradients"] = \
            (b["steady_peak_mb"] - o["steady_peak_mb"]) * _MB / grad_bytes
        out[f"step_time_optpass_over_{base}"] = o["median_step_ms"] / b["median_step_ms"]
        out[f"min_step_time_optpass_over_{base}"] = o["min_step_ms"] / b["min_step_ms"]
    if "step_time_optpass_over_inductor" in out:
        out["step_time_vs_inductor_goal_met"] = out["step_time_optpass_over_inductor"] <= STEP_GOAL
    return out


def _print_goals(opt: str, summary: dict, ratios: dict, grad_bytes: int) -> None:
    o = summary.get(f"optpass/{opt}")
    if o is None:
        return
    for base in ("inductor", "eager"):
        b = summary.get(f"{base}/{opt}")
        if b is None:
            print(f"  whole-run peak saved vs {base:8s}: n/a ({base}/{opt} not run)")
            continue
        saved = ratios[f"whole_run_saved_vs_{base}_fraction_of_gradients"]
        print(f"  whole-run peak saved vs {base:8s}: {b['whole_run_peak_mb'] - o['whole_run_peak_mb']:8.1f} MB = "
              f"{saved:6.3f} x gradient bytes  [goal >= {MEMORY_GOAL:.2f}: {_verdict(saved >= MEMORY_GOAL)}]"
              f"   (steady state: {ratios[f'steady_saved_vs_{base}_fraction_of_gradients']:.3f})")
    if "step_time_optpass_over_inductor" in ratios:
        r = ratios["step_time_optpass_over_inductor"]
        print(f"  step time optpass / inductor: {r:.3f} (of the minima "
              f"{ratios['min_step_time_optpass_over_inductor']:.3f})  [goal <= {STEP_GOAL:.2f}: "
              f"{_verdict(r <= STEP_GOAL)}]")
    else:
        print(f"  step time optpass / inductor: n/a (inductor/{opt} not run)")
    if "step_time_optpass_over_eager" in ratios:
        print(f"  step time optpass / eager:    {ratios['step_time_optpass_over_eager']:.3f}")
    c = summary.get(f"optpass-clip/{opt}")
    if c is not None:
        ratios["step_time_clip_over_optpass"] = c["median_step_ms"] / o["median_step_ms"]
        ratios["whole_run_peak_clip_minus_optpass_mb"] = c["whole_run_peak_mb"] - o["whole_run_peak_mb"]
        print(f"  optpass-clip vs optpass: step time ratio {ratios['step_time_clip_over_optpass']:.3f}; whole-run "
              f"peak {ratios['whole_run_peak_clip_minus_optpass_mb']:+.1f} MB  (the cost of clip_grad_norm)")
    for variant, what in (("optpass-inline", "every update inline: what outlining changes"),
                          ("optpass-scaler", "grad_scaler inside backward: a check-only first backward"),
                          ("optpass-scaler-after", "grad_scaler, update after backward")):
        c = summary.get(f"{variant}/{opt}")
        if c is not None:
            ratios[f"step_time_{variant}_over_optpass"] = c["median_step_ms"] / o["median_step_ms"]
            ratios[f"whole_run_peak_{variant}_minus_optpass_mb"] = c["whole_run_peak_mb"] - o["whole_run_peak_mb"]
            print(f"  {variant} vs optpass: step time ratio {ratios[f'step_time_{variant}_over_optpass']:.3f}; "
                  f"whole-run peak {ratios[f'whole_run_peak_{variant}_minus_optpass_mb']:+.1f} MB  ({what})")
    e, eager = summary.get(f"optpass-eager/{opt}"), summary.get(f"eager/{opt}")
    if e is not None and eager is not None:
        saved = (eager["whole_run_peak_mb"] - e["whole_run_peak_mb"]) * _MB / grad_bytes
        ratios["whole_run_saved_optpass_eager_vs_eager_fraction_of_gradients"] = saved
        print(f"  optpass-eager vs eager: whole-run peak saved {saved:.3f} x gradient bytes; step time ratio "
              f"{e['median_step_ms'] / eager['median_step_ms']:.3f}")


def _print_estimate(estimate: dict, grad_bytes: int) -> None:
    print(f"  graph-level estimate (optpass.analysis.memory, {estimate['lowering']} lowering, the fused compile; "
          f"passes {', '.join(estimate['passes'])}):")
    print(f"    gradients that become p.grad: {estimate['gradient_bytes'] / _MB:.1f} MB "
          f"(largest {estimate['largest_gradient_bytes'] / _MB:.1f} MB)")
    print(f"    gradient bytes live at the estimated peak: before {estimate['gradient_at_peak_before'] / _MB:.1f} MB"
          f" -> after {estimate['gradient_at_peak_after'] / _MB:.1f} MB")
    print(f"    estimated peak: before {estimate['peak_before'] / _MB:.1f} MB (after {estimate['peak_node_before']})"
          f" -> after {estimate['peak_after'] / _MB:.1f} MB (after {estimate['peak_node_after']}); "
          f"saved {(estimate['peak_before'] - estimate['peak_after']) / grad_bytes:.3f} x gradient bytes")
    print(f"    live at the graph's end: before {estimate['left_at_end_before'] / _MB:.1f} MB -> after "
          f"{estimate['left_at_end_after'] / _MB:.1f} MB")


def run_parent(args) -> None:
    kinds = _split(args.variants, ALL_KINDS, "variants")
    optimizers = _split(args.optimizers, OPTIMIZERS, "optimizers")
    variants = [f"{k}/{o}" for o in optimizers for k in kinds]
    started = time.perf_counter()
    print(f"optimizer_in_backward: whole-run peak memory and step time | MLP {args.layers} x "
          f"Linear({args.width}, {args.width}), batch {args.batch}, fp32 | optimizers {', '.join(optimizers)} | "
          f"threads {args.threads} | warmup {args.warmup} | steps {args.steps} | repeats {args.repeats} | "
          f"variants {', '.join(kinds)}", flush=True)
    if args.malloc_mmap_threshold is not None:
        print(f"DIAGNOSTIC, NOT WHAT A USER SEES: MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold} in every "
              "child (RSS follows the live tensors, not glibc's heap)", flush=True)

    runs = {v: [] for v in variants}
    for rep in range(args.repeats):
        for variant in variants:          # interleaved: eager, inductor, optpass, eager, ...
            r = _spawn(args, variant)
            runs[variant].append(r)
            cuda = (f", cuda peak whole run {_mb(r['whole_run_peak_bytes']):.1f} MB / steady "
                    f"{_mb(r['steady_peak_bytes']):.1f} MB" if r["device"] == "cuda" else "")
            print(f"  {variant:20s} rep {rep}: VmHWM whole run {_kib_mb(r['vm_hwm_whole_run_kib']):8.1f} MB "
                  f"(warm-up {_kib_mb(r['vm_hwm_warmup_kib']):.1f}), steady {_kib_mb(r['vm_hwm_steady_kib']):8.1f} "
                  f"MB, after imports {_kib_mb(r['rss_after_imports_kib']):.1f} MB{cuda}, step "
                  f"{r['median_step_s'] * 1e3:.1f} ms (min {r['min_step_s'] * 1e3:.1f}), warm-up calls "
                  f"{', '.join(f'{c:.1f}' for c in r['warmup_call_s'])} s, process {r['process_wall_s']:.0f} s, "
                  f"other load {r.get('other_processes_cores')} cores ({r.get('other_cores_during_steps')} "
                  "during the measured steps)", flush=True)

    # the graph-level estimate, from one more (unmeasured) child per optpass variant that keeps graphs
    for variant in variants:
        if variant.split("/")[0].startswith("optpass"):
            runs[variant][0]["estimate"] = _spawn(args, variant, estimate=True)["estimate"]

    first = runs[variants[0]][0]
    n_params = first["n_params"]
    grad_bytes = 4 * n_params
    metric = first["memory_metric"]
    summary = {v: _summarize(runs[v]) for v in variants}

    print()
    print(f"parameters {n_params:,} | parameter bytes {first['param_bytes'] / _MB:.1f} MB | "
          f"gradient bytes (4 x params) {grad_bytes / _MB:.1f} MB | MB = 1e6 bytes | medians of {args.repeats}")
    print(f"memory: {metric} ({'GPU allocator' if metric.startswith('cuda') else 'peak RSS, /proc/self/status'}); "
          "whole run = since process start, no reset; steady = after warm-up, peak reset; "
          "B/param = (peak - RSS after imports, before the model is built) / parameters")
    header = (f"{'variant':20s} {'after imports':>13s} {'whole-run peak':>14s} {'B/param':>8s} {'peak in':>14s} "
              f"{'steady peak':>12s} {'B/param':>8s} {'step ms':>9s} {'min ms':>8s} {'grads left':>10s} "
              f"{'final loss':>11s}")
    ratios, estimates = {}, {}
    for opt in optimizers:
        state = STATE_BYTES_PER_PARAM[opt]
        print()
        print(f"{opt}: fp32 reference before activations: {8 + state} B/param with every gradient alive "
              f"(4 param + {state} state + 4 gradient), {4 + state} with updates in backward")
        print(header)
        print("-" * len(header))
        for v in (f"{k}/{opt}" for k in kinds):
            s = summary[v]
            print(f"{v:20s} {s['baseline_mb']:10.1f} MB {s['whole_run_peak_mb']:11.1f} MB "
                  f"{s['bytes_per_param_whole_run']:8.2f} {'+'.join(s['peak_in']):>14s} "
                  f"{s['steady_peak_mb']:9.1f} MB {s['bytes_per_param_steady']:8.2f} "
                  f"{s['median_step_ms']:9.1f} {s['min_step_ms']:8.1f} {s['grads_not_none_after_steps']:10d} "
                  f"{s['final_loss']:11.6f}")
        ratios[opt] = _compare(summary, opt, grad_bytes)
        if f"optpass/{opt}" in summary:
            print(f"optpass/{opt} goals:")
            _print_goals(opt, summary, ratios[opt], grad_bytes)
        found = [r["estimate"] for k in kinds if k.startswith("optpass") for r in runs[f"{k}/{opt}"]
                 if r.get("estimate")]
        if found:
            estimates[opt] = found[0]
            _print_estimate(found[0], grad_bytes)
        elif any(k.startswith("optpass") for k in kinds):
            print(f"  WARNING: no report with optimizer_in_backward applied was recorded for {opt} (no estimate)")

    notes = []
    for v in variants:
        if v.startswith("optpass") and summary[v]["grads_not_none_after_steps"]:
            notes.append(f"WARNING: {v}: {summary[v]['grads_not_none_after_steps']} parameters still have "
                         ".grad after the steps (expected none)")
    if not all(r["peak_reset"] for rs in runs.values() for r in rs):
        notes.append("WARNING: /proc/self/clear_refs could not reset VmHWM: the steady-state VmHWM is the "
                     "whole run's")
    others = [r.get("other_cores_during_steps") for rs in runs.values() for r in rs]
    others = [o for o in others if o is not None]
    if others and max(others) > 0.25:
        notes.append(f"WARNING: other processes kept up to {max(others):.2f} CPUs busy during a child's measured "
                     "steps: step times are noisy (compare the minima, or rerun on an idle machine)")
    print()
    for n in notes:
        print(n)
    elapsed = time.perf_counter() - started
    print(f"total {elapsed:.0f} s")

    out = {
        "config": {"layers": args.layers, "width": args.width, "batch": args.batch, "steps": args.steps,
                   "warmup": args.warmup, "repeats": args.repeats, "threads": args.threads,
                   "malloc_mmap_threshold": args.malloc_mmap_threshold, "optimizers": list(optimizers),
                   "variants": variants},
        "n_params": n_params,
        "gradient_bytes": grad_bytes,
        "memory_metric": metric,
        "summary": summary,
        "ratios": ratios,
        "estimates": estimates,
        "goals": {"whole_run_saved_vs_inductor_and_eager_min_fraction_of_gradients": MEMORY_GOAL,
                  "step_time_optpass_over_inductor_max": STEP_GOAL},
        "runs": runs,
        "total_s": round(elapsed, 1),
    }
    brief = {k: out[k] for k in ("config", "n_params", "gradient_bytes", "memory_metric", "summary", "ratios",
                                 "goals")}
    print_json(brief, out, args.json)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=None, help="Linear layers (default 12; --quick 4)")
    p.add_argument("--width", type=int, default=None, help="features of every layer (default 2896; --quick 1024)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=None, help="measured steps per child (default 5; --quick 3)")
    p.add_argument("--warmup", type=int, default=3,
                   help="calls before measuring (>= 3: every compile is done, whichever call compiles the fused "
                        "graph, and Inductor's recompile once torch.optim has state)")
    p.add_argument("--repeats", type=int, default=None,
                   help="interleaved rounds of all variants (default 2; --quick 1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                   help=f"comma-separated, from {', '.join(OPTIMIZERS)} (AdamW; SGD with momentum 0.9)")
    p.add_argument("--variants", default=",".join(DEFAULT_KINDS),
                   help=f"comma-separated kinds, from {', '.join(ALL_KINDS)}; each runs with every optimizer")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 x Linear(1024, 1024), 1 repeat, 3 steps")
    p.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                   help="DIAGNOSTIC, not what a user sees: set glibc's MALLOC_MMAP_THRESHOLD_ in the children "
                        "(e.g. 131072: freed tensor buffers go back to the OS, so RSS tracks live tensors)")
    p.add_argument("--json", help="write all results to this file")
    p.add_argument("--child-timeout", type=int, default=900)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--estimate", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup < 3:
        p.error("--warmup must be >= 3 (every compile must be done before the measured steps)")
    quick = args.quick and not args.child
    for name, full, small in (("layers", 12, 4), ("width", 2896, 1024), ("steps", 5, 3), ("repeats", 2, 1)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    (run_variant if args.child else run_parent)(args)


if __name__ == "__main__":
    main()
