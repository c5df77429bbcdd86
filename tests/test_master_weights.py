"""master_weights: bf16/fp16 parameters trained through fp32 master copies, as Megatron-LM does it.

The reference is written here the Megatron way, eagerly: fp32 copies of the
half-precision parameters, torch.optim over the copies, each gradient cast to
fp32 before the step, the copies rounded back into the parameters after it.
"""

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import optpass
from optpass.demo.models import MLP
from parity import make_step, mlp_data, mlp_loss, unique_graphs

STEPS = 20
SIZES = (16, 32, 4)           # a 2-layer MLP: the tests' time is compile time, which grows with the graph

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2), weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=torch.tensor(1e-2), momentum=0.9),
}


class MegatronReference:
    """Eager mixed-precision training the Megatron way (Float16OptimizerWithFloat16Params).

    update="eager": torch.optim's step as it runs eagerly. update="compiled": the same step
    through torch.compile with Inductor's decompositions, run eagerly (aot_eager_decomp_partition),
    i.e. torch.optim's update as any compiled optimizer computes it (Adam's bias corrections as
    fp32 tensor math on `step`, where eager torch.optim uses Python doubles; README, Numerics)."""

    def __init__(self, model: nn.Module, make_optimizer, update: str = "eager"):
        self.model = model
        self.masters = [p.detach().float() if p.dtype in (torch.bfloat16, torch.float16) else p
                        for p in model.parameters()]
        self.opt = make_optimizer(self.masters)
        self.update = (self.opt.step if update == "eager"
                       else torch.compile(self.opt.step, backend="aot_eager_decomp_partition"))

    def step(self, x, y, loss_fn=mlp_loss):
        loss = loss_fn(self.model, x, y)
        loss.backward()
        for p, master in zip(self.model.parameters(), self.masters):
            if master is not p and p.grad is not None:   # copy the model gradients to fp32 main grads
                master.grad = p.grad.float()
                p.grad = None
        self.update()
        self.opt.zero_grad()
        self.copy_masters_back()
        return loss.detach()

    def finish_scaled_step(self, scaler, clip: float | None) -> None:
        """The fp16 step after the fp32 main gradients are set, driven by torch.amp.GradScaler
        (``opt.step`` is ``self.update``): scaler.unscale_ of the main gradients, [clip by their
        global norm], scaler.step (skipped on inf/nan), scaler.update, main params copied back."""
        scaler.unscale_(self.opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(self.masters, clip)
        scaler.step(self.opt)
        scaler.update()
        self.opt.zero_grad()
        self.copy_masters_back()

    @torch.no_grad()
    def copy_masters_back(self) -> None:
        """Copy the main params back to the model (rounded to its dtype)."""
        for p, master in zip(self.model.parameters(), self.masters):
            if master is not p:
                p.copy_(master)

    @torch.no_grad()
    def start_from(self, model: nn.Module, opt) -> None:
        """Take the parameters, masters and optimizer state of an optpass run (one step at a time)."""
        masters = optpass.master_weights(opt)
        state = optpass.precision.masters.master_state(opt, torch.float32).master_optimizer.state
        for mine, theirs, master in zip(self.model.parameters(), model.parameters(), self.masters):
            mine.copy_(theirs)
            if master is not mine:
                master.copy_(masters[theirs])
            self.opt.state[master] = {k: v.clone() for k, v in state.get(masters[theirs], {}).items()}


def compiled(model, opt, lower="eager", loss_fn=mlp_loss, **options):
    return torch.compile(make_step(model, opt, loss_fn), backend="optpass",
                         options={"lower": lower, "optimizer": opt, "master_weights": torch.float32, **options})


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between a and b in representable half-precision values (0: bitwise)."""
    def ordered(t):                                     # sign-magnitude bits -> a monotonic integer
        bits = t.detach().contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return int((ordered(a) - ordered(b)).abs().max())


def master_diff(opt, reference: MegatronReference) -> float:
    """max |master - reference master| / max |reference master|, over every parameter."""
    masters = optpass.master_weights(opt)
    return max(((masters[p] - m).abs().max() / m.abs().max()).item()
               for p, m in zip(masters, reference.masters))


def param_ulps(model, reference) -> int:
    """Largest distance of `model`'s parameters from the reference's (a MegatronReference or a module)."""
    other = reference.model if isinstance(reference, MegatronReference) else reference
    return max(ulps(p, q) for p, q in zip(model.parameters(), other.parameters()))


def applied_reports():
    return [r for r in optpass.recent_reports()
            if any(p.name == "master_weights" and p.status == "applied" for p in r.passes)]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_matches_the_megatron_way_eager_step(dtype, name):
    """20 steps, the updates after backward and inside it, against two Megatron-way references.

    * update as torch.compile computes torch.optim's step: parameters and masters bitwise, 20 steps;
    * update by eager torch.optim: every step starts from the fused run's parameters, masters and
      state, and ends within one half-precision ulp (SGD: bitwise) and 1e-5 on the masters. Not a
      20-step trajectory: Adam's fp32 formulation under torch.compile differs from eager's by ~1e-5
      of an update, which flips a rounding now and then, and the flipped parameter changes every
      later gradient (measured over 20 steps: fp16 27 ulps / 9.5e-5 on the masters, bf16 1 ulp /
      1.6e-4; SGD bitwise / 1e-7)."""
    torch.manual_seed(0)
    start = MLP(SIZES).to(dtype)
    compiled_ref = MegatronReference(copy.deepcopy(start), OPTIMIZERS[name], update="compiled")
    eager_ref = MegatronReference(copy.deepcopy(start), OPTIMIZERS[name])
    models = {placement: copy.deepcopy(start) for placement in ("after_backward", "in_backward")}
    opts = {placement: OPTIMIZERS[name](model.parameters()) for placement, model in models.items()}
    steps = {placement: compiled(models[placement], opts[placement], optimizer_in_backward=placement == "in_backward")
             for placement in models}
    optpass.report.clear_reports()
    for i in range(STEPS):
        x, y = mlp_data(i, dtype)
        if i:
            eager_ref.start_from(models["in_backward"], opts["in_backward"])
        expected = compiled_ref.step(x, y).item()
        assert eager_ref.step(x, y).item() == expected
        for placement, step in steps.items():
            assert step(x, y).item() == expected, (placement, i)
            assert all(p.grad is None for p in models[placement].parameters())   # every gradient consumed
        assert param_ulps(models["in_backward"], eager_ref) <= (0 if name == "sgd" else 1), i
        assert master_diff(opts["in_backward"], eager_ref) <= 1e-5, i
    for placement, model in models.items():
        opt = opts[placement]
        assert param_ulps(model, compiled_ref) == 0 and master_diff(opt, compiled_ref) == 0, placement
        # the state is torch.optim's own, created in fp32 for the masters; the user's optimizer has none
        store = optpass.precision.masters.master_state(opt, torch.float32)
        assert {t.dtype for s in store.master_optimizer.state.values() for t in s.values()} == {torch.float32}
        assert not opt.state
    # fused from the first step; SGD compiles again once its momentum buffers exist
    assert len(applied_reports()) == 2 * (2 if name == "sgd" else 1)


def every_torch_optim_optimizer():
    """The optimizers (and first-step traps) test_optimizer_in_backward.py trains in fp32."""
    from test_optimizer_in_backward import OPTIMIZERS as PER_PARAMETER, TRAPS
    return {**PER_PARAMETER, **TRAPS}


@pytest.mark.parametrize("name", sorted(every_torch_optim_optimizer()))
def test_every_torch_optim_optimizer_updates_bf16_masters_in_backward(name):
    """Not only AdamW and SGD: each optimizer's own (harvested) update runs on the fp32 masters inside
    backward. Every step, from the same parameters, masters and state as the fused run (the first
    from the optimizer as the user built it), eager torch.optim the Megatron way ends within one bf16
    ulp and 1e-5 on the masters, with the same loss (measured: 0-1 ulp; at most 8.4e-7 but RAdam's
    6th step, 7.6e-6, where its rectification starts: rho_t = 1999 - 2 t beta2^t / (1 - beta2^t) is
    6.0005 from the step tensor in fp32, as compiled torch.optim computes it, and 5.9942 in eager
    torch.optim's doubles, a rectification 0.18% larger). Step by
    step, as the 20-step test above: a 1e-7 difference in a master flips a bf16 rounding now and
    then, and the flipped parameter changes every later gradient. The first step catches Adagrad's
    initial accumulator: bf16-rounded by the user's optimizer (0.10009765625), 0.1 on the masters."""
    make_optimizer = every_torch_optim_optimizer()[name]
    torch.manual_seed(0)
    start = MLP(SIZES).to(torch.bfloat16)
    reference = MegatronReference(copy.deepcopy(start), make_optimizer)
    model = copy.deepcopy(start)
    opt = make_optimizer(model.parameters())
    step = compiled(model, opt, optimizer_in_backward=True)
    optpass.report.clear_reports()
    for i in range(6):
        x, y = mlp_data(i, torch.bfloat16)
        if i:
            reference.start_from(model, opt)
        assert step(x, y).item() == reference.step(x, y).item(), i
        assert all(p.grad is None for p in model.parameters())
        assert param_ulps(model, reference) <= 1 and master_diff(opt, reference) <= 1e-5, i
    assert applied_reports(), "the first step was not fused"
    assert not opt.state       # the state is the masters', in fp32
    store = optpass.precision.masters.master_state(opt, torch.float32)
    assert {t.dtype for s in store.master_optimizer.state.values() for t in s.values()
            if t.is_floating_point()} <= {torch.float32}


def test_inductor_lowering_matches_the_megatron_way():
    """Inductor computes bf16 forward/backward math in fp32 and rounds once: gradients differ from
    eager's by a rounding, so compare a short run."""
    torch.manual_seed(0)
    model = MLP((16, 4)).to(torch.bfloat16)          # one Linear: few kernels for Inductor to compile
    reference = MegatronReference(copy.deepcopy(model), OPTIMIZERS["adamw"])
    opt = OPTIMIZERS["adamw"](model.parameters())
    step = compiled(model, opt, lower="inductor", optimizer_in_backward=True)
    for i in range(4):
        x, y = mlp_data(i, torch.bfloat16)
        reference.step(x, y)
        step(x, y)
    assert param_ulps(model, reference) <= 1 and master_diff(opt, reference) <= 1e-5


class Gained(nn.Module):
    """A bf16 body with an fp32 output gain (as models keep norms in fp32)."""

    def __init__(self):
        super().__init__()
        self.body = MLP(SIZES).to(torch.bfloat16)
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.body(x).float() * self.gain


def gained_loss(model, x, y):
    return F.mse_loss(model(x), y.float())


def test_fp32_parameters_eager_state_and_an_lr_scheduler():
    """A bf16 body with an fp32 gain, trained 3 steps eagerly (torch.optim on the bf16 parameters),
    then with master_weights: the fp32 gain is its own master, updated as it is; the state the eager
    steps made becomes the masters' (bf16 -> fp32), as a checkpoint without masters would; the
    masters start from the parameters; lr changes every step without a recompile."""
    torch.manual_seed(0)
    model = Gained()
    opt = OPTIMIZERS["adamw"](model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.8)
    eager_step = make_step(model, opt, gained_loss)
    for i in range(3):
        eager_step(*mlp_data(i, torch.bfloat16))
        scheduler.step()
    assert opt.state[model.body[0].weight]["exp_avg"].dtype == torch.bfloat16
    # the reference continues the Megatron way from here (the fp32 gain is updated by Adam as
    # torch.compile formulates it, see the parity test)
    reference = MegatronReference(copy.deepcopy(model), OPTIMIZERS["adamw"], update="compiled")
    for master, state in zip(reference.masters, opt.state.values()):   # copies: optpass takes over the originals
        reference.opt.state[master] = {k: v.to(torch.float32, copy=True) if k != "step" else v.clone()
                                       for k, v in state.items()}
    reference.opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"].clone()
    reference_scheduler = torch.optim.lr_scheduler.StepLR(reference.opt, 1, gamma=0.8)
    step = compiled(model, opt, loss_fn=gained_loss, optimizer_in_backward=True)
    for i in range(3, 10):
        x, y = mlp_data(i, torch.bfloat16)
        assert step(x, y).item() == reference.step(x, y, gained_loss).item()
        scheduler.step()
        reference_scheduler.step()
        if i == 3:
            graphs = unique_graphs()
    assert unique_graphs() == graphs                  # lr is an input of the fused graph
    masters = optpass.master_weights(opt)
    assert masters[model.gain] is model.gain           # updated as it is, in fp32
    assert all(masters[p].dtype == torch.float32 and masters[p] is not p for p in model.body.parameters())
    assert not opt.state
    assert param_ulps(model.body, reference.model.body) == 0 and master_diff(opt, reference) == 0
    assert torch.equal(model.gain, reference.model.gain)


def test_a_param_group_added_later_gets_masters():
    """Fine-tuning: a frozen layer is unfrozen and given to the optimizer with add_param_group. Dynamo
    traces the step again, opt.step()'s pre-hooks included (the guard must not see the gradients
    that are still pending there); the new group gets masters and its own lr."""
    torch.manual_seed(0)
    start = MLP(SIZES).to(torch.bfloat16)
    first = lambda model: list(model.parameters())[:2]         # noqa: E731
    for p in first(start):
        p.requires_grad_(False)
    model = copy.deepcopy(start)
    opt = OPTIMIZERS["adamw"](list(model.parameters())[2:])
    reference = MegatronReference(copy.deepcopy(start), lambda masters: OPTIMIZERS["adamw"](masters[2:]),
                                  update="compiled")
    step = compiled(model, opt, optimizer_in_backward=True)
    for i in range(6):
        if i == 2:
            for module, optimizer, params in ((model, opt, first(model)),
                                              (reference.model, reference.opt, reference.masters[:2])):
                for p in first(module):
                    p.requires_grad_(True)
                optimizer.add_param_group({"params": params, "lr": torch.tensor(3e-3), "weight_decay": 0.0})
        x, y = mlp_data(i, torch.bfloat16)
        assert step(x, y).item() == reference.step(x, y).item(), i
    masters = optpass.master_weights(opt)
    assert all(torch.equal(masters[p], m) for p, m in zip(model.parameters(), reference.masters))
    assert param_ulps(model, reference) == 0 and all(p.grad is None for p in model.parameters())


def test_bf16_without_masters_loses_small_updates_with_masters_it_does_not():
    """A bf16 weight of 1.0 ignores any update below 2**-8 (half its ulp): plain bf16 training
    stalls where fp32 training moves; with fp32 masters the small updates add up."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    y = x @ torch.full((8, 1), 1.02)                  # the weights should move from 1.0 to 1.02

    def make(dtype):
        model = nn.Linear(8, 1, bias=False).to(dtype)
        nn.init.ones_(model.weight)
        return model, torch.optim.SGD(model.parameters(), lr=0.05)

    def loss_fn(model, x, y):
        return F.mse_loss(model(x), y)

    fp32, fp32_opt = make(torch.float32)
    bf16, bf16_opt = make(torch.bfloat16)
    mixed, mixed_opt = make(torch.bfloat16)
    steps = [make_step(fp32, fp32_opt, loss_fn), make_step(bf16, bf16_opt, loss_fn),
             compiled(mixed, mixed_opt, loss_fn=loss_fn, optimizer_in_backward=True)]
    for _ in range(STEPS):
        for step, dtype in zip(steps, (torch.float32, torch.bfloat16, torch.bfloat16)):
            step(x.to(dtype), y.to(dtype))
    assert 1.01 < fp32.weight.min() and fp32.weight.max() < 1.02            # fp32 moved
    assert torch.all(bf16.weight == 1.0)                                       # every update lost
    master = optpass.master_weights(mixed_opt)[mixed.weight]
    assert 1.01 < master.min() and master.max() < 1.02                         # the master moved
    assert torch.equal(mixed.weight, master.to(torch.bfloat16))               # the weights are its rounding
    assert torch.all(mixed.weight > 1.0)


def _run_to(model, opt, step, start, stop, checkpoint_at=None, path=None):
    for i in range(start, stop):
        step(*mlp_data(i, torch.bfloat16))
        if i + 1 == checkpoint_at:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)


def _resume_in_this_process(path, out):
    """Fresh process: build, compile, load the checkpoint, continue to STEPS, save the parameters."""
    torch.manual_seed(1)                             # other initial weights: the checkpoint must set them
    model = MLP(SIZES).to(torch.bfloat16)
    opt = OPTIMIZERS["adamw"](model.parameters())
    step = compiled(model, opt, optimizer_in_backward=True)
    checkpoint = torch.load(path)                    # weights_only: plain tensors and dicts
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    _run_to(model, opt, step, STEPS // 2, STEPS)
    torch.save({"params": [p.detach() for p in model.parameters()],
                "masters": [m for m in optpass.master_weights(opt).values()]}, out)


def test_checkpoint_resumes_in_a_fresh_process_exactly(tmp_path):
    path, out = tmp_path / "step10.pt", tmp_path / "resumed.pt"
    torch.manual_seed(0)
    model = MLP(SIZES).to(torch.bfloat16)
    opt = OPTIMIZERS["adamw"](model.parameters())
    step = compiled(model, opt, optimizer_in_backward=True)
    _run_to(model, opt, step, 0, STEPS, checkpoint_at=STEPS // 2, path=path)   # uninterrupted
    final = [p.detach().clone() for p in model.parameters()]
    final_masters = [m.clone() for m in optpass.master_weights(opt).values()]

    # what the checkpoint holds: fp32 masters and fp32 state, where torch.optim's load keeps them
    saved = torch.load(path)["optimizer"]["state"]
    assert list(saved) == ["optpass.master_weights"]
    assert sorted(saved["optpass.master_weights"]["masters"]) == list(range(4))
    assert {t.dtype for t in saved["optpass.master_weights"]["masters"].values()} == {torch.float32}
    assert {k: v.dtype for k, v in saved["optpass.master_weights"]["state"][0].items()} == \
        {"step": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32}

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(optpass.__file__))), os.path.dirname(__file__)])}
    subprocess.run([sys.executable, __file__, str(path), str(out)], check=True, env=env, timeout=300)
    resumed = torch.load(out)
    assert all(torch.equal(p, q) for p, q in zip(resumed["params"], final))       # bitwise
    assert all(torch.equal(m, n) for m, n in zip(resumed["masters"], final_masters))

    # in this process too: load step 10 into the running optimizer and replay (no recompile)
    compiles = len(optpass.recent_reports())
    checkpoint = torch.load(path)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    assert not opt.state                               # adopted by the masters at once
    _run_to(model, opt, step, STEPS // 2, STEPS)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), final))
    assert len(optpass.recent_reports()) == compiles


def test_explain_shows_the_master_update_and_trains_nothing():
    model = MLP(SIZES).to(torch.bfloat16)
    opt = OPTIMIZERS["adamw"](model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    text = str(optpass.explain(make_step(model, opt, mlp_loss), *mlp_data(0, torch.bfloat16), options={
        "lower": "eager", "optimizer": opt, "master_weights": torch.float32, "optimizer_in_backward": True}))
    assert "pass master_weights: applied" in text and "4 of 4 parameters updated on fp32 masters, inside backward" in text
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters()) and not opt.state    # no bf16 state was made


# ------------------------------------------------------------------ refusals

@pytest.mark.parametrize("options, message", [
    ({"master_weights": torch.float32}, "master_weights needs the optimizer"),
    ({"master_weights": torch.bfloat16, "optimizer": "opt"}, "must be torch.float32"),
    ({"master_weights": "float32", "optimizer": "opt"}, "'master_weights' must be None or dtype"),
    ({"master_weights": torch.float32, "optimizer": "opt", "disable_passes": ["master_weights"]},
     "needs the pass master_weights"),
])
def test_option_refusals(options, message):
    opt = torch.optim.SGD(MLP().to(torch.bfloat16).parameters(), lr=0.1)
    options = {k: (opt if v == "opt" else v) for k, v in options.items()}
    with pytest.raises(optpass.OptpassError, match=message):
        optpass.options.Options.from_user(options)


def refused(step, *args) -> str:
    """The OptpassError a step raises (Dynamo lets it through as itself)."""
    with pytest.raises(optpass.OptpassError) as info:
        step(*args)
    return str(info.value)


def test_an_optimizer_over_fp32_parameters_is_refused():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert "none is bfloat16 or float16" in refused(compiled(model, opt), *mlp_data(0))


def test_a_grad_scaler_in_the_step_is_refused_naming_the_grad_scaler_option():
    model = MLP().to(torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def train_step(x, y):
        loss = mlp_loss(model, x, y)
        scaler.scale(loss).backward()
        out = loss.detach()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return out

    step = torch.compile(train_step, backend="optpass", options={
        "lower": "eager", "optimizer": opt, "master_weights": torch.float32})
    message = refused(step, *mlp_data(0, torch.float16))
    assert "`GradScaler.scale` (Dynamo does not trace it)" in message and "scaler.scale(loss).backward()" in message
    assert "options={'optimizer': opt, 'grad_scaler': scaler, ...}" in message     # the fix


def test_opt_step_outside_the_compiled_step_is_refused():
    """After a compiled micro-step (no opt.step() in it) the gradients are in .grad: an eager
    opt.step() would update the bf16 parameters directly, bypassing the masters."""
    model = MLP().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def micro_step(x, y):
        loss = mlp_loss(model, x, y)
        loss.backward()
        return loss.detach()

    step = torch.compile(micro_step, backend="optpass", options={
        "lower": "eager", "optimizer": opt, "master_weights": torch.float32})
    before = [p.detach().clone() for p in model.parameters()]
    step(*mlp_data(0, torch.bfloat16))
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(optpass.OptpassError, match="opt.step\\(\\) was called with gradients"):
        opt.step()                                     # eagerly: the optimizer's step pre-hook

    def update_only():
        opt.step()
        opt.zero_grad()

    update = torch.compile(update_only, backend="optpass", options={
        "lower": "eager", "optimizer": opt, "master_weights": torch.float32})
    assert "opt.step() was called with gradients" in refused(update)    # compiled: its update graph
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_master_weights_before_the_first_step_is_an_error():
    opt = torch.optim.SGD(MLP().to(torch.bfloat16).parameters(), lr=0.1)
    with pytest.raises(optpass.OptpassError, match="no master weights \\(yet\\)"):
        optpass.master_weights(opt)


if __name__ == "__main__":                           # the fresh process of the checkpoint test
    _resume_in_this_process(sys.argv[1], sys.argv[2])
