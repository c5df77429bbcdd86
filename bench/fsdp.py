#!/usr/bin/env python3
"""Fully sharded data parallel (``optpass.fully_shard`` + ``data_parallel="fsdp"``) versus torch's FSDP2
and optpass ZeRO-1, gloo ranks on CPU, fp32 AdamW (``--optimizer adamw8bit``: torchao's ``AdamW8bit``).

For each world size (``--worlds``, default 2 and 3) and each variant a set of spawned ranks trains
from a fresh model of the same seed (``--same-processes``: one set of ranks, one variant after the
other):

* ``fsdp2``                  -- ``torch.distributed.fsdp.fully_shard`` on every unit and the root
  (``reshard_after_forward=True``) + ``torch.optim.AdamW``, eager (FSDP2's hooks graph-break
  under torch.compile: docs/design.md §38);
* ``fsdp2-compile``          -- ``fsdp2`` with each unit compiled first (``unit.compile()``, Inductor),
  torchtitan's order: compile each block, then ``fully_shard`` it (FSDP2's hooks stay outside the
  compiled blocks);
* ``optpass-fsdp``           -- ``optpass.fully_shard`` on every unit and the root, ``torch.compile(backend="optpass",
  options={"optimizer": opt, "data_parallel": "fsdp", "optimizer_in_backward": True})`` (Inductor);
* ``optpass-fsdp-after``     -- the same with the update after backward;
* ``optpass-zero1``          -- the whole model on every rank, ``data_parallel="zero1"``, in backward;
* ``optpass-fsdp-bf16``      -- optpass fsdp in backward with bf16 parameters and
  ``master_weights=torch.float32`` (fp32 master shards);
* ``optpass-fsdp-eager``     -- ``optpass-fsdp`` with ``lower="eager"`` (the rewritten aten graph run
  op by op, no Inductor);
* ``fsdp2-hooks``            -- ``fsdp2`` with the update in post-accumulate-grad hooks on the sharded
  parameters, one AdamW per parameter (torchtitan's former optimizer-in-backward): no clipping.

With ``--tp T`` (a Llama) every variant runs on a 2-D mesh of ``world / T`` data-parallel by ``T``
tensor-parallel ranks: torchtitan's plan (``optpass.plans.hugging_face_llama``, sequence parallel) on
``mesh["tp"]``, then FSDP2's ``fully_shard`` or ``optpass.fully_shard`` over ``mesh["dp"]`` per unit
and the root; each dp rank trains on its own batch, the tp ranks of a dp rank on the same one, and
bytes per parameter are per rank: the full model's parameters / (dp x tp). Physics (fp32 AdamW):
16 bytes per parameter per rank for FSDP2 + TP, 12 with the update in backward.

Models (``--model``): ``mlp`` (``--depth`` units of ``Linear(w, w)`` + ReLU; default 8 x 2048^2,
33.6M parameters) or ``llama`` (a random-init Hugging Face ``LlamaForCausalLM``, ``--depth``
decoder layers of width ``--width``; needs transformers).

Reported per rank, per variant:

* **the training run's live-tensor peak**: the highest point of live tensor bytes (a counting CPU
  allocator, ``_measure.CPUTensorBytes``, which also sees what gloo's threads free) from the
  optimizer's construction through compile and every step, the sharded model included; in bytes
  per parameter of the full model. Beside it the peak of building the model (every rank builds
  the full model, then shards it: the same for every variant);
* the parameter bytes resident between steps, and optimizer-state bytes;
* step time: median over ``--steps`` steps after ``--warmup`` (compile included there); the first
  step's time beside it (optpass compiles there);
* the whole run's peak RSS of each rank's process (``VmHWM``, never reset: imports, gloo, compile
  and every step) and its RSS before the first variant: each variant runs in processes of its own,
  so the peak is that variant's alone, as a user who runs one sees it;
* for optpass fsdp: the communication the schedule overlaps, 1 - (time the step's thread is
  blocked in ``wait_tensor``, torch.profiler, 3 more steps) / (the step graph's all-gathers and
  reduce-scatters replayed alone on tensors of the same sizes);
* the goals of the issue: worst-rank peak of optpass-fsdp <= 0.70 x fsdp2's, <= 12/N bytes/param +
  three units' full parameters + activations; resident <= 1.1 x P/N; step time <= 1.00 x fsdp2;
  with bf16 parameters and fp32 masters <= 14/N bytes/param + the bf16 window.

Usage::

    python3 bench/fsdp.py                  # 2 and 3 ranks, the MLP (~5 min)
    python3 bench/fsdp.py --model llama    # a Llama of 8 layers, width 512
    python3 bench/fsdp.py --quick          # 8 x 256^2, 2 ranks
    python3 bench/fsdp.py --same-processes # every variant in the same processes (faster)
    python3 bench/fsdp.py --model llama --optimizer adamw8bit --variants fsdp2 optpass-fsdp optpass-zero1
    python3 bench/fsdp.py --model llama --depth 4 --vocab 32000 --worlds 2 --clip 1.0 \
        --variants fsdp2 optpass-fsdp       # torchtitan's step: clip_grad_norm_ / clip_grad_norm 1.0
    python3 bench/fsdp.py --model llama --tp 2 --worlds 4 --width 512 --depth 4 --vocab 16000 --batch 1 \
        --seq 128 --clip 1.0 --variants fsdp2 fsdp2-hooks optpass-fsdp   # FSDP + TP on dp 2 x tp 2
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

from _measure import (CPUTensorBytes, add_rank_flags, child_command, child_env, emit_result, init_gloo,
                      proc_status_kib, run_ranks, training_step, waited_per_step)

VARIANTS = ("fsdp2", "fsdp2-compile", "fsdp2-hooks", "optpass-fsdp", "optpass-fsdp-after", "optpass-zero1",
            "optpass-fsdp-bf16", "optpass-fsdp-eager")


def build(args):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    if args.model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        intermediate = int(args.width * 8 / 3)
        if args.tp > 1:                # the column-parallel projections split it: a multiple of 64 x tp
            intermediate = 64 * args.tp * round(intermediate / (64 * args.tp))
        config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=intermediate,
                             num_hidden_layers=args.depth, num_attention_heads=max(1, args.width // 64),
                             num_key_value_heads=max(1, args.width // 64), max_position_embeddings=args.seq)
        model = LlamaForCausalLM(config)
        return model, list(model.model.layers)
    layers = []
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    return model, [m for m in model if isinstance(m, nn.Linear)]


def batches(args, rank: int, world: int):
    """Each data-parallel rank its own batches; the tensor-parallel ranks of one the same."""
    import torch

    g = torch.Generator().manual_seed(1 + rank // args.tp)
    while True:
        if args.model == "llama":
            tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
            yield tokens, tokens
        else:
            yield torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g)


def loss_fn(args, model):
    import torch.nn.functional as F

    if args.model == "llama":
        return lambda x, y: model(input_ids=x, labels=y).loss
    return lambda x, y: F.mse_loss(model(x), y)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def make_optimizer(name: str, params):
    """fp32 AdamW (a tensor lr), or torchao's ``AdamW8bit`` (Adam's moments in 8 bits, block scales)."""
    import torch

    if name == "adamw":
        return torch.optim.AdamW(params, lr=torch.tensor(1e-4))
    import torchao.optim

    return torchao.optim.AdamW8bit(params, lr=1e-4)


def stored_bytes(tensor) -> int:
    """A state tensor's bytes: a torchao quantized moment's codes, scales and map, not its fp32 size."""
    from optpass.optim.low_bit_states import stored_bytes as held

    return held(tensor)


def local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def step_collectives(report) -> list[tuple]:
    """(op, input shapes, dtype) of every all-gather (one unit's coalesced gather too) and
    reduce-scatter in a step graph, in order."""
    import torch

    c10d = torch.ops._c10d_functional
    ops = (c10d.all_gather_into_tensor.default, c10d.all_gather_into_tensor_coalesced.default,
           c10d.reduce_scatter_tensor.default)
    found = []
    for node in report.graph_after.nodes:
        if node.target in ops:
            inputs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
            size, group = node.args[-2:]                 # every rank of its group (dp, tp or the world's)
            found.append((node.target, [tuple(i.meta["val"].shape) for i in inputs], inputs[0].meta["val"].dtype,
                          size, group))
    return found


def collectives_alone(collectives: list[tuple], repeats: int = 5) -> float:
    """Seconds the step's collectives take alone (the same calls on tensors of the same sizes, each
    waited for at once, nothing else running): median over ``repeats``."""
    import torch
    import torch.distributed as dist

    c10d = torch.ops._c10d_functional
    inputs = [(op, [torch.randn(shape).to(dtype) for shape in shapes], size, name)
              for op, shapes, dtype, size, name in collectives]
    times = []
    for _ in range(repeats):
        dist.barrier()
        began = time.perf_counter()
        for op, tensors, world, name in inputs:
            if op is c10d.all_gather_into_tensor_coalesced.default:
                for out in op(tensors, world, name):
                    c10d.wait_tensor(out)
            elif op is c10d.all_gather_into_tensor.default:
                c10d.wait_tensor(op(tensors[0], world, name))
            else:
                c10d.wait_tensor(op(tensors[0], "sum", world, name))
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def tensor_parallel(model, tp: int, world: int):
    """With ``tp`` > 1 (2-D): torchtitan's plan on ``mesh["tp"]`` of a ``(world / tp, tp)`` mesh, and
    ``mesh["dp"]`` returned to shard over; else None (the default group)."""
    if tp == 1:
        return None
    import optpass
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    optpass.plans.hugging_face_llama(model, mesh["tp"])
    return mesh["dp"]


def optpass_fully_shard(model, units, dp_mesh) -> None:
    """FSDP2's calls with ``optpass.fully_shard``: every unit, then the root."""
    import optpass

    for unit in units:
        optpass.fully_shard(unit, mesh=dp_mesh)
    optpass.fully_shard(model, mesh=dp_mesh)


