"""optimizer_in_backward on language models: a tied weight's gradient is one buffer, built at the end
of backward (pass accumulate_gradient_in_place), Inductor keeps each update where its gradient dies,
and the step trains like eager."""

import pytest
import torch
from expecttest import TestCase

import optpass
from optpass.demo.models import LMConfig, TinyLM
from parity import Twin, lm_batch, lm_loss, make_step, steady_graph_after

TOL = 1e-6
aten = torch.ops.aten


def fused_step(model, opt, lower):
    return torch.compile(make_step(model, opt, lm_loss), backend="optpass",
                         options={"lower": lower, "optimizer": opt, "optimizer_in_backward": True})


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("tie_head", [True, False], ids=["tied", "untied"])
def test_tied_and_untied_language_models_train_like_eager_with_inductor(tie_head):
    torch._dynamo.reset()
    cfg = LMConfig(vocab=96, d_model=32, n_heads=2, n_layers=2, seq_len=16, tie_head=tie_head)
    twin = Twin(lambda: TinyLM(cfg), lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1))
    eager = make_step(twin.eager_model, twin.eager_opt, lm_loss)
    step = fused_step(twin.compiled_model, twin.compiled_opt, "inductor")
    data = lm_batch(cfg.vocab)
    for i in range(8):
        expected, got = eager(*data(i)), step(*data(i))
        assert got.item() == pytest.approx(expected.item(), rel=1e-9)
    params, state = twin.diffs()
    assert params <= TOL and state <= TOL
    assert all(p.grad is None for p in twin.compiled_model.parameters())


def test_a_tied_weight_gradient_is_one_buffer_built_at_the_end_of_backward():
    torch._dynamo.reset()
    # 16 tokens, vocab 512, d=64: the head's [512, 64] gradient is larger than its GEMM's inputs
    cfg = LMConfig(vocab=512, d_model=64, n_heads=2, n_layers=1, seq_len=8)
    model = TinyLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = fused_step(model, opt, "inductor")
    optpass.report.clear_reports()
    with optpass.keep_graphs():
        step(*lm_batch(cfg.vocab, batch=2, seq_len=8)(0))
    report = next(r for r in optpass.recent_reports() if r.graph_after is not None)
    nodes = list(report.graph_after.nodes)
    shape = tuple(model.embed.weight.shape)

    def of_shape(n):
        return isinstance(n.meta.get("val"), torch.Tensor) and tuple(n.meta["val"].shape) == shape

    # before: the head's GEMM early in backward, a zero-filled scatter, their sum
    before = list(report.graph_before.nodes)
    assert any(n.target is aten.full.default and of_shape(n) for n in before)
    # after: no zero-filled [vocab, d] tensor; the scatter accumulates into the head's GEMM,
    # computed right before it, and the update follows
    assert not any(n.target is aten.full.default and of_shape(n) for n in nodes)
    scatter = next(n for n in nodes if n.target is aten._unsafe_masked_index_put_accumulate.default)
    head = scatter.args[0]
    assert head.target is aten.mm.default and of_shape(head)
    assert nodes.index(scatter) - nodes.index(head) == 1
    late = nodes.index(head) / len(nodes)
    assert late > 0.9, f"the head's GEMM should run at the end of backward, not at {late:.0%} of the graph"


def test_the_live_peak_drops_by_all_but_the_largest_gradient_on_a_tied_language_model():
    """The issue's measure on a small GPT: the steady step's live-tensor peak with the updates in
    backward is at least 0.9 x (gradient bytes - the largest gradient's bytes) below Inductor's."""
    cfg = LMConfig(vocab=2048, d_model=256, n_heads=4, n_layers=2, seq_len=8)
    data = lm_batch(cfg.vocab, batch=2, seq_len=8)     # few tokens: gradients, not activations, set the peak
    peaks = {}
    for kind in ("inductor", "optpass"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = TinyLM(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4))
        train = make_step(model, opt, lm_loss)
        step = (torch.compile(train, backend="inductor") if kind == "inductor"
                else fused_step(model, opt, "inductor"))
        for i in range(3):
            step(*data(i))
        with optpass.measure_tensor_peak() as peak:
            step(*data(3))
        peaks[kind] = peak.peak_bytes
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    goal = 0.9 * (sum(sizes) - max(sizes))
    assert peaks["inductor"] - peaks["optpass"] >= goal, (peaks, goal)


