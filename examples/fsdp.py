# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
#
# %% [markdown]
# # Fully sharded data parallel (ZeRO-3) with optpass
#
# ZeRO-1 shards the optimizer state, but every rank still holds every parameter and
# every gradient: a model whose fp32 parameters do not fit one device cannot train.
# Fully sharded data parallel keeps only **1/N of each parameter** on each rank and
# gathers a parameter just before it is used.
#
# With optpass you call `optpass.fully_shard(model)` before building the optimizer and
# compile the usual single-device step with `data_parallel="fsdp"`. The compiled step
# gathers each parameter just before its use, frees it, gathers it again for backward,
# reduce-scatters each gradient onto its shard as soon as it is final and, with
# `optimizer_in_backward`, updates the shard right there. This notebook:
#
# 1. runs the training script on 2 ranks (gloo, CPU) three ways: optpass fsdp, torch's
#    FSDP2 and optpass ZeRO-1;
# 2. plots each rank's memory for the three;
# 3. prints the graph diff of one unit: what the `reshard_after_forward` pass did;
# 4. checks that the result equals single-process training on the whole batch;
# 5. builds a Hugging Face Llama on the meta device, so that no rank ever holds the whole
#    model, and trains it.

# %%
import json
import pathlib
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

import fsdp_train        # examples/fsdp_train.py: the script each rank runs
import optpass

print("torch", torch.__version__, "| optpass", optpass.__version__)

# %% [markdown]
# ## 1. The training script
#
# The optpass part of what each rank runs (`train` in `fsdp_train.py` also builds the
# FSDP2 and ZeRO-1 variants and measures memory):

# %%
source = pathlib.Path("fsdp_train.py").read_text()
print(source[source.index("    model = make_model()"):source.index("    losses = []")])

# %%
out = tempfile.mkdtemp(prefix="optpass-fsdp-")
command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "fsdp_train.py", "--out", out]
finished = subprocess.run(command, capture_output=True, text=True, timeout=900)
assert finished.returncode == 0, finished.stderr[-3000:]
ranks = [json.loads((pathlib.Path(out) / f"rank{r}.json").read_text()) for r in range(2)]
for r in ranks:
    for variant, got in r["variants"].items():
        print(f"rank {r['rank']} {variant:14s} loss {got['losses'][0]:.4f} -> {got['losses'][-1]:.4f}")

# %% [markdown]
# ## 2. Memory per rank
#
# Per rank: the parameter bytes it holds between steps, its optimizer state, and the
# peak of live tensor bytes over the whole run of 10 calls (the parameters it holds
# before the run plus the run's own peak, `optpass.measure_tensor_peak`, counted on
# every thread: gloo's worker threads free the collectives' buffers; the first call
# compiles and creates the optimizer state). ZeRO-1 holds every parameter; optpass fsdp and FSDP2 hold 1/2;
# with the update inside backward, optpass fsdp never holds the sharded gradients.

# %%
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

variants = list(ranks[0]["variants"])
params = ranks[0]["parameters"]
fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
for ax, what in zip(axes, ("param_bytes", "peak_bytes")):
    for r in ranks:
        values = [r["variants"][v][what] / 2**20 for v in variants]
        ax.bar([i + 0.4 * r["rank"] for i in range(len(variants))], values, width=0.4, label=f"rank {r['rank']}")
    ax.set_xticks([i + 0.2 for i in range(len(variants))], variants)
    ax.set_ylabel("MiB")
    ax.set_title({"param_bytes": "parameters held between steps", "peak_bytes": "peak live tensors"}[what])
    ax.legend()
fig.tight_layout()
fig.savefig(pathlib.Path(out) / "memory.png")
print(f"{params / 1e6:.1f}M parameters ({4 * params / 2**20:.1f} MiB fp32)")
for v in variants:
    worst = max(r["variants"][v]["peak_bytes"] for r in ranks)
    print(f"{v:14s} worst-rank peak {worst / 2**20:6.1f} MiB = {worst / params:5.2f} bytes/param, "
          f"parameters held {ranks[0]['variants'][v]['param_bytes'] / 2**20:.1f} MiB, "
          f"optimizer state {ranks[0]['variants'][v]['state_bytes'] / 2**20:.1f} MiB")

# %% [markdown]
# ## 3. The graph diff of one unit
#
# The step graph before and after the passes (rank 0). For each Linear weight the
# forward reads an all-gather of the shards (`all_gather_into_tensor` + `wait_tensor` +
# a slice and a view); `reshard_after_forward` adds a second gather just before backward
# reads the weight, so the forward's copy dies after its last forward use (not for the last
# Linear: backward reads it right after forward does, so forward's copy serves it). Each gather starts
# before the previous one's wait (prefetch: the next travels while this one is used). On gloo
# (here) every collective names the group's twin with one worker thread, `'0/optpass-one-thread'`:
# gloo's two threads corrupt a rank's heap when they run two collectives at once (docs/design.md
# §45); on NCCL each unit's gathers are one coalesced all-gather. The `reduce_scatter_tensor` in backward comes from
# the gather's gradient; `optimizer_in_backward` puts AdamW's update of the shard right
# after it. Below: every collective the passes added, then the lines of the last unit.

