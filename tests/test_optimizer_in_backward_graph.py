"""optimizer_in_backward's rewrite, pinned as graph diffs (read them: each update follows its gradient)."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase

import optpass
from parity import make_micro_step, make_step


def fused_graph_diff(model, opt, loss_fn, *inputs, **options):
    def train_step(*args):
        loss = loss_fn(*args)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    step = torch.compile(train_step, backend="optpass",
                         options={"lower": "eager", "optimizer": opt, "optimizer_in_backward": True,
                                  **options})
    optpass.report.clear_reports()
    with optpass.keep_graphs():
        step(*inputs)                  # fused from the first update
        step(*inputs)                  # SGD with momentum compiles again: its buffers exist now
    # the steady graph: the last compile of the step
    report = [r for r in optpass.recent_reports() if r.graph_after is not None and r.kind.value == "step"][-1]
    return optpass.graph_diff(report.graph_before, report.graph_after, shapes=False, context=1)


class TestOptimizerInBackwardGraph(TestCase):
    def setUp(self):
        torch._dynamo.reset()
        torch.manual_seed(0)

    def test_two_layer_mlp_sgd_momentum_updates_follow_their_gradients(self):
        model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        diff = fused_graph_diff(model, opt, lambda x, y: F.mse_loss(model(x), y),
                                torch.randn(5, 3), torch.randn(5, 2))
        self.assertExpectedInline(diff, """\
--- before
+++ after
@@ -27,3 +27,17 @@
 view_0 = aten.view(sum_0, [2])
+mul_0 = aten.mul.Tensor(in10, 0.9)
+add_0 = aten.add.Tensor(mul_0, view_0)
+neg_0 = aten.neg(in6)
+fma_0 = prims.fma(add_0, neg_0, in4)
+copy_0 = aten.copy(in4, fma_0)
+copy__0 = aten.copy_(in10, add_0)
+copy__1 = aten.copy_(in4, copy_0)
 t_5 = aten.t(t_4)
+mul_1 = aten.mul.Tensor(in9, 0.9)
+add_1 = aten.add.Tensor(mul_1, t_5)
+neg_1 = aten.neg(in6)
+fma_1 = prims.fma(add_1, neg_1, in3)
+copy_1 = aten.copy(in3, fma_1)
+copy__2 = aten.copy_(in9, add_1)
+copy__3 = aten.copy_(in3, copy_1)
 detach_1 = aten.detach(detach_0)
@@ -35,12 +49,18 @@
 view_1 = aten.view(sum_1, [4])
+mul_2 = aten.mul.Tensor(in8, 0.9)
+add_2 = aten.add.Tensor(mul_2, view_1)
+neg_2 = aten.neg(in6)
+fma_2 = prims.fma(add_2, neg_2, in1)
+copy_2 = aten.copy(in1, fma_2)
+copy__4 = aten.copy_(in8, add_2)
+copy__5 = aten.copy_(in1, copy_2)
 t_8 = aten.t(t_7)
-empty_like_0 = aten.empty_like(in0, pin_memory=False)
-copy_0 = aten.copy(empty_like_0, t_8)
-empty_like_1 = aten.empty_like(in1, pin_memory=False)
-copy_1 = aten.copy(empty_like_1, view_1)
-empty_like_2 = aten.empty_like(in3, pin_memory=False)
-copy_2 = aten.copy(empty_like_2, t_5)
-empty_like_3 = aten.empty_like(in4, pin_memory=False)
-copy_3 = aten.copy(empty_like_3, view_0)
+mul_3 = aten.mul.Tensor(in7, 0.9)
+add_3 = aten.add.Tensor(mul_3, t_8)
+neg_3 = aten.neg(in6)
+fma_3 = prims.fma(add_3, neg_3, in0)
+copy_3 = aten.copy(in0, fma_3)
+copy__6 = aten.copy_(in7, add_3)
+copy__7 = aten.copy_(in0, copy_3)
 detach_2 = aten.detach(mse_loss_0)
-return (detach_2, copy_0, copy_1, copy_2, copy_3)
+return (detach_2, None, None, None, None)""")

    def test_tied_weight_updates_after_both_contributions(self):
        class Tied(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(6, 3)

            def forward(self, tokens):
                return self.embed(tokens) @ self.embed.weight.t()   # the head reuses the embedding

        model = Tied()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        diff = fused_graph_diff(model, opt, lambda t, y: F.cross_entropy(model(t), y),
                                torch.tensor([1, 2, 3]), torch.tensor([2, 3, 4]))
        self.assertExpectedInline(diff, """\
