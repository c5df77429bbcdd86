# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # ZeRO-1 data parallelism with optpass
#
# Data-parallel training usually means `DistributedDataParallel`: every rank holds
# the whole model, the whole gradient and the **whole optimizer state** (AdamW: two
# numbers per parameter), and all-reduces the gradients every step.
#
# ZeRO-1 keeps each rank's optimizer state to **1/N**: the gradients are averaged
# across the ranks, each rank updates its shard of the parameters with its shard of
# the optimizer state, and every rank then gets the updated parameters. optpass picks
# the collectives by what is fast on the process group's backend: on NCCL a
# *reduce-scatter* (each rank receives the averaged gradients of its shard only) and
# an *all-gather* (together the bytes of one ring all-reduce); on gloo, whose
# reduce-scatter and all-gather are slow, an *all-reduce* of which each rank keeps
# its shard and one *broadcast* of each rank's updated shard.
#
# With optpass you keep the **single-device training step** and your ordinary
# `torch.optim` optimizer; `options={"data_parallel": "zero1"}` inserts the
# collectives and the sharded update into the compiled step. This notebook:
#
# 1. shows the training script and runs it on 2 ranks on CPU (gloo), with torchrun;
# 2. prints the collectives the `shard_optimizer` pass inserted (graph diff);
# 3. compares the per-rank optimizer-state memory with unsharded AdamW;
# 4. checks that the result equals single-process training on the whole batch.

# %%
import json
import pathlib
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

import optpass
import zero1_train        # examples/zero1_train.py: the script each rank runs

print("torch", torch.__version__, "| optpass", optpass.__version__)

# %% [markdown]
# ## 1. The training script
#
# This is all a rank runs. The step is the usual single-device step in the shape
# optpass supports (`out = loss.detach()` *before* `opt.step()`); the only
# data-parallel parts are `init_process_group`, the rank's slice of the batch and
# the option:

# %%
source = pathlib.Path("zero1_train.py").read_text()
print(source[source.index("def main"):source.index("    report =")])

# %% [markdown]
# Launch it on 2 ranks with `torchrun` (here `python -m torch.distributed.run`;
# gloo on CPU). Each rank writes what it measured to a JSON file.

# %%
out = tempfile.mkdtemp(prefix="optpass-zero1-")
command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "zero1_train.py", "--out", out]
finished = subprocess.run(command, capture_output=True, text=True, timeout=600)
assert finished.returncode == 0, finished.stderr[-3000:]
ranks = [json.loads((pathlib.Path(out) / f"rank{r}.json").read_text()) for r in range(2)]
for r in ranks:
    print(f"rank {r['rank']}: loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} over {len(r['losses'])} steps")
print()
print("shard_optimizer:", ranks[0]["notes"])

# %% [markdown]
# ## 2. What the pass inserted
#
# The compiled step graph before and after the `shard_optimizer` pass (rank 0,
# the steady graph; the first step already ran a sharded graph of the same shape,
# which also created the shard's AdamW state). Per bucket (gloo): the gradients are flattened into one
# buffer, which `all_reduce_(..., "sum", ...)` starts summing across the ranks as soon as the bucket's
# last gradient is computed, while backward goes on; after backward `wait_tensor` waits for it and this
# rank takes its chunk (divided by 2), AdamW's own update (harvested from torch.optim) runs on the
# chunk and the shard's state, one `broadcast_` per rank sends each rank's updated chunk to the
# others, and `copy_` writes the chunks into the parameters. The gradient outputs become `None`, so
# `opt.step()` in the step has nothing left to do.

# %%
diff = ranks[0]["graph_diff"]
collectives = [line for line in diff.splitlines() if line.startswith("+") and "_c10d_functional" in line]
print("\n".join(collectives))
print(f"\n{len(diff.splitlines())} diff lines in all; the first bucket in full:\n")
lines = diff.splitlines()
gather = next(i for i, line in enumerate(lines) if "broadcast" in line or "all_gather" in line)
end = next(i for i, line in enumerate(lines) if i > gather and "aten.copy_(" in line)
print("\n".join(lines[:end + 1]))

# %% [markdown]
# ## 3. Optimizer-state memory per rank
#
# Unsharded AdamW holds `exp_avg` and `exp_avg_sq` for every parameter (plus a
# step counter per parameter). Each optpass rank holds them for its chunk of each
# bucket only:

# %%
model, opt = zero1_train.make_model_and_optimizer()
n_params = sum(p.numel() for p in model.parameters())
unsharded = 2 * 4 * n_params       # exp_avg + exp_avg_sq, fp32
for r in ranks:
    owned = sum(b["owned"] for b in r["buckets"])
    print(f"rank {r['rank']}: {r['state_bytes']:7d} bytes of optimizer state "
          f"({r['state_bytes'] / unsharded:.3f} of unsharded {unsharded}), "
          f"{owned} of {n_params} parameters' elements, {len(r['buckets'])} buckets")

# %% [markdown]
# ## 4. Same result as single-process training
#
# Train the same model with plain eager PyTorch in this process, on the whole
# global batch (both ranks' slices) every step. The parameters optpass's two
# ranks ended with must equal these (AdamW under torch.compile differs from eager
# torch.optim by float32 rounding only, ~1e-5 relative after 20 steps).

# %%
model, opt = zero1_train.make_model_and_optimizer()
for i in range(zero1_train.STEPS):
    x, y = zero1_train.global_batch(i, 2 * zero1_train.PER_RANK)
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()

worst = 0.0
for rank in ranks:
    for p, trained in zip(model.parameters(), rank["params"]):
        trained = torch.tensor(trained).view_as(p)
        worst = max(worst, ((trained - p).abs().max() / p.abs().max()).item())
print(f"max relative difference, optpass ZeRO-1 on 2 ranks vs single process: {worst:.2e}")
assert worst < 1e-4

# %% [markdown]
# ## Summary
#
# * `options={"optimizer": opt, "data_parallel": "zero1"}` turns a single-device step
#   into data-parallel ZeRO-1: no DDP wrapper, no special optimizer class.
# * The collectives are functional collectives inside the compiled graph, chosen
#   per backend (gloo: an all-reduce per bucket, started during backward, and a
#   broadcast per rank's shard; NCCL: a reduce-scatter and an all-gather per bucket,
#   DDP's all-reduce volume); each rank keeps 1/N of the optimizer state.
# * `optimizer_in_backward=True` as well runs each bucket's update during backward;
#   `optpass.save_sharded_checkpoint` / `load_sharded_checkpoint` save the shards
#   with torch.distributed.checkpoint and resume on any number of ranks.
