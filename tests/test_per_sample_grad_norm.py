"""per_sample_grad_norm: DP-SGD written with torch.func runs without [B, out, in] tensors."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase
from torch.func import functional_call, grad, vmap

import optpass
from optpass.capture import GraphKind

B, IN, HIDDEN, CLASSES = 6, 8, 16, 4
MAX_GRAD_NORM, NOISE = 1.0, 0.5


def make_dp_step(model, opt, return_per_sample=False):
    """DP-SGD the plain way: per-sample gradients, clip each sample, add noise, step."""
    def loss_of_params(params, x, y):
        out = functional_call(model, params, (x.unsqueeze(0),))
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def clipped_noisy_gradients(x, y):
        params = {k: v.detach() for k, v in model.named_parameters()}
        per_sample = vmap(grad(loss_of_params), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.stack([g.reshape(B, -1).pow(2).sum(1) for g in per_sample.values()]).sum(0).sqrt()
        coef = (MAX_GRAD_NORM / (norms + 1e-6)).clamp(max=1.0)
        for name, p in model.named_parameters():
            p.grad = (torch.einsum("b,b...->...", coef, per_sample[name])
                      + NOISE * MAX_GRAD_NORM * torch.randn_like(p)) / B
        return norms, per_sample

    # What the step returns is taken before opt.step(): values alive across the optimizer's
    # graph break become graph outputs, and an output per-sample gradient must be materialized.
    if return_per_sample:
        def dp_step(x, y):
            norms, per_sample = clipped_noisy_gradients(x, y)
            out = norms, per_sample["0.weight"]
            opt.step()
            opt.zero_grad()
            return out
    else:
        def dp_step(x, y):
            norms, _ = clipped_noisy_gradients(x, y)
            opt.step()
            opt.zero_grad()
            return norms
    return dp_step


def mlp():
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def batch(step, tokens):
    g = torch.Generator().manual_seed(step)
    if tokens == 0:                                   # 2-D inputs: one "token" per sample
        return torch.randn(B, IN, generator=g), torch.randint(0, CLASSES, (B,), generator=g)
    return torch.randn(B, tokens, IN, generator=g), torch.randint(0, CLASSES, (B, tokens), generator=g)


def twins():
    torch.manual_seed(0)
    model = mlp()
    other = copy.deepcopy(model)
    return (model, torch.optim.SGD(model.parameters(), lr=0.5)), (other, torch.optim.SGD(other.parameters(), lr=0.5))


@pytest.mark.parametrize("tokens", [0, 5])
@pytest.mark.parametrize("lower", ["eager", "inductor"])
def test_rewritten_dp_step_equals_the_original(lower, tokens):
    (model, opt), (ref_model, ref_opt) = twins()
    compiled = torch.compile(make_dp_step(model, opt), backend="optpass", options={"lower": lower})
    reference = make_dp_step(ref_model, ref_opt)
    optpass.report.clear_reports()
    # fallback_random: Inductor draws the noise with torch's generator, as eager does;
    # keep_graphs: bypass the FX graph cache so the passes run (and report) here
    with torch._inductor.config.patch(fallback_random=True), optpass.keep_graphs():
        for step in range(4 if lower == "inductor" else 8):
            x, y = batch(step, tokens)
            torch.manual_seed(100 + step)
            norms = compiled(x, y)
            torch.manual_seed(100 + step)
            expected = reference(x, y)
            torch.testing.assert_close(norms, expected, rtol=1e-5, atol=1e-6)
            assert torch.equal(norms > MAX_GRAD_NORM, expected > MAX_GRAD_NORM)   # same samples clipped
            for p, q in zip(model.parameters(), ref_model.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    outcomes = [p for r in optpass.recent_reports() for p in r.passes if p.name == "per_sample_grad_norm"]
    assert any(p.status == "applied" for p in outcomes)


def per_sample_sized(graph, hidden=HIDDEN):
    """Nodes whose value is a [B, out, in]-sized tensor of a Linear weight."""
    sizes = {B * HIDDEN * IN, B * CLASSES * HIDDEN}
    return [n.name for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
            and n.meta["val"].dim() >= 2 and n.meta["val"].numel() in sizes and n.meta["val"].shape[0] == B]


@pytest.mark.parametrize("tokens", [0, 5])
def test_no_per_sample_weight_gradient_remains_and_memory_drops(tokens):
    (model, opt), _ = twins()
    step = torch.compile(make_dp_step(model, opt), backend="optpass",
                         options={"lower": "eager", "dp_materialize": "never"})
    optpass.report.clear_reports()
    with optpass.keep_graphs():
        step(*batch(0, tokens))
    report = next(r for r in optpass.recent_reports() if r.graph_after is not None and r.kind is GraphKind.OTHER)
    assert per_sample_sized(report.graph_before)
    assert per_sample_sized(report.graph_after) == []
    assert report.memory_after.peak_bytes < report.memory_before.peak_bytes
    norm_ops = [n for n in report.graph_after.nodes if n.target is torch.ops.optpass.per_sample_grad_sq_norm.default]
    assert len(norm_ops) == 2                                   # one per Linear weight
    assert sum(1 for n in report.graph_after.nodes if n.target is torch.ops.aten.mm.default) >= 2


def test_auto_keeps_a_layer_materialized_where_book_keeping_would_keep_more_and_explain_says_why():
    """tokens 5: the first layer (8 -> 16) has T·(in+out) = 120 < in·out = 128 and is rewritten;
    the second (16 -> 4) has 100 > 64, so book-keeping's X and G would outweigh its [B, 4, 16]
    per-sample gradient: dp_materialize='auto' keeps that one, and the step stays exact
    (test_rewritten_dp_step_equals_the_original[5] runs this mix for many steps)."""
    (model, opt), _ = twins()
    step = torch.compile(make_dp_step(model, opt), backend="optpass", options={"lower": "eager"})
    optpass.report.clear_reports()
    with optpass.keep_graphs():
        step(*batch(0, 5))
    report = next(r for r in optpass.recent_reports() if r.graph_after is not None and r.kind is GraphKind.OTHER)
    outcome = next(p for p in report.passes if p.name == "per_sample_grad_norm")
    assert outcome.status == "applied"
    norm_ops = [n for n in report.graph_after.nodes if n.target is torch.ops.optpass.per_sample_grad_sq_norm.default]
    assert [_shape(n.args[1]) for n in norm_ops] == [[B, 5, HIDDEN]]            # the first layer's G only
    kept = [n for n in report.graph_after.nodes if n.target is torch.ops.aten.bmm.default
            and list(n.meta["val"].shape) == [B, CLASSES, HIDDEN]]
    assert len(kept) == 1
    note = next(note for note in outcome.notes if "kept materialized" in note)
    assert f"[B={B}, {CLASSES}, {HIDDEN}]" in note and "out·in = 64 elements" in note and "T·(in+out) = 100" in note


def _shape(node):
    return list(node.meta["val"].shape)


def test_a_per_sample_gradient_with_another_use_is_left_alone_and_explain_says_why():
    (model, opt), (ref_model, ref_opt) = twins()
    compiled = torch.compile(make_dp_step(model, opt, return_per_sample=True), backend="optpass",
                             options={"lower": "eager"})
    optpass.report.clear_reports()
    x, y = batch(0, 0)
    torch.manual_seed(1)
    norms, per_sample = compiled(x, y)
    torch.manual_seed(1)
    expected, expected_per_sample = make_dp_step(ref_model, ref_opt, return_per_sample=True)(x, y)
    torch.testing.assert_close(per_sample, expected_per_sample)
    torch.testing.assert_close(norms, expected, rtol=1e-5, atol=1e-6)
    outcome = next(p for r in optpass.recent_reports() for p in r.passes if p.name == "per_sample_grad_norm")
    notes = " ".join(outcome.notes) + (outcome.reason or "")
    assert "also used by" in notes and f"[B={B}, {HIDDEN}, {IN}]" in notes
    assert outcome.status == "applied"     # the other layer's weight was still rewritten


@pytest.mark.parametrize("uses", [2, 3])
def test_a_weight_used_several_times_is_rewritten_as_one_over_all_uses_tokens_exactly(uses):
    """mid is applied `uses` times: its per-sample gradient is a chain of adds of outer products,
    rewritten as ONE norm op and ONE GEMM over the tokens of all uses (X and G concatenated along T)."""
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(IN, HIDDEN)
            self.mid = nn.Linear(HIDDEN, HIDDEN)
            self.out = nn.Linear(HIDDEN, CLASSES)

        def forward(self, x):
            h = torch.relu(self.inp(x))
            for _ in range(uses):
                h = torch.relu(self.mid(h))                # the same weight used again
            return self.out(h)

    torch.manual_seed(0)
    model = Tied()
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    compiled = torch.compile(make_dp_step(model, opt), backend="optpass", options={"lower": "eager"})
    reference = make_dp_step(ref, ref_opt)
    optpass.report.clear_reports()
    with optpass.keep_graphs():
        for step in range(6):
            x, y = batch(step, 0)
            torch.manual_seed(step)
            norms = compiled(x, y)
            torch.manual_seed(step)
            torch.testing.assert_close(norms, reference(x, y), rtol=1e-5, atol=1e-6)
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    report = next(r for r in optpass.recent_reports() if r.kind is GraphKind.OTHER and r.graph_after is not None)
    weight_sized = {B * HIDDEN * IN, B * HIDDEN * HIDDEN, B * CLASSES * HIDDEN}
    assert [n for n in report.graph_before.nodes if n.target is torch.ops.aten.add.Tensor
            and list(n.meta["val"].shape) == [B, HIDDEN, HIDDEN]]                    # the sum, before
    assert [n.name for n in report.graph_after.nodes if isinstance(n.meta.get("val"), torch.Tensor)
            and n.meta["val"].dim() >= 2 and n.meta["val"].shape[0] == B
            and n.meta["val"].numel() in weight_sized] == []
    norm_inputs = [list(n.args[0].meta["val"].shape) for n in report.graph_after.nodes
                   if n.target is torch.ops.optpass.per_sample_grad_sq_norm.default]
    assert sorted(norm_inputs) == sorted([[B, 1, IN], [B, uses, HIDDEN], [B, 1, HIDDEN]])   # mid: all uses' tokens
    outcome = next(p for p in report.passes if p.name == "per_sample_grad_norm")
    assert not any("added to another per-sample gradient" in note for note in outcome.notes)


# ---------------------------------------------------------------- Embedding weights

VOCAB, PAD, TOKENS = 13, 1, 7


def embedding_model(padding_idx=None, scale_grad_by_freq=False):
    return nn.Sequential(nn.Embedding(VOCAB, IN, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq),
                         nn.Linear(IN, CLASSES))


def token_batch(step):
    """Ids 0..3 of 13: every sample repeats tokens; sample 0 starts with two PAD tokens."""
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 4, (B, TOKENS), generator=g)
    x[0, :2] = PAD
    return x, torch.randint(0, CLASSES, (B, TOKENS), generator=g)


def vocab_sized(graph, batch=B, vocab=VOCAB, dim=IN):
    """Nodes holding B per-sample [vocab, d] Embedding gradients ([B, vocab, d], [B·vocab, d], ...)."""
    return [n.name for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
            and n.meta["val"].numel() == batch * vocab * dim
            and any(size in (vocab, batch * vocab, vocab * dim) for size in n.meta["val"].shape)]


def count(graph, op):
    return sum(1 for n in graph.nodes if n.target is op)


def run_twins_dp(model, lower, steps, batch_of=None):
    """Compiled (dp_materialize='never') and eager DP steps on twin models: norms, the samples
    clipped and the parameters must agree after every step. Returns the step graph's report and
    the eager twin."""
    ref = copy.deepcopy(model)
    compiled = torch.compile(make_dp_step(model, torch.optim.SGD(model.parameters(), lr=0.5)), backend="optpass",
                             options={"lower": lower, "dp_materialize": "never"})
    reference = make_dp_step(ref, torch.optim.SGD(ref.parameters(), lr=0.5))
    optpass.report.clear_reports()
    with torch._inductor.config.patch(fallback_random=True), optpass.keep_graphs():
        for step in range(steps):
            x, y = (batch_of or token_batch)(step)
            torch.manual_seed(100 + step)
            norms = compiled(x, y)
            torch.manual_seed(100 + step)
            expected = reference(x, y)
            torch.testing.assert_close(norms, expected, rtol=1e-5, atol=1e-6)
            assert torch.equal(norms > MAX_GRAD_NORM, expected > MAX_GRAD_NORM)
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    return next(r for r in optpass.recent_reports() if r.kind is GraphKind.OTHER and r.graph_after is not None), ref


def run_embedding_dp(lower, steps, **embedding_options):
    """run_twins_dp on an Embedding -> Linear model (the Linear head, T·(in+out) >= in·out here,
    rewritten too); the padding row stays untouched."""
    torch.manual_seed(0)
    model = embedding_model(**embedding_options)
    report, ref = run_twins_dp(model, lower, steps)
    if embedding_options.get("padding_idx") is not None:
        assert torch.equal(model[0].weight[PAD], ref[0].weight[PAD])
    outcome = next(p for p in report.passes if p.name == "per_sample_grad_norm")
    return report, outcome


@pytest.mark.parametrize("embedding_options", [{}, {"padding_idx": PAD}, {"scale_grad_by_freq": True}],
                         ids=["plain", "padding_idx", "scale_grad_by_freq"])
@pytest.mark.parametrize("lower", ["eager", "inductor"])
def test_embedding_dp_step_equals_the_original_without_a_vocab_sized_per_sample_tensor(lower, embedding_options):
    report, outcome = run_embedding_dp(lower, 3, **embedding_options)
    assert vocab_sized(report.graph_before)
    if lower == "eager" and embedding_options.get("scale_grad_by_freq"):
        # the aten graph divides by per-sample token counts inside embedding_dense_backward: left alone
        assert "scale_grad_by_freq" in " ".join(outcome.notes) and vocab_sized(report.graph_after)
        return
    assert outcome.status == "applied" and vocab_sized(report.graph_after) == []
    assert count(report.graph_after, torch.ops.optpass.embedding_per_sample_grad_sq_norm.default) == 1
    assert count(report.graph_after, torch.ops.optpass.per_sample_grad_sq_norm.default) == 1    # the Linear
    assert report.memory_after.peak_bytes < report.memory_before.peak_bytes


class TiedEmbeddingHead(nn.Module):
    """Embedding and output head sharing one [vocab, d] weight, as GPT-2 does."""

    def __init__(self, padding_idx=None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, IN, padding_idx=padding_idx)
        self.mix = nn.Linear(IN, IN)
        self.head = nn.Linear(IN, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mix(self.embed(x))))


@pytest.mark.parametrize("padding_idx", [None, PAD], ids=["plain", "padding_idx"])
@pytest.mark.parametrize("lower", ["eager", "inductor"])
def test_a_tied_embedding_and_head_is_one_norm_over_both_uses_exactly(lower, padding_idx):
    """The tied weight's per-sample gradient is scatter(g) + bmm(Gᵀ, X): the embedding's tokens
    (one-hot ids, token gradients) and the head's (G, X) concatenated, one norm op, one GEMM."""
    torch.manual_seed(0)

    def previous_token(step):                                  # predict the previous token: classes = vocab
        x, _ = token_batch(step)
        return x, x.roll(1, dims=1)

    report, _ = run_twins_dp(TiedEmbeddingHead(padding_idx), lower, 3, previous_token)
    tied = [n for n in report.graph_after.nodes if n.target is torch.ops.optpass.per_sample_grad_sq_norm.default
            and _shape(n.args[1]) == [B, 2 * TOKENS, VOCAB]]
    assert len(tied) == 1
    assert [n.name for n in report.graph_after.nodes if isinstance(n.meta.get("val"), torch.Tensor)
            and _shape(n) in ([B, VOCAB, IN], [B * VOCAB, IN])] == []


