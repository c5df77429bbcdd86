"""per_sample_grad_norm reads a per-sample norm however it is written: Opacus's spelling, torch.linalg,
einsum, a cat or stack of flattened gradients, a norm inside the vmapped function; the clipped sum as
einsum, tensordot or a broadcast product. Each rewrites every weight, equals the eager step and keeps
the docs' spelling's memory."""

import copy

import pytest
from expecttest import TestCase
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import optpass
from optpass.capture import GraphKind

B, IN, HIDDEN, CLASSES = 6, 8, 16, 4
MAX_GRAD_NORM = 1.0


def _flat(per_sample):
    return [g.reshape(len(g), -1) for g in per_sample.values()]


NORMS = {
    "docs": lambda ps: torch.stack([g.flatten(1).pow(2).sum(1) for g in ps.values()]).sum(0).sqrt(),
    # Opacus's clip_and_accumulate: per-parameter norms, stacked, their norm
    "opacus": lambda ps: torch.stack([g.norm(2, dim=-1) for g in _flat(ps)], dim=1).norm(2, dim=1),
    "linalg_vector_norm": lambda ps: torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g, dim=tuple(range(1, g.dim()))) for g in ps.values()], 1), dim=1),
    "linalg_norm": lambda ps: torch.stack([torch.linalg.norm(g, dim=1) for g in _flat(ps)]).pow(2).sum(0).sqrt(),
    "square": lambda ps: sum(g.square().sum(tuple(range(1, g.dim()))) for g in ps.values()).sqrt(),
    "self_product": lambda ps: sum((g * g).flatten(1).sum(1) for g in ps.values()).sqrt(),
    "product_of_views": lambda ps: sum((g * g).sum(1) for g in _flat(ps)).sqrt(),
    "einsum": lambda ps: sum(torch.einsum("bi,bi->b", g, g) for g in _flat(ps)).sqrt(),
    "cat": lambda ps: torch.cat(_flat(ps), dim=1).norm(2, dim=1),
    "cat_squared": lambda ps: torch.cat(_flat(ps), dim=1).pow(2).sum(1).sqrt(),
    "keepdim": lambda ps: sum(g.pow(2).sum(1, keepdim=True) for g in _flat(ps)).sqrt().squeeze(1),
}

CLIPPED_SUMS = {
    "einsum": lambda coef, g: torch.einsum("b,b...->...", coef, g),
    "tensordot": lambda coef, g: torch.tensordot(coef, g, dims=1),
    "broadcast": lambda coef, g: (coef.view(-1, *[1] * (g.dim() - 1)) * g).sum(0),
    "index": lambda coef, g: (coef[(slice(None),) + (None,) * (g.dim() - 1)] * g).sum(0),
}


def make_step(model, opt, norms_of, clipped_sum, norms_in_vmap=False):
    def loss_of_params(params, x, y):
        return F.cross_entropy(functional_call(model, params, (x.unsqueeze(0),)), y.unsqueeze(0))

    def gradients_and_norm(params, x, y):          # the norm computed per sample, inside the vmap
        g = grad(loss_of_params)(params, x, y)
        return g, torch.stack([v.norm() for v in g.values()]).norm()

    def dp_step(x, y):
        params = {k: v.detach() for k, v in model.named_parameters()}
        if norms_in_vmap:
            per_sample, norms = vmap(gradients_and_norm, in_dims=(None, 0, 0))(params, x, y)
        else:
            per_sample = vmap(grad(loss_of_params), in_dims=(None, 0, 0))(params, x, y)
            norms = norms_of(per_sample)
        coef = (MAX_GRAD_NORM / (norms + 1e-6)).clamp(max=1.0)
        for name, p in model.named_parameters():
            p.grad = clipped_sum(coef, per_sample[name]) / B
        out = norms.detach()
        opt.step()
        opt.zero_grad()
        return out
    return dp_step


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(B, IN, generator=g), torch.randint(0, CLASSES, (B,), generator=g)


