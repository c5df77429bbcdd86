#!/usr/bin/env python3
"""The largest Llama that trains 3 steps under a per-rank memory cap: optpass fsdp against torch's FSDP2.

A ladder of Hugging Face ``LlamaForCausalLM`` configs of one width (``--width``, vocab ``--vocab``)
and growing depth (``--layers``). Each trial is one side on one rung, in ``--world`` fresh gloo rank
processes (1 thread each), every rank capped at ``--cap-gib`` GiB of RSS by ``_measure.MemoryCap``
(a thread that ends the process with ``OVER_CAP_EXIT`` as soon as its peak RSS passes the cap). Both
sides build the model on the meta device, shard each decoder layer, the embedding, the head and then
the model, call ``to_empty(device="cpu")``, seed and run the model's ``init_weights()``, build fp32
AdamW and run ``--steps`` training steps of ``--batch`` x ``--seq`` tokens:

* ``fsdp2``         -- ``torch.distributed.fsdp.fully_shard`` (``reshard_after_forward=True``), eager
  (FSDP2's hooks graph-break under torch.compile: docs/design.md §38), the update after backward;
* ``optpass``       -- ``optpass.fully_shard``, ``torch.compile(backend="optpass", options={"optimizer":
  opt, "data_parallel": "fsdp", "optimizer_in_backward": True})``, Inductor (compiled in the rank's own
  process: ``TORCHINDUCTOR_COMPILE_THREADS=1``, so its memory is the rank's);
* ``optpass-eager`` -- the same with ``lower="eager"`` (no Inductor).

Per side a bisection over the ladder (``--search all``: every rung) finds the deepest model that
trains; a rung counts as trained when every rank ran every step under its cap. Per trial and rank:
the live-tensor peak (``_measure.CPUTensorBytes``), the peak RSS (``VmHWM``), the RSS before the
build (torch, transformers and gloo loaded), the first step's time and the mean of the later steps';
for a rank ended at its cap, the phase it was in. Every rank of both sides runs with glibc's mmap
threshold fixed (``--mmap-threshold``, 1 MiB): with glibc's default the threshold grows to 32 MiB as
large blocks are freed, and tensors below it (a shard, an activation, gloo's buffers) come from heaps
that keep freed memory, about 1 GiB of RSS over the live tensors on both sides at this size
(docs/fsdp.md). The physics: fp32 AdamW needs 16 bytes per parameter
(parameters, gradients, two moments) with the update after backward and 12 with the update in
backward, over the ranks; RSS adds the process's baseline and, for optpass, what compiling holds.

    python3 bench/largest_model.py --cap-gib 2.5 --width 1024 --layers 2 4 6 8 10 12 14 16 18 20 22 24
    python3 bench/largest_model.py --optimizer adamw8bit --sides fsdp2 optpass ...   # torchao 8-bit moments
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import (OVER_CAP_EXIT, ChildError, CPUTensorBytes, MemoryCap, add_rank_flags,  # noqa: E402
                      child_command, child_env, emit_result, empty_cache_dir, init_gloo, print_json,
                      proc_status_kib, run_ranks, training_step)

SIDES = ("fsdp2", "optpass", "optpass-eager")
_GIB = 2 ** 30


def llama_config(args):
    import transformers

    return transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.width,
                                    intermediate_size=int(args.width * 8 / 3), num_hidden_layers=args.layers,
                                    num_attention_heads=max(1, args.width // 128),
                                    num_key_value_heads=max(1, args.width // 128), max_position_embeddings=args.seq)


def build_sharded(side: str, args):
    """The meta-device recipe: build on meta, shard each decoder layer, the embedding and the head
    (torchtitan's units: with the default vocab they are the largest parameters; left in the root,
    they would be gathered together) then the model, allocate the shards, initialize them with the
    model's own code. The model and its parameters (counted on the meta device)."""
    import torch
    import transformers

    import optpass

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(args))
    params = sum(p.numel() for p in model.parameters())
    if side == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (args.world,))
        shard = lambda module: fully_shard(module, mesh=mesh, reshard_after_forward=True)  # noqa: E731
    else:
        shard = optpass.fully_shard
    for unit in (*model.model.layers, model.model.embed_tokens, model.lm_head):
        shard(unit)
    shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model, params


