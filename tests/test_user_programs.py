"""Programs a new user writes first, each compared with plain eager PyTorch on the same seed.

Each test is a small program as a user writes it with the README open: two models in one step,
a step that logs its loss, the model compiled alone, catching optpass's errors, a typo. Where
optpass refuses, the test reads the error as the user does. The programs around clipping, explain
and accumulation windows, and master weights live beside this file (``test_user_programs_clip.py``,
``_explain.py``, ``_masters.py``), so that the test workers share them out.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import optpass
from optpass.capture import _ordinal_suffix

OPTPASS_DIR = os.path.dirname(optpass.__file__)


def make_gan_generator_step(G, D, opt):
    def generator_step(z):
        loss = D(G(z)).sum(1).pow(2).mean()
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    return generator_step


def two_models(hidden_of_d: int):
    """G and D are both Sequential(Linear, act, Linear): their parameters share the names 0.weight, ..."""
    G = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    D = nn.Sequential(nn.Linear(16, hidden_of_d), nn.Tanh(), nn.Linear(hidden_of_d, 1))
    return G, D


@pytest.mark.parametrize("lower,hidden_of_d", [("eager", 16), ("eager", 24), ("inductor", 16)])
def test_two_models_whose_parameters_share_names_train_as_eager(lower, hidden_of_d):
    """A GAN's generator step: G is in the optimizer, D is not and accumulates .grad as in eager.
    Parameters were matched by their name within their module (both G's and D's are '0.weight'):
    G ended 0.0089 away (same shapes) or crashed (D's other shapes)."""
    G, D = two_models(hidden_of_d)
    G_ref, D_ref = copy.deepcopy(G), copy.deepcopy(D)
    opt = torch.optim.SGD(G.parameters(), lr=torch.tensor(0.05), momentum=0.9)
    opt_ref = torch.optim.SGD(G_ref.parameters(), lr=torch.tensor(0.05), momentum=0.9)
    step = torch.compile(make_gan_generator_step(G, D, opt), backend="optpass",
                         options={"optimizer": opt, "optimizer_in_backward": True, "lower": lower})
    eager = make_gan_generator_step(G_ref, D_ref, opt_ref)
    for i in range(4):
        z = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(step(z), eager(z), rtol=1e-5, atol=1e-6)
    for p, q in zip(G.parameters(), G_ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert p.grad is None and q.grad is None
    for p, q in zip(D.parameters(), D_ref.parameters()):       # D's gradients add up over the 4 steps
        assert p.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_explain_names_each_models_parameters_by_its_own_path():
    G, D = two_models(16)
    opt = torch.optim.SGD(G.parameters(), lr=0.05)
    report = optpass.explain(make_gan_generator_step(G, D, opt), torch.randn(8, 16),
                             options={"optimizer": opt, "optimizer_in_backward": True})
    step = report.of_kind(optpass.GraphKind.STEP)[0].to_dict()
    assert step["parameters"] == ["G.0.weight", "G.0.bias", "G.2.weight", "G.2.bias",
                                  "D.0.weight", "D.0.bias", "D.2.weight", "D.2.bias"]
    assert len(step["gradients"]) == 8


def test_a_single_models_parameters_keep_their_module_names():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    report = optpass.explain(train_step, torch.randn(3, 4), options={"optimizer": opt})
    assert report.of_kind(optpass.GraphKind.STEP)[0].to_dict()["parameters"] == [
        "0.weight", "0.bias", "2.weight", "2.bias"]


def mlp_and_adamw():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2))


def step_that_reads_the_loss_with_item(model, opt):
    def train_step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        out = loss.item()
        opt.step()
        opt.zero_grad()
        return out
    return train_step


def step_that_prints_the_loss(model, opt):
    def train_step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        print("loss", loss)
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    return train_step


def batch(i=0):
    g = torch.Generator().manual_seed(i)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


@pytest.mark.parametrize("make_step,cause", [
    (step_that_reads_the_loss_with_item, r"Tensor\.item\(\)"),
    (step_that_prints_the_loss, r"builtin operator `print`"),
])
def test_a_break_after_backward_is_named_as_the_cause(make_step, cause, capsys):
    """`.item()` (or print) after backward() keeps `loss` alive across a graph break, so Dynamo
    moves the break to backward(): the refusal names that call, not the step shape's usual cause."""
    model, opt = mlp_and_adamw()
    step = torch.compile(make_step(model, opt), backend="optpass",
                         options={"optimizer": opt, "optimizer_in_backward": True, "lower": "eager"})
    with pytest.raises(optpass.OptpassError, match=cause) as info:
        step(*batch())
    message = str(info.value)
    assert "reading `loss` after opt.step()" not in message
    assert "test_user_programs.py" in message and "call `.item()` or print it after the step returns" in message


