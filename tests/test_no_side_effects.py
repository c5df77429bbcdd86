"""Importing optpass, or compiling with it, changes no other compile (optpass/dynamo_scope.py).

Each program runs in a fresh interpreter, once with optpass imported and once without: what Dynamo
does with another backend's step (where it breaks the graph, what it trains) must be the same. The
2-rank programs (torch's FSDP2 and DDP beside optpass) are in tests/test_user_programs_distributed.py.
"""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import optpass
from parity import make_step, mlp_loss
from test_backend import run_python

# A step with a logging call in the model and a backward(); prints Dynamo's graph-break reasons and
# the parameters after 3 SGD steps.
OTHER_BACKENDS_STEP = """
import json, logging, sys, torch, torch.nn as nn, torch.nn.functional as F
if sys.argv[1] == "import":
    import optpass
log = logging.getLogger("user_model")

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 2)
    def forward(self, x):
        log.warning("forward")
        return self.b(torch.tanh(self.a(x)))

torch.manual_seed(0)
model = Model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def train_step(x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    out = loss.detach()
    opt.step()
    opt.zero_grad()
    return out

step = torch.compile(train_step, backend=sys.argv[2])
g = torch.Generator().manual_seed(1)
for _ in range(3):
    step(torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g))
from torch._dynamo.utils import counters
print(json.dumps({"breaks": sorted(counters["graph_break"]), "params": [p.tolist() for p in model.parameters()]}))
"""


def test_another_backends_compile_is_the_same_with_optpass_imported():
    """Its backward() and its logging call break the graph as they do without optpass (no traced
    backward, no skipped logging), and it trains to the same parameters. backend="eager": what
    Dynamo traces does not depend on the backend (Inductor is left out for the suite's time)."""
    backend = "eager"
    runs = {}
    for imported in ("import", "no-import"):
        out = run_python(OTHER_BACKENDS_STEP.replace("sys.argv[1]", repr(imported)).replace("sys.argv[2]", repr(backend)))
        runs[imported] = json.loads(out.strip().splitlines()[-1])
    assert runs["import"] == runs["no-import"]
    assert any("backward" in reason for reason in runs["import"]["breaks"]), runs["import"]["breaks"]
    assert any("logging" in reason.lower() for reason in runs["import"]["breaks"]), runs["import"]["breaks"]


def test_dynamo_settings_read_as_torchs_outside_an_optpass_compile():
    assert not torch._dynamo.config.trace_autograd_ops
    assert logging.Logger.warning not in torch._dynamo.config.ignore_logging_functions


class _BreakInTheHead(nn.Linear):
    def forward(self, x):
        torch._dynamo.graph_break()
        return super().forward(x)


def _model_broken_in_its_head():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 16), nn.Tanh(), _BreakInTheHead(16, 5))


def _step_computing_the_loss_itself(model, opt):
    """The loss computed in the step's frame: after the model's break that frame's graph holds the
    loss, and ends at backward()."""
    def train_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    return train_step


def _step_with_a_loss_helper(model, opt):
    """The loss computed in a helper (tests/parity.py): the step's frame after the break holds nothing
    before backward(), so no graph ends there; optpass learns of it at the next graph."""
    return make_step(model, opt, mlp_loss)


STEPS = {"loss in the step": (_step_computing_the_loss_itself, "test_no_side_effects.py"),
         "loss in a helper": (_step_with_a_loss_helper, "parity.py")}


@pytest.mark.parametrize("shape", sorted(STEPS))
def test_a_graph_break_in_the_model_trains_as_eager_and_is_warned(shape):
    """The step's frame after the break holds no parameter: Dynamo 2.13 would turn its traced
    backward() into nothing (no gradient, the model never trains); optpass lets backward run eagerly
    and says why it cannot rewrite it, at the backward() line."""
    make, step_file = STEPS[shape]
    torch._dynamo.reset()
    model = _model_broken_in_its_head()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    step = torch.compile(make(model, opt), backend="optpass", options={"lower": "eager"})
    g = torch.Generator().manual_seed(2)
    with pytest.warns(optpass.BackwardOutsideGraphWarning, match="a graph break inside it") as record:
        for _ in range(3):
            x, y = torch.randn(4, 7, generator=g), torch.randn(4, 5, generator=g)
            step(x, y)
            make(reference, reference_opt)(x, y)
    ours = [str(w.message) for w in record if issubclass(w.category, optpass.BackwardOutsideGraphWarning)]
    assert f"{step_file}:" in ours[0] and "loss.backward()" in ours[0], ours
    assert max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters())) <= 1e-6
    assert any((a - b).abs().max() > 0 for a, b in zip(model.parameters(), _model_broken_in_its_head().parameters()))


@pytest.mark.parametrize("shape", sorted(STEPS))
def test_a_graph_break_in_the_model_refuses_a_whole_step_rewrite_naming_it(shape):
    make, step_file = STEPS[shape]
    torch._dynamo.reset()
    model = _model_broken_in_its_head()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = torch.compile(make(model, opt), backend="optpass",
                         options={"optimizer": opt, "optimizer_in_backward": True, "lower": "eager"})
    with pytest.raises(optpass.OptpassError, match=r"optimizer_in_backward needs backward\(\) inside the compiled "
                       rf"step\. The loss's backward\(\) at .*{step_file}.* broken off by a graph break "
                       r"inside it \(the last: Call to `torch._dynamo.graph_break\(\)`.*torch._dynamo.explain"):
        step(torch.randn(4, 7), torch.randn(4, 5))


class _CheckpointedBlockWithACache(nn.Module):
    """A block run under torch.utils.checkpoint that writes outside itself, as a Hugging Face decoder
    layer writes its KV cache when use_cache is on."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(7, 5)
        self.cache = {}

    def forward(self, x):
        def block(x):
            y = self.fc(x)
            self.cache["last"] = y
            return y
        return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)


def test_a_checkpointed_block_that_writes_outside_itself_is_refused_naming_the_cache():
    """Dynamo cannot trace a checkpointed region's write to outside state ("HOP: Unsafe side effect"):
    the forward breaks off, and a whole-step rewrite is refused naming the cause and the
    Hugging Face fix (use_cache = False)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _CheckpointedBlockWithACache()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    make, _ = STEPS[sorted(STEPS)[0]]
    step = torch.compile(make(model, opt), backend="optpass",
                         options={"optimizer": opt, "optimizer_in_backward": True, "lower": "eager"})
    with pytest.raises(optpass.OptpassError, match=r"HOP: Unsafe side effect.*use_cache = False"):
        step(torch.randn(4, 7), torch.randn(4, 5))
