"""Write (and run) the example notebooks from the cell sources below.

    python examples/_build_notebooks.py             # write, execute, save with outputs
    python examples/_build_notebooks.py --no-run    # write the cells only, no outputs
    python examples/_build_notebooks.py dp_sgd.ipynb   # only this notebook

The notebooks are saved with their outputs so that GitHub shows the plots and
the printed results. ``tests/test_notebooks.py`` runs every ``examples/*.ipynb``
and checks that each notebook built here still has the cells written here.
"""

from __future__ import annotations

import argparse
import pathlib

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = pathlib.Path(__file__).resolve().parent


def md(text: str):
    return new_markdown_cell(text.strip("\n"))


def code(text: str):
    return new_code_cell(text.strip("\n"))


OPTIMIZER_IN_BACKWARD = [
    md("""
# Optimizer in backward with optpass

A normal training step keeps **every gradient alive at once**: `loss.backward()`
writes all of the `p.grad` tensors, and only then does `opt.step()` read them.
For a model with N parameters that is N extra numbers sitting in memory at the
end of backward.

optpass can instead run each parameter's optimizer update **inside backward**,
as soon as that parameter's gradient is final. The gradient is used once, by its
update, and then freed. You keep your ordinary `torch.optim` optimizer and your
ordinary training step; you only change how you call `torch.compile`.

This notebook:

1. trains a small MLP with `optimizer_in_backward` and checks it against plain eager PyTorch;
2. plots the estimated memory along the compiled graph, before and after the rewrite;
3. prints the graph diff the rewrite makes;
4. shows a step optpass refuses to rewrite (`clip_grad_norm_`), and why.

Everything runs on CPU in well under a minute.
"""),
    code("""
%matplotlib inline
import copy
import logging

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import optpass
from optpass.models import MLP

# torch prints a harmless "Profiler record function ... will be ignored" warning
# whenever it compiles a torch.optim step; hide it to keep the outputs readable.
logging.getLogger("torch._dynamo.variables.ctx_manager").setLevel(logging.ERROR)

print("torch", torch.__version__, "| optpass", optpass.__version__)
"""),
    md("""
## 1. Train with the optimizer inside backward

A small MLP (eight 256x256 linear layers) and AdamW. We also make an exact copy
of the model with its own AdamW: the *eager twin*, trained with plain PyTorch,
so we can check that optpass trains the same way.

The step must have this shape (it is what optpass can see as one graph):

```python
loss = F.mse_loss(model(x), y)
loss.backward()
out = loss.detach()   # take what you return BEFORE opt.step()
opt.step()
opt.zero_grad()
return out
```

Taking `loss.detach()` before `opt.step()` matters: if `loss` is still needed
after the optimizer, `torch.compile` splits the step at `backward()` and the
backward pass runs outside the compiled graph, where nothing can be rewritten.
"""),
    code("""
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
"""),
    md("""
Compile the step with the `optpass` backend and two options:

* `"optimizer": opt` tells optpass which optimizer the step uses;
* `"optimizer_in_backward": True` asks for the rewrite.

We also pass `"lower": "eager"`, which runs the rewritten graph as is instead
of handing it to Inductor: it compiles faster on a CPU. Drop it on a GPU to
get Inductor's fused kernels.

What happens on each call:

* **call 1** runs the step normally and then `opt.step()` once, eagerly, so that
  AdamW creates its state (`exp_avg`, `exp_avg_sq`, `step`);
* **call 2** compiles the rewritten graph, with each parameter's AdamW update
  spliced into backward, and every later call reuses it.

After every call `p.grad` is `None`: the gradients were consumed inside
backward, and the `opt.step()` in the step has nothing left to do.

`optpass.keep_graphs()` keeps a copy of each graph before and after the
rewrite, with memory estimates; we use them in sections 2 and 3. It costs
nothing at run time, only at compile time.
"""),
    code("""
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
"""),
    md("""
The parameters match the eager twin to float32 rounding: a few 1e-6 from the
first step on (the first update is fused too), on weights of magnitude up to 0.06. They are not bit-identical
because, under *any* `torch.compile` backend, PyTorch traces AdamW's
compile-friendly formulation (bias corrections computed as tensor math), which
rounds slightly differently from the eager one. optpass's own tests compare in
float64, where the two agree to ~1e-13.
"""),
    md("""
## 2. Where the memory goes

optpass estimates the memory a graph needs by walking it in order and tracking
which tensors are still alive after each operation (a tensor is freed right
after its last use). We kept the graph of the fused compile, before and after
the rewrite, together with those estimates:

* `report.memory_before.timeline` / `report.memory_after.timeline`: a list of
  `(node name, live bytes right after that node)`, one entry per operation;
* `report.gradient_bytes`: the size of all gradients together.

The compile we want is the one where the `optimizer_in_backward` pass was applied.
"""),
    code("""
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
ax.annotate(f"{(end_before - end_after) / MB:.2f} MB of gradients alive at the end of backward\\n"
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
"""),
    md("""
How to read it:

* The **red** graph is forward + backward as you wrote it. Memory climbs during
  backward as gradients pile up, and at the end all of them are still alive:
  they are outputs that become `p.grad`, waiting for `opt.step()`, which runs
  afterwards as a separate graph on top of this peak. (The zigzag at the top is
  each gradient being copied into its `.grad` tensor.)
* The **blue** graph has each AdamW update spliced in right after its gradient
  is final. It is longer (the updates are now part of it) but stays flat: at
  any time at most one gradient is alive, and at the end none is. The gradient
  bytes live at its peak drop to (about) zero.
* The small bumps in the blue graph are AdamW's temporaries: with
  `lower="eager"` the update's elementwise ops run one by one, each making a
  parameter-sized tensor. Inductor (the default lowering) fuses them into one
  kernel, so on a real run they mostly disappear.

The saving grows with the model: every gradient but the one being updated, so
roughly one copy of the model's parameters.
"""),
    md("""
## 3. What the rewrite did to the graph

`optpass.graph_diff(before, after)` prints a unified diff of the two graphs, one
line per operation, with stable names. A 2-layer MLP (4 -> 8 -> 2) with SGD and
momentum keeps it short. `torch._dynamo.reset()` clears the compile cache so
this section starts fresh.

Inputs are named `in0`, `in1`, ... in order: here `in0`-`in5` are the four
parameters and the batch `x`, `y`; `in6` is the learning rate and `in7`-`in10`
are the four momentum buffers.
"""),
    code("""
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
"""),
    md("""
Each block of `+` lines is one parameter's SGD-with-momentum update
(`buf = 0.9 * buf + grad; p = p - lr * buf`, ending in in-place `copy_` writes
into the parameter and its momentum buffer). It is placed right after the line
that finishes that parameter's gradient (`view_0` is the last layer's bias
gradient, `t_5` its weight gradient, and so on, backwards through the model).

At the bottom, the `-` lines are the copies that turned each gradient into a
`.grad` tensor; they are gone, and the graph returns `None` instead of the four
gradients.
"""),
    md("""
## 4. When optpass refuses: global gradient clipping

Running an update early is only correct if it needs nothing but its own
gradient. `torch.nn.utils.clip_grad_norm_` breaks that: it scales every
gradient by the norm of *all* gradients, which is not known until backward has
finished. Updating a parameter before that would apply an unclipped update.

optpass checks this on the captured graph before rewriting anything (it
follows which gradients flow into which values, so it catches any transform
that mixes gradients, not just `clip_grad_norm_` by name). It refuses with an
error that names the line that mixes them. `torch.compile` wraps backend errors
in its own exception type, so we catch `Exception` and print the message. In a
notebook the "line" is in a cell, which Python names after a temporary file.
"""),
    code("""
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
print("\\nNo update was applied: the parameters are unchanged.")
"""),
    md("""
The refusal happens at compile time, before the step runs, so a model is never
trained with clipping silently skipped. To train this step, either keep
`clip_grad_norm_` and compile without `optimizer_in_backward`, or drop the
global clipping.

## Summary

* `options={"optimizer": opt, "optimizer_in_backward": True}` runs each
  parameter's `torch.optim` update inside backward; you keep your optimizer,
  its `state_dict()`, and your LR scheduler.
* Training matches eager PyTorch, `p.grad` is `None` after each step, and the
  memory for all gradients at the end of backward is gone.
* optpass proves the rewrite is legal on your step, and refuses with the
  offending line when it is not.
"""),
]

