"""Sizes that change between steps (sequence length, a smaller last batch) under every fused rewrite.

Dynamo recompiles a step once with the changing size symbolic (automatic dynamic) and
hands the backend a graph with SymInt inputs; optpass must compile the fused graph from
those symbolic inputs, not from the tensors of one call (docs/design.md §7).
"""

import pytest
import torch

import optpass
from optpass.capture import GraphKind
from optpass.demo.models import LMConfig, TinyLM
from parity import Twin, make_step, unique_graphs

pytestmark = pytest.mark.usefixtures("float64_default")

TOL = 1e-6
# (batch, sequence length) per step: the length changes every step, the last batch is smaller
SHAPES = [(4, 8), (4, 12), (3, 9), (2, 7)]


def lm_loss(model, x, y):
    return model.loss(x, y)


def lm_batch(step, batch, length):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 64, (batch, length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train_with_changing_shapes(twin, shapes=SHAPES, lower="eager", mark_dynamic=False, **options):
    eager = make_step(twin.eager_model, twin.eager_opt, lm_loss)
    step = torch.compile(make_step(twin.compiled_model, twin.compiled_opt, lm_loss), backend="optpass",
                         options={"lower": lower, "optimizer": twin.compiled_opt,
                                  "optimizer_in_backward": True, **options})
    for i, (batch, length) in enumerate(shapes):
        x, y = lm_batch(i, batch, length)
        if mark_dynamic:
            for t in (x, y):
                torch._dynamo.mark_dynamic(t, 0)
                torch._dynamo.mark_dynamic(t, 1)
        expected, got = eager(x, y), step(x, y)
        assert got.item() == pytest.approx(expected.item(), rel=1e-9), (i, batch, length)
        assert all(p.grad is None for p in twin.compiled_model.parameters())
    return twin.diffs()


def step_compiles() -> int:
    return sum(r.kind is GraphKind.STEP for r in optpass.recent_reports())


@pytest.mark.parametrize("mark_dynamic", [False, True], ids=["automatic-dynamic", "mark_dynamic"])
def test_sequence_length_and_batch_change_every_step(mark_dynamic):
    twin = Twin(lambda: TinyLM(LMConfig(n_layers=1)), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    optpass.report.clear_reports()
    params, state = train_with_changing_shapes(twin, mark_dynamic=mark_dynamic)
    assert params <= TOL and state <= TOL
    # automatic dynamic: a static compile, then one with the length symbolic, then one with the
    # batch symbolic too (the smaller last batch); mark_dynamic: one symbolic compile for all
    assert step_compiles() == (1 if mark_dynamic else 3)


def test_sgd_momentum_first_and_steady_graphs_stay_symbolic():
    twin = Twin(lambda: TinyLM(LMConfig(n_layers=1)), lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9))
    optpass.report.clear_reports()
    params, state = train_with_changing_shapes(twin, mark_dynamic=True)
    assert params <= TOL and state <= TOL
    assert step_compiles() == 2           # the first update (creates the buffers), then the steady one
    graphs = unique_graphs()
    train_with_changing_shapes(twin, shapes=[(4, 6), (3, 3)], mark_dynamic=True)
    assert unique_graphs() == graphs


def test_clip_grad_norm_with_changing_lengths():
    twin = Twin(lambda: TinyLM(LMConfig(n_layers=1)), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    eager = make_step(twin.eager_model, twin.eager_opt, lm_loss, clip=0.1)
    step = torch.compile(make_step(twin.compiled_model, twin.compiled_opt, lm_loss), backend="optpass",
                         options={"lower": "eager", "optimizer": twin.compiled_opt,
                                  "optimizer_in_backward": True, "clip_grad_norm": 0.1})
    for i, (batch, length) in enumerate(SHAPES):
        x, y = lm_batch(i, batch, length)
        for t in (x, y):                     # one symbolic compile (the suite's time)
            torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(t, 1)
        eager(x, y)
        step(x, y)
    params, state = twin.diffs()
    assert params <= TOL and state <= TOL


def test_inductor_lowering_with_changing_lengths():
    twin = Twin(lambda: TinyLM(LMConfig(n_layers=1)), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    params, state = train_with_changing_shapes(twin, shapes=SHAPES[:3], lower="inductor", mark_dynamic=True)
    assert params <= TOL and state <= TOL


@pytest.mark.parametrize("lr", [1e-2, "tensor"])
def test_compiled_with_dynamic_true(lr):
    """torch.compile(..., dynamic=True): its config reached optpass's trace of torch.optim's step,
    which made every float of a param group symbolic; Adam reads betas with .item() and the first
    step raised DataDependentOutputException (found by a fresh-user check)."""
    twin = Twin(lambda: TinyLM(LMConfig(n_layers=1)),
                lambda m: torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-2) if lr == "tensor" else lr))
    eager = make_step(twin.eager_model, twin.eager_opt, lm_loss)
    step = torch.compile(make_step(twin.compiled_model, twin.compiled_opt, lm_loss), backend="optpass",
                         dynamic=True, options={"lower": "eager", "optimizer": twin.compiled_opt,
                                                "optimizer_in_backward": True})
    for i, (batch, length) in enumerate(SHAPES[:3]):
        x, y = lm_batch(i, batch, length)
        assert step(x, y).item() == pytest.approx(eager(x, y).item(), rel=1e-9)
    params, state = twin.diffs()
    assert params <= TOL and state <= TOL


def test_gradient_accumulation_with_changing_lengths():
    """accumulation_steps=2: the accumulating graph and the fused one both see every length."""
    K = 2
    twin = Twin(lambda: TinyLM(LMConfig(n_layers=1)), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))

    def make_micro_step(model):
        def micro_step(x, y):
            loss = model.loss(x, y) / K
            loss.backward()
            return loss.detach()
        return micro_step

    eager = make_micro_step(twin.eager_model)
    micro = torch.compile(make_micro_step(twin.compiled_model), backend="optpass",
                          options={"lower": "eager", "optimizer": twin.compiled_opt,
                                   "optimizer_in_backward": True, "accumulation_steps": K})
    optpass.report.clear_reports()
    shapes = SHAPES + [(3, 5), (2, 11)]
    for i, (batch, length) in enumerate(shapes):
        x, y = lm_batch(i, batch, length)
        for t in (x, y):
            torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(t, 1)
        assert micro(x, y).item() == pytest.approx(eager(x, y).item(), rel=1e-9)
        if (i + 1) % K == 0:
            twin.eager_opt.step()
            twin.eager_opt.zero_grad()
            assert all(p.grad is None for p in twin.compiled_model.parameters())
            params, state = twin.diffs()
            assert params <= TOL and state <= TOL, i
    # the micro-step with no .grad yet, the one accumulating into .grad, the fused K-th: each
    # compiled once, with the sizes symbolic, for every shape
    assert step_compiles() == 3
