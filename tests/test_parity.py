"""optpass with no rewriting pass trains exactly like eager PyTorch (20 steps, same seeds)."""

import pytest
import torch

import optpass

from optpass.demo.models import MLP, LMConfig, TinyLM, param_groups_no_decay
from parity import Twin, make_step, mlp_data, mlp_loss, unique_graphs

STEPS = 20
TOL = 1e-6


pytestmark = pytest.mark.usefixtures("float64_default")


def lm_loss(model, x, y):
    return model.loss(x, y)


LM_CFG = LMConfig()


def lm_data(step, dtype=None):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, LM_CFG.vocab, (4, LM_CFG.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def run_twin(twin, loss_fn, data, lower, clip=None, schedulers=None, steps=STEPS):
    eager_step = make_step(twin.eager_model, twin.eager_opt, loss_fn, clip)
    compiled_step = torch.compile(make_step(twin.compiled_model, twin.compiled_opt, loss_fn, clip),
                                  backend="optpass", options={"lower": lower})
    losses = []
    for i in range(steps):
        x, y = data(i, twin.dtype)
        expected = eager_step(x, y)
        got = compiled_step(x, y)
        losses.append((got.item(), expected.item()))
        if schedulers:
            for s in schedulers:
                s.step()
        for p in twin.compiled_model.parameters():
            assert p.grad is None
    for got, expected in losses:
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
    return twin.diffs()


OPTIMIZERS = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    "sgd_nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, nesterov=True),
    "adam_amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_mlp_matches_eager(name):
    twin = Twin(MLP, OPTIMIZERS[name])
    params, state = run_twin(twin, mlp_loss, mlp_data, "eager")
    assert params <= TOL and state <= TOL


def one_layer_lm() -> TinyLM:
    """Dynamo compiles torch.optim's update per parameter: one block keeps the LM cases quick."""
    return TinyLM(LMConfig(n_layers=1))


def test_lm_two_param_groups_with_clip_matches_eager():
    twin = Twin(one_layer_lm, lambda m: torch.optim.AdamW(param_groups_no_decay(m, 0.1), lr=3e-3))
    assert len(twin.eager_opt.param_groups) == 2
    params, state = run_twin(twin, lm_loss, lm_data, "eager", clip=0.5)
    assert params <= TOL and state <= TOL


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_float32_is_bit_identical_to_dynamo_without_optpass(name):
    """No rewriting pass: optpass runs exactly what torch.compile(backend="eager") runs."""
    twin = Twin(MLP, OPTIMIZERS[name], dtype=torch.float32)
    plain_step = torch.compile(make_step(twin.eager_model, twin.eager_opt, mlp_loss), backend="eager")
    optpass_step = torch.compile(make_step(twin.compiled_model, twin.compiled_opt, mlp_loss),
                                 backend="optpass", options={"lower": "eager"})
    for i in range(STEPS):
        x, y = mlp_data(i, torch.float32)
        assert torch.equal(plain_step(x, y), optpass_step(x, y))
    assert twin.diffs() == (0.0, 0.0)


@pytest.mark.parametrize("name,tensor_lr", [("sgd", True), ("adamw", False), ("adamw", True)])
def test_lr_scheduler_changes_lr_without_recompiling_every_step(name, tensor_lr):
    def lr():  # each optimizer its own tensor: schedulers update a tensor lr in place
        return torch.tensor(1e-2) if tensor_lr else 1e-2

    make_opt = {"sgd": lambda m: torch.optim.SGD(m.parameters(), lr=lr(), momentum=0.9),
                "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=lr())}[name]
    twin = Twin(MLP, make_opt)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.9)
                  for o in (twin.eager_opt, twin.compiled_opt)]
    run_twin(twin, mlp_loss, mlp_data, "eager", schedulers=schedulers, steps=5)
    graphs_after_5_steps = unique_graphs()
    params, state = run_twin(twin, mlp_loss, mlp_data, "eager", schedulers=schedulers)
    assert params <= TOL and state <= TOL
    assert float(twin.compiled_opt.param_groups[0]["lr"]) == pytest.approx(1e-2 * 0.9 ** (STEPS + 5))
    # step graph + update graph(s) for the first step (state creation) and the steady state,
    # plus one recompile where Dynamo turns a changed float lr into an input; then no more.
    assert graphs_after_5_steps <= 4
    assert unique_graphs() == graphs_after_5_steps


def test_float_lr_that_recompiles_every_step_is_reported_with_the_fix():
    twin = Twin(MLP, lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9))
    scheduler = torch.optim.lr_scheduler.StepLR(twin.compiled_opt, step_size=1, gamma=0.9)
    step = torch.compile(make_step(twin.compiled_model, twin.compiled_opt, mlp_loss),
                         backend="optpass", options={"lower": "eager"})
    with pytest.warns(optpass.RecompilingUpdateWarning, match=r"lr=torch.tensor\(0.01\)"):
        for i in range(5):
            step(*mlp_data(i))
            scheduler.step()


def test_gradient_accumulation_over_4_micro_steps_matches_eager():
    twin = Twin(MLP, OPTIMIZERS["adamw"])

    def make_micro_step(model):
        def micro_step(x, y):
            loss = mlp_loss(model, x, y) / 4
            loss.backward()
            return loss.detach()
        return micro_step

    def make_update(opt):
        def update():
            opt.step()
            opt.zero_grad()
        return update

    eager_micro, eager_update = make_micro_step(twin.eager_model), make_update(twin.eager_opt)
    micro = torch.compile(make_micro_step(twin.compiled_model), backend="optpass",
                          options={"lower": "eager"})
    update = torch.compile(make_update(twin.compiled_opt), backend="optpass", options={"lower": "eager"})
    for step in range(STEPS // 4 * 4):
        x, y = mlp_data(step)
        eager_micro(x, y)
        micro(x, y)
        if step % 4 == 3:
            eager_update()
            update()
    params, state = twin.diffs()
    assert params <= TOL and state <= TOL
    kinds = [r.kind.value for r in optpass.recent_reports()]
    assert "step" in kinds and "update" in kinds
    accumulating = [r for r in optpass.recent_reports() if r.captured.accumulating]
    assert accumulating, "the micro-steps after the first accumulate into .grad in the graph"


def test_inductor_lowering_matches_eager_mlp_adamw_with_clip():
    twin = Twin(MLP, OPTIMIZERS["adamw"])
    params, state = run_twin(twin, mlp_loss, mlp_data, "inductor", clip=1.0)
    assert params <= TOL and state <= TOL


def test_inductor_lowering_matches_eager_lm():
    twin = Twin(one_layer_lm, lambda m: torch.optim.AdamW(param_groups_no_decay(m, 0.1), lr=3e-3))
    params, state = run_twin(twin, lm_loss, lm_data, "inductor")
    assert params <= TOL and state <= TOL
