"""Float8 training under optpass's fsdp against torch's FSDP2 with the same torchao config, and the
same comparison in fp32: how far apart the two runs' parameters are after a few steps.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/float8_vs_fsdp2.py [--optimizer sgd]

Each rank trains its rows of the same batches; FSDP2 is eager (torch's ``fully_shard`` per Linear
and the root), optpass is ``optpass.fully_shard`` + ``data_parallel="fsdp"`` with the update in
backward (``lower="eager"``: the rewritten aten graph, no Inductor rounding). Beside each pair, each
run against one process in eager that averages the ranks' losses (what FSDP2 computes). Prints the
largest relative parameter difference of each pair, for fp32 Linears, torchao's Float8Linear and
the float8 all-gather config.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import optpass
from _measure import training_step


def mlp(float8_config=None, float8: bool = True) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 64))
    if float8:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, config=float8_config)
    return model


def batch(i: int, world: int):
    g = torch.Generator().manual_seed(10 + i)
    return torch.randn(16 * world, 64, generator=g), torch.randn(16 * world, 64, generator=g)


def optimizer(name: str, model):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    return torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2))


def mse_of(model):
    return lambda x, y: F.mse_loss(model(x), y)


def relative(ours: dict, theirs: dict) -> float:
    return max(((ours[n] - theirs[n]).abs().max() / theirs[n].abs().max()).item() for n in theirs)


def compare(opt_name: str, steps: int, float8: bool, config=None) -> dict:
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    ours = mlp(config, float8)
    theirs, one = copy.deepcopy(ours), copy.deepcopy(ours)
    optpass.fully_shard(ours)
    for m in theirs:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(theirs)
    our_opt, their_opt, one_opt = optimizer(opt_name, ours), optimizer(opt_name, theirs), optimizer(opt_name, one)
    our_step = torch.compile(training_step(mse_of(ours), our_opt), backend="optpass",
                             options={"optimizer": our_opt, "data_parallel": "fsdp", "optimizer_in_backward": True,
                                      "lower": "eager"})
    their_step = training_step(mse_of(theirs), their_opt)
    for i in range(steps):
        x, y = batch(i, world)
        our_step(x.chunk(world)[rank], y.chunk(world)[rank])
        their_step(x.chunk(world)[rank], y.chunk(world)[rank])
        loss = sum(F.mse_loss(one(a), b) for a, b in zip(x.chunk(world), y.chunk(world))) / world
        loss.backward()
        one_opt.step()
        one_opt.zero_grad()
    a = optpass.full_state_dict(ours)
    b = {n: p.full_tensor().detach() for n, p in theirs.named_parameters()}
    c = {n: p.detach() for n, p in one.named_parameters()}
    return {"optpass_vs_fsdp2": relative(a, b), "optpass_vs_one_process": relative(a, c),
            "fsdp2_vs_one_process": relative(b, c)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from torchao.float8 import Float8LinearConfig

    results = {"fp32": compare(args.optimizer, args.steps, float8=False),
               "float8": compare(args.optimizer, args.steps, float8=True),
               "float8_all_gather": compare(args.optimizer, args.steps, float8=True,
                                            config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))}
    if dist.get_rank() == 0:
        print(f"{args.optimizer}, {args.steps} steps, {dist.get_world_size()} ranks: largest relative parameter difference")
        print("| Linears | optpass vs FSDP2 | optpass vs one process | FSDP2 vs one process |")
        print("|---|---|---|---|")
        for name, r in results.items():
            print(f"| {name} | {r['optpass_vs_fsdp2']:.2e} | {r['optpass_vs_one_process']:.2e} | "
                  f"{r['fsdp2_vs_one_process']:.2e} |")
        print("JSON: " + json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
