"""per_sample_grad_norm on convolutions: DP-SGD written with torch.func runs without the per-sample
convolution weight gradients, equal to eager and to Opacus."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase
from torch.func import functional_call, grad, vmap

import optpass
from optpass.capture import GraphKind
from optpass.kernels import conv_norm

B, CLASSES, MAX_GRAD_NORM, NOISE = 5, 4, 1.0, 0.5


def make_dp_step(model, opt, noise=NOISE):
    """DP-SGD the plain way over the parameters that require grad (docs/dp_sgd.md's recipe):
    per-sample gradients, clip each sample, add noise, divide by the batch size, step."""
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
                      + noise * MAX_GRAD_NORM * torch.randn_like(p)) / x.shape[0]
        return norms

    def dp_step(x, y):
        norms = clipped_noisy_gradients(x, y)
        opt.step()
        opt.zero_grad()
        return norms
    return dp_step


def cnn():
    """Opacus's CIFAR-10 tutorial CNN in small: convolutions, GroupNorm, pooling, a Linear head."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, CLASSES))


def strided_grouped_cnn():
    """groups, stride, asymmetric padding and dilation, a kernel that is not square."""
    return nn.Sequential(nn.Conv2d(4, 8, (3, 2), stride=2, padding=(1, 0), dilation=(1, 2), groups=2), nn.Tanh(),
                         nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=4), nn.Tanh(),
                         nn.Flatten(), nn.LazyLinear(CLASSES))


class _Conv1dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 5, stride=2, padding=2, groups=2)
        self.depthwise = nn.Conv1d(8, 8, 3, padding=1, groups=8, bias=False)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.depthwise(torch.tanh(self.conv(x)))).mean(-1))


def conv3d():
    return nn.Sequential(nn.Conv3d(2, 4, (2, 3, 3), stride=(1, 2, 2), padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(4, CLASSES))


def pointwise_cnn():
    """1x1 convolutions as ResNet shortcuts and MobileNet's pointwise layers use them: plain, strided and
    grouped, and a kernel with one side 1."""
    return nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU(), nn.Conv2d(8, 8, 1, stride=2, groups=2), nn.Tanh(),
                         nn.Conv2d(8, 6, (1, 3), padding=(0, 1)), nn.ReLU(), nn.Flatten(), nn.LazyLinear(CLASSES))


MODELS = {"cnn": (cnn, (3, 8, 8)), "pointwise": (pointwise_cnn, (3, 6, 6)), "strided-grouped": (strided_grouped_cnn, (4, 9, 10)),
          "conv1d": (_Conv1dNet, (4, 12)), "conv3d": (conv3d, (2, 4, 6, 6))}


def build(name):
    factory, shape = MODELS[name]
    torch.manual_seed(0)
    model = factory()
    model(torch.zeros(1, *shape))                                   # LazyLinear's shape
    return model, shape


def batch(step, shape):
    g = torch.Generator().manual_seed(step)
    return torch.randn(B, *shape, generator=g), torch.randint(0, CLASSES, (B,), generator=g)


def conv_weight_gradients(graph):
    """vmap's per-sample convolution weight gradients: convolution_backward with B·groups groups."""
    return [n for n in graph.nodes if n.target is torch.ops.aten.convolution_backward.default
            and n.args[10][1] and n.args[9] % B == 0 and n.args[0].meta["val"].shape[1] % B == 0
            and list(n.meta["val"][1].shape)[0] % B == 0 and n.args[9] >= B]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("lower", ["eager", "inductor"])