def test_an_embedding_with_no_fewer_tokens_than_rows_is_left_alone_and_explain_says_why():
    """T >= vocab (a position table read at every row): the rewrite would keep the tokens' [B, T, d]
    gradients instead of [B, vocab, d], no smaller; so the step is kept as traced."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(TOKENS, IN), nn.Linear(IN, CLASSES))
    ref = copy.deepcopy(model)
    compiled = torch.compile(make_dp_step(model, torch.optim.SGD(model.parameters(), lr=0.5)), backend="optpass",
                             options={"lower": "eager"})
    x, y = token_batch(0)
    optpass.report.clear_reports()
    torch.manual_seed(1)
    norms = compiled(x, y)
    torch.manual_seed(1)
    torch.testing.assert_close(norms, make_dp_step(ref, torch.optim.SGD(ref.parameters(), lr=0.5))(x, y),
                               rtol=1e-5, atol=1e-6)
    notes = " ".join(note for r in optpass.recent_reports() for p in r.passes if p.name == "per_sample_grad_norm"
                     for note in p.notes)
    assert f"{TOKENS} tokens per sample >= vocab {TOKENS}" in notes


def test_an_embedding_per_sample_gradient_with_another_use_is_left_alone_and_explain_says_why():
    torch.manual_seed(0)
    model = embedding_model()
    compiled = torch.compile(make_dp_step(model, torch.optim.SGD(model.parameters(), lr=0.5), return_per_sample=True),
                             backend="optpass", options={"lower": "eager"})
    optpass.report.clear_reports()
    with optpass.keep_graphs():
        _, per_sample = compiled(*token_batch(0))
    assert per_sample.shape == (B, VOCAB, IN)
    report = next(r for r in optpass.recent_reports() if r.kind is GraphKind.OTHER and r.graph_after is not None)
    notes = " ".join(next(p for p in report.passes if p.name == "per_sample_grad_norm").notes)
    assert f"Embedding per-sample gradient [B={B}, vocab={VOCAB}, d={IN}] is also used by" in notes


class TestPerSampleGradNormGraph(TestCase):
    def test_graph_diff_norm_kernel_and_one_gemm(self):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(IN, CLASSES))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = torch.compile(make_dp_step(model, opt), backend="optpass",
                             options={"lower": "eager", "passes": ["per_sample_grad_norm"]})
        optpass.report.clear_reports()
        with optpass.keep_graphs():
            step(*batch(0, 0))
        report = next(r for r in optpass.recent_reports() if r.kind is GraphKind.OTHER)
        diff = optpass.graph_diff(report.graph_before, report.graph_after, context=0)
        self.assertExpectedInline(diff, """\
