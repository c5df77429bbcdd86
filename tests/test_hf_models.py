"""Hugging Face models as users train them (tiny random configs, CPU), fused with optimizer-in-backward.

GPT-2 with labels= computes its loss through transformers' loss_function, which logs with
logger.warning_once; optpass has Dynamo skip logging calls (DESIGN.md fact 23), so the step
stays one graph and every update is fused.
"""

import copy

import pytest
import torch

import optpass
from optpass.capture import GraphKind

transformers = pytest.importorskip("transformers")


def hf_step(model, opt):
    def train_step(ids):
        loss = model(ids, labels=ids).loss
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    return train_step


def test_gpt2_with_labels_is_fused_and_matches_eager():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    config.loss_type = None            # as in a fresh config: the path that logs warning_once
    model = transformers.GPT2LMHeadModel(config).double()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    step = torch.compile(hf_step(model, opt), backend="optpass",
                         options={"lower": "eager", "optimizer": opt, "optimizer_in_backward": True})
    eager = hf_step(reference, ref_opt)
    optpass.report.clear_reports()
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        # transformers computes the loss on float32 logits (logits.float()): float32 rounding
        assert step(ids).item() == pytest.approx(eager(ids).item(), rel=1e-6)
        assert all(p.grad is None for p in model.parameters())
    worst = max(((p - q).abs().max() / q.abs().max()).item()
                for p, q in zip(model.parameters(), reference.parameters()))
    # float32 logits (see above) make this a float32 comparison; AdamW's normalisation turns
    # 1e-7 gradient rounding into ~1e-5 of a small weight's step
    assert worst <= 1e-4
    kinds = [r.kind for r in optpass.recent_reports()]
    assert GraphKind.FORWARD not in kinds                  # no break before backward()
    assert any(p.name == "optimizer_in_backward" and p.status == "applied"
               for r in optpass.recent_reports() for p in r.passes)
