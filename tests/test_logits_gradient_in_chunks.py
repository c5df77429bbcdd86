"""logits_gradient_in_chunks: a language model's [tokens, vocab] logits gradient made in vocabulary
chunks beside its head's row-chunked update (never whole), pinned as a graph diff, equal to eager,
and the live peak it takes down."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase

import optpass
from optpass.demo.models import LMConfig, TinyLM
from parity import Twin, lm_batch, lm_loss, make_step, steady_graph_after

PASS = "logits_gradient_in_chunks"
IN_PLACE = "logits_gradient_in_place"


def compiled(model, opt, loss_fn, **options):
    return torch.compile(make_step(model, opt, loss_fn), backend="optpass",
                         options={"optimizer": opt, "optimizer_in_backward": True, "logits_in_chunks": True,
                                  **options})


def pass_notes() -> list[str]:
    return [note for r in optpass.recent_reports() for p in r.passes if p.name == PASS for note in p.notes]


class TestLogitsGradientInChunksGraph(TestCase):
    def test_the_logits_gradient_is_made_per_chunk_and_the_input_gradient_summed(self):
        """The graph with the pass against the same step without it (Inductor's post-grad graph:
        cross-entropy's backward is pointwise there): dY's pointwise work is copied onto each
        chunk's columns, the head's input gradient is the sum of the chunks' products."""
        from optpass.passes import _row_chunks

        graphs = {}
        saved, _row_chunks.ROW_CHUNK_BYTES = _row_chunks.ROW_CHUNK_BYTES, 16    # [6, 3] head: 2 chunks
        try:
            for disable in ([PASS], []):
                torch._dynamo.reset()
                torch.manual_seed(0)
                model = nn.Sequential(nn.Linear(4, 3, bias=False), nn.Tanh(), nn.Linear(3, 6, bias=False))
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                step = compiled(model, opt, lambda m, x, y: F.cross_entropy(m(x), y), disable_passes=disable)
                graphs[tuple(disable)] = steady_graph_after(step, torch.randn(5, 4), torch.tensor([0, 5, 2, 3, 1]))
        finally:
            _row_chunks.ROW_CHUNK_BYTES = saved
        diff = optpass.graph_diff(graphs[(PASS,)], graphs[()], shapes=False, context=0)
        self.assertExpectedInline(diff, """\
--- before
+++ after
@@ -49 +48,0 @@
-exp_1 = aten.exp(sub_1)
@@ -51,5 +50 @@
-mul_1 = aten.mul.Tensor(exp_1, sum_3)
-sub_2 = aten.sub.Tensor(mul_0, mul_1)
-permute_2 = aten.permute(sub_2, [1, 0])
-permute_3 = aten.permute(permute_1, [1, 0])
-mm_2 = aten.mm(sub_2, permute_3)
+permute_2 = aten.permute(permute_1, [1, 0])
@@ -58,3 +53,18 @@
-slice_1 = aten.slice.Tensor(permute_2, 0, 0, 2)
-mm_3 = aten.mm(slice_1, tanh_0)
-fma_0 = prims.fma(mm_3, neg_1, slice_0)
+slice_1 = aten.slice.Tensor(permute_1, 1, 0, 2)
+slice_2 = aten.slice.Tensor(iota_0, 0, 0, 2)
+mm_2 = aten.mm(tanh_0, slice_1)
+sub_2 = aten.sub.Tensor(mm_2, amax_0)
+sub_3 = aten.sub.Tensor(sub_2, log_0)
+reshape_1 = aten.reshape(slice_2, [1, 2])
+expand_1 = aten.expand(where_2, [5, 2])
+eq_1 = aten.eq.Tensor(expand_1, reshape_1)
+where_5 = aten.where.self(eq_1, scalar_tensor_1, scalar_tensor_0)
+mul_1 = aten.mul.Tensor(where_5, where_4)
+exp_1 = aten.exp(sub_3)
+mul_2 = aten.mul.Tensor(exp_1, sum_3)
+sub_4 = aten.sub.Tensor(mul_1, mul_2)
+slice_3 = aten.slice.Tensor(permute_2, 0, 0, 2)
+mm_3 = aten.mm(sub_4, slice_3)
+permute_3 = aten.permute(sub_4, [1, 0])
+mm_4 = aten.mm(permute_3, tanh_0)
+fma_0 = prims.fma(mm_4, neg_1, slice_0)
@@ -63,16 +73,48 @@
-slice_2 = aten.slice.Tensor(in2, 0, 2, 4)
-slice_3 = aten.slice.Tensor(permute_2, 0, 2, 4)
-mm_4 = aten.mm(slice_3, tanh_0)
-fma_1 = prims.fma(mm_4, neg_1, slice_2)
-copy_1 = aten.copy(slice_2, fma_1)
-copy__1 = aten.copy_(slice_2, copy_1)
-slice_4 = aten.slice.Tensor(in2, 0, 4, 6)
-slice_5 = aten.slice.Tensor(permute_2, 0, 4, 6)
-mm_5 = aten.mm(slice_5, tanh_0)
-fma_2 = prims.fma(mm_5, neg_1, slice_4)
-copy_2 = aten.copy(slice_4, fma_2)
-copy__2 = aten.copy_(slice_4, copy_2)
-mul_2 = aten.mul.Tensor(tanh_0, tanh_0)
-sub_3 = aten.sub.Tensor(1, mul_2)
-mul_3 = aten.mul.Tensor(mm_2, sub_3)
-permute_4 = aten.permute(mul_3, [1, 0])
+slice_4 = aten.slice.Tensor(in2, 0, 2, 4)
+slice_5 = aten.slice.Tensor(permute_1, 1, 2, 4)
+slice_6 = aten.slice.Tensor(iota_0, 0, 2, 4)
+mm_5 = aten.mm(tanh_0, slice_5)
+sub_5 = aten.sub.Tensor(mm_5, amax_0)
+sub_6 = aten.sub.Tensor(sub_5, log_0)
+reshape_2 = aten.reshape(slice_6, [1, 2])
+expand_2 = aten.expand(where_2, [5, 2])
+eq_2 = aten.eq.Tensor(expand_2, reshape_2)
+where_6 = aten.where.self(eq_2, scalar_tensor_1, scalar_tensor_0)
+mul_3 = aten.mul.Tensor(where_6, where_4)
+exp_2 = aten.exp(sub_6)
+mul_4 = aten.mul.Tensor(exp_2, sum_3)
+sub_7 = aten.sub.Tensor(mul_3, mul_4)
+slice_7 = aten.slice.Tensor(permute_2, 0, 2, 4)
+mm_6 = aten.mm(sub_7, slice_7)
+add_0 = aten.add.Tensor(mm_3, mm_6)
+permute_4 = aten.permute(sub_7, [1, 0])
+mm_7 = aten.mm(permute_4, tanh_0)
+fma_1 = prims.fma(mm_7, neg_1, slice_4)
+copy_1 = aten.copy(slice_4, fma_1)
+copy__1 = aten.copy_(slice_4, copy_1)
+slice_8 = aten.slice.Tensor(in2, 0, 4, 6)
+slice_9 = aten.slice.Tensor(permute_1, 1, 4, 6)
+slice_10 = aten.slice.Tensor(iota_0, 0, 4, 6)
+mm_8 = aten.mm(tanh_0, slice_9)
+sub_8 = aten.sub.Tensor(mm_8, amax_0)
+sub_9 = aten.sub.Tensor(sub_8, log_0)
+reshape_3 = aten.reshape(slice_10, [1, 2])
+expand_3 = aten.expand(where_2, [5, 2])
+eq_3 = aten.eq.Tensor(expand_3, reshape_3)
+where_7 = aten.where.self(eq_3, scalar_tensor_1, scalar_tensor_0)
+mul_5 = aten.mul.Tensor(where_7, where_4)
+exp_3 = aten.exp(sub_9)
+mul_6 = aten.mul.Tensor(exp_3, sum_3)
+sub_10 = aten.sub.Tensor(mul_5, mul_6)
+slice_11 = aten.slice.Tensor(permute_2, 0, 4, 6)
+mm_9 = aten.mm(sub_10, slice_11)
+add_1 = aten.add.Tensor(add_0, mm_9)
+permute_5 = aten.permute(sub_10, [1, 0])
+mm_10 = aten.mm(permute_5, tanh_0)
+fma_2 = prims.fma(mm_10, neg_1, slice_8)
+copy_2 = aten.copy(slice_8, fma_2)
+copy__2 = aten.copy_(slice_8, copy_2)
+mul_7 = aten.mul.Tensor(tanh_0, tanh_0)
+sub_11 = aten.sub.Tensor(1, mul_7)
+mul_8 = aten.mul.Tensor(add_1, sub_11)
+permute_6 = aten.permute(mul_8, [1, 0])
@@ -80,18 +122,18 @@
-slice_6 = aten.slice.Tensor(in0, 0, 0, 1)
-slice_7 = aten.slice.Tensor(permute_4, 0, 0, 1)
-mm_6 = aten.mm(slice_7, in1)
-fma_3 = prims.fma(mm_6, neg_2, slice_6)
-copy_3 = aten.copy(slice_6, fma_3)
-copy__3 = aten.copy_(slice_6, copy_3)
-slice_8 = aten.slice.Tensor(in0, 0, 1, 2)
-slice_9 = aten.slice.Tensor(permute_4, 0, 1, 2)
-mm_7 = aten.mm(slice_9, in1)
-fma_4 = prims.fma(mm_7, neg_2, slice_8)
-copy_4 = aten.copy(slice_8, fma_4)
-copy__4 = aten.copy_(slice_8, copy_4)
-slice_10 = aten.slice.Tensor(in0, 0, 2, 3)
-slice_11 = aten.slice.Tensor(permute_4, 0, 2, 3)
-mm_8 = aten.mm(slice_11, in1)
-fma_5 = prims.fma(mm_8, neg_2, slice_10)
-copy_5 = aten.copy(slice_10, fma_5)
-copy__5 = aten.copy_(slice_10, copy_5)
+slice_12 = aten.slice.Tensor(in0, 0, 0, 1)
+slice_13 = aten.slice.Tensor(permute_6, 0, 0, 1)
+mm_11 = aten.mm(slice_13, in1)
+fma_3 = prims.fma(mm_11, neg_2, slice_12)
+copy_3 = aten.copy(slice_12, fma_3)
+copy__3 = aten.copy_(slice_12, copy_3)
+slice_14 = aten.slice.Tensor(in0, 0, 1, 2)
+slice_15 = aten.slice.Tensor(permute_6, 0, 1, 2)
+mm_12 = aten.mm(slice_15, in1)
+fma_4 = prims.fma(mm_12, neg_2, slice_14)
+copy_4 = aten.copy(slice_14, fma_4)
+copy__4 = aten.copy_(slice_14, copy_4)
+slice_16 = aten.slice.Tensor(in0, 0, 2, 3)
+slice_17 = aten.slice.Tensor(permute_6, 0, 2, 3)
+mm_13 = aten.mm(slice_17, in1)
+fma_5 = prims.fma(mm_13, neg_2, slice_16)
+copy_5 = aten.copy(slice_16, fma_5)
+copy__5 = aten.copy_(slice_16, copy_5)""")


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("optimizer", ["adamw"])   # the other optimizers: test_language_model_memory
def test_an_untied_language_model_with_chunked_logits_gradients_trains_like_eager(optimizer, monkeypatch):
    from optpass.passes import _row_chunks

    monkeypatch.setattr(_row_chunks, "ROW_CHUNK_BYTES", 1024)       # tiny model, many chunks
    torch._dynamo.reset()
    cfg = LMConfig(vocab=96, d_model=32, n_heads=2, n_layers=2, seq_len=16, tie_head=False)
    make_opt = {"adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1),
                "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)}[optimizer]
    twin = Twin(lambda: TinyLM(cfg), make_opt)
    eager = make_step(twin.eager_model, twin.eager_opt, lm_loss)
    step = compiled(twin.compiled_model, twin.compiled_opt, lm_loss, lower="inductor")
    data = lm_batch(cfg.vocab, batch=4, seq_len=16)
    optpass.report.clear_reports()
    with optpass.keep_graphs():
        for i in range(6):
            expected, got = eager(*data(i)), step(*data(i))
            assert got.item() == pytest.approx(expected.item(), rel=1e-9)
    params, state = twin.diffs()
    assert params <= 1e-9 and state <= 1e-9
    assert any("made in vocabulary chunks" in note for note in pass_notes()), pass_notes()


def test_the_live_peak_no_longer_holds_the_whole_logits_gradient():
    """An untied LM whose step peak is the loss (256 tokens x vocab 8192: logits and their gradient,
    8 MiB each): with the pass the peak falls by at least 3/4 of the logits gradient, and it is no
    higher than with the logits gradient written over the logits (logits_gradient_in_place, on by
    default, which the chunks leave nothing to do)."""
    cfg = LMConfig(vocab=8192, d_model=256, n_heads=4, n_layers=1, seq_len=64, tie_head=False)
    data = lm_batch(cfg.vocab, batch=4, seq_len=64)
    peaks = {}
    for disable in ((PASS, IN_PLACE), (IN_PLACE,), (PASS,)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = TinyLM(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4))
        step = compiled(model, opt, lm_loss, disable_passes=list(disable))
        for i in range(2):
            step(*data(i))
        with optpass.measure_tensor_peak() as peak:
            step(*data(2))
        peaks[disable] = peak.growth_bytes
    logits_gradient_bytes = 4 * 64 * cfg.vocab * 4
    assert peaks[(PASS, IN_PLACE)] - peaks[(IN_PLACE,)] >= 0.75 * logits_gradient_bytes, peaks
    assert peaks[(IN_PLACE,)] <= peaks[(PASS,)], peaks


def test_explain_says_the_pass_runs_on_inductors_decomposed_loss():
    """explain's aten graph has cross-entropy's backward as one op: the pass does not apply there,
    and the line says where it does instead of a reason that reads like a refusal."""
    torch._dynamo.reset()
    cfg = LMConfig(vocab=8192, d_model=160, n_heads=4, n_layers=1, seq_len=16, tie_head=False)
    model = TinyLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4))
    text = str(optpass.explain(make_step(model, opt, lm_loss), *lm_batch(cfg.vocab, 2, 16)(0),
                               options={"optimizer": opt, "optimizer_in_backward": True,
                                        "logits_in_chunks": True}))
    line = next(line for line in text.splitlines() if f"pass {PASS}" in line)
    assert "Inductor's lowering (the default) decomposes it into pointwise ops" in line, line


def test_a_half_precision_logits_gradient_is_left_whole_with_the_reason(monkeypatch):
    """bf16 parameters on fp32 masters: each chunk's share of the head input's gradient would be
    rounded to bf16 before the sum, so the pass leaves the gradient whole and says why."""
    from optpass.passes import _row_chunks

    monkeypatch.setattr(_row_chunks, "ROW_CHUNK_BYTES", 1024)
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = LMConfig(vocab=96, d_model=32, n_heads=2, n_layers=1, seq_len=16, tie_head=False)
    model = TinyLM(cfg).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-3))
    step = compiled(model, opt, lm_loss, master_weights=torch.float32)
    optpass.report.clear_reports()
    loss = step(*lm_batch(cfg.vocab, batch=4, seq_len=16)(0))
    assert torch.isfinite(loss)
    outcome = next(p for r in optpass.recent_reports() for p in r.passes if p.name == PASS)
    assert outcome.status == "skipped" and "torch.bfloat16 gradient" in outcome.reason, outcome
