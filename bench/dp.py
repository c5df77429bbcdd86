#!/usr/bin/env python3
"""DP-SGD on CPU: step time and peak memory of optpass vs Inductor vs Opacus.

One training step of a small transformer LM (``TinyLM``-like: d_model 256, 4 layers,
4 heads, vocab 256), batch B = 16, sequence length T in {16, 128, 512}, SGD; or, with
``--model cnn``, of Opacus's CIFAR-10 CNN (``examples/cifar10.py``'s ``convnet``: four 3x3
convolutions, 3-32-64-64-128 channels, a Linear head) on 3x32x32 images; ``--model resnet`` /
``vit``: optpass.demo.vision's SmallResNet (GroupNorm, ``--widths``) and TinyViT on 3x32x32;
``--model mlp``: 256-256-256-10; ``--model pointwise``: one 1x1 Conv2d 256 -> 256 on 8x8.
``--norm docs|opacus|vector_norm`` spells the per-sample norm as docs/dp_sgd.md, Opacus's
``clip_and_accumulate`` or ``torch.linalg`` does.

Model: Opacus computes per-sample gradients module by module, and supports neither
a bare ``nn.Parameter`` (TinyLM's ``pos``: the whole TinyLM would fall back to
functorch) nor tied weights (TinyLM's head is tied to the embedding: ghost clipping
would treat the two uses as two independent layers and get the norm wrong). So every
variant here uses ``DPLM``, the same network with the positions as an
``nn.Embedding`` (indexed with a [B, T] arange) and an untied head.

Variants (each in a FRESH subprocess: this script re-invoked with ``--child VARIANT``):

* ``nonprivate``  -- ``loss.backward(); opt.step(); opt.zero_grad()``, compiled with
  ``backend="inductor"`` (no clipping, no noise: the reference);
* ``noise-floor`` -- NOT DP: the non-private step plus DP-SGD's Gaussian noise only
  (``p.grad.add_(randn_like(p), alpha=noise·C/B)`` for every parameter, between backward and
  ``opt.step()``), compiled with ``backend="inductor"`` drawing with torch's generator
  (``fallback_random``, as optpass does on CPU). Every DP variant draws the same noise, so its
  ratio to non-private is the least any of them can reach here;
* ``vmap-inductor`` -- DP-SGD written with ``torch.func``: ``vmap(grad(loss))`` per-sample
  gradients, per-sample norms, clip coefficients, ``einsum("b,b...->...")`` clipped sum
  + Gaussian noise, ``opt.step()``; compiled with ``backend="inductor"``;
* ``vmap-optpass``  -- the same step compiled with ``backend="optpass"`` (default lowering,
  Inductor): the ``per_sample_grad_norm`` pass replaces each Linear weight's
  [B, out, in] per-sample gradient by ``optpass::per_sample_grad_sq_norm`` + one GEMM,
  each Embedding's [B, vocab, d] one by ``optpass::embedding_per_sample_grad_sq_norm``
  + one scatter, and each convolution weight's by ``optpass::conv_per_sample_grad_sq_norm``
  + one weight gradient (``dp_materialize="auto"`` keeps those no larger materialized). Its
  first step's per-sample norms are compared with Opacus's (hooks, on a copy of the model):
  "norms vs Opacus" is their largest difference over the largest norm;
* ``opacus-hooks`` -- ``opacus.GradSampleModule`` (hooks materialize every per-sample
  gradient) + ``opacus.optimizers.DPOptimizer`` (clip, noise, step), eager;
* ``opacus-ghost`` -- ``GradSampleModuleFastGradientClipping(use_ghost_clipping=True)``
  + ``DPOptimizerFastGradientClipping`` + ``DPLossFastGradientClipping`` (ghost norms,
  then a second backward with the clipping coefficients), eager.

All DP variants use the same clipping norm C and noise multiplier, per-sample loss =
mean over the sample's tokens, update = (sum of clipped per-sample gradients + noise) / B.

Every child imports optpass (same Dynamo config everywhere), sets
``torch.set_num_threads(--threads)``, gets its own empty ``TORCHINDUCTOR_CACHE_DIR``,
runs ``--warmup`` steps (compiles happen there), resets the peak-RSS mark
(``echo 5 > /proc/self/clear_refs``), runs ``--steps`` measured steps and reads
``VmHWM`` from ``/proc/self/status``: the steady-state peak RSS of the process (the "x mem" ratio uses it;
it includes ~0.5 GB of torch/optpass/opacus code and compiled kernels, so small-T ratios
sit near 1). ``HWM-pre`` = VmHWM minus the RSS right before the measured steps: what the
steps themselves add on top of what stays resident. By
default every child runs with ``MALLOC_MMAP_THRESHOLD_=131072`` so that buffers
>= 128 KiB are unmapped on free and RSS follows the live tensors
(``--malloc-mmap-threshold 0`` to keep glibc's default). ``ru_maxrss`` (peak over the
whole process, compile included) is reported too. A child past ``--timeout`` seconds
is killed and reported as "timeout". "live MB" is the peak of live CPU tensor bytes over the
measured steps (``_measure.CPUTensorBytes``, counted by the allocator; no glibc retention, no
compiled code), "x live" its ratio to non-private. The line "optpass / vmap-inductor" gives
optpass's step time and live-tensor peak over those of the same program under plain Inductor.
``--repeat N`` runs the variants N times, alternating (one process each), and takes each
variant's median step time and live-tensor peak over its runs.
``--interleaved`` times only optpass against plain Inductor, both compiled in one process on
two copies of the model, one step of each in turn (the order flipped every pair): on a shared
machine both see the same load; it prints the median of the pairs' time ratios (per run, and the
median over ``--repeat`` runs).

Usage::

    python3 bench/dp.py                    # T = 16, 128, 512 (slow on 2 CPU cores)
    python3 bench/dp.py --T 16,128
    python3 bench/dp.py --quick            # smaller model, fewer steps, T = 16,64
    python3 bench/dp.py --json out.json
    python3 bench/dp.py --d-model 128 --n-layers 2 --T 128,512 --repeat 3
    python3 bench/dp.py --model cnn --repeat 3
    python3 bench/dp.py --d-model 128 --n-layers 2 --T 128,512 --interleaved --steps 30 --repeat 3

Goals (per T): optpass step time <= 1.3x and steady peak memory <= 1.1x non-private;
optpass the best (fastest and smallest) DP variant.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import time

from _measure import (ChildError, CPUTensorBytes, child_command, child_env, emit_result, empty_cache_dir,
                      graph_count, print_json, proc_status_kib, reset_peak_rss, run_child)

VARIANTS = ["nonprivate", "noise-floor", "vmap-inductor", "vmap-optpass", "opacus-hooks", "opacus-ghost"]
DP_VARIANTS = VARIANTS[2:]
MAX_GRAD_NORM, NOISE, LR = 1.0, 1.0, 0.05
CLASSES = 10   # the CNN's (CIFAR-10)


# ----------------------------------------------------------------------------- child side

def build_model(args):
    import torch
    import torch.nn as nn

    from optpass.demo.models import LMConfig, TinyLM

    class DPLM(TinyLM):
        """TinyLM that Opacus supports: positions as nn.Embedding, untied head."""

        def __init__(self, cfg):
            super().__init__(cfg)
            del self.pos
            self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
            nn.init.normal_(self.pos.weight, std=0.02)
            self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)   # untied

        def forward(self, tokens):
            b, t = tokens.shape
            positions = torch.arange(t, device=tokens.device).expand(b, t).contiguous()
            x = self.embed(tokens) + self.pos(positions)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    cfg = LMConfig(vocab=args.vocab, d_model=args.d_model, n_heads=args.n_heads,
                   n_layers=args.n_layers, seq_len=args.t)
    torch.manual_seed(0)
    return DPLM(cfg), cfg


def build_cnn(args):
    """Opacus's CIFAR-10 CNN (``examples/cifar10.py``'s ``convnet``): four 3x3 convolutions (3-32-64-64-128
    channels, ReLU, average pooling), a Linear head over 10 classes; images 3x32x32."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    layers = []
    for cin, cout in ((3, 32), (32, 64), (64, 64), (64, 128)):
        layers += [nn.Conv2d(cin, cout, kernel_size=3, stride=1, padding=1), nn.ReLU()]
        layers.append(nn.AvgPool2d(kernel_size=2, stride=2) if cout != 128 else nn.AdaptiveAvgPool2d((1, 1)))
    return nn.Sequential(*layers, nn.Flatten(start_dim=1, end_dim=-1), nn.Linear(128, CLASSES, bias=True))


