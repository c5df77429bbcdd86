"""bitsandbytes' optimizers are refused with the reason and what works instead (their step cannot be
compiled by AOTAutograd at all: optim/bitsandbytes_refusal.py), and the way out the message names,
the bitsandbytes step called outside the compiled function, trains as eager does."""

from __future__ import annotations

import inspect

import pytest
import torch

import optpass
import low_bit_workers
from low_bit_workers import training_step

bnb = pytest.importorskip("bitsandbytes")


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 256, generator=g), torch.randint(0, 64, (32,), generator=g)) for _ in range(n)]


_LINES, _FIRST = inspect.getsourcelines(training_step)
STEP_LINE = _FIRST + next(i for i, line in enumerate(_LINES) if "opt.step()" in line)   # in the step's own file


@pytest.mark.parametrize("options", [{}, {"optimizer_in_backward": True}], ids=["plain", "optimizer_in_backward"])
@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW"])
def test_a_bitsandbytes_optimizer_is_refused_naming_the_step_line_and_torchao(name, options):
    model = mlp()
    opt = getattr(bnb.optim, name)(model.parameters(), lr=1e-3)
    if options:
        options = {**options, "optimizer": opt}
    step = torch.compile(training_step(model, opt), backend="optpass", options=options)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batches(1)[0]
    with pytest.raises(optpass.OptpassError) as refused:
        step(x, y)
    message = str(refused.value)
    assert f"bitsandbytes' {name if options else 'optimizer'}" in message
    assert f"{low_bit_workers.__file__}:{STEP_LINE} in step" in message
    assert "cannot mutate tensors with frozen storage" in message
    assert "torchao.optim.AdamW8bit" in message
    # refused before anything ran: no parameter moved
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_the_bitsandbytes_step_outside_the_compiled_function_trains_as_eager():
    """The message's other way out: optpass compiles forward and backward, bitsandbytes steps."""
    runs = []
    for backend in (None, "optpass"):
        model = mlp()
        opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)

        def forward_backward(x, y):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss.detach()
        run = torch.compile(forward_backward, backend=backend) if backend else forward_backward
        losses = []
        for x, y in batches(6):
            losses.append(run(x, y))
            opt.step()
            opt.zero_grad()
        runs.append((model, losses))
    (eager, eager_losses), (compiled, compiled_losses) = runs
    assert torch.allclose(torch.stack(eager_losses), torch.stack(compiled_losses), atol=1e-6)
    assert opt.state[compiled[0].weight]["state1"].dtype == torch.uint8      # bitsandbytes' 8-bit moments
    for p, q in zip(eager.parameters(), compiled.parameters()):
        assert (p - q).abs().max().item() <= 5e-5       # compiled gradients round otherwise; 8-bit codes follow
