#!/usr/bin/env python3
"""DP-SGD with Poisson-sampled batch sizes: what a step costs padded to a bucket, or with B symbolic,
against a static-shape compile for the one size.

One process, one MLP DP-SGD step (``vmap(grad(...))``, per-sample norms, clip, noise / expected
batch size, SGD), compiled with ``backend="optpass"`` (``--lower``, default Inductor), four variants
on twin copies of the model, timed in interleaved blocks (medians over ``--rounds`` blocks of
``--block`` steps), all at the same real batch size ``--batch``:

* ``static``   -- compiled for exactly this batch size (``dynamic=False``): the reference, what a
  fixed-size batch costs; with Poisson sampling it would recompile for every new size;
* ``bucket``   -- docs/dp_sgd.md's recipe: ``optpass.pad_batch(x, y, multiple=--multiple)`` pads to the
  next multiple (``dynamic=False``: one compile per bucket), the mask zeroes the padded
  examples' clip coefficients;
* ``symbolic`` -- ``torch._dynamo.mark_dynamic`` on the batch dimension: one compile with B
  symbolic (warmed up at another size first). Only possible because this step's loss is written
  without ``gather`` (one-hot cross-entropy): vmap's batching rules of ``F.cross_entropy`` with
  class indices and of ``nn.Embedding`` read B as an int and specialize it;
* ``eager``    -- the same step uncompiled: what runs after Dynamo's recompile limit.

Every variant uses the same loss (one-hot cross-entropy) so the four run the same math. The
script fails if anything compiles during timing, and checks that the per_sample_grad_norm pass
was applied to each compiled step graph. It prints wall time and the process's CPU time per step
(medians); on a shared machine the CPU time with ``--threads 1`` is the steadier of the two.

    python3 bench/dp_poisson.py                     # B = 61 padded to 64, Inductor
    python3 bench/dp_poisson.py --batch 64          # a full bucket: the mask's cost alone
    python3 bench/dp_poisson.py --lower eager
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=61)
    parser.add_argument("--multiple", type=int, default=16)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--lower", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()

    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.func import functional_call, grad, vmap

    import optpass
    from optpass.capture import GraphKind

    torch.set_num_threads(args.threads)
    C, NOISE, EXPECTED = 1.0, 1.0, float(args.batch)

    def make_step(model, opt, masked):
        classes = torch.arange(args.classes)

        def loss_of_params(params, x, y):          # cross-entropy without gather: vmap keeps B symbolic
            logits = functional_call(model, params, (x.unsqueeze(0),))
            return -(logits.log_softmax(-1) * (y == classes).to(logits.dtype)).sum()

        def clipped_noisy_gradients(x, y, mask):
            params = {k: v.detach() for k, v in model.named_parameters()}
            per_sample = vmap(grad(loss_of_params), in_dims=(None, 0, 0))(params, x, y)
            norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per_sample.values()]).sum(0).sqrt()
            coef = (C / (norms + 1e-6)).clamp(max=1.0)
            if mask is not None:
                coef = torch.where(mask, coef, 0)
            for name, p in model.named_parameters():
                p.grad = (torch.einsum("b,b...->...", coef, per_sample[name])
                          + NOISE * C * torch.randn_like(p)) / EXPECTED
            return norms

        if masked:
            def step(x, y, mask):
                norms = clipped_noisy_gradients(x, y, mask)
                opt.step()
                opt.zero_grad()
                return norms
        else:
            def step(x, y):
                norms = clipped_noisy_gradients(x, y, None)
                opt.step()
                opt.zero_grad()
                return norms
        return step

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(args.features, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden),
                         nn.ReLU(), nn.Linear(args.hidden, args.classes))

    def twin(masked, compiled=True, **compile_kwargs):
        model = copy.deepcopy(base)
        step = make_step(model, torch.optim.SGD(model.parameters(), lr=0.05), masked)
        if not compiled:
            return step
        return torch.compile(step, backend="optpass", options={"lower": args.lower}, **compile_kwargs)

    g = torch.Generator().manual_seed(0)

    def batch(size):
        return torch.randn(size, args.features, generator=g), torch.randint(0, args.classes, (size,), generator=g)

    def marked(size):
        x, y = batch(size)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(y, 0)
        return x, y

    steps = {
        "static": (twin(False, dynamic=False), lambda: batch(args.batch)),
        "bucket": (twin(True, dynamic=False), lambda: optpass.pad_batch(*batch(args.batch), multiple=args.multiple)),
        "symbolic": (twin(False), lambda: marked(args.batch)),
        "eager": (twin(False, compiled=False), lambda: batch(args.batch)),
    }
    optpass.report.clear_reports()
    started = time.perf_counter()
    with optpass.keep_graphs():                     # no FX-graph-cache hit: the passes run and report
        for name, (step, inputs) in steps.items():  # compile; symbolic: first at another size
            if name == "symbolic":
                step(*marked(args.batch + 3))
            for _ in range(2):
                step(*inputs())
    compile_s = time.perf_counter() - started
    graphs = [r for r in optpass.recent_reports() if r.kind is GraphKind.OTHER]
    statuses = [p.status for r in graphs for p in r.passes if p.name == "per_sample_grad_norm"]
    assert statuses and all(s == "applied" for s in statuses), statuses

    times = {name: [] for name in steps}
    cpu = {name: [] for name in steps}             # process CPU time: less disturbed by other processes
    with torch._dynamo.config.patch(error_on_recompile=True):
        for r in range(args.rounds):
            order = list(steps) if r % 2 == 0 else list(reversed(steps))
            for name in order:
                step, inputs = steps[name]
                data = [inputs() for _ in range(args.block)]
                t0, c0 = time.perf_counter(), time.process_time()
                for d in data:
                    step(*d)
                times[name].append((time.perf_counter() - t0) / args.block)
                cpu[name].append((time.process_time() - c0) / args.block)
    median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    median_cpu = {name: statistics.median(t) * 1e3 for name, t in cpu.items()}
    padded = optpass.bucket_size(args.batch, args.multiple)
    print(f"B = {args.batch} (bucket {padded}), MLP {args.features}-{args.hidden}-{args.hidden}-{args.classes}, "
          f"lower={args.lower}, {args.threads} threads, {args.rounds} x {args.block} steps, "
          f"{len(graphs)} step graphs compiled in {compile_s:.0f} s")
    print(f"  {'':9s} {'wall':>16s} {'':13s} {'CPU (process)':>16s}")
    for name, ms in median.items():
        print(f"  {name:9s} {ms:8.2f} ms/step {ms / median['static']:5.2f}x static "
              f"{median_cpu[name]:8.2f} ms/step {median_cpu[name] / median_cpu['static']:5.2f}x static")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "median_ms": median, "median_cpu_ms": median_cpu,
                       "times_s": times, "cpu_s": cpu}, f, indent=1)


if __name__ == "__main__":
    main()