def build_vision(args):
    """``--model resnet``: optpass.demo.vision.SmallResNet (GroupNorm, 3x3 convolutions and strided 1x1
    shortcuts); ``--model vit``: TinyViT (4x4 patches by a strided Conv2d, 2 blocks, width 64); ``--model mlp``:
    a 256-256-256-10 MLP on 256 features; ``--model pointwise``: a 1x1 Conv2d 256 -> 256 on 256x8x8 inputs and a
    Linear head. Images 3x32x32, 10 classes."""
    import torch
    import torch.nn as nn

    from optpass.demo.vision import SmallResNet, TinyViT

    torch.manual_seed(0)
    if args.model == "pointwise":           # one 1x1 convolution, as a ResNet bottleneck's or MobileNet's
        return nn.Sequential(nn.Conv2d(256, 256, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(256, CLASSES))
    if args.model == "mlp":
        return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, CLASSES))
    widths = tuple(int(w) for w in args.widths.split(","))
    return SmallResNet(CLASSES, widths) if args.model == "resnet" else TinyViT(CLASSES)


# how the DP step spells the per-sample norm (--norm): the docs', Opacus's clip_and_accumulate, torch.linalg's
NORM_SPELLINGS = ("docs", "opacus", "vector_norm")


def per_sample_norms(grads, spelling: str):
    """[B] norms of the per-sample gradients ``grads``, spelled as ``spelling`` says."""
    import torch

    if spelling == "opacus":
        return torch.stack([g.reshape(len(g), -1).norm(2, dim=-1) for g in grads], dim=1).norm(2, dim=1)
    if spelling == "vector_norm":
        return torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads], dim=1), dim=1)
    return torch.stack([g.flatten(1).pow(2).sum(1) for g in grads]).sum(0).sqrt()


