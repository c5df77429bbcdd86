"""Run a training step eagerly and compiled with optpass, side by side, and compare."""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters


def make_step(model, opt, loss_fn, clip=None):
    """The supported step shape: the returned value is taken before opt.step()."""
    def train_step(x, y):
        loss = loss_fn(model, x, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    return train_step


def make_micro_step(model, loss_fn):
    """A micro-step of gradient accumulation: backward, no opt.step() (gradients add up in .grad)."""
    def micro_step(x, y):
        loss = loss_fn(model, x, y)
        loss.backward()
        return loss.detach()
    return micro_step


def mlp_loss(model, x, y):
    return F.mse_loss(model(x), y)


def mlp_data(step, dtype=None):
    """Batch `step` of an MLP regression stream (optpass.demo.models.MLP's default sizes)."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g, dtype=dtype), torch.randn(8, 4, generator=g, dtype=dtype)


def lm_loss(model, tokens, targets):
    """A language model's loss (``optpass.demo.models.TinyLM.loss``) as a step's loss_fn."""
    return model.loss(tokens, targets)


def lm_batch(vocab: int, batch: int = 4, seq_len: int = 16):
    """step -> (tokens, next tokens) of `batch` random sequences, the same for a step every call."""
    def data(step):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return data


def steady_graph_after(step, *inputs):
    """The graph after optpass's passes of the step's call on `inputs` (compiled already or now)."""
    import optpass

    optpass.report.clear_reports()
    with optpass.keep_graphs():
        step(*inputs)
    return next(r for r in optpass.recent_reports() if r.graph_after is not None).graph_after


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (0 when both are zero)."""
    a, b = a.detach().double(), b.detach().double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale > 0 else (a - b).abs().max().item()


def optimizer_state_diff(opt_a: torch.optim.Optimizer, opt_b: torch.optim.Optimizer) -> float:
    worst = 0.0
    for (pa, sa), (pb, sb) in zip(opt_a.state.items(), opt_b.state.items()):
        assert sa.keys() == sb.keys()
        for key in sa:
            if isinstance(sa[key], torch.Tensor):
                worst = max(worst, max_rel_diff(sa[key], sb[key]))
    return worst


def param_diff(model_a: torch.nn.Module, model_b: torch.nn.Module) -> float:
    return max(max_rel_diff(pa, pb) for pa, pb in zip(model_a.parameters(), model_b.parameters()))


class Twin:
    """The same model and optimizer twice: one for eager PyTorch, one for optpass.

    float64 by default: under any torch.compile backend (backend="eager" too),
    Dynamo traces torch.optim's compile-time formulation of Adam-family updates,
    whose float32 rounding drifts ~1e-5 from eager over 20 steps. In float64 the
    rounding is ~1e-13, so a 1e-6 bound tests that the programs are the same.
    """

    def __init__(self, make_model: Callable[[], torch.nn.Module],
                 make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
                 dtype: torch.dtype = torch.float64):
        torch.manual_seed(0)
        self.dtype = dtype
        self.eager_model = make_model().to(dtype)
        self.compiled_model = copy.deepcopy(self.eager_model)
        self.eager_opt = make_optimizer(self.eager_model)
        self.compiled_opt = make_optimizer(self.compiled_model)

    def diffs(self) -> tuple[float, float]:
        assert len(self.eager_opt.state) == len(self.compiled_opt.state)
        return (param_diff(self.compiled_model, self.eager_model),
                optimizer_state_diff(self.compiled_opt, self.eager_opt))


def unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]
