#!/usr/bin/env python3
"""ZeRO-1 (``data_parallel="zero1"``) versus DDP and DDP + ZeroRedundancyOptimizer, gloo ranks on CPU.

For each world size (``--worlds``, default 2 and 3 ranks, ``--threads`` threads each)
one set of spawned ranks builds the same MLP (default 8 x ``Linear(1024, 1024)`` + ReLU,
8.4M fp32 parameters) and AdamW once per variant:

* ``ddp``                 -- ``DistributedDataParallel(model)`` + ``torch.optim.AdamW`` (eager);
* ``ddp-zero``            -- DDP + ``ZeroRedundancyOptimizer(AdamW)`` (eager, PyTorch's ZeRO-1);
* ``optpass``             -- the single-device step under ``torch.compile(backend="optpass",
  options={"optimizer": opt, "data_parallel": "zero1", ...})`` (Inductor);
* ``optpass-in-backward`` -- the same with ``optimizer_in_backward=True``;

and, to tell how much communication the step hides, each of them once more without
communication: ``ddp/no-comm`` (under ``no_sync()``), ``optpass/no-comm`` and
``optpass-in-backward/no-comm`` (a collective plan that does the same local work and
no collective). All variants run interleaved step by step (after warm-up and compile),
the same number of steps each, median over ``--steps``. Reported per world:

* step time and the ratios optpass / ddp and optpass / ddp-zero (goals <= 1.05 and <= 1.00);
* hidden communication: exposed = step - step without communication; the variant's
  collectives alone (the same calls on buffers of the same sizes, nothing else running);
  hidden = 1 - exposed / alone. On a machine whose cores the ranks' compute already fills,
  the collectives' own CPU work (copies, TCP, gloo's reductions) slows the compute down, so
  this can be negative; also reported for optpass: the time its thread is blocked in
  ``wait_tensor`` (torch.profiler, 5 more steps), i.e. how much its schedule overlaps;
* the collectives alone per plan, on this layout (``reduce_scatter``: reduce_scatter +
  all_gather; ``all_reduce``: all_reduce + one broadcast per owner; and all_reduce +
  all_gather), which is why ``collectives="auto"`` picks what it picks on gloo;
* optimizer-state bytes (goal <= 1/N of DDP's + one bucket), collectives per step and bytes;
* the load: cores other processes kept busy while the steps were timed.

Usage::

    python3 bench/zero1.py                    # 2 and 3 ranks, 8 x 1024^2, batch 16/rank, 20 steps (~6 min)
    python3 bench/zero1.py --worlds 2         # one world size
    python3 bench/zero1.py --collectives reduce_scatter
    python3 bench/zero1.py --quick            # 4 x 256^2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

from _measure import (add_rank_flags, child_command, cpu_busy_s, emit_result, graph_count, init_gloo, other_cores,
                      run_ranks, self_cpu_s, training_step, waited_per_step)

VARIANTS = ("ddp", "ddp-zero", "optpass", "optpass-in-backward")


def build(width: int, depth: int):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def state_bytes(states) -> int:
    import torch

    return sum(t.numel() * t.element_size() for s in states for t in s.values()
               if isinstance(t, torch.Tensor))


def register_no_communication_plan() -> str:
    """A collective plan that does the all_reduce plan's local work (cat of the gradients, this
    rank's slice, the update, the parameter writes) and no collective: the step's time without
    communication. The other ranks' chunks are zeros, so the model trains wrongly: timing only."""
    import torch

    from optpass.passes import shard_optimizer

    aten = torch.ops.aten

    class NoCommunication(shard_optimizer.AllReducePlan):
        @staticmethod
        def describe(layout) -> str:
            return "no communication (bench/zero1.py: timing only)"

        def start_reduce(self, emit, bucket, flat_grad):
            return emit.joined([(flat_grad[s.param], s.start, s.stop) for segments in bucket.segments
                                for s in segments], like=flat_grad[bucket.params[0]])

        def finish_reduce(self, emit, bucket, started):
            owned, start = bucket.owned(self.rank), self._starts(bucket)[self.rank]
            self._reduced[bucket.index] = started
            return emit(aten.div.Tensor, emit.piece(started, start, start + owned), self.world) if owned else None

        def start_gather(self, emit, bucket, new_shard):
            return [(r, new_shard if r == self.rank else emit.zeros(self._reduced[bucket.index], bucket.owned(r)))
                    for r in range(self.world) if bucket.owned(r)]

        def finish_gather(self, emit, bucket, started):
            gathered = [None] * self.world
            for rank, node in started:
                gathered[rank] = (node, 0)
            return gathered

    shard_optimizer.PLANS["bench-no-communication"] = NoCommunication
    return "bench-no-communication"