def opacus_norms(model, x, y, vocab):
    """Opacus's per-sample gradient norms (hooks, GradSampleModule) of the DP step's loss at ``model``'s
    parameters, on a copy of the model."""
    import copy

    import torch
    import torch.nn.functional as F
    from opacus import GradSampleModule

    gsm = GradSampleModule(copy.deepcopy(model), loss_reduction="mean")
    F.cross_entropy(gsm(x).reshape(-1, vocab), y.reshape(-1)).backward()
    return torch.stack([p.grad_sample.reshape(len(x), -1).pow(2).sum(1) for p in gsm.parameters()]).sum(0).sqrt()


def make_nonprivate_step(model, opt, vocab, noise_batch=None):
    """loss.backward(); opt.step(). With noise_batch = B: DP-SGD's Gaussian noise (and nothing else of
    DP-SGD) added to every gradient before the step, the noise-floor variant."""
    import torch
    import torch.nn.functional as F

    def step(x, y):
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        if noise_batch is not None:
            for p in model.parameters():
                p.grad.add_(torch.randn_like(p), alpha=NOISE * MAX_GRAD_NORM / noise_batch)
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    return step


def make_vmap_dp_step(model, opt, vocab, batch, norm="docs"):
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call, grad, vmap

    def loss_of_params(params, x, y):
        logits = functional_call(model, params, (x.unsqueeze(0),))
        return F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))

    def clipped_noisy_gradients(x, y):
        params = {k: v.detach() for k, v in model.named_parameters()}
        per_sample = vmap(grad(loss_of_params), in_dims=(None, 0, 0))(params, x, y)
        norms = per_sample_norms(list(per_sample.values()), norm)
        coef = (MAX_GRAD_NORM / (norms + 1e-6)).clamp(max=1.0)
        for name, p in model.named_parameters():
            p.grad = (torch.einsum("b,b...->...", coef, per_sample[name])
                      + NOISE * MAX_GRAD_NORM * torch.randn_like(p)) / batch
        return norms

    # norms are computed before opt.step() and per_sample is not referenced after it:
    # values alive across the optimizer's graph break would become graph outputs.
    def dp_step(x, y):
        norms = clipped_noisy_gradients(x, y)
        opt.step()
        opt.zero_grad()
        return norms
    return dp_step


