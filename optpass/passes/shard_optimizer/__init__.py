"""Pass shard_optimizer: ZeRO-1 inside the compiled step, with functional collectives.

Precondition: a step graph (forward + backward, the supported shape of docs/design.md §4) whose
gradients are the raw gradients of autograd (legality: no gradient transform
runs before the update, since the gradients are averaged across ranks here);
the bucket layout and this rank's shard optimizer (``optpass/zero1/state.py``); the
shard optimizer's update harvested from torch.optim (``optim/harvest.py``: one
"parameter" per bucket, this rank's flat chunk), with its state tensors and
each group's lr as extra inputs (``runtime/sharded_step.py`` adds them).

Rewrite, per bucket, in three stages; a functional collective (``_c10d_functional``,
docs/design.md §24, §25) runs in the background from its call until its ``wait_tensor``:

    started  = <reduce>(cat(view(g, [-1]) ...))        # 1. as soon as the bucket's gradients are final
    chunk    = <wait>(started)                          # 2. this rank's averaged gradients
    new      = <torch.optim update of (shard, chunk, state, lr)>   # shard: its parameters' values
    gathered = <gather>(new)
    full     = <wait>(gathered)                         # 3. after the last read of the old values
    copy_(p, view(slice_scatter(...(flat(p), full[piece of p])...), p.shape))   # each parameter

and every bucketed gradient's output slot becomes None (``p.grad`` stays None,
the step's ``opt.step()`` does nothing: docs/design.md §17).

Collectives (option ``collectives``, a key of ``PLANS``; "auto" asks ``choose_collectives``
with the process group's backend for the parameters' device):

| plan             | reduce (stage 1 -> 2)                                  | gather (2 -> 3)                      | auto for |
|------------------|--------------------------------------------------------|--------------------------------------|----------|
| "reduce_scatter" | ``reduce_scatter_tensor(flat, "avg")``, flat rank-major | ``all_gather_into_tensor(new)``      | NCCL and every backend but gloo |
|                  | with each chunk padded to the bucket's chunk size      | (padded like the chunk)              |          |
| "all_reduce"     | ``all_reduce_(flat, "sum")`` in place, unpadded; this  | ``broadcast_`` of each rank's new    | gloo     |
|                  | rank's chunk is one slice of it, divided by N          | shard from its owner (N calls)       |          |

Why: on gloo (2 and 3 ranks, 1 thread each; ``bench/zero1.py`` times each plan's
collectives alone on its layout) reduce_scatter_tensor + all_gather_into_tensor take
1.4x the time of all_reduce + a broadcast per owner on an idle machine (1.0-1.6x on a
loaded one), although the latter moves 1.5x the bytes: gloo's reduce-scatter and all-gather are
not the halves of its ring all-reduce. DDP + ZeroRedundancyOptimizer does the same
on gloo. NCCL's reduce-scatter and all-gather each run at its all-reduce's bus
bandwidth (nccl-tests), so there the reduce_scatter plan (1x DDP's bytes) beats the
all_reduce plan (1.5x): planned from that cost model, not measured (no GPU here).
Both plans use the same layout and shards, so checkpoints do not depend on the plan.

Placement (stage 1 always during backward; ``_stage_points``; Inductor keeps it, see
``ShardPlan.inductor_config``):

* default: stage 1 right after the bucket's last gradient; stages 2 and 3 after
  backward, all buckets' stage 2 before any stage 3, so one bucket's gather runs
  while the next bucket is updated (the update after backward, like
  ZeroRedundancyOptimizer). The gradients live until stage 2, as they would in ``.grad``.
* optimizer_in_backward: stage 2 of bucket k just before the kernel that first writes
  bucket k+1's buffer: bucket k+1's first gradient computed by a kernel Inductor fuses
  the cast into (a bias's or norm weight's sum), else its last gradient
  (``_before_bucket_allocation``: its reduce runs while backward computes the GEMMs of
  bucket k+1 before that, and its buffer is freed before bucket k+1's is
  allocated), stage 3 where bucket k+1's stage 2 goes, and never before the last
  read of bucket k's old parameter values (docs/design.md §22); the last ones after backward.
  Each gradient dies at its bucket's cat. At one place, what frees buffers goes
  first (``_insertion_order``): the writes of gathers started earlier, then the
  updates, then the next reduce. So at most one bucket's reduce buffer, one layer's
  gradient and one bucket's gather buffers are alive at once (bench/mixed_precision.py).
  In a bucket of several parameters, a gradient that is a sum (a bias's or norm weight's,
  small) goes through ``optpass::materialized`` (a copy Inductor runs as an extern kernel):
  otherwise Inductor may fuse two such sums of two
  buckets into one kernel (a transformer layer's two norm weights, when a bucket border falls
  between them), which allocates both buckets' buffers before the first one's reduce starts.
  So a bucket's buffer is allocated by its cat, after the update before it.
  Buckets whose gradients are all final at one place (the last ones, at the end of
  backward) are each reduced and waited before the next one's buffer is allocated.
* clip_grad_norm (not with optimizer_in_backward): stage 1 as by default; after backward
  every bucket's stage 2 waits first, one all_reduce of the chunks' squared norms
  gives the global norm, then the scaled updates, the gathers and the writes.

Effect: optimizer state is 1/N per rank; the reduce_scatter plan moves exactly DDP's
all-reduce volume (even partition; greedy adds padding), the all_reduce plan that
plus one broadcast of the parameters.

With master_weights (Megatron's distributed optimizer): the chunk of a bf16/fp16
bucket that a rank updates is its fp32 master shard ``m``, an input of the graph
(``zero1.state.ShardedOptimizer`` keeps it; the shard optimizer's state is fp32 too).
The reduce is an all-to-all of the half-precision gradients, summed in fp32 by
the rank that owns them (``_AllToAllReduce``), in either plan; the gather stays:

    flat  = cat([bf16 gradient piece ...])                                 # rank-major, as it is
    mine  = <wait>(all_to_all_single(flat))             # every other rank's copy of my chunk (the
                                                        # first and last rank read theirs from flat)
    chunk = (f32(row_0) + ... + f32(row_N-1)) / N       # the fp32 average, rows in rank order
    new   = <torch.optim update of (m, chunk, state, lr)>;  copy_(m, new)
    full  = <wait>(<gather>(convert_element_type(new, bf16)))
    copy_(p, view(slice_scatter(...(flat(p), full[piece of p])...), p.shape))

The sum is fp32, as Megatron's ``grad_reduce_in_fp32``: gloo and NCCL reduce
bf16/fp16 too, but a half-precision sum rounds to 8 (bf16) or 11 (fp16) bits at
every addition, and an fp16 sum can overflow where the average would not.
Measured on the tests' MLP against the Megatron-way reference (fp32 average;
bench/zero1_master_weights_reduction.py): reducing in the half dtype put
parameters up to 27 ulps and masters up to 5.7e-4 (relative) off after one step
from the same state (2-3 ranks, AdamW/SGD, bf16/fp16), against 0-1 ulp and 8e-7
for fp32. Casting the gradients to fp32 before an fp32 reduce
(all_reduce_ / reduce_scatter_tensor) gives the same sum (bitwise at 2 ranks,
the order of N > 2 fp32 additions aside), for twice the bytes and an fp32 copy
of the bucket beside its bf16 gradients. Sent as they are, a rank holds the bf16
bucket and what it receives (2 + 2 bytes per element, not 2 + 4), a step moves
4 bytes per parameter (bf16 in, bf16 out: DDP's bf16 all-reduce volume), and on
gloo (2 ranks, 1 thread each) the zero1 step of bench/mixed_precision.py went from
0.98x to 0.72x (MLP) and from 1.59x to 1.00x (Llama) the by-hand step's time. The
all-gather carries the rounded parameters (``_in_param_dtype``), which is all a
rank needs from the others; on gloo (the all_reduce plan's broadcasts) the other
ranks' shards are received into buffers allocated after the update
(``optpass::empty_after``). Receiving them into the all-to-all's output instead
(read by the update by then) kept that output, as long as the bucket, alive until the
parameters are written: the Llama's live-tensor peak rose from 8.50 to 8.56 B/param.
With a grad_scaler the gradients are unscaled into fp32 first (``loss_scaling``) and
reduced in fp32 as fp32 buckets are.
fp32 buckets (an fp32 parameter is its own master) are unchanged.
"""

