#!/usr/bin/env python3
"""What a rank holds when a model is built on the meta device and sharded (``optpass.fully_shard``).

Each of ``--world`` gloo ranks (fresh processes) builds a random-init Hugging Face ``LlamaForCausalLM``
under ``torch.device("meta")``, calls ``fully_shard`` on each decoder layer and then on the model
(FSDP2's calls), ``to_empty(device="cpu")``, seeds and runs the model's own ``init_weights()``, builds
fp32 AdamW, and runs one compiled step (``data_parallel="fsdp"``, update in backward). A counting
CPU allocator (``_measure.CPUTensorBytes``: every thread's frees, gloo's included) gives each rank's
live-tensor peak of the build (meta build through the optimizer) and of the first step, beside the
rank's parameter shards, the largest full parameter and the full model.

    python3 bench/fsdp_meta_init.py                     # 2 ranks, 4 layers of width 512, vocab 8192
    python3 bench/fsdp_meta_init.py --layers 8 --width 1024
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import (CPUTensorBytes, add_rank_flags, child_command, child_env, emit_result, init_gloo,  # noqa: E402
                      run_ranks, training_step)

_MB = 2 ** 20


def rank_main(args) -> None:
    import torch
    import transformers

    import optpass
    from optpass.fsdp.shard import shard_spec

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    init_gloo(args.rank, args.world, args.port, 600)
    live = CPUTensorBytes()
    live.load()
    live.start()
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.width,
                                      intermediate_size=int(args.width * 2.6875), num_hidden_layers=args.layers,
                                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256)
    with live.mark("build"):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        for layer in model.model.layers:
            optpass.fully_shard(layer)
        optpass.fully_shard(model)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        model.init_weights()
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-4))

    step = training_step(lambda tokens, labels: model(input_ids=tokens, labels=labels).loss, opt)
    compiled = torch.compile(step, backend="optpass",
                             options={"optimizer": opt, "data_parallel": "fsdp", "optimizer_in_backward": True})
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
    with live.mark("first_step"):
        compiled(tokens, tokens)
    counted = live.stop()
    full = [shard_spec(p).numel * p.element_size() for p in model.parameters()]
    emit_result({"rank": args.rank, "build_peak_bytes": counted["marks"]["build"]["peak_bytes"],
                 "first_step_peak_bytes": counted["marks"]["first_step"]["peak_bytes"],
                 "shard_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                 "largest_full_bytes": max(full), "full_model_bytes": sum(full),
                 "alive_at_peak_mib": [round(b / _MB, 1) for b in counted["alive_at_peak"][:8]]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_rank_flags(parser)
    args = parser.parse_args()
    if args.child:
        rank_main(args)
        return
    world = args.world if args.world > 1 else 2
    cmd = child_command(__file__, child=True, world=world, layers=args.layers, width=args.width, vocab=args.vocab,
                        batch=args.batch, seq=args.seq)
    ranks = run_ranks(cmd, world, env=child_env(1), timeout=1800)
    first = ranks[0]
    print(f"Llama, {args.layers} layers of width {args.width}, vocab {args.vocab}: full model "
          f"{first['full_model_bytes'] / _MB:.1f} MiB, largest parameter {first['largest_full_bytes'] / _MB:.1f} MiB, "
          f"{world} ranks\n")
    print("| rank | shards MiB | build peak MiB | build peak - shards (largest parameters) | first step peak MiB "
          "| first step peak - 3 x shards (largest parameters) |")
    print("|---|---|---|---|---|---|")
    for r in ranks:
        shards, largest = r["shard_bytes"], r["largest_full_bytes"]
        print(f"| {r['rank']} | {shards / _MB:.1f} | {r['build_peak_bytes'] / _MB:.1f} "
              f"| {(r['build_peak_bytes'] - shards) / largest:.2f} | {r['first_step_peak_bytes'] / _MB:.1f} "
              f"| {(r['first_step_peak_bytes'] - 3 * shards) / largest:.2f} |")
    print("\nJSON:", json.dumps(ranks))


if __name__ == "__main__":
    main()