# %%
fsdp = ranks[0]["variants"]["optpass fsdp"]
print("reshard_after_forward:", fsdp["notes"])
diff = fsdp["graph_diff"].splitlines()
print("\n".join(line for line in diff if line.startswith("+") and "_c10d_functional" in line))
last = max(i for i, line in enumerate(diff) if line.startswith("+") and "all_gather_into_tensor" in line)
print("\n...\n" + "\n".join(diff[max(0, last - 2):last + 12]))

# %% [markdown]
# ## 4. Same result as single-process training
#
# The same model, trained eagerly in this process on the whole batch every step. optpass
# fsdp's parameters (gathered by `optpass.full_state_dict` on the ranks) must equal them
# (AdamW under torch.compile differs from eager torch.optim in float32 rounding only).

# %%
model = fsdp_train.make_model()
opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
for i in range(fsdp_train.STEPS):
    x, y = fsdp_train.global_batch(i, 2 * fsdp_train.PER_RANK)
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
worst = max((torch.tensor(fsdp["params"][name]).view_as(p) - p).abs().max().item()
            for name, p in model.state_dict().items())
print(f"max difference, optpass fsdp on 2 ranks vs one process: {worst:.2e}")
assert worst < 1e-4

# %% [markdown]
# ## 5. A model no rank can hold: build on the meta device
#
# Above, every rank built the whole model before `fully_shard` kept its rows. A model larger
# than one rank can hold is built under `torch.device("meta")` (shapes, no memory), sharded with
# FSDP2's calls (each decoder layer, then the model), given memory for its shards only by
# `to_empty`, and initialized by its own code (`init_weights()`, as a Hugging Face model
# does after construction) under the same seed on every rank. `train_from_meta` in
# `fsdp_train.py` does it for a tiny Llama on 2 ranks, then trains 3 steps:

# %%
meta_recipe = source.index("    with torch.device(\"meta\"):")
print(source[meta_recipe:source.index("    losses = []", meta_recipe)])

# %% [markdown]
# Each rank's parameter bytes are its shards, half of the whole model's: `to_empty` allocated
# nothing more, and `init_weights` held one full parameter at a time, the one it filled
# ([docs/fsdp.md](../docs/fsdp.md)). The parameters the ranks gathered after
# `init_weights` equal the same init on one device: the model built on meta in this process,
# `to_empty`, the same seed, `init_weights()`. So does training: 3 steps of one process on
# the whole batch.

# %%
import transformers

meta_out = tempfile.mkdtemp(prefix="optpass-fsdp-meta-")
meta_command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "fsdp_train.py", "--recipe", "meta", "--out", meta_out]
finished = subprocess.run(meta_command, capture_output=True, text=True, timeout=900)
assert finished.returncode == 0, finished.stderr[-3000:]
meta_ranks = [json.loads((pathlib.Path(meta_out) / f"rank{r}.json").read_text()) for r in range(2)]

with torch.device("meta"):
    one_device = transformers.LlamaForCausalLM(fsdp_train.llama_config())
one_device.to_empty(device="cpu")
torch.manual_seed(0)
one_device.init_weights()
full_bytes = sum(p.numel() * p.element_size() for p in one_device.parameters())
for r in meta_ranks:
    print(f"rank {r['rank']}: parameters held {r['param_bytes'] / 2**10:5.1f} KiB of the whole model's "
          f"{full_bytes / 2**10:.1f} KiB; loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")


def worst_difference(gathered, model):
    return max((torch.tensor(gathered[name]).view_as(t) - t).abs().max().item()
               for name, t in model.state_dict().items())


initialized = worst_difference(meta_ranks[0]["initialized"], one_device)
print(f"max difference, init_weights on 2 ranks' shards vs on one device: {initialized:.2e}")
assert initialized == 0

opt = torch.optim.AdamW(one_device.parameters(), lr=torch.tensor(1e-3))
for i in range(len(meta_ranks[0]["losses"])):
    tokens = fsdp_train.llama_tokens(i, 2 * fsdp_train.PER_RANK)
    one_device(input_ids=tokens, labels=tokens).loss.backward()
    opt.step()
    opt.zero_grad()
trained = worst_difference(meta_ranks[0]["trained"], one_device)
print(f"max difference after 3 steps, optpass fsdp on 2 ranks vs one process: {trained:.2e}")
assert trained < 1e-4

# %% [markdown]
# ## Summary
#
# * `optpass.fully_shard(model)` before the optimizer and `data_parallel="fsdp"`: each rank
#   holds 1/N of every parameter and of the optimizer state; the compiled single-device
#   step gathers, frees, re-gathers and reduce-scatters in the graph.
# * With `optimizer_in_backward=True` each shard's update runs as its gradient is reduced:
#   no rank ever holds the sharded gradients of the whole model.
# * `optpass.full_state_dict(model)` gathers the parameters; `optpass.save_sharded_checkpoint`
#   and `load_sharded_checkpoint` save the shards with torch.distributed.checkpoint and resume
#   on any number of ranks.
# * A model no rank can hold: build it on the meta device, `fully_shard` (each block, then the
#   model), `to_empty`, and initialize with the model's own code: each rank only ever allocates
#   its shards (and one full parameter at a time while it initializes);
#   `optpass.load_full_state_dict(model, path)` loads a Hugging Face `save_pretrained` directory
#   the same way, each rank reading its own rows. More in [docs/fsdp.md](../docs/fsdp.md).
