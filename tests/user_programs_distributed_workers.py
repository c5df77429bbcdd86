"""What each rank runs in tests/test_user_programs_distributed.py: the programs a data-parallel user
writes, each beside what they would use instead (DDP, eager) on the same seeds.

Every program is ``name(rank, world) -> dict`` and catches its own errors (``error`` holds the type
and message), so that one process group runs them all (``run_all``) and a refusal on one program
leaves the group usable for the next.
"""

from __future__ import annotations

import datetime
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import optpass
import optpass.zero1.agreement

STEPS = 6
PER_RANK = 4


def run_all(rank: int, world: int, names: list[str]) -> dict:
    results = {}
    for name in names:
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = globals()[name](rank, world)
            except Exception as error:  # noqa: BLE001  (the test reads it)
                result = {"error": (type(error).__name__, str(error), traceback.format_exc())}
        print(f"rank {rank}: {name}: {str(result)[:300]}", flush=True)
        result["warnings"] = [str(w.message) for w in caught if "torch.jit" not in str(w.message)]
        results[name] = result
        dist.barrier()
    return results


def batch(step: int, rank: int, world: int, features: int = 6, classes: int | None = None):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(PER_RANK * world, features, generator=g)
    y = (torch.randint(0, classes, (PER_RANK * world,), generator=g) if classes
         else torch.randn(PER_RANK * world, 1, generator=g))
    return x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]


def make_step(model, opt, loss_fn):
    def train_step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    return train_step


def ddp_run(model, opt, loss_fn, rank, world, steps=STEPS, **ddp_kwargs):
    ddp = DistributedDataParallel(model, **ddp_kwargs)
    for i in range(steps):
        x, y = batch(i, rank, world)
        loss_fn(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


def optpass_run(model, opt, loss_fn, rank, world, steps=STEPS, **options):
    step = torch.compile(make_step(model, opt, loss_fn), backend="optpass",
                         options={"optimizer": opt, "data_parallel": "zero1", **options})
    for i in range(steps):
        step(*batch(i, rank, world))
    return model


def worst(a: nn.Module, b: nn.Module) -> float:
    tensors = list(zip(a.parameters(), b.parameters())) + list(zip(a.buffers(), b.buffers()))
    return max((x.double() - y.double()).abs().max().item() for x, y in tensors)


def spread(module: nn.Module) -> float:
    """How far the ranks' parameters and buffers are apart (0: every rank holds the same)."""
    flat = torch.cat([t.detach().double().reshape(-1) for t in (*module.parameters(), *module.buffers())])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, dist.ReduceOp.MIN)
    dist.all_reduce(hi, dist.ReduceOp.MAX)
    return (hi - lo).abs().max().item()


def twins(make_model, seed: int, lr: float):
    """Two equal models (``seed`` may differ per rank), each with SGD + momentum over its trainable
    parameters: one for optpass, one for DDP."""
    pairs = []
    for _ in range(2):
        torch.manual_seed(seed)
        model = make_model()
        pairs.append((model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                             lr=lr, momentum=0.9)))
    return pairs


def against_ddp(make_model, seed: int, lr: float) -> dict:
    """zero1 (update after backward, and in backward) beside DDP, each from fresh twins."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for in_backward in (False, True):
        (model, opt), (reference, ref_opt) = twins(make_model, seed, lr)
        torch._dynamo.reset()
        optpass_run(model, opt, F.mse_loss, rank, world, optimizer_in_backward=in_backward)
        ddp_run(reference, ref_opt, F.mse_loss, rank, world)
        results[in_backward] = {"vs_ddp": worst(model, reference), "spread": spread(model)}
    return results


# ------------------------------------------------------------------ frozen parameters and buffers

class WithFrozenAndBuffer(nn.Module):
    """A frozen first layer and a buffer the forward reads, both random per rank (seed = rank)."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(6, 8).requires_grad_(False)
        self.head = nn.Linear(8, 1)
        self.register_buffer("offset", torch.randn(8))

    def forward(self, x):
        return self.head(torch.tanh(self.frozen(x) + self.offset))


def frozen_and_buffers(rank, world):
    return against_ddp(WithFrozenAndBuffer, seed=rank, lr=0.1)   # DDP users rely on its broadcast


# ------------------------------------------------------------------ BatchNorm in train mode

def batchnorm_model():
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