DP_SGD = [
    md("""
# DP-SGD with optpass: per-sample clipping without per-sample weight gradients

DP-SGD (differentially private SGD) clips **each sample's** gradient to norm at
most `C`, sums the clipped gradients, adds Gaussian noise and takes a step. With
`torch.func` the step is a few lines, but `vmap(grad(...))` builds, for every
`Linear` weight, a per-sample gradient of shape `[B, out, in]`: B copies of the
weight, only to take one norm per sample and one weighted sum.

The `per_sample_grad_norm` pass of optpass rewrites that graph: each per-sample
weight gradient `bmm(Gᵀ, X) -> [B, out, in]` is replaced by

* `optpass::per_sample_grad_sq_norm(X, G)`: the per-sample squared norms, computed
  from the layer's input `X` and output gradient `G` without the `[B, out, in]` tensor;
* one GEMM `(coef ⊙ G)ᵀ X` for the clipped sum.

This notebook (CPU, well under two minutes):

1. trains a small MLP with DP-SGD compiled with `backend="optpass"`, and checks every
   step against the same step run eagerly with the same random seeds;
2. prints the graph diff of the rewrite;
3. compares the estimated memory of the graph before and after;
4. shows which layers of a sequence model keep their per-sample gradient, and why;
5. trains with Poisson sampling (a different batch size every step, 0 included): batches
   padded to a few sizes with a mask, so the step compiles once per size bucket;
6. computes the privacy budget ε with Opacus's RDP accountant.
"""),
    code("""
import copy
import logging

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import optpass
from optpass.capture import GraphKind
from optpass.models import MLP

logging.getLogger("torch._dynamo.variables.ctx_manager").setLevel(logging.ERROR)
print("torch", torch.__version__, "| optpass", optpass.__version__)
"""),
    md("""
## 1. The DP-SGD step

The step as you would write it with `torch.func`. Two details make it one graph
that optpass can rewrite:

* the per-sample work happens in a helper that returns what the step returns
  (`norms`) **before** `opt.step()`;
* `per_sample` is not used after `opt.step()`: a value alive across the
  optimizer's graph break becomes a graph output, and an output per-sample
  gradient has to be materialized.

The noise comes from `torch.randn_like`, i.e. torch's global generator, so calling
`torch.manual_seed(s)` before the compiled step and before the eager step gives
both the same noise (`lower="eager"` runs the rewritten aten graph as is, drawing
random numbers in the same order as eager PyTorch).
"""),
    code("""
N, FEATURES, CLASSES = 2048, 32, 4     # synthetic data set: a random linear teacher
B = 64                                 # batch size
C = 1.0                                # clipping norm
NOISE = 1.0                            # noise multiplier (noise std = NOISE * C)
STEPS = 40
DELTA = 1e-5

g = torch.Generator().manual_seed(0)
X_all = torch.randn(N, FEATURES, generator=g)
teacher = torch.randn(FEATURES, CLASSES, generator=g)
Y_all = (X_all @ teacher).argmax(1)


def one_sample_loss(out, y):               # out [1, classes], y a class index
    return F.cross_entropy(out, y.unsqueeze(0))


def make_dp_step(model, opt, batch_size, per_sample_loss=one_sample_loss):
    def loss_of_params(params, x, y):
        return per_sample_loss(functional_call(model, params, (x.unsqueeze(0),)), y)

    def clipped_noisy_gradients(x, y):
        params = {k: v.detach() for k, v in model.named_parameters()}
        per_sample = vmap(grad(loss_of_params), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.stack([g.reshape(batch_size, -1).pow(2).sum(1) for g in per_sample.values()]).sum(0).sqrt()
        coef = (C / (norms + 1e-6)).clamp(max=1.0)
        for name, p in model.named_parameters():
            p.grad = (torch.einsum("b,b...->...", coef, per_sample[name])
                      + NOISE * C * torch.randn_like(p)) / batch_size
        return norms

    def dp_step(x, y):
        norms = clipped_noisy_gradients(x, y)   # computed before opt.step()
        opt.step()
        opt.zero_grad()
        return norms
    return dp_step


def accuracy(model):
    with torch.no_grad():
        return (model(X_all).argmax(1) == Y_all).float().mean().item()
"""),
    md("""
## 2. Train, and check every step against eager PyTorch

Two copies of the same MLP: one trained with the compiled step, its *eager twin*
with the same step uncompiled. Batches are drawn uniformly without replacement
from a fixed generator; before each call we reseed torch so both draw the same
noise. The first compiled call runs inside `optpass.keep_graphs()`, which keeps
the graphs before and after the passes in the report.
"""),
    code("""
torch.manual_seed(0)
model = MLP((FEATURES, 128, 128, CLASSES))
opt = torch.optim.SGD(model.parameters(), lr=0.5)
eager_model = copy.deepcopy(model)
eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.5)

compiled_step = torch.compile(make_dp_step(model, opt, B), backend="optpass", options={"lower": "eager"})
eager_step = make_dp_step(eager_model, eager_opt, B)

sampler = torch.Generator().manual_seed(1)
optpass.report.clear_reports()
print(f"accuracy before training: {accuracy(model):.3f}")
max_norm_diff = max_param_diff = 0.0
clipped = []
for step in range(STEPS):
    idx = torch.randperm(N, generator=sampler)[:B]
    x, y = X_all[idx], Y_all[idx]
    torch.manual_seed(1000 + step)
    if step == 0:
        with optpass.keep_graphs():
            norms = compiled_step(x, y)
    else:
        norms = compiled_step(x, y)
    torch.manual_seed(1000 + step)
    expected = eager_step(x, y)
    max_norm_diff = max(max_norm_diff, (norms - expected).abs().max().item())
    max_param_diff = max(max_param_diff, max((p - q).abs().max().item()
                                             for p, q in zip(model.parameters(), eager_model.parameters())))
    clipped.append((norms > C).float().mean().item())
    if step % 10 == 0 or step == STEPS - 1:
        print(f"step {step:2d}: median per-sample grad norm {norms.median().item():.3f}, "
              f"{clipped[-1]:.0%} of the batch clipped, accuracy {accuracy(model):.3f}")

print(f"\\nmax |norms - eager norms| over {STEPS} steps:      {max_norm_diff:.2e}")
print(f"max |params - eager params| after every step:      {max_param_diff:.2e}")
assert max_norm_diff < 1e-4 and max_param_diff < 1e-4
print(f"final accuracy: optpass {accuracy(model):.3f}, eager twin {accuracy(eager_model):.3f}")
"""),
    md("""
The compiled step and the eager step agree to floating-point rounding (the norms
are computed in a different order), at every step, with the same noise. The
model learns despite clipping and noise.

## 3. What the pass did to the graph

The report of the step graph says which passes ran. To keep the diff short we
compile the same step for a single `Linear(4, 3)` layer (batch 6); `context=0`
prints only the changed lines. Read it from the top:

* `bmm_0 = aten.bmm(...)` of shape `[6, 3, 4]` is the per-sample weight gradient,
  `[B, out, in]`; it disappears;
* `per_sample_grad_sq_norm` takes its place in the norm, reading the layer's input
  (`[6, 1, 4]`) and output gradient;
* the clipped sum, a `bmm` that contracted the batch dimension of `[1, 6, 12]`, becomes
  one `mm` of `[3, 6] x [6, 4]`: the output gradients scaled by the clip coefficients
  times the inputs;
* the bias's per-sample gradient is only `[B, out]` (`view_4`); its small `bmm` stays.
"""),
    code("""
step_report = next(r for r in optpass.recent_reports()
                   if r.kind is GraphKind.OTHER and r.graph_after is not None)
for outcome in step_report.passes:
    print(f"{outcome.name:28s} {outcome.status}")

torch._dynamo.reset()
torch.manual_seed(0)
small = torch.nn.Sequential(torch.nn.Linear(4, 3))
small_opt = torch.optim.SGD(small.parameters(), lr=0.1)
small_step = torch.compile(make_dp_step(small, small_opt, 6), backend="optpass",
                           options={"lower": "eager", "passes": ["per_sample_grad_norm"]})
optpass.report.clear_reports()
with optpass.keep_graphs():
    small_step(torch.randn(6, 4), torch.randint(0, 3, (6,)))
small_report = next(r for r in optpass.recent_reports() if r.kind is GraphKind.OTHER)
print()
print(optpass.graph_diff(small_report.graph_before, small_report.graph_after, context=0))
"""),
    md("""
## 4. Estimated memory, before and after

optpass estimates the live memory along each graph (tensor sizes from the traced
shapes, freed after their last use). For the MLP trained above (batch 64,
`Linear(32, 128)`, `Linear(128, 128)`, `Linear(128, 4)`), the per-sample weight
gradients are `[64, 128, 32]`, `[64, 128, 128]` and `[64, 4, 128]`: 64 copies of the
weights. After the pass none of them exists.
"""),
    code("""
MB = 2**20
weights = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}


def per_sample_weight_grads(graph):
    return [n.name for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
            and n.meta["val"].dim() == 3 and n.meta["val"].shape[0] == B
            and tuple(n.meta["val"].shape[1:]) in weights]


before, after = step_report.memory_before, step_report.memory_after
print(f"[B, out, in] per-sample weight gradients in the graph: "
      f"before {len(per_sample_weight_grads(step_report.graph_before))}, "
      f"after {len(per_sample_weight_grads(step_report.graph_after))}")
norm_ops = sum(1 for n in step_report.graph_after.nodes
               if n.target is torch.ops.optpass.per_sample_grad_sq_norm.default)
print(f"per_sample_grad_sq_norm calls after: {norm_ops} (one per Linear weight)")
print(f"estimated peak of the step graph: before {before.peak_bytes / MB:.2f} MB, "
      f"after {after.peak_bytes / MB:.2f} MB ({after.peak_bytes / before.peak_bytes:.0%})")
print(f"parameters: {sum(p.numel() for p in model.parameters()) * 4 / MB:.2f} MB")
"""),
    md("""
## 5. Sequences: which layers keep their per-sample gradient

With sequence inputs `[B, T, in]` the rewrite (book-keeping) keeps each layer's
input `X [B, T, in]` and output gradient `G [B, T, out]` until the clip
coefficients are known, at the end of backward. For a narrow layer and a long
sequence, `T·(in+out) >= in·out`, that is at least as large as the per-sample
gradient itself, and the rewrite would also cost one more GEMM. With
`dp_materialize="auto"` (the default) such a layer keeps its `[B, out, in]`
(fastDP's "mixed" choice), and the pass's notes say why; `"never"` rewrites every
layer. Here `T = 8`: `Linear(32, 128)` has 8·160 < 32·128 and is rewritten;
`Linear(128, 4)` has 8·132 >= 128·4 and is kept. The step is still exact.
"""),
    code("""
T = 8


def sequence_loss(out, y):                # out [1, T, classes], y [T]: the mean over the sample's tokens
    return F.cross_entropy(out[0], y)


torch._dynamo.reset()
torch.manual_seed(0)
seq_model = MLP((FEATURES, 128, CLASSES))  # applied to every token
seq_eager = copy.deepcopy(seq_model)
seq_step = torch.compile(make_dp_step(seq_model, torch.optim.SGD(seq_model.parameters(), lr=0.5), B, sequence_loss),
                         backend="optpass", options={"lower": "eager"})
x, y = torch.randn(B, T, FEATURES), torch.randint(0, CLASSES, (B, T))
optpass.report.clear_reports()
with optpass.keep_graphs():
    torch.manual_seed(7)
    norms = seq_step(x, y)
torch.manual_seed(7)
expected = make_dp_step(seq_eager, torch.optim.SGD(seq_eager.parameters(), lr=0.5), B, sequence_loss)(x, y)
print(f"max |norms - eager norms|: {(norms - expected).abs().max().item():.2e}")

seq_report = next(r for r in optpass.recent_reports() if r.kind is GraphKind.OTHER and r.graph_after is not None)
norm_inputs = [tuple(n.args[0].meta["val"].shape) for n in seq_report.graph_after.nodes
               if n.target is torch.ops.optpass.per_sample_grad_sq_norm.default]
print(f"rewritten (per_sample_grad_sq_norm on X of shape): {norm_inputs}")
for outcome in seq_report.passes:
    if outcome.name == "per_sample_grad_norm":
        for note in outcome.notes:
            print("note:", note)
"""),
    md("""
## 6. Poisson sampling: a different batch size every step

The accountant below assumes Poisson sampling: each example joins a step's batch with
probability `q` (Opacus's `DPDataLoader`), so the batch size changes every step and is
sometimes 0. A compiled `vmap(grad(...))` step would recompile for every new size (and run
eagerly after Dynamo's limit of 8); `mark_dynamic` does not help here, because vmap's batching rule
for `cross_entropy` reads the batch size as an int. So each batch is padded to the next
multiple of `MULTIPLE` with `optpass.pad_batch`, which also returns a mask of the real
examples. The step zeroes the padded examples' clip coefficients with it, after clipping and
before the sum: the sensitivity is unchanged. The sum is divided by the *expected* batch size
`q·N`, as Opacus does, so an empty batch gives the noise alone.

The eager twin runs the same step uncompiled on the unpadded batch (mask all True).
`MULTIPLE = 16` keeps this notebook to a few compiles; √(q·N) = 8 would pad less and compile more.
"""),
    code("""
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch._dynamo.utils import counters

Q = B / N              # sample rate: the expected batch size is q·N = 64
MULTIPLE = 16


def make_poisson_step(model, opt):
    def loss_of_params(params, x, y):
        return one_sample_loss(functional_call(model, params, (x.unsqueeze(0),)), y)

    def clipped_noisy_gradients(x, y, mask):
        params = {k: v.detach() for k, v in model.named_parameters()}
        per_sample = vmap(grad(loss_of_params), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per_sample.values()]).sum(0).sqrt()
        coef = torch.where(mask, (C / (norms + 1e-6)).clamp(max=1.0), 0)   # padding: 0, after clipping
        for name, p in model.named_parameters():
            p.grad = (torch.einsum("b,b...->...", coef, per_sample[name])
                      + NOISE * C * torch.randn_like(p)) / (Q * N)           # the expected batch size
        return norms

    def dp_step(x, y, mask):
        norms = clipped_noisy_gradients(x, y, mask)
        opt.step()
        opt.zero_grad()
        return norms
    return dp_step


torch._dynamo.reset()
counters.clear()
torch.manual_seed(0)
poisson_model = MLP((FEATURES, 128, 128, CLASSES))
poisson_twin = copy.deepcopy(poisson_model)
poisson_step = torch.compile(make_poisson_step(poisson_model, torch.optim.SGD(poisson_model.parameters(), lr=0.5)),
                             backend="optpass", options={"lower": "eager"}, dynamic=False)
eager_poisson_step = make_poisson_step(poisson_twin, torch.optim.SGD(poisson_twin.parameters(), lr=0.5))

sampler = UniformWithReplacementSampler(num_samples=N, sample_rate=Q, steps=12,
                                        generator=torch.Generator().manual_seed(2))
batches = [list(indices) for indices in sampler] + [[]]     # and an empty batch, which Poisson sampling can draw
optpass.report.clear_reports()
worst = 0.0
for step, indices in enumerate(batches):
    x, y = X_all[indices], Y_all[indices]
    before = [p.detach().clone() for p in poisson_model.parameters()]
    torch.manual_seed(2000 + step)
    poisson_step(*optpass.pad_batch(x, y, multiple=MULTIPLE))
    torch.manual_seed(2000 + step)
    eager_poisson_step(x, y, torch.ones(len(indices), dtype=torch.bool))
    worst = max(worst, max((p - q).abs().max().item()
                           for p, q in zip(poisson_model.parameters(), poisson_twin.parameters())))
    print(f"step {step:2d}: batch size {len(indices):2d}, padded to {optpass.bucket_size(len(indices), MULTIPLE)}, "
          f"graphs compiled so far: {counters['stats']['unique_graphs']}")

torch.manual_seed(2000 + len(batches) - 1)                  # the empty batch's update: the noise alone
lr = 0.5
noise_only = max((p - (old - lr * NOISE * C * torch.randn_like(p) / (Q * N))).abs().max().item()
                 for p, old in zip(poisson_model.parameters(), before))
rewrites = [p.status for r in optpass.recent_reports() if r.kind is GraphKind.OTHER
            for p in r.passes if p.name == "per_sample_grad_norm"]
print(f"\\nper_sample_grad_norm on the step graph of each bucket: {rewrites}")
print(f"max |params - eager twin's| after every step: {worst:.2e}")
print(f"empty batch: max |update - noise / (q·N) step|:  {noise_only:.2e}")
assert worst < 1e-4 and noise_only < 1e-6
"""),
    md("""
One graph per bucket the batches were padded to, plus the SGD update graph: after that, no
batch size compiles anything, the empty batch included. The rewrite applied to each
bucket's graph as to any fixed-size step.

## 7. The privacy budget

Each step touches a batch of `B` out of `N` samples, with noise multiplier `NOISE`.
Opacus's RDP accountant turns that into an (ε, δ) guarantee. (Its analysis assumes
Poisson sampling with rate `B / N`, as in section 6; the uniform batches of section 2 are
the usual approximation of it.)
"""),
    code("""
from opacus.accountants import RDPAccountant

accountant = RDPAccountant()
for _ in range(STEPS):
    accountant.step(noise_multiplier=NOISE, sample_rate=B / N)
epsilon = accountant.get_epsilon(delta=DELTA)
print(f"{STEPS} steps, sample rate {B / N:.4f}, noise multiplier {NOISE}: "
      f"(epsilon = {epsilon:.3f}, delta = {DELTA}) differential privacy")
"""),
    md("""
## Summary

* Write DP-SGD with `torch.func` (`vmap(grad(...))`, norms, clip, `einsum`, noise) and
  compile it with `backend="optpass"`; compute what you return before `opt.step()`.
* The `per_sample_grad_norm` pass removes every `[B, out, in]` per-sample `Linear`
  weight gradient: the norms come from `per_sample_grad_sq_norm`, the clipped sum
  from one GEMM. The step gives the same result as eager PyTorch.
* With sequences, a layer whose `[B, out, in]` is no larger than the `X` and `G` the
  rewrite would keep (`T·(in+out) >= in·out`) keeps it (`dp_materialize="auto"`); the
  notes say which and why.
* Poisson sampling: pad each batch with `optpass.pad_batch` and zero the padded examples'
  clip coefficients with its mask. The step then compiles once per bucket, an empty batch
  gives the noise alone, and the result equals the eager step on the unpadded batch.
* Privacy accounting is unchanged: the step is still DP-SGD with the same clipping
  and noise, so Opacus's accountant applies as is.
"""),
]

