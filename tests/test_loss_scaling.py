"""grad_scaler: fp16 dynamic loss scaling with torch.amp.GradScaler's semantics, inside the compiled step.

The references are driven by a real torch.amp.GradScaler: ``scaler.scale(loss).backward()``,
``scaler.unscale_`` (into the fp32 masters, the Megatron way), ``scaler.step`` (skipped on
inf/nan), ``scaler.update()``. Every run injects a batch holding an inf at INF_STEP (that step
must be skipped and the scale backed off) and uses a small growth interval (the scale grows).
"""

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F

import optpass
from optpass.demo.models import MLP
from parity import make_micro_step, make_step, mlp_data, mlp_loss
from test_master_weights import OPTIMIZERS, SIZES, MegatronReference, master_diff, param_ulps

STEPS = 20
INF_STEP = 7
SCALER = dict(init_scale=2.0 ** 14, growth_interval=3)


def data(i, dtype=torch.float16):
    x, y = mlp_data(i, dtype)
    if i == INF_STEP:
        x[0, 0] = float("inf")                       # the injected inf: this step must be skipped
    return x, y


class ScaledMegatronReference(MegatronReference):
    """Megatron's fp16 step driven by torch.amp.GradScaler: scaled backward, fp16 gradients copied
    into fp32 main gradients, scaler.unscale_ of those, [clip], scaler.step (skipped on inf/nan),
    scaler.update, main parameters copied back."""

    def __init__(self, model, make_optimizer, update="eager", clip=None, scaling=True):
        super().__init__(model, make_optimizer, update)
        self.scaler = torch.amp.GradScaler("cpu", enabled=scaling, **SCALER)     # disabled: a no-op
        self.clip = clip
        self.opt.step = self.update                  # what scaler.step(opt) calls

    def step(self, x, y, loss_fn=mlp_loss):
        loss = loss_fn(self.model, x, y)
        self.scaler.scale(loss).backward()
        for p, master in zip(self.model.parameters(), self.masters):
            if master is not p:
                master.grad = p.grad.float()
                p.grad = None
        self.finish_scaled_step(self.scaler, self.clip)
        return loss.detach()

    def start_from(self, model, opt, scaler=None) -> None:
        super().start_from(model, opt)
        self.scaler.load_state_dict(scaler.state_dict())


def compiled(model, opt, scaler, lower="eager", loss_fn=mlp_loss, **options):
    return torch.compile(make_step(model, opt, loss_fn), backend="optpass", options={
        "lower": lower, "optimizer": opt, "master_weights": torch.float32, "grad_scaler": scaler, **options})


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def scaler_state(scaler):
    return scaler.get_scale(), scaler._get_growth_tracker()


def snapshot(model, opt):
    """Parameters, masters and every optimizer state tensor (Adam's step counter included)."""
    store = optpass.precision.masters.master_state(opt, torch.float32)
    return ([p.detach().clone() for p in model.parameters()],
            [m.clone() for m in optpass.master_weights(opt).values()],
            [t.clone() for s in store.master_optimizer.state.values() for t in s.values()])


