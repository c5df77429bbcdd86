"""Several optimizers in one step (modded-nanogpt: Muon for the hidden matrices, AdamW for the rest),
and Muon's update through optpass against eager torch.optim."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import optpass


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32, bias=False),
                               torch.nn.ReLU(), torch.nn.Linear(32, 4))


def hidden_and_rest(model):
    """modded-nanogpt's split: Muon for the 2-D hidden matrices, AdamW for the rest."""
    hidden = [model[2].weight]
    return hidden, [p for p in model.parameters() if p is not model[2].weight]


def batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def make_step(model, *optimizers):
    """The supported step shape with each optimizer stepped on its own line (a `for` loop over the
    optimizers graph-breaks inside the loop, and Dynamo runs the whole step eagerly)."""
    first, *others = optimizers

    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        out = loss.detach()
        first.step()
        if others:
            others[0].step()
        first.zero_grad()
        if others:
            others[0].zero_grad()
        return out
    return train_step


def rel(a, b):
    return ((a.detach().double() - b.detach().double()).abs().max() / b.detach().double().abs().max()).item()


# ------------------------------------------------------------------ Muon with a float lr (item 3)

def test_muon_with_a_float_lr_in_backward_equals_eager_muon():
    """torch.optim.Muon(params, lr=0.02): optpass reads lr as a tensor input, and Dynamo traces
    `param.add_(update, alpha=-lr)` with a tensor alpha as an fma whose product rounds in the update's
    dtype, bf16 for Muon (8e-5 from eager after one step, 2.5e-3 after two on this model). The float's
    rounding is kept (optim/float_lr.py): the fused update equals eager Muon bitwise."""
    torch.manual_seed(0)
    eager_model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.ReLU(),
                                      torch.nn.Linear(32, 4, bias=False))
    model = copy.deepcopy(eager_model)
    eager_opt = torch.optim.Muon(eager_model.parameters(), lr=0.02, momentum=0.95, weight_decay=0.1)
    opt = torch.optim.Muon(model.parameters(), lr=0.02, momentum=0.95, weight_decay=0.1)
    eager = make_step(eager_model, eager_opt)
    step = torch.compile(make_step(model, opt), backend="optpass",
                         options={"optimizer": opt, "optimizer_in_backward": True, "lower": "eager"})
    for i in range(4):
        eager(*batch(i))
        step(*batch(i))
        assert all(p.grad is None for p in model.parameters())       # fused: updated inside backward
        for p, q in zip(model.parameters(), eager_model.parameters()):
            assert torch.equal(p, q), (i, rel(p, q))
        for p, q in zip(model.parameters(), eager_model.parameters()):
            assert torch.equal(opt.state[p]["momentum_buffer"], eager_opt.state[q]["momentum_buffer"])


# ------------------------------------------------------------------ a list of optimizers (item 4)

def several(model, muon=True):
    hidden, rest = hidden_and_rest(model)
    first = (torch.optim.Muon(hidden, lr=0.02, momentum=0.95) if muon
             else torch.optim.SGD(hidden, lr=0.05, momentum=0.9))
    return first, torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.1)


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("muon", [True, False], ids=["muon_adamw", "sgd_adamw"])
def test_a_list_of_optimizers_is_fused_in_backward_and_equals_eager(muon):
    """modded-nanogpt's step: Muon over the hidden matrix, AdamW over the rest, both stepped in the
    step. options={'optimizer': [muon, adamw]}: every update runs inside backward (no gradient after
    the step, no update graph with gradients), each harvested from its own optimizer, and the run
    equals eager over 5 steps (float64: AdamW's compiled bias corrections round like eager's)."""
    eager_model = mlp()
    model = copy.deepcopy(eager_model)
    eager_opts, opts = several(eager_model, muon), several(model, muon)
    eager = make_step(eager_model, *eager_opts)
    step = torch.compile(make_step(model, *opts), backend="optpass",
                         options={"optimizer": list(opts), "optimizer_in_backward": True, "lower": "eager"})
    optpass.report.clear_reports()
    for i in range(5):
        eager(*batch(i))
        step(*batch(i))
        assert all(p.grad is None for p in model.parameters())
        for p, q in zip(model.parameters(), eager_model.parameters()):
            assert rel(p, q) <= 1e-9, (i, rel(p, q))
    for opt, eager_opt in zip(opts, eager_opts):
        for p, q in zip(model.parameters(), eager_model.parameters()):
            assert (p in opt.state) == (q in eager_opt.state)
            for key, value in opt.state.get(p, {}).items():
                assert rel(value, eager_opt.state[q][key]) <= 1e-9, key
    kinds = [(r.kind, [p.name for p in r.passes if p.status == "applied"]) for r in optpass.recent_reports()]
    assert ("step", ["optimizer_in_backward"]) in [(k.value, a[:1]) for k, a in kinds]
    assert all(k.value != "update" for k, _ in kinds)       # opt.step() of either optimizer does nothing




