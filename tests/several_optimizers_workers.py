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


def _train(rank, world, first: str, data_parallel: str, listed: bool, keep: bool = False, **options):
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
    result = {"vs_one_process": worst(full, reference)}
    if keep:
        result.update(opts=opts, reference_state=_state_elements(
            state for opt in ref_opts for state in opt.state.values()))
    return result


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
    """Each listed optimizer's state sharded over the ranks: this rank's per-element state, by the
    class of the shard optimizer that holds it (summed over the ranks: one process's state)."""
    result = _train(rank, world, "sgd", "zero1", listed=True, keep=True)
    opts = result.pop("opts")
    sharded = optpass.zero1.sharded_state(list(opts))
    result["state_elements"] = {type(member).__name__: _state_elements(member.state.values())
                                for member in sharded.shard_optimizer.optimizers}
    result["unsharded_state"] = sum(len(opt.state) for opt in opts)     # the users' optimizers hold none
    return result


def zero1_list_of_sgd_and_adamw_in_backward(rank, world):
    return _train(rank, world, "sgd", "zero1", listed=True, optimizer_in_backward=True)


def zero1_list_of_muon_and_adamw(rank, world):
    return _train(rank, world, "muon", "zero1", listed=True)


def zero1_list_with_clip_grad_norm(rank, world):
    """options clip_grad_norm with a list under zero1: the parameters equal one process that calls
    clip_grad_norm_ over all of them, and optpass.grad_norm of either optimizer is what it returned."""
    model = mlp()
    reference = copy.deepcopy(model)
    opts, ref_opts = two_optimizers(model, "sgd"), two_optimizers(reference, "sgd")
    step = torch.compile(step_of(model, *opts), backend="optpass", options={
        "optimizer": list(opts), "data_parallel": "zero1", "clip_grad_norm": 0.05, "lower": "eager"})

    def reference_step(x, y):
        torch.nn.functional.mse_loss(reference(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        for opt in ref_opts:
            opt.step()
            opt.zero_grad()
        return norm

    norms = []
    for i in range(STEPS):
        x, y = batch(i, world)
        step(mine(x, rank, world), mine(y, rank, world))
        expected = reference_step(x, y)
        norms.append((expected.item(), optpass.grad_norm(opts[0]).item(), optpass.grad_norm(opts[1]).item()))
    return {"vs_one_process": worst(model.state_dict(), reference), "norms": norms}


def zero1_list_stepped_in_a_loop(rank, world):
    """modded-nanogpt's `for opt in optimizers: opt.step()`: Dynamo runs the step uncompiled, and each
    compiled step() would update with this rank's gradients: refused on every rank."""
    model = mlp()
    opts = two_optimizers(model, "sgd")

    def train_step(x, y):
        torch.nn.functional.mse_loss(model(x), y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()

    step = torch.compile(train_step, backend="optpass", options={
        "optimizer": list(opts), "data_parallel": "zero1", "lower": "eager"})
    x, y = batch(0, world)
    step(mine(x, rank, world), mine(y, rank, world))
    return {}


def zero1_list_checkpoint_resumes(rank, world):
    """A list under zero1, saved with save_sharded_checkpoint after 2 steps, loaded into fresh
    optimizers (the model's parameters from its state_dict, as a user keeps them), then 2 steps:
    equal to 4 uninterrupted steps. The same with a fully sharded model is refused."""
    import tempfile

    path = [tempfile.mkdtemp(prefix="optpass-list-ckpt-") if rank == 0 else None]
    dist.broadcast_object_list(path)
    runs = {}
    for resumed in (False, True):
        torch._dynamo.reset()
        model = mlp()
        opts = list(two_optimizers(model, "sgd"))
        step = torch.compile(step_of(model, *opts), backend="optpass",
                             options={"optimizer": opts, "data_parallel": "zero1", "lower": "eager"})
        for i in range(2):
            x, y = batch(i, world)
            step(mine(x, rank, world), mine(y, rank, world))
        if resumed:
            optpass.save_sharded_checkpoint(path[0], opts, model=model)
            saved = copy.deepcopy(model.state_dict())
            torch._dynamo.reset()
            model = mlp()
            model.load_state_dict(saved)
            opts = list(two_optimizers(model, "sgd"))
            step = torch.compile(step_of(model, *opts), backend="optpass",
                                 options={"optimizer": opts, "data_parallel": "zero1", "lower": "eager"})
            optpass.load_sharded_checkpoint(path[0], opts, model=model)
        for i in range(2, 4):
            x, y = batch(i, world)
            step(mine(x, rank, world), mine(y, rank, world))
        runs[resumed] = copy.deepcopy(model.state_dict())
    result = {"resumed_vs_uninterrupted": max((runs[True][k] - v).abs().max().item() for k, v in runs[False].items())}
    model = mlp()
    optpass.fully_shard(model)
    try:
        optpass.save_sharded_checkpoint(path[0] + "-fsdp", list(two_optimizers(model, "sgd")), model=model)
    except optpass.OptpassError as error:
        result["fsdp_list"] = str(error)
    return result


def _state_elements(states) -> int:
    return sum(value.numel() for state in states for value in state.values()
               if isinstance(value, torch.Tensor) and value.dim() > 0)
