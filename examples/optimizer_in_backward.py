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
# # Optimizer in backward with optpass
#
# A normal training step keeps **every gradient alive at once**: `loss.backward()`
# writes all of the `p.grad` tensors, and only then does `opt.step()` read them.
# For a model with N parameters that is N extra numbers sitting in memory at the
# end of backward.
#
# optpass can instead run each parameter's optimizer update **inside backward**,
# as soon as that parameter's gradient is final. The gradient is used once, by its
# update, and then freed. You keep your ordinary `torch.optim` optimizer and your
# ordinary training step; you only change how you call `torch.compile`.
#
# This notebook:
#
# 1. trains a small MLP with `optimizer_in_backward` and checks it against plain eager PyTorch;
# 2. plots the estimated memory along the compiled graph, before and after the rewrite;
# 3. prints the graph diff the rewrite makes;
# 4. shows a step optpass refuses to rewrite (`clip_grad_norm_`), and why.
#
# Everything runs on CPU in well under a minute.

# %%
# %matplotlib inline
import copy
import logging

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import optpass
from optpass.demo.models import MLP

# torch prints a harmless "Profiler record function ... will be ignored" warning
# whenever it compiles a torch.optim step; hide it to keep the outputs readable.
logging.getLogger("torch._dynamo.variables.ctx_manager").setLevel(logging.ERROR)

print("torch", torch.__version__, "| optpass", optpass.__version__)

# %% [markdown]
# ## 1. Train with the optimizer inside backward
#
# A small MLP (eight 256x256 linear layers) and AdamW. We also make an exact copy
# of the model with its own AdamW: the *eager twin*, trained with plain PyTorch,
# so we can check that optpass trains the same way.
#
# The step must have this shape (it is what optpass can see as one graph):
#
# ```python
# loss = F.mse_loss(model(x), y)
# loss.backward()
# out = loss.detach()   # take what you return BEFORE opt.step()
# opt.step()
# opt.zero_grad()
# return out
# ```
#
# Taking `loss.detach()` before `opt.step()` matters: if `loss` is still needed
# after the optimizer, `torch.compile` splits the step at `backward()` and the
# backward pass runs outside the compiled graph, where nothing can be rewritten.

# %%
torch.manual_seed(0)
model = MLP((256,) * 9)                      # 8 linear layers, 256 -> 256
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

eager_model = copy.deepcopy(model)           # the eager twin: same weights,
eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)  # its own AdamW


def make_train_step(model, opt):
    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    return train_step


n_params = sum(p.numel() for p in model.parameters())
print(f"{n_params:,} parameters = {n_params * 4 / 2**20:.2f} MB of float32 gradients per step")

# %% [markdown]
# Compile the step with the `optpass` backend and two options:
#
# * `"optimizer": opt` tells optpass which optimizer the step uses;
# * `"optimizer_in_backward": True` asks for the rewrite.
#
# We also pass `"lower": "eager"`, which runs the rewritten graph as is instead
# of handing it to Inductor: it compiles faster on a CPU. Drop it on a GPU to
# get Inductor's fused kernels.
#
# What happens on each call:
#
# * **call 1** compiles the rewritten graph, with each parameter's AdamW update
#   spliced into backward, and runs it: the update is fused from the first step.
#   optpass creates AdamW's state (`exp_avg`, `exp_avg_sq`, `step`) before the
#   step, as torch.optim would, without running an update;
# * every later call reuses that graph (an optimizer whose first update creates
#   its state from the gradient, SGD with momentum, compiles once more at call 2).
#
# After every call `p.grad` is `None`: the gradients were consumed inside
# backward, and the `opt.step()` in the step has nothing left to do.
#
# `optpass.keep_graphs()` keeps a copy of each graph before and after the
# rewrite, with memory estimates; we use them in sections 2 and 3. It costs
# nothing at run time, only at compile time.

# %%
step = torch.compile(
    make_train_step(model, opt),
    backend="optpass",
    options={"optimizer": opt, "optimizer_in_backward": True, "lower": "eager"},
)
eager_step = make_train_step(eager_model, eager_opt)

