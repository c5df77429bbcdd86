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
# # fp32 master weights for bf16 parameters with optpass
#
# Training with `bfloat16` parameters halves the memory of the weights, but
# `torch.optim` then updates the bf16 weights directly, and every update is
# rounded to bf16. bf16 keeps 8 significant bits: next to a weight of 1.0 the
# closest other values are 0.996 and 1.0078, so **any update smaller than
# 2⁻⁸ ≈ 0.004 is rounded away** and the weight never moves. Megatron-LM (and
# DeepSpeed, Apex AMP O2) keep an fp32 *master* copy of every half-precision
# parameter: the gradient is cast to fp32, the optimizer updates the fp32 copy,
# and the model gets the copy rounded to bf16.
#
# optpass does the same inside the compiled step, with your ordinary optimizer
# built over the bf16 parameters:
# `options={"optimizer": opt, "master_weights": torch.float32}`.
#
# This notebook shows the stall, its fix, the graph diff, and what a checkpoint holds.

# %%
# %matplotlib inline
import copy
import logging

import matplotlib.pyplot as plt
import torch
import torch.nn as nn
import torch.nn.functional as F

import optpass

logging.getLogger("torch._dynamo.variables.ctx_manager").setLevel(logging.ERROR)
print("torch", torch.__version__, "| optpass", optpass.__version__)

# %% [markdown]
# ## 1. A model whose every update is small
#
# Eight weights start at 1.0 and should move to 1.02. With SGD at `lr=0.05` each
# update is about 0.002 at first, and smaller later: below the 0.004 that a bf16
# weight of 1.0 can register.
#
# The same model is trained three times, from the same data:
#
# * **fp32**: eager PyTorch, float32 weights (the reference);
# * **bf16**: eager PyTorch, bfloat16 weights, `torch.optim` updating them directly;
# * **bf16 + masters**: the same bf16 model and optimizer, compiled with optpass and
#   `master_weights` (and `optimizer_in_backward`: each update runs as soon as its
#   gradient is final).

# %%
torch.manual_seed(0)
x = torch.randn(64, 8)
y = x @ torch.full((8, 1), 1.02)


def make(dtype):
    model = nn.Linear(8, 1, bias=False).to(dtype)
    nn.init.ones_(model.weight)
    return model, torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05))


def make_train_step(model, opt):
    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    return train_step


fp32, fp32_opt = make(torch.float32)
bf16, bf16_opt = make(torch.bfloat16)
mixed, mixed_opt = make(torch.bfloat16)
runs = {
    "fp32": (fp32, make_train_step(fp32, fp32_opt), torch.float32),
    "bf16": (bf16, make_train_step(bf16, bf16_opt), torch.bfloat16),
    "bf16 + masters": (mixed, torch.compile(make_train_step(mixed, mixed_opt), backend="optpass", options={
        "optimizer": mixed_opt, "master_weights": torch.float32, "optimizer_in_backward": True,
        "lower": "eager"}), torch.bfloat16),
}

# %% [markdown]
# Train 40 steps and record the mean weight (for the optpass run also its fp32
# master, read with `optpass.master_weights(opt)`). The first call of the optpass
# step compiles it; `keep_graphs()` keeps its graphs for section 2.

# %%
MASTER = "bf16 + masters: the fp32 master"
history = {name: [1.0] for name in runs}
history[MASTER] = [1.0]
with optpass.keep_graphs():
    for step_index in range(40):
        for name, (model, step, dtype) in runs.items():
            step(x.to(dtype), y.to(dtype))
            history[name].append(model.weight.float().mean().item())
        master = optpass.master_weights(mixed_opt)[mixed.weight]
        history[MASTER].append(master.mean().item())

for name, values in history.items():
    print(f"{name:34s} mean weight after 40 steps: {values[-1]:.5f}")

plt.figure(figsize=(7, 3.5))
for name, values in history.items():
    bf16_weights = name in ("bf16", "bf16 + masters")
    plt.plot(values, label=name, drawstyle="steps-post" if bf16_weights else "default",
             linestyle="--" if name == MASTER else "-")
