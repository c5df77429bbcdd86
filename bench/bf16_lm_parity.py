#!/usr/bin/env python3
"""bf16 numerics: how far a compiled bf16 language model drifts from eager torch.optim.

A tiny random-init Hugging Face Llama (2 layers, width 32, vocab 128) in bf16, AdamW with a
tensor lr, 8 steps on the same batches, each run from the same initial weights:

* ``eager``            -- no torch.compile (the reference users usually compare with);
* ``compiled-eager``   -- ``torch.compile(step, backend="eager")``: Dynamo's formulation of AdamW;
* ``inductor``         -- ``torch.compile(step, backend="inductor")``;
* ``optpass``          -- ``backend="optpass"``, no rewrite, ``lower="eager"``;
* ``optpass-in-backward`` / ``optpass-in-backward-eager`` -- updates fused into backward,
  Inductor / eager lowering.

Prints each run's relative parameter distance (``||a - b|| / ||b||`` over all parameters) to
eager torch.optim, to ``compiled-eager`` and to ``inductor``. Run: ``python bench/bf16_lm_parity.py``.
"""

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import optpass  # noqa: F401  (the backend is found through its entry point; imported for clarity)

STEPS = 8
VARIANTS = {
    "eager": None,
    "compiled-eager": dict(backend="eager"),
    "inductor": dict(backend="inductor"),
    "optpass": dict(backend="optpass", options={"lower": "eager"}),
    "optpass-in-backward": dict(backend="optpass", options={"optimizer_in_backward": True}),
    "optpass-in-backward-eager": dict(backend="optpass", options={"optimizer_in_backward": True, "lower": "eager"}),
}


def train(base: torch.nn.Module, variant: dict | None) -> torch.nn.Module:
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))

    def train_step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    if variant is not None:
        options = variant.get("options")
        if options is not None and variant["backend"] == "optpass":
            options = {"optimizer": opt, **options}
        train_step = torch.compile(train_step, backend=variant["backend"], options=options)
    batches = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        train_step(torch.randint(0, 128, (4, 16), generator=batches))
    return model


def distance(a: torch.nn.Module, b: torch.nn.Module) -> float:
    num = sum((p.float() - q.float()).pow(2).sum() for p, q in zip(a.parameters(), b.parameters()))
    return (num / sum(q.float().pow(2).sum() for q in b.parameters())).sqrt().item()


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base = LlamaForCausalLM(config).to(torch.bfloat16)
    models = {name: train(base, variant) for name, variant in VARIANTS.items()}
    print(f"bf16 tiny Llama, AdamW, {STEPS} steps: relative parameter distance")
    print(f"{'run':<28}{'to eager':>12}{'to compiled-eager':>20}{'to inductor':>14}")
    for name, model in models.items():
        print(f"{name:<28}{distance(model, models['eager']):>12.2e}"
              f"{distance(model, models['compiled-eager']):>20.2e}{distance(model, models['inductor']):>14.2e}")


if __name__ == "__main__":
    main()
