"""What each rank runs in tests/test_several_optimizers.py: several optimizers in a data-parallel step.

Every program is ``name(rank, world) -> dict`` and catches its own errors (``error`` holds the type
and message), so one process group runs them all (``run_all``). The reference trains the same model
on the whole batch in one process, eagerly (float64: AdamW's compiled bias corrections round like
eager's).
"""

from __future__ import annotations

import copy
import traceback

import torch
import torch.distributed as dist

import optpass

from fsdp_workers import batch, mine, mlp, worst

STEPS = 5


def run_all(rank: int, world: int, names: list[str]) -> dict:
    results = {}
    for name in names:
        torch._dynamo.reset()
        torch.set_default_dtype(torch.float64)
        try:
            results[name] = globals()[name](rank, world)
        except Exception as error:  # noqa: BLE001  (the test reads it)
            results[name] = {"error": (type(error).__name__, str(error), traceback.format_exc())}
        dist.barrier()
    return results


def two_optimizers(model, first: str):
    """The hidden 13x13 matrix to `first` (Muon or SGD), every other parameter to AdamW."""
    hidden = [p for name, p in model.named_parameters() if name == "2.weight"]    # a shard after fully_shard
    rest = [p for name, p in model.named_parameters() if name != "2.weight"]
    made = (torch.optim.Muon(hidden, lr=0.02, momentum=0.95) if first == "muon"
            else torch.optim.SGD(hidden, lr=0.05, momentum=0.9))
    return made, torch.optim.AdamW(rest, lr=0.01, weight_decay=0.1)


def step_of(model, first, second):
    def train_step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        out = loss.detach()
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
        return out
    return train_step


def _train(rank, world, first: str, data_parallel: str, listed: bool, **options):
    model = mlp()
    reference = copy.deepcopy(model)
    if data_parallel == "fsdp":
        optpass.fully_shard(model)
    opts, ref_opts = two_optimizers(model, first), two_optimizers(reference, first)
    optimizer = list(opts) if listed else opts[1]
    step = torch.compile(step_of(model, *opts), backend="optpass", options={
        "optimizer": optimizer, "data_parallel": data_parallel, "lower": "eager", **options})
    reference_step = step_of(reference, *ref_opts)
    for i in range(STEPS):
        x, y = batch(i, world)
        step(mine(x, rank, world), mine(y, rank, world))
        reference_step(x, y)
    full = optpass.full_state_dict(model) if data_parallel == "fsdp" else model.state_dict()
    return {"vs_one_process": worst(full, reference)}


def fsdp_muon_beside_adamw(rank, world):
    """The user's program: AdamW in options, Muon over the hidden matrix stepped beside it."""
    return _train(rank, world, "muon", "fsdp", listed=False)


def fsdp_sgd_beside_adamw(rank, world):
    """An elementwise optimizer that is not in options is refused too: optpass does not check it."""
    return _train(rank, world, "sgd", "fsdp", listed=False)


def zero1_muon_beside_adamw(rank, world):
    return _train(rank, world, "muon", "zero1", listed=False)


def fsdp_list_of_sgd_and_adamw(rank, world):
    return _train(rank, world, "sgd", "fsdp", listed=True)


def fsdp_list_of_sgd_and_adamw_in_backward(rank, world):
    return _train(rank, world, "sgd", "fsdp", listed=True, optimizer_in_backward=True)


def fsdp_list_of_muon_and_adamw(rank, world):
    return _train(rank, world, "muon", "fsdp", listed=True)


def zero1_list_of_sgd_and_adamw(rank, world):
    return _train(rank, world, "sgd", "zero1", listed=True)