def per_sample_sized(graph):
    sizes = {B * HIDDEN * IN, B * HIDDEN * HIDDEN, B * CLASSES * HIDDEN}
    return [n.name for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
            and n.meta["val"].dim() >= 2 and n.meta["val"].numel() in sizes and n.meta["val"].shape[0] == B]


def run_against_eager(norms_of, clipped_sum, lower="eager", steps=3, norms_in_vmap=False):
    """The compiled step and the eager one side by side; the DP graph's report."""
    model = mlp()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    compiled = torch.compile(make_step(model, opt, norms_of, clipped_sum, norms_in_vmap), backend="optpass",
                             options={"lower": lower, "dp_materialize": "never"})
    eager = make_step(reference, ref_opt, norms_of, clipped_sum, norms_in_vmap)
    optpass.report.clear_reports()
    with optpass.keep_graphs():
        for step in range(steps):
            x, y = batch(step)
            norms, expected = compiled(x, y), eager(x, y)
            torch.testing.assert_close(norms, expected, rtol=1e-5, atol=1e-6)
            for p, q in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    return next(r for r in optpass.recent_reports() if r.kind is GraphKind.OTHER and r.graph_after is not None)


def _rewritten(report):
    outcome = next(p for p in report.passes if p.name == "per_sample_grad_norm")
    return outcome, [line for line in outcome.notes if ": rewritten" in line]


@pytest.mark.parametrize("spelling", list(NORMS))
def test_every_norm_spelling_rewrites_every_weight_and_equals_eager(spelling):
    report = run_against_eager(NORMS[spelling], CLIPPED_SUMS["einsum"])
    outcome, rewritten = _rewritten(report)
    assert outcome.status == "applied" and len(rewritten) == 3, outcome
    assert per_sample_sized(report.graph_before) and per_sample_sized(report.graph_after) == []


def test_a_norm_computed_inside_the_vmapped_function_is_rewritten():
    report = run_against_eager(None, CLIPPED_SUMS["einsum"], norms_in_vmap=True)
    outcome, rewritten = _rewritten(report)
    assert len(rewritten) == 3, outcome
    assert per_sample_sized(report.graph_after) == []


@pytest.mark.parametrize("clipped", list(CLIPPED_SUMS))
def test_every_clipped_sum_spelling_is_rewritten(clipped):
    report = run_against_eager(NORMS["opacus"], CLIPPED_SUMS[clipped], steps=2)
    outcome, rewritten = _rewritten(report)
    assert len(rewritten) == 3, outcome


@pytest.mark.parametrize("spelling", ["opacus", "linalg_vector_norm", "cat"])
def test_norm_spellings_under_inductor(spelling):
    report = run_against_eager(NORMS[spelling], CLIPPED_SUMS["einsum"], lower="inductor", steps=2)
    outcome, rewritten = _rewritten(report)
    assert len(rewritten) == 3, outcome


def test_every_spelling_keeps_the_docs_spellings_estimated_peak():
    """The rewritten graphs hold the same tensors: explain's estimate of each spelling's peak is the
    docs' (a concatenation of the flattened gradients is split, not copied)."""
    peaks = {}
    for spelling in ("docs", "opacus", "linalg_vector_norm", "cat", "einsum"):
        peaks[spelling] = run_against_eager(NORMS[spelling], CLIPPED_SUMS["einsum"], steps=1).memory_after.peak_bytes
    assert all(peak <= peaks["docs"] * 1.01 for peak in peaks.values()), peaks


def test_a_spelling_it_cannot_read_gets_a_note_that_shows_the_one_that_works():
    def per_sample_loop(ps):              # each sample's norm on its own: the per-sample gradient is indexed
        return torch.stack([torch.stack([g[b].norm() for g in ps.values()]).norm() for b in range(B)])

    report = run_against_eager(per_sample_loop, CLIPPED_SUMS["einsum"], steps=1)
    outcome = next(p for p in report.passes if p.name == "per_sample_grad_norm")
    assert outcome.status == "skipped"
    assert "is also used by select" in outcome.reason
    assert "torch.linalg.vector_norm(g.flatten(1), dim=1)" in outcome.reason