def test_the_warning_for_a_break_after_backward_names_the_call_and_points_at_the_users_line():
    model, opt = mlp_and_adamw()
    model_ref, opt_ref = copy.deepcopy(model), copy.deepcopy(opt)
    opt_ref = torch.optim.AdamW(model_ref.parameters(), lr=torch.tensor(1e-2))

    def train_step(x, y):          # optpass warns once per line: this step's own
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        out = loss.item()
        opt.step()
        opt.zero_grad()
        return out
    step = torch.compile(train_step, backend="optpass")
    with pytest.warns(optpass.BackwardOutsideGraphWarning, match=r"Tensor\.item\(\)") as record:
        losses = [step(*batch(i)) for i in range(3)]
    ours = [w for w in record if issubclass(w.category, optpass.BackwardOutsideGraphWarning)]
    assert ours and all(os.path.basename(w.filename) == "test_user_programs.py" for w in ours), \
        [(w.filename, w.lineno) for w in ours]
    eager = step_that_reads_the_loss_with_item(model_ref, opt_ref)
    assert losses == pytest.approx([eager(*batch(i)) for i in range(3)], rel=1e-5)


_TUTORIAL_STEP_ON_STDIN = """
import warnings, torch, optpass
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1))
def train_step(x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()
with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    torch.compile(train_step, backend="optpass")(torch.randn(8, 4), torch.randn(8, 2))
print("WARNING:", [str(w.message) for w in record if isinstance(w.message, optpass.BackwardOutsideGraphWarning)])
torch._dynamo.reset()
try:
    torch.compile(train_step, backend="optpass", options={"optimizer": opt, "optimizer_in_backward": True})(
        torch.randn(8, 4), torch.randn(8, 2))
except optpass.OptpassError as error:
    print("ERROR:", error)
"""


def test_a_tutorial_step_whose_source_cannot_be_read_gets_both_causes_and_fixes():
    """A script piped to python (or a REPL without source): the break's line has no text, so
    optpass cannot tell the step shape from a break in a callee and says so, with both fixes."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-"], input=_TUTORIAL_STEP_ON_STDIN, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    warning = next(line for line in out.stdout.splitlines() if line.startswith("WARNING:"))
    error = next(line for line in out.stdout.splitlines() if line.startswith("ERROR:"))
    for message in (warning, error):
        assert "source could not be read" in message, message
        assert "The step shape is not the cause" not in message, message
        assert "loss.backward(); out = loss.detach(); opt.step(); opt.zero_grad(); return out" in message
        assert "torch._dynamo.explain(step)" in message
        assert "<stdin>:7 in train_step," in message, message      # no empty code after the line


@pytest.mark.parametrize("lower", ["eager", "inductor"])
def test_compiling_the_model_alone_warns_of_nothing(lower):
    """People try any backend on the model first: a forward with no backward() in it is no
    broken step. No optpass warning; the results equal Inductor's, training eagerly around it."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model_ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="optpass", options={"lower": lower})
    reference = torch.compile(model_ref, backend="inductor")
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, model_ref))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for i in range(3):
            x, y = batch(i)
            for m, o in ((compiled, opt), (reference, opt_ref)):
                loss = F.cross_entropy(m(x), y)
                loss.backward()
                o.step()
                o.zero_grad()
        with torch.no_grad():                                       # an evaluation in between
            torch.testing.assert_close(compiled(x), reference(x))
    ours = [w for w in record if issubclass(w.category, (optpass.BackwardOutsideGraphWarning,
                                                         optpass.RecompilingUpdateWarning))
            or w.filename.startswith(OPTPASS_DIR)]
    assert ours == [], [str(w.message)[:200] for w in ours]
    for p, q in zip(model.parameters(), model_ref.parameters()):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize("lower", ["eager", "inductor"])
def test_every_refusal_is_caught_as_optpass_error_with_optpass_message_only(lower):
    """Dynamo wraps a backend's errors in BackendCompilerFailed; optpass's come through as themselves."""
    model, opt = mlp_and_adamw()

    def clipped_step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    step = torch.compile(clipped_step, backend="optpass",
                         options={"optimizer": opt, "optimizer_in_backward": True, "lower": lower})
    try:
        step(*batch())
    except optpass.OptpassError as error:
        message = str(error)
        assert isinstance(error, RuntimeError)
    else:
        pytest.fail("clip_grad_norm_ in the step with optimizer_in_backward was not refused")
    assert message.startswith("optimizer_in_backward refused: the gradient of ")
    assert "TORCHDYNAMO_VERBOSE" not in message and "from user code" not in message
    before = [p.detach().clone() for p in model.parameters()]
    torch._dynamo.reset()
    with pytest.raises(optpass.OptpassError, match="did you mean 'optimizer_in_backward'"):
        torch.compile(clipped_step, backend="optpass", options={"optimizer_in_backwards": True})(*batch())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))   # nothing ran


