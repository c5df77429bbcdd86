#!/usr/bin/env python3
"""What does optpass cost over plain Inductor, for the same training step?

With no rewriting passes, ``backend="optpass"`` should cost nearly nothing over
``backend="inductor"``: it captures the roles of each Dynamo graph, runs its
pipeline as Inductor's ``post_grad_custom_pre_pass``, and otherwise lowers via
the same ``compile_fx``. This script measures that, on one ``TinyLM`` training
step (AdamW with a tensor lr), in the supported step shape::

    loss = model.loss(x, y); loss.backward(); out = loss.detach(); opt.step(); opt.zero_grad(); return out

Both variants import optpass, so ``torch._dynamo.config.trace_autograd_ops`` is
on for both and Dynamo captures the same graphs (backward traced into the step
graph): the difference is exactly optpass's capture + pass pipeline (+ the
custom-pass plumbing it adds to Inductor).

Measurements
------------
1. **Compile time, cold.** Each variant runs in a fresh subprocess with its own
   empty ``TORCHINDUCTOR_CACHE_DIR`` (no FX-graph / AOTAutograd cache hits).
   On torch 2.13 the first call compiles both graphs: the step graph (forward +
   backward) and the update graph (``opt.step()``, which also creates the AdamW
   state). With a tensor lr, call 2 does not compile again. A child fails if any
   graph compiles after its warmup calls. *compile time* = wall time of the first
   ``--warmup`` (3) calls minus ``--warmup`` x that subprocess's median
   steady-state step time; the raw wall time of those calls is reported too. Subprocesses alternate
   inductor/optpass order, ``--repeats`` times each; the median is reported.
2. **Steady-state step time.** The same subprocesses time ``--steps`` steps
   after warmup (median per step). Because separate processes are noisy, the
   reported step-time ratio comes from a separate *interleaved* subprocess that
   compiles both variants (two model+optimizer copies, two step closures) and
   alternates blocks of ``--block`` steps of each for ``--rounds`` rounds
   (order flipped every round); per variant, the median over blocks of the
   per-step time. (That subprocess starts from the cold runs' Inductor caches,
   merged: step time does not depend on where the compiled code came from, and
   it saves compiling both variants again.)

Every process uses ``torch.set_num_threads(--threads)`` (and ``OMP_NUM_THREADS``).
Each child checks that no compile happens during timing and that both variants
compiled the same number of graphs.

Shared machines: other processes on the cores make every number noisy (and a
2-thread OpenMP kernel whose sibling thread is descheduled can run many times
slower). The parent waits (``--idle-wait``) for the CPUs to go idle before each
child, measures how many cores other processes used while it ran
(``/proc/stat`` minus the child's own CPU time), runs a cold child again when
that was over 0.25 cores (``--busy-retries``), prints the compile ratio over
the idle-CPU runs alone when there were busy ones, and warns.

Hugging Face models (``--hf``)
------------------------------
``--hf bert,gpt2,llama --layers 2,8`` measures, for each model and depth, the step a user fine-tunes
with (``model(input_ids=ids, labels=ids).loss``, AdamW with a tensor lr, width 64, vocabulary 1000,
2 sequences) under ``backend="inductor"`` and under ``backend="optpass"`` with the update in backward
(``--hf-variants`` adds ``optpass-after``: the update after backward), each in a fresh process with an
empty Inductor cache, variants alternating: the *first step* (sequence length 16: its wall time
minus a steady step's), the *recompile* a new sequence length causes (24: Dynamo makes the length
dynamic, so 32 then compiles nothing; checked), the process's peak RSS (``VmHWM``, compiling
included) and the RSS before the first call, and for optpass its own time (harvesting the update,
the passes). Ratios optpass / inductor per row; the goal is <= 1.10 for both times.

Usage::

    python3 bench/compile_overhead.py              # full run (~6 min on 2 idle CPU cores; more if busy)
    python3 bench/compile_overhead.py --hf bert,gpt2,llama --layers 2 --repeats 1
    python3 bench/compile_overhead.py --quick      # smoke run (< 2 min)
    python3 bench/compile_overhead.py --json out.json
    python3 bench/compile_overhead.py --profile /tmp/prof   # + cProfile of each child's compile

The parent process never imports torch; all measuring is in child processes
(``--child ...``, re-invoking this script).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from _measure import child_command, child_env, cpu_busy_s, emit_result, graph_count, median, run_child, training_step

VARIANTS = ("inductor", "optpass")
BUSY_CORES = 0.25  # other processes using more CPU than this during a child: its times are noisy
STEP_GOAL = 1.02
COMPILE_GOAL = 1.10

FULL_MODEL = dict(vocab=256, d_model=128, n_heads=4, n_layers=4, seq_len=64, batch=8)
QUICK_MODEL = dict(vocab=64, d_model=32, n_heads=2, n_layers=2, seq_len=16, batch=4)


# ====================================================================== child side

def _setup_torch(threads: int):
    import torch

    torch.set_num_threads(threads)
    import optpass  # noqa: F401  (both variants: sets trace_autograd_ops, same captured graphs)

    torch._dynamo.config.trace_autograd_ops = True
    # Imports that the first compile would otherwise pay for inside the timed region of only
    # the first variant of the interleaved child (the cold children pay them equally).
    import torch._inductor.compile_fx  # noqa: F401
    return torch


def _make_training(torch, model_cfg: dict, seed: int = 0):
    from optpass.demo.models import LMConfig, TinyLM, batches, synthetic_corpus

    cfg = LMConfig(vocab=model_cfg["vocab"], d_model=model_cfg["d_model"], n_heads=model_cfg["n_heads"],
                   n_layers=model_cfg["n_layers"], seq_len=model_cfg["seq_len"])
    torch.manual_seed(seed)
    model = TinyLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
    corpus = synthetic_corpus(cfg.vocab, 20_000, seed=seed)
    stream = batches(corpus, model_cfg["batch"], cfg.seq_len, seed=seed)
    data = [tuple(t.contiguous() for t in next(stream)) for _ in range(16)]
    return model, opt, data


def _dynamo_timed(torch) -> dict:
    metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", {}) or {}
    return {k: round(sum(v), 6) for k, v in metrics.items()}


class _OptpassTimers:
    """Time optpass's own work inside the backend (capture, pass pipeline, harvesting the update
    for a fused step) by wrapping it."""

    def __init__(self):
        self.seconds = {"capture": 0.0, "rewrite": 0.0, "harvest": 0.0}
        import optpass.backend as backend
        import optpass.lowering as lowering
        import optpass.runtime.fused_step as fused_step

        self._wrap(backend, "capture", "capture")
        self._wrap(lowering, "rewrite", "rewrite")
        self._wrap(fused_step, "harvest_update", "harvest")

    def _wrap(self, module, attr, key):
        inner = getattr(module, attr)
        seconds = self.seconds

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[key] += time.perf_counter() - t0

        setattr(module, attr, timed)


def _compile(torch, variant: str, step):
    return torch.compile(step, backend=variant)


def child_cold(args) -> dict:
    """One variant, cold: compile (first `warmup` calls) then `steps` timed steps."""
    torch = _setup_torch(args.threads)
    timers = _OptpassTimers() if args.child == "optpass" else None
    model_cfg = json.loads(args.model)
    model, opt, data = _make_training(torch, model_cfg)
    step = _compile(torch, args.child, training_step(model.loss, opt))

    profiler = None
    if args.profile_out:
        import cProfile

        profiler = cProfile.Profile()
    warmup_calls, graphs_after_call = [], []
    for i in range(args.warmup):
        x, y = data[i % len(data)]
        if profiler:
            profiler.enable()
        t0 = time.perf_counter()
        step(x, y)
        warmup_calls.append(time.perf_counter() - t0)
        if profiler:
            profiler.disable()
        graphs_after_call.append(graph_count())
    if profiler:
        profiler.dump_stats(args.profile_out)

    graphs = graph_count()
    times, losses = [], []
    for i in range(args.steps):
        x, y = data[(args.warmup + i) % len(data)]
        t0 = time.perf_counter()
        out = step(x, y)
        times.append(time.perf_counter() - t0)
        losses.append(float(out))
    if graph_count() != graphs:
        raise RuntimeError(f"{args.child}: {graph_count() - graphs} graph(s) compiled during the "
                           "timed steps (the warmup is too short or the step recompiles)")
    if len(graphs_after_call) > 1 and graphs_after_call[-1] != graphs_after_call[-2]:
        raise RuntimeError(f"{args.child}: call {args.warmup} still compiled (graphs per call: "
                           f"{graphs_after_call}); raise --warmup")
    steady = statistics.median(times)
    result = {
        "variant": args.child,
        "warmup_call_s": warmup_calls,
        "warmup_wall_s": sum(warmup_calls),
        "compile_s": sum(warmup_calls) - len(warmup_calls) * steady,
        "steady_median_s": steady,
        "steady_mean_s": statistics.fmean(times),
        "step_times_s": times,
        "graphs_after_call": graphs_after_call,
        "graphs": graphs,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "dynamo_timed_s": _dynamo_timed(torch),
        "num_threads": torch.get_num_threads(),
    }
    if timers is not None:
        import optpass

        result["optpass_own_s"] = dict(timers.seconds)
        result["optpass_graph_kinds"] = [r.kind.value for r in optpass.recent_reports()]
    return result


def child_interleaved(args) -> dict:
    """Both variants in one process; alternate blocks of steps (the step-time ratio)."""
    torch = _setup_torch(args.threads)
    model_cfg = json.loads(args.model)
    steps, datas, compile_s, graphs = {}, {}, {}, {}
    # Informative only: this process starts from the cold runs' caches (warm-cache compiles),
    # and the variant compiled first also pays the process's one-time warm-up.
    for variant in VARIANTS:
        model, opt, data = _make_training(torch, model_cfg)
        step = _compile(torch, variant, training_step(model.loss, opt))
        before = graph_count()
        t0 = time.perf_counter()
        for i in range(args.warmup):
            step(*data[i % len(data)])
        compile_s[variant] = time.perf_counter() - t0
        graphs[variant] = graph_count() - before
        for i in range(args.block):  # a few warm steps before timing
            step(*data[i % len(data)])
        steps[variant], datas[variant] = step, data
    if graphs["inductor"] != graphs["optpass"]:
        raise RuntimeError(f"the variants compiled different numbers of graphs: {graphs}")

    total = graph_count()
    blocks = {v: [] for v in VARIANTS}
    counter = {v: 0 for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            step, data = steps[variant], datas[variant]
            t0 = time.perf_counter()
            for _ in range(args.block):
                step(*data[counter[variant] % len(data)])
                counter[variant] += 1
            blocks[variant].append((time.perf_counter() - t0) / args.block)
    if graph_count() != total:
        raise RuntimeError("a graph was compiled during the interleaved timing (recompile)")
    med = {v: statistics.median(blocks[v]) for v in VARIANTS}
    paired = [o / i for o, i in zip(blocks["optpass"], blocks["inductor"])]
    fastest = {v: min(blocks[v]) for v in VARIANTS}
    return {
        "block_per_step_s": blocks,
        "median_per_step_s": med,
        "ratio_of_medians": med["optpass"] / med["inductor"],
        "median_paired_ratio": statistics.median(paired),
        "min_per_step_s": fastest,
        "ratio_of_mins": fastest["optpass"] / fastest["inductor"],
        "paired_ratios": paired,
        "in_process_compile_s": compile_s,
        "graphs_per_variant": graphs,
        "compile_order": list(VARIANTS),
        "num_threads": torch.get_num_threads(),
    }


HF_VARIANTS = ("inductor", "optpass", "optpass-after")
HF_LENGTHS = (16, 16, 24, 24, 32)     # first step, steady, recompile (new length), steady, no recompile


def _hf_model(torch, name: str, layers: int):
    import transformers

    torch.manual_seed(0)
    if name == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=1000, hidden_size=64, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=128,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=1000, n_embd=64, n_layer=layers, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=2,
            num_key_value_heads=1))
    raise ValueError(f"unknown --hf model {name!r}")


def child_hf(args) -> dict:
    """One Hugging Face model, one variant, cold: the first step, a new length's recompile, RSS."""
    import torch

    from _measure import proc_status_kib

    torch.set_num_threads(args.threads)
    timers = _OptpassTimers()
    spent = timers.seconds
    model_cfg = json.loads(args.model)
    model = _hf_model(torch, model_cfg["name"], model_cfg["layers"])
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
    train_step = training_step(lambda ids, labels: model(input_ids=ids, labels=labels).loss, opt)

    if args.child == "hf-inductor":
        step = torch.compile(train_step, backend="inductor")
    else:
        step = torch.compile(train_step, backend="optpass", options={
            "optimizer": opt, "optimizer_in_backward": args.child == "hf-optpass"})
    generator = torch.Generator().manual_seed(0)
    rss_before = proc_status_kib("VmRSS") / 1024
    calls, graphs, own = [], [], []
    for length in HF_LENGTHS:
        ids = torch.randint(0, 1000, (2, length), generator=generator)
        for key in spent:
            spent[key] = 0.0
        t0 = time.perf_counter()
        float(step(ids, ids))
        calls.append(time.perf_counter() - t0)
        graphs.append(graph_count())
        own.append(dict(spent))
    if graphs[-1] != graphs[2] or graphs[1] != graphs[0]:
        raise RuntimeError(f"{args.child}: a call that should not compile did (graphs after each call: {graphs})")
    steady = []
    for _ in range(3):
        t0 = time.perf_counter()
        float(step(ids, ids))
        steady.append(time.perf_counter() - t0)
    steady_s = statistics.median(steady)
    return {"variant": args.child[len("hf-"):], "model": model_cfg, "calls_s": calls, "steady_s": steady_s,
            "first_step_s": calls[0] - steady_s, "recompile_s": calls[2] - steady_s,
            "optpass_own_first_s": own[0], "optpass_own_recompile_s": own[2], "graphs": graphs,
            "rss_before_mib": rss_before, "peak_rss_mib": proc_status_kib("VmHWM") / 1024,
            "parameters": sum(p.numel() for p in model.parameters())}