@pytest.mark.parametrize("tie_head", [True, False], ids=["tied", "untied"])
def test_the_embedding_gradient_is_never_whole(tie_head, monkeypatch):
    """The largest gradient, the embedding's [8192, 256] (8 MiB; tied to the head or not), is made
    and applied in row chunks at the end of backward: the step's live peak above parameters and
    state stays under half of it, where made whole it holds all of it."""
    from optpass.passes import _row_chunks

    cfg = LMConfig(vocab=8192, d_model=256, n_heads=4, n_layers=1, seq_len=8, tie_head=tie_head)
    data = lm_batch(cfg.vocab, batch=2, seq_len=8)     # 16 tokens: the gradients set the peak
    growth, default = {}, _row_chunks.ROW_CHUNK_BYTES
    for chunk_bytes in (default, 1 << 40):
        monkeypatch.setattr(_row_chunks, "ROW_CHUNK_BYTES", chunk_bytes)
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = TinyLM(cfg)
        step = fused_step(model, torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4)), "inductor")
        for i in range(2):
            step(*data(i))
        with optpass.measure_tensor_peak() as peak:
            step(*data(2))
        growth[chunk_bytes] = peak.growth_bytes
    embedding_bytes = model.embed.weight.numel() * 4
    chunked, whole = growth[default], growth[1 << 40]
    assert chunked < 0.5 * embedding_bytes <= whole, (chunked, whole, embedding_bytes)


@pytest.fixture
def small_row_chunks(monkeypatch):
    """Chunk every gradient of more than 2 KiB into chunks of about 1 KiB (tiny models get chunked)."""
    from optpass.passes import _row_chunks

    monkeypatch.setattr(_row_chunks, "ROW_CHUNK_BYTES", 1024)


def chunked_parameters() -> list[str]:
    return [note for r in optpass.recent_reports() for p in r.passes for note in p.notes if "row chunks" in note]


@pytest.mark.usefixtures("float64_default", "small_row_chunks")
@pytest.mark.parametrize("lower,tie_head", [("eager", False), ("inductor", False), ("inductor", True)])
def test_head_and_embedding_made_and_applied_in_row_chunks_train_like_eager(lower, tie_head):
    """The head's gradient (a GEMM) and, under Inductor's lowering, the embedding's (a scatter, tied
    or not) made and applied in row chunks: equal to eager in float64."""
    torch._dynamo.reset()
    cfg = LMConfig(vocab=96, d_model=32, n_heads=2, n_layers=1, seq_len=16, tie_head=tie_head)
    twin = Twin(lambda: TinyLM(cfg), lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1))
    eager = make_step(twin.eager_model, twin.eager_opt, lm_loss)
    step = fused_step(twin.compiled_model, twin.compiled_opt, lower)
    data = lm_batch(cfg.vocab)
    optpass.report.clear_reports()
    with optpass.keep_graphs():          # the passes run (no cache hit), so their notes are there
        for i in range(6):
            expected, got = eager(*data(i)), step(*data(i))
            assert got.item() == pytest.approx(expected.item(), rel=1e-9)
    params, state = twin.diffs()
    assert params <= TOL and state <= TOL
    chunked = chunked_parameters()
    assert tie_head or any(note.startswith("head.weight") for note in chunked), chunked
    assert lower == "eager" or any(note.startswith("embed.weight") for note in chunked), chunked


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "rmsprop_centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9, centered=True),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),      # not elementwise: never chunked
}


