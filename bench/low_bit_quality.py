#!/usr/bin/env python3
"""Does a small language model train as well with torchao's AdamW8bit fused in backward?

``optpass.demo.models.TinyLM`` (vocabulary 512, width 128, 2 blocks: its matrices quantized, its
norms and biases fp32), trained for ``--steps`` steps on the demo's synthetic corpus (batch 16 x 64
tokens, lr 1e-3 with 20 warm-up steps), one process per run, the same data in every run:

* ``optpass AdamW8bit`` -- torchao's ``AdamW8bit``, optpass ``optimizer_in_backward`` (Inductor);
* ``eager AdamW8bit``   -- the same optimizer, the model eager (torchao's compiled per-parameter step);
* ``optpass AdamW``     -- torch.optim's fp32 ``AdamW``, optpass ``optimizer_in_backward``.

Printed: the mean training loss over each tenth of the run and at the end (the last 20 steps), and
the largest parameter difference between the two AdamW8bit runs.

    python3 bench/low_bit_quality.py --steps 300
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import child_command, child_env, emit_result, empty_cache_dir, run_child, training_step  # noqa: E402

RUNS = ("optpass-adamw8bit", "eager-adamw8bit", "optpass-adamw")


def run(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    import optpass
    from optpass.demo.models import LMConfig, TinyLM, batches, synthetic_corpus

    side, name = args.child.split("-")
    cfg = LMConfig(vocab=512, d_model=128, n_heads=4, n_layers=2, seq_len=64)
    torch.manual_seed(0)
    model = TinyLM(cfg)
    if name == "adamw8bit":
        import torchao.optim

        opt = torchao.optim.AdamW8bit(model.parameters(), lr=1e-3, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), weight_decay=0.1)
    lr = opt.param_groups[0]["lr"]

    step = training_step(model.loss, opt)
    if side == "optpass":
        step = torch.compile(step, backend="optpass", options={"optimizer": opt, "optimizer_in_backward": True})
    stream = batches(synthetic_corpus(cfg.vocab, 200_000, seed=0), 16, cfg.seq_len, seed=0)
    losses = []
    for i in range(args.steps):
        lr.fill_(1e-3 * min(1.0, (i + 1) / 20))          # warm-up, then constant
        tokens, targets = next(stream)
        losses.append(float(step(tokens.contiguous(), targets.contiguous())))
    emit_result({"losses": losses, "weights": [p.detach().flatten()[:4096].tolist() for p in model.parameters()]})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run(args)
        return
    results = {}
    for name in RUNS:
        with empty_cache_dir(name) as cache_dir:
            results[name] = run_child(child_command(__file__, child=name, steps=args.steps, threads=args.threads),
                                      child_env(args.threads, cache_dir), 3600)
    tenth = max(1, args.steps // 10)
    print(f"TinyLM (vocab 512, width 128, 2 blocks), {args.steps} steps: mean training loss per tenth of the run")
    print("| run | " + " | ".join(f"{(i + 1) * tenth}" for i in range(10)) + " | last 20 |")
    print("|---|" + "---|" * 11)
    for name, r in results.items():
        losses = r["losses"]
        tenths = [sum(losses[i * tenth:(i + 1) * tenth]) / tenth for i in range(10)]
        print(f"| {name} | " + " | ".join(f"{t:.3f}" for t in tenths) + f" | {sum(losses[-20:]) / len(losses[-20:]):.4f} |")
    a, b = results["optpass-adamw8bit"]["weights"], results["eager-adamw8bit"]["weights"]
    worst = max(abs(x - y) for wa, wb in zip(a, b) for x, y in zip(wa, wb))
    print(f"largest difference between the two AdamW8bit runs' parameters (first 4096 entries of each): {worst:.2e}")


if __name__ == "__main__":
    main()