class TestSpelledNormGraph(TestCase):
    def test_a_cat_of_flattened_gradients_normed_becomes_the_sum_of_each_ones_squared_norm(self):
        """One Linear, norms as torch.cat([g.flatten(1) ...]).norm(2, dim=1): the concatenation is split
        into per-weight squared norms, the weight's becomes the norm op, the cat is gone."""
        torch.manual_seed(0)
        model = nn.Linear(IN, CLASSES)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        step = torch.compile(make_step(model, opt, NORMS["cat"], CLIPPED_SUMS["einsum"]), backend="optpass",
                             options={"lower": "eager", "dp_materialize": "never",
                                      "passes": ["per_sample_grad_norm"]})
        optpass.report.clear_reports()
        with optpass.keep_graphs():
            step(*batch(0))
        report = next(r for r in optpass.recent_reports() if r.kind is GraphKind.OTHER)
        self.assertExpectedInline(optpass.graph_diff(report.graph_before, report.graph_after, context=0), """\
--- before
+++ after
@@ -50,3 +49,0 @@
-bmm_0: f32[6, 4, 8] = aten.bmm(view_2, view_3)
-view_4: f32[6, 4, 8] = aten.view(bmm_0, [6, 4, 8])
-transpose_1: f32[6, 8, 4] = aten.transpose.int(view_4, 1, 2)
@@ -54,8 +51,10 @@
-view_5: f32[6, 4] = aten.view(sum_2, [6, 4])
-transpose_2: f32[6, 4, 8] = aten.transpose.int(transpose_1, 1, 2)
-view_6: f32[6, 32] = aten.view(transpose_2, [6, -1])
-view_7: f32[6, 4] = aten.view(view_5, [6, -1])
-cat_0: f32[6, 36] = aten.cat([view_6, view_7], 1)
-linalg_vector_norm_0: f32[6] = aten.linalg_vector_norm(cat_0, 2, [1])
-add_1: f32[6] = aten.add.Tensor(linalg_vector_norm_0, 1e-06)
-reciprocal_0: f32[6] = aten.reciprocal(add_1)
+view_4: f32[6, 4] = aten.view(sum_2, [6, 4])
+view_5: f32[6, 4] = aten.view(view_4, [6, -1])
+permute_0: f32[6, 1, 4] = aten.permute(view_2, [0, 2, 1])
+per_sample_grad_sq_norm_0: f32[6] = optpass.per_sample_grad_sq_norm(view_3, permute_0, 'auto')
+pow_0: f32[6, 4] = aten.pow.Tensor_Scalar(view_5, 2)
+sum_3: f32[6] = aten.sum.dim_IntList(pow_0, [1])
+add_1: f32[6] = aten.add.Tensor(per_sample_grad_sq_norm_0, sum_3)
+sqrt_0: f32[6] = aten.sqrt(add_1)
+add_2: f32[6] = aten.add.Tensor(sqrt_0, 1e-06)
+reciprocal_0: f32[6] = aten.reciprocal(add_2)
@@ -66,11 +65,17 @@
-permute_0: f32[1, 1, 6] = aten.permute(unsqueeze_5, [1, 2, 0])
-permute_1: f32[4, 8, 6] = aten.permute(transpose_2, [1, 2, 0])
-permute_2: f32[6, 1, 1] = aten.permute(permute_0, [2, 0, 1])
-view_8: f32[1, 1, 6] = aten.view(permute_2, [1, 1, 6])
-permute_3: f32[6, 4, 8] = aten.permute(permute_1, [2, 0, 1])
-view_9: f32[1, 6, 32] = aten.view(permute_3, [1, 6, 32])
-bmm_1: f32[1, 1, 32] = aten.bmm(view_8, view_9)
-view_10: f32[1, 4, 8] = aten.view(bmm_1, [1, 4, 8])
-permute_4: f32[4, 8, 1] = aten.permute(view_10, [1, 2, 0])
-view_11: f32[4, 8] = aten.view(permute_4, [4, 8])
-div_2: f32[4, 8] = aten.div.Tensor(view_11, 6)
+permute_1: f32[1, 1, 6] = aten.permute(unsqueeze_5, [1, 2, 0])
+permute_2: f32[6, 1, 1] = aten.permute(permute_1, [2, 0, 1])
+view_6: f32[1, 1, 6] = aten.view(permute_2, [1, 1, 6])
+permute_3: f32[6, 1, 4] = aten.permute(view_2, [0, 2, 1])
+clone_0: f32[1, 1, 6] = aten.clone(view_6, memory_format=torch.contiguous_format)
+view_7: f32[6, 1, 1] = aten.view(clone_0, [6, 1, 1])
+mul_3: f32[6, 1, 4] = aten.mul.Tensor(permute_3, view_7)
+clone_1: f32[6, 1, 4] = aten.clone(mul_3, memory_format=torch.contiguous_format)
+view_8: f32[6, 4] = aten.view(clone_1, [6, 4])
+view_9: f32[6, 8] = aten.view(view_3, [6, 8])
+permute_4: f32[4, 6] = aten.permute(view_8, [1, 0])
+mm_1: f32[4, 8] = aten.mm(permute_4, view_9)
+view_10: f32[1, 1, 32] = aten.view(mm_1, [1, 1, 32])
+view_11: f32[1, 4, 8] = aten.view(view_10, [1, 4, 8])
+permute_5: f32[4, 8, 1] = aten.permute(view_11, [1, 2, 0])
+view_12: f32[4, 8] = aten.view(permute_5, [4, 8])
+div_2: f32[4, 8] = aten.div.Tensor(view_12, 6)
@@ -78,12 +83,12 @@
-permute_5: f32[1, 6] = aten.permute(unsqueeze_6, [1, 0])
-permute_6: f32[4, 6] = aten.permute(view_5, [1, 0])
-permute_7: f32[6, 1] = aten.permute(permute_5, [1, 0])
-view_12: f32[1, 1, 6] = aten.view(permute_7, [1, 1, 6])
-permute_8: f32[6, 4] = aten.permute(permute_6, [1, 0])
-view_13: f32[1, 6, 4] = aten.view(permute_8, [1, 6, 4])
-bmm_2: f32[1, 1, 4] = aten.bmm(view_12, view_13)
-view_14: f32[1, 4] = aten.view(bmm_2, [1, 4])
-permute_9: f32[4, 1] = aten.permute(view_14, [1, 0])
-view_15: f32[4] = aten.view(permute_9, [4])
-div_3: f32[4] = aten.div.Tensor(view_15, 6)
-detach_2: f32[6] = aten.detach(linalg_vector_norm_0)
+permute_6: f32[1, 6] = aten.permute(unsqueeze_6, [1, 0])
+permute_7: f32[4, 6] = aten.permute(view_4, [1, 0])
+permute_8: f32[6, 1] = aten.permute(permute_6, [1, 0])
+view_13: f32[1, 1, 6] = aten.view(permute_8, [1, 1, 6])
+permute_9: f32[6, 4] = aten.permute(permute_7, [1, 0])
+view_14: f32[1, 6, 4] = aten.view(permute_9, [1, 6, 4])
+bmm_0: f32[1, 1, 4] = aten.bmm(view_13, view_14)
+view_15: f32[1, 4] = aten.view(bmm_0, [1, 4])
+permute_10: f32[4, 1] = aten.permute(view_15, [1, 0])
+view_16: f32[4] = aten.view(permute_10, [4])
+div_3: f32[4] = aten.div.Tensor(view_16, 6)
+detach_2: f32[6] = aten.detach(sqrt_0)""")
