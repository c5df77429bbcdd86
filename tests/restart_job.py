"""A training job run under ``torchrun --max-restarts 1`` that a rank's death interrupts (tests/test_restart.py).

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \\
    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 tests/restart_job.py \\
        --out DIR --steps 9 --save-every 3 --kill-at 7 --runs zero1:in:adamw fsdp:after:adamw8bit ...

Each run (``kind:update:optimizer[:lower]``) trains its own float64 model, stepping with the others in
turn (run 1's step 1, run 2's step 1, ..., run 1's step 2, ...), and saves
``DIR/<run>/step-<n>`` every ``--save-every`` steps with ``optpass.save_sharded_checkpoint``, the step
and the LR scheduler in the same checkpoint (``extra=``). With ``--kill-at k``, in the job's first
attempt, rank ``--kill-rank`` SIGKILLs itself in step k of the second run; torchrun then restarts every
rank, and each run resumes from its newest complete checkpoint (a directory with DCP's ``.metadata``;
an ``.incomplete`` one is a save that did not finish). At the end each rank writes
``DIR/<run>-rank<r>.pt``: its parameters and optimizer state, as tensors, for comparison with a job
that was not interrupted.

This is the loop a user writes for a job that survives a lost rank; docs/fsdp.md "When a rank fails".
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: torch 2.13's torchrun otherwise keeps its rendezvous store
across restarts, and the restarted ranks' gloo reads the first attempt's addresses ("Gloo
connectFullMesh failed ... Connection refused"; pytorch#135712), with or without optpass.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist

import optpass
from sharded_training import compiled_step, sharded_model


def newest_checkpoint(directory: str) -> str | None:
    """The newest complete checkpoint under `directory`: a ``step-<n>`` directory with DCP's metadata."""
    if not os.path.isdir(directory):
        return None
    steps = [int(name[len("step-"):]) for name in os.listdir(directory)
             if name.startswith("step-") and name[len("step-"):].isdigit()
             and os.path.exists(os.path.join(directory, name, ".metadata"))]
    return os.path.join(directory, f"step-{max(steps)}") if steps else None


class Run:
    """One training setup: its model, optimizer, LR scheduler and compiled step, resumed if it can be."""

    def __init__(self, spec: str, out: str):
        kind, update, optimizer, *lower = spec.split(":")
        self.name, self.kind, self.dir = spec.replace(":", "-"), kind, os.path.join(out, spec.replace(":", "-"))
        self.model = sharded_model(kind)
        if optimizer == "adamw8bit":
            from torchao.optim import AdamW8bit
            self.opt = AdamW8bit(self.model.parameters(), lr=0.01, block_size=16)
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=torch.tensor(0.01))   # a scheduler: no recompiles
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda step: min(1.0, (step + 1) / 4))
        self.step = compiled_step(self.model, self.opt, kind, in_backward=update == "in",
                                  lower=lower[0] if lower else "eager")
        self.done = 0
        resume_from = newest_checkpoint(self.dir)
        if resume_from is not None:
            extra = optpass.load_sharded_checkpoint(resume_from, self.opt, model=self.model)
            self.scheduler.load_state_dict(extra["scheduler"])
            self.done = extra["step"]

    def train_one_step(self, save_every: int) -> None:
        g = torch.Generator().manual_seed(1000 * self.done + dist.get_rank())     # the data of this step
        self.step(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g))
        self.scheduler.step()
        self.done += 1
        if self.done % save_every == 0:
            optpass.save_sharded_checkpoint(os.path.join(self.dir, f"step-{self.done}"), self.opt, model=self.model,
                                            extra={"step": self.done, "scheduler": self.scheduler.state_dict()})

    def tensors(self) -> list[torch.Tensor]:
        """This rank's parameters and optimizer state (a quantized moment as its inner tensors)."""
        holder = self.opt if self.kind == "fsdp" else optpass.zero1.sharded_state(self.opt).shard_optimizer
        found = [p.detach().clone() for p in self.model.parameters()]
        for p in [p for group in holder.param_groups for p in group["params"]] if holder is not None else []:
            for key, value in sorted(holder.state.get(p, {}).items()):
                if hasattr(value, "__tensor_flatten__"):
                    found += [getattr(value, inner).clone() for inner in value.__tensor_flatten__()[0]]
                elif isinstance(value, torch.Tensor):
                    found.append(value.clone())
        return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", nargs="+", required=True)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=0, help="0: no rank is killed")
    parser.add_argument("--kill-rank", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    runs = [Run(spec, args.out) for spec in args.runs]
    if rank == 0:
        print(f"attempt {attempt}: resumed at steps {[run.done for run in runs]}", flush=True)
    for step in range(1, args.steps + 1):
        for index, run in enumerate(runs):
            if run.done >= step:
                continue
            if attempt == 0 and step == args.kill_at and index == min(1, len(runs) - 1) and rank == args.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)       # as the OOM killer does
            run.train_one_step(args.save_every)
    for run in runs:
        torch.save(run.tensors(), os.path.join(args.out, f"{run.name}-rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