def unchanged(before, after) -> bool:
    return all(torch.equal(a, b) for group_a, group_b in zip(before, after) for a, b in zip(group_a, group_b))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fp16_masters_match_the_megatron_way_with_a_grad_scaler(name):
    """20 fp16 steps, updates after backward and inside it (check-only first backward), against two
    GradScaler-driven Megatron references:

    * update as torch.compile computes torch.optim's step: parameters and masters bitwise, 20 steps;
    * update by eager torch.optim: each step starts from the fused run's state and ends within one
      fp16 ulp (SGD: bitwise) and 1e-5 of the masters (see test_master_weights for why not 20 steps).

    Scale and growth tracker equal the reference's after every step; the step with the injected inf
    changes nothing (parameters, masters, optimizer state incl. Adam's step) and halves the scale."""
    torch.manual_seed(0)
    start = MLP(SIZES).to(torch.float16)
    compiled_ref = ScaledMegatronReference(copy.deepcopy(start), OPTIMIZERS[name], update="compiled")
    eager_ref = ScaledMegatronReference(copy.deepcopy(start), OPTIMIZERS[name])
    runs = {}
    for placement in ("after_backward", "in_backward"):
        model = copy.deepcopy(start)
        opt = OPTIMIZERS[name](model.parameters())
        scaler = torch.amp.GradScaler("cpu", **SCALER)
        runs[placement] = (model, opt, scaler,
                           compiled(model, opt, scaler, optimizer_in_backward=placement == "in_backward"))
    scales = [compiled_ref.scaler.get_scale()]
    for i in range(STEPS):
        x, y = data(i)
        model, opt, scaler, _ = runs["in_backward"]
        if i:
            eager_ref.start_from(model, opt, scaler)
        expected = compiled_ref.step(x, y).item()
        assert same(eager_ref.step(x, y).item(), expected)
        scales.append(compiled_ref.scaler.get_scale())
        for placement, (model, opt, scaler, step) in runs.items():
            before = snapshot(model, opt) if i == INF_STEP else None
            assert same(step(x, y).item(), expected), (placement, i)
            assert scaler_state(scaler) == scaler_state(compiled_ref.scaler), (placement, i)
            assert all(p.grad is None for p in model.parameters())
            if before is not None:
                assert unchanged(before, snapshot(model, opt)), placement
        model, opt, _, _ = runs["in_backward"]
        assert param_ulps(model, eager_ref) <= (0 if name == "sgd" else 1), i
        assert master_diff(opt, eager_ref) <= 1e-5, i
    for placement, (model, opt, scaler, _) in runs.items():
        assert param_ulps(model, compiled_ref) == 0 and master_diff(opt, compiled_ref) == 0, placement
        assert optpass.skipped_steps(scaler) == sum(b < a for a, b in zip(scales, scales[1:]))
    # the scale grew after growth_interval clean steps and backed off at the injected inf
    assert scales[INF_STEP + 1] == scales[INF_STEP] / 2 and any(b == 2 * a for a, b in zip(scales, scales[1:]))