plt.axhline(1.02, color="gray", linewidth=0.5)
plt.xlabel("step"); plt.ylabel("mean weight"); plt.legend(); plt.title("bf16 stalls; fp32 masters fix it")
plt.show()

# %% [markdown]
# Plain bf16 training never leaves 1.0: every update was rounded away. With fp32
# masters the small updates add up in the master, and the bf16 weights follow it,
# one bf16 step (2⁻⁷ ≈ 0.0078 above 1.0) at a time. The bf16 weights are exactly
# the masters rounded:

# %%
master = optpass.master_weights(mixed_opt)[mixed.weight]
print("master:      ", master)
print("bf16 weights:", mixed.weight.data)
print("weights == masters rounded to bf16:", torch.equal(mixed.weight, master.to(torch.bfloat16)))

# %% [markdown]
# ## 2. What optpass did to the step
#
# The graph diff of the compiled step: the gradient is cast to fp32
# (`convert_element_type`), torch.optim's own SGD update runs on the master
# (an input of the graph, like the optimizer state and lr), the new master is
# written in place, and its bf16 rounding is copied into the parameter. The
# gradient's output slot becomes `None`: `p.grad` stays None and `opt.step()`
# has nothing to do.

# %%
report = next(r for r in optpass.recent_reports()
              if any(p.name == "master_weights" and p.status == "applied" for p in r.passes))
print(optpass.graph_diff(report.graph_before, report.graph_after, shapes=False, context=1))

# %% [markdown]
# ## 3. Checkpoints
#
# `opt.state_dict()` holds the fp32 masters and the fp32 optimizer state, under
# one entry of `state` that torch.optim's `load_state_dict` keeps as it is (it
# casts parameter state to the parameter's dtype, which would round the masters to
# bf16). Saving and loading is the usual `torch.save` / `opt.load_state_dict`,
# also in a fresh process before the first step.

# %%
saved = mixed_opt.state_dict()["state"]
print(list(saved))
entry = saved["optpass.master_weights"]
print("masters:", {i: (tuple(t.shape), t.dtype) for i, t in entry["masters"].items()})
print("state:  ", {i: {k: v.dtype for k, v in s.items()} for i, s in entry["state"].items()})

# %% [markdown]
# ## 4. fp16 with dynamic loss scaling
#
# fp16 has a narrow range (up to 65504), so fp16 training scales the loss up before
# backward and the gradients down before the update, and skips a step whose gradients
# overflowed. Pass your `torch.amp.GradScaler` as `options["grad_scaler"]` and keep the
# plain step (no `scaler.scale(...)` in it: Dynamo cannot trace it). Below, batch 5 holds
# an inf: that step changes nothing and halves the scale. With `growth_interval=3` the scale
# doubles after every 3 clean steps; a step whose scaled gradients overflow fp16 is skipped
# as well (step 6 here). The scale lives in the
# scaler (`scaler.get_scale()`, `scaler.state_dict()`); `optpass.skipped_steps(scaler)` counts
# the skips.

# %%
torch.manual_seed(0)
fp16 = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(torch.float16)
fp16_opt = torch.optim.AdamW(fp16.parameters(), lr=torch.tensor(1e-2))
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 14, growth_interval=3)
fp16_step = torch.compile(make_train_step(fp16, fp16_opt), backend="optpass", options={
    "optimizer": fp16_opt, "master_weights": torch.float32, "grad_scaler": scaler, "lower": "eager"})

print("step  loss      scale   skipped so far")
for i in range(12):
    xb = x[8 * (i % 8): 8 * (i % 8) + 8].to(torch.float16)
    if i == 5:
        xb = xb.clone(); xb[0, 0] = float("inf")            # a batch that overflows
    before = [p.detach().clone() for p in fp16.parameters()]
    loss = fp16_step(xb, y[8 * (i % 8): 8 * (i % 8) + 8].to(torch.float16))
    moved = any(not torch.equal(p, q) for p, q in zip(fp16.parameters(), before))
    print(f"{i:4d}  {loss.item():8.4f}  {scaler.get_scale():6.0f}   {optpass.skipped_steps(scaler)}"
          f"{'' if moved else '   <- skipped: no parameter moved'}")