@pytest.mark.usefixtures("float64_default", "small_row_chunks")
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_elementwise_optimizer_applied_in_row_chunks_matches_eager(name):
    from optpass.demo.models import MLP

    from parity import mlp_data, mlp_loss

    torch._dynamo.reset()
    twin = Twin(lambda: MLP((16, 32, 32, 4)), lambda m: OPTIMIZERS[name](m.parameters()))
    eager = make_step(twin.eager_model, twin.eager_opt, mlp_loss)
    step = torch.compile(make_step(twin.compiled_model, twin.compiled_opt, mlp_loss), backend="optpass",
                         options={"lower": "eager", "optimizer": twin.compiled_opt, "optimizer_in_backward": True})
    optpass.report.clear_reports()
    with optpass.keep_graphs():
        for i in range(6):
            assert step(*mlp_data(i)).item() == pytest.approx(eager(*mlp_data(i)).item(), rel=1e-9)
    params, state = twin.diffs()
    assert params <= TOL and state <= TOL
    chunked = chunked_parameters()
    assert bool(chunked) == (name != "adafactor"), chunked


@pytest.mark.parametrize("lower", ["eager", "inductor"])
def test_bf16_masters_updated_in_row_chunks_equal_the_whole_update(lower, monkeypatch):
    """master_weights + optimizer_in_backward: a chunk's bf16 gradient rows are cast to fp32, its
    master rows updated, and rounded into the parameter's rows; equal to the update made whole up
    to bf16 rounding. SGD with momentum: under Adam a gradient element that sums to about zero
    (an embedding row's tokens, scattered in another order) turns a rounding difference into a
    step of 2 x lr, a difference of the optimizer's, not of the chunks."""
    from optpass.passes import _row_chunks

    cfg = LMConfig(vocab=96, d_model=32, n_heads=2, n_layers=1, seq_len=16, tie_head=False)
    data = lm_batch(cfg.vocab)
    results = {}
    for chunk_bytes in (1 << 40, 1024):
        monkeypatch.setattr(_row_chunks, "ROW_CHUNK_BYTES", chunk_bytes)
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = TinyLM(cfg).to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1), momentum=0.9, weight_decay=0.1)
        step = torch.compile(make_step(model, opt, lm_loss), backend="optpass",
                             options={"lower": lower, "optimizer": opt, "optimizer_in_backward": True,
                                      "master_weights": torch.float32})
        optpass.report.clear_reports()
        with optpass.keep_graphs():
            losses = [step(*data(i)).item() for i in range(5)]
        results[chunk_bytes] = (losses, [p.detach().clone() for p in model.parameters()], chunked_parameters())
    (whole_losses, whole, none), (chunk_losses, chunked, notes) = results[1 << 40], results[1024]
    assert not none and any(n.startswith("head.weight") for n in notes), notes
    assert lower == "eager" or any(n.startswith("embed.weight") for n in notes), notes
    assert chunk_losses == pytest.approx(whole_losses, rel=1e-6)
    for a, b in zip(chunked, whole):
        assert torch.equal(a, b) or (a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max()


class _TinyEmbeddingLM(torch.nn.Module):
    """Embedding(6, 2) -> Linear(2, 6): a [6, 2] embedding (48 bytes in fp32), tied to the head or not."""

    def __init__(self, tie_head: bool):
        super().__init__()
        self.embed = torch.nn.Embedding(6, 2)
        self.head = torch.nn.Linear(2, 6, bias=False)
        if tie_head:
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.embed(tokens)))


