"""Rank-side programs of tests/test_tensor_parallel.py: a tensor-parallel user's programs on gloo ranks.

Each program builds a Hugging Face Llama (or a small MLP), applies torch's tensor-parallel plan
(``parallelize_module``) on a 1-D mesh of every rank, trains it compiled with ``backend="optpass"``
and compares it with the same program on the whole model in this process, without the plan (one
process), in float64. Each program catches its own error, so a refusal leaves the group usable.
Most programs lower the rewritten graph with ``lower="eager"``: the passes are what they test, and
Inductor's C++ compile of a Llama per program was most of the file's time. The step as written, the
clipped update in backward and the 2-D update in backward lower through Inductor.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

import optpass

STEPS = 3
VOCAB = 64


def run_all(rank: int, world: int, names: list[str]) -> dict:
    results = {}
    for name in names:
        torch._dynamo.reset()
        try:
            results[name] = globals()[name](rank, world)
        except Exception as error:  # noqa: BLE001  (each program reports its own failure)
            results[name] = {"error": (type(error).__name__, str(error), traceback.format_exc())}
    return results


def llama(layers: int = 1, dtype=torch.float64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(dtype)


def llama_plan(model, mesh, sequence_parallel: bool = True, loss_parallel: bool = False):
    """torchtitan's Llama plan on a Hugging Face Llama (``optpass.plans.hugging_face_llama``)."""
    return optpass.plans.hugging_face_llama(model, mesh, sequence_parallel=sequence_parallel,
                                            loss_parallel=loss_parallel)


def tokens(i: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(100 + i))


@functools.lru_cache(maxsize=None)
def mesh_of(world: int):
    """One tensor-parallel mesh per process, as a training program has: every program of a worker
    shares it (a mesh made anew per program makes process groups anew, whose names a compiled
    graph of an earlier program may hold; docs/design.md §64)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))


def train(model, options: dict, steps: int = STEPS, clip_in_step: float | None = None, micro_steps: int = 1,
          loss_parallel: bool = False, cross_entropy: bool = False, optimizer=None) -> tuple[list[float], torch.optim.Optimizer]:
    """The supported step shape, compiled with optpass and `options` (``optimizer`` filled in)."""
    opt = optimizer(model) if optimizer else torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2),
                                                                weight_decay=0.1)
    options = dict(options, optimizer=opt) if options else {}

    def loss_of(ids):
        if not (loss_parallel or cross_entropy):
            return model(input_ids=ids, labels=ids).loss
        logits = model(input_ids=ids).logits          # under loss_parallel: sharded along the vocabulary
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    def step(ids):
        loss = loss_of(ids)
        loss.backward()
        if clip_in_step is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_in_step)
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    def micro_step(ids):
        loss = loss_of(ids) / micro_steps
        loss.backward()
        return loss.detach()

    compiled = torch.compile(step if micro_steps == 1 else micro_step, backend="optpass", options=options)
    from torch.distributed.tensor.parallel import loss_parallel as parallel_loss

    losses = []
    for i in range(steps * micro_steps):
        # loss_parallel() around the compiled call: Dynamo does not trace into the context manager
        with parallel_loss() if loss_parallel else contextlib.nullcontext():
            losses.append(float(compiled(tokens(i))))
    return losses, opt


def full(tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()


def relative(model, reference) -> float:
    """The largest relative difference of any parameter from the one-process model's."""
    ours = dict(model.named_parameters())
    return max(((full(ours[name]).double() - full(p).double()).abs().max() / full(p).double().abs().max()).item()
               for name, p in reference.named_parameters())


