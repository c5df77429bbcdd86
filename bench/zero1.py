#!/usr/bin/env python3
"""ZeRO-1 (``data_parallel="zero1"``) versus DDP + torch.optim, 2 gloo ranks on CPU, in one run.

Each rank (a process spawned here, ``--threads`` threads each) builds the same
MLP (default 8 x ``Linear(1024, 1024)`` + ReLU, 8.4M fp32 parameters) and AdamW,
three times:

* ``ddp``      -- ``DistributedDataParallel(model)`` + ``torch.optim.AdamW`` (eager): the baseline;
* ``ddp-zero`` -- DDP + ``ZeroRedundancyOptimizer(AdamW)`` (eager, PyTorch's ZeRO-1);
* ``optpass``  -- the single-device step under ``torch.compile(backend="optpass",
  options={"optimizer": opt, "data_parallel": "zero1", ...})`` (Inductor).

and reports, per rank:

* optimizer-state bytes: every tensor in the optimizer state (optpass: this rank's
  shard optimizer) versus the unsharded state of ``ddp`` -- goal <= 1/N + one bucket;
* collectives per step and their bytes: DDP's all-reduces counted by a comm hook
  (bucket buffers), optpass's reduce-scatters and all-gathers counted in the
  rewritten graph -- goal: optpass bytes (reduce-scatter in + all-gather out, each
  rank's view) equal DDP's all-reduce bytes, i.e. ratio 1.00 (a ring all-reduce
  is a reduce-scatter plus an all-gather of the same buffer);
* step time: the three variants interleaved step by step (after warm-up and
  compile), median over ``--steps``, ratios versus ``ddp``.

Usage::

    python3 bench/zero1.py              # 8 x 1024^2, batch 16 per rank, 20 steps (~2 min)
    python3 bench/zero1.py --quick      # 4 x 256^2
    python3 bench/zero1.py --in-backward --partition greedy
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time


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


def rank_main(rank: int, world: int, port: int, args, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    import optpass
    import optpass.zero1
    from optpass.passes.shard_optimizer import collectives_in

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, args.width, generator=g)

    # --- DDP + AdamW, and DDP + ZeroRedundancyOptimizer, with a comm hook that counts
    def counting_hook(counter):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(state, bucket):
            counter["calls"] += 1
            counter["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
            return allreduce_hook(state, bucket)
        return hook

    variants = {}
    for name in ("ddp", "ddp-zero"):
        model = build(args.width, args.depth)
        ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_bytes / 2**20)
        counter = {"calls": 0, "bytes": 0}
        ddp.register_comm_hook(None, counting_hook(counter))
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if name == "ddp" else
               ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3))

        def ddp_step(ddp=ddp, opt=opt):
            loss = F.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        variants[name] = (ddp_step, opt, counter)

    model = build(args.width, args.depth)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))

    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    options = {"optimizer": opt, "data_parallel": "zero1", "partition": args.partition,
               "optimizer_in_backward": args.in_backward, "bucket_bytes": args.bucket_bytes}
    compiled = torch.compile(train_step, backend="optpass", options=options)
    with optpass.keep_graphs():
        for _ in range(3):
            compiled(x, y)
    report = [r for r in optpass.recent_reports() if r.graph_after is not None][-1]
    collectives = collectives_in(report.graph_after)
    variants["optpass"] = (lambda: compiled(x, y), None, None)

    for name in ("ddp", "ddp-zero"):
        for _ in range(args.warmup):
            variants[name][0]()
        variants[name][2].update(calls=0, bytes=0)
    times = {name: [] for name in variants}
    for _ in range(args.steps):
        for name, (fn, _, _) in variants.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    # What the backend's collectives cost by themselves, on one buffer of all the gradients.
    flat = torch.randn(sum(p.numel() for p in model.parameters()) // world * world)
    chunk, full = torch.empty(flat.numel() // world), torch.empty_like(flat)
    comm = {"all_reduce": [], "reduce_scatter+all_gather": []}
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flat)
        comm["all_reduce"].append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        dist.reduce_scatter_tensor(chunk, flat)
        dist.all_gather_into_tensor(full, chunk)
        comm["reduce_scatter+all_gather"].append(time.perf_counter() - start)
    sharded = optpass.zero1.sharded_state(opt)
    zero_opt = variants["ddp-zero"][1]
    result = {
        "rank": rank,
        "params": sum(p.numel() for p in model.parameters()),
        "state_bytes": {"ddp": state_bytes(variants["ddp"][1].state.values()),
                        "ddp-zero": state_bytes(zero_opt.optim.state.values()),
                        "optpass": sharded.state_bytes()},
        "largest_bucket_state_bytes": max(b.chunk * world for b in sharded.layout.buckets) * 4 * 2,
        "collectives_per_step": {
            "ddp": {"all_reduce": [variants["ddp"][2]["calls"] / args.steps, variants["ddp"][2]["bytes"] / args.steps]},
            "optpass": collectives},
        "step_s": {name: statistics.median(t) for name, t in times.items()},
        "collective_s": {name: statistics.median(t) for name, t in comm.items()},
        "buckets": len(sharded.layout.buckets),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--partition", default="even", choices=("even", "greedy"))
    parser.add_argument("--in-backward", action="store_true")
    parser.add_argument("--bucket-bytes", type=int, default=25 * 2**20)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.width, args.depth, args.steps, args.bucket_bytes = 256, 4, 10, 2**18

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(rank_main, args=(args.world, port, args, out_dir), nprocs=args.world, join=True)
        results = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(args.world)]

    n = args.world
    print(f"ZeRO-1 bench: {n} gloo ranks, MLP {args.depth} x {args.width}^2 "
          f"({results[0]['params'] / 1e6:.1f}M fp32 params), AdamW, batch {args.batch}/rank, "
          f"partition {args.partition}, {'in' if args.in_backward else 'after'} backward, "
          f"bucket {args.bucket_bytes / 2**20:.2f} MiB, {args.threads} thread(s)/rank")
    for r in results:
        sb = r["state_bytes"]
        bound = sb["ddp"] / n + r["largest_bucket_state_bytes"]
        print(f"rank {r['rank']}: optimizer state  ddp {sb['ddp'] / 1e6:8.2f} MB  ddp-zero {sb['ddp-zero'] / 1e6:8.2f} MB"
              f"  optpass {sb['optpass'] / 1e6:8.2f} MB  -> optpass/ddp = {sb['optpass'] / sb['ddp']:.3f}"
              f" (goal <= 1/{n} + one bucket = {bound / sb['ddp']:.3f}: {'met' if sb['optpass'] <= bound else 'NOT met'})")
    r0 = results[0]
    ddp_calls, ddp_bytes = r0["collectives_per_step"]["ddp"]["all_reduce"]
    ours = r0["collectives_per_step"]["optpass"]
    our_bytes = ours["reduce_scatter"][1]
    print(f"collectives per step (rank 0): ddp {ddp_calls:.0f} all-reduce(s), {ddp_bytes / 1e6:.2f} MB; "
          f"optpass {ours['reduce_scatter'][0]} reduce-scatter(s) {ours['reduce_scatter'][1] / 1e6:.2f} MB in + "
          f"{ours['all_gather'][0]} all-gather(s) {ours['all_gather'][1] / 1e6:.2f} MB out, "
          f"{ours['all_reduce'][0]} all-reduce(s)")
    print(f"  bytes ratio optpass/ddp = {our_bytes / ddp_bytes:.4f} (goal 1.00: reduce-scatter + all-gather "
          "of a buffer = one ring all-reduce of it)")
    times = {k: statistics.median(r["step_s"][k] for r in results) for k in r0["step_s"]}
    print("step time (median over steps, median over ranks): " +
          ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in times.items()))
    print(f"  optpass/ddp = {times['optpass'] / times['ddp']:.3f}, ddp-zero/ddp = {times['ddp-zero'] / times['ddp']:.3f}")
    comm = {k: statistics.median(r["collective_s"][k] for r in results) for k in r0["collective_s"]}
    print(f"the collectives alone, one buffer of all gradients: all_reduce {comm['all_reduce'] * 1e3:.1f} ms, "
          f"reduce_scatter + all_gather {comm['reduce_scatter+all_gather'] * 1e3:.1f} ms "
          f"(x{comm['reduce_scatter+all_gather'] / comm['all_reduce']:.2f}: the backend's implementations, "
          "same bytes)")
    print(json.dumps({"args": vars(args), "ranks": results}))


if __name__ == "__main__":
    sys.exit(main())