def rank_main(args) -> None:
    cap = MemoryCap(int(args.cap_gib * _GIB), os.path.join(args.report_dir, f"rank{args.rank}.json")).start()
    import torch
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    init_gloo(args.rank, args.world, args.port, 1800)
    live = CPUTensorBytes()
    live.load()
    rss_start = proc_status_kib("VmRSS") * 1024
    live.start()
    cap.details = live.so_far                  # in the report of a rank ended at its cap
    cap.phase = "build"
    with live.mark("build"):
        model, params = build_sharded(args.side, args)
        if args.optimizer == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-4))
        else:                                  # torchao's: Adam's moments in 8 bits (its lr a tensor it makes)
            import torchao.optim

            opt = torchao.optim.AdamW8bit(model.parameters(), lr=1e-4)
    rss_peak_until = {"build": proc_status_kib("VmHWM") * 1024}   # the peak RSS up to the end of each phase
    step = training_step(lambda tokens, labels: model(input_ids=tokens, labels=labels).loss, opt)
    if args.side != "fsdp2":
        options = {"optimizer": opt, "data_parallel": "fsdp", "optimizer_in_backward": True}
        if args.side == "optpass-eager":
            options["lower"] = "eager"
        step = torch.compile(step, backend="optpass", options=options)
    g = torch.Generator().manual_seed(1 + args.rank)
    times, losses = [], []
    for i in range(args.steps):
        cap.phase = "first step (compile)" if i == 0 and args.side != "fsdp2" else f"step {i + 1}"
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        with live.mark(f"step {i + 1}"):
            began = time.perf_counter()
            losses.append(step(tokens, tokens).item())
            times.append(time.perf_counter() - began)
        rss_peak_until[f"step {i + 1}"] = proc_status_kib("VmHWM") * 1024
    counted = live.stop()
    emit_result({"rank": args.rank, "params": params, "live_peak_bytes": counted["peak_bytes"],
                 "peak_in": counted["peak_in"],
                 "alive_at_peak_mib": [round(b / 2 ** 20, 1) for b in counted["alive_at_peak"][:8]],
                 "live_peak_in": {name: m["peak_bytes"] for name, m in counted["marks"].items()},
                 "rss_start_bytes": rss_start, "rss_peak_bytes": proc_status_kib("VmHWM") * 1024,
                 "rss_peak_until": rss_peak_until,
                 "first_step_s": times[0], "step_s": sum(times[1:]) / max(1, len(times) - 1), "losses": losses})


def trial(side: str, layers: int, args) -> dict:
    """One side on one rung in fresh rank processes: their results, or why they did not train."""
    cmd = child_command(__file__, child=True, side=side, world=args.world, layers=layers, width=args.width,
                        vocab=args.vocab, batch=args.batch, seq=args.seq, steps=args.steps, cap_gib=args.cap_gib,
                        optimizer=args.optimizer)
    report_dir = tempfile.mkdtemp(prefix="optpass-bench-largest-")
    try:
        with empty_cache_dir(f"largest-{side}-{layers}") as cache:
            env = child_env(1, cache, TORCHINDUCTOR_COMPILE_THREADS=1,
                            MALLOC_MMAP_THRESHOLD_=args.mmap_threshold or None)
            began = time.perf_counter()
            try:
                ranks = run_ranks(cmd + ["--report-dir", report_dir], args.world, env=env, timeout=args.timeout)
                out = {"trained": True, "ranks": ranks}
            except ChildError as failed:
                over = {int(name[4:-5]): json.load(open(os.path.join(report_dir, name)))
                        for name in os.listdir(report_dir)}
                out = {"trained": False, "over_cap": over, "returncode": failed.returncode,
                       "timed_out": failed.timed_out}
                if not over:      # not the cap: a failure to show, not a size that does not fit
                    out["error"] = str(failed)[-3000:]
            out["wall_s"] = round(time.perf_counter() - began, 1)
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)
    out.update(side=side, layers=layers, params=params_of(layers, args))
    if out["trained"] and any(r["params"] != out["params"] for r in out["ranks"]):
        raise SystemExit(f"params_of({layers}) = {out['params']}, the model has {out['ranks'][0]['params']}")
    print(row(out), flush=True)
    if "error" in out:
        print(out["error"], file=sys.stderr, flush=True)
    return out


def params_of(layers: int, args) -> int:
    """The parameters of ``llama_config``'s model (the parent imports no torch): embedding, head and
    final norm, and per layer four width x width projections, three of the MLP and two norms. A
    trained trial's ranks count them on the model; ``trial`` checks that the two agree."""
    w, mlp = args.width, int(args.width * 8 / 3)
    return 2 * args.vocab * w + w + layers * (4 * w * w + 3 * w * mlp + 2 * w)


def largest(side: str, args, trials: list) -> int | None:
    """The index of the deepest rung that trains: a bisection over the ladder (the rungs grow, so one
    that does not fit means no deeper one does), or every rung with ``--search all``."""
    trained = {}

    def trains(i: int) -> bool:
        if i not in trained:
            trials.append(trial(side, args.layers[i], args))
            trained[i] = trials[-1]["trained"]
        return trained[i]

    if args.search == "all":
        fits = [i for i in range(len(args.layers)) if trains(i)]
        return fits[-1] if fits else None
    lo, hi = -1, len(args.layers)          # lo trains (or is below the ladder), hi does not (or is above it)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if trains(mid) else (lo, mid)
    return lo if lo >= 0 else None