--- before
+++ after
@@ -52,3 +51,0 @@
-bmm_0: f32[6, 4, 8] = aten.bmm(view_5, view_6)
-view_7: f32[6, 4, 8] = aten.view(bmm_0, [6, 4, 8])
-transpose_1: f32[6, 8, 4] = aten.transpose.int(view_7, 1, 2)
@@ -56,4 +53,5 @@
-view_8: f32[6, 4] = aten.view(sum_2, [6, 4])
-transpose_2: f32[6, 4, 8] = aten.transpose.int(transpose_1, 1, 2)
-view_9: f32[6, 32] = aten.view(transpose_2, [6, -1])
-pow_0: f32[6, 32] = aten.pow.Tensor_Scalar(view_9, 2)
+view_7: f32[6, 4] = aten.view(sum_2, [6, 4])
+permute_0: f32[6, 1, 4] = aten.permute(view_5, [0, 2, 1])
+per_sample_grad_sq_norm_0: f32[6] = optpass.per_sample_grad_sq_norm(view_6, permute_0, 'auto')
+view_8: f32[6, 4] = aten.view(view_7, [6, -1])
+pow_0: f32[6, 4] = aten.pow.Tensor_Scalar(view_8, 2)
@@ -61,6 +59,3 @@
-view_10: f32[6, 4] = aten.view(view_8, [6, -1])
-pow_1: f32[6, 4] = aten.pow.Tensor_Scalar(view_10, 2)
-sum_4: f32[6] = aten.sum.dim_IntList(pow_1, [1])
-stack_0: f32[2, 6] = aten.stack([sum_3, sum_4])
-sum_5: f32[6] = aten.sum.dim_IntList(stack_0, [0])
-sqrt_0: f32[6] = aten.sqrt(sum_5)
+stack_0: f32[2, 6] = aten.stack([per_sample_grad_sq_norm_0, sum_3])
+sum_4: f32[6] = aten.sum.dim_IntList(stack_0, [0])
+sqrt_0: f32[6] = aten.sqrt(sum_4)
@@ -73,10 +68,16 @@
-permute_0: f32[1, 1, 6] = aten.permute(unsqueeze_4, [1, 2, 0])
-permute_1: f32[4, 8, 6] = aten.permute(transpose_2, [1, 2, 0])
-permute_2: f32[6, 1, 1] = aten.permute(permute_0, [2, 0, 1])
-view_11: f32[1, 1, 6] = aten.view(permute_2, [1, 1, 6])
-permute_3: f32[6, 4, 8] = aten.permute(permute_1, [2, 0, 1])
-view_12: f32[1, 6, 32] = aten.view(permute_3, [1, 6, 32])
-bmm_1: f32[1, 1, 32] = aten.bmm(view_11, view_12)
-view_13: f32[1, 4, 8] = aten.view(bmm_1, [1, 4, 8])
-permute_4: f32[4, 8, 1] = aten.permute(view_13, [1, 2, 0])
-view_14: f32[4, 8] = aten.view(permute_4, [4, 8])
+permute_1: f32[1, 1, 6] = aten.permute(unsqueeze_4, [1, 2, 0])
+permute_2: f32[6, 1, 1] = aten.permute(permute_1, [2, 0, 1])
+view_9: f32[1, 1, 6] = aten.view(permute_2, [1, 1, 6])
+permute_3: f32[6, 1, 4] = aten.permute(view_5, [0, 2, 1])
+clone_0: f32[1, 1, 6] = aten.clone(view_9, memory_format=torch.contiguous_format)
+view_10: f32[6, 1, 1] = aten.view(clone_0, [6, 1, 1])
+mul_3: f32[6, 1, 4] = aten.mul.Tensor(permute_3, view_10)
+clone_1: f32[6, 1, 4] = aten.clone(mul_3, memory_format=torch.contiguous_format)
+view_11: f32[6, 4] = aten.view(clone_1, [6, 4])
+view_12: f32[6, 8] = aten.view(view_6, [6, 8])
+permute_4: f32[4, 6] = aten.permute(view_11, [1, 0])
+mm_1: f32[4, 8] = aten.mm(permute_4, view_12)
+view_13: f32[1, 1, 32] = aten.view(mm_1, [1, 1, 32])
+view_14: f32[1, 4, 8] = aten.view(view_13, [1, 4, 8])
+permute_5: f32[4, 8, 1] = aten.permute(view_14, [1, 2, 0])
+view_15: f32[4, 8] = aten.view(permute_5, [4, 8])
@@ -84,2 +85,2 @@
-mul_3: f32[4, 8] = aten.mul.Tensor(randn_like_0, 0.5)
-add_2: f32[4, 8] = aten.add.Tensor(view_14, mul_3)
+mul_4: f32[4, 8] = aten.mul.Tensor(randn_like_0, 0.5)
+add_2: f32[4, 8] = aten.add.Tensor(view_15, mul_4)
@@ -88,10 +89,10 @@
-permute_5: f32[1, 6] = aten.permute(unsqueeze_5, [1, 0])
-permute_6: f32[4, 6] = aten.permute(view_8, [1, 0])
-permute_7: f32[6, 1] = aten.permute(permute_5, [1, 0])
-view_15: f32[1, 1, 6] = aten.view(permute_7, [1, 1, 6])
-permute_8: f32[6, 4] = aten.permute(permute_6, [1, 0])
-view_16: f32[1, 6, 4] = aten.view(permute_8, [1, 6, 4])
-bmm_2: f32[1, 1, 4] = aten.bmm(view_15, view_16)
-view_17: f32[1, 4] = aten.view(bmm_2, [1, 4])
-permute_9: f32[4, 1] = aten.permute(view_17, [1, 0])
-view_18: f32[4] = aten.view(permute_9, [4])
+permute_6: f32[1, 6] = aten.permute(unsqueeze_5, [1, 0])
+permute_7: f32[4, 6] = aten.permute(view_7, [1, 0])
+permute_8: f32[6, 1] = aten.permute(permute_6, [1, 0])
+view_16: f32[1, 1, 6] = aten.view(permute_8, [1, 1, 6])
+permute_9: f32[6, 4] = aten.permute(permute_7, [1, 0])
+view_17: f32[1, 6, 4] = aten.view(permute_9, [1, 6, 4])
+bmm_0: f32[1, 1, 4] = aten.bmm(view_16, view_17)
+view_18: f32[1, 4] = aten.view(bmm_0, [1, 4])
+permute_10: f32[4, 1] = aten.permute(view_18, [1, 0])
+view_19: f32[4] = aten.view(permute_10, [4])
@@ -99,2 +100,2 @@
-mul_4: f32[4] = aten.mul.Tensor(randn_like_1, 0.5)
-add_3: f32[4] = aten.add.Tensor(view_18, mul_4)
+mul_5: f32[4] = aten.mul.Tensor(randn_like_1, 0.5)
+add_3: f32[4] = aten.add.Tensor(view_19, mul_5)""")


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_small_transformer_lm_per_sample_norms_match(tied):
    """Attention, LayerNorm, a position table, an embedding and output head (tied or not): Linear and
    untied Embedding weights rewritten, the tied embedding/head as one sum over both uses' tokens, all exact."""
    from optpass.demo.models import LMConfig, TinyLM

    cfg = LMConfig(vocab=32, d_model=16, n_heads=2, n_layers=1, seq_len=8)
    torch.manual_seed(0)
    model = TinyLM(cfg)
    if not tied:
        model.head.weight = nn.Parameter(model.embed.weight.detach().clone())
    ref = copy.deepcopy(model)
    batch_size = 3

    def make(model, opt):
        def loss_of_params(params, x, y):
            logits = functional_call(model, params, (x.unsqueeze(0),))
            return F.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1))

        def clipped(x, y):
            params = {k: v.detach() for k, v in model.named_parameters()}
            per_sample = vmap(grad(loss_of_params), in_dims=(None, 0, 0))(params, x, y)
            norms = torch.stack([g.reshape(batch_size, -1).pow(2).sum(1) for g in per_sample.values()]).sum(0).sqrt()
            coef = (MAX_GRAD_NORM / (norms + 1e-6)).clamp(max=1.0)
            for name, p in model.named_parameters():
                p.grad = torch.einsum("b,b...->...", coef, per_sample[name]) / batch_size
            return norms

        def step(x, y):
            norms = clipped(x, y)
            opt.step()
            opt.zero_grad()
            return norms
        return step

    # dp_materialize='never': at d_model 16 and T = 8, T·(in+out) >= in·out, and 'auto' would keep them
    compiled = torch.compile(make(model, torch.optim.SGD(model.parameters(), lr=0.1)), backend="optpass",
                             options={"lower": "eager", "dp_materialize": "never"})
    reference = make(ref, torch.optim.SGD(ref.parameters(), lr=0.1))
    optpass.report.clear_reports()
    with optpass.keep_graphs():
        for step in range(2):
            tokens = torch.randint(0, cfg.vocab, (batch_size, cfg.seq_len + 1), generator=torch.Generator().manual_seed(step))
            torch.testing.assert_close(compiled(tokens[:, :-1], tokens[:, 1:]), reference(tokens[:, :-1], tokens[:, 1:]),
                                       rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    report = next(r for r in optpass.recent_reports() if r.kind is GraphKind.OTHER and r.graph_after is not None)
    linear_norms = count(report.graph_after, torch.ops.optpass.per_sample_grad_sq_norm.default)
    embedding_norms = count(report.graph_after, torch.ops.optpass.embedding_per_sample_grad_sq_norm.default)
    vocab_by_d = vocab_sized(report.graph_after, batch_size, cfg.vocab, cfg.d_model)
    if tied:
        # wq, wk, wv, wo, the two MLP weights, and the tied embedding/head as ONE norm op over the
        # embedding's tokens (one-hot ids, token gradients) and the head's (its G and X)
        assert (linear_norms, embedding_norms) == (7, 0)
        tied_norm = [n for n in report.graph_after.nodes
                     if n.target is torch.ops.optpass.per_sample_grad_sq_norm.default
                     and list(n.args[1].meta["val"].shape) == [batch_size, 2 * cfg.seq_len, cfg.vocab]]
        assert len(tied_norm) == 1
        # (by size alone the one-hot [B, 2T, vocab] = [3, 16, 32] would pass for [B, vocab, d] here)
        assert [n.name for n in report.graph_after.nodes if isinstance(n.meta.get("val"), torch.Tensor)
                and list(n.meta["val"].shape) in ([batch_size, cfg.vocab, cfg.d_model],
                                                  [batch_size * cfg.vocab, cfg.d_model])] == []
    else:
        assert (linear_norms, embedding_norms) == (7, 1)     # ... and the head; the embedding
        assert vocab_by_d == []
    assert report.memory_after.peak_bytes < report.memory_before.peak_bytes


class TestEmbeddingGraph(TestCase):
    def test_graph_diff_embedding_norm_op_and_one_scatter(self):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(VOCAB, CLASSES, padding_idx=PAD))     # the embeddings are the logits
        step = torch.compile(make_dp_step(model, torch.optim.SGD(model.parameters(), lr=0.1)), backend="optpass",
                             options={"lower": "eager", "passes": ["per_sample_grad_norm"]})
        optpass.report.clear_reports()
        with optpass.keep_graphs():
            step(*token_batch(0))
        report = next(r for r in optpass.recent_reports() if r.kind is GraphKind.OTHER)
        diff = optpass.graph_diff(report.graph_before, report.graph_after, context=0)
        self.assertExpectedInline(diff, """\
--- before
+++ after
@@ -40,19 +40,8 @@
-arange_0: i64[6] = aten.arange.start_step(0, 78, 13, dtype=torch.int64, layout=torch.strided, device=device('cpu'))
-view_4: i64[6, 1, 1] = aten.view(arange_0, [6, 1, 1])
-add_0: i64[6, 1, 7] = aten.add.Tensor(unsqueeze_0, view_4)
-embedding_dense_backward_0: f32[78, 4] = aten.embedding_dense_backward(view_3, add_0, 78, -1, False)
-view_5: f32[6, 13, 4] = aten.view(embedding_dense_backward_0, [6, 13, 4])
-select_0: f32[6, 4] = aten.select.int(view_5, 1, 1)
-fill_0: f32[6, 4] = aten.fill.Scalar(select_0, 0)
-view_6: f32[6, 13, 4] = aten.view(embedding_dense_backward_0, [6, 13, 4])
-select_scatter_0: f32[6, 13, 4] = aten.select_scatter(view_6, fill_0, 1, 1)
-view_7: f32[78, 4] = aten.view(select_scatter_0, [78, 4])
-view_8: f32[6, 13, 4] = aten.view(view_7, [6, 13, 4])
-view_9: f32[6, 52] = aten.view(view_8, [6, -1])
-pow_0: f32[6, 52] = aten.pow.Tensor_Scalar(view_9, 2)
-sum_2: f32[6] = aten.sum.dim_IntList(pow_0, [1])
-stack_0: f32[1, 6] = aten.stack([sum_2])
-sum_3: f32[6] = aten.sum.dim_IntList(stack_0, [0])
-sqrt_0: f32[6] = aten.sqrt(sum_3)
-add_1: f32[6] = aten.add.Tensor(sqrt_0, 1e-06)
-reciprocal_0: f32[6] = aten.reciprocal(add_1)
+view_4: i64[6, 7] = aten.view(unsqueeze_0, [6, 7])
+view_5: f32[6, 7, 4] = aten.view(view_3, [6, 7, 4])
+embedding_per_sample_grad_sq_norm_0: f32[6] = optpass.embedding_per_sample_grad_sq_norm(view_4, view_5, 1, 'auto')
+stack_0: f32[1, 6] = aten.stack([embedding_per_sample_grad_sq_norm_0])
+sum_2: f32[6] = aten.sum.dim_IntList(stack_0, [0])
+sqrt_0: f32[6] = aten.sqrt(sum_2)
+add_0: f32[6] = aten.add.Tensor(sqrt_0, 1e-06)
+reciprocal_0: f32[6] = aten.reciprocal(add_0)
@@ -65,9 +54,11 @@
-view_10: f32[1, 1, 6] = aten.view(permute_1, [1, 1, 6])
-view_11: f32[6, 13, 4] = aten.view(view_7, [6, 13, 4])
-permute_2: f32[13, 4, 6] = aten.permute(view_11, [1, 2, 0])
-permute_3: f32[6, 13, 4] = aten.permute(permute_2, [2, 0, 1])
-view_12: f32[1, 6, 52] = aten.view(permute_3, [1, 6, 52])
-bmm_0: f32[1, 1, 52] = aten.bmm(view_10, view_12)
-view_13: f32[1, 13, 4] = aten.view(bmm_0, [1, 13, 4])
-permute_4: f32[13, 4, 1] = aten.permute(view_13, [1, 2, 0])
-view_14: f32[13, 4] = aten.view(permute_4, [13, 4])
+view_6: f32[1, 1, 6] = aten.view(permute_1, [1, 1, 6])
+clone_0: f32[1, 1, 6] = aten.clone(view_6, memory_format=torch.contiguous_format)
+view_7: f32[6, 1, 1] = aten.view(clone_0, [6, 1, 1])
+mul_2: f32[6, 7, 4] = aten.mul.Tensor(view_5, view_7)
+view_8: f32[42, 4] = aten.view(mul_2, [42, 4])
+view_9: i64[42] = aten.view(view_4, [42])
+embedding_dense_backward_0: f32[13, 4] = aten.embedding_dense_backward(view_8, view_9, 13, 1, False)
+view_10: f32[1, 1, 52] = aten.view(embedding_dense_backward_0, [1, 1, 52])
+view_11: f32[1, 13, 4] = aten.view(view_10, [1, 13, 4])
+permute_2: f32[13, 4, 1] = aten.permute(view_11, [1, 2, 0])
+view_12: f32[13, 4] = aten.view(permute_2, [13, 4])
@@ -75,3 +66,3 @@
-mul_2: f32[13, 4] = aten.mul.Tensor(randn_like_0, 0.5)
-add_2: f32[13, 4] = aten.add.Tensor(view_14, mul_2)
-div_2: f32[13, 4] = aten.div.Tensor(add_2, 6)
+mul_3: f32[13, 4] = aten.mul.Tensor(randn_like_0, 0.5)
+add_1: f32[13, 4] = aten.add.Tensor(view_12, mul_3)
+div_2: f32[13, 4] = aten.div.Tensor(add_1, 6)""")


