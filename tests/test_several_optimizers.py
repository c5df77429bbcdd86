"""Several optimizers in one step (modded-nanogpt: Muon for the hidden matrices, AdamW for the rest),
and Muon's update through optpass against eager torch.optim."""

import copy

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
