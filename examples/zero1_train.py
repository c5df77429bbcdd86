"""Data-parallel training with optpass ZeRO-1: one script, run on every rank by torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/zero1_train.py --out /tmp/zero1

The training step is the single-device step (no DDP wrapper, no special
optimizer); ``options={"data_parallel": "zero1"}`` makes optpass average the
gradients across ranks, keep 1/N of AdamW's state on each rank and update only
that shard, with the collectives inside the compiled step. Each rank feeds its
own slice of the global batch. Results go to ``--out/rank<r>.json``
(examples/zero1.ipynb reads them).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import optpass
import optpass.zero1
from optpass.demo.models import MLP

SIZES = (16, 64, 64, 64, 4)
STEPS = 20
PER_RANK = 8


TEACHER = torch.randn(SIZES[0], SIZES[-1], generator=torch.Generator().manual_seed(1234))


def global_batch(step: int, samples: int):
    """Step `step`'s whole batch: inputs and a fixed teacher's outputs (so the loss can fall)."""
    x = torch.randn(samples, SIZES[0], generator=torch.Generator().manual_seed(step))
    return x, torch.tanh(x @ TEACHER)


def make_model_and_optimizer():
    torch.manual_seed(0)
    model = MLP(SIZES)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-3), weight_decay=0.01)
    return model, opt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--bucket-bytes", type=int, default=16 * 1024)
    args = parser.parse_args()

    dist.init_process_group("gloo")                       # nccl on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = make_model_and_optimizer()

    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        out = loss.detach()          # take what you return BEFORE opt.step()
        opt.step()
        opt.zero_grad()
        return out

    step = torch.compile(train_step, backend="optpass",
                         options={"optimizer": opt, "data_parallel": "zero1",
                                  "bucket_bytes": args.bucket_bytes})
    losses = []
    with optpass.keep_graphs():                           # keep the graphs for the diff below
        for i in range(STEPS):
            x, y = global_batch(i, PER_RANK * world)
            mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            losses.append(step(x[mine], y[mine]).item())
    report = [r for r in optpass.recent_reports() if r.graph_after is not None and r.kind.value == "step"][-1]
    sharded = optpass.zero1.sharded_state(opt)          # this rank's shard of AdamW
    result = {
        "rank": rank, "world": world, "losses": losses,
        "state_bytes": sharded.state_bytes(),
        "buckets": [{"chunk": b.chunk, "owned": b.owned(rank), "params": len(b.params)}
                    for b in sharded.layout.buckets],
        "notes": [note for outcome in report.passes for note in outcome.notes],
        "graph_diff": optpass.graph_diff(report.graph_before, report.graph_after, shapes=False, context=0),
        "params": [p.detach().reshape(-1).tolist() for p in model.parameters()],
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