def test_convolution_dp_step_equals_the_original_without_per_sample_conv_gradients(lower, name):
    model, shape = build(name)
    reference_model = copy.deepcopy(model)
    compiled = torch.compile(make_dp_step(model, torch.optim.SGD(model.parameters(), lr=0.5)), backend="optpass",
                             options={"lower": lower, "dp_materialize": "never"})
    reference = make_dp_step(reference_model, torch.optim.SGD(reference_model.parameters(), lr=0.5))
    optpass.report.clear_reports()
    with torch._inductor.config.patch(fallback_random=True), optpass.keep_graphs():
        for step in range(4):
            x, y = batch(step, shape)
            torch.manual_seed(100 + step)
            norms = compiled(x, y)
            torch.manual_seed(100 + step)
            expected = reference(x, y)
            torch.testing.assert_close(norms, expected, rtol=1e-5, atol=1e-6)
            for p, q in zip(model.parameters(), reference_model.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    report = next(r for r in optpass.recent_reports() if r.graph_after is not None and r.kind is GraphKind.OTHER)
    convolutions = sum(isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) for m in model.modules())
    assert len(conv_weight_gradients(report.graph_before)) == convolutions
    assert conv_weight_gradients(report.graph_after) == []
    norm_ops = [n for n in report.graph_after.nodes if n.target is torch.ops.optpass.conv_per_sample_grad_sq_norm.default]
    assert len(norm_ops) == convolutions


@pytest.mark.parametrize("name", ["cnn", "strided-grouped", "pointwise"])
@pytest.mark.parametrize("materialize", ["never", "auto"])
def test_convolution_norms_and_training_equal_opacus(name, materialize):
    """Per-sample norms (1e-5) and parameters equal Opacus's GradSampleModule + DPOptimizer over
    several steps (the same noise: both draw it from torch's generator, parameter by parameter)."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model, shape = build(name)
    opacus_model = copy.deepcopy(model)
    compiled = torch.compile(make_dp_step(model, torch.optim.SGD(model.parameters(), lr=0.5)), backend="optpass",
                             options={"lower": "eager", "dp_materialize": materialize})
    gsm = GradSampleModule(opacus_model, loss_reduction="mean")
    dp_opt = DPOptimizer(torch.optim.SGD(opacus_model.parameters(), lr=0.5), noise_multiplier=NOISE,
                         max_grad_norm=MAX_GRAD_NORM, expected_batch_size=B)
    for step in range(3):
        x, y = batch(step, shape)
        torch.manual_seed(100 + step)
        norms = compiled(x, y)
        F.cross_entropy(gsm(x), y).backward()
        samples = [p.grad_sample for p in opacus_model.parameters()]
        opacus_norms = torch.stack([g.reshape(len(g), -1).norm(2, dim=-1) for g in samples], dim=1).norm(2, dim=1)
        torch.manual_seed(100 + step)
        dp_opt.step()
        dp_opt.zero_grad()
        torch.testing.assert_close(norms, opacus_norms, rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), opacus_model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["direct", "ghost"])
@pytest.mark.parametrize("dims, groups, stride, padding, dilation", [
    (1, 2, [2], [1], [3]), (2, 1, [1, 1], [1, 1], [1, 1]), (2, 3, [2, 1], [0, 2], [1, 2]),
    (3, 1, [1, 2, 1], [1, 0, 0], [1, 1, 1])])
def test_the_conv_norm_op_equals_the_per_sample_gradients_norms_in_a_chunk_of_one_sample(
        method, dims, groups, stride, padding, dilation):
    """direct and ghost (a Conv3d goes direct), whole batch and chunks of one sample, N = 2 rows per sample."""
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dims]
    kernel = [3, 2, 2][:dims]
    torch.manual_seed(0)
    x = torch.randn(B, 2, 6, *[7] * dims, dtype=torch.float64)
    weight = torch.randn(12, 6 // groups, *kernel, dtype=torch.float64)
    out_shape = conv(x[0], weight, None, stride, padding, dilation, groups).shape
    g = torch.randn(B, *out_shape, dtype=torch.float64)

    def loss(w, xb, gb):
        return (conv(xb, w, None, stride, padding, dilation, groups) * gb).sum()

    expected = vmap(grad(loss), in_dims=(None, 0, 0))(weight, x, g).flatten(1).pow(2).sum(1)
    for chunk in (conv_norm.CHUNK_BYTES, 1):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(conv_norm, "CHUNK_BYTES", chunk)
            got = torch.ops.optpass.conv_per_sample_grad_sq_norm(x, g, kernel, stride, padding, dilation, groups, method)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_auto_keeps_an_early_convolution_materialized_and_explain_names_each_layer_once():
    """dp_materialize='auto': the first convolution (3 -> 8 channels on 8x8) has a per-sample gradient of 216
    elements against 704 of input and output gradient the rewrite would keep: kept, saying so; the second
    (8 -> 16 on 4x4, 1152 against 384) is rewritten. Each layer's weight is named once, by module path."""
    model, shape = build("cnn")
    text = str(optpass.explain(make_dp_step(model, torch.optim.SGD(model.parameters(), lr=0.5)), *batch(0, shape)))
    notes = [line.strip().removeprefix("note: ") for line in text.splitlines() if line.strip().startswith("note: ")]
    assert sum(note.startswith("0.weight (Conv2d weight [8, 3, 3, 3]): Conv2d per-sample gradient [B=5, 8, 3, 3, 3]: "
                               "kept materialized (dp_materialize='auto'): per sample, the weight's 216 elements "
                               "are no more than the 704") for note in notes) == 1
    assert sum(note.startswith("3.weight (Conv2d weight [16, 8, 3, 3]): rewritten (norms without the "
                               "[B, 16, 8, 3, 3] per-sample gradient, one clipped sum)") for note in notes) == 1
    assert sum(note.startswith("8.weight (Linear weight [4, 16]): ") for note in notes) == 1
    assert not any("0.weight" in note or "3.weight" in note for note in notes[3:])


