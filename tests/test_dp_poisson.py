"""DP-SGD with Poisson sampling: a different batch size every step, 0 included, without a compile per size.

Recipe (docs/dp_sgd.md, "Poisson sampling"): pad each batch to a few sizes with ``optpass.pad_batch``
and zero the padded examples' clip coefficients with its mask; normalise by the expected batch
size q·N (Opacus's ``expected_batch_size``). The reference is the plain DP-SGD step on the
unpadded Poisson batch, eager: same clipped sum, same noise (same seed), B = 0 included.

Also: the per_sample_grad_norm rewrite on a graph whose batch size is symbolic
(``mark_dynamic``), for steps whose vmap keeps B symbolic.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch._dynamo.utils import counters
from torch.func import functional_call, grad, vmap

import optpass
from optpass.capture import GraphKind

IN, HIDDEN, CLASSES = 8, 16, 4
C, NOISE, LR = 1.0, 0.5, 0.5
N, Q = 40, 0.075                     # expected batch size q·N = 3
EXPECTED = N * Q
MULTIPLE = 4                         # batches padded to 4 or 8 examples


def make_poisson_step(model, opt, padded):
    """The DP-SGD step of docs/dp_sgd.md's recipe. ``padded``: takes (x, y, mask) and zeroes the padded
    examples' clip coefficients; else the plain step on (x, y) of any size B >= 0 (eager reference)."""
    def loss_of_params(params, x, y):
        return F.cross_entropy(functional_call(model, params, (x.unsqueeze(0),)), y.unsqueeze(0))

    def clipped_noisy_gradients(x, y, mask=None):
        params = {k: v.detach() for k, v in model.named_parameters()}
        per_sample = vmap(grad(loss_of_params), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per_sample.values()]).sum(0).sqrt()
        coef = (C / (norms + 1e-6)).clamp(max=1.0)
        if mask is not None:
            coef = torch.where(mask, coef, 0)           # after clipping, before the sum
        for name, p in model.named_parameters():
            p.grad = (torch.einsum("b,b...->...", coef, per_sample[name])
                      + NOISE * C * torch.randn_like(p)) / EXPECTED
        return norms

    if padded:
        def step(x, y, mask):
            norms = clipped_noisy_gradients(x, y, mask)
            opt.step()
            opt.zero_grad()
            return norms
    else:
        def step(x, y):
            norms = clipped_noisy_gradients(x, y)
            opt.step()
            opt.zero_grad()
            return norms
    return step


def twins():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
    ref = copy.deepcopy(model)
    return model, ref, torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)


def test_pad_batch_pads_to_the_next_multiple_and_masks_the_padding():
    x, y = torch.randn(5, 3), torch.arange(5)
    xp, yp, mask = optpass.pad_batch(x, y, multiple=4)
    assert xp.shape == (8, 3) and yp.shape == (8,) and mask.tolist() == [True] * 5 + [False] * 3
    assert torch.equal(xp[:5], x) and torch.equal(yp[:5], y) and not xp[5:].any() and not yp[5:].any()
    assert [optpass.bucket_size(b, 4) for b in (0, 1, 4, 5, 8)] == [4, 4, 4, 8, 8]
    empty, mask = optpass.pad_batch(torch.randn(0, 3), multiple=4)
    assert empty.shape == (4, 3) and not mask.any()
    with pytest.raises(ValueError, match="disagree on the batch size"):
        optpass.pad_batch(x, y[:4], multiple=4)