def batchnorm(rank, world):
    # SGD: Adam would blow the rounding noise of the first Linear's bias (its gradient is 0 before a
    # BatchNorm) up to lr per step on both sides. DDP's default broadcast_buffers=True.
    return against_ddp(batchnorm_model, seed=0, lr=0.05)


def batchnorm_accumulation(rank, world):
    """Two micro-steps per update: DDP broadcasts rank 0's buffers before every forward, no_sync too."""
    (model, opt), (reference, ref_opt) = twins(batchnorm_model, seed=0, lr=0.05)
    options = {"optimizer": opt, "data_parallel": "zero1"}

    def micro_step(x, y):
        loss = F.mse_loss(model(x), y) / 2
        loss.backward()
        return loss.detach()

    micro = torch.compile(micro_step, backend="optpass", options=options)
    step = torch.compile(make_step(model, opt, lambda out, y: F.mse_loss(out, y) / 2), backend="optpass",
                         options=options)
    ddp = DistributedDataParallel(reference)
    for i in range(STEPS):
        x, y = batch(i, rank, world)
        if i % 2 == 0:
            micro(x, y)
            with ddp.no_sync():
                (F.mse_loss(ddp(x), y) / 2).backward()
        else:
            step(x, y)
            (F.mse_loss(ddp(x), y) / 2).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    return {"vs_ddp": worst(model, reference)}


# ------------------------------------------------------------------ an optimizer over part of the model

def optimizer_over_part(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)     # model[0] stays trainable
    optpass_run(model, opt, F.mse_loss, rank, world, steps=1)
    grad = model[0].weight.grad
    return {"grad_spread": spread(nn.ParameterList([nn.Parameter(grad)])) if grad is not None else None}


# ------------------------------------------------------------------ options that differ across ranks

def _mlp_and_opt(lr=0.05):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def clip_on_rank_zero_only(rank, world):
    model, opt = _mlp_and_opt()
    optpass_run(model, opt, F.mse_loss, rank, world, steps=2, **({"clip_grad_norm": 1.0} if rank == 0 else {}))
    return {}


def in_backward_on_rank_zero_only(rank, world):
    model, opt = _mlp_and_opt()
    optpass_run(model, opt, F.mse_loss, rank, world, steps=2, optimizer_in_backward=rank == 0)
    return {}


def lr_tensor_differs(rank, world):
    model, opt = _mlp_and_opt(lr=torch.tensor(0.05 * (rank + 1)))
    optpass_run(model, opt, F.mse_loss, rank, world, steps=2)
    return {}