def collectives_alone(plan: str, layout, group, repeats: int) -> float:
    """Median seconds of one step's collectives of `plan` for `layout`, run back to back with
    nothing else (functional collectives, in place where the graph has them in place)."""
    import torch
    import torch.distributed as dist

    from optpass.passes.shard_optimizer import AllReducePlan

    fc = torch.ops._c10d_functional
    name, world = group.group_name, dist.get_world_size(group)
    buffers = []
    for bucket in layout.buckets:
        owned = [bucket.owned(r) for r in range(world)]
        buffers.append((torch.randn(sum(owned)), torch.randn(world * bucket.chunk),
                        [torch.randn(n) for n in owned], AllReducePlan._starts(bucket), bucket.chunk))
    times = []
    for _ in range(repeats):
        dist.barrier(group)
        start = time.perf_counter()
        for flat, padded, chunks, starts, chunk in buffers:
            if plan == "reduce_scatter":
                mine = fc.wait_tensor(fc.reduce_scatter_tensor(padded, "avg", world, name))
                fc.wait_tensor(fc.all_gather_into_tensor(mine, world, name))
            else:
                fc.wait_tensor(fc.all_reduce_(flat, "sum", name))
                if plan == "all_reduce":
                    for w in [fc.broadcast_(c, r, name) for r, c in enumerate(chunks) if c.numel()]:
                        fc.wait_tensor(w)
                else:                                   # "all_reduce+all_gather"
                    fc.wait_tensor(fc.all_gather_into_tensor(padded[:chunk], world, name))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ddp_collectives_alone(bucket_bytes: list[int], group, repeats: int) -> float:
    import torch
    import torch.distributed as dist

    buffers = [torch.randn(n // 4) for n in bucket_bytes]
    times = []
    for _ in range(repeats):
        dist.barrier(group)
        start = time.perf_counter()
        for b in buffers:
            dist.all_reduce(b, group=group)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    import optpass
    import optpass.zero1
    from optpass.passes.shard_optimizer import collectives_in

    rank, world = args.rank, args.world
    torch.set_num_threads(args.threads)
    init_gloo(rank, world, args.port, timeout_s=600)
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, args.width, generator=g)
    no_communication = register_no_communication_plan()

    def counting_hook(counter):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(state, bucket):
            counter["calls"] += 1
            counter["bytes"].append(bucket.buffer().numel() * bucket.buffer().element_size())
            return allreduce_hook(state, bucket)
        return hook

    steps, models, extra = {}, {}, {}
    for name in ("ddp", "ddp-zero", "ddp/no-comm"):
        model = build(args.width, args.depth)
        ddp = DistributedDataParallel(model)             # DDP's own buckets (25 MiB, first 1 MiB)
        counter = {"calls": 0, "bytes": []}
        ddp.register_comm_hook(None, counting_hook(counter))
        opt = (ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
               if name == "ddp-zero" else torch.optim.AdamW(model.parameters(), lr=1e-3))

        def ddp_step(ddp=ddp, opt=opt, sync=name != "ddp/no-comm"):
            with ddp.no_sync() if not sync else contextlib.nullcontext():
                loss = F.mse_loss(ddp(x), y)
                loss.backward()
            opt.step()
            opt.zero_grad()
        ddp_step()                               # as many steps as the optpass variants' compile call
        steps[name], models[name], extra[name] = ddp_step, model, (opt, counter)

    reports = {}
    for name in ("optpass", "optpass-in-backward"):
        for collectives in (args.collectives, no_communication):
            model = build(args.width, args.depth)
            opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
            train_step = training_step(lambda x, y, model=model: F.mse_loss(model(x), y), opt)
            options = {"optimizer": opt, "data_parallel": "zero1", "partition": args.partition,
                       "optimizer_in_backward": name == "optpass-in-backward",
                       "bucket_bytes": args.bucket_bytes, "collectives": collectives}
            compiled = torch.compile(train_step, backend="optpass", options=options)
            variant = name if collectives == args.collectives else f"{name}/no-comm"
            optpass.report.clear_reports()
            with optpass.keep_graphs():
                compiled(x, y)                   # compiles; the timed loop must not
            reports[variant] = [r for r in optpass.recent_reports() if r.graph_after is not None][-1]
            steps[variant] = lambda compiled=compiled: compiled(x, y)
            models[variant], extra[variant] = model, (opt, None)

    for _ in range(args.warmup):
        for fn in steps.values():
            fn()
    extra["ddp"][1].update(calls=0, bytes=[])
    compiles_before = graph_count()
    times = {name: [] for name in steps}
    busy_before, mine_before, wall_before = cpu_busy_s(), self_cpu_s(), time.perf_counter()
    for _ in range(args.steps):
        for name, fn in steps.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    wall, mine = time.perf_counter() - wall_before, self_cpu_s() - mine_before
    busy = None if busy_before is None else cpu_busy_s() - busy_before
    if graph_count() != compiles_before:
        raise SystemExit("a graph compiled while the steps were timed: the times are not steady-state")

    waited = {name: waited_per_step(steps[name], 5) for name in ("optpass", "optpass-in-backward")}
    sharded = optpass.zero1.sharded_state(extra["optpass"][0])
    plan_of = lambda variant: next(n for o in reports[variant].passes for n in o.notes if "bucket(s)" in n)  # noqa: E731
    ddp_bucket_bytes = extra["ddp"][1]["bytes"][:extra["ddp"][1]["calls"] // args.steps]
    repeats = 7
    alone = {plan: collectives_alone(plan, sharded.layout, group, repeats)
             for plan in ("reduce_scatter", "all_reduce", "all_reduce+all_gather")}
    alone["ddp"] = ddp_collectives_alone(ddp_bucket_bytes, group, repeats)

    result = {
        "rank": rank,
        "params": sum(p.numel() for p in models["ddp"].parameters()),
        "state_bytes": {"ddp": state_bytes(extra["ddp"][0].state.values()),
                        "ddp-zero": state_bytes(extra["ddp-zero"][0].optim.state.values()),
                        "optpass": sharded.state_bytes()},
        "largest_bucket_state_bytes": max(b.chunk * world for b in sharded.layout.buckets) * 4 * 2,
        "collectives_per_step": {
            "ddp": {"all_reduce": [len(ddp_bucket_bytes), sum(ddp_bucket_bytes)]},
            "optpass": collectives_in(reports["optpass"].graph_after)},
        "plan": plan_of("optpass"),
        "step_s": {name: statistics.median(t) for name, t in times.items()},
        "collectives_alone_s": alone,
        "waited_s": waited,
        "buckets": len(sharded.layout.buckets),
        "cpu_s": mine, "busy_s": busy, "wall_s": wall,
    }
    dist.destroy_process_group()
    emit_result(result)


def run_world(world: int, args) -> dict:
    cmd = child_command(__file__, child=True, world=world, width=args.width, depth=args.depth, batch=args.batch,
                        steps=args.steps, warmup=args.warmup, threads=args.threads, partition=args.partition,
                        collectives=args.collectives, bucket_bytes=args.bucket_bytes)
    results = run_ranks(cmd, world)
    times = {k: statistics.median(r["step_s"][k] for r in results) for k in results[0]["step_s"]}
    alone = {k: statistics.median(r["collectives_alone_s"][k] for r in results)
             for k in results[0]["collectives_alone_s"]}
    waited = {k: statistics.median(r["waited_s"][k] for r in results) for k in results[0]["waited_s"]}
    r0 = results[0]
    busy = r0["busy_s"]
    others = other_cores(busy, sum(r["cpu_s"] for r in results), r0["wall_s"])
    return {"world": world, "ranks": results, "times": times, "alone": alone, "waited": waited,
            "other_cores": others}


def report(summary: dict, args) -> None:
    world, results, times, alone = summary["world"], summary["ranks"], summary["times"], summary["alone"]
    r0 = results[0]
    print(f"\n=== {world} gloo ranks ({world} processes on {os.cpu_count()} cores"
          f"{', oversubscribed' if world > (os.cpu_count() or 1) else ''}), MLP {args.depth} x {args.width}^2 "
          f"({r0['params'] / 1e6:.1f}M fp32 params), AdamW, batch {args.batch}/rank, partition "
          f"{args.partition}, bucket_bytes {args.bucket_bytes}, {args.threads} thread(s)/rank")
    print(f"optpass plan: {r0['plan']}")
    for r in results:
        sb = r["state_bytes"]
        bound = sb["ddp"] / world + r["largest_bucket_state_bytes"]
        print(f"rank {r['rank']}: optimizer state  ddp {sb['ddp'] / 1e6:7.2f} MB  ddp-zero {sb['ddp-zero'] / 1e6:7.2f} MB"
              f"  optpass {sb['optpass'] / 1e6:7.2f} MB -> optpass/ddp = {sb['optpass'] / sb['ddp']:.3f}"
              f" (goal <= 1/{world} + one bucket = {bound / sb['ddp']:.3f}: {'met' if sb['optpass'] <= bound else 'NOT met'})")
    ddp_calls, ddp_bytes = r0["collectives_per_step"]["ddp"]["all_reduce"]
    ours = r0["collectives_per_step"]["optpass"]
    print(f"collectives per step (rank 0): ddp {ddp_calls} all-reduce(s) {ddp_bytes / 1e6:.2f} MB; optpass "
          + ", ".join(f"{n} {kind}(s) {b / 1e6:.2f} MB" for kind, (n, b) in ours.items() if n))
    print("the collectives alone, one step's worth on this layout (median of 7): "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in alone.items()))
    print("step time (median over steps, median over ranks): "
          + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in times.items()) + " ms")
    for name in ("ddp", "optpass", "optpass-in-backward"):
        exposed = times[name] - times[f"{name}/no-comm"]
        comm = alone["ddp"] if name == "ddp" else alone[_plan_key(r0["plan"])]
        waits = (f"; blocked in wait_tensor {summary['waited'][name] * 1e3:.1f} ms -> the schedule overlaps "
                 f"{1 - summary['waited'][name] / comm:.0%}") if name in summary["waited"] else ""
        print(f"  {name:20s} communication alone {comm * 1e3:6.1f} ms, exposed {exposed * 1e3:6.1f} ms "
              f"(step {times[name] * 1e3:.1f} - without communication {times[f'{name}/no-comm'] * 1e3:.1f}) "
              f"-> hidden {1 - exposed / comm:+.0%}{waits}")
    if summary["other_cores"] is not None:
        print(f"load: other processes kept {summary['other_cores']:.2f} of {os.cpu_count()} cores busy "
              "while the steps were timed")