def test_an_option_typo_says_did_you_mean_without_the_whole_table():
    with pytest.raises(optpass.OptpassError) as info:
        optpass.options.Options.from_user({"lower": "inducter"})
    assert str(info.value) == ("optpass option 'lower' must be one of 'inductor', 'eager', got 'inducter'; "
                               "did you mean 'inductor'?")


def test_clip_grad_norm_alone_is_refused_and_the_table_says_what_it_needs():
    with pytest.raises(optpass.OptpassError, match="without them call torch.nn.utils.clip_grad_norm_"):
        optpass.options.Options.from_user({"clip_grad_norm": 1.0})
    assert "it needs optimizer_in_backward, data_parallel, master_weights or grad_scaler" in \
        optpass.options.options_table()


def test_ordinals_and_articles_in_messages():
    assert [f"{n}{_ordinal_suffix(n)}" for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 103)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "103rd"]
    model, opt = mlp_and_adamw()

    def train_step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    text = str(optpass.explain(train_step, *batch(), options={"optimizer": opt}))
    assert "does not apply to an update graph" in text and "a update" not in text
    for line in text.splitlines():
        if "estimated peak memory" in line:     # one unit per line
            assert len({word for word in line.replace(")", " ").split() if word in ("B", "KB", "MB")}) == 1, line


@pytest.mark.parametrize("lower", ["eager", "inductor"])
def test_a_micro_step_with_optimizer_in_backward_is_refused_before_it_updates(lower):
    """Hand-written accumulation: a micro-step (backward, no opt.step()) compiled with the step's
    in-backward options updated the parameters at every call and dropped .grad (AdamW 17% off eager
    after K=3). It is refused before anything runs, with the fix; accumulation_steps does the job."""
    model, opt = mlp_and_adamw()
    before = [p.detach().clone() for p in model.parameters()]

    def micro_step(x, y):
        loss = F.cross_entropy(model(x), y) / 3
        loss.backward()
        return loss.detach()
    options = {"optimizer": opt, "optimizer_in_backward": True, "lower": lower}
    with pytest.raises(optpass.OptpassError, match=r"does not call opt.step\(\).*'accumulation_steps': K") as info:
        torch.compile(micro_step, backend="optpass", options=options)(*batch())
    assert "test_user_programs.py" in str(info.value)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters()) and not opt.state

    # the fix the message gives: the same micro-step with accumulation_steps, against eager
    model_ref = copy.deepcopy(model)
    opt_ref = torch.optim.AdamW(model_ref.parameters(), lr=torch.tensor(1e-2))
    torch._dynamo.reset()
    step = torch.compile(micro_step, backend="optpass", options={**options, "accumulation_steps": 3})
    for i in range(6):
        step(*batch(i))
        loss = F.cross_entropy(model_ref(batch(i)[0]), batch(i)[1]) / 3
        loss.backward()
        if i % 3 == 2:
            opt_ref.step()
            opt_ref.zero_grad()
    for p, q in zip(model.parameters(), model_ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_an_optimizer_whose_step_needs_a_closure_is_refused_for_fused_updates():
    """LBFGS runs backward() itself inside opt.step(closure), outside the step's graph: with
    optimizer_in_backward nothing was fused and nothing said so; explain moved the weights."""
    model = nn.Linear(8, 4)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5)
    before = [p.detach().clone() for p in model.parameters()]

    def train_step(x, y):
        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss
        return opt.step(closure).detach()
    options = {"optimizer": opt, "optimizer_in_backward": True}
    refusal = r"LBFGS.step\(\) needs a closure.*Compile the step without"
    with pytest.raises(optpass.OptpassError, match=refusal):
        optpass.explain(train_step, *batch(), options=options)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))     # explain checks first
    # compiled, the options reach optpass with Dynamo's first graph, inside LBFGS's first evaluation
    with pytest.raises(optpass.OptpassError, match=refusal):
        torch.compile(train_step, backend="optpass", options=options)(*batch())


def step_that_sets_the_lr(model, opt, where):
    def train_step(x, y, lr):
        if where == "before the forward":
            opt.param_groups[0]["lr"].fill_(lr)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if where == "after backward":
            opt.param_groups[0]["lr"].fill_(lr)
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    return train_step