def test_poisson_batches_compile_once_per_bucket_and_equal_the_eager_dp_step():
    """24 Poisson batches (Opacus's sampler, q·N = 3: sizes 0..8 with 0 and 1 among them) padded to
    4 or 8: after one warm-up step per bucket nothing recompiles (error_on_recompile), the rewrite
    is applied, and every step equals the eager step on the unpadded batch; an empty batch's step
    is the noise alone, divided by the expected batch size."""
    model, ref, opt, ref_opt = twins()
    compiled = torch.compile(make_poisson_step(model, opt, padded=True), backend="optpass",
                             options={"lower": "eager"}, dynamic=False)
    reference = make_poisson_step(ref, ref_opt, padded=False)
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(N, IN, generator=g), torch.randint(0, CLASSES, (N,), generator=g)

    def step(seed, x, y):
        torch.manual_seed(seed)
        norms = compiled(*optpass.pad_batch(x, y, multiple=MULTIPLE))
        torch.manual_seed(seed)
        expected = reference(x, y)
        torch.testing.assert_close(norms[:len(x)], expected, rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)

    optpass.report.clear_reports()
    for bucket in (4, 8):                               # warm-up: one full batch per bucket
        step(bucket, X[:bucket], Y[:bucket])
    compiles = counters["stats"]["unique_graphs"]
    assert compiles == 3                                # the step per bucket, and the SGD update
    sampler = UniformWithReplacementSampler(num_samples=N, sample_rate=Q, steps=24,
                                            generator=torch.Generator().manual_seed(0))
    sizes = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i, indices in enumerate(sampler):
            sizes.append(len(indices))
            before = [p.detach().clone() for p in model.parameters()]
            step(100 + i, X[indices], Y[indices])
            if not indices:                             # B = 0: the update is the noise alone
                torch.manual_seed(100 + i)
                for p, old in zip(model.parameters(), before):
                    noise = NOISE * C * torch.randn_like(p) / EXPECTED
                    torch.testing.assert_close(p, old - LR * noise, rtol=1e-5, atol=1e-6)
    assert {0, 1} <= set(sizes) and max(sizes) == 8 and len(set(sizes)) >= 7
    assert counters["stats"]["unique_graphs"] == compiles
    outcomes = [p for r in optpass.recent_reports() if r.kind is GraphKind.OTHER
                for p in r.passes if p.name == "per_sample_grad_norm"]
    assert [p.status for p in outcomes] == ["applied", "applied"]


# ---------------------------------------------------------------- a symbolic batch size

def make_regression_step(model, opt):
    """DP-SGD with a mean-squared-error loss: no ``gather`` and no Embedding, so vmap keeps B
    symbolic under ``mark_dynamic`` (cross_entropy's and Embedding's batching rules do not)."""
    def loss_of_params(params, x, y):
        return F.mse_loss(functional_call(model, params, (x.unsqueeze(0),)), y.unsqueeze(0))

    def clipped_noisy_gradients(x, y):
        params = {k: v.detach() for k, v in model.named_parameters()}
        per_sample = vmap(grad(loss_of_params), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per_sample.values()]).sum(0).sqrt()
        coef = (C / (norms + 1e-6)).clamp(max=1.0)
        for name, p in model.named_parameters():
            p.grad = (torch.einsum("b,b...->...", coef, per_sample[name])
                      + NOISE * C * torch.randn_like(p)) / EXPECTED
        return norms

    def step(x, y):
        norms = clipped_noisy_gradients(x, y)
        opt.step()
        opt.zero_grad()
        return norms
    return step


@pytest.mark.parametrize("lower", ["eager", "inductor"])
def test_rewrite_applies_to_a_symbolic_batch_size_compiled_once(lower):
    """mark_dynamic on B: ONE step graph for every size, compiled from symbolic inputs; the pass
    emits its views and GEMM with B as a graph value (a SymInt input, sym_size), the norm op runs,
    no [B, out, in] tensor remains, and every step equals eager."""
    model, ref, opt, ref_opt = twins()
    compiled = torch.compile(make_regression_step(model, opt), backend="optpass",
                             options={"lower": lower, "dp_materialize": "never"})
    reference = make_regression_step(ref, ref_opt)
    sizes = [5, 7, 3, 9, 2, 6] if lower == "eager" else [5, 3, 7]
    optpass.report.clear_reports()
    with torch._inductor.config.patch(fallback_random=True), optpass.keep_graphs():
        for i, b in enumerate(sizes):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(b, IN, generator=g), torch.randn(b, CLASSES, generator=g)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(y, 0)
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                torch.manual_seed(i)
                norms = compiled(x, y)
            torch.manual_seed(i)
            torch.testing.assert_close(norms, reference(x, y), rtol=1e-5, atol=1e-6)
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    report = next(r for r in optpass.recent_reports() if r.kind is GraphKind.OTHER)
    assert next(p for p in report.passes if p.name == "per_sample_grad_norm").status == "applied"
    batch = report.graph_after.find_nodes(op="placeholder")
    assert any(isinstance(n.meta.get("val"), torch.SymInt) for n in batch)        # B is a graph input
    after = [n for n in report.graph_after.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    assert sum(n.target is torch.ops.optpass.per_sample_grad_sq_norm.default for n in after) == 2
    weights = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}

    def per_sample_weight_gradients(graph):                      # [B, out, in], B symbolic
        shapes = {n.name: n.meta["val"].shape for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
                  and n.meta["val"].dim() == 3 and isinstance(n.meta["val"].shape[0], torch.SymInt)}
        return [name for name, shape in shapes.items()
                if all(type(s) is int for s in shape[1:]) and tuple(shape[1:]) in weights]

    assert per_sample_weight_gradients(report.graph_before)
    assert per_sample_weight_gradients(report.graph_after) == []


