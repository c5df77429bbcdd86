"""legality: optimizer_in_backward is refused, with the user's line, wherever it would be wrong."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import optpass
from optpass.demo.models import MLP

THIS_FILE = os.path.basename(__file__)


def setup_model():
    torch.manual_seed(0)
    model = MLP()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def data():
    return torch.randn(8, 16), torch.randn(8, 4)


def compile_fused(fn, opt, **options):
    return torch.compile(fn, backend="optpass",
                         options={"lower": "eager", "optimizer": opt, "optimizer_in_backward": True, **options})


def assert_refused(step, *patterns):
    with pytest.raises(optpass.OptpassError) as info:
        step(*data())
    message = str(info.value)
    for pattern in patterns:
        assert pattern in message, message
    return message


def test_global_clip_grad_norm_is_refused_naming_the_line():
    model, opt = setup_model()

    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    message = assert_refused(compile_fused(train_step, opt),
                             "depends on the gradients of other parameters",
                             f"{THIS_FILE}:", "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
                             "drop optimizer_in_backward")
    assert "What to do" in message


def test_the_torchtitan_failure_clip_silently_a_no_op_cannot_happen():
    """torchtitan's hook-based optimizer-in-backward let clip_grad_norm_ run after the updates
    (it saw no gradients, returned 0, clipped nothing). Here the step never runs unclipped."""
    model, opt = setup_model()
    before = [p.detach().clone() for p in model.parameters()]

    def train_step(x, y):
        loss = F.mse_loss(model(x), y) * 1e6   # huge gradients: clipping matters
        loss.backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        out = total.detach()
        opt.step()
        opt.zero_grad()
        return out

    assert_refused(compile_fused(train_step, opt), "clip_grad_norm_")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))   # nothing was applied
    # without optimizer_in_backward the same step clips: the returned total norm is real
    torch._dynamo.reset()
    plain = torch.compile(train_step, backend="optpass", options={"lower": "eager"})
    assert plain(*data()).item() > 1e-3


def test_custom_global_norm_transform_is_refused_by_dataflow_not_by_name():
    model, opt = setup_model()

    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        scale = 1.0 / (1.0 + sum((g * g).sum() for g in grads).sqrt())
        for g in grads:
            g.mul_(scale)
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    assert_refused(compile_fused(train_step, opt), "depends on the gradients of other parameters",
                   f"{THIS_FILE}:")


COUPLINGS = {
    "add_": "ps[1].grad.add_(ps[3].grad.sum())",
    "copy_": "ps[1].grad.copy_(ps[3].grad[:1].expand_as(ps[1].grad))",
    "foreach": "torch._foreach_add_([ps[1].grad], [ps[3].grad.sum().expand_as(ps[1].grad)])",
}


@pytest.mark.parametrize("kind", sorted(COUPLINGS))
def test_an_in_place_coupling_is_refused_naming_its_own_line(kind):
    """The message points at the line that couples two gradients, not at loss.backward()."""
    model, opt = setup_model()
    ps = list(model.parameters())
    coupling = COUPLINGS[kind]

    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if kind == "add_":
            ps[1].grad.add_(ps[3].grad.sum())
        elif kind == "copy_":
            ps[1].grad.copy_(ps[3].grad[:1].expand_as(ps[1].grad))
        else:
            torch._foreach_add_([ps[1].grad], [ps[3].grad.sum().expand_as(ps[1].grad)])
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    message = assert_refused(compile_fused(train_step, opt), "depends on the gradients of other parameters",
                             coupling)
    assert "loss.backward()" not in message.split("combined at")[1].split(".")[0], message


def test_per_parameter_gradient_transforms_are_legal():
    model, opt = setup_model()

    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            p.grad.mul_(0.5)                                         # touches only its own gradient
        torch._foreach_add_([p.grad for p in model.parameters()], 1e-3)
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    step = compile_fused(train_step, opt)
    for _ in range(3):
        step(*data())
    assert all(p.grad is None for p in model.parameters())


def test_grad_scaler_unscale_is_refused():
    model, opt = setup_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)

    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        out = loss.detach()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return out

    message = assert_refused(compile_fused(train_step, opt))
    # the real cause (GradScaler, which Dynamo does not trace), not the step shape, at the user's line
    assert "`GradScaler.scale` (Dynamo does not trace it)" in message
    assert "The step shape is not the cause" in message and "Fix the step shape" not in message
    assert "scaler.scale(loss).backward()" in message
    # the fix: the grad_scaler option and the plain step
    assert "options={'optimizer': opt, 'grad_scaler': scaler, ...}" in message
    assert "no scaler.scale/step/update in it" in message


@pytest.mark.parametrize("option", ["pipeline_parallel_degree", "expert_parallel_degree"])
def test_declared_pipeline_or_expert_parallelism_is_refused(option):
    model, opt = setup_model()

    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    assert_refused(compile_fused(train_step, opt, **{option: 2}), f"{option}=2")


@pytest.fixture
def single_rank_group():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_expert_parallel_all_to_all_in_the_graph_is_refused(single_rank_group):
    import torch.distributed._functional_collectives as funcol

    model, opt = setup_model()

    def train_step(x, y):
        routed = funcol.all_to_all_single(x, None, None, single_rank_group)   # expert dispatch
        loss = F.mse_loss(model(routed), y)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    assert_refused(compile_fused(train_step, opt), "all_to_all", f"{THIS_FILE}:")


def test_tutorial_step_shape_is_refused_with_the_fix():
    model, opt = setup_model()

    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    with pytest.warns(optpass.BackwardOutsideGraphWarning):
        assert_refused(compile_fused(train_step, opt), "needs backward() inside the compiled step",
                       "out = loss.detach(); opt.step(); opt.zero_grad(); return out")


def test_returning_the_logits_after_the_optimizer_is_refused_naming_them():
    """The first thing a user writes to get the logits back: `loss` has the step shape, the model's
    output does not. The message says that any returned forward tensor must be detached first."""
    model, opt = setup_model()

    def train_step(x, y):
        logits = model(x)
        loss = F.mse_loss(logits, y)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out, logits.detach()

    with pytest.warns(optpass.BackwardOutsideGraphWarning, match="logits"):
        assert_refused(compile_fused(train_step, opt), "needs backward() inside the compiled step",
                       "detach every value to return before opt.step()", "logits = logits.detach()")


def test_options_without_an_optimizer_are_refused():
    with pytest.raises(optpass.OptpassError, match="needs the optimizer"):
        optpass.options.Options.from_user({"optimizer_in_backward": True})


def test_explain_reports_the_legality_verdict():
    model, opt = setup_model()

    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    report = optpass.explain(train_step, *data(), options={"optimizer": opt, "optimizer_in_backward": True})
    verdict = report.to_dict()["graphs"][0]["legality"]
    assert verdict.startswith("optimizer_in_backward refused") and "clip_grad_norm_" in verdict
    assert "legality: optimizer_in_backward refused" in str(report)


@pytest.mark.parametrize("options,match", [
    ({"clip_grad_norm": 1.0}, "clip_grad_norm is a positive max norm for optimizer_in_backward"),
    ({"clip_grad_norm": -1.0, "optimizer_in_backward": True}, "clip_grad_norm is a positive max norm"),
    ({"accumulation_steps": 4}, "accumulation_steps is for optimizer_in_backward"),
])
def test_option_combinations_that_cannot_work_are_refused(options, match):
    _, opt = setup_model()
    with pytest.raises(optpass.OptpassError, match=match):
        optpass.options.Options.from_user({"optimizer": opt, **options})
