"""A DP-SGD model's mistakes are named at compile time, as Opacus's ModuleValidator names them:
BatchNorm refused with the fix, a frozen parameter differentiated in the vmap and a layer without a
rewrite warned by name; a model Opacus accepts compiles without a word."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import optpass

B, CLASSES = 4, 3


def dp_step(model, opt, with_buffers=False, trainable_only=True):
    def loss_of_params(params, buffers, x, y):
        state = (params, buffers) if with_buffers else params
        return F.cross_entropy(functional_call(model, state, (x.unsqueeze(0),)), y.unsqueeze(0))

    def step(x, y):
        named = [(k, p) for k, p in model.named_parameters() if p.requires_grad or not trainable_only]
        params = {k: p.detach() for k, p in named}
        per_sample = vmap(grad(loss_of_params), in_dims=(None, None, 0, 0))(params, dict(model.named_buffers()), x, y)
        norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per_sample.values()]).sum(0).sqrt()
        coef = (1.0 / (norms + 1e-6)).clamp(max=1.0)
        for name, p in named:
            p.grad = torch.einsum("b,b...->...", coef, per_sample[name]) / B
        out = norms.detach()
        opt.step()
        opt.zero_grad()
        return out
    return step


def conv_model(norm):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), norm, nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, CLASSES))
    return model


def batch(step=0):
    g = torch.Generator().manual_seed(step)
    return torch.randn(B, 3, 6, 6, generator=g), torch.randint(0, CLASSES, (B,), generator=g)


def compile_step(model, backend="optpass", **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return torch.compile(dp_step(model, opt, **kwargs), backend=backend)


@pytest.mark.parametrize("norm, with_buffers, layer", [
    (nn.BatchNorm2d(4), False, "a BatchNorm layer"),                        # the docs' recipe: parameters only
    (nn.BatchNorm2d(4), True, "a BatchNorm layer"),                         # buffers passed to functional_call
    (nn.BatchNorm2d(4, track_running_stats=False), False, "a BatchNorm in training mode"),
    (nn.InstanceNorm2d(4, affine=True, track_running_stats=True), False, "an InstanceNorm with track_running_stats"),
], ids=["running-stats", "buffers-passed", "no-running-stats", "instance-norm-running-stats"])
def test_a_batch_norm_in_training_mode_is_refused_naming_the_layer_the_line_and_group_norm(norm, with_buffers, layer):
    # this suite's fixture resets Dynamo before each test: the refusal survives it
    step = compile_step(conv_model(norm), with_buffers=with_buffers)
    with pytest.raises(optpass.OptpassError) as error:
        step(*batch())
    message = str(error.value)
    assert layer in message and "GroupNorm" in message and "ModuleValidator.fix(model)" in message
    assert f"model.1 ({type(norm).__name__}" in message        # the module, by its path
    assert "test_dp_model_checks.py" in message                  # the user's line: functional_call in the loss


def test_the_refusal_holds_after_explain_and_a_reset():
    """explain resets Dynamo (and so may the user): the BatchNorm refusal stays registered."""
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(3 * 6 * 6, CLASSES))
    optpass.explain(dp_step(mlp, torch.optim.SGD(mlp.parameters(), lr=0.1)), *batch())
    torch._dynamo.reset()
    with pytest.raises(optpass.OptpassError, match="BatchNorm"):
        compile_step(conv_model(nn.BatchNorm2d(4)))(*batch())
    model = conv_model(nn.BatchNorm2d(4))
    with pytest.raises(optpass.OptpassError, match="BatchNorm"):
        optpass.explain(dp_step(model, torch.optim.SGD(model.parameters(), lr=0.1)), *batch())


def test_another_backend_keeps_torchs_own_error():
    step = compile_step(conv_model(nn.BatchNorm2d(4)), backend="eager")
    with pytest.raises(Exception) as error:
        step(*batch())
    assert not isinstance(error.value, optpass.OptpassError)


@pytest.mark.parametrize("norm", [nn.GroupNorm(2, 4), nn.InstanceNorm2d(4, affine=True), nn.LayerNorm([4, 4, 4]),
                                  "batch-norm-eval"], ids=["group", "instance", "layer", "batch-norm-eval"])
def test_norms_that_mix_no_samples_compile_without_a_warning_and_equal_eager(norm):
    model = conv_model(nn.BatchNorm2d(4) if norm == "batch-norm-eval" else norm)
    if norm == "batch-norm-eval":
        model(torch.randn(16, 3, 6, 6))                              # some running statistics
        model[1].eval()                                              # fixed statistics: per sample
    reference = copy.deepcopy(model)
    step = compile_step(model)
    eager = dp_step(reference, torch.optim.SGD(reference.parameters(), lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", optpass.DPSGDModelWarning)
        for i in range(2):
            torch.testing.assert_close(step(*batch(i)), eager(*batch(i)), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_frozen_parameter_differentiated_in_the_vmap_is_warned_by_name():
    model = conv_model(nn.GroupNorm(2, 4))
    model[0].requires_grad_(False)
    with pytest.warns(optpass.DPSGDModelWarning, match=r"do not require grad: 0\.weight, 0\.bias") as record:
        compile_step(model, trainable_only=False)(*batch())
    assert record[0].filename == __file__                            # at the user's line
    with warnings.catch_warnings():
        warnings.simplefilter("error", optpass.DPSGDModelWarning)
        compile_step(conv_model(nn.GroupNorm(2, 4)))(*batch())        # trainable only: no warning


def test_a_layer_without_a_rewrite_is_warned_by_name_once_per_compile():
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, CLASSES))
    with pytest.warns(optpass.DPSGDModelWarning) as record:
        compile_step(model)(*batch())
    messages = [str(w.message) for w in record if issubclass(w.category, optpass.DPSGDModelWarning)]
    assert len(messages) == 1 and "0.weight [3, 4, 3, 3]: no rewrite for this layer" in messages[0]


def test_explain_gives_the_dp_graphs_estimated_growth_rewritten_beside_unrewritten():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 16, 3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(16 * 2 * 2, CLASSES))
    text = str(optpass.explain(dp_step(model, torch.optim.SGD(model.parameters(), lr=0.1)), *batch()))
    line = next(line for line in text.splitlines() if "estimated growth" in line)
    assert "unrewritten (this program under plain Inductor) ->" in line
    ratio = float(line.rsplit("(", 1)[1].rstrip("x)"))
    assert 0 < ratio < 1