def against_one_process(rank, world, options: dict, sequence_parallel=True, make=llama, plan=llama_plan,
                        **train_kwargs) -> dict:
    """The tensor-parallel model and the whole model in this process, the same program, compiled alike."""
    model = make()
    reference = copy.deepcopy(model)
    plan(model, mesh_of(world), sequence_parallel, **({"loss_parallel": True} if train_kwargs.get("loss_parallel")
                                                      else {}))
    losses, opt = train(model, options, **train_kwargs)
    torch._dynamo.reset()
    reference_losses, reference_opt = train(reference, options, **dict(train_kwargs, loss_parallel=False))
    clipped = options.get("clip_grad_norm") is not None
    return {"relative": relative(model, reference), "losses": losses, "reference_losses": reference_losses,
            "grad_norm": float(optpass.grad_norm(opt)) if clipped else None,
            "reference_grad_norm": float(optpass.grad_norm(reference_opt)) if clipped else None,
            "state_types": sorted({type(v).__name__ for s in opt.state.values() for v in s.values()}),
            "grads_none": all(p.grad is None for p in model.parameters())}


# ---------------------------------------------------------------- the programs

def plain_step(rank, world):
    """No options: the step as written (the update after backward), clip_grad_norm_ inside it."""
    return against_one_process(rank, world, {}, clip_in_step=0.5)


def in_backward(rank, world):
    return against_one_process(rank, world, {"optimizer_in_backward": True, "lower": "eager"})


def in_backward_without_sequence_parallel(rank, world):
    return against_one_process(rank, world, {"optimizer_in_backward": True}, sequence_parallel=False)


def in_backward_clipped(rank, world):
    return {lower: against_one_process(rank, world, {"optimizer_in_backward": True, "clip_grad_norm": 0.5,
                                                     "lower": lower})
            for lower in ("eager", "inductor")}


def in_backward_accumulated(rank, world):
    return against_one_process(rank, world, {"optimizer_in_backward": True, "accumulation_steps": 2,
                                             "clip_grad_norm": 0.5, "lower": "eager"}, micro_steps=2)


def in_backward_loss_parallel(rank, world):
    return against_one_process(rank, world, {"optimizer_in_backward": True, "lower": "eager"},
                               loss_parallel=True, cross_entropy=True)


def in_backward_sgd_momentum(rank, world):
    """SGD's first momentum buffer is made from the gradient (state the update creates)."""
    return against_one_process(rank, world, {"optimizer_in_backward": True, "lower": "eager"},
                               optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))


def master_weights_bf16(rank, world):
    """bf16 parameters, fp32 masters of each rank's local shard, the update in backward: against the
    same tensor-parallel model trained eagerly with Megatron's step by hand (fp32 masters as DTensors,
    the bf16 gradient cast to fp32, torch.optim's AdamW on the masters, the parameter rounded from
    its master). One process is not the reference here: its bf16 GEMMs sum in another order, and
    Adam's first step moves an element by lr times the sign of its gradient, which a near-zero bf16
    gradient can flip."""
    model = llama(dtype=torch.bfloat16)
    by_hand = copy.deepcopy(model)
    mesh = mesh_of(world)
    llama_plan(model, mesh)
    llama_plan(by_hand, mesh)
    train(model, {"optimizer_in_backward": True, "master_weights": torch.float32, "lower": "eager"})
    masters = [p.detach().float().requires_grad_() for p in by_hand.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    for i in range(STEPS):
        by_hand(input_ids=tokens(i), labels=tokens(i)).loss.backward()
        for master, p in zip(masters, by_hand.parameters()):
            master.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for master, p in zip(masters, by_hand.parameters()):
                p.copy_(master)
    return {"relative": relative(model, by_hand),
            "dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def muon_on_a_sharded_matrix(rank, world):
    """Muon's Newton-Schulz mixes a matrix's elements: refused on a column-parallel weight."""
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Tanh(), nn.Linear(16, 4, bias=False)).double()
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, mesh_of(world), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.Muon(model.parameters(), lr=0.02)

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    try:
        torch.compile(step, backend="optpass", options={"optimizer": opt, "optimizer_in_backward": True})(
            torch.randn(4, 8, dtype=torch.float64))
    except optpass.OptpassError as error:
        return {"error": ("OptpassError", str(error), "")}
    return {}


def data_parallel_over_a_tensor_parallel_model(rank, world):
    model = llama_plan(llama(layers=1), mesh_of(world))
    try:
        train(model, {"optimizer_in_backward": True, "data_parallel": "zero1"}, steps=1)
    except optpass.OptpassError as error:
        return {"error": ("OptpassError", str(error), "")}
    return {}



class Attention(nn.Module):
    """One SDPA self-attention block over [batch, sequence, width]."""

    def __init__(self, width: int = 16, heads: int = 2):
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(width, 3 * width), nn.Linear(width, width), heads

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, w))