data = torch.Generator().manual_seed(0)
with optpass.keep_graphs():
    for i in range(6):
        x, y = torch.randn(16, 256, generator=data), torch.randn(16, 256, generator=data)
        loss = step(x, y)
        eager_loss = eager_step(x, y)
        max_diff = max((p - q).abs().max().item()
                       for p, q in zip(model.parameters(), eager_model.parameters()))
        grads_gone = all(p.grad is None for p in model.parameters())
        print(f"step {i}: loss {loss.item():.6f} (eager {eager_loss.item():.6f})  "
              f"max |param - eager param| = {max_diff:.1e}  all p.grad None: {grads_gone}")
        assert grads_gone and max_diff < 1e-5

# %% [markdown]
# The parameters match the eager twin to float32 rounding: a few 1e-6 from the
# first step on (the first update is fused too), on weights of magnitude up to 0.06. They are not bit-identical
# because, under *any* `torch.compile` backend, PyTorch traces AdamW's
# compile-friendly formulation (bias corrections computed as tensor math), which
# rounds slightly differently from the eager one. optpass's own tests compare in
# float64, where the two agree to ~1e-13.

# %% [markdown]
# ## 2. Where the memory goes
#
# optpass estimates the memory a graph needs by walking it in order and tracking
# which tensors are still alive after each operation (a tensor is freed right
# after its last use). We kept the graph of the fused compile, before and after
# the rewrite, together with those estimates:
#
# * `report.memory_before.timeline` / `report.memory_after.timeline`: a list of
#   `(node name, live bytes right after that node)`, one entry per operation;
# * `report.gradient_bytes`: the size of all gradients together.
#
# The compile we want is the one where the `optimizer_in_backward` pass was applied.

# %%
report = next(r for r in reversed(optpass.recent_reports())
              if any(p.name == "optimizer_in_backward" and p.status == "applied" for p in r.passes))
before, after = report.memory_before, report.memory_after
MB = 2**20

inputs = after.timeline[0][1]                # parameters, AdamW state and the batch: live throughout
end_before, end_after = before.timeline[-1][1], after.timeline[-1][1]

fig, ax = plt.subplots(figsize=(10, 4.5))
ax.plot([b / MB for _, b in before.timeline], color="tab:red", lw=2,
        label=f"before the pass ({len(before.timeline)} ops), peak {before.peak_bytes / MB:.2f} MB")
ax.plot([b / MB for _, b in after.timeline], color="tab:blue", lw=1.5,
        label=f"after the pass ({len(after.timeline)} ops), peak {after.peak_bytes / MB:.2f} MB")
ax.axhline(inputs / MB, color="gray", ls=":", label="inputs: parameters + AdamW state + batch")

# At the end of the unfused graph every gradient is still alive, waiting for opt.step().
x_end = len(before.timeline) - 1
ax.annotate("", xy=(x_end, end_before / MB), xytext=(x_end, end_after / MB),
            arrowprops=dict(arrowstyle="<->", color="black"))
ax.annotate(f"{(end_before - end_after) / MB:.2f} MB of gradients alive at the end of backward\n"
            f"(all {report.gradient_bytes / MB:.2f} MB of them, waiting for opt.step())",
            xy=(x_end, (end_before + end_after) / 2 / MB), xytext=(x_end + 30, (end_before + after.peak_bytes) / 2 / MB),
            arrowprops=dict(arrowstyle="-", color="gray"), va="center", fontsize=9)

ax.set_xlabel("node index in the compiled graph (forward, then backward)")
ax.set_ylabel("estimated live memory (MB)")
ax.set_title("Live memory along the training-step graph, before and after optimizer_in_backward")
ax.set_ylim(inputs / MB - 0.2, before.peak_bytes / MB + 0.4)
ax.legend(loc="upper right", fontsize=9)
fig.tight_layout()
plt.show()

rows = [
    ("peak (MB)", before.peak_bytes, after.peak_bytes),
    ("gradient bytes live at the peak (MB)",
     before.bytes_by_tag_at_peak.get("gradient", 0), after.bytes_by_tag_at_peak.get("gradient", 0)),
    ("live at the end of the step (MB)", end_before, end_after),
]
print(f"{'':40s}{'before':>10s}{'after':>10s}")
for name, b, a in rows:
    print(f"{name:40s}{b / MB:10.2f}{a / MB:10.2f}")
print(f"largest single gradient: {report.largest_gradient_bytes / MB:.2f} MB")