--- before
+++ after
@@ -22,7 +22,14 @@
 t_4 = aten.t(t_2)
-embedding_dense_backward_0 = aten.embedding_dense_backward(mm_2, in1, 6, -1, False)
-add_0 = aten.add.Tensor(t_4, embedding_dense_backward_0)
-empty_like_0 = aten.empty_like(in0, pin_memory=False)
-copy_0 = aten.copy(empty_like_0, add_0)
+ge_0 = aten.ge.Scalar(in1, 0)
+lt_0 = aten.lt.Scalar(in1, 6)
+bitwise_and_0 = aten.bitwise_and.Tensor(ge_0, lt_0)
+ne_0 = aten.ne.Scalar(in1, -1)
+bitwise_and_1 = aten.bitwise_and.Tensor(bitwise_and_0, ne_0)
+unsqueeze_0 = aten.unsqueeze(bitwise_and_1, -1)
+_unsafe_masked_index_put_accumulate_0 = aten._unsafe_masked_index_put_accumulate(t_4, unsqueeze_0, [in1], mm_2)
+neg_0 = aten.neg(in3)
+fma_0 = prims.fma(_unsafe_masked_index_put_accumulate_0, neg_0, in0)
+copy_0 = aten.copy(in0, fma_0)
+copy__0 = aten.copy_(in0, copy_0)
 detach_2 = aten.detach(getitem_0)
-return (detach_2, copy_0)
+return (detach_2, None)""")

    def test_a_large_gradient_is_made_and_applied_in_row_chunks(self):
        from optpass.passes import _row_chunks

        model = nn.Linear(3, 4, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        saved, _row_chunks.ROW_CHUNK_BYTES = _row_chunks.ROW_CHUNK_BYTES, 16   # 48 bytes: 2 chunks of 2 rows
        try:
            diff = fused_graph_diff(model, opt, lambda x, y: F.mse_loss(model(x), y),
                                    torch.randn(5, 3), torch.randn(5, 4))
        finally:
            _row_chunks.ROW_CHUNK_BYTES = saved
        self.assertExpectedInline(diff, """\
--- before
+++ after
@@ -10,8 +10,16 @@
 t_1 = aten.t(mse_loss_backward_0)
-mm_1 = aten.mm(t_1, in1)
-t_2 = aten.t(mm_1)
-t_3 = aten.t(t_2)
-empty_like_0 = aten.empty_like(in0, pin_memory=False)
-copy_0 = aten.copy(empty_like_0, t_3)
+neg_0 = aten.neg(in3)
+slice_0 = aten.slice.Tensor(in0, 0, 0, 2)
+slice_1 = aten.slice.Tensor(t_1, 0, 0, 2)
+mm_1 = aten.mm(slice_1, in1)
+fma_0 = prims.fma(mm_1, neg_0, slice_0)
+copy_0 = aten.copy(slice_0, fma_0)
+copy__0 = aten.copy_(slice_0, copy_0)
+slice_2 = aten.slice.Tensor(in0, 0, 2, 4)
+slice_3 = aten.slice.Tensor(t_1, 0, 2, 4)
+mm_2 = aten.mm(slice_3, in1)
+fma_1 = prims.fma(mm_2, neg_0, slice_2)
+copy_1 = aten.copy(slice_2, fma_1)
+copy__1 = aten.copy_(slice_2, copy_1)
 detach_0 = aten.detach(mse_loss_0)
-return (detach_0, copy_0)
+return (detach_0, None)""")

    def test_clip_grad_norm_runs_a_norm_only_backward_first(self):
        model = nn.Sequential(nn.Linear(3, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        diff = fused_graph_diff(model, opt, lambda x, y: F.mse_loss(model(x), y),
                                torch.randn(5, 3), torch.randn(5, 2), clip_grad_norm=0.5)
        self.assertExpectedInline(diff, """\
--- before
+++ after
@@ -16,8 +16,31 @@
 view_0 = aten.view(sum_0, [2])
+linalg_vector_norm_0 = aten.linalg_vector_norm(view_0, 2.0)
 t_3 = aten.t(t_2)