def _plan_key(note: str) -> str:
    return "reduce_scatter" if "reduce_scatter +" in note else "all_reduce"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--partition", default="even", choices=("even", "greedy"))
    parser.add_argument("--collectives", default="auto", choices=("auto", "reduce_scatter", "all_reduce"))
    parser.add_argument("--bucket-bytes", type=int, default=None,
                        help="optpass's bucket_bytes (default: its default); DDP keeps its own buckets")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", help="write every number here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_rank_flags(parser)
    args = parser.parse_args()
    if args.child:
        rank_main(args)
        return
    if args.quick:
        args.width, args.depth, args.steps = 256, 4, 10

    summaries = [run_world(world, args) for world in args.worlds]
    for summary in summaries:
        report(summary, args)
    print(f"\n| ranks | step | ddp ms | ddp-zero ms | optpass ms | optpass / ddp (goal <= 1.05) "
          "| optpass / ddp-zero (goal <= 1.00) | comm hidden (step time) | comm overlapped (waits) "
          "| other load (cores) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in summaries:
        t = s["times"]
        for name, where in (("optpass", "update after backward"), ("optpass-in-backward", "update in backward")):
            comm = s["alone"][_plan_key(s["ranks"][0]["plan"])]
            hidden = 1 - (t[name] - t[f"{name}/no-comm"]) / comm
            print(f"| {s['world']}{' (oversubscribed)' if s['world'] > (os.cpu_count() or 1) else ''} | {where} "
                  f"| {t['ddp'] * 1e3:.1f} | {t['ddp-zero'] * 1e3:.1f} | {t[name] * 1e3:.1f} "
                  f"| {t[name] / t['ddp']:.3f} | {t[name] / t['ddp-zero']:.3f} | {hidden:.0%} "
                  f"| {1 - s['waited'][name] / comm:.0%} "
                  f"| {s['other_cores']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "worlds": summaries}, f)


if __name__ == "__main__":
    sys.exit(main())