def amp_loss(model, x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        return F.mse_loss(model(x), y)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_classic_amp_fp32_parameters_under_fp16_autocast(name):
    """fp32 parameters, fp16 autocast, no masters: the user's optimizer's own update, harvested, after
    backward and inside it, against eager GradScaler (scaler.scale(loss).backward(); scaler.step(opt);
    scaler.update()) with torch.optim's step as torch.compile computes it: bitwise."""
    torch.manual_seed(0)
    start = MLP(SIZES)
    reference = copy.deepcopy(start)
    ref_opt = OPTIMIZERS[name](reference.parameters())
    ref_opt.step = torch.compile(ref_opt.step, backend="aot_eager_decomp_partition")
    ref_scaler = torch.amp.GradScaler("cpu", **SCALER)
    runs = []
    for in_backward in (False, True):
        model = copy.deepcopy(start)
        opt = OPTIMIZERS[name](model.parameters())
        scaler = torch.amp.GradScaler("cpu", **SCALER)
        runs.append((model, scaler, torch.compile(make_step(model, opt, amp_loss), backend="optpass", options={
            "lower": "eager", "optimizer": opt, "grad_scaler": scaler, "optimizer_in_backward": in_backward})))
    for i in range(12):
        x, y = data(i, torch.float32)
        loss = amp_loss(reference, x, y)
        ref_scaler.scale(loss).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        for model, scaler, step in runs:
            assert same(step(x, y).item(), loss.item()), i
            assert scaler_state(scaler) == scaler_state(ref_scaler), i
    for model, scaler, _ in runs:
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
        assert optpass.skipped_steps(scaler) >= 1


def test_inductor_lowering_matches_the_megatron_way():
    """Inductor computes fp16 forward math in fp32 and rounds once: the losses differ from eager's
    by a rounding; the updates stay within one ulp over a short run with a skipped step."""
    torch.manual_seed(0)
    model = MLP(SIZES).to(torch.float16)
    reference = ScaledMegatronReference(copy.deepcopy(model), OPTIMIZERS["adamw"], update="compiled")
    opt = OPTIMIZERS["adamw"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    step = compiled(model, opt, scaler, lower="inductor", optimizer_in_backward=True)
    for i in range(INF_STEP - 1, INF_STEP + 2):
        x, y = data(i)
        reference.step(x, y)
        step(x, y)
        assert scaler_state(scaler) == scaler_state(reference.scaler), i
    assert param_ulps(model, reference) <= 1 and master_diff(opt, reference) <= 1e-5
    assert optpass.skipped_steps(scaler) == 1


def _train(model, opt, scaler, step, start, stop):
    for i in range(start, stop):
        step(*data(i))


def test_scaler_checkpoint_continues_identically():
    """scaler.state_dict() (with the model's and the optimizer's) saved at step 10 and loaded into a
    new model, optimizer and GradScaler continues bitwise as the uninterrupted run, scale included."""
    torch.manual_seed(0)
    model = MLP(SIZES).to(torch.float16)
    opt = OPTIMIZERS["adamw"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    step = compiled(model, opt, scaler, optimizer_in_backward=True)
    _train(model, opt, scaler, step, 0, 10)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict()}, buffer)
    _train(model, opt, scaler, step, 10, 14)

    torch._dynamo.reset()
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    resumed = MLP(SIZES).to(torch.float16)
    resumed_opt = OPTIMIZERS["adamw"](resumed.parameters())
    resumed_scaler = torch.amp.GradScaler("cpu")                 # other settings: the checkpoint sets them
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    resumed_scaler.load_state_dict(checkpoint["scaler"])
    assert resumed_scaler.get_scale() == checkpoint["scaler"]["scale"]
    resumed_step = compiled(resumed, resumed_opt, resumed_scaler, optimizer_in_backward=True)
    _train(resumed, resumed_opt, resumed_scaler, resumed_step, 10, 14)
    assert scaler_state(resumed_scaler) == scaler_state(scaler)
    assert all(torch.equal(p, q) for p, q in zip(resumed.parameters(), model.parameters()))
    assert all(torch.equal(m, n) for m, n in zip(optpass.master_weights(resumed_opt).values(),
                                                 optpass.master_weights(opt).values()))


def test_sgd_first_step_skipped_creates_no_momentum():
    """SGD's first update creates its momentum buffers from the gradient; eager GradScaler skips
    opt.step() on inf, so a skipped first step must leave no buffer behind (the next step creates it)."""
    torch.manual_seed(0)
    model = MLP(SIZES).to(torch.float16)
    reference = ScaledMegatronReference(copy.deepcopy(model), OPTIMIZERS["sgd"], update="compiled")
    opt = OPTIMIZERS["sgd"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    step = compiled(model, opt, scaler)
    store = optpass.precision.masters.master_state(opt, torch.float32)
    for i in range(3):
        x, y = data(INF_STEP if i == 0 else i)
        reference.step(x, y)
        step(x, y)
        assert len(store.master_optimizer.state) == len(reference.opt.state), i
    assert param_ulps(model, reference) == 0 and master_diff(opt, reference) == 0


def test_explain_shows_the_scaling_and_trains_nothing():
    model = MLP(SIZES).to(torch.float16)
    opt = OPTIMIZERS["adamw"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    before = [p.detach().clone() for p in model.parameters()]
    text = str(optpass.explain(make_step(model, opt, mlp_loss), *data(0), options={
        "lower": "eager", "optimizer": opt, "master_weights": torch.float32, "grad_scaler": scaler,
        "optimizer_in_backward": True}))
    assert "grad_scaler is legal" in text and "pass loss_scaling: applied" in text
    assert "4 gradients unscaled into fp32; the update is skipped on inf/nan (checked in a first backward)" in text
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert scaler_state(scaler) == (SCALER["init_scale"], 0) and optpass.skipped_steps(scaler) == 0
    micro = str(optpass.explain(make_micro_step(model, mlp_loss), *data(0), options={
        "lower": "eager", "optimizer": opt, "master_weights": torch.float32, "grad_scaler": scaler}))
    assert "grad_scaler: a micro-step (no opt.step()): backward of loss * scale" in micro
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


# ------------------------------------------------------------------ clip_grad_norm with master weights

@pytest.mark.parametrize("scaling", [False, True], ids=["masters", "masters+scaler"])
def test_clip_grad_norm_clips_the_fp32_master_gradients(scaling):
    """options clip_grad_norm with master_weights clips by the global norm of the fp32 gradients
    (Megatron's main gradients), after unscaling and the inf/nan check with a scaler (Megatron's
    order), after backward and inside it (the norm from the check-only first backward). Against the
    reference's clip_grad_norm_ over the fp32 master gradients, one step at a time from the same
    state: the norm is summed in another order (sqrt of the sum of squares, not a norm of norms), so
    within one fp16 ulp and 1e-5 of the masters; the clip is active at every step (max norm 0.05)."""
    torch.manual_seed(0)
    start = MLP(SIZES).to(torch.float16)
    optpass.report.clear_reports()
    runs = []
    for in_backward in (False, True):
        model = copy.deepcopy(start)
        opt = OPTIMIZERS["adamw"](model.parameters())
        scaler = torch.amp.GradScaler("cpu", enabled=scaling, **SCALER)
        reference = ScaledMegatronReference(copy.deepcopy(start), OPTIMIZERS["adamw"], clip=0.05, scaling=scaling)
        runs.append((model, opt, scaler, reference, compiled(model, opt, scaler, clip_grad_norm=0.05,
                                                             optimizer_in_backward=in_backward)))
    for i in range(INF_STEP - 3, INF_STEP + 3):
        x, y = data(i) if scaling else mlp_data(i, torch.float16)
        for model, opt, scaler, reference, step in runs:
            if i > INF_STEP - 3:
                reference.start_from(model, opt, scaler)
            expected = reference.step(x, y).item()
            assert same(step(x, y).item(), expected), i
            assert param_ulps(model, reference) <= 1 and master_diff(opt, reference) <= 1e-5, i
            if scaling:
                assert scaler_state(scaler) == scaler_state(reference.scaler), i
    applied = [p for r in optpass.recent_reports() for p in r.passes if p.name == "clip_grad_norm_in_backward"]
    assert applied and all(p.status == "applied" for p in applied)


def test_clip_grad_norm_in_the_step_with_master_weights_matches_eager():
    """A user-written clip_grad_norm_ in the step (no in-backward, no scaler) clips the fp16 gradients the
    step computes, before the fused update casts them for the masters: bitwise the eager Megatron-way
    step with the same clip_grad_norm_ call before the gradients are cast (20 steps)."""
    torch.manual_seed(0)
    start = MLP(SIZES).to(torch.float16)

    class Reference(MegatronReference):
        def step(self, x, y):
            loss = mlp_loss(self.model, x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.05)     # the step's own line
            for p, master in zip(self.model.parameters(), self.masters):
                master.grad = p.grad.float()
                p.grad = None
            self.update()
            self.opt.zero_grad()
            with torch.no_grad():
                for p, master in zip(self.model.parameters(), self.masters):
                    p.copy_(master)
            return loss.detach()

    reference = Reference(copy.deepcopy(start), OPTIMIZERS["sgd"], update="compiled")
    model = copy.deepcopy(start)
    opt = OPTIMIZERS["sgd"](model.parameters())
    step = torch.compile(make_step(model, opt, mlp_loss, clip=0.05), backend="optpass", options={
        "lower": "eager", "optimizer": opt, "master_weights": torch.float32})
    for i in range(STEPS):
        x, y = mlp_data(i, torch.float16)
        assert step(x, y).item() == reference.step(x, y).item(), i
    assert param_ulps(model, reference) == 0 and master_diff(opt, reference) == 0


ACCUMULATED = 3           # micro-steps per step: calls 3k and 3k+1 are micro-steps, 3k+2 the step


@pytest.mark.parametrize("name, lower", [("adamw", "eager"), ("sgd", "eager"), ("sgd", "inductor")])
def test_gradient_accumulation_matches_gradscaler(name, lower):
    """Micro-steps (backward, no opt.step()) compiled with the step's options, every third call the
    whole step, 24 calls: each micro-step differentiates loss * scale, as scaler.scale(loss).backward()
    does, .grad sums the scaled fp16 gradients, and the step unscales, checks and applies the sum.
    Against the Megatron way driven by GradScaler with the same micro-steps, torch.optim's update as
    torch.compile computes it: the scale after every call equal; eager lowering: every loss equal,
    parameters and masters bitwise; Inductor (fp16 forward and backward math in fp32, rounded once,
    in each of the 3 micro-steps a step sums): losses within a rounding, 3 SGD steps within one ulp
    and 1e-4 of the masters (measured 1 ulp, 4.0e-5). The inf injected into micro-step
    INF_STEP reaches the sum: the next step changes nothing and backs the scale off."""
    torch.manual_seed(0)
    start = MLP(SIZES).to(torch.float16)
    reference = ScaledMegatronReference(copy.deepcopy(start), OPTIMIZERS[name], update="compiled")
    model = copy.deepcopy(start)
    opt = OPTIMIZERS[name](model.parameters())
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    micro = torch.compile(make_micro_step(model, mlp_loss), backend="optpass", options={
        "lower": lower, "optimizer": opt, "master_weights": torch.float32, "grad_scaler": scaler})
    step = compiled(model, opt, scaler, lower)
    eager = lower == "eager"
    loss_matches = same if eager else (lambda a, b: math.isclose(a, b, rel_tol=2e-3) or same(a, b))
    skipped_at = None
    for i in range((8 if eager else 3) * ACCUMULATED):
        x, y = data(i)
        if (i + 1) % ACCUMULATED:
            loss = mlp_loss(reference.model, x, y)
            reference.scaler.scale(loss).backward()
            assert loss_matches(micro(x, y).item(), loss.item()), i
            assert all(p.grad is not None for p in model.parameters()), i
        else:
            before = snapshot(model, opt) if skipped_at is None and i > INF_STEP else None
            assert loss_matches(step(x, y).item(), reference.step(x, y).item()), i
            assert all(p.grad is None for p in model.parameters()), i
            if before is not None:
                skipped_at = i
                assert unchanged(before, snapshot(model, opt)), i
        assert scaler_state(scaler) == scaler_state(reference.scaler), i
    assert skipped_at == INF_STEP + 1 and optpass.skipped_steps(scaler) >= 1
    if eager:
        assert param_ulps(model, reference) == 0 and master_diff(opt, reference) == 0
    else:                     # SGD is not scale-invariant: an unscaled micro-step would be 1e-2 off
        assert param_ulps(model, reference) <= 1 and master_diff(opt, reference) <= 1e-4


def test_gradient_accumulation_with_batch_sizes_that_change():
    """Micro-steps and steps on batches of 8, 5, 7 and 3 examples: after the first, Dynamo compiles
    the micro-step with the batch size symbolic (once with .grad None, once accumulating into it), and
    the scaled micro-step compiles from those symbolic inputs: 3 compiles for 8 micro-steps of 4
    sizes; bitwise against the GradScaler-driven reference, the scale equal after every call."""
    from unittest import mock

    from optpass.runtime.scaled_micro_step import ScaledMicroStep

    torch.manual_seed(0)
    start = MLP(SIZES).to(torch.float16)
    reference = ScaledMegatronReference(copy.deepcopy(start), OPTIMIZERS["sgd"], update="compiled")
    model = copy.deepcopy(start)
    opt = OPTIMIZERS["sgd"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    options = {"lower": "eager", "optimizer": opt, "master_weights": torch.float32, "grad_scaler": scaler}
    micro = torch.compile(make_micro_step(model, mlp_loss), backend="optpass", options=options)
    step = compiled(model, opt, scaler)
    compiles, compile_micro_step = [], ScaledMicroStep._compile

    def counted(self, args, scale):
        compiles.append(len(args))
        return compile_micro_step(self, args, scale)

    g = torch.Generator().manual_seed(1)
    with mock.patch.object(ScaledMicroStep, "_compile", counted):
        for i in range(4 * ACCUMULATED):
            batch = (8, 5, 7, 3)[i % 4]
            x = torch.randn(batch, SIZES[0], generator=g).half()
            y = torch.randn(batch, SIZES[-1], generator=g).half()
            if (i + 1) % ACCUMULATED:
                loss = mlp_loss(reference.model, x, y)
                reference.scaler.scale(loss).backward()
                assert same(micro(x, y).item(), loss.item()), i
            else:
                assert same(step(x, y).item(), reference.step(x, y).item()), i
            assert scaler_state(scaler) == scaler_state(reference.scaler), i
    assert len(compiles) == 3, compiles
    assert param_ulps(model, reference) == 0 and master_diff(opt, reference) == 0


def test_gradient_accumulation_with_fp32_parameters_under_fp16_autocast():
    """Classic AMP (fp32 parameters, fp16 autocast, no masters) with micro-steps: bitwise against eager
    GradScaler (scaler.scale(loss).backward() per micro-step; scaler.step(opt); scaler.update())."""
    torch.manual_seed(0)
    start = MLP(SIZES)
    reference = copy.deepcopy(start)
    ref_opt = OPTIMIZERS["adamw"](reference.parameters())
    ref_opt.step = torch.compile(ref_opt.step, backend="aot_eager_decomp_partition")
    ref_scaler = torch.amp.GradScaler("cpu", **SCALER)
    model = copy.deepcopy(start)
    opt = OPTIMIZERS["adamw"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    options = {"lower": "eager", "optimizer": opt, "grad_scaler": scaler}
    micro = torch.compile(make_micro_step(model, amp_loss), backend="optpass", options=options)
    step = torch.compile(make_step(model, opt, amp_loss), backend="optpass", options=options)
    for i in range(6 * ACCUMULATED):
        x, y = data(i, torch.float32)
        loss = amp_loss(reference, x, y)
        ref_scaler.scale(loss).backward()
        if (i + 1) % ACCUMULATED:
            assert same(micro(x, y).item(), loss.item()), i
        else:
            ref_scaler.step(ref_opt)
            ref_scaler.update()
            ref_opt.zero_grad()
            assert same(step(x, y).item(), loss.item()), i
        assert scaler_state(scaler) == scaler_state(ref_scaler), i
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert optpass.skipped_steps(scaler) >= 1


# ------------------------------------------------------------------ refusals

def _fp16_setup():
    model = MLP(SIZES).to(torch.float16)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def refused(step, *args) -> str:
    with pytest.raises(optpass.OptpassError) as info:
        step(*args)
    return str(info.value)


@pytest.mark.parametrize("options, message", [
    ({"grad_scaler": "scaler"}, "grad_scaler needs the optimizer"),
    ({"grad_scaler": "scaler", "optimizer": "opt", "optimizer_in_backward": True, "accumulation_steps": 2},
     "grad_scaler with accumulation_steps > 1 is not supported yet"),
    ({"grad_scaler": "scaler", "optimizer": "opt", "disable_passes": ["loss_scaling"]},
     "needs the pass loss_scaling"),
    ({"grad_scaler": 2.0 ** 16, "optimizer": "opt"}, "'grad_scaler' must be None or GradScaler"),
])
def test_option_refusals(options, message):
    _, opt = _fp16_setup()
    scaler = torch.amp.GradScaler("cpu")
    options = {k: {"opt": opt, "scaler": scaler}.get(v, v) if isinstance(v, str) else v for k, v in options.items()}
    with pytest.raises(optpass.OptpassError, match=message):
        optpass.options.Options.from_user(options)


def test_a_disabled_scaler_is_ignored_as_gradscaler_ignores_itself():
    _, opt = _fp16_setup()
    options = optpass.options.Options.from_user({"optimizer": opt,
                                                 "grad_scaler": torch.amp.GradScaler("cpu", enabled=False)})
    assert options.grad_scaler is None


def test_fp16_parameters_without_masters_are_refused():
    model, opt = _fp16_setup()
    step = torch.compile(make_step(model, opt, mlp_loss), backend="optpass", options={
        "lower": "eager", "optimizer": opt, "grad_scaler": torch.amp.GradScaler("cpu")})
    message = refused(step, *mlp_data(0, torch.float16))
    assert "needs master_weights=torch.float32" in message and "Attempting to unscale FP16 gradients" in message


def test_a_gradient_transform_in_the_step_is_refused_with_the_clip_option_as_the_fix():
    model, opt = _fp16_setup()
    before = [p.detach().clone() for p in model.parameters()]
    step = torch.compile(make_step(model, opt, mlp_loss, clip=1.0), backend="optpass", options={
        "lower": "eager", "optimizer": opt, "master_weights": torch.float32,
        "grad_scaler": torch.amp.GradScaler("cpu")})
    message = refused(step, *mlp_data(0, torch.float16))
    assert "clip_grad_norm_(model.parameters(), clip)" in message        # the user's line (tests/parity.py)
    assert "'clip_grad_norm': max_norm" in message
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_a_step_adding_to_gradients_no_scaled_micro_step_made_is_refused():
    """An eager (unscaled) backward before the compiled step: the step would unscale .grad."""
    model, opt = _fp16_setup()
    scaler = torch.amp.GradScaler("cpu")
    step = compiled(model, opt, scaler, loss_fn=mlp_loss)
    x, y = mlp_data(0, torch.float16)
    mlp_loss(model, x, y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    message = refused(step, x, y)
    assert "no micro-step compiled with" in message and "'grad_scaler': scaler" in message
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_gradient_accumulation_with_optimizer_in_backward_is_refused():
    model, opt = _fp16_setup()
    step = compiled(model, opt, torch.amp.GradScaler("cpu"), optimizer_in_backward=True)
    x, y = mlp_data(0, torch.float16)
    mlp_loss(model, x, y).backward()
    assert "grad_scaler with optimizer_in_backward: this step accumulates" in refused(step, x, y)