@pytest.mark.usefixtures("float64_default")
def test_a_list_of_optimizers_with_the_clip_grad_norm_option_equals_eager_clipping():
    """clip_grad_norm over the parameters of every listed optimizer: the global norm of all of them,
    as clip_grad_norm_(model.parameters()) in the eager step; optpass.grad_norm of either optimizer
    (or of the list) is that step's norm, what clip_grad_norm_ returns."""
    eager_model = mlp()
    model = copy.deepcopy(eager_model)
    eager_opts, opts = several(eager_model, muon=False), several(model, muon=False)
    first, second = eager_opts

    def eager(x, y):
        loss = F.mse_loss(eager_model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(eager_model.parameters(), 0.1)
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
        return norm

    step = torch.compile(make_step(model, *opts), backend="optpass", options={
        "optimizer": list(opts), "optimizer_in_backward": True, "clip_grad_norm": 0.1, "lower": "eager"})
    for i in range(4):
        eager_norm = eager(*batch(i))
        step(*batch(i))
        assert eager_norm > 0.1                    # every step clips
        for norm in (optpass.grad_norm(opts[0]), optpass.grad_norm(opts[1]), optpass.grad_norm(list(opts))):
            assert rel(norm, eager_norm) <= 1e-12, (i, norm, eager_norm)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert rel(p, q) <= 1e-12

def test_an_optimizer_stepped_in_the_step_but_not_in_options_is_warned_with_its_line():
    """AdamW in options, Muon stepped beside it: optpass fuses AdamW's update and leaves Muon's
    after backward as written (the result equals eager), and says so once, with the line and the fix."""
    eager_model = mlp()
    model = copy.deepcopy(eager_model)
    eager_opts, opts = several(eager_model), several(model)
    eager = make_step(eager_model, *eager_opts)
    step = torch.compile(make_step(model, *opts), backend="optpass",
                         options={"optimizer": opts[1], "optimizer_in_backward": True, "lower": "eager"})
    with pytest.warns(UserWarning) as caught:
        for i in range(3):
            eager(*batch(i))
            step(*batch(i))
    messages = [str(w.message) for w in caught if "not in options['optimizer']" in str(w.message)]
    assert len(messages) == 1, messages
    assert "optpass: Muon at " in messages[0] and " in train_step: first.step(), an optimizer" in messages[0]
    assert "(which holds AdamW), steps parameter(s) 2.weight:" in messages[0] and "Put it in the list" in messages[0]
    assert caught[[str(w.message) for w in caught].index(messages[0])].filename == __file__
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert rel(p, q) <= 1e-5


def _stepped_in_a_loop(model, optimizers):
    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        out = loss.detach()
        for opt in optimizers:            # the loop the warning names
            opt.step()
        for opt in optimizers:
            opt.zero_grad()
        return out
    return train_step


LOOP_LINE = _stepped_in_a_loop.__code__.co_firstlineno + 5


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("options", [{}, {"optimizer_in_backward": True}], ids=["plain", "in_backward"])
def test_optimizers_stepped_in_a_loop_are_warned_at_the_loop_with_the_fix(options, monkeypatch):
    """modded-nanogpt's `for opt in optimizers: opt.step()`: torch.optim's step() breaks the graph inside
    the loop, and Dynamo runs the whole step uncompiled (backward from eager autograd, nothing fused).
    Warned once, at the loop's line, as a BackwardOutsideGraphWarning; the run equals eager (it is)."""
    monkeypatch.setattr(optpass.capture, "_WARNED_LOOPS", set())     # once per loop and process
    eager_model = mlp()
    model = copy.deepcopy(eager_model)
    eager_opts, opts = several(eager_model, muon=False), several(model, muon=False)
    eager = _stepped_in_a_loop(eager_model, eager_opts)
    given = {"optimizer": list(opts), **options} if options else {}
    step = torch.compile(_stepped_in_a_loop(model, opts), backend="optpass", options={**given, "lower": "eager"})
    with pytest.warns(UserWarning) as caught:
        for i in range(3):
            eager(*batch(i))
            step(*batch(i))
    found = [w for w in caught if issubclass(w.category, optpass.OptimizerStepInLoopWarning)]
    assert len(found) == 1, [str(w.message) for w in caught]
    assert issubclass(found[0].category, optpass.BackwardOutsideGraphWarning)
    assert (found[0].filename, found[0].lineno) == (__file__, LOOP_LINE)
    message = str(found[0].message)
    assert "inside a loop, at" in message and "opt.step()" in message and "(the loop: `for opt in optimizers:" in message
    assert "step each optimizer on its own line" in message and "options={'optimizer': [opt_a, opt_b]" in message
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert rel(p, q) <= 1e-12


def test_optimizers_stepped_on_their_own_lines_are_not_warned_of_a_loop():
    """The fix: each step() on its own line (the training loop around the compiled step is no loop
    of the step's)."""
    model = mlp()
    opts = several(model, muon=False)
    step = torch.compile(make_step(model, *opts), backend="optpass", options={"lower": "eager"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            step(*batch(i))
    assert not [w for w in caught if issubclass(w.category, optpass.BackwardOutsideGraphWarning)], \
        [str(w.message) for w in caught]


@pytest.mark.parametrize("optimizers, message", [
    ("two_sharing", r"a parameter of shape \[32, 32\] is in optimizer 0 \(Muon\) and in optimizer 1 \(AdamW\)"),
    ("not_an_optimizer", r"element 1 of the list is a Parameter, not a torch.optim.Optimizer"),
    ("empty", r"is an empty list"),
])
def test_a_list_that_is_not_one_optimizer_per_parameter_is_an_error(optimizers, message):
    model = mlp()
    hidden, _ = hidden_and_rest(model)
    given = {"two_sharing": lambda: [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(model.parameters())],
             "not_an_optimizer": lambda: [torch.optim.AdamW(model.parameters()), hidden[0]],
             "empty": lambda: []}[optimizers]()
    with pytest.raises(optpass.OptpassError, match=message):
        optpass.options.Options.from_user({"optimizer": given, "optimizer_in_backward": True})

# ------------------------------------------------------------------ data parallel (items 1 and 4)

PROGRAMS = ["fsdp_muon_beside_adamw", "fsdp_sgd_beside_adamw", "zero1_muon_beside_adamw",
            "fsdp_list_of_sgd_and_adamw", "fsdp_list_of_sgd_and_adamw_in_backward", "fsdp_list_of_muon_and_adamw",
            "zero1_list_of_sgd_and_adamw", "zero1_list_of_sgd_and_adamw_in_backward", "zero1_list_of_muon_and_adamw",
            "zero1_list_with_clip_grad_norm", "zero1_list_stepped_in_a_loop", "zero1_list_checkpoint_resumes"]


@pytest.fixture(scope="module")
def two_ranks():
    import several_optimizers_workers as workers
    from distributed import run_ranks, values

    return values(run_ranks(2, workers.run_all, PROGRAMS, timeout_s=600, pg_timeout_s=120))


def _errors(results, name):
    found = [r[name].get("error") for r in results]
    assert all(found), [r[name] for r in results]
    return [(kind, message) for kind, message, _ in found]


@pytest.mark.parametrize("name, message", [
    # Muon's Newton-Schulz ran on each rank's rows: parameters 10-20% from one process after 4-5 steps
    ("fsdp_muon_beside_adamw", r"data_parallel='fsdp': Muon at .*several_optimizers_workers\.py:\d+ in train_step: "
                               r"first\.step\(\), an optimizer that is not in options\['optimizer'\] \(which holds "
                               r"AdamW\), steps parameter\(s\) 2\.weight: .*Put it in the list"),
    ("fsdp_sgd_beside_adamw", r"an optimizer that is not in options\['optimizer'\].*Put it in the list"),
    ("zero1_muon_beside_adamw", r"data_parallel='zero1': parameter\(s\) .*2\.weight get gradients in this step "
                                r"but are not in the optimizer.*Muon beside AdamW"),
    ("fsdp_list_of_muon_and_adamw", r"data_parallel='fsdp': Muon's update is not elementwise: it computes .*mm"),
    ("zero1_list_stepped_in_a_loop", r"data_parallel='zero1' refused: the compiled step calls an optimizer's step\(\) "
                                     r"inside a loop, at .*several_optimizers_workers\.py:\d+ in train_step: opt\.step\(\) "
                                     r"\(the loop: `for opt in opts:`.*on its own line.*drift apart"),
    ("zero1_list_of_muon_and_adamw", r"data_parallel='zero1': Muon's update is not elementwise: it computes .*mm"),
])
def test_an_optimizer_optpass_does_not_shard_is_refused_on_every_rank(two_ranks, name, message):
    import re

    for kind, text in _errors(two_ranks, name):
        assert kind == "OptpassError" and re.search(message, text, re.S), text


@pytest.mark.parametrize("name", ["fsdp_list_of_sgd_and_adamw", "fsdp_list_of_sgd_and_adamw_in_backward",
                                  "zero1_list_of_sgd_and_adamw", "zero1_list_of_sgd_and_adamw_in_backward"])
def test_a_list_of_elementwise_optimizers_data_parallel_trains_as_one_process(two_ranks, name):
    for result in two_ranks:
        assert "error" not in result[name], result[name]["error"][2]
        assert result[name]["vs_one_process"] <= 1e-9, result[name]


def test_zero1_shards_the_state_of_each_listed_optimizer(two_ranks):
    """SGD's momentum and AdamW's moments each split over the 2 ranks: every rank holds state of
    both classes, less than one process's, and the ranks' pieces add up to one process's state."""
    results = [r["zero1_list_of_sgd_and_adamw"] for r in two_ranks]
    reference = results[0]["reference_state"]
    for result in results:
        assert set(result["state_elements"]) == {"SGD", "AdamW"}, result
        assert 0 < sum(result["state_elements"].values()) < reference, result
        assert result["unsharded_state"] == 0
    assert sum(sum(r["state_elements"].values()) for r in results) == reference


def test_zero1_with_a_list_and_clip_grad_norm_gives_each_optimizer_the_global_norm(two_ranks):
    for result in two_ranks:
        found = result["zero1_list_with_clip_grad_norm"]
        assert "error" not in found, found["error"][2]
        assert found["vs_one_process"] <= 1e-9, found
        for expected, first, second in found["norms"]:
            assert expected > 0.05                      # every step clips
            assert abs(first - expected) <= 1e-12 * expected and first == second, found["norms"]


def test_a_zero1_list_saved_and_loaded_resumes_as_if_uninterrupted(two_ranks):
    for result in two_ranks:
        got = result["zero1_list_checkpoint_resumes"]
        assert "error" not in got, got["error"]
        assert got["resumed_vs_uninterrupted"] == 0.0, got
        assert "a list of optimizers with a fully sharded model is not supported" in got["fsdp_list"], got