# %% [markdown]
# How to read it:
#
# * The **red** graph is forward + backward as you wrote it. Memory climbs during
#   backward as gradients pile up, and at the end all of them are still alive:
#   they are outputs that become `p.grad`, waiting for `opt.step()`, which runs
#   afterwards as a separate graph on top of this peak. (The zigzag at the top is
#   each gradient being copied into its `.grad` tensor.)
# * The **blue** graph has each AdamW update spliced in right after its gradient
#   is final. It is longer (the updates are now part of it) but stays flat: at
#   any time at most one gradient is alive, and at the end none is. The gradient
#   bytes live at its peak drop to (about) zero.
# * The small bumps in the blue graph are AdamW's temporaries: with
#   `lower="eager"` the update's elementwise ops run one by one, each making a
#   parameter-sized tensor. Inductor (the default lowering) fuses them into one
#   kernel, so on a real run they mostly disappear.
#
# The saving grows with the model: every gradient but the one being updated, so
# roughly one copy of the model's parameters.

# %% [markdown]
# ## 3. What the rewrite did to the graph
#
# `optpass.graph_diff(before, after)` prints a unified diff of the two graphs, one
# line per operation, with stable names. A 2-layer MLP (4 -> 8 -> 2) with SGD and
# momentum keeps it short. `torch._dynamo.reset()` clears the compile cache so
# this section starts fresh.
#
# Inputs are named `in0`, `in1`, ... in order: here `in0`-`in5` are the four
# parameters and the batch `x`, `y`; `in6` is the learning rate and `in7`-`in10`
# are the four momentum buffers.

# %%
torch._dynamo.reset()
torch.manual_seed(0)
small = MLP((4, 8, 2))
small_opt = torch.optim.SGD(small.parameters(), lr=0.1, momentum=0.9)
small_step = torch.compile(
    make_train_step(small, small_opt),
    backend="optpass",
    options={"optimizer": small_opt, "optimizer_in_backward": True, "lower": "eager"},
)
x, y = torch.randn(3, 4), torch.randn(3, 2)
small_step(x, y)                  # call 1: fused already; SGD's first update creates the momentum buffers
with optpass.keep_graphs():
    small_step(x, y)              # call 2: compiles the steady fused graph (it reads the buffers)
small_report = next(r for r in reversed(optpass.recent_reports()) if r.graph_after is not None)
print(optpass.graph_diff(small_report.graph_before, small_report.graph_after, shapes=False, context=1))

# %% [markdown]
# Each block of `+` lines is one parameter's SGD-with-momentum update
# (`buf = 0.9 * buf + grad; p = p - lr * buf`, ending in in-place `copy_` writes
# into the parameter and its momentum buffer). It is placed right after the line
# that finishes that parameter's gradient (`view_0` is the last layer's bias
# gradient, `t_5` its weight gradient, and so on, backwards through the model).
#
# At the bottom, the `-` lines are the copies that turned each gradient into a
# `.grad` tensor; they are gone, and the graph returns `None` instead of the four
# gradients.

# %% [markdown]
# ## 4. When optpass refuses: global gradient clipping
#
# Running an update early is only correct if it needs nothing but its own
# gradient. `torch.nn.utils.clip_grad_norm_` breaks that: it scales every
# gradient by the norm of *all* gradients, which is not known until backward has
# finished. Updating a parameter before that would apply an unclipped update.
#
# optpass checks this on the captured graph before rewriting anything (it
# follows which gradients flow into which values, so it catches any transform
# that mixes gradients, not just `clip_grad_norm_` by name). It refuses with an
# error that names the line that mixes them. `torch.compile` wraps backend errors
# in its own exception type, so we catch `Exception` and print the message. In a
# notebook the "line" is in a cell, which Python names after a temporary file.

# %%
torch._dynamo.reset()
torch.manual_seed(0)
clip_model = MLP((4, 8, 2))
clip_opt = torch.optim.SGD(clip_model.parameters(), lr=0.1, momentum=0.9)