ZERO1 = [
    md("""
# ZeRO-1 data parallelism with optpass

Data-parallel training usually means `DistributedDataParallel`: every rank holds
the whole model, the whole gradient and the **whole optimizer state** (AdamW: two
numbers per parameter), and all-reduces the gradients every step.

ZeRO-1 keeps each rank's optimizer state to **1/N**: the gradients are averaged
across the ranks, each rank updates its shard of the parameters with its shard of
the optimizer state, and every rank then gets the updated parameters. optpass picks
the collectives by what is fast on the process group's backend: on NCCL a
*reduce-scatter* (each rank receives the averaged gradients of its shard only) and
an *all-gather* (together the bytes of one ring all-reduce); on gloo, whose
reduce-scatter and all-gather are slow, an *all-reduce* of which each rank keeps
its shard and one *broadcast* of each rank's updated shard.

With optpass you keep the **single-device training step** and your ordinary
`torch.optim` optimizer; `options={"data_parallel": "zero1"}` inserts the
collectives and the sharded update into the compiled step. This notebook:

1. shows the training script and runs it on 2 ranks on CPU (gloo), with torchrun;
2. prints the collectives the `shard_optimizer` pass inserted (graph diff);
3. compares the per-rank optimizer-state memory with unsharded AdamW;
4. checks that the result equals single-process training on the whole batch.
"""),
    code("""
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
"""),
    md("""
## 1. The training script

This is all a rank runs. The step is the usual single-device step in the shape
optpass supports (`out = loss.detach()` *before* `opt.step()`); the only
data-parallel parts are `init_process_group`, the rank's slice of the batch and
the option:
"""),
    code("""
source = pathlib.Path("zero1_train.py").read_text()
print(source[source.index("def main"):source.index("    report =")])
"""),
    md("""
Launch it on 2 ranks with `torchrun` (here `python -m torch.distributed.run`;
gloo on CPU). Each rank writes what it measured to a JSON file.
"""),
    code("""
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
"""),
    md("""
## 2. What the pass inserted

The compiled step graph before and after the `shard_optimizer` pass (rank 0,
the steady graph; the first step already ran a sharded graph of the same shape,
which also created the shard's AdamW state). Per bucket (gloo): the gradients are flattened into one
buffer, which `all_reduce_(..., "sum", ...)` starts summing across the ranks as soon as the bucket's
last gradient is computed, while backward goes on; after backward `wait_tensor` waits for it and this
rank takes its chunk (divided by 2), AdamW's own update (harvested from torch.optim) runs on the
chunk and the shard's state, one `broadcast_` per rank sends each rank's updated chunk to the
others, and `copy_` writes the chunks into the parameters. The gradient outputs become `None`, so
`opt.step()` in the step has nothing left to do.
"""),
    code("""
diff = ranks[0]["graph_diff"]
collectives = [line for line in diff.splitlines() if line.startswith("+") and "_c10d_functional" in line]
print("\\n".join(collectives))
print(f"\\n{len(diff.splitlines())} diff lines in all; the first bucket in full:\\n")
lines = diff.splitlines()
gather = next(i for i, line in enumerate(lines) if "broadcast" in line or "all_gather" in line)
end = next(i for i, line in enumerate(lines) if i > gather and "aten.copy_(" in line)
print("\\n".join(lines[:end + 1]))
"""),
    md("""
## 3. Optimizer-state memory per rank

Unsharded AdamW holds `exp_avg` and `exp_avg_sq` for every parameter (plus a
step counter per parameter). Each optpass rank holds them for its chunk of each
bucket only:
"""),
    code("""
model, opt = zero1_train.make_model_and_optimizer()
n_params = sum(p.numel() for p in model.parameters())
unsharded = 2 * 4 * n_params       # exp_avg + exp_avg_sq, fp32
for r in ranks:
    owned = sum(b["owned"] for b in r["buckets"])
    print(f"rank {r['rank']}: {r['state_bytes']:7d} bytes of optimizer state "
          f"({r['state_bytes'] / unsharded:.3f} of unsharded {unsharded}), "
          f"{owned} of {n_params} parameters' elements, {len(r['buckets'])} buckets")
"""),
    md("""
## 4. Same result as single-process training

Train the same model with plain eager PyTorch in this process, on the whole
global batch (both ranks' slices) every step. The parameters optpass's two
ranks ended with must equal these (AdamW under torch.compile differs from eager
torch.optim by float32 rounding only, ~1e-5 relative after 20 steps).
"""),
    code("""
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
"""),
    md("""
## Summary

* `options={"optimizer": opt, "data_parallel": "zero1"}` turns a single-device step
  into data-parallel ZeRO-1: no DDP wrapper, no special optimizer class.
* The collectives are functional collectives inside the compiled graph, chosen
  per backend (gloo: an all-reduce per bucket, started during backward, and a
  broadcast per rank's shard; NCCL: a reduce-scatter and an all-gather per bucket,
  DDP's all-reduce volume); each rank keeps 1/N of the optimizer state.
* `optimizer_in_backward=True` as well runs each bucket's update during backward;
  `optpass.save_sharded_checkpoint` / `load_sharded_checkpoint` save the shards
  with torch.distributed.checkpoint and resume on any number of ranks.
"""),
]

