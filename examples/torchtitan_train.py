"""A torchtitan-style training loop on optpass: what an FSDP2 user brings, with the update in backward.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/torchtitan_train.py \\
        --steps 20 --checkpoint-every 10 --out /tmp/titan
    # later, on any number of ranks: picks up the newest checkpoint in --out and trains on
    python -m torch.distributed.run --standalone --nproc-per-node 3 examples/torchtitan_train.py \\
        --steps 30 --checkpoint-every 10 --out /tmp/titan

What torchtitan does, and the optpass spelling of each piece:

* the model is built on the meta device (no rank ever holds it whole), each decoder layer wrapped
  in activation checkpointing (``checkpoint_wrapper``), then ``fully_shard`` per decoder layer and
  on the root with FSDP2's ``MixedPrecisionPolicy`` (bf16 gathers and compute, fp32 reduce): here
  ``optpass.fully_shard``, the same calls;
* ``model.to_empty(device=...)`` then the model's own initialization writes each rank's shards;
* AdamW with a linear warmup then cosine decay (``LambdaLR``), gradient clipping at 1.0: here the
  clip is the option ``clip_grad_norm`` (the global norm over every rank's shards, computed in
  backward before the updates) and the update runs in backward (``optimizer_in_backward``);
* checkpoints through ``torch.distributed.checkpoint`` with ``get_state_dict`` / ``set_state_dict``
  (DTensors of the full shapes: resumable on another number of ranks), the scheduler and the step
  in the same checkpoint (a resume takes the newest one with DCP's ``.metadata``, written last);
* rank 0 logs loss, gradient norm, learning rate and tokens per second.

The data is a fixed synthetic token stream, the same global batch at each step whatever the number
of ranks (each rank takes its rows), so a run resumed on another number of ranks continues the same
run. Each rank writes ``--out/losses-from-<first step>-rank<r>.json`` with the losses of the steps it ran.

With ``--tp 2`` on 4 ranks the model is trained on a 2-D mesh (FSDP over dp 2 x tensor parallel over
tp 2: torchtitan's Llama plan, ``optpass.plans.hugging_face_llama``); ``--float8`` converts every
Linear but the head to torchao's Float8 training (``--width`` a multiple of 16):

    python -m torch.distributed.run --standalone --nproc-per-node 4 examples/torchtitan_train.py \
        --tp 2 --float8 --steps 6 --out /tmp/titan_2d

CPU and gloo here (a tiny config by default); on GPUs initialize NCCL and build on ``cuda``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import optpass


def llama_config(args):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.width, intermediate_size=2 * args.width,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=args.seq, tie_word_embeddings=False,
        use_cache=False)                                   # training: no KV cache (a side effect under checkpointing)


def build_model(args, mesh):
    """Meta build, per-layer activation checkpointing, per-layer then root sharding, materialize.

    With ``--tp`` (a 2-D mesh): built on the CPU with the same seed on every rank (a tensor-parallel
    plan under optpass.fully_shard is not built from the meta device yet), the plan on mesh["tp"]
    first, then checkpointing and fully_shard over mesh["dp"], torchtitan's order. With ``--float8``
    every Linear becomes torchao's Float8Linear before any of that."""
    import transformers

    if args.tp > 1:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(llama_config(args))
    else:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(llama_config(args))
    if args.float8:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda module, name: name != "lm_head")
    if args.tp > 1:
        optpass.plans.hugging_face_llama(model, mesh["tp"])
        mesh = mesh["dp"]
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer)              # torchtitan's full activation checkpointing
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, args.param_dtype), reduce_dtype=torch.float32)
    for layer in layers:
        optpass.fully_shard(layer, mesh=mesh, mp_policy=policy)
    optpass.fully_shard(model, mesh=mesh, mp_policy=policy)
    if args.tp == 1:
        model.to_empty(device="cpu")                        # this rank's shards only
        torch.manual_seed(0)                                # the same seed on every rank
        model.init_weights()                                # writes each rank's rows of the init
    return model