-empty_like_0 = aten.empty_like(in0, pin_memory=False)
-copy_0 = aten.copy(empty_like_0, t_3)
-empty_like_1 = aten.empty_like(in1, pin_memory=False)
-copy_1 = aten.copy(empty_like_1, view_0)
+linalg_vector_norm_1 = aten.linalg_vector_norm(t_3, 2.0)
+stack_0 = aten.stack([linalg_vector_norm_1, linalg_vector_norm_0])
+linalg_vector_norm_2 = aten.linalg_vector_norm(stack_0, 2.0)
+add_0 = aten.add.Tensor(linalg_vector_norm_2, 1e-06)
+reciprocal_0 = aten.reciprocal(add_0)
+mul_0 = aten.mul.Tensor(reciprocal_0, 0.5)
+clamp_max_0 = aten.clamp_max(mul_0, 1.0)
+ones_like_1 = aten.ones_like(mse_loss_0, pin_memory=False, memory_format=torch.preserve_format)
+mse_loss_backward_1 = aten.mse_loss_backward(ones_like_1, addmm_0, in3, 1)
+t_4 = aten.t(mse_loss_backward_1)
+mm_1 = aten.mm(t_4, in2)
+t_5 = aten.t(mm_1)
+sum_1 = aten.sum.dim_IntList(mse_loss_backward_1, [0], True)
+view_1 = aten.view(sum_1, [2])
+mul_1 = aten.mul.Tensor(view_1, clamp_max_0)
+neg_0 = aten.neg(in4)
+fma_0 = prims.fma(mul_1, neg_0, in1)
+copy_0 = aten.copy(in1, fma_0)
+copy__0 = aten.copy_(in1, copy_0)
+t_6 = aten.t(t_5)
+mul_2 = aten.mul.Tensor(t_6, clamp_max_0)
+neg_1 = aten.neg(in4)
+fma_1 = prims.fma(mul_2, neg_1, in0)
+copy_1 = aten.copy(in0, fma_1)
+copy__1 = aten.copy_(in0, copy_1)
 detach_0 = aten.detach(mse_loss_0)
-return (detach_0, copy_0, copy_1)
+copy__2 = aten.copy_(in5, linalg_vector_norm_2)
+return (detach_0, None, None)""")


class TestMasterWeightsGraph(TestCase):
    def setUp(self):
        torch._dynamo.reset()
        torch.manual_seed(0)

    def test_bf16_update_casts_the_gradient_updates_the_master_and_rounds_back(self):
        """master_weights + optimizer_in_backward: g -> fp32, update the fp32 master, copy it back
        rounded into the bf16 parameter, right after the gradient is final."""
        model = nn.Linear(3, 2, bias=False).to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        diff = fused_graph_diff(model, opt, lambda x, y: F.mse_loss(model(x), y),
                                torch.randn(4, 3, dtype=torch.bfloat16), torch.randn(4, 2, dtype=torch.bfloat16),
                                master_weights=torch.float32)
        self.assertExpectedInline(diff, """\
--- before
+++ after
@@ -14,5 +14,10 @@
 t_3 = aten.t(t_2)
-empty_like_0 = aten.empty_like(in0, pin_memory=False)
-copy_0 = aten.copy(empty_like_0, t_3)
+convert_element_type_0 = prims.convert_element_type(t_3, torch.float32)
+neg_0 = aten.neg(in3)
+fma_0 = prims.fma(convert_element_type_0, neg_0, in4)
+copy_0 = aten.copy(in4, fma_0)
+copy__0 = aten.copy_(in4, copy_0)
+convert_element_type_1 = prims.convert_element_type(copy_0, torch.bfloat16)
+copy__1 = aten.copy_(in0, convert_element_type_1)
 detach_0 = aten.detach(mse_loss_0)
