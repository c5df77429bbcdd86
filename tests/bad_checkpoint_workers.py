"""What each rank runs in tests/test_checkpoint_files.py's bad-checkpoint test: checkpoints that must
not load, each refused on every rank alike with the model and the optimizer state unchanged, and
a good one that loads exactly. zero1 or fsdp; the model's head has one output row, so that under
fsdp one rank holds none of it (a parameter with fewer rows than ranks)."""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import optpass
from sharded_training import compiled_step, sharded_model


def _trained(kind: str, width: int = 16, extra_layer: bool = False, optimizer: str = "AdamW"):
    """A model and its optimizer after 2 compiled steps (the same batches for every model)."""
    model = sharded_model(kind, width, extra_layer)
    opt = (torch.optim.AdamW(model.parameters(), lr=0.01) if optimizer == "AdamW"
           else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    step = compiled_step(model, opt, kind)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        step(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g))
    return model, opt, step


def _state(model, opt) -> list[torch.Tensor]:
    """Everything a load may write into on this rank: the parameters and the optimizer's tensors."""
    tensors = [p.detach().clone() for p in model.parameters()]
    holder = opt if opt.state else optpass.zero1.sharded_state(opt).shard_optimizer    # zero1: the shards'
    for p in ([p for group in holder.param_groups for p in group["params"]] if holder is not None else []):
        values = holder.state.get(p, {})
        tensors += [values[k].clone() for k in sorted(values) if isinstance(values[k], torch.Tensor)]
    return tensors


def bad_checkpoints(rank: int, world: int, kind: str, workdir: str) -> dict:
    torch.set_default_dtype(torch.float64)
    places = {name: os.path.join(workdir, name) for name in
              ["good", "wider model", "deeper model", "other optimizer", "foreign", "cut data", "lost data"]}
    for name, build in [("wider model", dict(width=24)), ("deeper model", dict(extra_layer=True)),
                        ("other optimizer", dict(optimizer="SGD"))]:
        torch._dynamo.reset()
        optpass.save_sharded_checkpoint(places[name], *reversed(_trained(kind, **build)[:2]))
    torch._dynamo.reset()
    model, opt, step = _trained(kind)
    optpass.save_sharded_checkpoint(places["good"], opt, model=model)
    saved = _state(model, opt)
    if rank == 0:
        dcp.save({"app": {"weights": torch.ones(3)}}, checkpoint_id=places["foreign"], no_dist=True)
        for name in ["cut data", "lost data"]:
            shutil.copytree(places["good"], places[name])
        data = sorted(f for f in os.listdir(places["good"]) if f.endswith(".distcp"))
        cut = os.path.join(places["cut data"], data[-1])
        with open(cut, "r+b") as f:
            f.truncate(os.path.getsize(cut) - 8)
        os.remove(os.path.join(places["lost data"], data[0]))
    dist.barrier()
    g = torch.Generator().manual_seed(100 + rank)
    step(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g))       # moved on from "good"
    before = _state(model, opt)
    refusals, changed = {}, {}
    for name, where in places.items():
        if name == "good":
            continue
        try:
            optpass.load_sharded_checkpoint(where, opt, model=model)
            refusals[name] = "loaded"
        except optpass.OptpassError as error:
            refusals[name] = str(error)
        changed[name] = max((a - b).abs().max().item() for a, b in zip(_state(model, opt), before))
        dist.barrier()
    optpass.load_sharded_checkpoint(places["good"], opt, model=model)
    loaded = max((a - b).abs().max().item() for a, b in zip(_state(model, opt), saved))
    # a resume whose optimizer is built with other settings trains with the checkpoint's, as torch's
    # load_state_dict does (zero1 once kept the code's betas and weight decay in its shard optimizer)
    other = sharded_model(kind)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5, betas=(0.8, 0.9), weight_decay=0.5)
    other_step = compiled_step(other, other_opt, kind)
    optpass.load_sharded_checkpoint(places["good"], other_opt, model=other)
    batch = torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)
    step(*batch)
    other_step(*batch)
    settings = max((a - b).abs().max().item() for a, b in zip(other.parameters(), model.parameters()))
    try:                                   # an extra that cannot be pickled: refused, the good one kept
        optpass.save_sharded_checkpoint(places["good"], opt, model=model, extra={"f": lambda: 0})
        unpicklable = "saved"
    except optpass.OptpassError as error:
        unpicklable = str(error)
    kept = os.path.exists(os.path.join(places["good"], ".metadata"))
    return {"refusals": refusals, "changed": changed, "good loaded": loaded, "other settings in code": settings,
            "unpicklable extra": unpicklable, "good kept": kept}