class TestEmbeddingRowChunksGraph(TestCase):
    """The embedding's gradient in row chunks, pinned as a graph diff against the same step with every
    gradient made whole (Inductor's post-grad graph, SGD): chunk rows a:b are the tokens whose index
    falls in a:b scattered into fresh [b - a, d] zeros made after the previous chunk's row write
    (untied), or into the head GEMM's rows a:b (tied), and the update of rows a:b is written in place."""

    def embedding_diff(self, tie_head: bool) -> str:
        from optpass.passes import _row_chunks

        graphs = {}
        for chunk_bytes in (1 << 40, 16):            # whole; 48 bytes in chunks of 2 rows (16 bytes)
            saved, _row_chunks.ROW_CHUNK_BYTES = _row_chunks.ROW_CHUNK_BYTES, chunk_bytes
            try:
                torch._dynamo.reset()
                torch.manual_seed(0)
                model = _TinyEmbeddingLM(tie_head)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                loss = lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y)      # noqa: E731
                step = torch.compile(make_step(model, opt, loss), backend="optpass",
                                     options={"optimizer": opt, "optimizer_in_backward": True,
                                              "disable_passes": ["logits_gradient_in_place"]})
                graphs[chunk_bytes] = steady_graph_after(step, torch.tensor([0, 5, 2, 3, 1]),
                                                         torch.tensor([1, 0, 4, 2, 5]))
            finally:
                _row_chunks.ROW_CHUNK_BYTES = saved
        return optpass.graph_diff(graphs[1 << 40], graphs[16], shapes=False, context=0)

    def test_an_untied_embedding_gradient_is_scattered_into_zeros_per_chunk(self):
        self.assertExpectedInline(self.embedding_diff(tie_head=False), """\
--- before
+++ after
@@ -53 +52,0 @@
-mm_1 = aten.mm(permute_1, tanh_0)
@@ -55 +54 @@
-mm_2 = aten.mm(sub_2, permute_2)
+mm_1 = aten.mm(sub_2, permute_2)
@@ -57,3 +56,18 @@
-fma_0 = prims.fma(mm_1, neg_1, in2)
-copy_0 = aten.copy(in2, fma_0)
-copy__0 = aten.copy_(in2, copy_0)
+slice_0 = aten.slice.Tensor(in2, 0, 0, 2)
+slice_1 = aten.slice.Tensor(permute_1, 0, 0, 2)
+mm_2 = aten.mm(slice_1, tanh_0)
+fma_0 = prims.fma(mm_2, neg_1, slice_0)
+copy_0 = aten.copy(slice_0, fma_0)
+copy__0 = aten.copy_(slice_0, copy_0)
+slice_2 = aten.slice.Tensor(in2, 0, 2, 4)
+slice_3 = aten.slice.Tensor(permute_1, 0, 2, 4)
+mm_3 = aten.mm(slice_3, tanh_0)
+fma_1 = prims.fma(mm_3, neg_1, slice_2)
+copy_1 = aten.copy(slice_2, fma_1)
+copy__1 = aten.copy_(slice_2, copy_1)
+slice_4 = aten.slice.Tensor(in2, 0, 4, 6)
+slice_5 = aten.slice.Tensor(permute_1, 0, 4, 6)
+mm_4 = aten.mm(slice_5, tanh_0)
+fma_2 = prims.fma(mm_4, neg_1, slice_4)
+copy_2 = aten.copy(slice_4, fma_2)
+copy__2 = aten.copy_(slice_4, copy_2)
@@ -62 +76 @@
-mul_3 = aten.mul.Tensor(mm_2, sub_3)
+mul_3 = aten.mul.Tensor(mm_1, sub_3)
@@ -69,2 +82,0 @@
-full_5 = aten.full([6, 2], 0, dtype=torch.float32, layout=torch.strided, device=device('cpu'), pin_memory=False)
-_unsafe_masked_index_put_accumulate_0 = aten._unsafe_masked_index_put_accumulate(full_5, unsqueeze_2, [in1], mul_3)
@@ -72,3 +84,48 @@
-fma_1 = prims.fma(_unsafe_masked_index_put_accumulate_0, neg_2, in0)
-copy_1 = aten.copy(in0, fma_1)
-copy__1 = aten.copy_(in0, copy_1)
+slice_6 = aten.slice.Tensor(in0, 0, 0, 2)
+zeros_after_0 = optpass.zeros_after([2, 2], torch.float32, device('cpu'), [mul_3])
+ge_1 = aten.ge.Scalar(in1, 0)
+lt_1 = aten.lt.Scalar(in1, 2)
+bitwise_and_2 = aten.bitwise_and.Tensor(ge_1, lt_1)
+reshape_1 = aten.reshape(bitwise_and_2, [5, 1])
+bitwise_and_3 = aten.bitwise_and.Tensor(unsqueeze_2, reshape_1)
+scalar_tensor_2 = aten.scalar_tensor(0, dtype=torch.int64)
+sub_4 = aten.sub.Tensor(in1, 0)
+where_5 = aten.where.self(bitwise_and_2, sub_4, scalar_tensor_2)
+scalar_tensor_3 = aten.scalar_tensor(0.0, dtype=torch.float32)
+where_6 = aten.where.self(bitwise_and_3, mul_3, scalar_tensor_3)
+index_put__0 = aten.index_put_(zeros_after_0, [where_5], where_6, True)
+fma_3 = prims.fma(index_put__0, neg_2, slice_6)
+copy_3 = aten.copy(slice_6, fma_3)
+copy__3 = aten.copy_(slice_6, copy_3)
+slice_7 = aten.slice.Tensor(in0, 0, 2, 4)
+zeros_after_1 = optpass.zeros_after([2, 2], torch.float32, device('cpu'), [copy__3])
+ge_2 = aten.ge.Scalar(in1, 2)
+lt_2 = aten.lt.Scalar(in1, 4)
+bitwise_and_4 = aten.bitwise_and.Tensor(ge_2, lt_2)
+reshape_2 = aten.reshape(bitwise_and_4, [5, 1])
+bitwise_and_5 = aten.bitwise_and.Tensor(unsqueeze_2, reshape_2)
+scalar_tensor_4 = aten.scalar_tensor(0, dtype=torch.int64)
+sub_5 = aten.sub.Tensor(in1, 2)
+where_7 = aten.where.self(bitwise_and_4, sub_5, scalar_tensor_4)
+scalar_tensor_5 = aten.scalar_tensor(0.0, dtype=torch.float32)
+where_8 = aten.where.self(bitwise_and_5, mul_3, scalar_tensor_5)
+index_put__1 = aten.index_put_(zeros_after_1, [where_7], where_8, True)
+fma_4 = prims.fma(index_put__1, neg_2, slice_7)
+copy_4 = aten.copy(slice_7, fma_4)
+copy__4 = aten.copy_(slice_7, copy_4)
+slice_8 = aten.slice.Tensor(in0, 0, 4, 6)
+zeros_after_2 = optpass.zeros_after([2, 2], torch.float32, device('cpu'), [copy__4])
+ge_3 = aten.ge.Scalar(in1, 4)
+lt_3 = aten.lt.Scalar(in1, 6)
+bitwise_and_6 = aten.bitwise_and.Tensor(ge_3, lt_3)
+reshape_3 = aten.reshape(bitwise_and_6, [5, 1])
+bitwise_and_7 = aten.bitwise_and.Tensor(unsqueeze_2, reshape_3)
+scalar_tensor_6 = aten.scalar_tensor(0, dtype=torch.int64)
+sub_6 = aten.sub.Tensor(in1, 4)
+where_9 = aten.where.self(bitwise_and_6, sub_6, scalar_tensor_6)
+scalar_tensor_7 = aten.scalar_tensor(0.0, dtype=torch.float32)
+where_10 = aten.where.self(bitwise_and_7, mul_3, scalar_tensor_7)
+index_put__2 = aten.index_put_(zeros_after_2, [where_9], where_10, True)
+fma_5 = prims.fma(index_put__2, neg_2, slice_8)
+copy_5 = aten.copy(slice_8, fma_5)
+copy__5 = aten.copy_(slice_8, copy_5)""")

    def test_a_tied_embedding_gradient_is_scattered_into_the_head_gemm_rows_per_chunk(self):
        self.assertExpectedInline(self.embedding_diff(tie_head=True), """\
--- before
+++ after
@@ -52 +51,0 @@
-mm_1 = aten.mm(permute_1, tanh_0)
@@ -54 +53 @@
-mm_2 = aten.mm(sub_2, permute_2)
+mm_1 = aten.mm(sub_2, permute_2)
@@ -57 +56 @@
-mul_3 = aten.mul.Tensor(mm_2, sub_3)
+mul_3 = aten.mul.Tensor(mm_1, sub_3)
@@ -64 +62,0 @@
-_unsafe_masked_index_put_accumulate_0 = aten._unsafe_masked_index_put_accumulate(mm_1, unsqueeze_2, [in1], mul_3)
@@ -66,3 +64,54 @@
-fma_0 = prims.fma(_unsafe_masked_index_put_accumulate_0, neg_1, in0)
-copy_0 = aten.copy(in0, fma_0)
-copy__0 = aten.copy_(in0, copy_0)
+slice_0 = aten.slice.Tensor(in0, 0, 0, 2)
+slice_1 = aten.slice.Tensor(permute_1, 0, 0, 2)
+mm_2 = aten.mm(slice_1, tanh_0)
+clone_after_0 = optpass.clone_after(in1, [mul_3])
+ge_1 = aten.ge.Scalar(clone_after_0, 0)
+lt_1 = aten.lt.Scalar(clone_after_0, 2)
+bitwise_and_2 = aten.bitwise_and.Tensor(ge_1, lt_1)
+reshape_1 = aten.reshape(bitwise_and_2, [5, 1])
+bitwise_and_3 = aten.bitwise_and.Tensor(unsqueeze_2, reshape_1)
+scalar_tensor_2 = aten.scalar_tensor(0, dtype=torch.int64)
+sub_4 = aten.sub.Tensor(clone_after_0, 0)
+where_5 = aten.where.self(bitwise_and_2, sub_4, scalar_tensor_2)
+scalar_tensor_3 = aten.scalar_tensor(0.0, dtype=torch.float32)
+where_6 = aten.where.self(bitwise_and_3, mul_3, scalar_tensor_3)
+index_put__0 = aten.index_put_(mm_2, [where_5], where_6, True)
+fma_0 = prims.fma(index_put__0, neg_1, slice_0)
+copy_0 = aten.copy(slice_0, fma_0)
+copy__0 = aten.copy_(slice_0, copy_0)
+slice_2 = aten.slice.Tensor(in0, 0, 2, 4)
+slice_3 = aten.slice.Tensor(permute_1, 0, 2, 4)
+mm_3 = aten.mm(slice_3, tanh_0)
+clone_after_1 = optpass.clone_after(in1, [copy__0])
+ge_2 = aten.ge.Scalar(clone_after_1, 2)
+lt_2 = aten.lt.Scalar(clone_after_1, 4)
+bitwise_and_4 = aten.bitwise_and.Tensor(ge_2, lt_2)
+reshape_2 = aten.reshape(bitwise_and_4, [5, 1])
+bitwise_and_5 = aten.bitwise_and.Tensor(unsqueeze_2, reshape_2)
+scalar_tensor_4 = aten.scalar_tensor(0, dtype=torch.int64)
+sub_5 = aten.sub.Tensor(clone_after_1, 2)
+where_7 = aten.where.self(bitwise_and_4, sub_5, scalar_tensor_4)
+scalar_tensor_5 = aten.scalar_tensor(0.0, dtype=torch.float32)
+where_8 = aten.where.self(bitwise_and_5, mul_3, scalar_tensor_5)
+index_put__1 = aten.index_put_(mm_3, [where_7], where_8, True)
+fma_1 = prims.fma(index_put__1, neg_1, slice_2)
+copy_1 = aten.copy(slice_2, fma_1)
+copy__1 = aten.copy_(slice_2, copy_1)
+slice_4 = aten.slice.Tensor(in0, 0, 4, 6)
+slice_5 = aten.slice.Tensor(permute_1, 0, 4, 6)
+mm_4 = aten.mm(slice_5, tanh_0)
+clone_after_2 = optpass.clone_after(in1, [copy__1])
+ge_3 = aten.ge.Scalar(clone_after_2, 4)
+lt_3 = aten.lt.Scalar(clone_after_2, 6)
+bitwise_and_6 = aten.bitwise_and.Tensor(ge_3, lt_3)
+reshape_3 = aten.reshape(bitwise_and_6, [5, 1])
+bitwise_and_7 = aten.bitwise_and.Tensor(unsqueeze_2, reshape_3)
+scalar_tensor_6 = aten.scalar_tensor(0, dtype=torch.int64)
+sub_6 = aten.sub.Tensor(clone_after_2, 4)
+where_9 = aten.where.self(bitwise_and_6, sub_6, scalar_tensor_6)
+scalar_tensor_7 = aten.scalar_tensor(0.0, dtype=torch.float32)
+where_10 = aten.where.self(bitwise_and_7, mul_3, scalar_tensor_7)
+index_put__2 = aten.index_put_(mm_4, [where_9], where_10, True)
+fma_2 = prims.fma(index_put__2, neg_1, slice_4)
+copy_2 = aten.copy(slice_4, fma_2)
+copy__2 = aten.copy_(slice_4, copy_2)""")
