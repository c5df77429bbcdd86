"""logits_gradient_in_place: a loss's [tokens, vocab] logits gradient written over the logits
(one buffer where Inductor allocated two), pinned as a graph diff, equal to eager, and the live
peak it takes down."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase

import optpass
from optpass.demo.models import LMConfig, TinyLM
from optpass.passes import logits_gradient_in_place
from parity import Twin, lm_batch, lm_loss, make_step, steady_graph_after

PASS = "logits_gradient_in_place"


def compiled(model, opt, loss_fn, step_fn=make_step, **options):
    return torch.compile(step_fn(model, opt, loss_fn), backend="optpass", options={"optimizer": opt, **options})


def pass_outcomes() -> list:
    return [p for r in optpass.recent_reports() for p in r.passes if p.name == PASS]


class TestLogitsGradientInPlaceGraph(TestCase):
    def test_the_logits_gradient_is_copied_into_a_view_of_the_logits(self):
        """The graph with the pass against the same step without it (Inductor's post-grad graph,
        where cross-entropy's backward is pointwise): the gradient's readers read it through a
        copy_ into a view of the logits GEMM's result."""
        graphs = {}
        for disable in ([PASS], []):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 3, bias=False), nn.Tanh(), nn.Linear(3, 6, bias=False))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            step = compiled(model, opt, lambda m, x, y: F.cross_entropy(m(x), y), disable_passes=disable)
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(logits_gradient_in_place, "MIN_BYTES", 0)      # a [5, 6] gradient
                graphs[tuple(disable)] = steady_graph_after(step, torch.randn(5, 4), torch.tensor([0, 5, 2, 3, 1]))
        diff = optpass.graph_diff(graphs[(PASS,)], graphs[()], shapes=False, context=1)
        self.assertExpectedInline(diff, """\
--- before
+++ after
@@ -51,4 +51,8 @@
 sub_2 = aten.sub.Tensor(mul_0, mul_1)
+view_0 = aten.view(mm_1, [1, 5, 6])
+view_1 = aten.view(sub_2, [1, 5, 6])
+copy__0 = aten.copy_(view_0, view_1)
+view_2 = aten.view(copy__0, [5, 6])
 permute_2 = aten.permute(permute_1, [1, 0])
-mm_2 = aten.mm(sub_2, permute_2)
+mm_2 = aten.mm(view_2, permute_2)
 mul_2 = aten.mul.Tensor(tanh_0, tanh_0)
@@ -58,3 +62,3 @@
 mm_3 = aten.mm(permute_3, in1)
-permute_4 = aten.permute(sub_2, [1, 0])
+permute_4 = aten.permute(view_2, [1, 0])
 mm_4 = aten.mm(permute_4, tanh_0)""")


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("in_backward", [True, False])
def test_a_language_model_with_its_logits_gradient_in_place_trains_like_eager(in_backward):
    """Float64, 6 steps of AdamW on an untied LM whose logits gradient is 1 MiB (64 tokens x vocab
    2048): the update in backward (the head's rows written in chunks after the loss) and after it."""
    torch._dynamo.reset()
    cfg = LMConfig(vocab=2048, d_model=32, n_heads=2, n_layers=1, seq_len=16, tie_head=False)
    twin = Twin(lambda: TinyLM(cfg), lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1))
    eager = make_step(twin.eager_model, twin.eager_opt, lm_loss)
    step = compiled(twin.compiled_model, twin.compiled_opt, lm_loss, optimizer_in_backward=in_backward)
    data = lm_batch(cfg.vocab, batch=4, seq_len=16)
    optpass.report.clear_reports()
    for i in range(6):
        expected, got = eager(*data(i)), step(*data(i))
        assert got.item() == pytest.approx(expected.item(), rel=1e-9)
    params, state = twin.diffs()
    assert params <= 1e-9 and state <= 1e-9
    assert any("written over the logits" in note for p in pass_outcomes() for note in p.notes), pass_outcomes()


@pytest.mark.usefixtures("float64_default")
def test_returned_logits_are_the_forward_logits_and_the_gradient_is_not_written_over_them():
    """A step that returns the logits (detached, before opt.step()) reads them after their gradient
    is made: the pass leaves them, says why, and the step returns what eager returns."""
    def step_returning_logits(model, opt, loss_fn):
        def train_step(x, y):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            out = (loss.detach(), logits.detach())
            opt.step()
            opt.zero_grad()
            return out
        return train_step

    torch._dynamo.reset()
    cfg = LMConfig(vocab=2048, d_model=32, n_heads=2, n_layers=1, seq_len=16, tie_head=False)
    twin = Twin(lambda: TinyLM(cfg), lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    eager = step_returning_logits(twin.eager_model, twin.eager_opt, None)
    step = compiled(twin.compiled_model, twin.compiled_opt, None, step_fn=step_returning_logits,
                    optimizer_in_backward=True)
    data = lm_batch(cfg.vocab, batch=4, seq_len=16)
    optpass.report.clear_reports()
    for i in range(3):
        (expected_loss, expected_logits), (loss, logits) = eager(*data(i)), step(*data(i))
        assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-9)
        torch.testing.assert_close(logits, expected_logits, rtol=1e-9, atol=1e-9)
    reasons = [p.reason for p in pass_outcomes() if p.status == "skipped"]
    assert any("returns a value that reads the logits" in r for r in reasons), pass_outcomes()


