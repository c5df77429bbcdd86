"""The small float64 training setup that the fault tests share (tests/rank_failure_workers.py,
tests/bad_checkpoint_workers.py, tests/restart_job.py): an MLP with a one-output head (under fsdp
with 2 ranks one rank holds none of the head's rows), sharded per layer, and its compiled step."""

from __future__ import annotations

import torch
import torch.nn as nn

import optpass


def sharded_model(kind: str, width: int = 16, extra_layer: bool = False) -> nn.Module:
    """The MLP, seeded, passed to ``optpass.fully_shard`` per Linear and at the root under fsdp;
    `extra_layer` appends a Linear(1, 1) (another model, whose first layers match)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1),
                          *([nn.Linear(1, 1)] if extra_layer else []))
    if kind == "fsdp":
        for layer in model:
            if isinstance(layer, nn.Linear):
                optpass.fully_shard(layer)
        optpass.fully_shard(model)
    return model


def compiled_step(model: nn.Module, opt, kind: str, in_backward: bool = True, lower: str = "eager"):
    """The documented step shape, compiled with ``data_parallel=kind``."""
    def train_step(x, y):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    return torch.compile(train_step, backend="optpass", options={
        "optimizer": opt, "data_parallel": kind, "optimizer_in_backward": in_backward, "lower": lower})