def interleaved_optpass_inductor(args, model, batches, vocab, info) -> None:
    """vmap-optpass and vmap-inductor in ONE process on two copies of the model, one step of each in
    turn (``--steps`` pairs after ``--warmup``): on a shared machine both see the same load. Reports
    each one's median step and the median of the pairs' time ratios (optpass / inductor)."""
    import copy

    import torch

    steps = {}
    for backend in ("inductor", "optpass"):
        replica = copy.deepcopy(model)
        opt = torch.optim.SGD(replica.parameters(), lr=LR)
        steps[backend] = torch.compile(make_vmap_dp_step(replica, opt, vocab, args.batch, args.norm), backend=backend)
    for i in range(args.warmup):
        for step in steps.values():
            step(*batches[i % len(batches)])
    times = {backend: [] for backend in steps}
    for i in range(args.steps):
        for backend, step in (steps.items() if i % 2 == 0 else reversed(steps.items())):
            t0 = time.perf_counter()
            step(*batches[i % len(batches)])
            times[backend].append(time.perf_counter() - t0)
    ratios = [o / n for o, n in zip(times["optpass"], times["inductor"])]
    info.update(step_s={b: statistics.median(t) for b, t in times.items()}, times=times,
                pair_ratio=statistics.median(ratios))
    emit_result(info)