def _step_with_metric(metric: str, after_backward: bool):
    def make(model, opt, loss_fn):
        def train_step(x, y):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            if not after_backward:
                value = _metric(metric, logits, y)
            loss.backward()
            if after_backward:
                value = _metric(metric, logits, y)
            out = (loss.detach(), value)
            opt.step()
            opt.zero_grad()
            return out
        return train_step
    return make


def _metric(metric, logits, y):
    if metric == "accuracy":
        return (logits.detach().argmax(-1) == y).double().mean()
    return -(logits.detach().softmax(-1) * logits.detach().log_softmax(-1)).sum(-1).mean()   # entropy


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("metric,after_backward,in_backward,applies", [
    ("accuracy", True, False, True),      # argmax moves before the gradient (update after backward)
    ("accuracy", False, True, True),
    ("entropy", False, True, False),      # a softmax of the logits beside the loss: left whole
])
def test_metrics_of_the_logits_equal_eager(metric, after_backward, in_backward, applies):
    """A step that also computes a metric of the logits: equal to eager; the pass writes the
    gradient over the logits when the metric reads them first (an argmax computed after backward
    is moved before the gradient), and leaves them whole beside a softmax (Inductor's C++ backend
    failed to compile that step with the write)."""
    torch._dynamo.reset()
    cfg = LMConfig(vocab=2048, d_model=32, n_heads=2, n_layers=1, seq_len=16, tie_head=False)
    twin = Twin(lambda: TinyLM(cfg), lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3))
    make = _step_with_metric(metric, after_backward)
    eager = make(twin.eager_model, twin.eager_opt, None)
    step = compiled(twin.compiled_model, twin.compiled_opt, None, step_fn=make, optimizer_in_backward=in_backward)
    data = lm_batch(cfg.vocab, batch=4, seq_len=16)
    optpass.report.clear_reports()
    for i in range(3):
        (expected_loss, expected), (loss, got) = eager(*data(i)), step(*data(i))
        assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-9)
        assert got.item() == pytest.approx(expected.item(), rel=1e-9, abs=1e-12)
    assert any(p.status == "applied" for p in pass_outcomes()) == applies, pass_outcomes()


class NanoGPT(nn.Module):
    """nanoGPT's shape in one block (SDPA attention, GELU MLP, learned positions): with the update
    after backward the graph computes the loss's picked log-probability after the logits gradient."""

    def __init__(self, vocab=4096, d=64, seq_len=32, heads=2):
        super().__init__()
        self.wte, self.wpe, self.heads = nn.Embedding(vocab, d), nn.Embedding(seq_len, d), heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T))
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(self.ln1(x)).chunk(3, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + self.proj(y)
        x = x + self.fc2(F.gelu(self.fc(self.ln2(x))))
        return self.head(self.ln_f(x))


@pytest.mark.usefixtures("float64_default")
def test_a_loss_the_graph_computes_after_the_gradient_moves_before_it():
    """The update after backward (default options) on nanoGPT's shape: the loss's gather sits after
    the logits gradient in the graph and moves before it, so the pass applies; equal to eager."""
    torch._dynamo.reset()
    twin = Twin(NanoGPT, lambda m: torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-2)))
    loss_fn = lambda m, x, y: F.cross_entropy(m(x).reshape(-1, 4096), y.reshape(-1))   # noqa: E731
    eager = make_step(twin.eager_model, twin.eager_opt, loss_fn)
    step = compiled(twin.compiled_model, twin.compiled_opt, loss_fn)
    data = lm_batch(4096, batch=2, seq_len=32)
    optpass.report.clear_reports()
    for i in range(4):
        assert step(*data(i)).item() == pytest.approx(eager(*data(i)).item(), rel=1e-9)
    params, state = twin.diffs()
    assert params <= 1e-9 and state <= 1e-9
    assert any(p.status == "applied" for p in pass_outcomes()), pass_outcomes()


def test_the_live_peak_holds_one_logits_sized_buffer_at_the_loss():
    """An untied LM whose step peak is the loss (256 tokens x vocab 8192: logits and their gradient,
    8 MiB each) with the update in backward: the pass takes 0.6 of the logits off the peak (which moves
    to the embedding's 8 MiB gradient at the end of backward: 0.72 measured)."""
    cfg = LMConfig(vocab=8192, d_model=256, n_heads=4, n_layers=1, seq_len=64, tie_head=False)
    data = lm_batch(cfg.vocab, batch=4, seq_len=64)
    peaks = {}
    for disable in ([PASS], []):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = TinyLM(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4))
        step = compiled(model, opt, lm_loss, optimizer_in_backward=True, disable_passes=disable)
        for i in range(2):
            step(*data(i))
        with optpass.measure_tensor_peak() as peak:
            step(*data(2))
        peaks[tuple(disable)] = peak.growth_bytes
    logits_bytes = 4 * 64 * cfg.vocab * 4
    assert peaks[(PASS,)] - peaks[()] >= 0.6 * logits_bytes, peaks


def test_explain_says_the_pass_runs_on_inductors_decomposed_loss():
    """explain's aten graph has cross-entropy's backward as one op: the line says where the pass
    applies instead of a reason that reads like a refusal."""
    torch._dynamo.reset()
    cfg = LMConfig(vocab=8192, d_model=160, n_heads=4, n_layers=1, seq_len=16, tie_head=False)
    model = TinyLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4))
    text = str(optpass.explain(make_step(model, opt, lm_loss), *lm_batch(cfg.vocab, 2, 16)(0),
                               options={"optimizer": opt, "optimizer_in_backward": True}))
    line = next(line for line in text.splitlines() if f"pass {PASS}" in line)
    assert "Inductor's lowering decomposes it" in line, line