from __future__ import annotations

from optpass.passes.shard_optimizer.collectives import (PLANS, AllReducePlan, ReduceScatterPlan, choose_collectives,
                                                      collectives_in)
from optpass.passes.shard_optimizer.plan import CONTEXT_KEY, ShardPlan
from optpass.passes.shard_optimizer.rewrite import shard_update

__all__ = ["CONTEXT_KEY", "EXPLAIN_KEY", "PLANS", "AllReducePlan", "ReduceScatterPlan", "ShardPlan",
           "choose_collectives", "collectives_in", "run", "shard_update"]


# explain's dry compile of a step zero1 shards: no plan (the layout needs every rank), said so
EXPLAIN_KEY = "shard_optimizer.explained"


def run(step, options) -> str | None:
    plan = step.context.get(CONTEXT_KEY)
    if plan is None and step.context.get(EXPLAIN_KEY):
        return ("applies at the first training call, not in explain: there every rank agrees on the model, "
                "and per gradient bucket a reduce starts during backward, this rank updates its 1/N shard "
                "and a gather brings the parameters back (explain runs no collective)")
    if plan is None:
        if options.data_parallel == "fsdp":
            return "data_parallel is 'fsdp': its parameters are shards already (this pass is zero1's)"
        return ("not requested (options data_parallel)" if options.data_parallel != "zero1"
                else "this compile keeps gradients (a micro-step without opt.step(): they add up in .grad)")
    shard_update(step, plan)
    step.notes.append(_summary(plan))
    return None


def _summary(plan: ShardPlan) -> str:
    sharded, layout = plan.sharded, plan.sharded.layout
    return (f"rank {sharded.rank} of {layout.world}: {len(layout.buckets)} bucket(s), "
            f"{layout.partition} partition, {PLANS[plan.collectives].describe(layout)}, reduce started "
            f"during backward, update {'during' if plan.in_backward else 'after'} backward")
