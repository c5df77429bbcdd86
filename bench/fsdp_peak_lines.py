#!/usr/bin/env python3
"""Which lines of Inductor's code for an optpass fsdp step hold its peak: a line-by-line trace of the
live tensor bytes, on rank 0.

``bench/fsdp.py`` says how high a rank's live peak is and which large tensors are alive at it; the step
graph's liveness estimate says where the graph's own order peaks. When the two disagree, this says
where the run really peaks: it compiles the same model as ``bench/fsdp.py`` (a Hugging Face Llama,
optionally on a dp x tp mesh, ``optpass.fully_shard`` per layer and the root, AdamW in backward,
clipping), runs two steps, then runs a third with ``sys.settrace`` on the compiled graph's ``call``
(the wrapper Inductor writes: one line per kernel, collective, allocation and ``del``), reading the
counting allocator's live bytes (every thread: gloo's buffers included) before each line. It prints
the highest reading and the lines around it, each with the live MiB before it ran.

Run it under torchrun, one process per rank (gloo, CPU):

    python -m torch.distributed.run --standalone --nproc-per-node 4 bench/fsdp_peak_lines.py --depth 2 --tp 2

Sampling is per line, so a buffer a collective allocates and frees on gloo's thread between two lines
(its scratch copy) may be missed: the printed peak can sit below ``bench/fsdp.py``'s (docs/design.md §68).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--around", type=int, default=40, help="lines shown before the peak")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from optpass.analysis.counting_allocator import counting_allocator

    allocator = counting_allocator()          # installed before the model is built: every tensor counted
    import optpass  # noqa: F401  (registers backend="optpass")
    from _measure import training_step
    from fsdp import batches, build, loss_fn, make_optimizer, optpass_fully_shard, tensor_parallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    settings = argparse.Namespace(model="llama", width=args.width, depth=args.depth, batch=1, seq=args.seq,
                                  vocab=args.vocab, tp=args.tp, clip=args.clip)
    model, units = build(settings)
    optpass_fully_shard(model, units, tensor_parallel(model, args.tp, world))
    opt = make_optimizer("adamw", model.parameters())
    options = {"optimizer": opt, "data_parallel": "fsdp", "optimizer_in_backward": True}
    if args.clip:
        options["clip_grad_norm"] = args.clip
    compiled = torch.compile(training_step(loss_fn(settings, model), opt), backend="optpass", options=options)
    data = batches(settings, rank, world)
    for _ in range(2):
        compiled(*next(data))

    readings: list[tuple[int, int, str]] = []

    def each_line(frame, event, _arg):
        if event == "line":
            readings.append((allocator.counters()[0], frame.f_lineno, frame.f_code.co_filename))
        return each_line

    def in_the_wrapper(frame, _event, _arg):
        return each_line if frame.f_code.co_name == "call" and "torchinductor" in frame.f_code.co_filename else None

    dist.barrier()
    before = allocator.counters()[0]
    sys.settrace(in_the_wrapper)
    compiled(*next(data))
    sys.settrace(None)
    if rank == 0 and readings:
        peak = max(range(len(readings)), key=lambda i: readings[i][0])
        live, line, path = readings[peak]
        print(f"live before the step {before / 2**20:.1f} MiB; highest reading {live / 2**20:.1f} MiB, before "
              f"line {line} of {path}")
        source = open(path).read().splitlines()
        for live, line, _ in readings[max(0, peak - args.around):peak + 8]:
            code = source[line - 1].strip()
            if not code.startswith(("assert_", "#")):
                print(f"{live / 2**20:8.1f} {line:6d}  {code[:150]}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
