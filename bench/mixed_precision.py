#!/usr/bin/env python3
"""bf16 training with fp32 master weights: bytes per parameter at the whole run's peak, and step time.

The model (``--model``), trained with AdamW (lr 1e-4, weight decay 0.01) on fp32 master
weights, the Megatron way:

* ``mlp`` (default): a bf16 MLP, 12 x ``Linear(2896, 2896)`` with ReLU between, 100.7M
  parameters, batch 8, MSE loss computed in fp32. Each weight is 1/12 of the model: the
  worst case for what is in flight beside the state (a gradient, a reduce bucket);
* ``llama``: transformers' ``LlamaForCausalLM`` in bf16, hidden 768, 13 decoder layers
  (MLP 2048, 12 heads), vocabulary 8192 with an untied head: 104.6M parameters, the
  largest (embedding, head) 6% of the model, batch 2 x 16 tokens, cross-entropy in fp32.

Variants, each in a FRESH
process (its own empty ``TORCHINDUCTOR_CACHE_DIR``, ``--threads`` threads):

* ``by-hand`` -- the reference a careful user writes without optpass (eager): fp32
  masters, ``torch.optim.AdamW`` over them, and after ``loss.backward()`` one
  parameter at a time: cast its bf16 gradient to fp32 into the master's ``.grad``,
  free the bf16 gradient, step (only that master has a gradient, so only it is
  updated), copy the rounded master back. Before activations: 2 (bf16 parameter) +
  2 (bf16 gradients, all alive after backward) + 4 (master) + 8 (AdamW state) =
  16 B/param, plus one fp32 gradient at a time;
* ``optpass`` -- the plain step (``loss.backward(); out = loss.detach(); opt.step();
  opt.zero_grad(); return out``) with ``torch.compile(backend="optpass", options={
  "optimizer": opt, "master_weights": torch.float32, "optimizer_in_backward": True})``:
  each master updated as soon as its gradient is final, the gradient dying there:
  2 + 4 + 8 = 14 B/param plus one gradient (goal <= 14.5 at the whole run's peak);
* ``optpass-after`` (only with ``--variants``) -- master_weights without
  optimizer_in_backward (every bf16 gradient alive at the update: 16 B/param);
* ``inductor`` (only with ``--variants``) -- the peer a torch.compile user has without
  optpass: the same plain step under ``backend="inductor"``, AdamW straight on the bf16
  parameters (no masters: the update stalls where the issue says it does; 2 + 2 + 4 =
  8 B/param with every gradient alive). It is here for its "compile MB": what compiling
  the same step shape costs a process without optpass's passes;
* ``zero1`` -- the same plain step with ``data_parallel="zero1"`` as well, on
  ``--world`` gloo ranks (processes launched here, each ``--threads`` threads): each
  rank keeps 1/N of the masters and of the state: 2 + 12/N B/param plus one
  bucket (goal <= 8.5 per rank at 2 ranks). Each rank trains on its own batch of
  the same size.

Memory is what a user sees (docs/design.md, "Measuring"): ``VmHWM`` from
``/proc/self/status``, the process's peak RSS since it started (imports, model,
compile, warm-up, measured steps), read before anything resets it; B/param =
(peak - baseline) / parameters, the baseline being RSS after the imports and after
torch.compile's first use in the process (``_initialise_torch_compile``: a tiny copy
of the step compiled and run, then dropped, in every variant; 77-200 MB whatever the
model's width). Beside it, "over
imports": the same peak over RSS after the imports alone, that first-use cost counted
in (``--no-compile-init`` makes it the baseline). What compiling this model adds
(Dynamo/Inductor state and generated code) is counted in both; the column "compile
MB" says how much that is (RSS growth of the same compile on a width-64 copy).
The steady-state peak (VmHWM reset after warm-up) is printed beside it.

Beside the headline, never instead of it: the **live-tensor peak** ("tensors B/p"),
the most bytes of CPU tensors alive at once over the whole run (from before the
model is built through the last measured step, the first step included) -- what
``torch.cuda.max_memory_allocated()`` reports on a GPU: the tensor design's peak,
without glibc's retention or the compile state. ``_measure.CPUTensorBytes`` counts it:
a c10 CPU allocator that allocates as the default one does adds each allocation's bytes to
a running total and the tensor's deleter takes them off, on whatever thread the tensor dies
(gloo's workers included), checked exact on a toy (tests/test_bench_measure.py). It
does not change where memory comes from, so it runs in the same process as the RSS
headline (``--tensor-peak off`` skips it). Also printed: the live-tensor peak of the
measured steps ("steady") and of the first step ("1st step"). Step time:
median of the measured steps; ratios against ``by-hand`` (same threads per process).

Usage::

    python3 bench/mixed_precision.py                   # 100.7M params, by-hand, optpass, zero1 on 2 ranks (minutes)
    python3 bench/mixed_precision.py --quick           # 4 x Linear(512, 512): smoke run
    python3 bench/mixed_precision.py --model llama     # a 104.6M-parameter bf16 Llama (transformers)
    python3 bench/mixed_precision.py --variants by-hand,optpass,optpass-after --json out.json
    python3 bench/mixed_precision.py --tensor-peak off               # the RSS headline only
    python3 bench/mixed_precision.py --variants zero1 --bucket-bytes 16779424   # zero1, one layer per bucket

The parent never imports torch.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _measure import (CPUTensorBytes, add_rank_flags, child_command, child_env, emit_result, empty_cache_dir,
                      graph_count, init_gloo, median, print_json, proc_status_kib, reset_peak_rss, run_child,
                      run_ranks, training_step)

VARIANTS = ("by-hand", "optpass", "optpass-after", "zero1", "inductor")
DEFAULT_VARIANTS = ("by-hand", "optpass", "zero1")
GOALS = {"optpass": 14.5, "zero1": 8.5}     # B/param at the whole run's peak (zero1: per rank, 2 ranks)
_MB = 1e6


# ====================================================================== child side

def run_variant(args) -> None:
    import gc

    import torch

    torch.set_num_threads(args.threads)
    import optpass
    if args.model == "llama":
        import transformers  # noqa: F401  (before the baseline: the library is not the model)

    torch._dynamo.config.trace_autograd_ops = True
    kind = args.child
    rank, world = args.rank, args.world if kind == "zero1" else 1
    if kind == "zero1":
        init_gloo(rank, world, args.port, timeout_s=900)
    live = CPUTensorBytes()             # live tensor bytes from start() on, every thread (a counting allocator)
    if args.count_tensors:
        live.load()                     # its module before the baseline, installed after it
    rss_after_imports_kib = proc_status_kib("VmRSS")
    if args.compile_init:
        _initialise_torch_compile(args, kind, rank)
    rss_after_compile_init_kib = proc_status_kib("VmRSS")
    if args.count_tensors:
        live.start()

    with live.mark("build"):
        model, data, loss_of = _build(args, args.width, args.layers, rank)
        params = list(model.parameters())
        n_params = sum(p.numel() for p in params)

    if kind == "by-hand":
        masters = [p.detach().float() for p in params]
        opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.01)

        def step(x, y):
            loss = loss_of(x, y)
            loss.backward()
            out = loss.detach()
            with torch.no_grad():
                for p, m in zip(params, masters):   # one fp32 gradient alive at a time
                    m.grad = p.grad.float()
                    p.grad = None
                    opt.step()                      # only m has a gradient: only m moves
                    m.grad = None
                    p.copy_(m)
            return out
        state_of = lambda: opt.state.values()        # noqa: E731
    else:
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
        step = _compiled_step(args, kind, loss_of, opt)

        def state_of():
            if kind == "inductor":
                return opt.state.values()
            if kind == "zero1":
                shard = optpass.zero1.sharded_state(opt).shard_optimizer
                return shard.state.values() if shard is not None else []
            return optpass.precision.masters.master_state(opt, torch.float32).master_optimizer.state.values()

    losses, warmup_s = [], []
    for i in range(args.warmup):
        x, y = data[i % len(data)]
        t0 = time.perf_counter()
        with live.mark(f"warmup {i}"):
            losses.append(float(step(x, y)))
        warmup_s.append(time.perf_counter() - t0)
    hwm_warmup_kib = proc_status_kib("VmHWM")          # since process start: nothing reset it yet
    graphs = graph_count()
    gc.collect()
    reset_ok = reset_peak_rss()
    times = []
    for i in range(args.steps):
        x, y = data[(args.warmup + i) % len(data)]
        if kind == "zero1":
            torch.distributed.barrier()
        t0 = time.perf_counter()
        with live.mark(f"step {i}"):
            losses.append(float(step(x, y)))
        times.append(time.perf_counter() - t0)
    hwm_steady_kib = proc_status_kib("VmHWM")
    tensors = live.stop() if args.count_tensors else None
    if graph_count() != graphs:
        raise SystemExit(f"{kind}: a graph compiled during the measured steps (raise --warmup)")
    # what holds the fp32 masters and the optimizer state, counted tensor by tensor
    state_bytes = sum(t.numel() * t.element_size() for s in state_of() for t in s.values()
                      if isinstance(t, torch.Tensor) and t.dim() > 0)
    if kind == "zero1":
        shard = optpass.zero1.sharded_state(opt)
        master_bytes = sum(t.numel() * t.element_size() for t in shard.shards.values())
        torch.distributed.destroy_process_group()
    elif kind == "by-hand":
        master_bytes = sum(m.numel() * m.element_size() for m in masters)
    elif kind == "inductor":
        master_bytes = 0
    else:
        master_bytes = sum(m.numel() * m.element_size() for p, m in optpass.master_weights(opt).items()
                           if m is not p)
    whole = max(hwm_warmup_kib, hwm_steady_kib) * 1024
    baseline = rss_after_compile_init_kib * 1024
    emit_result({
        "variant": kind, "rank": rank, "world": world, "n_params": n_params,
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "master_bytes": master_bytes, "state_bytes": state_bytes,
        "baseline_bytes": baseline, "whole_run_peak_bytes": whole, "steady_peak_bytes": hwm_steady_kib * 1024,
        "peak_in": "warm-up" if hwm_warmup_kib >= hwm_steady_kib else "steps",
        "bytes_per_param_whole_run": (whole - baseline) / n_params,
        # the same peak over RSS after the imports only: torch.compile's first-use cost counted in
        "rss_after_imports_bytes": rss_after_imports_kib * 1024,
        "compile_init_bytes": (rss_after_compile_init_kib - rss_after_imports_kib) * 1024,
        "bytes_per_param_whole_run_over_imports": (whole - rss_after_imports_kib * 1024) / n_params,
        "bytes_per_param_steady": (hwm_steady_kib * 1024 - baseline) / n_params,
        "peak_reset": reset_ok,
        **(_tensor_fields(tensors, n_params, args) if tensors else {}),
        "warmup_call_s": warmup_s, "step_times_s": times,
        "median_step_s": statistics.median(times), "losses": losses, "graphs": graphs,
        "grads_left": sum(p.grad is not None for p in params),
    })


def _build(args, width: int, layers: int, rank: int):
    """The bf16 model, 4 batches of this rank's data, and ``loss_of(x, y)`` (fp32 loss)."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1 + rank)
    if args.model == "mlp":
        from optpass.demo.models import MLP
        model = MLP((width,) * (layers + 1)).to(torch.bfloat16)
        data = [(torch.randn(args.batch, width, generator=g).to(torch.bfloat16),
                 torch.randn(args.batch, width, generator=g)) for _ in range(4)]
        return model, data, lambda x, y: F.mse_loss(model(x).float(), y)
    import transformers
    heads = max(1, width // 64)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=width, intermediate_size=_llama_intermediate(width),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max(64, args.seq), tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    tokens = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g) for _ in range(4)]
    data = [(t[:, :-1], t[:, 1:]) for t in tokens]

    def loss_of(x, y):
        logits = model(input_ids=x).logits.float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return model, data, loss_of


def _llama_intermediate(hidden: int) -> int:
    """Llama's MLP width: 8/3 of the hidden size, rounded up to a multiple of 256."""
    return -(-8 * hidden // 3 // 256) * 256


def _compiled_step(args, kind: str, loss_of, opt):
    """The supported step shape, compiled by optpass with this variant's options."""
    import torch

    train_step = training_step(loss_of, opt)
    if kind == "inductor":
        return torch.compile(train_step, backend="inductor")
    options = {"optimizer": opt, "master_weights": torch.float32,
               "optimizer_in_backward": kind in ("optpass", "zero1")}
    if kind == "zero1":
        options.update(data_parallel="zero1", bucket_bytes=args.bucket_bytes)
    return torch.compile(train_step, backend="optpass", options=options)


def _initialise_torch_compile(args, kind: str, rank: int) -> None:
    """Pay torch.compile's once-per-process cost before the baseline is read.

    The first compile in a process grows RSS by 77 MB (the MLP's step) to 200 MB (the
    Llama's) whatever the model's width (Dynamo, Inductor and C++ codegen state
    initialised on first use): a fixed cost of the process, not of the parameters.
    Every variant, by-hand included, compiles and runs 2 steps of this variant's optpass
    step (by-hand: the in-backward one) on a copy of the model 1/32 as wide with 1 layer,
    then drops it, so that B/param counts what the model and its own compile add. The
    peak over RSS after the imports alone is reported beside it."""
    import gc

    import torch
    small, data, loss_of = _build(args, max(64, args.width // 32), 1, rank)
    opt = torch.optim.AdamW(small.parameters(), lr=1e-4, weight_decay=0.01)
    step = _compiled_step(args, "optpass" if kind == "by-hand" else kind, loss_of, opt)
    for x, y in data[:2]:
        step(x, y)
    del small, data, loss_of, opt, step
    torch._dynamo.reset()
    gc.collect()


def _tensor_fields(t: dict, n_params: int, args) -> dict:
    """The live-tensor figures of one child (``CPUTensorBytes.stop()``), bytes and B/param."""
    marks = t["marks"]
    steady = max(marks[f"step {i}"]["peak_bytes"] for i in range(args.steps))
    return {
        "tensor_peak_bytes": t["peak_bytes"], "bytes_per_param_tensor_peak": t["peak_bytes"] / n_params,
        "tensor_peak_steady_bytes": steady, "bytes_per_param_tensor_steady": steady / n_params,
        "tensor_peak_first_step_bytes": marks["warmup 0"]["peak_bytes"] if args.warmup else None,
        "tensor_peak_in": t["peak_in"],
        "tensor_peak_by_mark": {k: v["peak_bytes"] for k, v in marks.items()},
        # live after the model is built and after every step: constant across steps unless a free was missed
        "tensor_live_after": {k: v["end_bytes"] for k, v in marks.items()},
        "tensor_allocations": t["allocations"],
        # tensors of >= 1 MiB alive at the run's peak that were allocated in the mark it fell in (MB)
        "tensor_alive_at_peak_mb": [round(b / _MB, 2) for b in t["alive_at_peak"]],
    }


# ====================================================================== parent side

def _cmd(args, variant: str, width: int | None = None, count_tensors: bool = False) -> list[str]:
    return child_command(__file__, child=variant, layers=args.layers, width=width or args.width, batch=args.batch,
                         steps=args.steps, warmup=args.warmup, threads=args.threads, world=args.world, model=args.model,
                         vocab=args.vocab, seq=args.seq, no_compile_init=not args.compile_init,
                         bucket_bytes=args.bucket_bytes, no_tensor_peak=not count_tensors)


def _spawn(args, variant: str, width: int | None = None, count_tensors: bool = False) -> list[dict]:
    """One process (or --world rank processes for zero1); their results, by rank. ``count_tensors``: the
    child measures the live-tensor peak (the counting allocator installed before the model is built)."""
    with empty_cache_dir(variant) as cache_dir:
        env = child_env(args.threads, cache_dir)
        if variant != "zero1":
            return [run_child(_cmd(args, variant, width, count_tensors), env, args.child_timeout)]
        return run_ranks(_cmd(args, variant, width, count_tensors), args.world, env, args.child_timeout)


def _fmt(x) -> str:
    return "-" if x is None or x != x else f"{x:.2f}"


def run_parent(args) -> None:
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    started = time.perf_counter()
    model = (f"MLP {args.layers} x Linear({args.width}, {args.width}), batch {args.batch}" if args.model == "mlp"
             else f"LlamaForCausalLM hidden {args.width}, {args.layers} layers, vocab {args.vocab}, "
                  f"batch {args.batch} x {args.seq} tokens")
    print(f"mixed precision: bf16 {model}, "
          f"AdamW on fp32 masters | threads {args.threads}/process | zero1 on {args.world} gloo ranks | "
          f"warmup {args.warmup} | steps {args.steps} | repeats {args.repeats}", flush=True)
    runs: dict[str, list[list[dict]]] = {v: [] for v in variants}
    for rep in range(args.repeats):
        for v in variants:               # interleaved
            ranks = _spawn(args, v, count_tensors=args.tensor_peak == "same")
            runs[v].append(ranks)
            for r in ranks:
                print(f"  {v:14s} rep {rep} rank {r['rank']}: whole-run peak {r['whole_run_peak_bytes'] / _MB:8.1f} MB"
                      f" ({r['bytes_per_param_whole_run']:.2f} B/param, in {r['peak_in']}), steady "
                      f"{r['bytes_per_param_steady']:.2f} B/param | live tensors: peak "
                      f"{_fmt(r.get('bytes_per_param_tensor_peak'))} B/param (in {r.get('tensor_peak_in', '-')}), "
                      f"steady {_fmt(r.get('bytes_per_param_tensor_steady'))}"
                      + (f", alive at the peak (>= 1 MiB, from its step, MB): {r['tensor_alive_at_peak_mb']}"
                         if "tensor_alive_at_peak_mb" in r else "")
                      + f" | step {r['median_step_s'] * 1e3:.0f} ms,"
                      f" warm-up "
                      f"{', '.join(f'{t:.1f}' for t in r['warmup_call_s'])} s, process {r.get('process_wall_s', '-')} s",
                      flush=True)
    # what compiling alone adds to a process: the same variant on a width-64 copy of the model
    overhead = {}
    for v in variants:
        if v != "by-hand":
            small = _spawn(args, v, width=64)[0]
            overhead[v] = small["whole_run_peak_bytes"] - small["baseline_bytes"]

    first = runs[variants[0]][0][0]
    n = first["n_params"]
    print()
    print(f"parameters {n:,} (bf16: {first['param_bytes'] / _MB:.1f} MB) | MB = 1e6 bytes | medians of "
          f"{args.repeats} | whole-run / steady B/param (the headline) = (VmHWM - baseline) / parameters, "
          f"baseline = RSS after the imports and torch.compile's first use"
          f"{' (a tiny copy compiled)' if args.compile_init else ' (not paid before: counted in)'}; "
          f"'over imports': the same peak over RSS after the imports alone"
          f" | tensors B/param = peak of live tensor bytes (allocated since the baseline) / parameters")
    header = (f"{'variant':14s} {'whole-run B/param':>17s} {'goal':>6s} {'over imports':>12s} {'steady B/param':>14s} "
              f"{'tensors B/p':>11s} {'steady':>6s} {'1st step':>8s} "
              f"{'masters B/p':>11s} {'state B/p':>9s} {'compile MB':>10s} {'step ms':>8s} {'/ by-hand':>9s} "
              f"{'grads left':>10s} {'final loss':>11s}")
    print(header)
    print("-" * len(header))
    summary = {}
    hand_ms = None
    if "by-hand" in runs:
        hand_ms = median([r["median_step_s"] for rs in runs["by-hand"] for r in rs]) * 1e3
    for v in variants:
        flat = [r for rs in runs[v] for r in rs]
        whole = max(median([r["bytes_per_param_whole_run"] for r in rs]) for rs in zip(*runs[v]))
        tensor = max(median([r.get("bytes_per_param_tensor_peak") for r in rs]) for rs in zip(*runs[v]))
        s = {
            "bytes_per_param_whole_run": whole,          # zero1: the rank with the higher median
            "bytes_per_param_whole_run_over_imports": max(
                median([r["bytes_per_param_whole_run_over_imports"] for r in rs]) for rs in zip(*runs[v])),
            "compile_init_mb": median([r["compile_init_bytes"] for r in flat]) / _MB,
            "bytes_per_param_tensor_peak": tensor,      # the same, for the peak of live tensor bytes
            "bytes_per_param_tensor_steady": median([r.get("bytes_per_param_tensor_steady") for r in flat]),
            "bytes_per_param_tensor_first_step": median([(r.get("tensor_peak_first_step_bytes") or 0) / n
                                                         if "tensor_peak_bytes" in r else None for r in flat]),
            "bytes_per_param_steady": median([r["bytes_per_param_steady"] for r in flat]),
            "master_bytes_per_param": median([r["master_bytes"] for r in flat]) / n,
            "state_bytes_per_param": median([r["state_bytes"] for r in flat]) / n,
            "compile_overhead_mb": overhead.get(v, 0) / _MB,
            "median_step_ms": median([r["median_step_s"] for r in flat]) * 1e3,
            "grads_left": max(r["grads_left"] for r in flat),
            "final_loss": flat[0]["losses"][-1],
            "goal": GOALS.get(v),
        }
        s["step_over_by_hand"] = s["median_step_ms"] / hand_ms if hand_ms else None
        s["goal_met"] = None if s["goal"] is None else whole <= s["goal"]
        s["goal_met_tensor_peak"] = None if s["goal"] is None or tensor != tensor else tensor <= s["goal"]
        summary[v] = s
        goal = "-" if s["goal"] is None else f"{s['goal']:.1f}"
        ratio = "-" if s["step_over_by_hand"] is None else f"{s['step_over_by_hand']:.2f}"
        print(f"{v:14s} {whole:17.2f} {goal:>6s} {s['bytes_per_param_whole_run_over_imports']:12.2f} "
              f"{s['bytes_per_param_steady']:14.2f} "
              f"{_fmt(tensor):>11s} {_fmt(s['bytes_per_param_tensor_steady']):>6s} "
              f"{_fmt(s['bytes_per_param_tensor_first_step']):>8s} "
              f"{s['master_bytes_per_param']:11.2f} {s['state_bytes_per_param']:9.2f} "
              f"{s['compile_overhead_mb']:10.1f} {s['median_step_ms']:8.0f} {ratio:>9s} {s['grads_left']:10d} "
              f"{s['final_loss']:11.6f}")
    print()
    for v, s in summary.items():
        if s["goal"] is not None:
            per = f" per rank ({args.world} ranks)" if v == "zero1" else ""
            net = s["bytes_per_param_whole_run"] - s["compile_overhead_mb"] * _MB / n
            print(f"{v}: whole-run peak {s['bytes_per_param_whole_run']:.2f} B/param{per} "
                  f"[goal <= {s['goal']}: {'met' if s['goal_met'] else 'NOT met'}]; without the compile overhead "
                  f"{net:.2f} B/param; live-tensor peak {_fmt(s['bytes_per_param_tensor_peak'])} B/param "
                  f"[{'-' if s['goal_met_tensor_peak'] is None else 'met' if s['goal_met_tensor_peak'] else 'NOT met'}]")
    print("torch.compile's first use (RSS, before the baseline): "
          + ", ".join(f"{v} {s['compile_init_mb']:.0f} MB" for v, s in summary.items()))
    print(f"total {time.perf_counter() - started:.0f} s")
    out = {"config": vars(args), "n_params": n, "summary": summary, "runs": runs}
    print_json({k: out[k] for k in ("config", "n_params", "summary")}, out, args.json)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("mlp", "llama"), default="mlp",
                   help="mlp: Linear layers of one width; llama: transformers' LlamaForCausalLM")
    p.add_argument("--layers", type=int, default=None,
                   help="Linear layers (mlp, default 12) or decoder layers (llama, default 13); --quick 4 / 2")
    p.add_argument("--width", type=int, default=None,
                   help="features of every layer (mlp, default 2896) or hidden size (llama, default 768); "
                        "--quick 512 / 128")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default mlp 8, llama 2)")
    p.add_argument("--seq", type=int, default=16, help="llama: tokens per sequence")
    p.add_argument("--vocab", type=int, default=8192, help="llama: vocabulary (untied embedding and head)")
    p.add_argument("--no-compile-init", dest="compile_init", action="store_false",
                   help="read the baseline right after the imports (torch.compile's first-use cost counted in "
                        "B/param); by default a tiny copy is compiled first (see _initialise_torch_compile)")
    p.add_argument("--steps", type=int, default=None, help="measured steps (default 5; --quick 3)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="threads per process (zero1: per rank)")
    p.add_argument("--world", type=int, default=2, help="gloo ranks for the zero1 variant")
    p.add_argument("--bucket-bytes", type=int, default=None,
                   help="zero1's bucket_bytes option (default None: optpass's default)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"from {', '.join(VARIANTS)}")
    p.add_argument("--tensor-peak", choices=("same", "off"), default="same",
                   help="live-tensor peak: counted in the same process as the RSS headline (a counting CPU "
                        "allocator, default), or not at all")
    p.add_argument("--no-tensor-peak", dest="count_tensors", action="store_false", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    p.add_argument("--child-timeout", type=int, default=1800)
    p.add_argument("--child", help=argparse.SUPPRESS)
    add_rank_flags(p, world=False)
    args = p.parse_args(argv)
    quick = args.quick and not args.child
    llama = args.model == "llama"
    for name, full, small in (("layers", 13 if llama else 12, 2 if llama else 4),
                              ("width", 768 if llama else 2896, 128 if llama else 512),
                              ("batch", 2 if llama else 8, 2 if llama else 8), ("steps", 5, 3)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    (run_variant if args.child else run_parent)(args)


if __name__ == "__main__":
    main()
