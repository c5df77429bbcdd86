"""Fully sharded training with optpass, beside torch's FSDP2 and optpass ZeRO-1: one script, every rank.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/fsdp_train.py --out /tmp/fsdp

Each rank trains the same model three times, one after the other, from the same seed: with
``optpass.fully_shard`` + ``data_parallel="fsdp"`` and the update in backward, with torch's FSDP2
(``fully_shard`` per layer and the root, eager), and with optpass ZeRO-1 (every rank holds the whole
model). For each it measures the live-tensor peak of the run: the parameters this rank holds before it plus
the run's own peak (``optpass.measure_tensor_peak``, which counts on every thread, gloo's included);
and writes it, with the graph diff of the fsdp step and the gathered
parameters, to ``--out/rank<r>.json``
(examples/fsdp.ipynb reads them).

With ``--recipe meta`` each rank instead builds a small Hugging Face Llama on the meta device,
shards it (``fully_shard`` per decoder layer, then the model), allocates its shards with
``to_empty``, initializes them with the model's own ``init_weights()`` and trains it
(``train_from_meta``).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import optpass
import optpass.zero1

WIDTH, DEPTH = 512, 8          # 8 units of Linear(512, 512): 2.1M parameters
STEPS = 10
PER_RANK = 8


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def global_batch(step: int, samples: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(samples, WIDTH, generator=g)
    return x, torch.tanh(x.roll(1, dims=1))


def train(variant: str, rank: int, world: int) -> dict:
    torch._dynamo.reset()
    model = make_model()
    if variant == "optpass fsdp":
        optpass.fully_shard(model)                       # before the optimizer: each rank keeps its shard
    elif variant == "torch FSDP2":
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))

    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        out = loss.detach()          # take what you return BEFORE opt.step()
        opt.step()
        opt.zero_grad()
        return out

    if variant != "torch FSDP2":
        train_step = torch.compile(train_step, backend="optpass", options={
            "optimizer": opt, "optimizer_in_backward": True,
            "data_parallel": "fsdp" if variant == "optpass fsdp" else "zero1"})
    losses = []
    held = _bytes(model.parameters())        # what this rank holds before the run: its parameters
    # the whole run's live-tensor peak, counted on every thread (gloo's, which free the collectives'
    # buffers, included): the first call compiles and creates the optimizer state
    with optpass.keep_graphs(), optpass.measure_tensor_peak() as run:
        for i in range(STEPS):
            x, y = global_batch(i, PER_RANK * world)
            mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            losses.append(train_step(x[mine], y[mine]).item())
    peak = held + run.growth_bytes
    param_bytes = _bytes(model.parameters())
    result = {"peak_bytes": peak, "param_bytes": param_bytes, "state_bytes": _bytes(_state(opt, variant)),
              "losses": losses}
    if variant == "optpass fsdp":
        report = [r for r in optpass.recent_reports() if r.graph_after is not None and r.kind.value == "step"][-1]
        result["notes"] = [note for outcome in report.passes if outcome.name == "reshard_after_forward"
                           for note in outcome.notes]
        result["graph_diff"] = optpass.graph_diff(report.graph_before, report.graph_after, shapes=False, context=0)
        result["params"] = {name: t.reshape(-1).tolist() for name, t in optpass.full_state_dict(model).items()}
    return result


def llama_config():
    import transformers

    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


def llama_tokens(step: int, samples: int) -> torch.Tensor:
    return torch.randint(0, 64, (samples, 16), generator=torch.Generator().manual_seed(step))


def train_from_meta(rank: int, world: int) -> dict:
    """FSDP2's recipe for a model no rank can hold: no rank ever allocates the whole model."""
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config())   # shapes only, no memory
    for layer in model.model.layers:
        optpass.fully_shard(layer)                      # FSDP2's calls: each decoder layer a unit,
    optpass.fully_shard(model)                          # then the rest (embeddings, norm, head)
    model.to_empty(device="cpu")                        # this rank allocates its shards only
    torch.manual_seed(0)                                # the same seed on every rank
    model.init_weights()                                # the model's own init writes the shards
    initialized = optpass.full_state_dict(model)        # gathered, for the notebook to check
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))

    def train_step(tokens):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    # lower="eager" (the rewritten graph run op by op) only to compile this tiny model faster; train
    # with the default, Inductor, when memory and speed matter (docs/fsdp.md, "Memory and time")
    train_step = torch.compile(train_step, backend="optpass", options={
        "optimizer": opt, "optimizer_in_backward": True, "data_parallel": "fsdp", "lower": "eager"})
    losses = []
    for i in range(3):
        tokens = llama_tokens(i, PER_RANK * world)
        losses.append(train_step(tokens[rank * PER_RANK:(rank + 1) * PER_RANK]).item())
    return {"param_bytes": _bytes(model.parameters()), "losses": losses, "initialized": _as_lists(initialized),
            "trained": _as_lists(optpass.full_state_dict(model))}


def _as_lists(state: dict) -> dict:
    return {name: t.reshape(-1).tolist() for name, t in state.items()}


def _bytes(tensors) -> int:
    """Bytes this rank holds (a DTensor's local shard)."""
    return sum(getattr(t, "to_local", lambda: t)().numel() * t.element_size() for t in tensors)


def _state(opt, variant: str) -> list:
    """The optimizer state this rank holds (zero1 keeps it in its shard optimizer, made at the first call)."""
    holder = opt
    if variant == "optpass zero1":
        try:
            holder = optpass.zero1.sharded_state(opt).shard_optimizer
        except optpass.OptpassError:
            return []
    return [v for s in holder.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--recipe", choices=("compare", "meta"), default="compare")
    args = parser.parse_args()
    dist.init_process_group("gloo")                       # nccl on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.recipe == "meta":
        result = {"rank": rank, "world": world, **train_from_meta(rank, world)}
    else:
        result = {"rank": rank, "world": world, "parameters": sum(p.numel() for p in make_model().parameters()),
                  "variants": {v: train(v, rank, world) for v in ("optpass fsdp", "torch FSDP2", "optpass zero1")}}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
