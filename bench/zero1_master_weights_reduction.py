#!/usr/bin/env python3
"""zero1 + master_weights: reduce the gradients in fp32 (what optpass does) or in bf16/fp16?

Trains the model of tests/test_zero1_master_weights.py (the MLP of
tests/zero1_workers.py in bf16/fp16, two param groups) with
``options={"data_parallel": "zero1", "master_weights": torch.float32}`` on 2 and
3 gloo ranks, 20 steps, twice per case:

* ``fp32`` -- optpass as it is: each bucket's half-precision gradients are sent to
  their owner (all-to-all) and summed there in fp32 (Megatron's grad_reduce_in_fp32);
* ``half`` -- the reduce-scatter in the parameters' dtype, its chunk cast to fp32
  for the update (the alternative, patched in here: the sum rounded to bf16/fp16).

Both are compared with the Megatron-way reference of the tests (per-rank
gradients cast to fp32, averaged in fp32, torch.optim on fp32 masters):
``per step`` is the worst distance after one step from the run's own state (eager
torch.optim), ``20 steps`` the distance of the whole trajectory (the reference's
step as torch.compile computes it). Parameters in half-precision ulps, masters
relative to each parameter's largest master.

    python3 bench/zero1_master_weights_reduction.py          # 10.5 min on a busy 2-core machine
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests")]

from _measure import add_rank_flags, child_command, emit_result, init_gloo, run_ranks  # noqa: E402

CASES = [{"optimizer": o, "dtype": d, "partition": "even", "in_backward": False}
         for o in ("AdamW", "SGD") for d in ("bf16", "fp16")]


def measure(rank: int, world: int, reduction: str) -> list[dict]:
    import zero1_master_weights_workers as workers   # lazy: it imports torch, which the parent never does

    if reduction == "half":
        # patched where they are looked up: the update in rewrite, the reduction's dtype in collectives
        from optpass.passes.shard_optimizer import collectives, rewrite

        emit_update = rewrite._emit_update

        def update_from_half_chunk(emit, plan, name, shard, gradient, inputs):
            if gradient.meta["val"].dtype != shard.meta["val"].dtype:     # cast after the reduction
                gradient = emit(rewrite.convert_element_type, gradient, shard.meta["val"].dtype)
            return emit_update(emit, plan, name, shard, gradient, inputs)

        rewrite._emit_update = update_from_half_chunk
        collectives._summed_by_owner = lambda sharded, bucket, flat: False   # reduced as it is
    return workers.parity(rank, world, CASES)


def rank_main(args) -> None:
    """One gloo rank (1 thread) of one reduction: its results, one per case."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_gloo(args.rank, args.world, args.port, timeout_s=60)
    results = measure(args.rank, args.world, args.reduction)
    dist.destroy_process_group()
    emit_result({"cases": results})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reduction", choices=("fp32", "half"), help=argparse.SUPPRESS)
    add_rank_flags(p)
    args = p.parse_args()
    if args.reduction:
        rank_main(args)
        return
    print(f"{'ranks':>5} {'case':<11} {'reduction':<9} {'per step: ulps':>15} {'master':>9} "
          f"{'20 steps: ulps':>15} {'master':>9}")
    for world in (2, 3):
        for reduction in ("fp32", "half"):
            ranks = run_ranks(child_command(__file__, reduction=reduction, world=world), world, timeout=1200)
            for r in ranks[0]["cases"]:
                print(f"{world:>5} {r['optimizer'] + ' ' + r['dtype']:<11} {reduction:<9} "
                      f"{r['eager_ulps']:>15} {r['eager_master']:>9.1e} {r['ulps']:>15} {r['master']:>9.1e}",
                      flush=True)


if __name__ == "__main__":
    main()
