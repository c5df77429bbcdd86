"""Programs a new user writes around optpass.explain and accumulation_steps, each compared with eager
PyTorch (or, where optpass's numerics are its own, with the same compiled run without the explain call).

* explain before training changes nothing: parameters, gradients, opt.state_dict(), the RNG, and so the
  training that follows, for SGD with dampening, AdamW, Adagrad (state made by its constructor), with
  fp32 master weights (bf16 model) and with a GradScaler, fused or not (and zero1's legality check);
* accumulation windows follow what the user does: an epoch of 6 micro-batches with K=4, the end-of-epoch
  flush of the partial window (opt.step(); opt.zero_grad()), zero_grad(set_to_none=False), a flush
  without zero_grad, and a partial window cleared without a step.
"""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch
import torch.nn.functional as F

import optpass
from parity import make_step


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(dtype)


def batch(i, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(8, 16, generator=g).to(dtype), torch.randn(8, 4, generator=g).to(dtype)


OPTIMIZERS = {
    "sgd_dampening": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.5),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1, initial_accumulator_value=0.1),
}


def make_train_step(model, opt):
    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    return train_step


def same(a, b) -> bool:
    """Equal structure, equal values (tensors bitwise, dtype and shape included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


class Before:
    """What the user can see of the training state, to compare after explain."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt
        self.params = [p.detach().clone() for p in model.parameters()]
        self.grads = [p.grad for p in model.parameters()]
        self.grad_values = [None if g is None else g.clone() for g in self.grads]
        self.state_dict = copy.deepcopy(opt.state_dict())
        self.state_keys = {id(p): list(s) for p, s in opt.state.items()}
        self.rng = torch.get_rng_state()
        self.py_rng = random.getstate()

    def assert_unchanged(self):
        params = list(self.model.parameters())
        assert all(torch.equal(p, q) for p, q in zip(params, self.params))
        assert all(p.grad is g for p, g in zip(params, self.grads))          # None stays None
        assert all(v is None or torch.equal(g, v) for g, v in zip(self.grads, self.grad_values))
        assert {id(p): list(s) for p, s in self.opt.state.items()} == self.state_keys
        assert same(self.opt.state_dict(), self.state_dict)
        assert torch.equal(torch.get_rng_state(), self.rng) and random.getstate() == self.py_rng


# ------------------------------------------------------------------ explain before training