def clipped_train_step(x, y):
    loss = F.mse_loss(clip_model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(clip_model.parameters(), 1.0)
    out = loss.detach()
    clip_opt.step()
    clip_opt.zero_grad()
    return out


clipped_step = torch.compile(
    clipped_train_step,
    backend="optpass",
    options={"optimizer": clip_opt, "optimizer_in_backward": True, "lower": "eager"},
)
weights_before = [p.detach().clone() for p in clip_model.parameters()]
try:
    clipped_step(x, y)
except Exception as e:  # torch.compile wraps optpass.OptpassError in BackendCompilerFailed
    message = str(e)
    print(type(e).__name__)
    print(message)
else:
    raise AssertionError("expected optpass to refuse this step")

assert "clip_grad_norm_" in message
assert all(torch.equal(a, b) for a, b in zip(weights_before, clip_model.parameters()))
print("\nNo update was applied: the parameters are unchanged.")

# %% [markdown]
# The refusal happens at compile time, before the step runs, so a model is never
# trained with clipping silently skipped. To train this step, either keep
# `clip_grad_norm_` and compile without `optimizer_in_backward`, or drop the
# global clipping.
#
# ## 5. Low-bit optimizer state: torchao's AdamW8bit
#
# Fusing the update removes the gradients; what is left is the parameters and the
# optimizer's state. torchao's low-bit optimizers shrink the state: `AdamW8bit`
# keeps each moment in one byte per element plus an fp32 scale per block of 256
# (`pip install "optpass[torchao]"`). optpass fuses torchao's own update
# (dequantize, step, requantize) into backward, as it does torch.optim's.
# The state stays torchao's, so `state_dict()` and checkpoints work as before.
#
# The eager twin trains with the same torchao optimizer. Its gradients round a
# little differently from the compiled step's, and a moment near a quantization
# boundary can then take the neighbouring code: the two runs drift apart faster
# than with fp32 AdamW (docs/low_bit_optimizers.md), so the check is looser.

# %%
import importlib.util

if importlib.util.find_spec("torchao") is None:
    print("torchao is not installed: pip install 'optpass[torchao]'")
else:
    import torchao.optim

    torch.manual_seed(0)
    low_bit_model = MLP((1024, 1024, 1024))          # two 1024x1024 layers: quantized moments
    low_bit_opt = torchao.optim.AdamW8bit(low_bit_model.parameters(), lr=1e-3)
    twin = copy.deepcopy(low_bit_model)
    twin_opt = torchao.optim.AdamW8bit(twin.parameters(), lr=1e-3)
    low_bit_step = torch.compile(
        make_train_step(low_bit_model, low_bit_opt),
        backend="optpass",
        options={"optimizer": low_bit_opt, "optimizer_in_backward": True, "lower": "eager"},
    )
    twin_step = make_train_step(twin, twin_opt)
    for i in range(4):
        x, y = torch.randn(16, 1024, generator=data), torch.randn(16, 1024, generator=data)
        low_bit_step(x, y)
        twin_step(x, y)
    max_diff = max((p - q).abs().max().item() for p, q in zip(low_bit_model.parameters(), twin.parameters()))
    weight = low_bit_model[0].weight
    moment = low_bit_opt.state[weight]["exp_avg"]
    held = (weight.numel() * 4 + sum(low_bit_opt.state[weight][k].codes.numel() + low_bit_opt.state[weight][k].scale.numel() * 4
                                     for k in ("exp_avg", "exp_avg_sq")))
    print(f"max |param - eager torchao param| after 4 steps: {max_diff:.1e}")
    print(f"exp_avg is {type(moment).__name__}; weight + state: {held / weight.numel():.2f} bytes per parameter")
    assert type(moment).__name__ == "OptimState8bit" and max_diff < 1e-3
    assert all(p.grad is None for p in low_bit_model.parameters())

# %% [markdown]
# ## Summary
#
# * `options={"optimizer": opt, "optimizer_in_backward": True}` runs each
#   parameter's `torch.optim` update inside backward; you keep your optimizer,
#   its `state_dict()`, and your LR scheduler.
# * Training matches eager PyTorch, `p.grad` is `None` after each step, and the
#   memory for all gradients at the end of backward is gone.
# * optpass proves the rewrite is legal on your step, and refuses with the
#   offending line when it is not.
# * torchao's low-bit optimizers fuse the same way: about 6 bytes per parameter
#   with `AdamW8bit`, where fp32 AdamW with every gradient alive holds 16.