def row(t: dict) -> str:
    cells = [t["side"], str(t["layers"]), f"{t['params'] / 1e6:.1f}"]
    if t["trained"]:
        ranks = t["ranks"]
        gib = lambda key: " / ".join(f"{r[key] / _GIB:.2f}" for r in ranks)  # noqa: E731
        per_param = " / ".join(f"{r['live_peak_bytes'] / (t['params'] / len(ranks)):.1f}" for r in ranks)
        cells += ["yes", gib("live_peak_bytes"), per_param, gib("rss_peak_bytes"), gib("rss_start_bytes"),
                  f"{max(r['first_step_s'] for r in ranks):.1f}", f"{max(r['step_s'] for r in ranks):.2f}"]
    elif t["over_cap"]:
        where = "; ".join(f"rank {r}: RSS {o['rss_bytes'] / _GIB:.2f}, live peak "
                          f"{o.get('peak_bytes', 0) / _GIB:.2f} in {o['phase']}"
                          for r, o in sorted(t["over_cap"].items()))
        cells += [f"no: over the cap ({where})", "", "", "", "", "", ""]
    else:
        cells += ["no: " + ("timed out" if t["timed_out"] else f"failed (exit {t['returncode']})"),
                  "", "", "", "", "", ""]
    return "| " + " | ".join(cells) + " |"


def phases_row(t: dict) -> str:
    """Where a trained trial's memory went, worst rank per phase: peak RSS up to the end of the build,
    of the first step (optpass compiles there) and of the last; the live-tensor peak in each."""
    worst = lambda key: " / ".join(f"{max(r[key][p] for r in t['ranks']) / _GIB:.2f}"  # noqa: E731
                                   for p in t["ranks"][0][key])
    return (f"| {t['side']} | {t['layers']} | {worst('rss_peak_until')} | {worst('live_peak_in')} "
            f"| {t['ranks'][0]['peak_in']}: {t['ranks'][0]['alive_at_peak_mib']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cap-gib", type=float, default=2.5, help="each rank's RSS cap in GiB")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, nargs="+", default=list(range(2, 26, 2)),
                        help="the ladder: decoder layers of each rung, smallest first")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--search", default="bisect", choices=("bisect", "all"))
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one trial may take")
    parser.add_argument("--mmap-threshold", type=int, default=2 ** 20,
                        help="glibc's MALLOC_MMAP_THRESHOLD_ for every rank of both sides (bytes; 0: glibc's "
                             "default, a threshold that grows to 32 MiB as large blocks are freed)")
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "adamw8bit"),
                        help="fp32 AdamW, or torchao's AdamW8bit (both sides; the moments 1 byte each)")
    parser.add_argument("--json", help="write every trial here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--report-dir", help=argparse.SUPPRESS)
    add_rank_flags(parser)
    args = parser.parse_args()
    if args.child:
        args.layers = args.layers[0]
        rank_main(args)
        return
    args.world = args.world if args.world > 1 else 2
    if args.layers != sorted(args.layers):
        parser.error("--layers: the ladder goes from the smallest model up")
    malloc = (f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold else
              "glibc's default mmap threshold")
    print(f"Llama, width {args.width}, vocab {args.vocab}, rungs of {args.layers} layers; {args.world} gloo ranks "
          f"capped at {args.cap_gib} GiB RSS each ({malloc}); {args.optimizer}, {args.steps} steps of {args.batch} x "
          f"{args.seq} tokens")
    print("\n| side | layers | params M | trained | live peak GiB (rank 0 / 1) | live peak bytes per param of "
          "the rank's share | peak RSS GiB | RSS before build GiB | first step s | later steps s |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    trials, best = [], {}
    for side in args.sides:
        i = largest(side, args, trials)
        best[side] = None if i is None else params_of(args.layers[i], args)
    print("\n| side | layers | peak RSS GiB until the end of build / each step | live peak GiB in build / each step "
          "| rank 0's peak: where, tensors of >= 1 MiB alive there (MiB) |")
    print("|---|---|---|---|---|")
    for t in trials:
        if t["trained"]:
            print(phases_row(t))
    print()
    for side, params in best.items():
        print(f"{side}: largest that trains: " + ("none of the ladder" if params is None else f"{params / 1e6:.1f}M "
                                                 f"parameters ({16 * params / _GIB:.1f} GiB at 16 bytes/param)"))
    brief = {"cap_gib": args.cap_gib, "largest_params": best}
    if best.get("fsdp2"):
        for side in args.sides:
            if side != "fsdp2" and best[side]:
                brief[f"{side}/fsdp2"] = round(best[side] / best["fsdp2"], 3)
                print(f"{side} / fsdp2: {brief[f'{side}/fsdp2']:.3f} (goal >= 1.25)")
    print_json(brief, {"args": vars(args), "trials": trials, **brief}, args.json)


if __name__ == "__main__":
    main()
