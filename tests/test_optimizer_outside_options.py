"""An optimizer stepped in the step beside the one in options['optimizer'] (a new user's Muon + AdamW
program), and the clip_grad_norm option's norm against eager clip_grad_norm_."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import optpass


class Net(torch.nn.Module):
    """The user's model: Muon for the hidden matrices, AdamW for the embedding, head and a scalar."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.h1 = torch.nn.Linear(16, 16, bias=False)
        self.h2 = torch.nn.Linear(16, 16, bias=False)
        self.head = torch.nn.Linear(16, 32)
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        h = self.emb(x)
        h = h + torch.relu(self.h1(h))
        h = h + self.h2(h) * self.scale
        return self.head(h)


def muon_and_adamw():
    torch.manual_seed(0)
    m = Net()
    muon = torch.optim.Muon([m.h1.weight, m.h2.weight], lr=0.02)
    adamw = torch.optim.AdamW([m.emb.weight, m.head.weight, m.head.bias, m.scale], lr=1e-2)
    return m, muon, adamw


def batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)


def step_of(m, muon, adamw):
    def train_step(x, y):
        loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
        loss.backward()
        out = loss.detach()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
        return out
    return train_step


def test_the_warning_names_the_optimizer_left_out_and_the_users_function(monkeypatch):
    """Muon in options, AdamW stepped beside it: the warning names AdamW (the one left out, whose
    parameters and line it quotes), Muon as what options holds, and train_step, not Dynamo's
    torch_dynamo_resume_in_train_step_at_N."""
    monkeypatch.setattr(optpass.legality, "_WARNED_UNLISTED", set())
    m, muon, adamw = muon_and_adamw()
    step = torch.compile(step_of(m, muon, adamw), backend="optpass",
                         options={"optimizer": muon, "optimizer_in_backward": True, "lower": "eager"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(*batch(0))
    found = [str(w.message) for w in caught if "not in options['optimizer']" in str(w.message)]
    assert len(found) == 1, [str(w.message) for w in caught]
    assert found[0].startswith("optpass: AdamW at ") and " in train_step: adamw.step(), " in found[0], found[0]
    assert "(which holds Muon), steps parameter(s) emb.weight, head.weight, head.bias ..." in found[0]
    assert "torch_dynamo_resume" not in found[0]


def test_clip_grad_norm_with_an_optimizer_left_out_is_refused_with_the_fix():
    """Measured before the refusal: the norm covered Muon's gradients only (0.67 vs eager's 1.19) and
    AdamW's went unclipped, 1.7e-2 from eager after 6 steps."""
    m, muon, adamw = muon_and_adamw()
    step = torch.compile(step_of(m, muon, adamw), backend="optpass", options={
        "optimizer": muon, "optimizer_in_backward": True, "clip_grad_norm": 0.5, "lower": "eager"})
    with pytest.raises(optpass.OptpassError, match=r"clip_grad_norm: AdamW at .* in train_step: adamw\.step\(\), an "
                       r"optimizer that is not in options\['optimizer'\] \(which holds Muon\).*would go unclipped.*"
                       r"List both optimizers: options=\{'optimizer': \[opt, other_opt\], 'clip_grad_norm'"):
        step(*batch(0))


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32, bias=False),
                               torch.nn.ReLU(), torch.nn.Linear(32, 4))


def sgd_and_adamw(model):
    params = list(model.parameters())
    return [torch.optim.SGD(params[2:3], lr=0.05, momentum=0.9), torch.optim.AdamW(params[:2] + params[3:], lr=0.01)]


@pytest.mark.parametrize("seed", range(8))
def test_the_clip_norm_and_the_clipped_gradient_equal_eager_clip_grad_norm_bitwise(seed):
    """lower='eager', fp32, a list [SGD, AdamW] in backward: the norm is clip_grad_norm_'s over the
    optimizers' parameters in their order, computed with its own ops (each gradient's norm, then the
    norm of those stacked), so it rounds as eager's; SGD's first momentum buffer (the clipped
    gradient) is eager's bit for bit. Before: the norm was a sum of squares, 1 ulp off."""
    eager_model = mlp()
    model = copy.deepcopy(eager_model)
    eager_opts, opts = sgd_and_adamw(eager_model), sgd_and_adamw(model)
    x, y = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed)), torch.randn(8, 4)
    F.mse_loss(eager_model(x), y).backward()
    eager_norm = torch.nn.utils.clip_grad_norm_(
        [p for opt in eager_opts for group in opt.param_groups for p in group["params"]], 0.05)
    for opt in eager_opts:
        opt.step()

    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        out = loss.detach()
        opts[0].step()
        opts[1].step()
        opts[0].zero_grad()
        opts[1].zero_grad()
        return out
    step = torch.compile(train_step, backend="optpass", options={
        "optimizer": opts, "optimizer_in_backward": True, "clip_grad_norm": 0.05, "lower": "eager"})
    step(x, y)
    assert eager_norm > 0.05                                       # it clips
    assert torch.equal(optpass.grad_norm(opts[0]), eager_norm), (optpass.grad_norm(opts[0]), eager_norm)
    buffer, eager_buffer = (o.state[o.param_groups[0]["params"][0]]["momentum_buffer"] for o in (opts[0], eager_opts[0]))
    assert torch.equal(buffer, eager_buffer)