def run_variant(variant: str, args, rank: int, world: int, live) -> dict:
    import torch
    import torch.distributed as dist

    import optpass
    from optpass.zero1.state import sharded_state

    torch._dynamo.reset()
    gc.collect()
    with live.mark(f"{variant}/before"):      # what earlier variants left alive (caches), not this one's
        pass
    with live.mark(f"{variant}/build"):
        model, units = build(args)
        if variant == "optpass-fsdp-bf16":
            model.to(torch.bfloat16)
        if args.float8:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                                       module_filter_fn=lambda module, name: name != "lm_head")
            if args.model == "mlp":                # the units are the Float8Linears now
                units = [m for m in model if isinstance(m, torch.nn.Linear)]
        full_params = sum(p.numel() for p in model.parameters())
        unit_bytes = max(tensor_bytes(u.parameters()) for u in units)
        dp_mesh = tensor_parallel(model, args.tp, world)
        if variant.startswith("fsdp2"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = dp_mesh if dp_mesh is not None else init_device_mesh("cpu", (world,))
            for unit in units:
                if variant == "fsdp2-compile":
                    unit.compile()
                fully_shard(unit, mesh=mesh, reshard_after_forward=True)
            fully_shard(model, mesh=mesh, reshard_after_forward=True)
        elif variant.startswith("optpass-fsdp"):
            optpass_fully_shard(model, units, dp_mesh)
        gc.collect()
    resident = tensor_bytes(local(p) for p in model.parameters())
    data = batches(args, rank, world)
    times = []
    with live.mark(f"{variant}/train", list_peak=True):
        opt = make_optimizer(args.optimizer, model.parameters())
        if variant == "fsdp2-hooks":
            opt = in_backward_hooks(args.optimizer, model)
            step = training_step(loss_fn(args, model), opt)
        elif variant.startswith("fsdp2"):
            step = training_step(loss_fn(args, model), opt, list(model.parameters()), args.clip)
        else:
            options = {"optimizer": opt, "data_parallel": "zero1" if variant == "optpass-zero1" else "fsdp",
                       "optimizer_in_backward": variant != "optpass-fsdp-after"}
            if args.clip is not None:
                options["clip_grad_norm"] = args.clip
            if variant == "optpass-fsdp-bf16":
                options["master_weights"] = torch.float32
            if variant == "optpass-fsdp-eager":
                options["lower"] = "eager"
            step = torch.compile(training_step(loss_fn(args, model), opt), backend="optpass", options=options)
        dtype = next(model.parameters()).dtype
        cast = (lambda t: t.to(dtype) if t.is_floating_point() else t)
        with optpass.keep_graphs():
            with live.mark(f"{variant}/first step"):
                began = time.perf_counter()
                step(*map(cast, next(data)))              # optpass: compiles here
                first_step_s = time.perf_counter() - began
            for _ in range(args.warmup - 1):
                step(*map(cast, next(data)))
        dist.barrier()
        with live.mark(f"{variant}/later steps"):
            for _ in range(args.steps):
                x, y = map(cast, next(data))
                dist.barrier()
                began = time.perf_counter()
                step(x, y)
                times.append(time.perf_counter() - began)
    holder = sharded_state(opt).shard_optimizer if variant == "optpass-zero1" else opt   # zero1 keeps its own
    holders = holder.optimizers if variant == "fsdp2-hooks" else [holder]
    state = sum(stored_bytes(local(v)) for h in holders for s in h.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    if variant == "optpass-fsdp-bf16":             # and the fp32 master shards
        state += tensor_bytes(optpass.master_weights(opt).values())
    result = {"resident_param_bytes": resident, "state_bytes": state, "full_params": full_params,
              "unit_bytes": unit_bytes, "step_s": statistics.median(times), "first_step_s": first_step_s}
    if variant.startswith("optpass-fsdp"):
        # communication the schedule overlaps: 1 - (time blocked in wait_tensor) / (collectives alone)
        reports = [r for r in optpass.recent_reports() if r.graph_after is not None and r.kind.value == "step"]
        collectives = step_collectives(reports[-1])
        estimate = reports[-1].memory_after      # the step graph's liveness estimate: where its peak is
        result["embedding_rows"] = [str(p) for p in reports[-1].passes if p.name == "embedding_gradient_rows"]
        result["estimated_peak"] = {"bytes": estimate.peak_bytes, "node": estimate.peak_node,
                                    "by_tag": estimate.bytes_by_tag_at_peak,
                                    "largest": [list(b) for b in estimate.largest(12)]}
        result["collectives"] = len(collectives)
        result["collectives_alone_s"] = collectives_alone(collectives)
        result["waited_s"] = waited_per_step(lambda: step(*map(cast, next(data))), 3)
    del model, opt, step, units, holder
    gc.collect()
    dist.barrier()
    return result


class _StepsInHooks:
    """What the step calls for ``fsdp2-hooks``: each parameter's optimizer steps in its
    post-accumulate-grad hook (torchtitan's former optimizer-in-backward), so ``step`` and
    ``zero_grad`` have nothing left to do."""

    def __init__(self, optimizers):
        self.optimizers = optimizers

    def step(self):
        pass

    def zero_grad(self):
        pass


def in_backward_hooks(name: str, model) -> _StepsInHooks:
    """One optimizer per (sharded) parameter, stepped and cleared in its post-accumulate-grad hook."""
    optimizers = {}
    for p in model.parameters():
        optimizers[p] = make_optimizer(name, [p])

        def hook(param):
            optimizers[param].step()
            optimizers[param].zero_grad()
        p.register_post_accumulate_grad_hook(hook)
    return _StepsInHooks(list(optimizers.values()))


def rank_main(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    init_gloo(args.rank, args.world, args.port, 600)
    live = CPUTensorBytes()         # live tensor bytes on every thread (gloo frees on its own), from here on
    live.load()
    rss_start = proc_status_kib("VmRSS") * 1024     # torch imported, gloo up, the allocator loaded
    live.start()
    results = {variant: run_variant(variant, args, args.rank, args.world, live) for variant in args.variants}
    rss_peak = proc_status_kib("VmHWM") * 1024      # the whole process's peak RSS, never reset
    stopped = live.stop()
    marks = stopped["marks"]
    for variant, result in results.items():
        before, build, train = (marks[f"{variant}/{m}"] for m in ("before", "build", "train"))
        # the training run's peak above what earlier variants in this process left alive (a user
        # runs one); building the full model before sharding is reported beside it
        left = before["end_bytes"]
        first, later = marks[f"{variant}/first step"], marks[f"{variant}/later steps"]
        # where the run's peak fell (the first step compiles; the later steps are the steady state)
        result.update(first_step_peak_bytes=first["peak_bytes"] - left, later_steps_peak_bytes=later["peak_bytes"] - left,
                      alive_at_peak=marks[f"{variant}/train"]["alive_at_peak"][:16])
        result.update(peak_bytes=train["peak_bytes"] - left, build_peak_bytes=build["peak_bytes"] - left,
                      left_by_earlier_variants_bytes=left, rss_start_bytes=rss_start, rss_peak_bytes=rss_peak,
                      variants_in_process=len(args.variants))
    emit_result(results)


def summarize(world: int, ranks: list[dict], args) -> dict:
    worst = {v: max(r[v]["peak_bytes"] for r in ranks) for v in args.variants}
    step = {v: max(r[v]["step_s"] for r in ranks) for v in args.variants}
    P = ranks[0][args.variants[0]]["full_params"]
    unit = ranks[0][args.variants[0]]["unit_bytes"]
    overlapped = {v: 1 - max(r[v]["waited_s"] for r in ranks) / max(r[v]["collectives_alone_s"] for r in ranks)
                  for v in args.variants if "waited_s" in ranks[0][v]}
    out = {"world": world, "params": P, "unit_bytes": unit, "worst_peak_bytes": worst, "step_s": step,
           "comm_overlapped": overlapped,
           "bytes_per_param": {v: worst[v] / P for v in args.variants},
           "resident_over_P_N": {v: max(r[v]["resident_param_bytes"] for r in ranks) / (4 * P / world)
                                 for v in args.variants},
           # per rank: the model's parameters over every rank (dp x tp)
           "bytes_per_param_per_rank": {v: worst[v] / (P / world) for v in args.variants},
           "ranks": ranks}
    if "fsdp2" in args.variants and "optpass-fsdp" in args.variants:
        out["peak_vs_fsdp2"] = worst["optpass-fsdp"] / worst["fsdp2"]
        out["step_vs_fsdp2"] = step["optpass-fsdp"] / step["fsdp2"]
        out["budget_bytes"] = 12 * P / world + 3 * unit          # + activations, reported beside
    if "fsdp2" in args.variants:
        out["vs_fsdp2"] = {v: {"peak": worst[v] / worst["fsdp2"], "step": step[v] / step["fsdp2"]}
                           for v in args.variants if v != "fsdp2"}
    if "optpass-fsdp-bf16" in args.variants:
        out["budget_bf16_bytes"] = 14 * P / world + 3 * unit / 2   # bf16 units
    return out


def s_dp(summary: dict, args) -> int:
    return summary["world"] // args.tp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--model", default="mlp", choices=("mlp", "llama"))
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--same-processes", action="store_true",
                        help="every variant in the same processes, one after the other (faster; the RSS "
                             "peak is then the process's, and a variant's step time can depend on the ones "
                             "before it: FSDP2's Llama step took 2.4x longer as the first of five)")
    parser.add_argument("--clip", type=float, default=None,
                        help="global-norm clipping: clip_grad_norm_ for fsdp2, options clip_grad_norm for optpass")
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "adamw8bit"),
                        help="torch.optim's AdamW, or torchao's AdamW8bit (every variant)")
    parser.add_argument("--float8", action="store_true",
                        help="torchao's Float8 training with FSDP2's float8 all-gather "
                             "(Float8LinearConfig(enable_fsdp_float8_all_gather=True)) on every Linear but a "
                             "Llama's head; 1-D only")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel degree: a 2-D mesh of world/tp x tp ranks (a Llama only)")
    parser.add_argument("--json", help="write every number here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_rank_flags(parser)
    args = parser.parse_args()
    if args.width is None:
        args.width = 512 if args.model == "llama" else 2048
    if args.child:
        rank_main(args)
        return
    if args.quick:
        args.width, args.worlds, args.steps = 256, [2], 3
    if args.tp > 1 and (args.model != "llama" or any(w % args.tp for w in args.worlds)
                        or {"optpass-zero1", "fsdp2-compile"} & set(args.variants)):
        parser.error("--tp needs --model llama, world sizes it divides, and no optpass-zero1 / fsdp2-compile "
                     "(zero1 is refused over a tensor-parallel model; a tensor-parallel block compiled alone "
                     "fails in backward on torch 2.13)")
    if args.float8 and (args.tp > 1 or {"optpass-zero1", "fsdp2-compile", "optpass-fsdp-bf16"} & set(args.variants)):
        parser.error("--float8 compares FSDP2's float8 all-gather with optpass's: 1-D (no --tp; optpass refuses the "
                     "float8 all-gather on a 2-D mesh), fsdp variants in fp32")
    summaries = []
    for world in args.worlds:
        cmd = child_command(__file__, child=True, world=world, model=args.model, width=args.width, depth=args.depth,
                            batch=args.batch, seq=args.seq, vocab=args.vocab, steps=args.steps, warmup=args.warmup,
                            threads=args.threads, clip=args.clip, optimizer=args.optimizer, tp=args.tp,
                            float8=args.float8)
        if not args.same_processes:   # a user runs one: a process per variant, so VmHWM is that variant's
            runs = [run_ranks(cmd + ["--variants", v], world, env=child_env(args.threads), timeout=3600)
                    for v in args.variants]
            ranks = [{k: v for run in runs for k, v in run[r].items()} for r in range(world)]
        else:
            ranks = run_ranks(cmd + ["--variants", *args.variants], world, env=child_env(args.threads), timeout=3600)
        summaries.append(summarize(world, ranks, args))
    print(f"model {args.model}: {summaries[0]['params'] / 1e6:.1f}M parameters, largest unit "
          f"{summaries[0]['unit_bytes'] / 2**20:.1f} MiB fp32")
    print("\n| ranks | variant | worst-rank peak MiB | bytes/param | bytes/param per rank | params resident / (P/N) "
          "| step ms |")
    print("|---|---|---|---|---|---|---|")
    for s in summaries:
        for v in args.variants:
            print(f"| {s['world']}{f' (dp {s_dp(s, args)} x tp {args.tp})' if args.tp > 1 else ''} | {v} "
                  f"| {s['worst_peak_bytes'][v] / 2**20:.1f} | {s['bytes_per_param'][v]:.2f} "
                  f"| {s['bytes_per_param_per_rank'][v]:.2f} | {s['resident_over_P_N'][v]:.2f} | {s['step_s'][v] * 1e3:.1f} |")
    print("\n| ranks | variant | whole-run peak RSS MiB | RSS at start MiB | first step (compile) s |")
    print("|---|---|---|---|---|")
    for s in summaries:
        for v in args.variants:
            worst = max(s["ranks"], key=lambda r: r[v]["rss_peak_bytes"])[v]
            alone = "" if worst["variants_in_process"] == 1 else f" (process of {worst['variants_in_process']} variants)"
            print(f"| {s['world']} | {v} | {worst['rss_peak_bytes'] / 2**20:.0f}{alone} | "
                  f"{worst['rss_start_bytes'] / 2**20:.0f} | {max(r[v]['first_step_s'] for r in s['ranks']):.1f} |")
    for s in summaries:
        for v, share in s["comm_overlapped"].items():
            r0 = s["ranks"][0][v]
            print(f"ranks {s['world']}: {v}: {r0['collectives']} collectives per step take "
                  f"{r0['collectives_alone_s'] * 1e3:.1f} ms alone; the step waits {r0['waited_s'] * 1e3:.1f} ms "
                  f"in wait_tensor: {share:.0%} of the communication overlapped (worst rank)")
    for s in summaries:
        for v in args.variants:
            worst = max(s["ranks"], key=lambda r: r[v]["peak_bytes"])[v]
            where = ("; tensors of 1 MiB or more alive at it (MiB, where each was made; * on another thread, "
                     "gloo's workers): " + ", ".join(f"{b / 2**20:.1f} ({made}){'*' if elsewhere else ''}"
                                                     for b, made, elsewhere in worst["alive_at_peak"]))
            print(f"ranks {s['world']}: {v}: worst rank's peak {worst['peak_bytes'] / 2**20:.1f} MiB: in its first "
                  f"step {worst['first_step_peak_bytes'] / 2**20:.1f}, in the later steps "
                  f"{worst['later_steps_peak_bytes'] / 2**20:.1f}{where}")
            estimate = s["ranks"][0][v].get("estimated_peak")
            if estimate:
                print(f"ranks {s['world']}: {v}: rank 0's step graph peaks (liveness estimate, graph inputs "
                      f"included) at {estimate['bytes'] / 2**20:.1f} MiB after {estimate['node']}; by kind: "
                      + ", ".join(f"{k} {b / 2**20:.1f}" for k, b in sorted(estimate["by_tag"].items()))
                      + "; largest: " + ", ".join(f"{n} {b / 2**20:.1f}" for n, b, _ in estimate["largest"]))
    for s in summaries:
        if "peak_vs_fsdp2" in s:
            print(f"ranks {s['world']}: optpass-fsdp / fsdp2: peak {s['peak_vs_fsdp2']:.3f} (goal <= 0.70), step time "
                  f"{s['step_vs_fsdp2']:.3f} (goal <= 1.00); 12/N bytes/param + 3 units = "
                  f"{s['budget_bytes'] / 2**20:.1f} MiB vs peak {s['worst_peak_bytes']['optpass-fsdp'] / 2**20:.1f} MiB")
    for s in summaries:
        for v, ratio in s.get("vs_fsdp2", {}).items():
            print(f"ranks {s['world']}: {v} / fsdp2: peak {ratio['peak']:.3f}, step time {ratio['step']:.3f}")
    for s in summaries:
        if "budget_bf16_bytes" in s:
            print(f"ranks {s['world']}: optpass-fsdp-bf16 (bf16 parameters, fp32 master shards): 14/N bytes/param + 3 "
                  f"bf16 units = {s['budget_bf16_bytes'] / 2**20:.1f} MiB vs peak "
                  f"{s['worst_peak_bytes']['optpass-fsdp-bf16'] / 2**20:.1f} MiB")
    brief = {f"{s['world']}": {k: s[k] for k in ("peak_vs_fsdp2", "step_vs_fsdp2", "bytes_per_param") if k in s}
             for s in summaries}
    print("JSON: " + json.dumps(brief))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "worlds": summaries}, f)


if __name__ == "__main__":
    sys.exit(main())