def run_hf_parent(args) -> None:
    models = [m for m in args.hf.split(",") if m]
    depths = [int(d) for d in args.layers.split(",") if d]
    variants = ["inductor"] + [v for v in args.hf_variants.split(",") if v and v != "inductor"]
    print(f"compile time of Hugging Face training steps, optpass vs inductor | models {models} | layers {depths} "
          f"| variants {variants} | repeats {args.repeats} | threads {args.threads}", flush=True)
    rows = []
    for model in models:
        for depth in depths:
            runs = {v: [] for v in variants}
            for rep in range(args.repeats):
                for variant in (variants if rep % 2 == 0 else variants[::-1]):
                    cache_dir = _new_cache_dir(variant)
                    try:
                        r = _spawn(args, f"hf-{variant}", {"name": model, "layers": depth}, cache_dir)
                    finally:
                        shutil.rmtree(cache_dir, ignore_errors=True)
                    runs[variant].append(r)
                    print(f"  {model} x{depth} {variant:13s} rep {rep}: first step {r['first_step_s']:6.1f} s, "
                          f"recompile {r['recompile_s']:6.1f} s, peak RSS {r['peak_rss_mib']:6.0f} MiB, "
                          f"other load {r.get('other_processes_cores')} cores", flush=True)
            rows.append((model, depth, {v: {k: median([r[k] for r in rs]) for k in
                                            ("first_step_s", "recompile_s", "peak_rss_mib", "rss_before_mib")}
                                        | {"parameters": rs[0]["parameters"],
                                           "harvest_s": median([r["optpass_own_first_s"].get("harvest", 0) +
                                                                r["optpass_own_recompile_s"].get("harvest", 0)
                                                                for r in rs]),
                                           "other_load": max(r.get("other_processes_cores") or 0 for r in rs)}
                                        for v, rs in runs.items()}, runs))
    print()
    print("| model | layers | params | variant | first step s | ratio | recompile s | ratio | peak RSS MiB "
          "(before the first call) | optpass harvesting the update s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model, depth, summary, _ in rows:
        base = summary["inductor"]
        for v in variants:
            m = summary[v]
            print(f"| {model} | {depth} | {m['parameters'] / 1e6:.2f}M | {v} | {m['first_step_s']:.1f} | "
                  f"{m['first_step_s'] / base['first_step_s']:.2f} | {m['recompile_s']:.1f} | "
                  f"{m['recompile_s'] / base['recompile_s']:.2f} | {m['peak_rss_mib']:.0f} "
                  f"({m['rss_before_mib']:.0f}) | {m['harvest_s']:.1f} |")
    busy = [f"{model} x{depth}" for model, depth, summary, _ in rows
            if any(m["other_load"] > BUSY_CORES for m in summary.values())]
    if busy:
        print(f"WARNING: other processes loaded the CPUs during {', '.join(busy)}: those times are noisy")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"model": m, "layers": d, "summary": s_, "runs": r} for m, d, s_, r in rows], f, indent=1)
        print(f"wrote {args.json}")


