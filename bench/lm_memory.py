#!/usr/bin/env python3
"""How much memory ``optimizer_in_backward`` saves on the language models people train.

Models (B=4 sequences of T=32 tokens, AdamW lr 3e-4 as a tensor, weight decay 0.1):

* ``gpt-tied``   -- nanoGPT-style GPT (``optpass.demo.models.TinyLM``): 2 blocks, d=768, 12 heads,
  vocab 8192, the head tied to the token embedding (GPT-2's choice), 20.5M parameters;
* ``gpt-untied`` -- the same with an untied head, 26.8M;
* ``hf-gpt2``    -- Hugging Face ``GPT2LMHeadModel`` from a local config: 2 layers, d=768, the full
  vocabulary of 50257, tied, 53.2M;
* ``hf-llama``   -- Hugging Face ``LlamaForCausalLM`` from a local config: 2 layers, d=256, the full
  vocabulary of 32000, untied, 18.0M.

Precisions: ``fp32`` (fp32 parameters, fp32 AdamW) and ``bf16`` (bf16 parameters, AdamW on fp32
masters: optpass's ``master_weights``). Variants, each in a FRESH process with its own empty
Inductor cache:

* ``inductor`` -- fp32: ``torch.compile(step, backend="inductor")`` (optpass imported, so backward is
  traced into the step graph, as optpass's capture); bf16: ``backend="optpass"`` with
  ``master_weights`` and the update after backward (the same update, every gradient alive);
* ``optpass``  -- the same plus ``optimizer_in_backward``, Inductor lowering.

Each child counts live CPU tensor bytes from before the model is built (``CPUTensorBytes``,
what ``torch.cuda.max_memory_allocated`` is on a GPU): the **whole run's peak** (build, compile,
first step, warm-up, measured steps) and the **steady-step peak** (the measured steps alone; live
parameters and optimizer state included), each in bytes per parameter, plus the whole run's RSS
(VmHWM) and the first (compiling) call's time. The parent prints, per model and precision, the
saving as a fraction of the gradient bytes, the goal (0.9 x (gradient bytes - the largest
gradient's bytes): every gradient but the largest dead by the time the peak comes) and the step
time ratio (median of the measured steps).

Step time with ``--interleaved``: one process per model (fp32), Inductor and optpass (and, with
``--disable PASS``, optpass without that pass) compiled side by side and called in turn, each
round once and starting at the next variant, median of ``--steps`` rounds after ``--warmup``: load on the machine then slows every
variant alike, where separate processes' medians differ by +-15% between runs.

    python3 bench/lm_memory.py                         # every model, fp32 and bf16
    python3 bench/lm_memory.py --models gpt-tied --precisions fp32
    python3 bench/lm_memory.py --interleaved --steps 20 --disable logits_gradient_in_place
    python3 bench/lm_memory.py --precisions fp32 --optimizer adamw8bit   # torchao's 8-bit moments
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import (CPUTensorBytes, child_command, child_env, emit_result, empty_cache_dir, graph_count,  # noqa: E402
                      print_json, proc_status_kib, run_child, training_step)

MODELS = ("gpt-tied", "gpt-untied", "hf-gpt2", "hf-llama", "hf-llama-52m")
# What each step does (``--setup``): the whole step; accumulation over ACCUMULATION micro-steps (without and
# with clipping at 1.0); the whole step with the model's gradient checkpointing (Hugging Face models).
SETUPS = ("step", "accumulation", "accumulation-clip", "checkpointing")
ACCUMULATION = 4
PRECISIONS = ("fp32", "bf16")
KINDS = ("inductor", "optpass")
_MB = 2 ** 20


def build_model(name: str):
    """The model and its loss(tokens, targets) function, built under the current seed."""
    if name.startswith("gpt-"):
        from optpass.demo.models import LMConfig, TinyLM

        return _loss_of(name, TinyLM(LMConfig(vocab=8192, d_model=768, n_heads=12, n_layers=2, seq_len=32,
                                              tie_head=name == "gpt-tied")))
    import transformers

    transformers.logging.set_verbosity_error()
    if name == "hf-gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=768, n_head=12, n_positions=64, vocab_size=50257,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    elif name == "hf-llama":
        config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=4, vocab_size=32000,
                                          max_position_embeddings=64, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    elif name == "hf-llama-52m":
        config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                                          num_attention_heads=8, num_key_value_heads=8, vocab_size=32000,
                                          max_position_embeddings=64, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    else:
        raise SystemExit(f"unknown model {name!r}; choose from {MODELS}")
    return _loss_of(name, model)


def make_optimizer(name: str, params):
    """AdamW (lr 3e-4, weight decay 0.1): torch.optim's with a tensor lr, or one of torchao's low-bit
    ones (``adamw8bit``, ``adamw4bit``, ``adamwfp8``: its moments quantized, lr a tensor it makes)."""
    import torch

    if name == "adamw":
        return torch.optim.AdamW(params, lr=torch.tensor(3e-4), weight_decay=0.1)
    import torchao.optim

    classes = {"adamw8bit": torchao.optim.AdamW8bit, "adamw4bit": torchao.optim.AdamW4bit,
               "adamwfp8": torchao.optim.AdamWFp8}
    return classes[name](params, lr=3e-4, weight_decay=0.1)


def run_variant(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    import optpass

    model_name, precision, kind, setup = args.child.split("/")
    live = CPUTensorBytes()
    live.load()
    rss_after_imports_kib = proc_status_kib("VmRSS")
    live.start()
    with live.mark("build"):
        torch.manual_seed(0)
        model, loss_of = build_model(model_name)
        if precision == "bf16":
            model = model.to(torch.bfloat16)
        if setup == "checkpointing":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        params = list(model.parameters())
        opt = make_optimizer(args.optimizer, params)
        g = torch.Generator().manual_seed(1)
        vocab = model.config.vocab_size if hasattr(model, "config") else model.cfg.vocab
        data = [torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=g) for _ in range(4)]
    n_params = sum(p.numel() for p in params)
    gradient_bytes = sum(p.numel() * p.element_size() for p in params)
    largest_gradient_bytes = max(p.numel() * p.element_size() for p in params)

    options = {"optimizer": opt}
    if precision == "bf16":
        options["master_weights"] = torch.float32
    if kind == "optpass":
        options["optimizer_in_backward"] = True
        options["logits_in_chunks"] = args.logits_in_chunks
    clip = 1.0 if setup == "accumulation-clip" else None
    if setup.startswith("accumulation"):
        compiled = accumulation_step(loss_of, opt, params, kind, options, precision, clip)
    else:
        step = training_step(loss_of, opt)
        compiled = (torch.compile(step, backend="inductor") if kind == "inductor" and precision == "fp32"
                    else torch.compile(step, backend="optpass", options=options))

    warmup_s = []
    with live.mark("warm-up"):
        for i in range(args.warmup):
            tokens = data[i % len(data)]
            t0 = time.perf_counter()
            compiled(tokens[:, :-1], tokens[:, 1:])
            warmup_s.append(time.perf_counter() - t0)
    graphs = graph_count()
    times, losses = [], []
    with live.mark("steps"):
        for i in range(args.steps):
            tokens = data[(args.warmup + i) % len(data)]
            t0 = time.perf_counter()
            losses.append(float(compiled(tokens[:, :-1], tokens[:, 1:])))
            times.append(time.perf_counter() - t0)
    if graph_count() != graphs:
        raise SystemExit(f"{args.child}: a graph compiled during the measured steps (raise --warmup)")
    counted = live.stop()
    emit_result({
        "variant": args.child, "n_params": n_params, "gradient_bytes": gradient_bytes,
        "largest_gradient_bytes": largest_gradient_bytes,
        "whole_run_peak_bytes": counted["peak_bytes"], "peak_in": counted["peak_in"],
        "steady_peak_bytes": counted["marks"]["steps"]["peak_bytes"],
        "alive_at_peak_mib": [round(b / _MB, 1) for b in counted["alive_at_peak"][:8]],
        "vm_hwm_kib": proc_status_kib("VmHWM"), "rss_after_imports_kib": rss_after_imports_kib,
        "first_call_s": warmup_s[0], "median_step_s": statistics.median(times), "losses": losses,
        "grads_left": sum(p.grad is not None for p in params),
    })


def accumulation_step(loss_of, opt, params, kind: str, options: dict, precision: str, clip: float | None):
    """A callable of one micro-step (``x, y``): the loss divided by ACCUMULATION and backward, compiled,
    with the window's update at every ACCUMULATION-th call. Inductor (fp32): the micro-step compiled
    by Inductor, then ``clip_grad_norm_`` (with ``clip``), ``opt.step()`` and ``opt.zero_grad()`` as an
    Inductor user writes them, eagerly; bf16: optpass with ``master_weights``, the micro-steps compiled
    with the step's options and the last one with ``opt.step()`` in it (the update after backward).
    optpass: ``accumulation_steps`` with the update in backward (and ``clip_grad_norm``)."""
    import torch

    def micro_step(x, y):
        loss = loss_of(x, y) / ACCUMULATION
        loss.backward()
        return loss.detach()

    if kind == "optpass":
        options = {**options, "accumulation_steps": ACCUMULATION}
        if clip is not None:
            options["clip_grad_norm"] = clip
        return torch.compile(micro_step, backend="optpass", options=options)
    if precision == "fp32":
        micro = torch.compile(micro_step, backend="inductor")

        def update():
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            opt.zero_grad()
    else:
        micro = torch.compile(micro_step, backend="optpass", options=options)
        if clip is not None:
            options = {**options, "clip_grad_norm": clip}
        last = torch.compile(training_step(lambda x, y: loss_of(x, y) / ACCUMULATION, opt),
                             backend="optpass", options=options)
        update = None
    calls = [0]

    def call(x, y):
        calls[0] += 1
        if calls[0] % ACCUMULATION:
            return micro(x, y)
        if update is None:
            return last(x, y)
        out = micro(x, y)
        update()
        return out
    return call


def run_interleaved(args) -> None:
    """Median step time of each variant, called in turn in one process (see the module docstring)."""
    import copy

    import torch

    torch.set_num_threads(args.threads)
    import optpass  # noqa: F401  (registers the backend)

    print("| model | Inductor ms | optpass ms | optpass / Inductor |"
          + "".join(f" without {p} ms | ratio |" for p in args.disable))
    print("|---|---|---|---|" + "---|---|" * len(args.disable))
    for name in args.models:
        torch._dynamo.reset()      # the variants of every model share train_step's code object
        torch.manual_seed(0)
        base, _ = build_model(name)
        variants = {}
        for kind in ("inductor", "optpass", *(f"-{p}" for p in args.disable)):
            model = copy.deepcopy(base)
            _, loss_of = _loss_of(name, model)
            opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4), weight_decay=0.1)
            step = training_step(loss_of, opt)
            options = {"optimizer": opt, "optimizer_in_backward": True, "logits_in_chunks": args.logits_in_chunks}
            if kind.startswith("-"):
                options["disable_passes"] = [kind[1:]]
            variants[kind] = (torch.compile(step, backend="inductor") if kind == "inductor"
                              else torch.compile(step, backend="optpass", options=options))
        vocab = base.config.vocab_size if hasattr(base, "config") else base.cfg.vocab
        g = torch.Generator().manual_seed(1)
        data = [torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=g) for _ in range(4)]
        times = {kind: [] for kind in variants}
        kinds = list(variants)
        for i in range(args.warmup + args.steps):
            # each round starts at another variant: the one called right after Inductor's step ran
            # 10% slower than the same graph called later in the round (measured, Llama)
            for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
                compiled = variants[kind]
                tokens = data[i % len(data)]
                t0 = time.perf_counter()
                compiled(tokens[:, :-1], tokens[:, 1:])
                if i >= args.warmup:
                    times[kind].append(time.perf_counter() - t0)
        ms = {kind: statistics.median(t) * 1e3 for kind, t in times.items()}
        print(f"| {name} | {ms['inductor']:.1f} | {ms['optpass']:.1f} | {ms['optpass'] / ms['inductor']:.2f} |"
              + "".join(f" {ms['-' + p]:.1f} | {ms['-' + p] / ms['inductor']:.2f} |" for p in args.disable),
              flush=True)


def _loss_of(name: str, model):
    """(model, loss(tokens, targets)) for a copy of a model build_model made."""
    import torch.nn.functional as F

    if name.startswith("gpt-"):
        return model, model.loss

    def loss_of(tokens, targets):
        logits = model(input_ids=tokens).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    return model, loss_of


def _spawn(args, variant: str) -> dict:
    warmup, steps = args.warmup, args.steps
    if variant.split("/")[3].startswith("accumulation"):          # whole windows, each phase
        warmup, steps = (-(-n // ACCUMULATION) * ACCUMULATION for n in (warmup, steps))
    cmd = child_command(__file__, child=variant, batch=args.batch, seq_len=args.seq_len, steps=steps,
                        warmup=warmup, threads=args.threads, logits_in_chunks=args.logits_in_chunks,
                        optimizer=args.optimizer)
    with empty_cache_dir(variant) as cache_dir:
        return run_child(cmd, child_env(args.threads, cache_dir), args.child_timeout)


def run_parent(args) -> None:
    rows, full = [], {}
    print(f"| model | precision | setup | params | B/param Inductor -> optpass (steady) | whole run (optpass/Inductor) | saved / gradient bytes "
          "(steady) | goal | whole-run saved / floor | step time optpass/Inductor | first call (s) | RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, precision, setup in ((m, p, s) for m in args.models for p in args.precisions for s in args.setups):
        if setup == "checkpointing" and not model.startswith("hf-"):
            continue                       # the Hugging Face models' gradient_checkpointing_enable
        base, ours = (_spawn(args, f"{model}/{precision}/{kind}/{setup}") for kind in KINDS)
        full[f"{model}/{precision}/{setup}"] = {"inductor": base, "optpass": ours}
        n, grads, largest = ours["n_params"], ours["gradient_bytes"], ours["largest_gradient_bytes"]
        goal = 0.9 * (grads - largest)
        saved_steady = base["steady_peak_bytes"] - ours["steady_peak_bytes"]
        saved_whole = base["whole_run_peak_bytes"] - ours["whole_run_peak_bytes"]
        row = {
            "model": model, "precision": precision, "setup": setup, "n_params": n,
            "whole_run_optpass_over_inductor": ours["whole_run_peak_bytes"] / base["whole_run_peak_bytes"],
            "steady_bytes_per_param": [base["steady_peak_bytes"] / n, ours["steady_peak_bytes"] / n],
            "whole_run_bytes_per_param": [base["whole_run_peak_bytes"] / n, ours["whole_run_peak_bytes"] / n],
            "saved_steady_of_gradients": saved_steady / grads, "goal_of_gradients": goal / grads,
            "steady_goal_met": saved_steady >= goal,
            # the floor: every gradient but the largest dead at the peak (the 100M MLP: 1.06)
            "whole_run_saved_of_floor": saved_whole / (grads - largest),
            "step_time_ratio": ours["median_step_s"] / base["median_step_s"],
            "first_call_s": [base["first_call_s"], ours["first_call_s"]],
            "vm_hwm_mib": [base["vm_hwm_kib"] / 1024, ours["vm_hwm_kib"] / 1024],
            "alive_at_optpass_peak_mib": ours["alive_at_peak_mib"],
        }
        rows.append(row)
        print(f"| {model} | {precision} | {setup} | {n / 1e6:.1f}M | {row['steady_bytes_per_param'][0]:.2f} -> "
              f"{row['steady_bytes_per_param'][1]:.2f} | {row['whole_run_bytes_per_param'][0]:.2f} -> "
              f"{row['whole_run_bytes_per_param'][1]:.2f} ({row['whole_run_optpass_over_inductor']:.3f}x) | "
              f"{row['saved_steady_of_gradients']:.2f} | "
              f"{row['goal_of_gradients']:.2f} ({'met' if row['steady_goal_met'] else 'MISSED'}) | "
              f"{row['whole_run_saved_of_floor']:.2f} | {row['step_time_ratio']:.2f} | "
              f"{row['first_call_s'][0]:.0f} / {row['first_call_s'][1]:.0f} | "
              f"{row['vm_hwm_mib'][0]:.0f} / {row['vm_hwm_mib'][1]:.0f} |", flush=True)
    print_json({"rows": rows}, full, args.json)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    parser.add_argument("--precisions", type=lambda s: s.split(","), default=list(PRECISIONS))
    parser.add_argument("--setups", type=lambda s: s.split(","), default=["step"],
                        help=f"comma-separated, of {SETUPS}: the whole step, accumulation over {ACCUMULATION} "
                             "micro-steps (and with clip_grad_norm 1.0), the model's gradient checkpointing")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child-timeout", type=float, default=1200)
    parser.add_argument("--logits-in-chunks", action="store_true",
                        help="optpass with options logits_in_chunks (an untied fp32 head's logits made in chunks)")
    parser.add_argument("--interleaved", action="store_true",
                        help="step time only: every variant in one process, called in turn (fp32)")
    parser.add_argument("--disable", type=lambda s: s.split(","), default=[],
                        help="with --interleaved: also optpass without these passes")
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "adamw8bit", "adamw4bit", "adamwfp8"),
                        help="torch.optim's AdamW, or one of torchao's low-bit AdamWs (fp32 parameters only)")
    parser.add_argument("--json", default=None, help="write every child's numbers here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.child and args.optimizer != "adamw" and (args.interleaved or "bf16" in args.precisions):
        parser.error(f"--optimizer {args.optimizer}: fp32 parameters only (--precisions fp32), no --interleaved")
    if args.child:
        run_variant(args)
    elif args.interleaved:
        run_interleaved(args)
    else:
        run_parent(args)


if __name__ == "__main__":
    main()