@pytest.mark.parametrize("where,options,refused", [
    ("before the forward", {}, "Dynamo then drops the step's backward"),
    ("before the forward", {"optimizer_in_backward": True}, "Dynamo then drops the step's backward"),
    ("after backward", {"optimizer_in_backward": True}, "would apply one step late"),
    ("after backward", {}, None),
])
def test_a_step_that_writes_the_lr_in_place_trains_as_eager_or_is_refused(where, options, refused):
    """Warm-up written inside the step: before the forward the weights never moved (traced backward
    dropped, any backend); after backward with in-backward the update read the previous lr."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model_ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1))
    opt_ref = torch.optim.SGD(model_ref.parameters(), lr=torch.tensor(0.1))
    step = torch.compile(step_that_sets_the_lr(model, opt, where), backend="optpass",
                         options={"optimizer": opt, "lower": "eager", **options})
    eager = step_that_sets_the_lr(model_ref, opt_ref, where)
    before = [p.detach().clone() for p in model.parameters()]
    if refused is not None:
        with pytest.raises(optpass.OptpassError, match=rf"writes opt.param_groups\[0\]\['lr'\] in place.*{refused}"
                                                       r".*change it outside the compiled step"):
            step(*batch(), torch.tensor(0.05))
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        return
    for i in range(3):
        step(*batch(i), torch.tensor(0.05 * (i + 1)))
        eager(*batch(i), torch.tensor(0.05 * (i + 1)))
    for p, q in zip(model.parameters(), model_ref.parameters()):
        torch.testing.assert_close(p, q)


def test_a_grad_scaler_that_torch_disabled_for_lack_of_cuda_is_refused_with_the_fix():
    """GradScaler("cuda") (the usual line) on a machine without CUDA: torch disables it, and optpass
    trained fp16 unscaled with no inf check. GradScaler(enabled=False) stays a deliberate off switch."""
    if torch.cuda.is_available():
        pytest.skip("torch disables GradScaler('cuda') only where CUDA is not available")
    model = nn.Linear(8, 4).to(torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = torch.amp.GradScaler("cuda")
    with pytest.raises(optpass.OptpassError, match=r"GradScaler\('cpu'\)"):
        optpass.options.Options.from_user({"optimizer": opt, "master_weights": torch.float32, "grad_scaler": scaler})
    off = optpass.options.Options.from_user({"optimizer": opt, "master_weights": torch.float32,
                                             "grad_scaler": torch.amp.GradScaler("cpu", enabled=False)})
    assert off.grad_scaler is None


def test_token_weighted_accumulation_as_the_readme_writes_it_equals_eager():
    """accumulation_steps with a loss summed over tokens and divided by the window's count of real
    (non -100) tokens, given as a 0-d tensor: the update is the gradient of the window's token mean."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
    model_ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2))
    opt_ref = torch.optim.AdamW(model_ref.parameters(), lr=torch.tensor(1e-2))

    def make_micro_step(model):
        def micro_step(x, labels, tokens_in_window):
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                   reduction="sum") / tokens_in_window
            loss.backward()
            return loss.detach()
        return micro_step
    step = torch.compile(make_micro_step(model), backend="optpass", options={
        "optimizer": opt, "optimizer_in_backward": True, "accumulation_steps": 2, "lower": "eager"})
    eager = make_micro_step(model_ref)
    g = torch.Generator().manual_seed(0)
    for window in range(3):
        batches = []
        for _ in range(2):
            x = torch.randint(0, 16, (2, 6), generator=g)
            labels = torch.randint(0, 16, (2, 6), generator=g)
            labels[:, torch.randint(1, 6, (1,), generator=g).item():] = -100     # padding, a different amount each
            batches.append((x, labels))
        tokens_in_window = torch.tensor(sum(int((labels != -100).sum()) for _, labels in batches))
        for x, labels in batches:
            torch.testing.assert_close(step(x, labels, tokens_in_window), eager(x, labels, tokens_in_window))
        opt_ref.step()
        opt_ref.zero_grad()
    for p, q in zip(model.parameters(), model_ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert p.grad is None


@pytest.fixture
def fresh_clearing_checks():
    """Every program below is checked afresh (the check runs once per calling place and warns once per step)."""
    from optpass.runtime import gradient_clearing

    gradient_clearing._WARNED.clear()
    gradient_clearing._CHECKED.clear()
    torch._dynamo.reset()


def _sgd_pair():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _step_never_clearing(model, opt):
    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        out = loss.detach()
        opt.step()
        return out
    return train_step


def _gradients_never_cleared(caught) -> list:
    return [w for w in caught if issubclass(w.category, optpass.GradientsNeverClearedWarning)]


def _train_beside_eager(make_step, loop, steps=4):
    """`loop(step, opt, x, y, i)` runs one iteration of the user's loop; the same loop runs the compiled
    step and the eager one. Returns (warnings of the compiled run, largest parameter difference)."""
    (model, opt), (eager_model, eager_opt) = _sgd_pair(), _sgd_pair()
    step = torch.compile(make_step(model, opt), backend="optpass", options={"optimizer": opt, "optimizer_in_backward": True})
    eager = make_step(eager_model, eager_opt)
    data = [(torch.randn(3, 4, generator=torch.Generator().manual_seed(i)), torch.randn(3, 2)) for i in range(steps)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(data):
            loop(step, opt, x, y, i)
    for i, (x, y) in enumerate(data):
        loop(eager, eager_opt, x, y, i)
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), eager_model.parameters()))
    return _gradients_never_cleared(caught), diff


