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


def odd_blocks_mlp() -> torch.nn.Module:
    """Weights of 24, 24 and 17 blocks of 256 (quantized by torchao, 65 blocks in all: split evenly
    over 2 ranks without regard to blocks, the chunks would meet inside a block) and a head of 680
    elements (kept fp32 by torchao)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 68), torch.nn.ReLU(), torch.nn.Linear(68, 10))


def odd_blocks_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(STEPS)]


def one_process(optimizer_class: str):
    """``odd_blocks_mlp`` and its optimizer after ``STEPS`` steps of one process on the whole batch, fused in backward."""
    import torchao.optim

    model = odd_blocks_mlp()
    opt = getattr(torchao.optim, optimizer_class)(model.parameters(), lr=1e-3)
    step = make_step(model, opt)
    for x, y in odd_blocks_batches():
        step(x, y)
    return model, opt


def zero1_low_bit(rank: int, world: int, optimizer_class: str = "AdamW8bit") -> dict:
    """Each rank's rows of each batch under ZeRO-1 with a torchao optimizer, beside one process on the
    whole batch: the parameters, and this rank's quantized moments block for block against the one
    process's moments of the same parameter elements (run in this rank: tensors are not sent back)."""
    import hashlib

    import torchao.optim

    from optpass.zero1 import sharded_state

    model = odd_blocks_mlp()
    opt = getattr(torchao.optim, optimizer_class)(model.parameters(), lr=1e-3)
    step = make_step(model, opt, data_parallel="zero1")
    rows = slice(rank * 16 // world, (rank + 1) * 16 // world)
    for x, y in odd_blocks_batches():
        step(x[rows], y[rows])
    reference_model, reference = one_process(optimizer_class)
    sharded = sharded_state(opt)
    reference_params = list(reference_model.parameters())
    kinds, scale_error, moment_error = [], 0.0, 0.0
    for bucket in sharded.layout.buckets:
        shard = sharded.shards.get(bucket.index)
        if shard is None:
            continue
        mine = sharded.shard_optimizer.state[shard]["exp_avg"]
        kinds.append((type(mine).__name__, sharded.block_of(bucket)))
        block = sharded.block_of(bucket)
        for s in bucket.segments[rank]:
            theirs = reference.state[reference_params[s.param]]["exp_avg"]
            if block is not None:
                ours = mine.scale[s.offset // block:(s.offset + s.numel) // block]
                expected = theirs.scale[s.start // block:s.stop // block]
                # relative to the block's scale, or to a typical one where it is near zero (dead units)
                relative = (ours - expected).abs() / (expected.abs() + expected.abs().median())
                scale_error = max(scale_error, relative.max().item())
                moment_error = max(moment_error, (mine[s.offset:s.offset + s.numel].dequantize()
                                                  - theirs.dequantize().reshape(-1)[s.start:s.stop]).abs().max().item())
    state = model.state_dict()
    digest = hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()
    return {"vs_one_process": max((state[k] - v).abs().max().item() for k, v in reference_model.state_dict().items()),
            "digest": digest, "kinds": sorted(set(kinds)), "chunks": [b.chunk for b in sharded.layout.buckets], "scale_relative_error": scale_error,
            "moment_error": moment_error, "state_bytes": sharded.state_bytes(),
            "reference_state_bytes": sum(low_bit_bytes(v) for st in reference.state.values() for v in st.values())}


def low_bit_bytes(value) -> int:
    from optpass.optim.low_bit_states import stored_bytes

    return stored_bytes(value)


def zero1_low_bit_resume(rank: int, world: int, directory: str, optimizer_class: str = "AdamW8bit") -> dict:
    """Three steps under ZeRO-1, a DCP checkpoint, three more; then a new model and optimizer that load
    the checkpoint before their first step and take the same three steps: both runs' parameters and
    this rank's quantized moments, compared bit for bit (in this rank)."""
    import torchao.optim

    from optpass.zero1 import sharded_state

    rows = slice(rank * 16 // world, (rank + 1) * 16 // world)
    data = odd_blocks_batches()

    def run(load: bool):
        model = odd_blocks_mlp()
        opt = getattr(torchao.optim, optimizer_class)(model.parameters(), lr=1e-3)
        if load:
            optpass.load_sharded_checkpoint(directory, opt, model=model)
        step = make_step(model, opt, data_parallel="zero1")
        for i, (x, y) in enumerate(data):
            if load and i < 3:
                continue
            step(x[rows], y[rows])
            if not load and i == 2:
                optpass.save_sharded_checkpoint(directory, opt, model=model)
        sharded = sharded_state(opt)
        moments = [(type(v).__name__, v.codes.clone(), v.scale.clone()) if hasattr(v, "codes") else (type(v).__name__, v.clone())
                   for state in sharded.shard_optimizer.state.values() for _, v in sorted(state.items())]
        return model.state_dict(), moments

    first, first_moments = run(load=False)
    second, second_moments = run(load=True)
    same_moments = len(first_moments) == len(second_moments) and all(
        a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1:], b[1:])) for a, b in zip(first_moments, second_moments))
    return {"parameters_equal": all(torch.equal(first[k], second[k]) for k in first),
            "moments_equal": same_moments, "kinds": sorted({m[0] for m in first_moments})}


def zero1_low_bit_adopts_state(rank: int, world: int) -> dict:
    """Three one-process steps with torchao's AdamW8bit on every rank (the state a run brings to its
    first zero1 step: eager steps, or a torchao state_dict loaded), then the optimizer sharded: this
    rank's moments must be the rows of the one-process moments, codes and scales bit for bit."""
    import torchao.optim

    from optpass.zero1.state import sharded_optimizer

    model = odd_blocks_mlp()
    opt = torchao.optim.AdamW8bit(model.parameters(), lr=1e-3)
    step = make_step(model, opt)
    for x, y in odd_blocks_batches()[:3]:
        step(x, y)
    before = {i: {k: (v.codes.clone(), v.scale.clone()) if hasattr(v, "codes") else v.clone()
                  for k, v in opt.state[p].items()} for i, p in enumerate(model.parameters())}
    sharded = sharded_optimizer(opt)
    equal, quantized = True, 0
    for bucket in sharded.layout.buckets:
        shard = sharded.shards.get(bucket.index)
        if shard is None:
            continue
        state = sharded.shard_optimizer.state[shard]
        equal &= state["step"].item() == 3
        for s in bucket.segments[rank]:
            for key in ("exp_avg", "exp_avg_sq"):
                mine, theirs = state[key], before[s.param][key]
                if hasattr(mine, "codes"):
                    block = sharded.block_of(bucket)
                    quantized += 1
                    equal &= torch.equal(mine.codes[s.offset:s.offset + s.numel], theirs[0].reshape(-1)[s.start:s.stop])
                    equal &= torch.equal(mine.scale[s.offset // block:(s.offset + s.numel) // block],
                                         theirs[1][s.start // block:s.stop // block])
                else:
                    equal &= torch.equal(mine[s.offset:s.offset + s.numel], theirs.reshape(-1)[s.start:s.stop])
    return {"equal": bool(equal), "quantized_pieces": quantized, "user_state_left": len(opt.state)}


def resharded_mlp() -> torch.nn.Module:
    """A weight torchao quantizes on 1, 2 and 3 ranks' shards ([1024, 256]: shards of 512 and 342 rows),
    and two it quantizes on 2 ranks but not on 3: [256, 64] (shards of 128 rows, 8192 elements, and of
    86 rows, 5504, not whole blocks: a row boundary there is no block boundary) and a head [8, 1024]
    (4 rows, 4096 elements, and 3 rows, 3072). Tanh, not ReLU: with ReLU's dead units torchao's 8-bit
    second moment rounds to its zero code where the first does not, and its update m / eps throws the
    runs being compared apart (eager torchao alone moved a weight by 6 in 8 steps: a fresh user)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1024), torch.nn.Tanh(),
                               torch.nn.Linear(1024, 8))


def resharded_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(12, 64, generator=g), torch.randint(0, 8, (12,), generator=g)) for _ in range(STEPS)]


def _full_moments(model, opt) -> dict[str, torch.Tensor]:
    """Every moment of a fully sharded model's torchao state, dequantized, in the parameter's shape
    (gathered from the ranks), and which were quantized on this world."""
    import torch.distributed as dist

    from optpass.fsdp.shard import sharded_parameters
    from optpass.optim.low_bit_states import is_quantized

    full = {}
    for name, p, spec in sharded_parameters(model):
        for key in ("exp_avg", "exp_avg_sq"):
            value = opt.state[p][key]
            rows = (value.dequantize() if is_quantized(value) else value)[:spec.valid].clone()
            pieces = [None] * spec.world
            dist.all_gather_object(pieces, rows)
            full[f"{name}.{key}"] = torch.cat(pieces).reshape(spec.shape)
            full[f"{name}.{key}.quantized"] = is_quantized(value)
    return full


def _save(directory, model, opt, api: str) -> None:
    if api == "optpass":
        optpass.save_sharded_checkpoint(directory, opt, model=model)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)


def _load(directory, model, opt, api: str) -> None:
    if api == "optpass":
        optpass.load_sharded_checkpoint(directory, opt, model=model)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    set_state_dict(model, opt, model_state_dict=model_state, optim_state_dict=optim_state)


def fsdp_low_bit_checkpoint(rank: int, world: int, directory: str, role: str, optimizer_class: str = "AdamW8bit",
                            api: str = "optpass") -> dict:
    """``role="save"``: three steps fully sharded with AdamW8bit in backward, a DCP checkpoint, then three
    more; rank 0 writes the checkpoint's moments (dequantized, whole) and the final parameters beside
    it. ``role="resume"``: a new model and optimizer on this world load the checkpoint, and this rank
    compares the moments they start from and, after the same three steps, the parameters with what the
    saving run wrote. Each rank takes its rows of each batch. ``api="torch"``: saved and loaded with
    torch's ``get_state_dict`` / ``set_state_dict`` and DCP, as torchtitan does."""
    import os

    import torchao.optim

    data = resharded_batches()
    rows = slice(rank * 12 // world, (rank + 1) * 12 // world)
    model = resharded_mlp()
    optpass.fully_shard(model)
    module = torch.optim if optimizer_class == "AdamW" else torchao.optim          # AdamW: torch.optim's
    opt = getattr(module, optimizer_class)(model.parameters(), lr=1e-3)
    if role == "resume":
        _load(directory, model, opt, api)
        loaded = _full_moments(model, opt)
    step = make_step(model, opt, data_parallel="fsdp")
    for i, (x, y) in enumerate(data):
        if role == "resume" and i < 3:
            continue
        step(x[rows], y[rows])
        if role == "save" and i == 2:
            _save(directory, model, opt, api)
            saved = _full_moments(model, opt)
    final = optpass.full_state_dict(model)
    reference_path = os.path.join(directory, "reference.pt")
    if role == "save":
        if rank == 0:
            torch.save({"moments": saved, "parameters": final}, reference_path)
        return {"quantized": sorted(k for k, v in saved.items() if v is True)}
    reference = torch.load(reference_path)
    moment_error = {}
    for key, value in loaded.items():
        if key.endswith(".quantized"):
            continue
        saved_value = reference["moments"][key]
        scale = saved_value.abs().max().item() or 1.0
        moment_error[key] = (value - saved_value).abs().max().item() / scale
    return {"quantized": sorted(k for k, v in loaded.items() if v is True),
            "saved_quantized": sorted(k for k, v in reference["moments"].items() if v is True),
            "moment_error": moment_error,
            "steps": opt.state[next(model.parameters())]["step"].item(),
            "vs_saving_run": max((final[k] - v).abs().max().item() for k, v in reference["parameters"].items())}