@pytest.mark.parametrize("options", [{}, {"optimizer_in_backward": True}], ids=["update_after", "in_backward"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_explain_before_training_changes_nothing(name, options):
    """SGD(momentum=0.9, dampening=0.5): explain left zero momentum buffers in opt.state, so the first
    real step took the steady-state formula (buf * 0.9 + 0.5 * grad) instead of buf = grad: 0.0196
    from eager after 3 steps. AdamW's explain left its moments and step; Adagrad's has state from its
    constructor, which must stay as it is."""
    eager_model = make_model()
    eager_opt = OPTIMIZERS[name](eager_model.parameters())
    eager_step = make_train_step(eager_model, eager_opt)

    model = make_model()
    opt = OPTIMIZERS[name](model.parameters())
    train_step = make_train_step(model, opt)
    options = {"lower": "eager", "optimizer": opt, **options} if options else {}
    before = Before(model, opt)
    optpass.explain(train_step, *batch(0), options=options)
    before.assert_unchanged()

    step = torch.compile(train_step, backend="optpass", options=options or {"lower": "eager"})
    for i in range(3):
        expected = eager_step(*batch(i))
        assert torch.allclose(step(*batch(i)), expected, rtol=1e-5, atol=1e-7)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert (p - q).abs().max().item() <= 1e-6
    assert same(list(opt.state_dict()["state"]), list(eager_opt.state_dict()["state"]))


def test_explain_leaves_the_users_gradients_and_random_numbers():
    """Gradients a user has before explain (a step that accumulates into them) are the same tensors with
    the same values after it. A step that draws from Python's random (an augmentation) and from torch's
    (dropout): the generators are where they were (Dynamo advanced Python's for the dry run)."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def train_step(x, y):
        x = x * (1.0 + 0.1 * random.random())        # random brightness
        loss = F.mse_loss(model(x), y)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    before = Before(model, opt)
    optpass.explain(train_step, *batch(0), options={"optimizer": opt, "optimizer_in_backward": True})
    before.assert_unchanged()
    optpass.explain(train_step, *batch(0))
    before.assert_unchanged()


@pytest.mark.parametrize("in_backward", [False, True], ids=["update_after", "in_backward"])
@pytest.mark.parametrize("name", ["adamw", "adagrad"])
def test_explain_with_master_weights_makes_no_masters(name, in_backward):
    """master_weights (bf16 model): explain made the fp32 masters from the parameters as they were then
    (a later model.load_state_dict would not reach them), hooked the optimizer (its state_dict grew an
    'optpass.master_weights' entry) and moved Adagrad's constructor state out of opt.state. After
    explain the optimizer is as it was, and training equals the same training without explain."""
    runs = []
    for explain_first in (False, True):
        model = make_model(torch.bfloat16)
        opt = OPTIMIZERS[name](model.parameters())
        train_step = make_train_step(model, opt)
        options = {"lower": "eager", "optimizer": opt, "master_weights": torch.float32,
                   "optimizer_in_backward": in_backward}
        if explain_first:
            before = Before(model, opt)
            text = str(optpass.explain(train_step, *batch(0, torch.bfloat16), options=options))
            assert "pass master_weights: applied" in text
            before.assert_unchanged()
            with pytest.raises(optpass.OptpassError, match="has no master weights"):
                optpass.master_weights(opt)
        step = torch.compile(train_step, backend="optpass", options=options)
        losses = [step(*batch(i, torch.bfloat16)) for i in range(3)]
        runs.append((losses, [p.detach().clone() for p in model.parameters()], opt.state_dict()))
        torch._dynamo.reset()
    assert same(runs[0], runs[1])


def test_explain_with_a_grad_scaler_leaves_the_scaler_as_it_was():
    """grad_scaler: explain created the scaler's scale (GradScaler makes it at its first scale()) and
    optpass's skip counter; after explain both are as they were and training equals training without
    explain, and eager PyTorch's scaled step."""
    scaler_kwargs = {"init_scale": 2.0 ** 8, "growth_interval": 2}
    eager_model = make_model()
    eager_opt = OPTIMIZERS["sgd_dampening"](eager_model.parameters())
    eager_scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)
    model = make_model()
    opt = OPTIMIZERS["sgd_dampening"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)
    train_step = make_train_step(model, opt)
    options = {"lower": "eager", "optimizer": opt, "grad_scaler": scaler, "optimizer_in_backward": True}
    before = Before(model, opt)
    optpass.explain(train_step, *batch(0), options=options)
    before.assert_unchanged()
    assert scaler._scale is None and scaler.state_dict() == eager_scaler.state_dict()
    step = torch.compile(train_step, backend="optpass", options=options)
    for i in range(4):
        x, y = batch(i)
        loss = F.mse_loss(eager_model(x), y)
        eager_scaler.scale(loss).backward()
        eager_scaler.step(eager_opt)
        eager_scaler.update()
        eager_opt.zero_grad()
        assert torch.allclose(step(x, y), loss.detach(), rtol=1e-5, atol=1e-7)
    assert scaler.get_scale() == eager_scaler.get_scale() == 2.0 ** 10
    assert optpass.skipped_steps(scaler) == 0
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert (p - q).abs().max().item() <= 1e-6


def test_explain_with_zero1_leaves_the_optimizer_as_it_was():
    """data_parallel='zero1': explain checks the step's legality (no ranks needed) and dry-runs the
    user's opt.step(); SGD's momentum buffers it stored stay out of opt.state."""
    model = make_model()
    opt = OPTIMIZERS["sgd_dampening"](model.parameters())
    before = Before(model, opt)
    text = str(optpass.explain(make_train_step(model, opt), *batch(0),
                               options={"optimizer": opt, "data_parallel": "zero1"}))
    assert "optimizer update" in text
    before.assert_unchanged()
    assert not opt.state


def test_explain_mid_training_leaves_the_state_it_found():
    """explain between compiled steps (masters and state exist): nothing moves, training goes on as
    the same training without the explain call."""
    runs = []
    for explain_between in (False, True):
        model = make_model(torch.bfloat16)
        opt = OPTIMIZERS["adamw"](model.parameters())
        train_step = make_train_step(model, opt)
        options = {"lower": "eager", "optimizer": opt, "master_weights": torch.float32,
                   "optimizer_in_backward": True}
        step = torch.compile(train_step, backend="optpass", options=options)
        losses = [step(*batch(i, torch.bfloat16)) for i in range(2)]
        if explain_between:
            masters = optpass.master_weights(opt)
            values = {p: m.clone() for p, m in masters.items()}
            before = Before(model, opt)
            optpass.explain(train_step, *batch(2, torch.bfloat16), options=options)
            before.assert_unchanged()
            assert all(optpass.master_weights(opt)[p] is m and torch.equal(m, values[p]) for p, m in masters.items())
            step = torch.compile(train_step, backend="optpass", options=options)   # explain reset Dynamo
        losses += [step(*batch(i, torch.bfloat16)) for i in range(2, 4)]
        runs.append((losses, [p.detach().clone() for p in model.parameters()], opt.state_dict()))
        torch._dynamo.reset()
    assert same(runs[0], runs[1])


def test_explain_says_so_when_code_outside_the_graphs_writes_a_parameter():
    """Code Dynamo does not compile (here a torch._dynamo.disable'd weight decay) runs for real under
    explain; explain cannot put a parameter back that it wrote, and says so instead of returning."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @torch._dynamo.disable
    def shrink():
        with torch.no_grad():
            model[0].weight.mul_(0.5)

    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        shrink()
        return out

    with pytest.raises(optpass.OptpassError, match=r"wrote 1 tensor\(s\) in place \(a parameter \(32, 16\)\)"):
        optpass.explain(train_step, *batch(0))


# ------------------------------------------------------------------ accumulation windows

K, BATCHES_PER_EPOCH, EPOCHS = 4, 6, 3


def epoch_batches(epoch):
    return [batch(epoch * BATCHES_PER_EPOCH + i, torch.float64) for i in range(BATCHES_PER_EPOCH)]


def loss_of(model, x, y):
    return F.mse_loss(model(x), y) / K


def train_eager(model, opt, end_of_epoch):
    """The usual eager loop: step every K micro-batches, then `end_of_epoch` for the partial window."""
    after_epochs = []
    for epoch in range(EPOCHS):
        for i, (x, y) in enumerate(epoch_batches(epoch)):
            loss_of(model, x, y).backward()
            if (i + 1) % K == 0:
                opt.step()
                opt.zero_grad()
        end_of_epoch(opt)
        after_epochs.append([p.detach().clone() for p in model.parameters()])
    return after_epochs


def train_compiled(model, opt, end_of_epoch, lower="eager"):
    """The same loop with optpass: the micro-step is compiled, the update fires at each K-th call."""
    def micro_step(x, y):
        loss = loss_of(model, x, y)
        loss.backward()
        return loss.detach()

    step = torch.compile(micro_step, backend="optpass", options={
        "lower": lower, "optimizer": opt, "optimizer_in_backward": True, "accumulation_steps": K})
    after_epochs = []
    for epoch in range(EPOCHS):
        for x, y in epoch_batches(epoch):
            step(x, y)
        end_of_epoch(opt)
        after_epochs.append([p.detach().clone() for p in model.parameters()])
    return after_epochs


def flush(opt):
    opt.step()
    opt.zero_grad()


def flush_to_zeros(opt):
    opt.step()
    opt.zero_grad(set_to_none=False)


def flush_keeping_grads(opt):
    opt.step()          # no zero_grad: the next epoch's first window adds to these gradients (as eager)


def drop(opt):
    opt.zero_grad()     # the partial window's gradients are dropped, no update


def drop_to_zeros(opt):
    opt.zero_grad(set_to_none=False)


ACCUMULATION_OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.5),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
}


def compare_epochs(name, end_of_epoch, lower="eager"):
    eager_model, model = make_model(torch.float64), make_model(torch.float64)
    expected = train_eager(eager_model, ACCUMULATION_OPTIMIZERS[name](eager_model.parameters()), end_of_epoch)
    got = train_compiled(model, ACCUMULATION_OPTIMIZERS[name](model.parameters()), end_of_epoch, lower)
    for epoch, (a, b) in enumerate(zip(got, expected)):
        worst = max((p - q).abs().max().item() for p, q in zip(a, b))
        # SGD to rounding; AdamW's compiled update reads its float32 `step` in another formula (~1e-7)
        assert worst <= (1e-12 if name == "sgd" else 1e-6), f"epoch {epoch + 1}: {worst}"


@pytest.mark.parametrize("end_of_epoch", [flush, flush_to_zeros, flush_keeping_grads],
                         ids=["flush", "flush_set_to_none_False", "flush_without_zero_grad"])
@pytest.mark.parametrize("name", list(ACCUMULATION_OPTIMIZERS))
def test_an_epoch_with_a_partial_window_and_a_flush_matches_eager(name, end_of_epoch):
    """K=4, 6 micro-batches an epoch, the leftover 2 applied by an eager opt.step() at the end of the
    epoch: every epoch's windows start at its first micro-batch. optpass counted micro-steps per
    optimizer for the whole run, so epoch 2's update fired after its 2nd micro-batch (SGD lr 0.5:
    4.6e-2 from eager after 3 epochs)."""
    compare_epochs(name, end_of_epoch)


def test_the_flush_matches_eager_under_inductor():
    compare_epochs("sgd", flush, lower="inductor")


@pytest.mark.parametrize("end_of_epoch", [drop, drop_to_zeros], ids=["zero_grad", "set_to_none_False"])
def test_clearing_a_partial_window_drops_it_with_a_warning(end_of_epoch):
    """Clearing .grad mid-window (no opt.step()) drops those micro-steps, as eager's zero_grad does, and
    the next call starts a window; optpass warns once, since clearing at every micro-step (eager habit)
    would never reach an update."""
    with pytest.warns(UserWarning, match="cleared before the update that ends their window") as record:
        compare_epochs("sgd", end_of_epoch)
    dropped = [w for w in record if "cleared before the update" in str(w.message)]
    assert len(dropped) == 1
    assert dropped[0].filename == __file__      # the user's line, not optpass's


def test_a_flush_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        compare_epochs("sgd", flush)


def test_master_weights_windows_restart_where_the_user_clears():
    """master_weights (bf16 model): an eager opt.step() is refused (it would bypass the masters), so a
    partial window is dropped with opt.zero_grad(): the run equals the same run that never fed the
    dropped micro-batches."""
    runs = []
    for feed_leftovers in (True, False):
        model = make_model(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def micro_step(x, y):
            loss = F.mse_loss(model(x), y) / K
            loss.backward()
            return loss.detach()

        step = torch.compile(micro_step, backend="optpass", options={
            "lower": "eager", "optimizer": opt, "optimizer_in_backward": True, "accumulation_steps": K,
            "master_weights": torch.float32})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)          # the dropped window's warning
            for epoch in range(EPOCHS):
                batches = [batch(epoch * BATCHES_PER_EPOCH + i, torch.bfloat16) for i in range(BATCHES_PER_EPOCH)]
                for x, y in batches if feed_leftovers else batches[:K]:
                    step(x, y)
                if feed_leftovers and epoch == 0:
                    with pytest.raises(optpass.OptpassError, match="bypass|masters"):
                        opt.step()
                opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
        torch._dynamo.reset()
    assert same(runs[0], runs[1])


def test_explain_names_what_is_largest_at_the_peak_as_the_user_knows_it():
    """The largest buffers at the estimated peak are named by parameter (and state key), as
    model.named_parameters() and opt.state name them, not by the aten graph's placeholders."""
    import re

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Embedding(512, 64), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train_step(x, y):
        loss = F.cross_entropy(model(x).mean(1), y)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    text = str(optpass.explain(train_step, torch.randint(0, 512, (4, 8)), torch.tensor([0, 1, 2, 3]),
                               options={"optimizer": opt, "optimizer_in_backward": True}))
    [line] = [line for line in text.splitlines() if "largest live at the peak" in line]
    assert "0.weight " in line and re.search(r"0\.weight (exp_avg|exp_avg_sq) ", line), line
    assert not re.search(r"\barg\d+_\d+\b", line), line


def test_explain_names_what_is_alive_at_the_peak_before_and_after():
    """A step whose peak is its activations (a batch of 8192 through 256-wide layers): explain gives
    what is alive at each estimate's peak, before and after the rewrite, each size in its own unit (not
    'gradients 0.00 MB' for a few KB), and says why the update in backward leaves that peak as it was."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                                torch.nn.Tanh(), torch.nn.Linear(256, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step = make_step(model, opt, lambda m, x, y: F.cross_entropy(m(x), y))
    text = str(optpass.explain(train_step, torch.randn(8192, 4), torch.randint(0, 2, (8192,)),
                               options={"optimizer": opt, "optimizer_in_backward": True, "lower": "eager"}))
    before = next(line for line in text.splitlines() if "alive at the estimated peak (before)" in line)
    after = next(line for line in text.splitlines() if "alive at the estimated peak (after)" in line)
    assert "activations 16.00 MB" in before and "activations 16.00 MB" in after
    assert "gradients 0.00 MB" not in before and "KB" in before       # the gradients alive, in their unit
    assert "about the same peak, with next to no gradient alive at it" in text
