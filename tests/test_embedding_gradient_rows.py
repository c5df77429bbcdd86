"""embedding_gradient_rows: an embedding gradient of which one block of rows is kept is made for
those rows alone (a vocabulary-parallel embedding under DTensor), pinned as a graph diff and equal
to eager.

One process: a vocabulary shard written the way DTensor's RowwiseParallel embedding runs on a
tensor-parallel rank (the rows [a, b) of a table of V, looked up with the ids masked; the
gradient made over the whole table, then this shard's rows kept and copied). The tensor-parallel
Llama on ranks (tests/test_tensor_parallel.py) runs the same rewrite on DTensor's own graph."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase

import optpass
from parity import Twin, make_step, steady_graph_after

PASS = "embedding_gradient_rows"
aten = torch.ops.aten


class _RowsOfTheTable(torch.autograd.Function):
    """Rows [start, start + weight.shape[0]) of an embedding table of ``vocab`` rows: the lookup of
    the ids that fall there (others give zeros); backward as DTensor spells it."""

    @staticmethod
    def forward(ctx, weight, ids, vocab, start, padding_idx, spelling):
        ctx.save_for_backward(ids)
        ctx.vocab, ctx.start, ctx.rows, ctx.padding_idx, ctx.spelling = vocab, start, weight.shape[0], padding_idx, spelling
        inside = (ids >= start) & (ids < start + weight.shape[0])
        return F.embedding(torch.where(inside, ids - start, 0), weight) * inside.unsqueeze(-1)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        whole = aten.embedding_dense_backward(grad, ids, ctx.vocab, ctx.padding_idx, False)
        if ctx.spelling == "split":
            rows = whole.split(ctx.rows)[ctx.start // ctx.rows]
        else:
            rows = whole[ctx.start:ctx.start + ctx.rows]
        return rows.clone(), None, None, None, None, None


class VocabularyShard(nn.Module):
    def __init__(self, vocab=12, rows=4, start=4, width=5, padding_idx=-1, spelling="split"):
        super().__init__()
        self.embedding = nn.Parameter(torch.randn(rows, width))
        self.head = nn.Linear(width, vocab)
        self.vocab, self.start, self.padding_idx, self.spelling = vocab, start, padding_idx, spelling

    def forward(self, ids):
        rows = _RowsOfTheTable.apply(self.embedding, ids, self.vocab, self.start, self.padding_idx, self.spelling)
        return self.head(torch.tanh(rows))


def loss_fn(model, ids, targets):
    return F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())


def compiled(model, opt, **options):
    return torch.compile(make_step(model, opt, loss_fn), backend="optpass", options={"optimizer": opt, **options})


def batch(i, vocab=12):
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, vocab, (3, 7), generator=g), torch.randint(0, vocab, (3, 7), generator=g)


class TestEmbeddingGradientRowsGraph(TestCase):
    def test_the_gradient_is_made_over_the_kept_rows_and_one_padding_row(self):
        """The graph with the pass against the same step without it: the gradient over 12 rows,
        split, its second piece copied, becomes the gradient over 4 + 1 rows (ids outside renumbered
        to the padding row 4), its first 4 read as they are."""
        graphs = {}
        for disable in ([PASS], []):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = VocabularyShard()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            step = compiled(model, opt, disable_passes=disable)
            graphs[tuple(disable)] = steady_graph_after(step, *batch(0))
        diff = optpass.graph_diff(graphs[(PASS,)], graphs[()], shapes=False, context=1)
        self.assertExpectedInline(diff, """\
--- before
+++ after
@@ -5,3 +5,3 @@
 in4 = placeholder
-full_0 = aten.full([12, 5], 0, dtype=torch.float32, layout=torch.strided, device=device('cpu'), pin_memory=False)
+full_0 = aten.full([4, 5], 0, dtype=torch.float32, layout=torch.strided, device=device('cpu'), pin_memory=False)
 ge_0 = aten.ge.Scalar(in1, 0)
@@ -62,5 +62,9 @@
 mul_4 = aten.mul.Tensor(reshape_3, sub_4)