def grad_scaler_on_rank_zero_only(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    options = {"master_weights": torch.float32}
    if rank == 0:
        options["grad_scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)

    def loss_fn(out, y):
        return F.mse_loss(out.float(), y)

    step = torch.compile(make_step(model, opt, loss_fn), backend="optpass",
                         options={"optimizer": opt, "data_parallel": "zero1", **options})
    for i in range(2):
        x, y = batch(i, rank, world)
        step(x.half(), y)
    return {}


def data_parallel_on_rank_zero_only(rank, world):
    optpass.zero1.agreement.UNDISTRIBUTED_GRACE_S = 3.0      # not a minute: the test waits for it
    model, opt = _mlp_and_opt()
    options = {"optimizer": opt, **({"data_parallel": "zero1"} if rank == 0 else {})}
    step = torch.compile(make_step(model, opt, F.mse_loss), backend="optpass", options=options)
    for i in range(2):
        step(*batch(i, rank, world))
    return {}


def refusal_on_rank_one_only(rank, world):
    """Rank 1's step clips inside the step (refused under zero1 at its compile); rank 0's does not."""
    model, opt = _mlp_and_opt()

    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if rank == 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    step = torch.compile(train_step, backend="optpass", options={"optimizer": opt, "data_parallel": "zero1"})
    step(*batch(0, rank, world))
    return {}


# ------------------------------------------------------------------ evaluation, uneven calls

def evaluation_without_no_grad(rank, world):
    model, opt = _mlp_and_opt()
    options = {"optimizer": opt, "data_parallel": "zero1"}
    train = torch.compile(make_step(model, opt, F.mse_loss), backend="optpass", options=options)
    train(*batch(0, rank, world))

    def evaluate(x, y):
        return F.mse_loss(model(x), y)

    x, y = batch(1, rank, world)
    got = torch.compile(evaluate, backend="optpass", options=options)(x, y)
    expected = evaluate(x, y)
    return {"diff": (got - expected).abs().item(), "value": expected.abs().item()}


def ddp_model_compiled_with_optpass(rank, world):
    """A DDP user who only swaps the backend: DDP's all-reduce runs in autograd hooks, so backward must
    run from eager autograd (trains as DDP, warned); a fused update cannot be had (refused, naming DDP)."""
    results = {}
    for options in ({}, {"optimizer": None}):
        torch.manual_seed(rank)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        torch.manual_seed(rank)
        reference = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        ddp = DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        if "optimizer" in options:
            options = {"optimizer": opt, "optimizer_in_backward": True}
        torch._dynamo.reset()
        step = torch.compile(make_step(ddp, opt, F.mse_loss), backend="optpass", options=options)
        try:
            for i in range(3):
                step(*batch(i, rank, world))
        except optpass.OptpassError as error:
            results[str(sorted(options))] = {"error": str(error)}
            continue
        ddp_run(reference, ref_opt, F.mse_loss, rank, world, steps=3)
        results[str(sorted(options))] = {"vs_ddp": worst(model, reference), "spread": spread(model)}
    return results


def torch_fsdp2_model(rank, world):
    """A model sharded by torch's FSDP2 (fully_shard per Linear, then the root), float64, compiled with
    backend="eager" in this process that imported optpass, with backend="optpass", and with a fused
    update: each beside one eager process on the whole batch (relative difference), or its refusal."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    results = {}
    mesh = init_device_mesh("cpu", (world,))
    for backend, options in (("eager", None), ("optpass", None), ("optpass", "fused")):
        torch._dynamo.reset()
        torch.set_default_dtype(torch.float64)
        try:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
            reference = copy.deepcopy(model)
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
            compile_options = {"options": {"optimizer": opt, "optimizer_in_backward": True}} if options else {}
            step = torch.compile(make_step(model, opt, F.mse_loss), backend=backend, **compile_options)
            reference_step = make_step(reference, ref_opt, F.mse_loss)
            name = backend + (f"+{options}" if options else "")
            try:
                for i in range(4):
                    x, y = batch(i, rank, world)
                    step(x.double(), y.double())
                    whole = [torch.cat(_gathered(t)) for t in batch(i, rank, world)]
                    reference_step(whole[0].double(), whole[1].double())
            except optpass.OptpassError as error:
                results[name] = {"error": str(error)}
                continue
            full = {k: v.full_tensor() for k, v in model.state_dict().items()}
            results[name] = {"relative": max(((full[k] - v).abs().max() / v.abs().max()).item()
                                             for k, v in reference.state_dict().items())}
        finally:
            torch.set_default_dtype(torch.float32)
    return results


def checkpointed_blocks_under_fsdp(rank, world):
    """torch.utils.checkpoint around each block of a model sharded per block (torchtitan's habit),
    float64, the update in backward, both lowerings: equal to one eager process (with the same
    checkpointing) on the whole batch."""
    import copy

    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3))
            self.head = nn.Linear(6, 1)

        def forward(self, x):
            for block in self.blocks:
                x = x + checkpoint(block, x, use_reentrant=False)
            return self.head(x)

    results = {}
    torch.set_default_dtype(torch.float64)
    try:
        for lower in ("eager", "inductor"):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = Checkpointed()
            reference = copy.deepcopy(model)
            for block in model.blocks:
                optpass.fully_shard(block)
            optpass.fully_shard(model)
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
            step = torch.compile(make_step(model, opt, F.mse_loss), backend="optpass",
                                 options={"optimizer": opt, "data_parallel": "fsdp", "optimizer_in_backward": True,
                                          "lower": lower})
            for i in range(3):
                x, y = batch(i, rank, world)
                step(x.double(), y.double())
                whole = [torch.cat(_gathered(t)).double() for t in (x, y)]
                make_step(reference, ref_opt, F.mse_loss)(*whole)
            full = optpass.full_state_dict(model)
            results[lower] = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    finally:
        torch.set_default_dtype(torch.float32)
    return results


def fsdp2_mixed_precision_policy(rank, world):
    """FSDP2's MixedPrecisionPolicy (bf16 gathers and compute, fp32 reduce, fp32 shards and state) on a
    small language model sharded per block with optpass.fully_shard, the update in backward, SGD (its
    parameters follow the gradients linearly, so the bf16 arithmetic shows): relative difference from
    torch's FSDP2 with the same policy, eagerly, and from the same model all in fp32 (FSDP2 without a
    policy); an MLP taking float inputs, output_dtype fp32: the output's dtype and its difference from
    FSDP2; the refused spellings (2-D mesh, CPU offload)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    mesh = init_device_mesh("cpu", (world,))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def language_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(64, 32), nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)),
                             nn.LayerNorm(32), nn.Linear(32, 64))

    def tokens(i):
        g = torch.Generator().manual_seed(100 * i + rank)
        return torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g)

    def lm_loss(logits, y):
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def train(shard, policy, lower=None):
        torch._dynamo.reset()
        model = language_model()
        shard(model[1], mesh=mesh, **policy)
        shard(model, mesh=mesh, **policy)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        step = make_step(model, opt, lm_loss)
        if lower:
            step = torch.compile(step, backend="optpass", options={
                "optimizer": opt, "optimizer_in_backward": True, "data_parallel": "fsdp", "lower": lower})
        for i in range(4):
            step(*tokens(i))
        dtypes = {str(p.dtype) for p in model.parameters()}
        with torch.no_grad():
            gathered = str(model[3].weight.dtype)          # a read outside the step gathers it
        return {k: v.full_tensor() for k, v in model.state_dict().items()}, dtypes, gathered

    def relative(a, b):
        return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)

    reference, _, _ = train(fsdp2_fully_shard, {"mp_policy": bf16})
    fp32, _, _ = train(fsdp2_fully_shard, {})
    results = {"fp32_vs_fsdp2": relative(fp32, reference)}
    for lower in ("eager", "inductor"):
        params, dtypes, gathered = train(optpass.fully_shard, {"mp_policy": bf16}, lower)
        results[lower] = {"vs_fsdp2": relative(params, reference), "shard_dtypes": sorted(dtypes),
                          "gathered": gathered}

    # float inputs cast to bf16, outputs to fp32 (cast_forward_inputs, output_dtype)
    outputs = {}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    for name, shard in (("fsdp2", fsdp2_fully_shard), ("optpass", optpass.fully_shard)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = shard(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)), mesh=mesh, mp_policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = make_step(model, opt, F.mse_loss)
        if name == "optpass":
            step = torch.compile(step, backend="optpass", options={
                "optimizer": opt, "optimizer_in_backward": True, "data_parallel": "fsdp", "lower": "eager"})
        for i in range(3):
            step(*batch(i, rank, world))
        with torch.no_grad():
            out = model(batch(0, rank, world)[0])
        outputs[name] = ({k: v.full_tensor() for k, v in model.state_dict().items()}, str(out.dtype))
    results["mlp"] = {"vs_fsdp2": relative(outputs["optpass"][0], outputs["fsdp2"][0]),
                      "output_dtype": outputs["optpass"][1]}

    refusals = {}
    for name, kwargs in (("cpu_offload", {"offload_policy": CPUOffloadPolicy()}),
                         ("mesh_2d", {"mesh": init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))}),
                         ("not_a_policy", {"mp_policy": torch.bfloat16})):
        try:
            optpass.fully_shard(nn.Linear(2, 2), **kwargs)
            refusals[name] = None
        except optpass.OptpassError as error:
            refusals[name] = str(error)
    torch.manual_seed(0)
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    fsdp2_fully_shard(mixed[0], mesh=mesh)
    try:
        optpass.fully_shard(mixed, mesh=mesh)
        refusals["torch_fsdp2_blocks"] = None
    except optpass.OptpassError as error:
        refusals["torch_fsdp2_blocks"] = str(error)
    results["refusals"] = refusals
    return results