def test_explain_names_each_layer_rewritten_kept_or_left_as_traced_and_calls_the_graph_dp_sgd():
    (model, opt), _ = twins()
    text = str(optpass.explain(make_dp_step(model, opt), *batch(0, 5)))
    assert "dp-sgd (Dynamo compile" in text and "] other (" not in text
    assert "0.weight (Linear weight [16, 8]): rewritten" in text
    assert "2.weight (Linear weight [4, 16]): per-sample gradient [B=6, 4, 16]: kept materialized" in text
    assert "left as traced (2): 0.bias, 2.bias" in text


# ---------------------------------------------------------------- frozen layers, against Opacus

def make_trainable_dp_step(model, opt, batch_size, noise):
    """docs/dp_sgd.md's recipe: only the parameters that require grad are differentiated, clipped and
    given a .grad; the sum is divided by the (expected) batch size, as Opacus's DPOptimizer does."""
    def loss_of_params(params, x, y):
        return F.cross_entropy(functional_call(model, params, (x.unsqueeze(0),)), y.unsqueeze(0))

    def clipped_noisy_gradients(x, y):
        trainable = {k: p for k, p in model.named_parameters() if p.requires_grad}
        params = {k: p.detach() for k, p in trainable.items()}
        per_sample = vmap(grad(loss_of_params), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per_sample.values()]).sum(0).sqrt()
        coef = (MAX_GRAD_NORM / (norms + 1e-6)).clamp(max=1.0)
        for name, p in trainable.items():
            p.grad = (torch.einsum("b,b...->...", coef, per_sample[name])
                      + noise * MAX_GRAD_NORM * torch.randn_like(p)) / batch_size
        return norms, coef

    def dp_step(x, y):
        out = clipped_noisy_gradients(x, y)
        opt.step()
        opt.zero_grad()
        return out
    return dp_step