-_unsafe_masked_index_put_accumulate_0 = aten._unsafe_masked_index_put_accumulate(full_0, unsqueeze_0, [in1], mul_4)
-split_0 = aten.split.Tensor(_unsafe_masked_index_put_accumulate_0, 4)
-getitem_0 = getitem(split_0, 1)
+ge_2 = aten.ge.Scalar(in1, 4)
+lt_2 = aten.lt.Scalar(in1, 8)
+bitwise_and_3 = aten.bitwise_and.Tensor(ge_2, lt_2)
+unsqueeze_3 = aten.unsqueeze(bitwise_and_3, -1)
+bitwise_and_4 = aten.bitwise_and.Tensor(unsqueeze_0, unsqueeze_3)
+sub_5 = aten.sub.Tensor(in1, 4)
+_unsafe_masked_index_put_accumulate_0 = aten._unsafe_masked_index_put_accumulate(full_0, bitwise_and_4, [sub_5], mul_4)
 ne_4 = aten.ne.Scalar(reshape_1, -100)
@@ -69,4 +73,4 @@
 where_4 = aten.where.self(ne_5, reshape_1, full_5)
-unsqueeze_3 = aten.unsqueeze(where_4, 1)
-gather_0 = aten.gather(sub_2, 1, unsqueeze_3)
+unsqueeze_4 = aten.unsqueeze(where_4, 1)
+gather_0 = aten.gather(sub_2, 1, unsqueeze_4)
 squeeze_0 = aten.squeeze.dim(gather_0, 1)
@@ -81,2 +85,2 @@
 reshape_4 = aten.reshape(sum_4, [12])
-return (div_1, getitem_0, mm_1, reshape_4)
+return (div_1, _unsafe_masked_index_put_accumulate_0, mm_1, reshape_4)""")


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("spelling,padding_idx,in_backward,lower", [
    ("split", -1, True, "inductor"), ("split", 5, True, "inductor"), ("split", 1, True, "inductor"),
    ("slice", 5, True, "inductor"), ("split", 5, False, "inductor"),
    ("split", 5, True, "eager"), ("slice", 1, True, "eager"), ("split", -1, False, "eager")])
def test_a_vocabulary_shard_trains_like_eager(spelling, padding_idx, in_backward, lower):
    """Float64, 5 steps of AdamW, the rows 4..8 of a table of 12: a padding id among the kept rows
    (5), outside them (1) or none; the gradient kept by split or by slice; the update in backward
    and after it; Inductor's graph (a masked accumulation) and the eager lowering's
    (embedding_dense_backward, a padding row added)."""
    torch._dynamo.reset()
    twin = Twin(lambda: VocabularyShard(padding_idx=padding_idx, spelling=spelling),
                lambda m: torch.optim.AdamW(m.parameters(), lr=3e-2, weight_decay=0.1))
    eager = make_step(twin.eager_model, twin.eager_opt, loss_fn)
    step = compiled(twin.compiled_model, twin.compiled_opt, optimizer_in_backward=in_backward, lower=lower)
    optpass.report.clear_reports()
    for i in range(5):
        expected, got = eager(*batch(i)), step(*batch(i))
        assert got.item() == pytest.approx(expected.item(), rel=1e-12)
    params, state = twin.diffs()
    assert params <= 1e-12 and state <= 1e-12
    outcomes = [p for r in optpass.recent_reports() for p in r.passes if p.name == PASS]
    assert any(p.status == "applied" and "12 -> 4 rows (4..8)" in " ".join(p.notes) for p in outcomes), outcomes


def test_a_whole_embedding_gradient_is_left_alone():
    """An nn.Embedding's gradient is read whole: nothing to rewrite."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Embedding(12, 5), nn.Linear(5, 12))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = compiled(model, opt)
    optpass.report.clear_reports()
    step(*batch(0))
    outcomes = [p for r in optpass.recent_reports() for p in r.passes if p.name == PASS]
    assert outcomes and all(p.status == "skipped" for p in outcomes), outcomes