def child_main(args) -> None:
    if args.child.startswith("hf-"):
        emit_result(child_hf(args))
    else:
        emit_result(child_interleaved(args) if args.child == "interleaved" else child_cold(args))


# ====================================================================== parent side

def _spawn(args, child: str, model_cfg: dict, cache_dir: str, profile_out: str | None = None) -> dict:
    cmd = child_command(__file__, child=child, model=json.dumps(model_cfg), threads=args.threads,
                        warmup=args.warmup, steps=args.steps, rounds=args.rounds, block=args.block,
                        profile_out=profile_out)
    waited = _wait_until_idle(args.idle_wait) if args.idle_wait > 0 else 0.0
    result = run_child(cmd, child_env(args.threads, cache_dir), args.child_timeout)
    result["waited_for_idle_s"] = round(waited, 1)
    return result


def _wait_until_idle(max_wait_s: float, window_s: float = 2.0, threshold_cores: float = 0.25) -> float:
    """Between children nothing of ours runs: wait (up to max_wait_s) until the machine's CPUs are idle."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_wait_s:
        before = cpu_busy_s()
        if before is None:
            break
        time.sleep(window_s)
        if (cpu_busy_s() - before) / window_s < threshold_cores:
            break
    return time.perf_counter() - t0


def _busy_warning(args, runs) -> str | None:
    """Other processes on the CPUs make the numbers noisy (and OpenMP threads that wait on a
    descheduled sibling make steps many times slower): say so."""
    others = [r["other_processes_cores"] for r in runs if r.get("other_processes_cores") is not None]
    if others and max(others) > BUSY_CORES:
        return (f"WARNING: other processes kept up to {max(others):.2f} of the {os.cpu_count()} CPUs busy "
                f"during a child run (this benchmark runs {args.threads} threads): the times are noisy; "
                "rerun on an idle machine for numbers to compare.")
    return None


def _new_cache_dir(tag: str) -> str:
    return tempfile.mkdtemp(prefix=f"optpass-bench-{tag}-")


def run_parent(args) -> None:
    model_cfg = dict(QUICK_MODEL if args.quick else FULL_MODEL)
    started = time.perf_counter()
    print(f"optpass compile/step overhead vs inductor | model {model_cfg} | threads {args.threads} | "
          f"repeats {args.repeats} | warmup calls {args.warmup} | steps {args.steps} | "
          f"interleaved {args.rounds}x{args.block}", flush=True)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)

    cold = {v: [] for v in VARIANTS}
    retries_left = args.busy_retries
    discarded = []  # cold runs redone because other processes loaded the CPUs meanwhile
    last_cache = {}  # variant -> cache dir of its last cold run (reused, merged, by the interleaved run)
    try:
        for rep in range(args.repeats):
            order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                prof = os.path.join(args.profile, f"{variant}_{rep}.prof") if args.profile else None
                attempts = []
                while True:
                    cache_dir = _new_cache_dir(variant)  # empty: a cold compile
                    if variant in last_cache:
                        shutil.rmtree(last_cache.pop(variant), ignore_errors=True)
                    last_cache[variant] = cache_dir
                    r = _spawn(args, variant, model_cfg, cache_dir, prof)
                    attempts.append(r)
                    busy = (r.get("other_processes_cores") or 0.0) > BUSY_CORES
                    print(f"  cold {variant:8s} rep {rep}: compile {r['compile_s']:7.2f} s "
                          f"(first {args.warmup} calls {', '.join(f'{c:.2f}' for c in r['warmup_call_s'])} s), "
                          f"steady {r['steady_median_s'] * 1e3:.2f} ms/step, graphs {r['graphs']}, "
                          f"process {r['process_wall_s']:.1f} s, other load {r.get('other_processes_cores')} "
                          f"cores (waited {r['waited_for_idle_s']:.0f} s for idle)"
                          f"{'  [busy: run again]' if busy and retries_left > 0 else ''}", flush=True)
                    if not busy or retries_left <= 0:
                        break
                    retries_left -= 1
                # Of the attempts, keep the one that other processes disturbed least.
                r = min(attempts, key=lambda a: a.get("other_processes_cores") or 0.0)
                if len(attempts) > 1:
                    print(f"    kept the attempt with other load {r.get('other_processes_cores')} cores")
                discarded.extend(a for a in attempts if a is not r)
                cold[variant].append(r)

        interleaved = None
        if args.rounds > 0:
            # Step time does not depend on where the compiled code came from: start the interleaved
            # run from both variants' caches merged, so it does not spend minutes compiling again.
            merged = _new_cache_dir("interleaved")
            last_cache["interleaved"] = merged
            for variant in VARIANTS:
                shutil.copytree(last_cache[variant], merged, dirs_exist_ok=True)
            interleaved = _spawn(args, "interleaved", model_cfg, merged)
            med = interleaved["median_per_step_s"]
            print(f"  interleaved: inductor {med['inductor'] * 1e3:.2f} ms/step, optpass "
                  f"{med['optpass'] * 1e3:.2f} ms/step, process {interleaved['process_wall_s']:.1f} s, "
                  f"other load {interleaved.get('other_processes_cores')} cores",
                  flush=True)
    finally:
        for d in last_cache.values():
            shutil.rmtree(d, ignore_errors=True)

    graphs = {v: sorted({r["graphs"] for r in cold[v]}) for v in VARIANTS}
    if graphs["inductor"] != graphs["optpass"]:
        print(f"WARNING: the variants compiled different numbers of graphs: {graphs}")

    summary = {}
    for v in VARIANTS:
        rs = cold[v]
        summary[v] = {
            "compile_s": median([r["compile_s"] for r in rs]),
            "warmup_wall_s": median([r["warmup_wall_s"] for r in rs]),
            "first_call_s": median([r["warmup_call_s"][0] for r in rs]),
            "second_call_s": median([r["warmup_call_s"][1] for r in rs]) if args.warmup > 1 else None,
            "steady_cold_process_s": median([r["steady_median_s"] for r in rs]),
            "steady_interleaved_s": interleaved["median_per_step_s"][v] if interleaved else None,
            "graphs": graphs[v],
            "process_cpu_s": median([r["process_cpu_s"] for r in rs]),
            "dynamo_timed_s": {k: median([r["dynamo_timed_s"].get(k, 0.0) for r in rs])
                               for k in sorted({k for r in rs for k in r["dynamo_timed_s"]})},
        }
    compile_ratio = summary["optpass"]["compile_s"] / summary["inductor"]["compile_s"]
    wall_ratio = summary["optpass"]["warmup_wall_s"] / summary["inductor"]["warmup_wall_s"]
    paired_compile = [o["compile_s"] / i["compile_s"] for i, o in zip(cold["inductor"], cold["optpass"])]
    clean = {v: [r["compile_s"] for r in cold[v] if (r.get("other_processes_cores") or 0.0) <= BUSY_CORES]
             for v in VARIANTS}
    clean_ratio = median(clean["optpass"]) / median(clean["inductor"]) if all(clean.values()) else None
    if interleaved:
        step_ratio = interleaved["ratio_of_medians"]
        step_source = "interleaved"
    else:
        step_ratio = summary["optpass"]["steady_cold_process_s"] / summary["inductor"]["steady_cold_process_s"]
        step_source = "separate processes"

    print()
    header = f"{'':38s}{'inductor':>12s}{'optpass':>12s}{'ratio':>9s}"
    print(header)
    print("-" * len(header))

    def row(label, key, scale=1.0, unit=""):
        a, b = summary["inductor"][key], summary["optpass"][key]
        if a is None or b is None:
            return
        print(f"{label + unit:38s}{a * scale:12.3f}{b * scale:12.3f}{b / a:9.3f}")

    row(f"compile: first {args.warmup} calls - {args.warmup}x step", "compile_s", unit=" [s]")
    print(f"{'  median of per-repeat compile ratios':38s}{'':24s}{median(paired_compile):9.3f}")
    if clean_ratio is not None and any(len(clean[v]) < len(cold[v]) for v in VARIANTS):
        print(f"{'  only runs on idle CPUs (n=%d/%d)' % (len(clean['inductor']), len(clean['optpass'])):38s}"
              f"{median(clean['inductor']):12.3f}{median(clean['optpass']):12.3f}{clean_ratio:9.3f}")
    row(f"  wall time of first {args.warmup} calls", "warmup_wall_s", unit=" [s]")
    row("  call 1 (step + update/init graphs)", "first_call_s", unit=" [s]")
    if args.warmup > 1:
        row("  call 2", "second_call_s", unit=" [s]")
    row("step, separate processes (median)", "steady_cold_process_s", 1e3, " [ms]")
    if interleaved:
        row("step, interleaved (median of blocks)", "steady_interleaved_s", 1e3, " [ms]")
        print(f"{'  median of paired block ratios':38s}{'':24s}{interleaved['median_paired_ratio']:9.3f}")
        fastest = interleaved["min_per_step_s"]
        print(f"{'step, interleaved (fastest block) [ms]':38s}{fastest['inductor'] * 1e3:12.3f}"
              f"{fastest['optpass'] * 1e3:12.3f}{interleaved['ratio_of_mins']:9.3f}")
        warm = interleaved["in_process_compile_s"]
        print(f"{'warm-cache compile, 1 process [s] (*)':38s}{warm['inductor']:12.3f}{warm['optpass']:12.3f}"
              f"{warm['optpass'] / warm['inductor']:9.3f}")
    row("CPU time of a whole cold process", "process_cpu_s", unit=" [s]")
    own = [r.get("optpass_own_s", {}) for r in cold["optpass"]]
    if own and own[0]:
        cap = median([o["capture"] for o in own])
        rew = median([o["rewrite"] for o in own])
        print(f"{'optpass own time: capture / passes [s]':38s}{'':12s}{cap:6.3f}/{rew:5.3f}")
    print(f"{'graphs compiled (Dynamo)':38s}{str(graphs['inductor']):>12s}{str(graphs['optpass']):>12s}")
    kinds = cold["optpass"][0].get("optpass_graph_kinds")
    if kinds:
        print(f"{'optpass graph kinds':38s}{'':12s}  {', '.join(kinds)}")
    diffs = sorted(((summary["optpass"]["dynamo_timed_s"].get(k, 0.0) - summary["inductor"]["dynamo_timed_s"].get(k, 0.0), k)
                    for k in set(summary["optpass"]["dynamo_timed_s"]) | set(summary["inductor"]["dynamo_timed_s"])),
                   key=lambda dk: -abs(dk[0]))
    print("largest compile-phase differences, optpass - inductor (medians of dynamo_timed, nested, s):")
    print("  " + ", ".join(f"{k} {d:+.2f}" for d, k in diffs[:6]))
    print("-" * len(header))
    print(f"step time ratio optpass/inductor = {step_ratio:.3f} (goal <= {STEP_GOAL}) "
          f"[{step_source}]{'' if step_ratio <= STEP_GOAL else '  <-- over goal'}")
    print(f"compile time ratio optpass/inductor = {compile_ratio:.3f} (goal <= {COMPILE_GOAL})"
          f"{'' if compile_ratio <= COMPILE_GOAL else '  <-- over goal'}")
    if interleaved:
        print("(*) informative only: Inductor caches warm, inductor compiled first in that process "
              "(it also pays the process's one-time warm-up)")
    print(f"(wall-time-of-first-{args.warmup}-calls ratio = {wall_ratio:.3f}; "
          f"total bench time {time.perf_counter() - started:.0f} s)")
    busy = _busy_warning(args, [r for v in VARIANTS for r in cold[v]] + ([interleaved] if interleaved else []))
    if busy:
        print(busy)
    warned = sorted({w for v in VARIANTS for r in cold[v] for w in r.get("stderr_warnings", [])})
    if warned:
        print("warnings printed by the children:")
        for w in warned[:10]:
            print("  " + w[:200])

    report = {
        "config": {"model": model_cfg, "threads": args.threads, "repeats": args.repeats,
                   "warmup_calls": args.warmup, "steps": args.steps, "rounds": args.rounds,
                   "block": args.block, "quick": args.quick, "python": sys.version.split()[0],
                   "cpu_count": os.cpu_count(), "busy_warning": busy,
                   "compile_time_definition": f"wall time of the first {args.warmup} calls minus "
                                              f"{args.warmup} x the same process's median steady step"},
        "ratios": {"step_time": step_ratio, "step_time_source": step_source,
                   "compile_time": compile_ratio, "warmup_wall_time": wall_ratio,
                   "compile_time_paired_median": median(paired_compile),
                   "compile_time_idle_runs_only": clean_ratio,
                   "step_goal": STEP_GOAL, "compile_goal": COMPILE_GOAL},
        "summary": summary,
        "cold_runs": cold,
        "discarded_busy_cold_runs": discarded,
        "interleaved": interleaved,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    else:
        print("JSON:" + json.dumps(report))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description="Compile-time and step-time overhead of backend='optpass' over backend='inductor' "
                    "on the same TinyLM training step (cold compiles in fresh subprocesses with empty "
                    "Inductor caches; step-time ratio from an interleaved in-process run).")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: small model, 1 repeat, fewer steps (< 2 min)")
    p.add_argument("--repeats", type=int, default=None,
                   help="cold subprocesses per variant, order alternating (default 3; --quick 1)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steady steps per cold subprocess (default 30; --quick 10)")
    p.add_argument("--warmup", type=int, default=3,
                   help="first calls counted as compile (default 3; on torch 2.13 call 1 compiles both graphs)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds; 0 skips the interleaved run (default 10; --quick 4)")
    p.add_argument("--block", type=int, default=5, help="steps per interleaved block (default 5)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in every process (default 2)")
    p.add_argument("--json", metavar="PATH", help="write all raw numbers here (default: print one 'JSON:' line)")
    p.add_argument("--profile", metavar="DIR",
                   help="cProfile each cold child's compile calls into DIR/<variant>_<rep>.prof")
    p.add_argument("--idle-wait", type=float, default=None,
                   help="before each child, wait up to this many seconds for other processes to leave "
                        "the CPUs idle (shared machines; 0: don't wait; default 60; --quick 10)")
    p.add_argument("--busy-retries", type=int, default=None,
                   help="run a cold child again (at most this many times in all) when other processes "
                        f"used more than {BUSY_CORES} cores while it ran (default 2; --quick 0)")
    p.add_argument("--child-timeout", type=int, default=900, help="seconds before a child is killed")
    p.add_argument("--hf", metavar="MODELS", help="Hugging Face models instead of the TinyLM: a comma-separated "
                   "list of bert, gpt2, llama (the first step and a recompile per model and depth)")
    p.add_argument("--layers", default="2", help="with --hf: comma-separated depths (default 2)")
    p.add_argument("--hf-variants", default="optpass", help="with --hf: comma-separated, of optpass (update in "
                   "backward), optpass-after (update after backward); inductor always runs (default optpass)")
    p.add_argument("--child", choices=(*VARIANTS, "interleaved", *(f"hf-{v}" for v in HF_VARIANTS)),
                   help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--profile-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.steps is None:
        args.steps = 10 if args.quick else 30
    if args.idle_wait is None:
        args.idle_wait = 10 if args.quick else 60
    if args.busy_retries is None:
        args.busy_retries = 0 if args.quick else 2
    if args.rounds is None:
        args.rounds = 4 if args.quick else 10
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1 or args.block < 1:
        p.error("--warmup, --steps, --repeats and --block must be >= 1")
    if args.child:
        child_main(args)
    elif args.hf:
        run_hf_parent(args)
    else:
        run_parent(args)


if __name__ == "__main__":
    main()
