"""Activation checkpointing in a traced backward, recomputed by optpass (optpass/checkpointed_regions.py).

One process here; under data_parallel="fsdp" on 2 ranks: checkpointed_blocks_under_fsdp in
tests/test_user_programs_distributed.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import optpass
from optpass.capture import GraphKind
from parity import make_step, mlp_loss


class Blocks(nn.Module):
    """Residual MLP blocks whose wide hidden activations are what checkpointing saves."""

    def __init__(self, width=64, hidden=512, depth=3, checkpointed=True):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, width))
                                    for _ in range(depth))
        self.checkpointed = checkpointed

    def forward(self, x):
        for block in self.blocks:
            x = x + (checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x))
        return x


def test_checkpointed_blocks_are_recomputed_in_backward_and_train_as_eager():
    """The graph after the passes recomputes each block's hidden activation just before backward
    needs it (``tanh_recomputed``), the update fused after; float64, 4 steps, equal to eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Blocks(width=8, hidden=16).double()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.01, momentum=0.9)
    step = torch.compile(make_step(model, opt, mlp_loss), backend="optpass",
                         options={"optimizer": opt, "optimizer_in_backward": True, "lower": "eager"})
    g = torch.Generator().manual_seed(0)
    optpass.report.clear_reports()          # another test's step report (no graphs kept) may be there
    with optpass.keep_graphs():
        for _ in range(4):
            x, y = torch.randn(4, 8, generator=g).double(), torch.randn(4, 8, generator=g).double()
            step(x, y)
            make_step(reference, reference_opt, mlp_loss)(x, y)
        report = next(r for r in optpass.recent_reports() if r.captured.kind is GraphKind.STEP)
    recomputed = [n.name for n in report.graph_after.nodes if n.name.endswith("_recomputed")]
    assert sum(name.startswith("tanh") for name in recomputed) == 3, recomputed
    assert max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters())) <= 1e-12


def test_checkpointing_lowers_the_steps_peak():
    """The step's live-tensor peak, 6 blocks of hidden width 1024, batch 256, float32: with every block
    checkpointed it is lower than without by at least a quarter of the hidden activations the blocks
    would keep (measured 2.07 MB of 6.29 with the eager lowering, 1.28 with Inductor's: the recomputed
    block's own activations are alive at backward's peak)."""
    peaks = {}
    for checkpointed in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Blocks(hidden=1024, depth=6, checkpointed=checkpointed)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        step = torch.compile(make_step(model, opt, mlp_loss), backend="optpass",
                             options={"optimizer": opt, "optimizer_in_backward": True, "lower": "eager"})
        x, y = torch.randn(256, 64), torch.randn(256, 64)
        step(x, y)
        with optpass.measure_tensor_peak() as measured:
            step(x, y)
        peaks[checkpointed] = measured.peak_bytes
    hidden = 6 * 256 * 1024 * 4              # each block's tanh output, kept for its backward
    assert peaks[False] - peaks[True] >= hidden / 4, peaks


def test_a_hugging_face_llama_with_checkpointed_layers_traces_whole_with_hub_kernel_routing():
    """transformers >= 5.25 routes its hub kernels (the ``kernels`` package) by writing a module-level
    variable around every attention layer's forward and restoring it; inside checkpoint_wrapper Dynamo
    refused that write ("HOP: Unsafe side effect") and the forward broke off the step. optpass lets
    that write through (optpass/dynamo_scope.py): the step is one graph, with the update in backward,
    equal in float64 to the same model without checkpointing under optpass (and to eager within the
    rounding of Hugging Face's rotary embedding, which it computes in fp32)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa", use_cache=False)
    plain = LlamaForCausalLM(config).double()
    checkpointed, eager = copy.deepcopy(plain), copy.deepcopy(plain)
    for i, layer in enumerate(checkpointed.model.layers):
        checkpointed.model.layers[i] = checkpoint_wrapper(layer)

    def run(model, compiled: bool) -> list[float]:
        torch._dynamo.reset()
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2, dtype=torch.float64))
        step = make_step(model, opt, lambda m, ids, labels: m(input_ids=ids, labels=labels).loss)
        if compiled:
            step = torch.compile(step, backend="optpass",
                                 options={"optimizer": opt, "optimizer_in_backward": True, "lower": "eager"})
        batches = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(i)) for i in range(3)]
        return [float(step(ids, ids)) for ids in batches]

    losses = run(checkpointed, compiled=True)
    assert all(p.grad is None for p in checkpointed.parameters())       # the update ran in backward
    assert losses == pytest.approx(run(plain, compiled=True), rel=1e-12)
    assert losses == pytest.approx(run(eager, compiled=False), rel=1e-6)
    names = dict(plain.named_parameters())
    worst = max((p - names[n.replace("._checkpoint_wrapped_module", "")]).abs().max().item()
                for n, p in checkpointed.named_parameters())
    assert worst <= 1e-12, worst