def warmup_cosine(warmup: int, steps: int):
    """torchtitan's schedule: linear warmup to the peak, then cosine decay to 0."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def global_batch(step: int, args):
    """The step's global batch: [global_batch, seq] tokens, the same on any number of ranks. Each row
    counts up from a random token by a random stride of 1 to 3 (mod the vocabulary): a pattern the
    model can learn, so the loss falls."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, args.vocab, (args.global_batch, 1), generator=g)
    stride = torch.randint(1, 4, (args.global_batch, 1), generator=g)
    return (start + stride * torch.arange(args.seq)) % args.vocab


def newest_checkpoint(out: str) -> str | None:
    """The newest complete checkpoint: DCP writes its .metadata last, so a save killed half-way is skipped."""
    steps = [int(d.split("-")[1]) for d in os.listdir(out)
             if d.startswith("step-") and os.path.exists(os.path.join(out, d, ".metadata"))] if os.path.isdir(out) else []
    return os.path.join(out, f"step-{max(steps)}") if steps else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--global-batch", type=int, default=12, help="divisible by the number of ranks")
    parser.add_argument("--param-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--lower", default="inductor", choices=("inductor", "eager"))
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: a 2-D mesh of world/tp x tp")
    parser.add_argument("--float8", action="store_true", help="torchao's Float8 training for every Linear but the head")
    args = parser.parse_args()

    dist.init_process_group("gloo")                         # "nccl" on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world % args.tp == 0, "--tp must divide the number of ranks"
    dp, dp_rank = world // args.tp, rank // args.tp
    assert args.global_batch % dp == 0, "--global-batch must be divisible by the data-parallel ranks"
    mesh = (init_device_mesh("cpu", (world,)) if args.tp == 1 else
            init_device_mesh("cpu", (dp, args.tp), mesh_dim_names=("dp", "tp")))
    model = build_model(args, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(args.lr), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, args.steps))

    start = 0
    resume_from = newest_checkpoint(args.out)
    if resume_from is not None:
        # torchtitan's resume: DCP reads each rank's rows of every tensor, whatever the saving world
        # (the step and the scheduler are in the same checkpoint, as torchtitan's train state: saved together)
        model_state, optim_state = get_state_dict(model, opt)
        state = {"model": model_state, "optim": optim_state, "train": {"step": 0, "scheduler": scheduler.state_dict()}}
        dcp.load(state, checkpoint_id=resume_from)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        scheduler.load_state_dict(state["train"]["scheduler"])
        start = state["train"]["step"]
        if rank == 0:
            print(f"resumed from {resume_from} at step {start} on {world} ranks", flush=True)

    def train_step(tokens):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    train_step = torch.compile(train_step, backend="optpass", options={
        "optimizer": opt, "optimizer_in_backward": True, "data_parallel": "fsdp",
        "clip_grad_norm": 1.0, "lower": args.lower})

    per_rank = args.global_batch // dp                     # the tp ranks of a dp rank: the same rows
    losses, lrs = {}, {}
    for step in range(start, args.steps):
        began = time.perf_counter()
        tokens = global_batch(step, args)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        lr = float(scheduler.get_last_lr()[0])              # this step's
        loss = train_step(tokens)
        scheduler.step()
        logged = loss.clone()
        dist.all_reduce(logged)                             # the mean over ranks, as torchtitan logs it
        losses[step + 1], lrs[step + 1] = logged.item() / world, lr
        if rank == 0 and (step + 1) % args.log_every == 0:
            seconds = time.perf_counter() - began
            print(f"step {step + 1:4d}  loss {losses[step + 1]:.4f}  grad_norm {optpass.grad_norm(opt).item():.4f}  "
                  f"lr {lr:.2e}  tokens/s {args.global_batch * args.seq / seconds:,.0f}",
                  flush=True)
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            model_state, optim_state = get_state_dict(model, opt)
            where = os.path.join(args.out, f"step-{step + 1}")
            dcp.save({"model": model_state, "optim": optim_state,
                      "train": {"step": step + 1, "scheduler": scheduler.state_dict()}}, checkpoint_id=where)

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"losses-from-{start}-rank{rank}.json"), "w") as f:
        json.dump({"world": world, "tp": args.tp, "start": start, "losses": losses, "lrs": lrs}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
