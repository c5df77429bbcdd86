"""fsdp on one GPU (NCCL, one rank): the graph gloo never runs, run where it does.

On gloo optpass gathers each parameter by itself; on NCCL each unit's parameters are one coalesced
all-gather (``all_gather_into_tensor_coalesced``), prefetched one unit ahead, compiled by Inductor
to CUDA kernels. CI has no GPU; this checks that graph on one:

1. ``equivalence``: a 4-block MLP (float64), ``data_parallel="fsdp"``, AdamW, 20 steps, the update in
   backward and after it, against eager torch.optim in the same process: the largest parameter
   difference, and what explain says of the gathers (one collective per unit, prefetched).
2. ``memory``: 8 x Linear(2048, 2048) fp32 (33.6M parameters), AdamW, 10 steps, each variant in a
   process of its own: ``torch.cuda.max_memory_allocated()`` over the whole run (never reset) for
   eager (no sharding), FSDP2 (``fully_shard`` per layer and the root) and optpass fsdp with the
   update in backward, and the step time. With one rank nothing is sharded: the difference is
   the gradients the update in backward frees as it goes (and what each keeps beside).

    python3 bench/fsdp_one_gpu.py [--json out.json]     # needs a CUDA device
    python3 bench/fsdp_one_gpu.py --device cpu          # the same on gloo, to check the script (no peaks)
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

from _measure import child_command, emit_result, free_port, print_json, run_child, training_step

WIDTH, DEPTH, BATCH, STEPS = 2048, 8, 64, 10


def _init(args) -> str:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    if args.device == "cuda":
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    return args.device


def _synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _train_step(model, opt):
    import torch.nn.functional as F

    return training_step(lambda x, y: F.mse_loss(model(x), y), opt)


def equivalence(args) -> None:
    import torch
    import torch.nn as nn

    import optpass

    device = _init(args)
    torch.set_default_dtype(torch.float64)
    results = {}
    for in_backward in (True, False):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)]).to(device)
        reference = copy.deepcopy(model)
        optpass.fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01, device=device), weight_decay=0.1)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.1)
        options = {"optimizer": opt, "data_parallel": "fsdp", "optimizer_in_backward": in_backward,
                   "lower": args.lower}
        g = torch.Generator(device=device).manual_seed(1)
        x, y = torch.randn(16, 64, device=device, generator=g), torch.randn(16, 64, device=device, generator=g)
        explained = str(optpass.explain(_train_step(model, opt), x, y, options=options))
        step = torch.compile(_train_step(model, opt), backend="optpass", options=options)
        for i in range(20):
            x, y = torch.randn(16, 64, device=device, generator=g), torch.randn(16, 64, device=device, generator=g)
            step(x, y)
            _train_step(reference, ref_opt)(x, y)
        # one rank: each shard is its whole parameter (full_state_dict would gather it with
        # torch.distributed.all_gather_single, which a torch older than 2.13 lacks)
        full = dict(model.named_parameters())
        worst = max((full[k].detach().reshape(v.shape) - v).abs().max().item() for k, v in reference.named_parameters())
        results["in_backward" if in_backward else "after_backward"] = {
            "max_param_diff_vs_eager": worst,
            "gathers": [line.strip() for line in explained.splitlines() if "all-gathered" in line]}
    torch.distributed.destroy_process_group()
    emit_result(results)


def memory(args) -> None:
    import torch
    import torch.nn as nn

    import optpass

    device = _init(args)
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)]
    model = nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())]).to(device)
    params = sum(p.numel() for p in model.parameters())
    if args.variant == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
    elif args.variant == "optpass-fsdp":
        optpass.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-4, device=device))
    step = _train_step(model, opt)
    if args.variant == "optpass-fsdp":
        step = torch.compile(step, backend="optpass", options={"optimizer": opt, "data_parallel": "fsdp",
                                                                "optimizer_in_backward": True, "lower": args.lower})
    g = torch.Generator(device=device).manual_seed(2)
    times = []
    for _ in range(STEPS):
        x, y = (torch.randn(BATCH, WIDTH, device=device, generator=g) for _ in range(2))
        _synchronize(device)
        began = time.perf_counter()
        step(x, y)
        _synchronize(device)
        times.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else float("nan")
    torch.distributed.destroy_process_group()
    emit_result({"params": params, "peak_MiB": round(peak / 2**20, 1), "bytes_per_param": round(peak / params, 2),
                 "first_step_s": round(times[0], 2), "step_ms": round(1000 * sorted(times[3:])[len(times[3:]) // 2], 2)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--lower", default="inductor", choices=("inductor", "eager"), help="optpass's lowering")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "equivalence":
        return equivalence(args)
    if args.child == "memory":
        return memory(args)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/fsdp_one_gpu.py needs a CUDA device (--device cpu checks the script on gloo)")
    child = dict(device=args.device, lower=args.lower)
    results = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "torch": torch.__version__,
               "lower": args.lower,
               "equivalence": run_child(child_command(__file__, child="equivalence", port=free_port(), **child),
                                        timeout=900)}
    print_json(results)
    results["memory"] = {variant: run_child(child_command(__file__, child="memory", variant=variant, port=free_port(),
                                                                      **child),
                                            timeout=900)
                         for variant in ("eager", "fsdp2", "optpass-fsdp")}
    base = results["memory"]["fsdp2"]
    results["memory"]["optpass_vs_fsdp2"] = {
        "peak": round(results["memory"]["optpass-fsdp"]["peak_MiB"] / base["peak_MiB"], 3),
        "step": round(results["memory"]["optpass-fsdp"]["step_ms"] / base["step_ms"], 3)}
    print_json(results, path=args.json)


if __name__ == "__main__":
    main()
