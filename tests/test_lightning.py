"""The Lightning recipe of docs/integrations.md: a LightningModule with manual optimization whose
training_step calls a step compiled with optpass (the update in backward) trains as the same module
with the step run eagerly, Lightning's step count and LR scheduler included."""

from __future__ import annotations

import copy

import pytest
import torch

lightning = pytest.importorskip("lightning")

from parity import max_rel_diff  # noqa: E402


class Regressor(lightning.LightningModule):
    """A small MLP regressor; ``compiled``: its step compiled with optpass (the recipe), else eager."""

    def __init__(self, net: torch.nn.Module, compiled: bool):
        super().__init__()
        self.net, self.compiled = net, compiled
        self.automatic_optimization = False
        self._step = None

    def loss(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 4)}

    def _make_step(self):
        opt = self.optimizers().optimizer                   # the torch optimizer under Lightning's wrapper

        def step(batch):
            loss = self.loss(batch)
            loss.backward()
            out = loss.detach()
            opt.step()
            opt.zero_grad()
            return out
        if not self.compiled:
            return step
        return torch.compile(step, backend="optpass", options={"optimizer": opt, "optimizer_in_backward": True,
                                                               "lower": "eager"})

    def training_step(self, batch, batch_idx):
        if self._step is None:
            self._step = self._make_step()
        loss = self._step(batch)
        self.optimizers().step()        # Lightning counts its steps here; no gradient is left: nothing to update
        self.lr_schedulers().step()
        return loss


def _data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(48, 6, generator=generator, dtype=torch.float64)
    y = torch.randn(48, 2, generator=generator, dtype=torch.float64)
    return torch.utils.data.DataLoader(list(zip(x, y)), batch_size=8)


def test_a_lightning_module_with_its_step_compiled_by_optpass_trains_as_eager():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    modules = {compiled: Regressor(copy.deepcopy(net), compiled) for compiled in (False, True)}
    steps = {}
    for compiled, module in modules.items():
        trainer = lightning.Trainer(max_epochs=2, accelerator="cpu", devices=1, precision="64-true", logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, _data())
        steps[compiled] = trainer.global_step
    assert steps[True] == steps[False] == 12
    eager, compiled = modules[False], modules[True]
    assert max(max_rel_diff(p, q) for p, q in zip(compiled.net.parameters(), eager.net.parameters())) <= 1e-9
    assert compiled.optimizers().optimizer.param_groups[0]["lr"] == eager.optimizers().optimizer.param_groups[0]["lr"]
    assert all(p.grad is None for p in compiled.net.parameters())
