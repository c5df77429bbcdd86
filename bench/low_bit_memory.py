#!/usr/bin/env python3
"""Bytes per parameter with torchao's low-bit optimizers, the update in backward or not.

4 x ``Linear(2048, 2048)`` (16.8M parameters), batch 8, MSE loss, one process. For each optimizer
(``torch.optim.AdamW`` with a tensor lr; torchao's ``AdamW8bit``, ``AdamWFp8``, ``AdamW4bit``) and
each variant (``torch.compile(step, backend="inductor")``; ``backend="optpass"`` with
``optimizer_in_backward``), a fresh process with its own empty Inductor cache counts live CPU tensor
bytes on every thread (``optpass.measure_tensor_peak``): the whole run's peak (state creation,
compile, 3 warm-up steps and the measured step) and a steady step's peak, each in bytes per
parameter, from the parameters up (what else the process holds does not count).

    python3 bench/low_bit_memory.py
    python3 bench/low_bit_memory.py --optimizers adamw8bit --layers 8
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import child_command, child_env, emit_result, empty_cache_dir, run_child, training_step  # noqa: E402

OPTIMIZERS = ("adamw", "adamw8bit", "adamwfp8", "adamw4bit")
VARIANTS = ("inductor", "optpass")


def _state_tensors(opt) -> list:
    import torch

    tensors = []
    for state in opt.state.values():
        for value in state.values():
            if hasattr(value, "__tensor_flatten__"):
                tensors += [getattr(value, name) for name in value.__tensor_flatten__()[0]]
            elif isinstance(value, torch.Tensor):
                tensors.append(value)
    return tensors


def run_child_variant(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    import optpass
    from lm_memory import make_optimizer

    name, variant = args.child.split("/")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    params = list(model.parameters())
    opt = make_optimizer(name, params)

    step = training_step(lambda x, y: torch.nn.functional.mse_loss(model(x), y), opt)
    compiled = (torch.compile(step, backend="inductor") if variant == "inductor" else
                torch.compile(step, backend="optpass", options={"optimizer": opt, "optimizer_in_backward": True}))
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    n = sum(p.numel() for p in params)
    parameter_bytes = sum(p.untyped_storage().nbytes() for p in params)
    with optpass.measure_tensor_peak() as whole:
        for _ in range(3):
            compiled(x, y)
        with optpass.measure_tensor_peak() as steady:
            compiled(x, y)
    held = parameter_bytes + sum(t.untyped_storage().nbytes() for t in _state_tensors(opt))
    emit_result({"n": n, "held_per_param": held / n, "steady_per_param": (held + steady.growth_bytes) / n,
                 "whole_run_per_param": (parameter_bytes + whole.growth_bytes) / n,
                 "state_type": type(opt.state[params[0]]["exp_avg"]).__name__, "counted_by": steady.counted_by})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--optimizers", type=lambda s: s.split(","), default=list(OPTIMIZERS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child-timeout", type=float, default=1200)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_child_variant(args)
        return
    print(f"{args.layers} x Linear({args.width}, {args.width}), batch {args.batch}: live tensor bytes per parameter")
    print("| optimizer | state | held (parameters + state) | steady step: inductor -> optpass | whole run: inductor -> optpass |")
    print("|---|---|---|---|---|")
    for name in args.optimizers:
        results = {}
        for variant in VARIANTS:
            cmd = child_command(__file__, child=f"{name}/{variant}", layers=args.layers, width=args.width,
                                batch=args.batch, threads=args.threads)
            with empty_cache_dir(f"{name}-{variant}") as cache_dir:
                try:
                    results[variant] = run_child(cmd, child_env(args.threads, cache_dir), args.child_timeout)
                except Exception as error:          # Inductor's own compile of AdamW4bit fails in torch
                    results[variant] = {"error": str(error).strip().splitlines()[-1][:80]}
        ours, base = results["optpass"], results["inductor"]

        def both(key: str) -> str:
            return " -> ".join(f"{r[key]:.2f}" if key in r else f"failed ({r['error']})" for r in (base, ours))
        print(f"| {name} | {ours.get('state_type', '?')} | {ours.get('held_per_param', float('nan')):.2f} | "
              f"{both('steady_per_param')} | {both('whole_run_per_param')} |", flush=True)


if __name__ == "__main__":
    main()
