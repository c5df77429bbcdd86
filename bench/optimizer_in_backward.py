#!/usr/bin/env python3
"""How much memory does ``optimizer_in_backward`` save, and what does it cost in step time?

One training step of a large fp32 MLP (default: 12 ``Linear(2896, 2896)`` layers
with ReLU between them, about 100.7M parameters, batch 8, MSE loss) with fp32
AdamW, in the supported step shape::

    loss = F.mse_loss(model(x), y); loss.backward(); out = loss.detach(); opt.step(); opt.zero_grad(); return out

Variants (each in a FRESH subprocess: this script re-invoked with ``--child VARIANT``):

* ``eager``    -- the step as plain eager PyTorch (no compile);
* ``inductor`` -- ``torch.compile(step, backend="inductor")``; optpass is imported
  so ``torch._dynamo.config.trace_autograd_ops`` is on and backward is traced into
  the step graph, the same capture as optpass;
* ``optpass``  -- ``torch.compile(step, backend="optpass", options={"optimizer": opt,
  "optimizer_in_backward": True})`` (default lowering: Inductor). Call 1 runs the
  unfused graph and an eager ``opt.step()`` (torch.optim creates its state), call
  2 compiles the fused graph -- inside ``optpass.keep_graphs()``, so its report
  carries the graph-level memory estimate before/after the pass;
* ``optpass-clip`` (only with ``--variants``) -- optpass with ``clip_grad_norm=1.0``: what
  exact global-norm clipping (a norm-only backward first) costs.
* ``optpass-eager`` (only with ``--variants``) -- the same with ``lower="eager"``:
  the rewritten aten graph run as is, for telling Inductor's part from the pass's.

Every child imports optpass (same imported modules, same Dynamo config), sets
``torch.set_num_threads(--threads)`` (and ``OMP_NUM_THREADS``), gets its own empty
``TORCHINDUCTOR_CACHE_DIR``, runs ``--warmup`` calls (compiles are done by then;
the child fails if a graph compiles during the measured steps), then resets the
peak-RSS mark (``echo 5 > /proc/self/clear_refs``), runs ``--steps`` measured
steps timed with ``time.perf_counter`` and reads ``VmHWM``/``VmRSS`` from
``/proc/self/status``. ``ru_maxrss`` (peak over the whole process, compile
included) is reported too, and ``HWM-pre``: VmHWM minus the RSS right before the
measured steps, what the steps add on top of what stays resident.

RSS is what glibc holds, not what tensors hold: with glibc's dynamic mmap
threshold, ~32 MiB buffers (a 2896^2 fp32 weight's gradient is 33.5 MB) come from
the heap after the first one is freed, and freed heap pages stay resident. So the
warm-up's highest point (optpass: call 1 is an unfused step plus an eager
``opt.step()``, all gradients alive) can stay in RSS and hide a smaller steady
peak. Two opt-in knobs, applied to every variant alike:
``--malloc-trim`` (``malloc_trim(0)`` after warm-up, before the peak reset) and
``--malloc-mmap-threshold 131072`` (a fixed threshold: every buffer >= 128 KiB is
mmap'ed and unmapped on free, so RSS follows the live tensors).

The parent runs the variants interleaved, ``--repeats`` times (eager, inductor,
optpass, eager, inductor, optpass, ...), takes medians, and prints:

* gradient bytes = 4 x number of parameters (fp32);
* memory saved as a fraction of the gradient bytes:
  ``(VmHWM_inductor - VmHWM_optpass) / gradient_bytes`` (goal >= 0.90) and the same vs eager;
* step time ratio optpass / inductor (goal <= 1.00) and optpass / eager;
* the graph-level estimate (``optpass.memory``) of the fused compile: gradient bytes
  live at the estimated peak and the estimated peak, before vs after the passes.

Usage::

    python3 bench/optimizer_in_backward.py                 # default: 12 x 2896^2, batch 8 (~2 min idle, ~6 min busy)
    python3 bench/optimizer_in_backward.py --quick         # smoke run: 4 x 1024^2
    python3 bench/optimizer_in_backward.py --variants eager,inductor,optpass,optpass-eager
    python3 bench/optimizer_in_backward.py --malloc-trim  # RSS without the heap pages warm-up freed
    python3 bench/optimizer_in_backward.py --json out.json

The parent never imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _measure import children_cpu_s, cpu_busy_s, malloc_trim, median, proc_status_kib, reset_peak_rss, self_cpu_s

DEFAULT_VARIANTS = ("eager", "inductor", "optpass")
ALL_VARIANTS = DEFAULT_VARIANTS + ("optpass-eager", "optpass-clip")
MEMORY_GOAL = 0.90      # fraction of the gradient bytes saved vs inductor
STEP_GOAL = 1.00        # optpass / inductor step time
RESULT_PREFIX = "RESULT:"
_MB = 1e6
_MIB = 1 << 20


# ====================================================================== child side

def _graph_count(torch) -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


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


def run_child(args) -> None:
    import gc
    import resource

    import torch

    torch.set_num_threads(args.threads)
    import torch.nn.functional as F

    import optpass  # every variant: same imports, trace_autograd_ops on (backward in the graph)
    from optpass.models import MLP

    torch._dynamo.config.trace_autograd_ops = True
    variant = args.child
    rss_start_kib = proc_status_kib("VmRSS")

    torch.manual_seed(0)
    model = MLP((args.width,) * (args.layers + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g))
            for _ in range(4)]

    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    if variant == "eager":
        step = train_step
    elif variant == "inductor":
        step = torch.compile(train_step, backend="inductor")
    elif variant in ("optpass", "optpass-eager", "optpass-clip"):
        options = {"optimizer": opt, "optimizer_in_backward": True}
        if variant == "optpass-eager":
            options["lower"] = "eager"
        if variant == "optpass-clip":   # exact global-norm clipping: one extra, norm-only backward
            options["clip_grad_norm"] = 1.0
        step = torch.compile(train_step, backend="optpass", options=options)
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    fused = variant.startswith("optpass")

    warmup_s, losses, estimate = [], [], None
    for i in range(args.warmup):
        x, y = data[i % len(data)]
        t0 = time.perf_counter()
        if fused and i == 1:              # the fused graph compiles at the 2nd call
            optpass.report.clear_reports()
            with optpass.keep_graphs():
                out = step(x, y)
        else:
            out = step(x, y)
        losses.append(float(out))
        warmup_s.append(time.perf_counter() - t0)
    if fused:
        estimate = _fused_report_estimate(optpass)
        optpass.report.clear_reports()    # drop the kept graph copies before measuring
    graphs = _graph_count(torch)
    grads_after_warmup = sum(p.grad is not None for p in model.parameters())

    gc.collect()
    trimmed = malloc_trim() if args.malloc_trim else None
    rss_before_kib = proc_status_kib("VmRSS")
    reset_ok = reset_peak_rss()
    machine_before, self_before, wall_before = cpu_busy_s(), self_cpu_s(), time.perf_counter()
    times = []
    for i in range(args.steps):
        x, y = data[(args.warmup + i) % len(data)]
        t0 = time.perf_counter()
        out = step(x, y)
        times.append(time.perf_counter() - t0)
        losses.append(float(out))
    vm_hwm_kib = proc_status_kib("VmHWM")
    vm_rss_kib = proc_status_kib("VmRSS")
    machine_after, self_after, wall_after = cpu_busy_s(), self_cpu_s(), time.perf_counter()
    other_cores = None
    if machine_before is not None and machine_after is not None:
        # CPUs kept busy by other processes while the measured steps ran (OpenMP threads that
        # share the cores with another process make steps several times slower)
        other_cores = round(max(0.0, (machine_after - machine_before) - (self_after - self_before))
                            / (wall_after - wall_before), 2)
    if _graph_count(torch) != graphs:
        raise SystemExit(f"{variant}: {_graph_count(torch) - graphs} graph(s) compiled during the measured "
                         "steps (raise --warmup, or the step recompiles)")

    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor))
    result = {
        "variant": variant,
        "n_params": n_params,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "optimizer_state_bytes": state_bytes,
        "optimizer_state_params": len(opt.state),
        "grads_not_none_after_warmup": grads_after_warmup,
        "grads_not_none_after_steps": sum(p.grad is not None for p in model.parameters()),
        "rss_at_start_kib": rss_start_kib,
        "rss_before_steps_kib": rss_before_kib,
        "peak_reset": reset_ok,
        "malloc_trim": trimmed,
        "vm_hwm_kib": vm_hwm_kib,
        "vm_rss_kib": vm_rss_kib,
        "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "warmup_call_s": warmup_s,
        "step_times_s": times,
        "median_step_s": statistics.median(times),
        "min_step_s": min(times),
        "other_cores_during_steps": other_cores,
        "losses": losses,
        "graphs": graphs,
        "num_threads": torch.get_num_threads(),
        "estimate": estimate,
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# ====================================================================== parent side

def _spawn(args, variant: str) -> dict:
    cache_dir = tempfile.mkdtemp(prefix=f"optpass-oib-{variant}-")   # empty: nothing shared between children
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    env["OMP_NUM_THREADS"] = str(args.threads)
    if args.malloc_mmap_threshold is not None:
        # glibc: a fixed threshold turns off the dynamic one; every buffer at least this big is
        # mmap'ed and unmapped on free, so RSS follows the live tensors rather than the heap.
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    for var in ("TORCH_COMPILE_DEBUG", "TORCH_TRACE", "TORCH_LOGS", "TORCHINDUCTOR_FORCE_DISABLE_CACHES"):
        env.pop(var, None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant,
           "--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
    if args.malloc_trim:
        cmd.append("--malloc-trim")
    cpu_before, ours_before = cpu_busy_s(), children_cpu_s()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise SystemExit(f"child {variant!r} timed out after {args.child_timeout}s: {' '.join(cmd)}\n"
                         f"--- stderr tail ---\n{err[-4000:]}")
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"child {variant!r} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                         f"--- stdout tail ---\n{proc.stdout[-3000:]}\n--- stderr tail ---\n{proc.stderr[-6000:]}")
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    result["process_wall_s"] = round(wall, 2)
    cpu_after, ours_after = cpu_busy_s(), children_cpu_s()
    if cpu_before is not None and cpu_after is not None:
        # cores kept busy by processes other than this child, on average over its run
        result["other_processes_cores"] = round(
            max(0.0, (cpu_after - cpu_before) - (ours_after - ours_before)) / wall, 2)
    warnings_seen = sorted({ln.strip() for ln in proc.stderr.splitlines() if "Warning" in ln})
    if warnings_seen:
        result["stderr_warnings"] = warnings_seen[:20]
    return result


def _mb(kib: float) -> float:
    return kib * 1024 / _MB


def run_parent(args) -> None:
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = [v for v in variants if v not in ALL_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {ALL_VARIANTS}")
    started = time.perf_counter()
    print(f"optimizer_in_backward memory/step time | MLP {args.layers} x Linear({args.width}, {args.width}), "
          f"batch {args.batch}, fp32 AdamW | threads {args.threads} | warmup {args.warmup} | "
          f"steps {args.steps} | repeats {args.repeats} | variants {', '.join(variants)} | MALLOC_MMAP_THRESHOLD_ "
          f"{args.malloc_mmap_threshold if args.malloc_mmap_threshold is not None else '(glibc default)'}"
          f"{' | malloc_trim after warm-up' if args.malloc_trim else ''}",
          flush=True)

    runs = {v: [] for v in variants}
    for rep in range(args.repeats):
        for variant in variants:
            r = _spawn(args, variant)
            runs[variant].append(r)
            print(f"  {variant:13s} rep {rep}: VmHWM {_mb(r['vm_hwm_kib']):8.1f} MB, "
                  f"VmRSS {_mb(r['vm_rss_kib']):8.1f} MB, ru_maxrss {_mb(r['ru_maxrss_kib']):8.1f} MB, "
                  f"step {r['median_step_s'] * 1e3:7.1f} ms (min {r['min_step_s'] * 1e3:.1f}), warmup calls "
                  f"{', '.join(f'{c:.1f}' for c in r['warmup_call_s'])} s, process {r['process_wall_s']:.0f} s, "
                  f"other load {r.get('other_processes_cores')} cores ({r.get('other_cores_during_steps')} "
                  "during the measured steps)", flush=True)

    first = runs[variants[0]][0]
    n_params = first["n_params"]
    grad_bytes = 4 * n_params
    summary = {}
    for v in variants:
        rs = runs[v]
        summary[v] = {
            "vm_hwm_mb": _mb(median([r["vm_hwm_kib"] for r in rs])),
            "vm_rss_mb": _mb(median([r["vm_rss_kib"] for r in rs])),
            "step_peak_above_rest_mb": _mb(median([r["vm_hwm_kib"] - r["rss_before_steps_kib"] for r in rs])),
            "rss_at_start_mb": _mb(median([r["rss_at_start_kib"] for r in rs])),
            "rss_before_steps_mb": _mb(median([r["rss_before_steps_kib"] for r in rs])),
            "ru_maxrss_mb": _mb(median([r["ru_maxrss_kib"] for r in rs])),
            "median_step_ms": median([r["median_step_s"] for r in rs]) * 1e3,
            "min_step_ms": min(r["min_step_s"] for r in rs) * 1e3,
            "grads_not_none_after_steps": max(r["grads_not_none_after_steps"] for r in rs),
            "optimizer_state_mb": rs[0]["optimizer_state_bytes"] / _MB,
            "final_loss": rs[0]["losses"][-1],
        }

    print()
    print(f"parameters {n_params:,} | parameter bytes {first['param_bytes'] / _MB:.1f} MB | "
          f"gradient bytes (4 x params) {grad_bytes / _MB:.1f} MB | "
          f"AdamW state {first['optimizer_state_bytes'] / _MB:.1f} MB   (MB = 1e6 bytes; medians of {args.repeats})")
    header = (f"{'variant':13s} {'VmHWM steady':>13s} {'VmRSS end':>10s} {'RSS pre-steps':>14s} "
              f"{'HWM-pre':>10s} {'RSS at start':>13s} "
              f"{'ru_maxrss':>10s} {'step ms':>9s} {'min ms':>8s} {'grads left':>10s} {'final loss':>11s}")
    print(header)
    print("-" * len(header))
    for v in variants:
        s = summary[v]
        print(f"{v:13s} {s['vm_hwm_mb']:10.1f} MB {s['vm_rss_mb']:7.1f} MB {s['rss_before_steps_mb']:11.1f} MB "
              f"{s['step_peak_above_rest_mb']:7.1f} MB "
              f"{s['rss_at_start_mb']:10.1f} MB "
              f"{s['ru_maxrss_mb']:7.1f} MB {s['median_step_ms']:9.1f} {s['min_step_ms']:8.1f} "
              f"{s['grads_not_none_after_steps']:10d} "
              f"{s['final_loss']:11.6f}")

    ratios = {}
    print()
    if "optpass" in summary:
        o = summary["optpass"]
        for base in ("inductor", "eager"):
            if base not in summary:
                continue
            b = summary[base]
            saved = (b["vm_hwm_mb"] - o["vm_hwm_mb"]) * _MB / grad_bytes
            step_ratio = o["median_step_ms"] / b["median_step_ms"]
            ratios[f"memory_saved_vs_{base}_fraction_of_gradients"] = saved
            ratios[f"step_time_optpass_over_{base}"] = step_ratio
            ratios[f"min_step_time_optpass_over_{base}"] = o["min_step_ms"] / b["min_step_ms"]
            goal = ""
            if base == "inductor":
                goal = (f"  [memory goal >= {MEMORY_GOAL:.2f}: {'met' if saved >= MEMORY_GOAL else 'NOT met'}; "
                        f"time goal <= {STEP_GOAL:.2f}: {'met' if step_ratio <= STEP_GOAL else 'NOT met'}]")
            print(f"optpass vs {base:8s}: VmHWM saved {(b['vm_hwm_mb'] - o['vm_hwm_mb']):8.1f} MB = "
                  f"{saved:.3f} x gradient bytes; step time ratio {step_ratio:.3f} (of the minima "
                  f"{o['min_step_ms'] / b['min_step_ms']:.3f}){goal}")
        if "optpass-clip" in summary and "optpass" in summary:
            c, o = summary["optpass-clip"], summary["optpass"]
            ratios["step_time_clip_over_optpass"] = c["median_step_ms"] / o["median_step_ms"]
            ratios["memory_clip_minus_optpass_mb"] = c["vm_hwm_mb"] - o["vm_hwm_mb"]
            print(f"optpass-clip vs optpass: step time ratio {ratios['step_time_clip_over_optpass']:.3f} "
                  f"(of the minima {c['min_step_ms'] / o['min_step_ms']:.3f}); VmHWM "
                  f"{ratios['memory_clip_minus_optpass_mb']:+.1f} MB  (the cost of clip_grad_norm)")
        if "optpass-eager" in summary and "eager" in summary:
            e = summary["optpass-eager"]
            saved = (summary["eager"]["vm_hwm_mb"] - e["vm_hwm_mb"]) * _MB / grad_bytes
            ratios["memory_saved_optpass_eager_vs_eager_fraction_of_gradients"] = saved
            print(f"optpass-eager vs eager: VmHWM saved {saved:.3f} x gradient bytes; step time ratio "
                  f"{e['median_step_ms'] / summary['eager']['median_step_ms']:.3f}")

    estimates = [r["estimate"] for v in variants if v.startswith("optpass") for r in runs[v] if r.get("estimate")]
    estimate = estimates[0] if estimates else None
    if estimate:
        print()
        print(f"graph-level estimate (optpass.memory, {estimate['lowering']} lowering, fused compile; "
              f"passes {', '.join(estimate['passes'])}):")
        print(f"  gradients that become p.grad: {estimate['gradient_bytes'] / _MB:.1f} MB "
              f"(largest {estimate['largest_gradient_bytes'] / _MB:.1f} MB)")
        print(f"  gradient bytes live at the estimated peak: before {estimate['gradient_at_peak_before'] / _MB:.1f} MB"
              f" -> after {estimate['gradient_at_peak_after'] / _MB:.1f} MB")
        print(f"  estimated peak: before {estimate['peak_before'] / _MB:.1f} MB (after {estimate['peak_node_before']})"
              f" -> after {estimate['peak_after'] / _MB:.1f} MB (after {estimate['peak_node_after']}); "
              f"saved {(estimate['peak_before'] - estimate['peak_after']) / grad_bytes:.3f} x gradient bytes")
        print(f"  live at the graph's end: before {estimate['left_at_end_before'] / _MB:.1f} MB -> after "
              f"{estimate['left_at_end_after'] / _MB:.1f} MB")
    elif any(v.startswith("optpass") for v in variants):
        print("\nWARNING: no report with optimizer_in_backward applied was recorded (no estimate)")

    notes = []
    for v in variants:
        if v.startswith("optpass") and summary[v]["grads_not_none_after_steps"]:
            notes.append(f"WARNING: {v}: {summary[v]['grads_not_none_after_steps']} parameters still have "
                         ".grad after the steps (expected none)")
    if not all(r["peak_reset"] for rs in runs.values() for r in rs):
        notes.append("WARNING: /proc/self/clear_refs could not reset VmHWM: VmHWM includes the compile")
    others = [r.get("other_cores_during_steps") for rs in runs.values() for r in rs]
    others = [o for o in others if o is not None]
    if others and max(others) > 0.25:
        notes.append(f"WARNING: other processes kept up to {max(others):.2f} CPUs busy during a child's measured "
                     "steps: step times are noisy (compare the minima, or rerun on an idle machine)")
    for n in notes:
        print(n)
    elapsed = time.perf_counter() - started
    print(f"total {elapsed:.0f} s")

    out = {
        "config": {"layers": args.layers, "width": args.width, "batch": args.batch, "steps": args.steps,
                   "warmup": args.warmup, "repeats": args.repeats, "threads": args.threads,
                   "malloc_mmap_threshold": args.malloc_mmap_threshold, "malloc_trim": args.malloc_trim,
                   "variants": list(variants)},
        "n_params": n_params,
        "gradient_bytes": grad_bytes,
        "summary": summary,
        "ratios": ratios,
        "estimate": estimate,
        "goals": {"memory_saved_vs_inductor_min": MEMORY_GOAL, "step_time_vs_inductor_max": STEP_GOAL},
        "runs": runs,
        "total_s": round(elapsed, 1),
    }
    brief = {k: out[k] for k in ("config", "n_params", "gradient_bytes", "summary", "ratios", "estimate")}
    print("JSON: " + json.dumps(brief))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=None, help="Linear layers (default 12; --quick 4)")
    p.add_argument("--width", type=int, default=None, help="features of every layer (default 2896; --quick 1024)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=None, help="measured steps per child (default 5; --quick 3)")
    p.add_argument("--warmup", type=int, default=3, help="calls before measuring (>= 3: compiles done)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds of all variants (default 2; --quick 1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, from {', '.join(ALL_VARIANTS)}")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 x Linear(1024, 1024), 1 repeat, 3 steps")
    p.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                   help="set glibc's MALLOC_MMAP_THRESHOLD_ in the children (e.g. 131072: freed tensor "
                        "buffers go back to the OS, so RSS tracks live tensors; default: glibc's dynamic one)")
    p.add_argument("--malloc-trim", action="store_true",
                   help="call glibc malloc_trim(0) after warm-up, before resetting the peak mark (the heap's "
                        "free pages left by warm-up and compile stop counting as RSS)")
    p.add_argument("--json", help="write all results to this file")
    p.add_argument("--child-timeout", type=int, default=900)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup < 3:
        p.error("--warmup must be >= 3 (optpass compiles the fused graph at the 2nd call)")
    quick = args.quick and not args.child
    for name, full, small in (("layers", 12, 4), ("width", 2896, 1024), ("steps", 5, 3), ("repeats", 2, 1)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    if args.child:
        run_child(args)
    else:
        run_parent(args)


if __name__ == "__main__":
    main()
