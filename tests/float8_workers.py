"""Rank-side programs of tests/test_float8.py: torchao's Float8 training under optpass's fsdp, 2 gloo ranks.

Float8 scales each GEMM operand by its own amax: a weight's from the whole (gathered) weight, an
activation's from this rank's batch. So the reference is one process under ``backend="inductor"``
that computes each rank's loss on that rank's rows separately and averages them, as fsdp averages
the ranks' gradients: the same scales, the same roundings.
"""

from __future__ import annotations

import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

import optpass
from parity import make_step, mlp_loss

STEPS = 4


def float8_mlp(config=None) -> nn.Module:
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 64))
    convert_to_float8_training(model, config=config)
    return model


def batch(i: int, world: int):
    g = torch.Generator().manual_seed(10 + i)
    return torch.randn(16 * world, 64, generator=g), torch.randn(16 * world, 64, generator=g)


def run_all(rank: int, world: int, names: list[str]) -> dict:
    results = {}
    for name in names:
        torch._dynamo.reset()
        try:
            results[name] = globals()[name](rank, world)
        except Exception as error:  # noqa: BLE001  (each program reports its own failure)
            results[name] = {"error": (type(error).__name__, str(error), traceback.format_exc())}
    return results


def _fsdp_against_one_process(rank, world, config=None, options=None, precompute: bool = False) -> dict:
    options = options if options is not None else {"optimizer_in_backward": True}
    model = float8_mlp(config)
    reference = float8_mlp(config)
    data_parallel = options.pop("data_parallel", "fsdp")
    if data_parallel == "fsdp":
        optpass.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=torch.tensor(1e-2))

    step = make_step(model, opt, mlp_loss)

    def reference_step(xs, ys):
        loss = sum(F.mse_loss(reference(x), y) for x, y in zip(xs, ys)) / len(xs)
        loss.backward()
        out = loss.detach()
        ref_opt.step()
        ref_opt.zero_grad()
        return out

    compiled = torch.compile(step, backend="optpass", options=dict(options, optimizer=opt, data_parallel=data_parallel))
    reference_compiled = torch.compile(reference_step, backend="inductor")
    for i in range(STEPS):
        x, y = batch(i, world)
        compiled(x.chunk(world)[rank], y.chunk(world)[rank])
        if precompute:          # FSDP2's recipe after each step: harmless here (optpass casts where it gathers)
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)
        reference_compiled(list(x.chunk(world)), list(y.chunk(world)))
    full = optpass.full_state_dict(model) if data_parallel == "fsdp" else dict(model.named_parameters())
    return {"relative": max(((full[n] - p.detach()).abs().max() / p.detach().abs().max()).item()
                            for n, p in reference.named_parameters()),
            "module": type(model[0]).__name__}


def fsdp_in_backward(rank, world):
    return _fsdp_against_one_process(rank, world)


def zero1_in_backward(rank, world):
    return _fsdp_against_one_process(rank, world, options={"optimizer_in_backward": True, "data_parallel": "zero1"})


def fsdp_float8_all_gather(rank, world):
    from torchao.float8 import Float8LinearConfig

    return _fsdp_against_one_process(rank, world, Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                                     precompute=True)


def fsdp_float8_all_gather_graph(rank, world):
    """What the step with the float8 all-gather config moves: the dtypes its all-gathers send,
    forward and backward, and the reshard pass's notes."""
    from torchao.float8 import Float8LinearConfig

    model = float8_mlp(Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    optpass.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2))

    step = make_step(model, opt, mlp_loss)
    x, y = batch(0, world)
    report = optpass.explain(step, x.chunk(world)[rank], y.chunk(world)[rank],
                             options={"optimizer": opt, "data_parallel": "fsdp", "optimizer_in_backward": True})
    graph = [r for r in optpass.recent_reports() if r.graph_after is not None and r.kind.value == "step"][-1].graph_after
    sent = [str(n.args[0].meta["val"].dtype) for n in graph.nodes
            if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default]
    reduced = [n.args[1] for n in graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default]
    return {"sent": sent, "all_reduce_ops": reduced, "explain": str(report)}
