"""Ranks of tests/test_low_bit_optimizers.py: fully sharded training with torchao's AdamW8bit."""

from __future__ import annotations

import torch

import optpass

STEPS = 6


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 16))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 1024, generator=g), torch.randint(0, 16, (16,), generator=g)) for _ in range(STEPS)]


def training_step(model, opt):
    """The supported step shape, cross entropy on `model`'s output."""
    def step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    return step


def make_step(model, opt, **options):
    """``training_step`` compiled by optpass with the update in backward (``backend="inductor"``: by
    Inductor, the reference)."""
    if options.get("backend") == "inductor":
        return torch.compile(training_step(model, opt), backend="inductor")
    return torch.compile(training_step(model, opt), backend="optpass",
                         options={"optimizer": opt, "optimizer_in_backward": True, **options})


def one_process_adamw8bit() -> dict[str, torch.Tensor]:
    import torchao.optim

    model = mlp()
    opt = torchao.optim.AdamW8bit(model.parameters(), lr=1e-3)
    step = make_step(model, opt)
    for x, y in batches():
        step(x, y)
    return model.state_dict()


def fsdp_adamw8bit(rank: int, world: int) -> dict:
    """Each rank's rows of each batch, fully sharded, AdamW8bit in backward; beside one process on the
    whole batch (run in this rank: tensors are not sent back)."""
    import hashlib

    import torchao.optim

    model = mlp()
    optpass.fully_shard(model)
    opt = torchao.optim.AdamW8bit(model.parameters(), lr=1e-3)
    step = make_step(model, opt, data_parallel="fsdp")
    rows = slice(rank * 16 // world, (rank + 1) * 16 // world)
    for x, y in batches():
        step(x[rows], y[rows])
    shard = next(model.parameters())
    moment = opt.state[shard]["exp_avg"]
    full = optpass.full_state_dict(model)
    reference = one_process_adamw8bit()
    digest = hashlib.sha256(b"".join(full[k].numpy().tobytes() for k in sorted(full))).hexdigest()
    return {"vs_one_process": max((full[k] - v).abs().max().item() for k, v in reference.items()),
            "digest": digest, "moment": type(moment).__name__, "moment_shape": tuple(moment.shape),
            "shard_shape": tuple(shard.shape), "scales": moment.scale.numel(),
            "steps": opt.state[shard]["step"].item()}
