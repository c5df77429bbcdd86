"""What each rank runs in tests/test_fsdp_state_dict.py: torch's state-dict and DCP APIs on a model
sharded by optpass.fully_shard, as torchtitan's checkpoint manager calls them, beside one process.

The model is tests/fsdp_workers.py's MLP, sharded FSDP2's way (each Linear, then the root), float64,
AdamW; every rank trains on its rows of the same 6-row batches, so a run on 1, 2 or 3 ranks is one
process's run on the whole batch.
"""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import optpass
from fsdp_workers import adamw, batch, make_step, mine, mlp, worst

SAVED_AFTER, TRAINED_TO = 4, 8
FUSED = {"data_parallel": "fsdp", "optimizer_in_backward": True, "lower": "eager"}


def run_all(rank: int, world: int, names: list[str], workdir: str) -> dict:
    results = {}
    for name in names:
        torch._dynamo.reset()
        torch.set_default_dtype(torch.float64)
        try:
            results[name] = globals()[name](rank, world, workdir)
        except Exception as error:  # noqa: BLE001  (the test reads it)
            results[name] = {"error": (type(error).__name__, str(error), traceback.format_exc())}
        finally:
            torch.set_default_dtype(torch.float32)
        print(f"rank {rank}: {name}: {str(results[name])[:300]}", flush=True)
        dist.barrier()
    return results


def _sharded(meta: bool):
    if meta:
        with torch.device("meta"):
            model = mlp()
    else:
        model = mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            optpass.fully_shard(layer)
    optpass.fully_shard(model)
    if meta:
        model.to_empty(device="cpu")         # the checkpoint is its initialization
    return model


def _train(model, opt, rank, world, steps):
    step = torch.compile(make_step(model, opt), backend="optpass", options={"optimizer": opt, **FUSED})
    for i in steps:
        x, y = batch(i, 1, per_rank=6)         # the same 6 rows on every world size
        step(mine(x, rank, world), mine(y, rank, world))


def _one_process(steps: int):
    model = mlp()
    opt = adamw(model)
    for i in range(steps):
        x, y = batch(i, 1, per_rank=6)
        make_step(model, opt)(x, y)
    return model, opt


def save(rank, world, workdir):
    """Train, then torch's get_state_dict + dcp.save; what the state dicts hold, sharded and full."""
    model = _sharded(meta=False)
    opt = adamw(model)
    _train(model, opt, rank, world, range(SAVED_AFTER))
    model_sd, optim_sd = get_state_dict(model, opt)
    reference, reference_opt = _one_process(SAVED_AFTER)
    shapes = {name: (type(v).__name__, tuple(v.shape)) for name, v in model_sd.items()}
    local_rows = {name: tuple(v.to_local().shape) for name, v in model_sd.items() if isinstance(v, DTensor)}
    exp_avg = optim_sd["state"]["0.weight"]["exp_avg"]
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{workdir}/dcp")
    full_model, full_optim = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    reference_exp_avg = reference_opt.state[reference[0].weight]["exp_avg"]
    return {"shapes": shapes, "reference_shapes": {n: tuple(v.shape) for n, v in reference.state_dict().items()},
            "local_rows": local_rows, "exp_avg": (type(exp_avg).__name__, tuple(exp_avg.shape)),
            "full_vs_one_process": worst(full_model, reference),
            "full_exp_avg_vs_one_process": (full_optim["state"]["0.weight"]["exp_avg"] - reference_exp_avg).abs().max().item(),
            "full_step": float(full_optim["state"]["0.weight"]["step"])}


def resume(rank, world, workdir):
    """A fresh meta-built model restored with get_state_dict + dcp.load + set_state_dict (torchtitan's
    order), trained on; and one restored from full state dicts with set_state_dict(full_state_dict=True)."""
    results = {}
    for how in ("dcp", "full"):
        torch._dynamo.reset()
        model = _sharded(meta=True)
        opt = adamw(model)
        if how == "dcp":
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{workdir}/dcp")
            set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        else:
            saved, saved_opt = _one_process(SAVED_AFTER)
            model_sd, optim_sd = get_state_dict(saved, saved_opt)      # one process's: full tensors
            set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                           options=StateDictOptions(full_state_dict=True))
        _train(model, opt, rank, world, range(SAVED_AFTER, TRAINED_TO))
        reference, _ = _one_process(TRAINED_TO)
        results[how] = worst(optpass.full_state_dict(model), reference)
    return results


def model_load_state_dict(rank, world, workdir):
    """Plain torch: a single process's state_dict() into a sharded model, and the sharded model's
    state_dict() (DTensors) into a fresh sharded one, each by load_state_dict."""
    reference, _ = _one_process(2)
    model = _sharded(meta=False)
    model.load_state_dict(reference.state_dict())
    first = worst(optpass.full_state_dict(model), reference)
    other = _sharded(meta=True)
    other.load_state_dict(model.state_dict())
    return {"from_full": first, "from_dtensors": worst(optpass.full_state_dict(other), reference)}
