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
# # DP-SGD with optpass: per-sample clipping without per-sample weight gradients
#
# DP-SGD (differentially private SGD) clips **each sample's** gradient to norm at
# most `C`, sums the clipped gradients, adds Gaussian noise and takes a step. With
# `torch.func` the step is a few lines, but `vmap(grad(...))` builds, for every
# `Linear` weight, a per-sample gradient of shape `[B, out, in]`: B copies of the
# weight, only to take one norm per sample and one weighted sum.
#
# The `per_sample_grad_norm` pass of optpass rewrites that graph: each per-sample
# weight gradient `bmm(Gᵀ, X) -> [B, out, in]` is replaced by
#
# * `optpass::per_sample_grad_sq_norm(X, G)`: the per-sample squared norms, computed
#   from the layer's input `X` and output gradient `G` without the `[B, out, in]` tensor;
# * one GEMM `(coef ⊙ G)ᵀ X` for the clipped sum.
#
# This notebook (CPU, well under two minutes):
#
# 1. trains a small MLP with DP-SGD compiled with `backend="optpass"`, and checks every
#    step against the same step run eagerly with the same random seeds;
# 2. prints the graph diff of the rewrite;
# 3. compares the estimated memory of the graph before and after;
# 4. shows which layers of a sequence model keep their per-sample gradient, and why;
# 5. trains with Poisson sampling (a different batch size every step, 0 included): batches
#    padded to a few sizes with a mask, so the step compiles once per size bucket;
# 6. computes the privacy budget ε with Opacus's RDP and PRV accountants (PrivacyEngine's default).

# %%
import copy
import logging

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import optpass
from optpass.capture import GraphKind
from optpass.demo.models import MLP

logging.getLogger("torch._dynamo.variables.ctx_manager").setLevel(logging.ERROR)
print("torch", torch.__version__, "| optpass", optpass.__version__)

# %% [markdown]
# ## 1. The DP-SGD step
#
# The step as you would write it with `torch.func`. Three details make it DP-SGD as Opacus
# computes it, in one graph that optpass can rewrite:
#
# * only the trainable parameters are differentiated (`requires_grad`), as Opacus clips them: a
#   frozen layer's per-sample gradient would change every clip factor and give it a `.grad`;
# * the per-sample work happens in a helper that returns what the step returns
#   (`norms`) **before** `opt.step()`;
# * `per_sample` is not used after `opt.step()`: a value alive across the
#   optimizer's graph break becomes a graph output, and an output per-sample
#   gradient has to be materialized.
#
# The noise comes from `torch.randn_like`, i.e. torch's global generator, so calling
# `torch.manual_seed(s)` before the compiled step and before the eager step gives
# both the same noise (`lower="eager"` runs the rewritten aten graph as is, drawing
# random numbers in the same order as eager PyTorch).

# %%
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
        trainable = {k: p for k, p in model.named_parameters() if p.requires_grad}   # frozen layers stay out
        params = {k: p.detach() for k, p in trainable.items()}
        per_sample = vmap(grad(loss_of_params), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per_sample.values()]).sum(0).sqrt()
        coef = (C / (norms + 1e-6)).clamp(max=1.0)
        for name, p in trainable.items():
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


# %% [markdown]
# ## 2. Train, and check every step against eager PyTorch
#
# Two copies of the same MLP: one trained with the compiled step, its *eager twin*
# with the same step uncompiled. Batches are drawn uniformly without replacement
# from a fixed generator; before each call we reseed torch so both draw the same
# noise. The first compiled call runs inside `optpass.keep_graphs()`, which keeps
# the graphs before and after the passes in the report.

# %%
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

print(f"\nmax |norms - eager norms| over {STEPS} steps:      {max_norm_diff:.2e}")
print(f"max |params - eager params| after every step:      {max_param_diff:.2e}")
assert max_norm_diff < 1e-4 and max_param_diff < 1e-4
print(f"final accuracy: optpass {accuracy(model):.3f}, eager twin {accuracy(eager_model):.3f}")

# %% [markdown]
# The compiled step and the eager step agree to floating-point rounding (the norms
# are computed in a different order), at every step, with the same noise. The
# model learns despite clipping and noise.
#
# ## 3. What the pass did to the graph
#
# The report of the step graph says which passes ran. To keep the diff short we
# compile the same step for a single `Linear(4, 3)` layer (batch 6); `context=0`
# prints only the changed lines. Read it from the top:
#
# * `bmm_0 = aten.bmm(...)` of shape `[6, 3, 4]` is the per-sample weight gradient,
#   `[B, out, in]`; it disappears;
# * `per_sample_grad_sq_norm` takes its place in the norm, reading the layer's input
#   (`[6, 1, 4]`) and output gradient;
# * the clipped sum, a `bmm` that contracted the batch dimension of `[1, 6, 12]`, becomes
#   one `mm` of `[3, 6] x [6, 4]`: the output gradients scaled by the clip coefficients
#   times the inputs;
# * the bias's per-sample gradient is only `[B, out]` (`view_4`); its small `bmm` stays.

# %%
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

# %% [markdown]
# ## 4. Estimated memory, before and after
#
# optpass estimates the live memory along each graph (tensor sizes from the traced
# shapes, freed after their last use). For the MLP trained above (batch 64,
# `Linear(32, 128)`, `Linear(128, 128)`, `Linear(128, 4)`), the per-sample weight
# gradients are `[64, 128, 32]`, `[64, 128, 128]` and `[64, 4, 128]`: 64 copies of the
# weights. After the pass none of them exists.

# %%
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

