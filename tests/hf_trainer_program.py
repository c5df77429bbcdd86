"""A Hugging Face fine-tuner's Trainer run, with and without optpass (tests/test_hf_trainer.py).

A tiny Llama, float64 (so the comparison sees optpass, not rounding; the default dtype too, which
torch.optim's step counters follow), sequences of 16, 24 and 31 tokens padded per batch with -100
labels, the Trainer's default optimizer (fused AdamW), a cosine schedule warming up from lr 0,
accumulation over 4 micro-batches, ``max_grad_norm`` below the gradients' norm (every update is
clipped), gradient checkpointing. 14 micro-batches an epoch: windows of 4, 4, 4 and 2, so each
epoch ends with a window cut short, which the Trainer steps eagerly.

Run as a script it trains one run (``--resume DIR``: from that checkpoint) and saves the trained
parameters and the optimizer's state to ``--out``: a resume in a new process.
"""

from __future__ import annotations

import argparse
import copy

import torch

VOCAB, ROWS, LENGTHS = 128, 28, (16, 24, 31)


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(torch.float64)


def dataset() -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for i in range(ROWS):
        ids = torch.randint(0, VOCAB, (LENGTHS[i % len(LENGTHS)],), generator=generator)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def collate(rows: list[dict]) -> dict:
    """Pad to the batch's longest row: pad id 0, label -100 (not counted), attention mask 0."""
    length = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    labels = torch.full((len(rows), length), -100)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = row["input_ids"], row["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def arguments(out_dir: str, **overrides):
    from transformers import TrainingArguments

    settings = dict(output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=4,
                    max_grad_norm=0.3, learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=2,
                    num_train_epochs=2, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                    seed=0, gradient_checkpointing=True,
                    gradient_checkpointing_kwargs={"use_reentrant": False})
    settings.update(overrides)
    return TrainingArguments(**settings)


def trainer(cls, model, out_dir: str, optpass: bool, **overrides):
    extra = {"optpass_options": {"lower": "eager"}} if optpass else {}
    return cls(model=model, args=arguments(out_dir, **overrides), train_dataset=dataset(), data_collator=collate,
               **extra)


def main() -> None:
    from optpass.integrations.transformers import OptpassTrainer

    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--resume")
    parser.add_argument("--out", required=True)
    parser.add_argument("--eager", action="store_true", help="the Trainer without optpass")
    parser.add_argument("--save-steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)       # AdamW's step counters too, as in the test's run
    model = copy.deepcopy(tiny_llama())
    from transformers import Trainer

    run = trainer(Trainer if args.eager else OptpassTrainer, model, args.dir, optpass=not args.eager,
                  save_strategy="steps", save_steps=args.save_steps)
    run.train(resume_from_checkpoint=args.resume)
    optimizer = run.optimizer.optimizer if hasattr(run.optimizer, "optimizer") else run.optimizer
    torch.save({"params": {n: p.detach() for n, p in model.named_parameters()},
                "optimizer": optimizer.state_dict(), "global_step": run.state.global_step}, args.out)


if __name__ == "__main__":
    main()