MIXED_PRECISION = [
    md("""
# fp32 master weights for bf16 parameters with optpass

Training with `bfloat16` parameters halves the memory of the weights, but
`torch.optim` then updates the bf16 weights directly, and every update is
rounded to bf16. bf16 keeps 8 significant bits: next to a weight of 1.0 the
closest other values are 0.996 and 1.0078, so **any update smaller than
2⁻⁸ ≈ 0.004 is rounded away** and the weight never moves. Megatron-LM (and
DeepSpeed, Apex AMP O2) keep an fp32 *master* copy of every half-precision
parameter: the gradient is cast to fp32, the optimizer updates the fp32 copy,
and the model gets the copy rounded to bf16.

optpass does the same inside the compiled step, with your ordinary optimizer
built over the bf16 parameters:
`options={"optimizer": opt, "master_weights": torch.float32}`.

This notebook shows the stall, its fix, the graph diff, and what a checkpoint holds.
"""),
    code("""
%matplotlib inline
import copy
import logging

import matplotlib.pyplot as plt
import torch
import torch.nn as nn
import torch.nn.functional as F

import optpass

logging.getLogger("torch._dynamo.variables.ctx_manager").setLevel(logging.ERROR)
print("torch", torch.__version__, "| optpass", optpass.__version__)
"""),
    md("""
## 1. A model whose every update is small

Eight weights start at 1.0 and should move to 1.02. With SGD at `lr=0.05` each
update is about 0.002 at first, and smaller later: below the 0.004 that a bf16
weight of 1.0 can register.

The same model is trained three times, from the same data:

* **fp32**: eager PyTorch, float32 weights (the reference);
* **bf16**: eager PyTorch, bfloat16 weights, `torch.optim` updating them directly;
* **bf16 + masters**: the same bf16 model and optimizer, compiled with optpass and
  `master_weights` (and `optimizer_in_backward`: each update runs as soon as its
  gradient is final).
"""),
    code("""
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
"""),
    md("""
Train 40 steps and record the mean weight (for the optpass run also its fp32
master, read with `optpass.master_weights(opt)`). The first call of the optpass
step compiles it; `keep_graphs()` keeps its graphs for section 2.
"""),
    code("""
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
"""),
    md("""
Plain bf16 training never leaves 1.0: every update was rounded away. With fp32
masters the small updates add up in the master, and the bf16 weights follow it,
one bf16 step (2⁻⁷ ≈ 0.0078 above 1.0) at a time. The bf16 weights are exactly
the masters rounded:
"""),
    code("""
master = optpass.master_weights(mixed_opt)[mixed.weight]
print("master:      ", master)
print("bf16 weights:", mixed.weight.data)
print("weights == masters rounded to bf16:", torch.equal(mixed.weight, master.to(torch.bfloat16)))
"""),
    md("""
## 2. What optpass did to the step

The graph diff of the compiled step: the gradient is cast to fp32
(`convert_element_type`), torch.optim's own SGD update runs on the master
(an input of the graph, like the optimizer state and lr), the new master is
written in place, and its bf16 rounding is copied into the parameter. The
gradient's output slot becomes `None`: `p.grad` stays None and `opt.step()`
has nothing to do.
"""),
    code("""
report = next(r for r in optpass.recent_reports()
              if any(p.name == "master_weights" and p.status == "applied" for p in r.passes))
print(optpass.graph_diff(report.graph_before, report.graph_after, shapes=False, context=1))
"""),
    md("""
## 3. Checkpoints

`opt.state_dict()` holds the fp32 masters and the fp32 optimizer state, under
one entry of `state` that torch.optim's `load_state_dict` keeps as it is (it
casts parameter state to the parameter's dtype, which would round the masters to
bf16). Saving and loading is the usual `torch.save` / `opt.load_state_dict`,
also in a fresh process before the first step.
"""),
    code("""
saved = mixed_opt.state_dict()["state"]
print(list(saved))
entry = saved["optpass.master_weights"]
print("masters:", {i: (tuple(t.shape), t.dtype) for i, t in entry["masters"].items()})
print("state:  ", {i: {k: v.dtype for k, v in s.items()} for i, s in entry["state"].items()})
"""),
    md("""
## 4. fp16 with dynamic loss scaling

fp16 has a narrow range (up to 65504), so fp16 training scales the loss up before
backward and the gradients down before the update, and skips a step whose gradients
overflowed. Pass your `torch.amp.GradScaler` as `options["grad_scaler"]` and keep the
plain step (no `scaler.scale(...)` in it: Dynamo cannot trace it). Below, batch 5 holds
an inf: that step changes nothing and halves the scale. With `growth_interval=3` the scale
doubles after every 3 clean steps; a step whose scaled gradients overflow fp16 is skipped
as well (step 6 here). The scale lives in the
scaler (`scaler.get_scale()`, `scaler.state_dict()`); `optpass.skipped_steps(scaler)` counts
the skips.
"""),
    code("""
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
"""),
    md("""
**Gradient accumulation** with a scaler: compile the micro-step (backward, no
`opt.step()`) with the same options as the step. Each micro-step runs backward of
`loss * scale`, as `scaler.scale(loss).backward()` does, so `.grad` sums scaled gradients;
the step that follows unscales, checks and applies the sum. Below, 3 calls per update
against torch.amp driving the Megatron-way reference (fp32 masters by hand) with the same
micro-steps: the same scale, and parameters equal bit for bit.
"""),
    code("""
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
"""),
    md("""
## Summary

* `options={"optimizer": opt, "master_weights": torch.float32}`: an fp32 master per
  bf16/fp16 parameter, torch.optim's update on the master, the rounded master in the
  parameter (fp32 parameters are updated as they are).
* With `optimizer_in_backward=True` each master is updated as soon as its gradient is
  final; without it, after backward. Either way no step keeps an fp32 copy of the gradients.
* With `data_parallel="zero1"` each rank keeps only its shard of the fp32 masters and
  of the state (README, "With ZeRO-1: masters sharded").
* `grad_scaler`: fp16 dynamic loss scaling with torch.amp.GradScaler's semantics inside
  the step, gradient accumulation included (micro-steps compiled with the same options);
  `clip_grad_norm` clips the fp32 (unscaled) gradients. Both work with
  `data_parallel="zero1"` too (README).
* With `data_parallel="zero1"` gradient accumulation works too (micro-steps compiled with
  the same options, the update after backward: each rank's sums reduced in fp32, README).
* Not yet: gradient accumulation with `optimizer_in_backward` and a scaler, or with
  `optimizer_in_backward` under `data_parallel="zero1"`; optpass refuses them with an
  error that says so.
"""),
]

NOTEBOOKS = {"optimizer_in_backward.ipynb": OPTIMIZER_IN_BACKWARD, "dp_sgd.ipynb": DP_SGD,
             "zero1.ipynb": ZERO1, "mixed_precision.ipynb": MIXED_PRECISION}


def build(cells) -> nbformat.NotebookNode:
    nb = new_notebook(cells=[nbformat.from_dict(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for index, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{index:02d}"   # stable ids: regenerating gives a small diff
    return nb


def execute(nb: nbformat.NotebookNode) -> None:
    from nbclient import NotebookClient

    NotebookClient(nb, timeout=300, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(HERE)}}).execute()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-run", action="store_true", help="write the cells without executing them")
    parser.add_argument("names", nargs="*", choices=[[]] + list(NOTEBOOKS), metavar="NOTEBOOK",
                        help=f"only these notebooks (default: all of {', '.join(NOTEBOOKS)})")
    args = parser.parse_args()
    for name, cells in NOTEBOOKS.items():
        if args.names and name not in args.names:
            continue
        nb = build(cells)
        if not args.no_run:
            execute(nb)
        path = HERE / name
        nbformat.validate(nb)
        nbformat.write(nb, path)
        print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KB)")


if __name__ == "__main__":
    main()