# %% [markdown]
# ## 5. Sequences: which layers keep their per-sample gradient
#
# With sequence inputs `[B, T, in]` the rewrite (book-keeping) keeps each layer's
# input `X [B, T, in]` and output gradient `G [B, T, out]` until the clip
# coefficients are known, at the end of backward. For a narrow layer and a long
# sequence, `T·(in+out) >= in·out`, that is at least as large as the per-sample
# gradient itself, and the rewrite would also cost one more GEMM. With
# `dp_materialize="auto"` (the default) such a layer keeps its `[B, out, in]`
# (fastDP's "mixed" choice), and the pass's notes say why; `"never"` rewrites every
# layer. Here `T = 8`: `Linear(32, 128)` has 8·160 < 32·128 and is rewritten;
# `Linear(128, 4)` has 8·132 >= 128·4 and is kept. The step is still exact.

# %%
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

# %% [markdown]
# ## 6. Poisson sampling: a different batch size every step
#
# The accountant below assumes Poisson sampling: each example joins a step's batch with
# probability `q` (Opacus's `DPDataLoader`), so the batch size changes every step and is
# sometimes 0. A compiled `vmap(grad(...))` step would recompile for every new size (and run
# eagerly after Dynamo's limit of 8); `mark_dynamic` does not help here, because vmap's batching rule
# for `cross_entropy` reads the batch size as an int. So each batch is padded to the next
# multiple of `MULTIPLE` with `optpass.pad_batch`, which also returns a mask of the real
# examples. The step zeroes the padded examples' clip coefficients with it, after clipping and
# before the sum: the sensitivity is unchanged. The sum is divided by the *expected* batch size
# `q·N`, as Opacus does, so an empty batch gives the noise alone.
#
# The eager twin runs the same step uncompiled on the unpadded batch (mask all True).
# `MULTIPLE = 16` keeps this notebook to a few compiles; √(q·N) = 8 would pad less and compile more.

# %%
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch._dynamo.utils import counters

Q = B / N              # sample rate: the expected batch size is q·N = 64
MULTIPLE = 16


def make_poisson_step(model, opt):
    def loss_of_params(params, x, y):
        return one_sample_loss(functional_call(model, params, (x.unsqueeze(0),)), y)

    def clipped_noisy_gradients(x, y, mask):
        trainable = {k: p for k, p in model.named_parameters() if p.requires_grad}
        params = {k: p.detach() for k, p in trainable.items()}
        per_sample = vmap(grad(loss_of_params), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per_sample.values()]).sum(0).sqrt()
        coef = torch.where(mask, (C / (norms + 1e-6)).clamp(max=1.0), 0)   # padding: 0, after clipping
        for name, p in trainable.items():
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
print(f"\nper_sample_grad_norm on the step graph of each bucket: {rewrites}")
print(f"max |params - eager twin's| after every step: {worst:.2e}")
print(f"empty batch: max |update - noise / (q·N) step|:  {noise_only:.2e}")
assert worst < 1e-4 and noise_only < 1e-6

# %% [markdown]
# One graph per bucket the batches were padded to, plus the SGD update graph: after that, no
# batch size compiles anything, the empty batch included. The rewrite applied to each
# bucket's graph as to any fixed-size step.
#
# ## 7. The privacy budget
#
# Each step touches a batch of `B` out of `N` samples, with noise multiplier `NOISE`.
# An accountant turns that into an (ε, δ) guarantee. (Its analysis assumes Poisson sampling
# with rate `B / N`, as in section 6; the uniform batches of section 2 are the usual
# approximation of it.) Opacus has two: the RDP accountant, and the PRV accountant, which
# `opacus.PrivacyEngine()` uses by default (`PrivacyEngine(accountant="prv")`) and which gives a
# tighter ε for the same training. Both are given here; the guarantee is the same DP-SGD's,
# only its bound differs.

# %%
from opacus.accountants import PRVAccountant, RDPAccountant

for accountant in (RDPAccountant(), PRVAccountant()):
    for _ in range(STEPS):
        accountant.step(noise_multiplier=NOISE, sample_rate=B / N)
    epsilon = accountant.get_epsilon(delta=DELTA)
    print(f"{type(accountant).__name__}: {STEPS} steps, sample rate {B / N:.4f}, noise multiplier "
          f"{NOISE}: (epsilon = {epsilon:.3f}, delta = {DELTA}) differential privacy")

# %% [markdown]
# ## Summary
#
# * Write DP-SGD with `torch.func` (`vmap(grad(...))`, norms, clip, `einsum`, noise) and
#   compile it with `backend="optpass"`; compute what you return before `opt.step()`.
# * The `per_sample_grad_norm` pass removes every `[B, out, in]` per-sample `Linear`
#   weight gradient: the norms come from `per_sample_grad_sq_norm`, the clipped sum
#   from one GEMM. The step gives the same result as eager PyTorch.
# * With sequences, a layer whose `[B, out, in]` is no larger than the `X` and `G` the
#   rewrite would keep (`T·(in+out) >= in·out`) keeps it (`dp_materialize="auto"`); the
#   notes say which and why.
# * Poisson sampling: pad each batch with `optpass.pad_batch` and zero the padded examples'
#   clip coefficients with its mask. The step then compiles once per bucket, an empty batch
#   gives the noise alone, and the result equals the eager step on the unpadded batch.
# * Privacy accounting is unchanged: the step is still DP-SGD with the same clipping
#   and noise, so Opacus's accountants apply as they are (PRV is PrivacyEngine's default, RDP
#   gives a looser ε).