def writes_into_parameters_outside_the_step(rank, world):
    """After two fsdp steps, the writes a user makes into parameters under no_grad, through the
    module (fill_, nn.init, copy_, .data[i].zero_(), an index, .detach()), with and without a bf16
    MixedPrecisionPolicy: the full state dict afterwards against the one before with the same writes
    applied to it; the dtype of a parameter read outside the forward (fp32: FSDP2's parameters are
    fp32 between forwards); a read kept across a step (it must not put its stale values back), and
    a write into it after the step (lost, with a warning)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    results = {}
    for name, policy in (("fp32", None), ("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                      reduce_dtype=torch.float32))):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = optpass.fully_shard(nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 1)), mp_policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = torch.compile(make_step(model, opt, F.mse_loss), backend="optpass", options={
            "optimizer": opt, "optimizer_in_backward": True, "data_parallel": "fsdp", "lower": "eager"})
        for i in range(2):
            step(*batch(i, rank, world))
        expected = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        row = torch.linspace(-1, 1, 6)
        with torch.no_grad():
            model[2].bias.fill_(0.1)
            torch.nn.init.ones_(model[2].weight)
            model[0].bias.copy_(torch.linspace(-1, 1, 7))
            model[0].weight.data[0].zero_()            # the read dies before these writes run
            model[0].weight.data[6, 1] = 3.3
            model[0].weight[5] = row
            model[0].weight.detach()[4].fill_(0.5)
            read_dtype = str(model[0].weight.dtype)
        for key, write in (("2.bias", lambda t: t.fill_(0.1)), ("2.weight", lambda t: t.fill_(1.0)),
                           ("0.bias", lambda t: t.copy_(torch.linspace(-1, 1, 7))),
                           ("0.weight", lambda t: (t[0].zero_(), t[6].__setitem__(1, 3.3), t[5].copy_(row),
                                                   t[4].fill_(0.5)))):
            write(expected[key])
        got = {k: v.full_tensor() for k, v in model.state_dict().items()}
        result = {"max_diff": max((got[k] - expected[k]).abs().max().item() for k in expected),
                  "read_dtype": read_dtype}

        with torch.no_grad():                          # writes through a read still held, then a fresh read
            held = model[0].weight
            held[2] = 5.0
            result["fresh_read_sees_held_write"] = bool((model[0].weight[2] == 5.0).all())
            model[0].weight[3] = 7.0
            del held
            both = model.state_dict()["0.weight"].full_tensor()
            result["both_writes_kept"] = bool((both[2] == 5.0).all() and (both[3] == 7.0).all())
            held = model[2].bias
            held.fill_(0.5)
            x = batch(0, rank, world)[0]
            out = model(x)
            expected_out = torch.tanh(x @ both.t() + model[0].bias) @ model[2].weight.t() + 0.5
            result["forward_sees_held_write"] = (out.float() - expected_out.float()).abs().max().item()
            del held, out
        with torch.no_grad():
            kept = model[0].weight                     # held across a step, never written
        step(*batch(2, rank, world))
        trained = model.state_dict()["0.weight"].full_tensor().clone()
        del kept
        result["stale_read_put_back"] = bool((model.state_dict()["0.weight"].full_tensor() != trained).any())
        with torch.no_grad():
            kept = model[0].bias
        step(*batch(3, rank, world))
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kept.fill_(9.0)
            del kept
            model.state_dict()
        result["stale_write_warned"] = [str(w.message) for w in caught if "optpass" in str(w.message)]
        result["stale_write_applied"] = bool((model.state_dict()["0.bias"].full_tensor() == 9.0).any())
        step(*batch(4, rank, world))          # trains on
        result["trains_on"] = bool(torch.isfinite(model.state_dict()["0.weight"].full_tensor()).all())
        results[name] = result
    return results


def _gathered(tensor):
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return parts


def one_rank_calls_the_step_once_more(rank, world):
    """Rank 1 has one batch more than rank 0: its last call waits alone."""
    model, opt = _mlp_and_opt()
    step = torch.compile(make_step(model, opt, F.mse_loss), backend="optpass",
                         options={"optimizer": opt, "data_parallel": "zero1"})
    for i in range(2 + rank):
        step(*batch(i, rank, world))
    if rank == 0:       # goes on to something else (evaluation, saving) while rank 1 waits
        dist.distributed_c10d._get_default_store().wait(["optpass/agreement/failed/1"], datetime.timedelta(seconds=120))
    return {}


def unused_head(rank, world):
    """Two heads, one used (what DDP needs find_unused_parameters=True for)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Linear(6, 8), "a": nn.Linear(8, 1), "b": nn.Linear(8, 1)})
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = torch.compile(make_step(lambda x: model["a"](torch.tanh(model["body"](x))), opt, F.mse_loss),
                         backend="optpass", options={"optimizer": opt, "data_parallel": "zero1"})
    step(*batch(0, rank, world))
    return {}


def explain_a_zero1_step(rank, world):
    model, opt = _mlp_and_opt()
    text = str(optpass.explain(make_step(model, opt, F.mse_loss), *batch(0, rank, world),
                               options={"optimizer": opt, "data_parallel": "zero1"}))
    return {"shard_optimizer": [line.strip() for line in text.splitlines() if "pass shard_optimizer" in line]}