def context_parallel_sdpa(rank, world):
    """torch's context_parallel around an SDPA model: trained equal to one process where torch's CP
    runs, refused naming context parallelism where it does not (CPU: no sharding strategy for SDPA)."""
    from torch.distributed.tensor.experimental import context_parallel

    torch.manual_seed(0)
    model = Attention().double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(2, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    results = {}
    for name, options in (("plain", {}), ("fused", {"optimizer": opt, "optimizer_in_backward": True})):
        torch._dynamo.reset()
        local = x.clone()
        try:
            with context_parallel(mesh_of(world), buffers=[local], buffer_seq_dims=[1]):
                torch.compile(step, backend="optpass", options=options)(local)
            results[name] = {"error": None}
        except Exception as error:  # noqa: BLE001  (torch's own failure is what is reported)
            results[name] = {"error": (type(error).__name__, str(error)[:3000], "".join(getattr(error, "__notes__", []))),
                             "where": traceback.format_exc()[-2500:]}
    return results


# ---------------------------------------------------------------- 2-D: FSDP over dp, tensor parallel over tp

@functools.lru_cache(maxsize=None)
def mesh_2d(world: int, tp: int = 2):
    """The dp x tp mesh, one per process (see ``mesh_of``)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))


def fully_shard_2d(model, mesh):
    """The 2-D recipe as torchtitan spells it: the plan on mesh["tp"], then fully_shard over mesh["dp"]
    for each decoder layer and the whole model."""
    llama_plan(model, mesh["tp"])
    for layer in model.model.layers:
        optpass.fully_shard(layer, mesh=mesh["dp"])
    optpass.fully_shard(model, mesh=mesh["dp"])
    return model


def dp_tokens(i: int, dp_rank: int, dp: int, rows: int = 4) -> torch.Tensor:
    """This dp rank's rows of step i's batch of `rows` sequences (the same batch on any number of ranks)."""
    whole = torch.randint(0, VOCAB, (rows, 8), generator=torch.Generator().manual_seed(200 + i))
    return whole.chunk(dp)[dp_rank]


def two_dimensional(rank, world, options: dict | None = None, steps: int = STEPS) -> dict:
    """FSDP over dp x tensor parallel over tp, the update in backward: equal to one process on the
    whole batch (each dp rank's loss is the mean over its rows; fsdp averages the dp ranks)."""
    options = options if options is not None else {"optimizer_in_backward": True, "clip_grad_norm": 0.5}
    mesh = mesh_2d(world)
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    model = llama()
    reference = copy.deepcopy(model)
    fully_shard_2d(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1)

    compiled = torch.compile(_step_of(model, opt), backend="optpass",
                             options=dict(options, optimizer=opt, data_parallel="fsdp"))
    # one process: the same math, the update in backward (where it runs does not change a number)
    ref_options = dict(options, optimizer_in_backward=True)
    for i in range(steps):
        compiled(dp_tokens(i, dp_rank, dp))
    torch._dynamo.reset()
    reference_step = torch.compile(_step_of(reference, ref_opt), backend="optpass",
                                   options=dict(ref_options, optimizer=ref_opt))
    for i in range(steps):
        reference_step(torch.cat([dp_tokens(i, r, dp) for r in range(dp)]))
    worst = max(((gathered(model, name).double() - p.detach()).abs().max() / p.detach().abs().max()).item()
                for name, p in reference.named_parameters())
    return {"relative": worst,
            "grad_norm": float(optpass.grad_norm(opt)) if options.get("clip_grad_norm") else None,
            "reference_grad_norm": float(optpass.grad_norm(ref_opt)) if options.get("clip_grad_norm") else None,
            "shard_types": sorted({type(p).__name__ for p in model.parameters()})}


def gathered(model, name: str) -> torch.Tensor:
    """The whole parameter `name` of a 2-D sharded model: read through its module (gathered over dp,
    the tensor-parallel DTensor again), then its full tensor (every rank must call it)."""
    *path, attribute = name.split(".")
    module = model.get_submodule(".".join(path))
    with torch.no_grad():
        return full(getattr(module, attribute))



def _step_of(model, opt):
    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    return step


def _two_dimensional_run(world: int, tp: int = 2):
    mesh = mesh_2d(world, tp)
    model = fully_shard_2d(llama(), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1)
    step = torch.compile(_step_of(model, opt), backend="optpass",
                         options={"optimizer": opt, "data_parallel": "fsdp", "optimizer_in_backward": True,
                                  "clip_grad_norm": 0.5, "lower": "eager"})
    return mesh, model, opt, lambda i: step(dp_tokens(i, mesh["dp"].get_local_rank(), mesh["dp"].size()))


def two_dimensional_saves(rank, world, path: str) -> dict:
    """2 steps on dp x tp, a DCP checkpoint of torch's get_state_dict (DTensors on the 2-D mesh), then
    a third step: what a resumed run must reach."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    mesh, model, opt, step = _two_dimensional_run(world)
    for i in range(2):
        step(i)
    model_sd, optim_sd = get_state_dict(model, opt)
    placements = sorted({repr(tuple(v.placements)) for v in model_sd.values() if hasattr(v, "placements")})
    whole = {name: full(v).clone() for name, v in model_sd.items()}
    now = {name: gathered(model, name) for name in whole}
    import torch.distributed as dist
    spread = {}
    for name in whole:
        mine = now[name].contiguous()
        others = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(others, mine)
        spread[name] = max((o - mine).abs().max().item() for o in others)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    if rank == 0:
        torch.save(now, f"{path}/../after_two_steps.pt")
    step(2)
    after = {name: gathered(model, name) for name, _ in llama().named_parameters()}
    if rank == 0:
        torch.save(after, f"{path}/../after_three_steps.pt")
    return {"placements": placements,
            "saved_vs_params": max((whole[n] - now[n]).abs().max().item() for n in whole),
            "spread": {n: v for n, v in spread.items() if v > 0}}


def two_dimensional_resumes(rank, world, path: str) -> dict:
    """On dp 1 x tp 2 (tp kept, dp 2 -> 1): load the checkpoint into a fresh model and optimizer with
    set_state_dict and take the third step: equal to the uninterrupted run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh, model, opt, step = _two_dimensional_run(world)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = torch.load(f"{path}/../after_two_steps.pt")
    loaded_vs_saved = max((gathered(model, n).double() - want).abs().max().item() for n, want in loaded.items())
    step(2)
    expected = torch.load(f"{path}/../after_three_steps.pt")
    return {"relative": max(((gathered(model, n).double() - want).abs().max() / want.abs().max()).item()
                            for n, want in expected.items()), "loaded_vs_saved": loaded_vs_saved}


def two_dimensional_programs(rank, world, path: str) -> dict:
    """The 2-D programs on one process group (dp 2 x tp 2), each catching its own error."""
    programs = {"in_backward": lambda: two_dimensional(rank, world),
                "after_backward": lambda: two_dimensional(rank, world, {"clip_grad_norm": 0.5, "lower": "eager"}),
                "saves": lambda: two_dimensional_saves(rank, world, path),
                "optpass_checkpoint": lambda: _optpass_checkpoint_refused(rank, world, path)}
    results = {}
    for name, program in programs.items():
        torch._dynamo.reset()
        try:
            results[name] = program()
        except Exception as error:  # noqa: BLE001  (each program reports its own failure)
            results[name] = {"error": (type(error).__name__, str(error), traceback.format_exc())}
    return results


def _optpass_checkpoint_refused(rank, world, path: str) -> dict:
    mesh, model, opt, _ = _two_dimensional_run(world)
    try:
        optpass.save_sharded_checkpoint(f"{path}-optpass", opt, model=model)
    except optpass.OptpassError as error:
        return {"error": ("OptpassError", str(error), "")}
    return {}
