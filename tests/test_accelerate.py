"""accelerate on one device (docs/integrations.md): the model and optimizer an ``Accelerator`` prepared,
the step compiled with optpass with the torch optimizer under accelerate's wrapper, trains as the same
loop run eagerly with ``accelerator.backward``."""

from __future__ import annotations

import copy

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from parity import max_rel_diff  # noqa: E402


def test_an_accelerator_prepared_step_compiled_with_optpass_trains_as_the_eager_loop(float64_default):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 6, generator=generator), torch.randn(8, 2, generator=generator)) for _ in range(5)]
    trained = {}
    for compiled in (False, True):
        accelerator = accelerate.Accelerator(cpu=True)
        model = copy.deepcopy(net)
        model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        torch_opt = opt.optimizer                     # AcceleratedOptimizer wraps the torch optimizer

        def step(x, y):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            out = loss.detach()
            torch_opt.step()
            torch_opt.zero_grad()
            return out
        if compiled:
            step = torch.compile(step, backend="optpass", options={"optimizer": torch_opt, "optimizer_in_backward": True,
                                                                   "lower": "eager"})
        for x, y in batches:
            step(x, y)
        trained[compiled] = model
    assert max(max_rel_diff(p, q) for p, q in zip(trained[True].parameters(), trained[False].parameters())) <= 1e-9
    assert all(p.grad is None for p in trained[True].parameters())