-return (detach_0, copy_0)
+return (detach_0, None)""")


class TestLossScalingGraph(TestCase):
    def setUp(self):
        torch._dynamo.reset()
        torch.manual_seed(0)

    def test_fp16_sgd_scaled_seed_unscale_found_inf_guarded_update_and_scale_update(self):
        """grad_scaler + master_weights, update after backward: the loss times the scale seeds backward
        (rounded to the fp16 loss's dtype, as eager autograd does); the gradient is unscaled in fp32
        with GradScaler's inv_scale; found_inf guards both writes (master, parameter); the scale and
        growth tracker are updated by _amp_update_scale, and optpass's skip flag and count."""
        model = nn.Linear(3, 2, bias=False).to(torch.float16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def train_step(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            out = loss.detach()
            opt.step()
            opt.zero_grad()
            return out

        step = torch.compile(train_step, backend="optpass", options={
            "lower": "eager", "optimizer": opt, "master_weights": torch.float32,
            "grad_scaler": torch.amp.GradScaler("cpu")})
        optpass.report.clear_reports()
        with optpass.keep_graphs():
            step(torch.randn(4, 3, dtype=torch.float16), torch.randn(4, 2, dtype=torch.float16))
        report = [r for r in optpass.recent_reports() if r.graph_after is not None and r.kind.value == "step"][-1]
        before = optpass.graph_text(report.graph_before, shapes=False).splitlines()
        seed = before[before.index(next(line for line in before if line.startswith("mse_loss_0"))):][:6]
        # in4: the scaler's scale (an input): backward of loss * scale, as scaler.scale(loss) computes it
        self.assertExpectedInline("\n".join(seed), """\
mse_loss_0 = aten.mse_loss(mm_0, in2)
mul_0 = aten.mul.Tensor(mse_loss_0, in4)
ones_like_0 = aten.ones_like(mul_0, pin_memory=False, memory_format=torch.preserve_format)
mul_1 = aten.mul.Tensor(ones_like_0, in4)
_to_copy_0 = aten._to_copy(mul_1, dtype=torch.float16)
mse_loss_backward_0 = aten.mse_loss_backward(_to_copy_0, mm_0, in2, 1)""")
        diff = optpass.graph_diff(report.graph_before, report.graph_after, shapes=False, context=1)
        # in3: lr, in4: scale, in5: growth tracker, in6/in7: optpass's skip flag / count, in8: the fp32 master
        self.assertExpectedInline(diff, """\
--- before
+++ after
@@ -9,2 +9,5 @@
 in8 = placeholder
+convert_element_type_0 = prims.convert_element_type(in4, torch.float64)
+reciprocal_0 = aten.reciprocal(convert_element_type_0)
+convert_element_type_1 = prims.convert_element_type(reciprocal_0, torch.float32)
 t_0 = aten.t(in0)
@@ -21,5 +24,27 @@
 t_3 = aten.t(t_2)
-empty_like_0 = aten.empty_like(in0, pin_memory=False)
-copy_0 = aten.copy(empty_like_0, t_3)
+abs_0 = aten.abs(t_3)
+lt_0 = aten.lt.Scalar(abs_0, float('inf'))
+logical_not_0 = aten.logical_not(lt_0)
+any_0 = aten.any(logical_not_0)
+convert_element_type_2 = prims.convert_element_type(t_3, torch.float32)
+mul_2 = aten.mul.Tensor(convert_element_type_2, convert_element_type_1)
 detach_0 = aten.detach(mse_loss_0)
-return (detach_0, copy_0)
+convert_element_type_3 = prims.convert_element_type(any_0, torch.float32)
+_amp_update_scale_0 = aten._amp_update_scale(in4, in5, convert_element_type_3, 2.0, 0.5, 2000)
+getitem_0 = getitem(_amp_update_scale_0, 0)
+copy__0 = aten.copy_(in4, getitem_0)
+getitem_1 = getitem(_amp_update_scale_0, 1)
+copy__1 = aten.copy_(in5, getitem_1)
+copy__2 = aten.copy_(in6, convert_element_type_3)
+convert_element_type_4 = prims.convert_element_type(any_0, torch.int64)
+add_0 = aten.add.Tensor(in7, convert_element_type_4)
+copy__3 = aten.copy_(in7, add_0)
+neg_0 = aten.neg(in3)
+fma_0 = prims.fma(mul_2, neg_0, in8)
+copy_0 = aten.copy(in8, fma_0)
+where_0 = aten.where.self(any_0, in8, copy_0)
+copy__4 = aten.copy_(in8, where_0)
+convert_element_type_5 = prims.convert_element_type(copy_0, torch.float16)
+where_1 = aten.where.self(any_0, in0, convert_element_type_5)
+copy__5 = aten.copy_(in0, where_1)
+return (detach_0, None)""")

    def test_fp16_accumulation_micro_step_scales_backward_and_the_step_unscales_the_sum(self):
        """grad_scaler + master_weights with a micro-step (backward, no opt.step()): the micro-step's
        graph seeds backward with loss * scale (in4, an input) and adds the scaled gradient into the
        existing .grad (in3); the step's graph unscales .grad + its own gradient (add_0) with the scale
        in5, checks the sum for inf/nan and guards the update with it."""
        model = nn.Linear(3, 2, bias=False).to(torch.float16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        options = {"lower": "eager", "optimizer": opt, "master_weights": torch.float32,
                   "grad_scaler": torch.amp.GradScaler("cpu")}

        loss_fn = lambda m, x, y: F.mse_loss(m(x), y)      # noqa: E731
        micro = torch.compile(make_micro_step(model, loss_fn), backend="optpass", options=options)
        step = torch.compile(make_step(model, opt, loss_fn), backend="optpass", options=options)
        batch = (torch.randn(4, 3, dtype=torch.float16), torch.randn(4, 2, dtype=torch.float16))
        optpass.report.clear_reports()
        with optpass.keep_graphs():
            micro(*batch)              # .grad is None: a new gradient
            micro(*batch)              # accumulates into .grad
            step(*batch)               # adds its gradient to .grad, unscales, checks, updates
        reports = [r for r in optpass.recent_reports() if r.graph_before is not None and r.kind.value == "step"]
        accumulating_micro = optpass.graph_text(reports[1].graph_before, shapes=False)
        self.assertExpectedInline(accumulating_micro, """\
in0 = placeholder
in1 = placeholder
in2 = placeholder
in3 = placeholder
in4 = placeholder
t_0 = aten.t(in0)
mm_0 = aten.mm(in1, t_0)
mse_loss_0 = aten.mse_loss(mm_0, in2)
mul_0 = aten.mul.Tensor(mse_loss_0, in4)
ones_like_0 = aten.ones_like(mul_0, pin_memory=False, memory_format=torch.preserve_format)
mul_1 = aten.mul.Tensor(ones_like_0, in4)
_to_copy_0 = aten._to_copy(mul_1, dtype=torch.float16)
mse_loss_backward_0 = aten.mse_loss_backward(_to_copy_0, mm_0, in2, 1)
t_1 = aten.t(mse_loss_backward_0)
mm_1 = aten.mm(t_1, in1)
t_2 = aten.t(mm_1)
t_3 = aten.t(t_2)
empty_like_0 = aten.empty_like(in0, pin_memory=False)
copy_0 = aten.copy(empty_like_0, t_3)
add_0 = aten.add.Tensor(in3, copy_0)
detach_0 = aten.detach(mse_loss_0)
copy__0 = aten.copy_(in3, add_0)
return (detach_0, copy__0)""")
        diff = optpass.graph_diff(reports[2].graph_before, reports[2].graph_after, shapes=False, context=1)
        self.assertExpectedInline(diff, """\
--- before
+++ after
@@ -10,2 +10,5 @@
 in9 = placeholder
+convert_element_type_0 = prims.convert_element_type(in5, torch.float64)
+reciprocal_0 = aten.reciprocal(convert_element_type_0)
+convert_element_type_1 = prims.convert_element_type(reciprocal_0, torch.float32)
 t_0 = aten.t(in0)
@@ -25,4 +28,27 @@
 add_0 = aten.add.Tensor(in3, copy_0)
+abs_0 = aten.abs(add_0)
+lt_0 = aten.lt.Scalar(abs_0, float('inf'))
+logical_not_0 = aten.logical_not(lt_0)
+any_0 = aten.any(logical_not_0)
+convert_element_type_2 = prims.convert_element_type(add_0, torch.float32)
+mul_2 = aten.mul.Tensor(convert_element_type_2, convert_element_type_1)
 detach_0 = aten.detach(mse_loss_0)
-copy__0 = aten.copy_(in3, add_0)
-return (detach_0, copy__0)
+convert_element_type_3 = prims.convert_element_type(any_0, torch.float32)
+_amp_update_scale_0 = aten._amp_update_scale(in5, in6, convert_element_type_3, 2.0, 0.5, 2000)
+getitem_0 = getitem(_amp_update_scale_0, 0)
+copy__0 = aten.copy_(in5, getitem_0)
+getitem_1 = getitem(_amp_update_scale_0, 1)
+copy__1 = aten.copy_(in6, getitem_1)
+copy__2 = aten.copy_(in7, convert_element_type_3)
+convert_element_type_4 = prims.convert_element_type(any_0, torch.int64)
+add_1 = aten.add.Tensor(in8, convert_element_type_4)
+copy__3 = aten.copy_(in8, add_1)
+neg_0 = aten.neg(in4)
+fma_0 = prims.fma(mul_2, neg_0, in9)
+copy_1 = aten.copy(in9, fma_0)
+where_0 = aten.where.self(any_0, in9, copy_1)
+copy__4 = aten.copy_(in9, where_0)
+convert_element_type_5 = prims.convert_element_type(copy_1, torch.float16)
+where_1 = aten.where.self(any_0, in0, convert_element_type_5)
+copy__5 = aten.copy_(in0, where_1)
+return (detach_0, None)""")