print(scaler.state_dict())


# %% [markdown]
# **Gradient accumulation** with a scaler: compile the micro-step (backward, no
# `opt.step()`) with the same options as the step. Each micro-step runs backward of
# `loss * scale`, as `scaler.scale(loss).backward()` does, so `.grad` sums scaled gradients;
# the step that follows unscales, checks and applies the sum. Below, 3 calls per update
# against torch.amp driving the Megatron-way reference (fp32 masters by hand) with the same
# micro-steps: the same scale, and parameters equal bit for bit.

# %%
def make_micro_step(model):
    def micro_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()                                   # no opt.step(): gradients add up in .grad
        return loss.detach()
    return micro_step

torch.manual_seed(0)
acc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(torch.float16)
ref = copy.deepcopy(acc)
acc_opt = torch.optim.SGD(acc.parameters(), lr=0.05, momentum=0.9)
acc_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 14, growth_interval=3)
options = {"optimizer": acc_opt, "master_weights": torch.float32, "grad_scaler": acc_scaler, "lower": "eager"}
micro = torch.compile(make_micro_step(acc), backend="optpass", options=options)
step = torch.compile(make_train_step(acc, acc_opt), backend="optpass", options=options)

# the reference: fp32 masters by hand, torch.amp's GradScaler, the same micro-steps
ref_masters = [p.detach().float() for p in ref.parameters()]
ref_opt = torch.optim.SGD(ref_masters, lr=0.05, momentum=0.9)
ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 14, growth_interval=3)

for i in range(12):
    xb, yb = x[8 * (i % 8): 8 * (i % 8) + 8].to(torch.float16), y[8 * (i % 8): 8 * (i % 8) + 8].to(torch.float16)
    ref_scaler.scale(F.mse_loss(ref(xb), yb)).backward()
    if (i + 1) % 3:
        micro(xb, yb)
        continue
    step(xb, yb)
    for p, m in zip(ref.parameters(), ref_masters):
        m.grad = p.grad.float(); p.grad = None
    ref_scaler.unscale_(ref_opt); ref_scaler.step(ref_opt); ref_scaler.update(); ref_opt.zero_grad()
    with torch.no_grad():
        for p, m in zip(ref.parameters(), ref_masters):
            p.copy_(m)
    same = all(torch.equal(p, q) for p, q in zip(acc.parameters(), ref.parameters()))
    print(f"update after call {i:2d}: scale {acc_scaler.get_scale():6.0f} (torch.amp: "
          f"{ref_scaler.get_scale():6.0f}), parameters equal: {same}")

# %% [markdown]
# ## Summary
#
# * `options={"optimizer": opt, "master_weights": torch.float32}`: an fp32 master per
#   bf16/fp16 parameter, torch.optim's update on the master, the rounded master in the
#   parameter (fp32 parameters are updated as they are).
# * With `optimizer_in_backward=True` each master is updated as soon as its gradient is
#   final; without it, after backward. Either way no step keeps an fp32 copy of the gradients.
# * With `data_parallel="zero1"` each rank keeps only its shard of the fp32 masters and
#   of the state (docs/mixed_precision.md, "With ZeRO-1: masters sharded").
# * `grad_scaler`: fp16 dynamic loss scaling with torch.amp.GradScaler's semantics inside
#   the step, gradient accumulation included (micro-steps compiled with the same options);
#   `clip_grad_norm` clips the fp32 (unscaled) gradients. Both work with
#   `data_parallel="zero1"` too (docs/mixed_precision.md).
# * With `data_parallel="zero1"` gradient accumulation works too (micro-steps compiled with
#   the same options, the update after backward: each rank's sums reduced in fp32, docs/zero1.md).
# * Not yet: gradient accumulation with `optimizer_in_backward` and a scaler, or with
#   `optimizer_in_backward` under `data_parallel="zero1"`; optpass refuses them with an
#   error that says so.
