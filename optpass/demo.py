"""python -m optpass.demo: train a small causal transformer LM with backend="optpass" on CPU.

Shows the supported step shape, the loss falling, and what optpass captured
(``optpass.explain``). Runs in well under two minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

import optpass
from optpass.models import LMConfig, TinyLM, batches, param_groups_no_decay, synthetic_corpus


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lower", choices=("inductor", "eager"), default="inductor")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    cfg = LMConfig(vocab=64, d_model=64, n_heads=4, n_layers=2, seq_len=32)
    model = TinyLM(cfg)
    # A tensor lr is a graph input: the scheduler changes it without recompiling the update.
    opt = torch.optim.AdamW(param_groups_no_decay(model, 0.1), lr=torch.tensor(3e-3))
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    data = batches(synthetic_corpus(cfg.vocab, 20_000), args.batch, cfg.seq_len)

    # The supported step shape: take the value to return BEFORE opt.step().
    def train_step(tokens, targets):
        loss = model.loss(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    print(f"optpass demo: TinyLM ({sum(p.numel() for p in model.parameters()):,} parameters), "
          f"AdamW + cosine LR + clip_grad_norm_, lower={args.lower!r}")
    step = torch.compile(train_step, backend="optpass", options={"lower": args.lower})
    start = time.perf_counter()
    losses = []
    with tqdm(range(args.steps), desc="training", unit="step") as bar:
        for i in bar:
            losses.append(step(*next(data)).item())
            schedule.step()
            if i == 0:
                bar.write(f"compiled and ran the first step in {time.perf_counter() - start:.1f}s")
            if i % 10 == 0:
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
    window = max(1, args.steps // 10)
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    print(f"loss: first {window} steps {first:.3f} -> last {window} steps {last:.3f} "
          f"({time.perf_counter() - start:.1f}s)")
    for i in range(0, args.steps, max(1, args.steps // 10)):
        print(f"  step {i:4d}  loss {losses[i]:.3f}  " + "#" * int(40 * losses[i] / losses[0]))

    print("\nWhat optpass captured (optpass.explain):")
    print(optpass.explain(train_step, *next(data), options={"lower": args.lower}))


if __name__ == "__main__":
    main()