def test_a_step_that_never_clears_gradients_is_warned_at_its_backward_line(fresh_clearing_checks):
    """Eager adds each step's gradients to the last one's when nothing clears them; optpass's update
    in backward reads the step's own. The two differ from the second step: say so, at the step's line."""
    model, opt = _sgd_pair()
    step = torch.compile(_step_never_clearing(model, opt), backend="optpass",
                         options={"optimizer": opt, "optimizer_in_backward": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(torch.randn(3, 4), torch.randn(3, 2))
        step(torch.randn(3, 4), torch.randn(3, 2))
    [warning] = _gradients_never_cleared(caught)
    message = str(warning.message)
    assert "opt.zero_grad()" in message and "accumulation_steps" in message and "differs from eager" in message
    assert warning.filename == __file__ and "loss.backward()" in open(__file__).readlines()[warning.lineno - 1]


def _clear_in_loop(step, opt, x, y, i):
    opt.zero_grad()
    step(x, y)


def _clear_on_even_steps(step, opt, x, y, i):
    if i % 2 == 0:
        opt.zero_grad()
    step(x, y)


def _clear_through_a_helper(step, opt, x, y, i):
    step(x, y)
    _clear(opt)


def _zero_the_gradients_there_are(step, opt, x, y, i):
    step(x, y)
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.data.zero_()


def _clear(opt):
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("loop, warned", [
    (_clear_in_loop, False),
    (_clear_through_a_helper, False),
    (_clear_on_even_steps, True),
    (_zero_the_gradients_there_are, False),
], ids=["zero_grad_in_the_loop", "zero_grad_in_a_helper", "on_even_steps_only", "zero_if_not_none"])
def test_what_the_loop_around_the_step_clears_on_every_iteration_decides(fresh_clearing_checks, loop, warned):
    got, diff = _train_beside_eager(_step_never_clearing, loop)
    assert bool(got) == warned, [str(w.message) for w in got]
    if not warned:
        assert diff <= 1e-6, diff
    if warned:
        assert diff > 1e-4, diff                         # the wrong result the warning is about


def test_zero_grad_once_before_the_loop_is_not_every_step(fresh_clearing_checks):
    (model, opt), data = _sgd_pair(), [(torch.randn(3, 4), torch.randn(3, 2)) for _ in range(3)]
    step = torch.compile(_step_never_clearing(model, opt), backend="optpass",
                         options={"optimizer": opt, "optimizer_in_backward": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.zero_grad()
        for x, y in data:
            step(x, y)
    assert len(_gradients_never_cleared(caught)) == 1


def test_clearing_part_of_the_model_or_another_optimizer_names_the_parameters_left(fresh_clearing_checks):
    (model, opt), other = _sgd_pair(), torch.nn.Linear(4, 2)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)

    def make(model, opt):
        def train_step(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            out = loss.detach()
            opt.step()
            other_opt.zero_grad()
            model[2].zero_grad()
            return out
        return train_step

    step = torch.compile(make(model, opt), backend="optpass", options={"optimizer": opt, "optimizer_in_backward": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(torch.randn(3, 4), torch.randn(3, 2))
    [warning] = _gradients_never_cleared(caught)
    assert "nothing clears the gradients of 0.bias, 0.weight before every step" in str(warning.message), \
        str(warning.message)


def test_a_step_that_clears_gradients_first_is_not_warned_and_equals_eager(fresh_clearing_checks):
    def make(model, opt):
        def train_step(x, y):
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            out = loss.detach()
            opt.step()
            return out
        return train_step

    got, diff = _train_beside_eager(make, lambda step, opt, x, y, i: step(x, y))
    assert not got and diff <= 1e-6, ([str(w.message) for w in got], diff)