VOCAB, TOKENS = 13, 5


def make_token_step(model, opt):
    """The recipe's step for a token model (an Embedding, then a Linear over the vocabulary); with
    ``mask`` None, the unpadded step."""
    def loss_of_params(params, x, y):
        return F.cross_entropy(functional_call(model, params, (x.unsqueeze(0),))[0], y)

    def step(x, y, mask=None):
        trainable = {k: p for k, p in model.named_parameters() if p.requires_grad}
        params = {k: p.detach() for k, p in trainable.items()}
        per_sample = vmap(grad(loss_of_params), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per_sample.values()]).sum(0).sqrt()
        coef = (C / (norms + 1e-6)).clamp(max=1.0)
        if mask is not None:
            coef = torch.where(mask, coef, 0)
        for name, p in trainable.items():
            p.grad = (torch.einsum("b,b...->...", coef, per_sample[name])
                      + NOISE * C * torch.randn_like(p)) / EXPECTED
        out = norms.detach()
        opt.step()
        opt.zero_grad()
        return out
    return step


def test_an_unpadded_empty_batch_fails_with_a_note_that_points_at_pad_batch_and_the_padded_one_adds_the_noise():
    """Poisson sampling draws an empty batch after a non-empty one: vmap over 0 examples fails while
    Dynamo traces (an Embedding's batched backward), before optpass sees a graph; the error carries
    optpass's note naming pad_batch. Padded, the same batch trains: the update is the noise alone. An error inside a vmap over
    a non-empty batch gets no such note."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB))
    step = torch.compile(make_token_step(model, torch.optim.SGD(model.parameters(), lr=LR)), backend="optpass",
                         options={"lower": "eager"}, dynamic=False)
    step(torch.randint(0, VOCAB, (3, TOKENS)), torch.randint(0, VOCAB, (3, TOKENS)))   # a first, non-empty batch
    x, y = torch.zeros(0, TOKENS, dtype=torch.long), torch.zeros(0, TOKENS, dtype=torch.long)
    with pytest.raises(RuntimeError) as failed:
        step(x, y)
    assert any("optpass.pad_batch(x, y, multiple=m)" in note for note in getattr(failed.value, "__notes__", ()))

    before = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(7)
    step(*optpass.pad_batch(x, y, multiple=MULTIPLE))
    torch.manual_seed(7)
    for p, old in zip(model.parameters(), before):
        torch.testing.assert_close(p, old - LR * NOISE * C * torch.randn_like(p) / EXPECTED, rtol=1e-6, atol=1e-7)

    torch._dynamo.reset()
    wrong = torch.compile(make_token_step(nn.Sequential(nn.Linear(IN + 1, VOCAB)), torch.optim.SGD(
        model.parameters(), lr=LR)), backend="optpass", options={"lower": "eager"})
    with pytest.raises(RuntimeError) as failed:                    # [3, IN] into Linear(IN + 1, ...)
        wrong(torch.randn(3, IN), torch.zeros(3, dtype=torch.long))
    assert not any("pad_batch" in note for note in getattr(failed.value, "__notes__", ()))