def child(args) -> None:
    import torch
    import torch.nn as nn

    import optpass

    torch.set_num_threads(args.threads)
    live = CPUTensorBytes()
    live.load()
    g = torch.Generator().manual_seed(1)
    if args.model in ("cnn", "resnet", "vit", "mlp", "pointwise"):
        model = build_cnn(args) if args.model == "cnn" else build_vision(args)
        cfg = argparse.Namespace(vocab=CLASSES)
        shape = {"mlp": (256,), "pointwise": (256, 8, 8)}.get(args.model, (3, 32, 32))
        batches = [(torch.randn(args.batch, *shape, generator=g),
                    torch.randint(0, CLASSES, (args.batch,), generator=g)) for _ in range(4)]
    else:
        model, cfg = build_model(args)
        data = [torch.randint(0, cfg.vocab, (args.batch, args.t + 1), generator=g) for _ in range(4)]
        batches = [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]
    n_params = sum(p.numel() for p in model.parameters())
    info: dict = {"variant": args.child, "T": args.t, "params": n_params}
    variant = args.child

    if variant == "interleaved":
        interleaved_optpass_inductor(args, model, batches, cfg.vocab, info)
        return
    if variant == "nonprivate":
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        step = torch.compile(make_nonprivate_step(model, opt, cfg.vocab), backend="inductor")
    elif variant == "noise-floor":
        torch._inductor.config.fallback_random = True
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        step = torch.compile(make_nonprivate_step(model, opt, cfg.vocab, noise_batch=args.batch), backend="inductor")
    elif variant in ("vmap-inductor", "vmap-optpass"):
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        backend = "inductor" if variant == "vmap-inductor" else "optpass"
        options = {"dp_materialize": args.dp_materialize} if backend == "optpass" else None
        step = torch.compile(make_vmap_dp_step(model, opt, cfg.vocab, args.batch, args.norm), backend=backend,
                             options=options)
    elif variant == "opacus-hooks":
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        gsm = GradSampleModule(model, loss_reduction="mean")
        opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=LR), noise_multiplier=NOISE,
                          max_grad_norm=MAX_GRAD_NORM, expected_batch_size=args.batch, loss_reduction="mean")
        criterion = nn.CrossEntropyLoss()

        def step(x, y):
            loss = criterion(gsm(x).reshape(-1, cfg.vocab), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
    elif variant == "opacus-ghost":
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

        gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=MAX_GRAD_NORM, use_ghost_clipping=True,
                                                   loss_reduction="mean")
        opt = DPOptimizerFastGradientClipping(torch.optim.SGD(gsm.parameters(), lr=LR), noise_multiplier=NOISE,
                                              max_grad_norm=MAX_GRAD_NORM, expected_batch_size=args.batch,
                                              loss_reduction="mean")
        criterion = DPLossFastGradientClipping(gsm, opt, nn.CrossEntropyLoss(), loss_reduction="mean")

        def step(x, y):
            logits = gsm(x)
            loss = criterion(logits.reshape(-1, cfg.vocab), y.reshape(-1), shape=logits.shape)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
    else:
        raise SystemExit(f"unknown variant {variant}")

    if variant == "vmap-optpass":
        reference = opacus_norms(model, *batches[0], cfg.vocab)
        optpass.report.clear_reports()
        with optpass.keep_graphs():
            norms = step(*batches[0])
        info["norms_vs_opacus"] = ((norms - reference).abs().max() / reference.abs().max()).item()
        applied, norm_ops, est = [], 0, None
        for r in optpass.recent_reports():
            for p in r.passes:
                if p.name == "per_sample_grad_norm":
                    applied.append(p.status)
            if r.graph_after is not None:
                norm_ops += sum(1 for n in r.graph_after.nodes
                                if n.target in (torch.ops.optpass.per_sample_grad_sq_norm.default,
                                                torch.ops.optpass.embedding_per_sample_grad_sq_norm.default,
                                                torch.ops.optpass.conv_per_sample_grad_sq_norm.default))
            if r.memory_before is not None and r.memory_after is not None and est is None and norm_ops:
                est = (r.memory_before.peak_bytes, r.memory_after.peak_bytes)
        info.update(pass_status=applied, norm_ops=norm_ops, est_peak_before=est and est[0],
                    est_peak_after=est and est[1])
        # keep_graphs() made the reports hold the step's graphs (explain's data); a user who
        # does not ask for them does not keep them: drop them before measuring
        optpass.report.clear_reports()
        gc.collect()
        warmup = args.warmup - 1
    else:
        warmup = args.warmup
    for i in range(warmup):
        step(*batches[i % len(batches)])

    graphs = graph_count()
    rss_pre = proc_status_kib("VmRSS") * 1024
    live.start()
    info["hwm_reset"] = reset_peak_rss()
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        step(*batches[i % len(batches)])
        times.append(time.perf_counter() - t0)
    info.update(step_s=statistics.median(times), times=times, live_peak=live.stop()["peak_bytes"],
                vmhwm=proc_status_kib("VmHWM") * 1024,
                rss_pre=rss_pre, rss_end=proc_status_kib("VmRSS") * 1024,
                ru_maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                recompiled=graph_count() != graphs)
    emit_result(info)


# ----------------------------------------------------------------------------- parent side

def run_variant(args, variant: str, t: int) -> dict:
    """One child; a failure or a timeout comes back as its status (the table goes on without it)."""
    cmd = child_command(__file__, child=variant, t=t, d_model=args.d_model, n_layers=args.n_layers,
                        n_heads=args.n_heads, vocab=args.vocab, batch=args.batch, threads=args.threads,
                        warmup=args.warmup, steps=args.steps, model=args.model, dp_materialize=args.dp_materialize,
                        norm=args.norm, widths=args.widths)
    with empty_cache_dir("dp") as cache:
        env = child_env(args.threads, cache, MALLOC_MMAP_THRESHOLD_=args.malloc_mmap_threshold or None,
                        TRITON_CACHE_DIR=os.path.join(cache, "triton"))
        try:
            result = run_child(cmd, env, args.timeout)
        except ChildError as e:
            if e.timed_out:
                return {"variant": variant, "T": t, "status": "timeout", "wall_s": args.timeout}
            tail = (e.stderr or e.stdout).strip().splitlines()[-8:]
            return {"variant": variant, "T": t, "status": "error", "error": "\n".join(tail), "wall_s": e.wall_s}
    result.update(status="ok", wall_s=result["process_wall_s"])
    return result


