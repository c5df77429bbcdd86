"""Does this torch's gloo survive two functional collectives in flight at once? (docs/design.md §45)

For each pair of collectives (``--pairs``; ``ag``: ``all_gather_into_tensor``, ``rs``:
``reduce_scatter_tensor``, ``ar``: ``all_reduce``, ``ag-c10d``: c10d's asynchronous
``all_gather_into_tensor``, the one FSDP2 calls), 2 gloo ranks run ``--iters`` rounds of six
collectives where each starts before the previous one's wait, as a prefetching step graph would:
on the default group (gloo's two worker threads), and on the twin with one worker thread that
optpass runs a fully sharded model's collectives on (``optpass.process_groups``); and the same
one at a time on the default group. A rank killed by a signal (glibc's ``malloc(): unaligned tcache
chunk detected``, a segmentation fault) is reported as ``crashed``, with its last output line.

    python3 bench/gloo_collectives_in_flight.py                  # every pair, ~3 min
    python3 bench/gloo_collectives_in_flight.py --pairs ag ar    # some

On torch 2.13 (2 ranks, 2-core AMD EPYC) ``ag`` beside ``ag`` on two worker threads crashed a rank
in 9 of 10 runs (3,000 to 20,000 rounds), beside ``rs`` or ``ar`` in half the runs; ``ar``, ``rs`` and
``ag-c10d`` in pairs and every collective one at a time ran their rounds; on one worker thread
every pair ran every round (``ag``: 20,000 rounds in each of 4 runs). So optpass sends a fully
sharded model's collectives on gloo through the one-thread twin, and prefetches there too.
"""

from __future__ import annotations

import argparse
import sys

from _measure import ChildError, add_rank_flags, child_command, child_env, emit_result, init_gloo, print_json, run_ranks

KINDS = {"ag": ("ag", "ag"), "ag+rs": ("ag", "rs"), "ag+ar": ("ag", "ar"), "ar": ("ar", "ar"), "rs": ("rs", "rs"),
         "ag-c10d": ("ag-c10d", "ag-c10d")}


def child(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_group

    init_gloo(args.rank, args.world, args.port, timeout_s=120)
    functional, world = torch.ops._c10d_functional, args.world
    group = _get_default_group().group_name
    if args.one_thread:
        from optpass.process_groups import collective_group_name

        group = collective_group_name(_get_default_group(), "cpu")
    shards = [torch.randn(rows, 13, dtype=torch.float64) for rows in (7, 1, 7, 1, 3, 1)]

    def start(kind, x):
        if kind == "ag":
            return functional.all_gather_into_tensor(x, world, group)
        if kind == "rs":
            return functional.reduce_scatter_tensor(torch.cat([x] * world), "sum", world, group)
        if kind == "ar":
            return functional.all_reduce(x, "sum", group)
        return dist.all_gather_into_tensor(x.new_empty(x.shape[0] * world, *x.shape[1:]), x, async_op=True)

    def wait(handle):
        functional.wait_tensor(handle) if isinstance(handle, torch.Tensor) else handle.wait()

    kinds = KINDS[args.pair]
    for _ in range(args.iters):
        previous = start(kinds[0], shards[0])
        for i, x in enumerate(shards[1:], 1):
            if args.in_flight:
                current = start(kinds[i % 2], x)
                wait(previous)
            else:
                wait(previous)
                current = start(kinds[i % 2], x)
            previous = current
        wait(previous)
    dist.destroy_process_group()
    emit_result({"rounds": args.iters})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--iters", type=int, default=10000)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pair", default="ag", help=argparse.SUPPRESS)
    parser.add_argument("--in-flight", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--one-thread", action="store_true", help=argparse.SUPPRESS)
    add_rank_flags(parser)
    args = parser.parse_args()
    if args.child:
        return child(args)
    results = {}
    for pair in args.pairs:
        for in_flight, one_thread in ((True, False), (True, True), (False, False)):
            if one_thread and pair == "ag-c10d":      # c10d's own API runs on the user's groups only
                continue
            cmd = child_command(__file__, child=True, pair=pair, in_flight=in_flight, one_thread=one_thread,
                                iters=args.iters, world=2)
            key = (f"{pair} {'in flight at once' if in_flight else 'one at a time'} on "
                   f"{'one worker thread' if one_thread else 'two worker threads'}")
            try:
                run_ranks(cmd, 2, env=child_env(threads=1), timeout=600)
                results[key] = "ran every round"
            except ChildError as error:     # the first rank seen failing: the crashed one, or its peer
                crashed = (error.returncode or 0) < 0 or "Connection closed by peer" in error.stderr
                first = next((line for line in error.stderr.splitlines() if line.strip()), "")[:120]
                results[key] = f"{'crashed' if crashed else 'failed'} (a rank's exit {error.returncode}): {first}"
            print(f"{key}: {results[key]}", file=sys.stderr, flush=True)
    print_json(results, path=args.json)


if __name__ == "__main__":
    main()