def test_a_convolution_applied_twice_is_left_as_it_was_exactly_and_explain_says_why():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, padding=1)
            self.head = nn.Linear(3, CLASSES)

        def forward(self, x):
            return self.head(self.conv(torch.tanh(self.conv(x))).mean((-2, -1)))

    torch.manual_seed(0)
    model = Twice()
    reference_model = copy.deepcopy(model)
    options = {"lower": "eager", "dp_materialize": "never"}
    compiled = torch.compile(make_dp_step(model, torch.optim.SGD(model.parameters(), lr=0.5), noise=0.0),
                             backend="optpass", options=options)
    reference = make_dp_step(reference_model, torch.optim.SGD(reference_model.parameters(), lr=0.5), noise=0.0)
    for step in range(3):
        x, y = batch(step, (3, 6, 6))
        torch.testing.assert_close(compiled(x, y), reference(x, y), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    text = str(optpass.explain(make_dp_step(model, torch.optim.SGD(model.parameters(), lr=0.5)),
                               *batch(0, (3, 6, 6)), options=options))
    assert "is added to another per-sample gradient by" in text and "left as it was (exact)" in text


class TestConvolutionGraph(TestCase):
    def test_graph_diff_conv_norm_op_and_one_weight_gradient(self):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, bias=False), nn.Flatten(), nn.Linear(4, CLASSES, bias=False))
        step = torch.compile(make_dp_step(model, torch.optim.SGD(model.parameters(), lr=0.1)), backend="optpass",
                             options={"lower": "eager", "passes": ["per_sample_grad_norm"], "dp_materialize": "never"})
        optpass.report.clear_reports()
        with optpass.keep_graphs():
            step(*batch(0, (2, 3, 3)))
        report = next(r for r in optpass.recent_reports() if r.kind is GraphKind.OTHER)
        diff = optpass.graph_diff(report.graph_before, report.graph_after, context=0)
        self.assertExpectedInline(diff, """\
--- before
+++ after
@@ -53,3 +52,0 @@
-bmm_0: f32[5, 4, 4] = aten.bmm(view_5, view_6)
-view_7: f32[5, 4, 4] = aten.view(bmm_0, [5, 4, 4])
-transpose_1: f32[5, 4, 4] = aten.transpose.int(view_7, 1, 2)
@@ -57,2 +54,2 @@
-view_8: f32[5, 4] = aten.view(_log_softmax_backward_data_0, [5, 4])
-mm_1: f32[5, 4] = aten.mm(view_8, t_1)
+view_7: f32[5, 4] = aten.view(_log_softmax_backward_data_0, [5, 4])
+mm_1: f32[5, 4] = aten.mm(view_7, t_1)
@@ -60,4 +57,3 @@
-transpose_2: f32[5, 4, 4] = aten.transpose.int(transpose_1, 1, 2)
-view_9: f32[5, 1, 4, 1, 1] = aten.view(_unsafe_view_1, [5, 1, 4, 1, 1])
-permute_1: f32[1, 5, 4, 1, 1] = aten.permute(view_9, [1, 0, 2, 3, 4])
-view_10: f32[1, 20, 1, 1] = aten.view(permute_1, [1, 20, 1, 1])
+view_8: f32[5, 1, 4, 1, 1] = aten.view(_unsafe_view_1, [5, 1, 4, 1, 1])
+permute_1: f32[1, 5, 4, 1, 1] = aten.permute(view_8, [1, 0, 2, 3, 4])
+view_9: f32[1, 20, 1, 1] = aten.view(permute_1, [1, 20, 1, 1])
@@ -65,16 +61,11 @@
-view_11: f32[1, 10, 3, 3] = aten.view(permute_2, [1, 10, 3, 3])
-slice_0: f32[1, 2, 3, 3] = aten.slice.Tensor(detach_0, 0, 0, 1)
-new_empty_0: f32[] = aten.new_empty(slice_0, [])
-expand_2: f32[20, 2, 3, 3] = aten.expand(new_empty_0, [20, 2, 3, 3])
-convolution_backward_0: (_, f32[20, 2, 3, 3], _) = aten.convolution_backward(view_10, view_11, expand_2, None, [2, 2], [0, 0], [1, 1], False, [0, 0], 5, [False, True, False])
-getitem_0: f32[20, 2, 3, 3] = getitem(convolution_backward_0, 1)
-view_12: f32[5, 4, 2, 3, 3] = aten.view(getitem_0, [5, 4, 2, 3, 3])
-view_13: f32[5, 72] = aten.view(view_12, [5, 72])
-pow_0: f32[5, 72] = aten.pow.Tensor_Scalar(view_13, 2)
-sum_2: f32[5] = aten.sum.dim_IntList(pow_0, [1])
-view_14: f32[5, 16] = aten.view(transpose_2, [5, 16])
-pow_1: f32[5, 16] = aten.pow.Tensor_Scalar(view_14, 2)
-sum_3: f32[5] = aten.sum.dim_IntList(pow_1, [1])
-stack_0: f32[2, 5] = aten.stack([sum_2, sum_3])
-sum_4: f32[5] = aten.sum.dim_IntList(stack_0, [0])
-sqrt_0: f32[5] = aten.sqrt(sum_4)
+view_10: f32[1, 10, 3, 3] = aten.view(permute_2, [1, 10, 3, 3])
+view_11: f32[1, 5, 2, 3, 3] = aten.view(view_10, [1, 5, 2, 3, 3])
+permute_3: f32[5, 1, 2, 3, 3] = aten.permute(view_11, [1, 0, 2, 3, 4])
+view_12: f32[1, 5, 4, 1, 1] = aten.view(view_9, [1, 5, 4, 1, 1])
+permute_4: f32[5, 1, 4, 1, 1] = aten.permute(view_12, [1, 0, 2, 3, 4])
+conv_per_sample_grad_sq_norm_0: f32[5] = optpass.conv_per_sample_grad_sq_norm(permute_3, permute_4, [3, 3], [2, 2], [0, 0], [1, 1], 1, 'auto')
+permute_5: f32[5, 1, 4] = aten.permute(view_5, [0, 2, 1])
+per_sample_grad_sq_norm_0: f32[5] = optpass.per_sample_grad_sq_norm(view_6, permute_5, 'auto')
+stack_0: f32[2, 5] = aten.stack([conv_per_sample_grad_sq_norm_0, per_sample_grad_sq_norm_0])
+sum_2: f32[5] = aten.sum.dim_IntList(stack_0, [0])
+sqrt_0: f32[5] = aten.sqrt(sum_2)
@@ -89,10 +80,21 @@
-permute_3: f32[1, 1, 1, 1, 5] = aten.permute(unsqueeze_7, [1, 2, 3, 4, 0])
-permute_4: f32[4, 2, 3, 3, 5] = aten.permute(view_12, [1, 2, 3, 4, 0])
-permute_5: f32[5, 1, 1, 1, 1] = aten.permute(permute_3, [4, 0, 1, 2, 3])
-view_15: f32[1, 1, 5] = aten.view(permute_5, [1, 1, 5])
-permute_6: f32[5, 4, 2, 3, 3] = aten.permute(permute_4, [4, 0, 1, 2, 3])
-view_16: f32[1, 5, 72] = aten.view(permute_6, [1, 5, 72])
-bmm_1: f32[1, 1, 72] = aten.bmm(view_15, view_16)
-view_17: f32[1, 4, 2, 3, 3] = aten.view(bmm_1, [1, 4, 2, 3, 3])
-permute_7: f32[4, 2, 3, 3, 1] = aten.permute(view_17, [1, 2, 3, 4, 0])
-view_18: f32[4, 2, 3, 3] = aten.view(permute_7, [4, 2, 3, 3])
+permute_6: f32[1, 1, 1, 1, 5] = aten.permute(unsqueeze_7, [1, 2, 3, 4, 0])
+permute_7: f32[5, 1, 1, 1, 1] = aten.permute(permute_6, [4, 0, 1, 2, 3])
+view_13: f32[1, 1, 5] = aten.view(permute_7, [1, 1, 5])
+clone_0: f32[1, 1, 5] = aten.clone(view_13, memory_format=torch.contiguous_format)
+view_14: f32[5, 1, 1] = aten.view(clone_0, [5, 1, 1])
+view_15: f32[5, 1, 1, 1, 1] = aten.view(view_14, [5, 1, 1, 1, 1])
+view_16: f32[1, 5, 4, 1, 1] = aten.view(view_9, [1, 5, 4, 1, 1])
+permute_8: f32[5, 1, 4, 1, 1] = aten.permute(view_16, [1, 0, 2, 3, 4])
+mul_2: f32[5, 1, 4, 1, 1] = aten.mul.Tensor(permute_8, view_15)
+reshape_0: f32[5, 4, 1, 1] = aten.reshape(mul_2, [5, 4, 1, 1])
+view_17: f32[1, 5, 2, 3, 3] = aten.view(view_10, [1, 5, 2, 3, 3])
+permute_9: f32[5, 1, 2, 3, 3] = aten.permute(view_17, [1, 0, 2, 3, 4])
+reshape_1: f32[5, 2, 3, 3] = aten.reshape(permute_9, [5, 2, 3, 3])
+new_empty_0: f32[] = aten.new_empty(reshape_1, [])
+expand_2: f32[4, 2, 3, 3] = aten.expand(new_empty_0, [4, 2, 3, 3])
+convolution_backward_0: (_, f32[4, 2, 3, 3], _) = aten.convolution_backward(reshape_0, reshape_1, expand_2, None, [2, 2], [0, 0], [1, 1], False, [0, 0], 1, [False, True, False])
+getitem_0: f32[4, 2, 3, 3] = getitem(convolution_backward_0, 1)
+view_18: f32[1, 1, 72] = aten.view(getitem_0, [1, 1, 72])
+view_19: f32[1, 4, 2, 3, 3] = aten.view(view_18, [1, 4, 2, 3, 3])
+permute_10: f32[4, 2, 3, 3, 1] = aten.permute(view_19, [1, 2, 3, 4, 0])
+view_20: f32[4, 2, 3, 3] = aten.view(permute_10, [4, 2, 3, 3])
@@ -100,2 +102,2 @@
-mul_2: f32[4, 2, 3, 3] = aten.mul.Tensor(randn_like_0, 0.5)
-add_1: f32[4, 2, 3, 3] = aten.add.Tensor(view_18, mul_2)
+mul_3: f32[4, 2, 3, 3] = aten.mul.Tensor(randn_like_0, 0.5)
+add_1: f32[4, 2, 3, 3] = aten.add.Tensor(view_20, mul_3)
@@ -105,10 +107,16 @@
-permute_8: f32[1, 1, 5] = aten.permute(unsqueeze_9, [1, 2, 0])
-permute_9: f32[4, 4, 5] = aten.permute(transpose_2, [1, 2, 0])
-permute_10: f32[5, 1, 1] = aten.permute(permute_8, [2, 0, 1])
-view_19: f32[1, 1, 5] = aten.view(permute_10, [1, 1, 5])
-permute_11: f32[5, 4, 4] = aten.permute(permute_9, [2, 0, 1])
-view_20: f32[1, 5, 16] = aten.view(permute_11, [1, 5, 16])
-bmm_2: f32[1, 1, 16] = aten.bmm(view_19, view_20)
-view_21: f32[1, 4, 4] = aten.view(bmm_2, [1, 4, 4])
-permute_12: f32[4, 4, 1] = aten.permute(view_21, [1, 2, 0])
-view_22: f32[4, 4] = aten.view(permute_12, [4, 4])
+permute_11: f32[1, 1, 5] = aten.permute(unsqueeze_9, [1, 2, 0])
+permute_12: f32[5, 1, 1] = aten.permute(permute_11, [2, 0, 1])
+view_21: f32[1, 1, 5] = aten.view(permute_12, [1, 1, 5])
+permute_13: f32[5, 1, 4] = aten.permute(view_5, [0, 2, 1])
+clone_1: f32[1, 1, 5] = aten.clone(view_21, memory_format=torch.contiguous_format)
+view_22: f32[5, 1, 1] = aten.view(clone_1, [5, 1, 1])
+mul_4: f32[5, 1, 4] = aten.mul.Tensor(permute_13, view_22)
+clone_2: f32[5, 1, 4] = aten.clone(mul_4, memory_format=torch.contiguous_format)
+view_23: f32[5, 4] = aten.view(clone_2, [5, 4])
+view_24: f32[5, 4] = aten.view(view_6, [5, 4])
+permute_14: f32[4, 5] = aten.permute(view_23, [1, 0])
+mm_2: f32[4, 4] = aten.mm(permute_14, view_24)
+view_25: f32[1, 1, 16] = aten.view(mm_2, [1, 1, 16])
+view_26: f32[1, 4, 4] = aten.view(view_25, [1, 4, 4])
+permute_15: f32[4, 4, 1] = aten.permute(view_26, [1, 2, 0])
+view_27: f32[4, 4] = aten.view(permute_15, [4, 4])
@@ -116,2 +124,2 @@
-mul_3: f32[4, 4] = aten.mul.Tensor(randn_like_1, 0.5)
-add_2: f32[4, 4] = aten.add.Tensor(view_22, mul_3)
+mul_5: f32[4, 4] = aten.mul.Tensor(randn_like_1, 0.5)
+add_2: f32[4, 4] = aten.add.Tensor(view_27, mul_5)""")


