"""What each rank runs in tests/test_ranks_start_alike.py: every rank starts from rank 0's model, and
ranks that disagree fail alike, however fast the others exit.

``run_all`` runs several programs in one process group, each catching its own error. Seeds differ per
rank where a DDP user relies on DDP's broadcast from rank 0.
"""

from __future__ import annotations

import copy
import datetime
import gc
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import optpass
from fsdp_workers import make_step
from optpass.zero1 import agreement

PER_RANK = 3


def run_all(rank: int, world: int, names: list[str]) -> dict:
    results = {}
    for name in names:
        torch._dynamo.reset()
        try:
            results[name] = globals()[name](rank, world)
        except Exception as error:  # noqa: BLE001  (the test reads it)
            results[name] = {"error": (type(error).__name__, str(error), traceback.format_exc())}
        print(f"rank {rank}: {name}: {str(results[name])[:300]}", flush=True)
        dist.barrier()
    return results


def batch(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(PER_RANK * world, 6, generator=g), torch.randn(PER_RANK * world, 1, generator=g)
    return x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]


# ------------------------------------------------------------------ buffers the step does not read

class WithEvalOnlyState(nn.Module):
    """A BatchNorm the step reads and writes; a buffer and a frozen layer read only in evaluation;
    a non-persistent buffer read by nothing. Every one of them random per rank (seed = rank)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
        self.eval_head = nn.Linear(8, 1).requires_grad_(False)
        self.register_buffer("eval_scale", torch.randn(8))
        self.register_buffer("unread", torch.randn(3), persistent=False)
        with torch.no_grad():
            self.body[1].running_mean.normal_()

    def forward(self, x):
        if self.training:
            return self.body(x)
        return self.eval_head(torch.tanh(self.body[:3](x)) * self.eval_scale)


def _differs_from_rank_zero(module: nn.Module) -> dict[str, float]:
    """Per parameter and buffer: how far this rank's value is from rank 0's."""
    found = {}
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        theirs = tensor.detach().clone()
        dist.broadcast(theirs, 0)
        found[name] = (tensor.detach() - theirs).abs().max().item()
    return found


def _against_ddp(data_parallel: str) -> dict:
    """One step of optpass (zero1 or fsdp) beside DDP from the same per-rank random model: every buffer,
    read by the step or not, and every parameter are rank 0's, and evaluation equals DDP's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = WithEvalOnlyState()
    reference = copy.deepcopy(model)
    before = _differs_from_rank_zero(model)
    if data_parallel == "fsdp":
        optpass.fully_shard(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ddp = DistributedDataParallel(reference)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    step = torch.compile(make_step(model, opt), backend="optpass",
                         options={"optimizer": opt, "data_parallel": data_parallel, "lower": "eager"})
    for i in range(2):
        step(*batch(i, rank, world))
        make_step(ddp, ref_opt)(*batch(i, rank, world))
    model.eval()
    reference.eval()
    x, _ = batch(9, rank, world)
    with torch.no_grad():
        evaluated, expected = model(x), reference(x)
    buffers = dict(model.named_buffers())
    return {"before": {n: before[n] for n in buffers},
            "after": {n: d for n, d in _differs_from_rank_zero(model).items() if n in buffers},
            "vs_ddp": {n: (b - dict(reference.named_buffers())[n]).abs().max().item() for n, b in buffers.items()},
            "eval_vs_ddp": (evaluated - expected).abs().max().item()}


def zero1_buffers(rank, world):
    return _against_ddp("zero1")


def fsdp_buffers(rank, world):
    return _against_ddp("fsdp")


# ------------------------------------------------------------------ a model on the meta device

def _mlp():
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))


def meta_model_materialized(rank, world):
    """Materialized before sharding: to_empty, initialize, fully_shard. Trained 3 steps with fsdp, it
    equals one process on the whole batch from rank 0's initialization."""
    torch.manual_seed(rank)                     # only rank 0's initialization counts
    with torch.device("meta"):
        model = _mlp()
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    torch.manual_seed(0)
    reference = _mlp()
    if rank == 0:
        reference.load_state_dict(model.state_dict())
    for p in reference.parameters():
        dist.broadcast(p.data, 0)
    optpass.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=torch.tensor(0.01))
    step = torch.compile(make_step(model, opt), backend="optpass",
                         options={"optimizer": opt, "data_parallel": "fsdp", "lower": "eager"})
    for i in range(3):
        step(*batch(i, rank, world))
        whole = [torch.cat(parts) for parts in zip(*(batch(i, r, world) for r in range(world)))]
        make_step(reference, ref_opt)(*whole)
    full = optpass.full_state_dict(model)
    return {"vs_one_process": max((full[n] - v).abs().max().item() for n, v in reference.state_dict().items())}


# ------------------------------------------------------------------ ranks that disagree, then exit

def _lr_differs(rank) -> list:
    return [("param group 0 'lr'", repr(0.05 * (rank + 1)))]


def disagree_and_lose_the_store(rank, world, runs: int) -> list:
    """``runs`` agreements on an lr that differs, each over a store of its own that rank 0 hosts and
    drops as soon as its agreement raised (as when rank 0's program exits on the error), while rank 1
    reads the store slowly: each rank's error, per run."""
    errors = []
    default = agreement._store
    slow = agreement._POLL_S * 15
    for _ in range(runs):
        host = (dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=30)) if rank == 0 else None)
        port = [host.port if host is not None else None]
        dist.broadcast_object_list(port, 0)
        store = host if host is not None else dist.TCPStore("127.0.0.1", port[0], world, is_master=False,
                                                            timeout=datetime.timedelta(seconds=30))
        agreement._store = lambda: store
        agreement._POLL_S = slow if rank == 1 else slow / 15
        if rank == 0:
            time.sleep(slow / 2)          # rank 1 posts first, then sleeps: rank 0 reads everything first
        try:
            agreement.agree(dist.group.WORLD, "zero1", _lr_differs(rank))
            errors.append(None)
        except Exception as error:  # noqa: BLE001  (the test reads it)
            errors.append((type(error).__name__, str(error).splitlines()[0]))
        finally:
            agreement._store, agreement._POLL_S = default, slow / 15
            del store, host
            gc.collect()                  # rank 0: the store's server stops here
        dist.barrier()
    return errors


def disagree(rank, world, runs: int) -> dict:
    """``disagree_and_lose_the_store``, then ``disagree_then_exit`` (last: rank 0's process exits)."""
    return {"runs": disagree_and_lose_the_store(rank, world, runs), "exit": disagree_then_exit(rank, world)}


def disagree_then_exit(rank, world):
    """A zero1 step compiled with another lr on each rank: rank 0 compiles once rank 1 waits in the
    agreement, and its process exits as soon as it raised; rank 1 reads the store every 2 s."""
    if rank == 1:
        agreement._POLL_S = 2.0
    else:                   # rank 1 is waiting in the agreement when rank 0 reaches it
        key = f"{agreement._PREFIX}/{dist.group.WORLD.group_name}/{agreement._started}/1"
        dist.distributed_c10d._get_default_store().wait([key])
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05 * (rank + 1)))
    step = torch.compile(make_step(model, opt), backend="optpass",
                         options={"optimizer": opt, "data_parallel": "zero1", "lower": "eager"})
    try:
        step(*batch(0, rank, world))
    except Exception as error:  # noqa: BLE001  (the test reads it)
        return (type(error).__name__, str(error).splitlines()[0])
    return None