def median_of_runs(runs: list[dict]) -> dict:
    """The repeats of one variant (alternating processes) as one result: the median of their step
    times and live-tensor peaks, the rest from the last run that finished."""
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        return runs[-1]
    return {**ok[-1], "step_s": statistics.median(r["step_s"] for r in ok),
            "live_peak": statistics.median(r["live_peak"] for r in ok),
            "step_s_runs": [r["step_s"] for r in ok], "live_peak_runs": [r["live_peak"] for r in ok]}


def fmt_mb(b):
    return f"{b / 2**20:8.1f}" if b is not None else f"{'-':>8s}"


def print_table(t: int, results: dict[str, dict]) -> dict:
    base = results.get("nonprivate", {})
    ok_base = base.get("status") == "ok"
    print(f"\n=== {f'T = {t}' if t else 'one batch shape'} ===")
    print(f"{'variant':16s}{'step ms':>10s}{'x time':>8s}{'live MB':>9s}{'x live':>8s}{'VmHWM MB':>10s}{'x mem':>7s}"
          f"{'HWM-pre':>9s}{'maxrss MB':>11s}{'wall s':>8s}  notes")
    for v in VARIANTS:
        r = results.get(v)
        if r is None:
            continue
        if r["status"] != "ok":
            print(f"{v:16s}{r['status']:>10s}" + " " * 53 + (r.get("error", "").splitlines() or [""])[-1][:100])
            continue
        tr = r["step_s"] / base["step_s"] if ok_base else None
        mr = r["vmhwm"] / base["vmhwm"] if ok_base else None
        lr = r["live_peak"] / base["live_peak"] if ok_base else None
        r["time_ratio"], r["mem_ratio"], r["live_ratio"] = tr, mr, lr
        notes = []
        if v == "noise-floor":
            notes.append("not DP: non-private + the noise only (the floor of every DP variant)")
        if v == "vmap-optpass":
            notes.append(f"per_sample_grad_norm {','.join(sorted(set(r['pass_status']))) or 'not run'}, "
                         f"{r['norm_ops']} norm ops, norms vs Opacus {r['norms_vs_opacus']:.1e}")
            if r.get("est_peak_before"):
                notes.append(f"est. graph peak {r['est_peak_before'] / 2**20:.0f} -> "
                             f"{r['est_peak_after'] / 2**20:.0f} MB")
        if r.get("recompiled"):
            notes.append("RECOMPILED during timing")
        print(f"{v:16s}{r['step_s'] * 1e3:10.1f}{(f'{tr:.2f}' if tr else '-'):>8s}{fmt_mb(r['live_peak']):>9s}"
              f"{(f'{lr:.2f}' if lr else '-'):>8s}{fmt_mb(r['vmhwm']):>10s}"
              f"{(f'{mr:.2f}' if mr else '-'):>7s}{fmt_mb(r['vmhwm'] - r['rss_pre']):>9s}{fmt_mb(r['ru_maxrss']):>11s}{r['wall_s']:8.0f}  {'; '.join(notes)}")
    goals = {}
    o, i = results.get("vmap-optpass", {}), results.get("vmap-inductor", {})
    if o.get("status") == "ok" and i.get("status") == "ok":
        goals["vs_inductor_time"] = o["step_s"] / i["step_s"]
        goals["vs_inductor_live"] = o["live_peak"] / i["live_peak"]
        print(f"optpass / vmap-inductor: time {goals['vs_inductor_time']:.2f}x (goal <= 1.00), live-tensor peak "
              f"{goals['vs_inductor_live']:.2f}x (goal <= 0.80); norms vs Opacus {o['norms_vs_opacus']:.1e} "
              f"(goal <= 1e-5)")
    if ok_base and o.get("status") == "ok":
        dp_ok = {v: results[v] for v in DP_VARIANTS if results.get(v, {}).get("status") == "ok"}
        fastest = min(dp_ok, key=lambda v: dp_ok[v]["step_s"])
        smallest = min(dp_ok, key=lambda v: dp_ok[v]["vmhwm"])
        floor = results.get("noise-floor", {})
        goals = {"time_le_1.3x": o["time_ratio"] <= 1.3, "mem_le_1.1x": o["mem_ratio"] <= 1.1,
                 "noise_floor_time": floor.get("time_ratio"),
                 "fastest_dp": fastest == "vmap-optpass", "smallest_dp": smallest == "vmap-optpass",
                 "fastest_dp_variant": fastest, "smallest_dp_variant": smallest}
        print(f"goals: optpass time {o['time_ratio']:.2f}x <= 1.3x: {'MET' if goals['time_le_1.3x'] else 'NOT met'}; "
              f"memory {o['mem_ratio']:.2f}x <= 1.1x: {'MET' if goals['mem_le_1.1x'] else 'NOT met'}; "
              f"best DP variant: fastest={fastest}, smallest={smallest} "
              f"({'MET' if goals['fastest_dp'] and goals['smallest_dp'] else 'NOT met'})")
        if goals["noise_floor_time"]:
            print(f"noise floor (non-private + the noise alone): {goals['noise_floor_time']:.2f}x; optpass above it: "
                  f"{o['step_s'] / floor['step_s']:.2f}x")
    else:
        print("goals: cannot be judged (non-private or optpass run missing)")
    return goals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--norm", default="docs", choices=NORM_SPELLINGS,
                   help="how the DP step spells the per-sample norm: docs/dp_sgd.md's, Opacus's, torch.linalg's")
    p.add_argument("--model", default="lm", choices=("lm", "cnn", "resnet", "vit", "mlp", "pointwise"),
                   help="lm: DPLM (the default); cnn: Opacus's CIFAR-10 CNN on 3x32x32 images; resnet, vit: "
                        "optpass.demo.vision's SmallResNet and TinyViT on 3x32x32; mlp: 256-256-256-10; pointwise: a 1x1 "
                        "Conv2d 256 -> 256 on 8x8 (no --T)")
    p.add_argument("--widths", default="64,128,256", help="--model resnet: the three stages' widths")
    p.add_argument("--interleaved", action="store_true",
                   help="only optpass against plain Inductor, both in one process, one step of each in turn")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the variants this many times, alternating; each variant's median over the runs")
    p.add_argument("--T", default=None, help="comma-separated sequence lengths (default 16,128,512; --quick 16,64)")
    p.add_argument("--quick", action="store_true", help="d_model 64, 2 layers, T = 16,64")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--n-layers", type=int, default=None)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--timeout", type=float, default=600, help="seconds per child (default 600)")
    p.add_argument("--malloc-mmap-threshold", type=int, default=131072, help="0: glibc default")
    p.add_argument("--dp-materialize", default="auto", choices=("auto", "never"),
                   help="vmap-optpass's option dp_materialize (default auto)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--t", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.d_model is None:
        args.d_model = 64 if args.quick else 256
    if args.n_layers is None:
        args.n_layers = 2 if args.quick else 4
    if args.warmup is None:
        args.warmup = 6
    if args.steps is None:
        args.steps = 6
    if args.child:
        child(args)
        return

    ts = [int(t) for t in (args.T or ("16,64" if args.quick else "16,128,512")).split(",")]
    if args.model != "lm":
        ts = [0]    # one table; the vision models and the MLP have no sequence length
    variants = [v for v in args.variants.split(",") if v]
    model = ({"cnn": "Opacus's CIFAR-10 CNN (3x32x32)", "resnet": f"SmallResNet widths {args.widths}, GroupNorm (3x32x32)",
              "vit": "TinyViT, 4x4 patches, 2 blocks of width 64 (3x32x32)",
              "mlp": "MLP 256-256-256-10", "pointwise": "1x1 Conv2d 256 -> 256 on 256x8x8, Linear head"}[args.model] if args.model != "lm" else
             f"DPLM d_model={args.d_model} n_layers={args.n_layers} n_heads={args.n_heads} vocab={args.vocab} "
             f"(positions as nn.Embedding, untied head)")
    print(f"{model}, B={args.batch}, SGD, C={MAX_GRAD_NORM}, "
          f"noise={NOISE}, threads={args.threads}, warmup={args.warmup}, steps={args.steps}, "
          f"MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold or 'default'}")
    all_results, all_goals = {}, {}
    if args.interleaved:
        for t in ts:
            runs = [run_variant(args, "interleaved", t) for _ in range(args.repeat)]
            ok = [r for r in runs if r["status"] == "ok"]
            for r in runs:
                print(f"  {f'T={t}' if t else args.model}: " + (f"optpass {r['step_s']['optpass'] * 1e3:.1f} ms, inductor "
                      f"{r['step_s']['inductor'] * 1e3:.1f} ms, median pair ratio {r['pair_ratio']:.3f}"
                      if r["status"] == "ok" else f"{r['status']} {r.get('error', '')[-300:]}"), flush=True)
            if ok:
                print(f"  {f'T={t}' if t else args.model}: optpass / vmap-inductor time, median over {len(ok)} runs: "
                      f"{statistics.median(r['pair_ratio'] for r in ok):.3f} (goal <= 1.00)")
            all_results[t] = runs
        print_json({"interleaved": {str(t): [r.get("pair_ratio") for r in rs] for t, rs in all_results.items()}},
                   path=args.json)
        return
    for t in ts:
        runs = {v: [] for v in variants}
        for _ in range(args.repeat):
            for v in variants:
                runs[v].append(run_variant(args, v, t))
                r = runs[v][-1]
            print(f"  T={t} {v}: {r['status']}" + (f", {r['step_s'] * 1e3:.1f} ms/step, VmHWM "
                                                    f"{r['vmhwm'] / 2**20:.1f} MB" if r["status"] == "ok" else
                                                    f" {r.get('error', '')[-300:]}"), flush=True)
        results = {v: median_of_runs(rs) for v, rs in runs.items()}
        all_goals[t] = print_table(t, results)
        all_results[t] = results

    print("\nsummary:")
    for t, goals in all_goals.items():
        if not goals:
            print(f"  T={t}: goals not judged (a run failed or timed out)")
            continue
        judged = [k for k in ("time_le_1.3x", "mem_le_1.1x", "fastest_dp", "smallest_dp") if k in goals]
        met = [k for k in judged if goals[k]]
        missed = [k for k in judged if not goals[k]]
        floor = f" (noise floor {goals['noise_floor_time']:.2f}x)" if goals.get("noise_floor_time") else ""
        print(f"  T={t}: met {met or 'none'}; NOT met {missed or 'none'}{floor}")
    summary = {str(t): {v: {k: r.get(k) for k in ("status", "step_s", "vmhwm", "ru_maxrss", "time_ratio",
                                                   "mem_ratio", "live_peak", "live_ratio", "step_s_runs",
                                                   "norms_vs_opacus", "norm_ops", "est_peak_before", "est_peak_after")
                            if k in r} for v, r in res.items()} for t, res in all_results.items()}
    out = {"config": {k: getattr(args, k) for k in ("d_model", "n_layers", "n_heads", "vocab", "batch", "threads",
                                                     "warmup", "steps", "malloc_mmap_threshold")},
           "results": summary, "goals": {str(t): g for t, g in all_goals.items()}}
    print_json(out, {**out, "raw": {str(t): r for t, r in all_results.items()}}, args.json, indent=1)


if __name__ == "__main__":
    main()