def frozen_first_layer_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                          nn.Linear(HIDDEN, CLASSES))
    model[0].requires_grad_(False)                     # a frozen layer, as in fine-tuning
    return model


@pytest.mark.parametrize("lower", ["eager", "inductor"])
def test_the_recipe_on_a_model_with_a_frozen_layer_equals_opacus(lower):
    """Per-sample norms, clip factors and parameters equal Opacus's GradSampleModule + DPOptimizer over
    several steps (same noise: both draw it from torch's generator, parameter by parameter); the
    frozen layer keeps its values and gets no .grad."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model = frozen_first_layer_model()
    opacus_model = copy.deepcopy(model)
    frozen = [p.detach().clone() for p in model[0].parameters()]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    compiled = torch.compile(make_trainable_dp_step(model, opt, B, NOISE), backend="optpass",
                             options={"lower": lower})
    gsm = GradSampleModule(opacus_model, loss_reduction="mean")
    dp_opt = DPOptimizer(torch.optim.SGD([p for p in opacus_model.parameters() if p.requires_grad], lr=0.5),
                         noise_multiplier=NOISE, max_grad_norm=MAX_GRAD_NORM, expected_batch_size=B)
    with torch._inductor.config.patch(fallback_random=True):
        for step in range(4):
            x, y = batch(step, 0)
            torch.manual_seed(100 + step)
            norms, coef = compiled(x, y)
            F.cross_entropy(gsm(x), y).backward()
            samples = [p.grad_sample for p in opacus_model.parameters() if p.requires_grad]
            opacus_norms = torch.stack([g.reshape(len(g), -1).norm(2, dim=-1) for g in samples], dim=1).norm(2, dim=1)
            opacus_coef = (MAX_GRAD_NORM / (opacus_norms + 1e-6)).clamp(max=1.0)
            torch.manual_seed(100 + step)
            dp_opt.step()
            dp_opt.zero_grad()
            torch.testing.assert_close(norms, opacus_norms, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(coef, opacus_coef, rtol=1e-5, atol=1e-6)
            for p, q in zip(model.parameters(), opacus_model.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in model[0].parameters())
    assert all(torch.equal(p, q) for p, q in zip(model[0].parameters(), frozen))


def test_explain_names_a_differentiated_parameter_that_does_not_require_grad():
    """Differentiating every named_parameters() of a model with a frozen layer: explain names the
    frozen weight and bias and says Opacus leaves them out; the recipe (trainable only): no such note,
    and the frozen parameters are not listed as per-sample gradients."""
    def every_parameter_step(model, opt):
        def loss_of_params(params, x, y):
            return F.cross_entropy(functional_call(model, params, (x.unsqueeze(0),)), y.unsqueeze(0))

        def clipped(x, y):
            params = {k: v.detach() for k, v in model.named_parameters()}
            per_sample = vmap(grad(loss_of_params), in_dims=(None, 0, 0))(params, x, y)
            norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per_sample.values()]).sum(0).sqrt()
            coef = (MAX_GRAD_NORM / (norms + 1e-6)).clamp(max=1.0)
            for name, p in model.named_parameters():
                p.grad = torch.einsum("b,b...->...", coef, per_sample[name]) / B
            return norms

        def dp_step(x, y):
            norms = clipped(x, y)
            opt.step()
            opt.zero_grad()
            return norms
        return dp_step

    model = frozen_first_layer_model()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    text = str(optpass.explain(every_parameter_step(model, opt), *batch(0, 0)))
    assert "0.weight (Linear weight [16, 8], requires_grad=False): rewritten" in text
    assert ("per-sample gradients of parameters that do not require grad (requires_grad=False): 0.weight, "
            "0.bias: they enter every per-sample norm and clip factor, and p.grad is set for them; Opacus "
            "leaves them out") in text
    text = str(optpass.explain(make_trainable_dp_step(model, opt, B, NOISE), *batch(0, 0)))
    notes = [line for line in text.splitlines() if line.strip().startswith("note: ")]
    assert notes and not any("requires_grad=False" in line or "0.weight" in line or "0.bias" in line for line in notes)
    assert "left as traced (2): 2.bias, 4.bias" in text


@pytest.mark.parametrize("tied, lower", [(True, "inductor"), (False, "eager")], ids=["tied-inductor", "untied-eager"])
def test_explain_gives_one_line_per_weight_and_calls_an_embedding_an_embedding(tied, lower):
    """Two transformer blocks (eight [16, 16] attention weights): each weight on a line of its own,
    named from the dataflow, not one line per shape repeated; the embedding is an Embedding, tied to
    the output head or not."""
    from optpass.demo.models import LMConfig, TinyLM

    cfg = LMConfig(vocab=32, d_model=16, n_heads=2, n_layers=2, seq_len=8)
    torch.manual_seed(0)
    model = TinyLM(cfg)
    if not tied:
        model.head.weight = nn.Parameter(model.embed.weight.detach().clone())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_of_params(params, x, y):
        return F.cross_entropy(functional_call(model, params, (x.unsqueeze(0),)).reshape(-1, cfg.vocab), y.reshape(-1))

    def clipped(x, y):
        params = {k: v.detach() for k, v in model.named_parameters()}
        per_sample = vmap(grad(loss_of_params), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per_sample.values()]).sum(0).sqrt()
        coef = (MAX_GRAD_NORM / (norms + 1e-6)).clamp(max=1.0)
        for name, p in model.named_parameters():
            p.grad = torch.einsum("b,b...->...", coef, per_sample[name]) / 3
        return norms

    def dp_step(x, y):
        norms = clipped(x, y)
        opt.step()
        opt.zero_grad()
        return norms

    tokens = torch.randint(0, cfg.vocab, (3, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    text = str(optpass.explain(dp_step, tokens[:, :-1], tokens[:, 1:],
                               options={"lower": lower, "dp_materialize": "never"}))
    notes = [line.strip().removeprefix("note: ") for line in text.splitlines() if line.strip().startswith("note: ")]
    rewritten = "rewritten (norms without the"
    weights = [f"layers.{i}.{w}.weight" for i in range(2)
               for w in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.0", "mlp.2")]
    for weight in weights:
        shape = {"mlp.0": "[64, 16]", "mlp.2": "[16, 64]"}.get(weight.split(".", 2)[2][:-len(".weight")], "[16, 16]")
        assert sum(note.startswith(f"{weight} (Linear weight {shape}): {rewritten}") for note in notes) == 1, weight
    assert not any("one of" in note for note in notes)
    if tied:
        assert sum(note.startswith(f"embed.weight (Embedding weight [32, 16], tied to a Linear (an output head)): "
                                   f"{rewritten}") for note in notes) == 1
        assert len(notes) == len(weights) + 3           # + the embedding, + the 1-D ones' line, + pos's
    else:
        assert sum(note.startswith(f"embed.weight (Embedding weight [32, 16]): {rewritten}") for note in notes) == 1
        assert sum(note.startswith(f"head.weight (Linear weight [32, 16]): {rewritten}") for note in notes) == 1
        assert len(notes) == len(weights) + 4
    assert notes[-2].startswith("left as traced (14): layers.0.norm1 (weight, bias), ")
    assert notes[-1].startswith("materialized, not rewritten (1): pos [8, 16]: ")


# ---------------------------------------------------------------- recurrent layers

class _SequenceClassifier(nn.Module):
    def __init__(self, recurrent):
        super().__init__()
        self.recurrent, self.head = recurrent, nn.Linear(7, CLASSES)

    def forward(self, x):
        out, _ = self.recurrent(x)
        return self.head(out[:, -1])


@pytest.mark.parametrize("layer", ["nn.LSTM", "DPLSTM"])
def test_an_lstm_in_a_vmap_grad_step_warns_that_it_runs_eagerly_and_opacus_dplstm_compiles(layer):
    """nn.LSTM inside vmap(grad): Dynamo skips the function around it, which runs eagerly; optpass warns
    at the user's line, naming the module, the fallback and Opacus's DPLSTM. With DPLSTM (the fix) the
    step compiles and is rewritten, without the warning. Both equal the eager step over 3 steps."""
    import warnings

    from opacus.layers import DPLSTM

    torch.manual_seed(0)
    recurrent = nn.LSTM(IN, 7, batch_first=True) if layer == "nn.LSTM" else DPLSTM(IN, 7, batch_first=True)
    model = _SequenceClassifier(recurrent)
    ref = copy.deepcopy(model)
    compiled = torch.compile(make_trainable_dp_step(model, torch.optim.SGD(model.parameters(), lr=0.5), B, NOISE),
                             backend="optpass", options={"lower": "eager"})
    reference = make_trainable_dp_step(ref, torch.optim.SGD(ref.parameters(), lr=0.5), B, NOISE)
    optpass.report.clear_reports()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x, y = batch(step, 5)
            torch.manual_seed(100 + step)
            norms, _ = compiled(x, y[:, 0])
            torch.manual_seed(100 + step)
            expected, _ = reference(x, y[:, 0])
            torch.testing.assert_close(norms, expected, rtol=1e-5, atol=1e-6)
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    ours = [w for w in caught if issubclass(w.category, optpass.RecurrentLayerFallbackWarning)]
    rewritten = [p.status for r in optpass.recent_reports() for p in r.passes
                 if p.name == "per_sample_grad_norm" and p.status == "applied"]
    if layer == "nn.LSTM":
        assert len(ours) == 1 and not rewritten
        message = str(ours[0].message)
        assert message.startswith(f"optpass: Dynamo does not trace LSTM({IN}, 7, batch_first=True)")
        assert "ran eagerly, uncompiled" in message and "opacus.layers.DPLSTM" in message
        assert issubclass(ours[0].category, optpass.BackwardOutsideGraphWarning)
        assert ours[0].filename == __file__
    else:
        assert not ours and rewritten