def _notes(text):
    return [line.strip().removeprefix("note: ") for line in text.splitlines() if line.strip().startswith("note: ")]


def test_explain_names_every_layer_once_with_its_outcome_and_a_transposed_convolution_as_materialized():
    """Each parameter in exactly one note: convolution and Linear weights on lines of their own (rewritten,
    or kept and why), the 1-D ones grouped by module, and a ConvTranspose2d weight (no rewrite for it) as
    materialized with its shape, not among the biases. The step stays equal to eager."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
                          nn.ConvTranspose2d(8, 4, 2, stride=2), nn.ReLU(), nn.Conv2d(4, 16, 3, stride=2),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, CLASSES))
    reference_model = copy.deepcopy(model)
    shape = (3, 6, 6)
    options = {"lower": "eager"}
    text = str(optpass.explain(make_dp_step(model, torch.optim.SGD(model.parameters(), lr=0.5)), *batch(0, shape),
                               options=options))
    notes = _notes(text)
    names = [name for name, _ in model.named_parameters()]
    for name in names:
        module, leaf = name.rsplit(".", 1)
        mentions = [note for note in notes if f"{name} " in note or f"{name}:" in note or f"{name}," in note
                    or (f"{module} (" in note and leaf in note.split(f"{module} (", 1)[1].split(")", 1)[0])]
        assert len(mentions) == 1, (name, notes)
    assert any(note.startswith("0.weight (Conv2d weight [8, 3, 3, 3]): ") and "kept materialized" in note
               for note in notes)
    assert any(note.startswith("5.weight (Conv2d weight [16, 4, 3, 3]): ") for note in notes)
    assert any(note.startswith("left as traced (6): 0.bias, 1 (weight, bias), 3.bias, 5.bias, 8.bias: 1-D")
               for note in notes)
    assert any(note.startswith("materialized, not rewritten (1): 3.weight [8, 4, 2, 2]: not a Linear, Embedding "
                               "or Conv1d/2d/3d weight") for note in notes)

    compiled = torch.compile(make_dp_step(model, torch.optim.SGD(model.parameters(), lr=0.5)), backend="optpass",
                             options=options)
    reference = make_dp_step(reference_model, torch.optim.SGD(reference_model.parameters(), lr=0.5))
    for step in range(3):
        x, y = batch(step, shape)
        torch.manual_seed(100 + step)
        norms = compiled(x, y)
        torch.manual_seed(100 + step)
        torch.testing.assert_close(norms, reference(x, y), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_the_clipped_sum_as_inductor_writes_it_for_a_gpu_is_rewritten_too():
    """On a GPU Inductor's joint-graph pattern bmm_to_mm makes the clipped sum's batch-1 bmm an mm of
    squeezed operands (seen on an H100/H200); here the pattern is made to fire on the CPU. Linear and
    convolution weights are rewritten all the same and the step equals the eager one."""
    from torch._inductor.fx_passes import joint_graph

    model, shape = build("cnn")
    reference_model = copy.deepcopy(model)
    compiled = torch.compile(make_dp_step(model, torch.optim.SGD(model.parameters(), lr=0.5), noise=0.0),
                             backend="optpass", options={"lower": "inductor", "dp_materialize": "never"})
    reference = make_dp_step(reference_model, torch.optim.SGD(reference_model.parameters(), lr=0.5), noise=0.0)
    optpass.report.clear_reports()
    with pytest.MonkeyPatch.context() as patch, optpass.keep_graphs():
        patch.setattr(joint_graph, "check_device", lambda *devices: True)
        for step in range(3):
            x, y = batch(step, shape)
            torch.testing.assert_close(compiled(x, y), reference(x, y), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    report = next(r for r in optpass.recent_reports() if r.graph_after is not None and r.kind is GraphKind.OTHER)
    squeezed_mm = [n for n in report.graph_before.nodes if n.target is torch.ops.aten.mm.default
                   and n.args[0].target is torch.ops.aten.squeeze.dim]
    assert len(squeezed_mm) >= 3                                   # the form this test is about is there
    assert conv_weight_gradients(report.graph_after) == []
    outcome = next(p for p in report.passes if p.name == "per_sample_grad_norm")
    assert sum("rewritten" in note for note in outcome.notes) == 3, outcome.notes
