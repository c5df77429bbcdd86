"""What each rank runs in the ZeRO-1 tests (tests/test_zero1.py, tests/test_zero1_runtime.py); importable by spawned processes.

Every worker trains a small model with two param groups and uneven parameter
sizes (the last bias has 1 element: fewer than the ranks) on its slice of a
global batch, and compares against the same training in one process on the
whole batch, and against DDP + ZeroRedundancyOptimizer.
"""

from __future__ import annotations

import contextlib
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import optpass
import optpass.zero1
from optpass.passes.shard_optimizer import collectives_in

STEPS = 20
PER_RANK = 3
BUCKET_BYTES = 256          # float64: a few parameters per bucket, several buckets


def make_model(hidden: int = 9) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 4), nn.Tanh(), nn.Linear(4, 1))


def param_groups(model: nn.Module) -> list[dict]:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0, "lr": 0.02}]


OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, {"lr": 0.01}),
    "SGD": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.05, "initial_accumulator_value": 0.1}),   # state from its constructor
}


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    cls, kwargs = OPTIMIZERS[name]
    return cls(params, **kwargs)


# case "changing_batch": every rank's batch changes size between steps (a smaller last batch):
# Dynamo recompiles once with the batch symbolic, and the sharded graph must stay symbolic
CHANGING_PER_RANK = [3, 3, 2, 3, 2]      # no 1: Dynamo specializes a size of 1


def per_rank(step: int, case: dict | None) -> int:
    return CHANGING_PER_RANK[step % len(CHANGING_PER_RANK)] if (case or {}).get("changing_batch") else PER_RANK


def global_batch(step: int, world: int, case: dict | None = None):
    g = torch.Generator().manual_seed(1000 + step)
    n = per_rank(step, case) * world
    return torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g)


def local(batch, rank: int, world: int):
    x, y = batch
    n = x.shape[0] // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def make_step(model, opt):
    def train_step(x, y):
        loss = loss_fn(model, x, y)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    return train_step


def rel_diff(model_a, model_b) -> float:
    worst = 0.0
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
    return worst


def scheduler(opt, case: dict):
    """A StepLR halving every 5 steps if the case asks for one (lr changes mid-run), else None."""
    return torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5) if case.get("scheduler") else None


def clip(model, case: dict) -> float | None:
    """clip_grad_norm_ if the case clips; the norm it returns."""
    if case.get("clip") is not None:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"]).item()
    return None


def train_single_process(optimizer: str, world: int, steps: int = STEPS, case: dict | None = None,
                         norms: list | None = None) -> nn.Module:
    model = make_model()
    opt = make_optimizer(optimizer, param_groups(model))
    lr_schedule = scheduler(opt, case or {})
    for i in range(steps):
        x, y = global_batch(i, world, case)
        loss_fn(model, x, y).backward()
        norm = clip(model, case or {})
        if norms is not None:
            norms.append(norm)
        opt.step()
        opt.zero_grad()
        if lr_schedule is not None:
            lr_schedule.step()
    return model


def train_ddp_zero(rank: int, optimizer: str, world: int, case: dict) -> nn.Module:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = make_model()
    ddp = DistributedDataParallel(model)
    cls, kwargs = OPTIMIZERS[optimizer]
    groups = param_groups(model)
    opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=cls, weight_decay=0.1, **kwargs)
    opt.add_param_group(groups[1])
    lr_schedule = scheduler(opt, case)
    for i in range(STEPS):
        x, y = local(global_batch(i, world, case), rank, world)
        loss_fn(ddp, x, y).backward()
        clip(model, case)                      # DDP's gradients are averaged by now
        opt.step()
        opt.zero_grad()
        if lr_schedule is not None:
            lr_schedule.step()
    return model


def _plan_in(collectives: dict) -> str | None:
    """Which collective plan the rewritten graph holds."""
    if collectives["reduce_scatter"][0]:
        return "reduce_scatter"
    return "all_reduce" if collectives["broadcast"][0] else None


def _positions(ops: list[str], is_mm, is_reduce, is_wait) -> dict:
    """How many gradient GEMMs run after the first collective (a bucket's reduce) is started, and
    after the first update waits for its bucket's reduced gradients (the first wait)."""
    first_reduce = next(i for i, op in enumerate(ops) if is_reduce(op))
    first_wait = next(i for i, op in enumerate(ops) if is_wait(op))
    return {"mm_after_first_reduce": sum(map(is_mm, ops[first_reduce:])),
            "mm_after_first_update": sum(map(is_mm, ops[first_wait:]))}


def _graph_positions(graph) -> dict:
    ops = [getattr(n.target, "__name__", "") for n in graph.nodes]
    return _positions(ops, lambda op: op.startswith("mm"),
                      lambda op: op.startswith(("reduce_scatter", "all_reduce")), lambda op: op.startswith("wait_tensor"))


def _inductor_positions(codes: list[str]) -> dict | None:
    """The same count in the code Inductor generated for the sharded step (its own schedule)."""
    code = next((c for c in codes if "_c10d_functional" in c), None)
    if code is None:
        return None
    lines = code[code.index("def call("):].splitlines()
    return _positions(lines, lambda line: "extern_kernels.mm(" in line or "extern_kernels.addmm(" in line,
                      lambda line: "_c10d_functional.all_reduce" in line or "reduce_scatter_tensor" in line,
                      lambda line: "wait_tensor" in line)


def reduce_buffers_alive_at_once(code: str) -> tuple[int, int]:
    """(most reduce buffers alive at once, reduce buffers) in the schedule of Inductor's generated
    ``call``: a buffer lives from its ``empty_strided_cpu`` until its last name is deleted (a
    ``# reuse`` renames it, a ``# alias`` adds a name); a reduce buffer is one an ``all_reduce_``
    or ``reduce_scatter_tensor`` reads (it may be allocated long before, by the kernel that
    writes its first piece)."""
    lines = [line.strip() for line in code[code.index("def call("):].splitlines()]

    def walk(reduce: set) -> tuple[set, int]:
        storage: dict[str, int] = {}         # name -> storage id (in allocation order)
        names: dict[int, set] = {}            # storage id -> its live names
        alive, found, most = set(), set(), 0
        for line in lines:
            if m := re.match(r"(buf\d+) = empty_strided_cpu\(", line):
                storage[m[1]] = len(names)
                names[len(names)] = {m[1]}
                alive.add(storage[m[1]])
            elif (m := re.match(r"(buf\d+) = (?:reinterpret_tensor\()?(buf\d+)\b", line)) and m[2] in storage:
                storage[m[1]] = storage[m[2]]
                names[storage[m[2]]].add(m[1])
            if m := re.search(r"_c10d_functional\.(?:all_reduce_|reduce_scatter_tensor|all_to_all_single)\.default\("
                              r"(?:reinterpret_tensor\()?(buf\d+)", line):
                found.add(storage[m[1]])
            for name in re.findall(r"\bdel (buf\d+)", line):
                sid = storage.pop(name, None)
                if sid is not None:
                    names[sid].discard(name)
                    if not names[sid]:
                        alive.discard(sid)
            most = max(most, len(alive & reduce))
        return found, most

    reduce, _ = walk(set())
    return walk(reduce)[1], len(reduce)


@contextlib.contextmanager
def inductor_code(codes: list[str]):
    """Collect the code Inductor generates meanwhile (what torch._inductor.utils.run_and_get_code
    does, without its dynamo reset)."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        yield


def equivalence(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Train each case with optpass zero1 and compare (run on every rank)."""
    torch.set_default_dtype(torch.float64)
    results = []
    for case in cases:
        torch._dynamo.reset()
        model = make_model()
        opt = make_optimizer(case["optimizer"], param_groups(model))
        options = {"optimizer": opt, "data_parallel": "zero1", "lower": case.get("lower", "eager"),
                   "partition": case["partition"], "optimizer_in_backward": case.get("in_backward", False),
                   "bucket_bytes": BUCKET_BYTES, "collectives": case.get("collectives", "auto")}
        if case.get("clip") is not None:
            options["clip_grad_norm"] = case["clip"]
        step = torch.compile(make_step(model, opt), backend="optpass", options=options)
        lr_schedule = scheduler(opt, case)
        optpass.report.clear_reports()
        codes: list[str] = []
        norms = []                             # optpass.grad_norm(opt) after each clipped step
        with optpass.keep_graphs(), inductor_code(codes):
            for i in range(STEPS):
                step(*local(global_batch(i, world, case), rank, world))
                assert all(p.grad is None for p in model.parameters())
                if case.get("clip") is not None:
                    norms.append(optpass.grad_norm(opt).item())
                if lr_schedule is not None:
                    lr_schedule.step()
        steps = [r for r in optpass.recent_reports() if r.kind is optpass.GraphKind.STEP]
        report, first_step = steps[-1], steps[0]     # the steady graph; the one step 1 ran
        sharded = optpass.zero1.sharded_state(opt)
        reference_norms: list = []
        reference = train_single_process(case["optimizer"], world, case=case, norms=reference_norms)
        # unsharded state bytes: what torch.optim holds for the same model after one step
        unsharded_opt = make_optimizer(case["optimizer"], param_groups(train_single_process(case["optimizer"], world, 1)))
        for group in unsharded_opt.param_groups:
            for p in group["params"]:
                p.grad = torch.ones_like(p)
        unsharded_opt.step()
        unsharded = sum(t.numel() * t.element_size() for s in unsharded_opt.state.values()
                        for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
        state_bytes = sum(t.numel() * t.element_size() for s in sharded.shard_optimizer.state.values()
                          for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
        largest_bucket = max(b.chunk * world for b in sharded.layout.buckets) * 8
        results.append({
            **case,
            "vs_single_process": rel_diff(model, reference),
            "norms": norms, "single_process_norms": reference_norms if norms else [],
            "checksum": sum(p.detach().double().abs().sum().item() for p in model.parameters()),
            "vs_ddp_zero": rel_diff(model, train_ddp_zero(rank, case["optimizer"], world, case)),
            "state_bytes": state_bytes, "unsharded_state_bytes": unsharded,
            "state_bytes_per_element": unsharded // sum(p.numel() for p in model.parameters()),
            "bucket_state_bytes": largest_bucket * unsharded // (8 * sum(p.numel() for p in model.parameters())),
            "buckets": len(sharded.layout.buckets),
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "collectives": collectives_in(report.graph_after),
            "requested_collectives": case.get("collectives", "auto"),      # "collectives": what ran
            "plan": _plan_in(collectives_in(report.graph_after)),
            "owners_per_bucket": sum(1 for b in sharded.layout.buckets for r in range(world) if b.owned(r)),
            "ddp_bucket_padding_elements": sharded.layout.collective_elements() - sum(p.numel() for p in model.parameters()),
            "positions": {"graph": _graph_positions(report.graph_after),
                          **({"inductor": _inductor_positions(codes)} if case.get("lower") == "inductor" else {})},
            "notes": [n for o in report.passes for n in o.notes],
            # the first compile of the step, which ran at step 1, already holds the sharded update
            "first_step_fused": any(p.name == "shard_optimizer" and p.status == "applied"
                                    for p in first_step.passes),
            "step_compiles": sum(r.kind is optpass.GraphKind.STEP for r in optpass.recent_reports()),
        })
    return results


def checkpoint_phase(rank: int, world: int, phase: str, path: str, partition: str) -> list[list[float]] | None:
    """phase 'save': 20 steps, checkpoint after step 10. phase 'load': resume from it, steps 10..20."""
    torch.set_default_dtype(torch.float64)
    model = make_model()
    opt = make_optimizer("AdamW", param_groups(model))
    options = {"optimizer": opt, "data_parallel": "zero1", "lower": "eager", "partition": partition,
               "bucket_bytes": BUCKET_BYTES}
    step = torch.compile(make_step(model, opt), backend="optpass", options=options)
    start = 0
    if phase == "load":
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()                    # the checkpoint must bring the parameters back
        optpass.load_sharded_checkpoint(path, opt, model=model, partition=partition, bucket_bytes=BUCKET_BYTES)
        start = 10
    for i in range(start, STEPS):
        # the global batch is the same whatever the world size: 6 samples split over the ranks
        x, y = global_batch(i, 2)
        n = x.shape[0] // world
        step(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        if phase == "save" and i == 9:
            optpass.save_sharded_checkpoint(path, opt, model=model)
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def failing_rank(rank: int, world: int, bad_rank: int, linger_s: float = 0.0) -> str:
    """Rank `bad_rank` feeds a wrongly shaped batch at step 3; every rank must fail, none hang.

    With `linger_s` the failing rank stays alive (holding its connections) that long after
    its error, so the others can only learn of it from the process group's timeout."""
    torch.set_default_dtype(torch.float64)
    model = make_model()
    opt = make_optimizer("AdamW", param_groups(model))
    step = torch.compile(make_step(model, opt), backend="optpass",
                         options={"optimizer": opt, "data_parallel": "zero1", "lower": "eager"})
    for i in range(6):
        x, y = local(global_batch(i, world), rank, world)
        if i == 3 and rank == bad_rank:
            x = x[:, :5]                     # the model expects 6 features
            try:
                step(x, y)
            finally:
                time.sleep(linger_s)
        step(x, y)
    return "finished"


def different_models(rank: int, world: int) -> str:
    """Rank 1 builds a wider hidden layer: the compile-time check must name the difference."""
    torch.set_default_dtype(torch.float64)
    model = make_model(hidden=9 if rank == 0 else 10)
    opt = make_optimizer("AdamW", param_groups(model))
    step = torch.compile(make_step(model, opt), backend="optpass",
                         options={"optimizer": opt, "data_parallel": "zero1", "lower": "eager"})
    step(*local(global_batch(0, world), rank, world))
    return "trained"


def ranks_agree_on_parameters(rank: int, world: int) -> float:
    """Parameters start from rank 0's (as DDP does) even if ranks seed differently."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(rank)
    model = nn.Linear(6, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = torch.compile(make_step(model, opt), backend="optpass",
                         options={"optimizer": opt, "data_parallel": "zero1", "lower": "eager"})
    for i in range(3):
        step(*local(global_batch(i, world), rank, world))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    return max((e - flat).abs().max().item() for e in everyone)


def rewritten_graph_diff(rank: int, world: int) -> str:
    """The shard_optimizer pass's graph diff on this rank: a 2-layer MLP (11 float32 elements,
    44 bytes: one bucket of 64), SGD with momentum, even partition (2 ranks: 6 + 6 elements, one
    of them padding; the first weight is cut between the ranks), lower='eager'."""
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = torch.compile(make_step(model, opt), backend="optpass",
                         options={"optimizer": opt, "data_parallel": "zero1", "lower": "eager",
                                  "bucket_bytes": 64})
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    with optpass.keep_graphs():
        for _ in range(2):
            step(x, y)
    report = [r for r in optpass.recent_reports() if r.graph_after is not None][-1]
    return optpass.graph_diff(report.graph_before, report.graph_after, context=0)


def hf_causal_lm(rank: int, world: int, in_backward: bool, accumulate: bool = False) -> dict:
    """A tiny Llama (transformers, labels=) trained with zero1 on this rank's slice of each
    global batch, against the same model trained in one process on the whole batch.
    ``accumulate``: each update is 2 compiled micro-steps (backward, no opt.step()) and the step,
    the sequence length changing between them and between updates (8, 12, 16 tokens in turn:
    Dynamo recompiles each graph once with it symbolic)."""
    import copy

    import transformers

    torch._dynamo.reset()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).double()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    def make(m, o):
        def train_step(ids):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            out = loss.detach()
            o.step()
            o.zero_grad()
            return out
        return train_step

    def micro_step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    options = {"optimizer": opt, "data_parallel": "zero1", "lower": "eager", "optimizer_in_backward": in_backward}
    step = torch.compile(make(model, opt), backend="optpass", options=options)
    micro = torch.compile(micro_step, backend="optpass", options=options)
    eager = make(reference, ref_opt)
    optpass.report.clear_reports()
    losses = []
    for i in range(5):
        lengths = ((8, 12, 16), (12, 16, 8), (16, 8, 12))[i % 3] if accumulate else (8,)
        for k, length in enumerate(lengths):
            ids = torch.randint(0, 64, (2 * world, length), generator=torch.Generator().manual_seed(10 * i + k))
            last = k == len(lengths) - 1
            local_loss = (step if last else micro)(ids[2 * rank:2 * (rank + 1)])
            # the mean over ranks of each rank's mean token loss is the global batch's (equal token counts)
            dist.all_reduce(local_loss, op=dist.ReduceOp.AVG)
            if last:
                losses.append((local_loss.item(), eager(ids).item()))
            else:
                reference_loss = reference(input_ids=ids, labels=ids).loss
                reference_loss.backward()
                losses.append((local_loss.item(), reference_loss.item()))
        assert all(p.grad is None for p in model.parameters())
    steps = [r for r in optpass.recent_reports() if r.kind is optpass.GraphKind.STEP]
    sharded = [any(p.name == "shard_optimizer" and p.status == "applied" for p in r.passes) for r in steps]
    return {"losses": losses, "vs_single_process": rel_diff(model, reference),
            "kinds": [r.kind.value for r in optpass.recent_reports()],
            # every step graph is sharded; micro-steps (accumulate) are not
            "sharded": bool(steps) and (any(sharded) if accumulate else all(sharded)),
            "unsharded_compiles": len(sharded) - sum(sharded)}


def hf_causal_lm_runs(rank: int, world: int, runs: list[dict]) -> list[dict]:
    """Several hf_causal_lm runs (keyword arguments each) in one spawned group."""
    return [hf_causal_lm(rank, world, **run) for run in runs]

MICRO_BATCHES = 3           # gradient accumulation: micro-steps + the step, per update
ACCUMULATION_STEPS = 8


def micro_batch(step: int, micro: int, world: int):
    """Micro-batch `micro` of update `step`: a global batch of its own (PER_RANK rows per rank)."""
    return global_batch(1000 * (step + 1) + micro, world)


def train_single_process_accumulating(optimizer: str, world: int, case: dict) -> nn.Module:
    """The reference: one process, the whole of every micro-batch, .grad summed over them, as
    DDP with no_sync() on the micro-steps gives (each rank's sum, averaged over the ranks)."""
    model = make_model()
    opt = make_optimizer(optimizer, param_groups(model))
    for i in range(ACCUMULATION_STEPS):
        for k in range(MICRO_BATCHES):
            loss_fn(model, *micro_batch(i, k, world)).backward()
        clip(model, case)
        opt.step()
        opt.zero_grad()
    return model


def accumulation(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """zero1 with gradient accumulation: MICRO_BATCHES - 1 compiled micro-steps (backward, no
    opt.step()) and the compiled step, the same options; compared with single-process training."""
    torch.set_default_dtype(torch.float64)
    results = []
    for case in cases:
        torch._dynamo.reset()
        model = make_model()
        if case.get("ranks_differ"):        # zero1 starts every rank from rank 0's parameters
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * rank)
        opt = make_optimizer(case["optimizer"], param_groups(model))
        options = {"optimizer": opt, "data_parallel": "zero1", "lower": case.get("lower", "eager"),
                   "bucket_bytes": BUCKET_BYTES}
        if case.get("clip") is not None:
            options["clip_grad_norm"] = case["clip"]

        def micro_step(x, y):
            loss = loss_fn(model, x, y)
            loss.backward()
            return loss.detach()

        micro = torch.compile(micro_step, backend="optpass", options=options)
        step = torch.compile(make_step(model, opt), backend="optpass", options=options)
        optpass.report.clear_reports()
        grads_kept, collectives_in_micro = True, 0
        for i in range(ACCUMULATION_STEPS):
            for k in range(MICRO_BATCHES - 1):
                micro(*local(micro_batch(i, k, world), rank, world))
                grads_kept &= all(p.grad is not None for p in model.parameters())
            step(*local(micro_batch(i, MICRO_BATCHES - 1, world), rank, world))
            assert all(p.grad is None for p in model.parameters())
        reports = optpass.recent_reports()
        applied = [any(p.name == "shard_optimizer" and p.status == "applied" for p in r.passes)
                   for r in reports if r.kind is optpass.GraphKind.STEP]
        reference = train_single_process_accumulating(case["optimizer"], world, case)
        results.append({**case, "vs_single_process": rel_diff(model, reference), "grads_kept": grads_kept,
                        "sharded_compiles": sum(applied), "plain_compiles": len(applied) - sum(applied),
                        "checksum": sum(p.detach().double().abs().sum().item() for p in model.parameters())})
    return results


def resume_from_plain_state(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Steps 0..k-1 eagerly in one process on the whole batches (every rank alike, as if each loaded
    the same plain torch.optim checkpoint), then zero1 from step k on: against one process over all
    steps. case["rank_without_state"]: that rank clears its optimizer state first (it loaded none);
    case["frozen_while_eager"]: the last parameter takes no eager step (it holds no state);
    case["one_group"]: one param group (buckets never span two groups); case["eager_on_own_rows"]: each
    rank's eager steps see its own rows (no DDP), so the ranks' state differs in values only."""
    torch.set_default_dtype(torch.float64)
    results = []
    for case in cases:
        torch._dynamo.reset()
        model = make_model()
        opt = make_optimizer(case["optimizer"], model.parameters() if case.get("one_group") else param_groups(model))
        frozen = list(model.parameters())[-1] if case.get("frozen_while_eager") else None
        if frozen is not None:
            frozen.requires_grad_(False)                   # no gradient, so no state, in the eager steps
        for i in range(case["eager_steps"]):
            batch = global_batch(i, world)
            loss_fn(model, *(local(batch, rank, world) if case.get("eager_on_own_rows") else batch)).backward()
            opt.step()
            opt.zero_grad()
        if frozen is not None:
            frozen.requires_grad_(True)
        if case.get("rank_without_state") == rank:
            opt.state.clear()
        step = torch.compile(make_step(model, opt), backend="optpass", options={
            "optimizer": opt, "data_parallel": "zero1", "lower": "eager", "partition": case["partition"],
            "optimizer_in_backward": case.get("in_backward", False),
            "bucket_bytes": case.get("bucket_bytes", BUCKET_BYTES)})
        try:
            for i in range(case["eager_steps"], STEPS):
                step(*local(global_batch(i, world), rank, world))
        except Exception as error:            # noqa: BLE001  (the refusal is the result)
            results.append({**case, "error": f"{type(error).__name__}: {error}"})
            continue
        results.append({**case, "vs_single_process": rel_diff(model, train_single_process(case["optimizer"], world)),
                        "user_state_entries": len(opt.state)})
    return results


def resume_master_weights_checkpoint(rank: int, world: int) -> dict:
    """A bf16 run with master_weights and no zero1 saves opt.state_dict() (its fp32 masters and state
    under one entry) after 3 steps; every rank loads it into a fresh model and optimizer and goes on
    with zero1 (masters sharded, in backward). Against the same run uninterrupted (6 steps, one process
    on the whole batches): the largest parameter difference, and how far the masters are."""
    import copy

    def data(i, part=None):
        x, y = global_batch(i, world)
        if part is not None:
            x, y = local((x, y), rank, world)
        return x.bfloat16(), y.bfloat16()

    def compiled(model, opt, **options):
        return torch.compile(make_step(model, opt), backend="optpass", options={
            "optimizer": opt, "lower": "eager", "master_weights": torch.float32, **options})

    def from_scratch(steps: int):
        """A run with master_weights (no zero1) on the whole batches: the model and its optimizer."""
        torch._dynamo.reset()
        model = make_model().to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        step = compiled(model, opt)
        for i in range(steps):
            step(*data(i))
        return model, opt

    whole, whole_opt = from_scratch(6)
    first, first_opt = from_scratch(3)
    saved_model, saved_opt = copy.deepcopy(first.state_dict()), copy.deepcopy(first_opt.state_dict())
    torch._dynamo.reset()
    model = make_model().to(torch.bfloat16)
    model.load_state_dict(saved_model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    opt.load_state_dict(saved_opt)
    step = compiled(model, opt, data_parallel="zero1", optimizer_in_backward=True, bucket_bytes=BUCKET_BYTES)
    for i in range(3, 6):
        step(*data(i, part=True))
    masters = optpass.master_weights(whole_opt)
    worst_master = 0.0
    for index, pieces in optpass.zero1.sharded_state(opt).master_pieces().items():
        reference = masters[list(whole.parameters())[index]].reshape(-1)
        for start, stop, piece in pieces:
            worst_master = max(worst_master, ((piece - reference[start:stop]).abs().max() / reference.abs().max()).item())
    return {"params": max((a.float() - b.float()).abs().max().item() for a, b in zip(model.parameters(), whole.parameters())),
            "masters": worst_master, "user_state_entries": len(opt.state)}


def save_interrupted_then_bad_checkpoints(rank: int, world: int, path: str) -> dict:
    """A checkpoint saved after 3 steps; a second save that dies after writing its files (on every rank:
    the job is killed) must leave the first loadable; then three bad checkpoints, each refused with the
    model as it was; then a save that finishes replaces the first (tests/test_checkpoint_files.py)."""
    import os
    import shutil

    from optpass.zero1 import checkpoint as zero1_checkpoint

    torch.set_default_dtype(torch.float64)
    model = make_model()
    opt = make_optimizer("AdamW", param_groups(model))
    step = torch.compile(make_step(model, opt), backend="optpass",
                         options={"optimizer": opt, "data_parallel": "zero1", "lower": "eager"})
    params = lambda: [p.detach().clone() for p in model.parameters()]            # noqa: E731
    for i in range(3):
        step(*local(global_batch(i, world), rank, world))
    optpass.save_sharded_checkpoint(path, opt, model=model)
    saved = params()
    for i in range(3, 5):
        step(*local(global_batch(i, world), rank, world))
    trained = params()

    real_save = zero1_checkpoint.dcp.save

    def killed_after_writing(state, checkpoint_id, process_group):
        real_save(state, checkpoint_id=checkpoint_id, process_group=process_group)
        raise RuntimeError("killed")
    zero1_checkpoint.dcp.save = killed_after_writing
    try:
        optpass.save_sharded_checkpoint(path, opt, model=model)
    except RuntimeError as error:
        interrupted = str(error)
    finally:
        zero1_checkpoint.dcp.save = real_save
    left = sorted(os.listdir(os.path.dirname(path)))
    optpass.load_sharded_checkpoint(path, opt, model=model)
    loaded_previous = max((a - b).abs().max().item() for a, b in zip(params(), saved))

    refusals = {}
    bad = {"missing": path + "-missing", "no metadata": path + "-no-metadata", "cut": path + "-cut"}
    if rank == 0:
        shutil.copytree(path, bad["no metadata"])
        os.remove(os.path.join(bad["no metadata"], ".metadata"))
        shutil.copytree(path, bad["cut"])
        metadata = os.path.join(bad["cut"], ".metadata")
        with open(metadata, "r+b") as f:
            f.truncate(os.path.getsize(metadata) // 2)
    torch.distributed.barrier()
    before = params()
    for kind, where in bad.items():
        try:
            optpass.load_sharded_checkpoint(where, opt, model=model)
            refusals[kind] = "loaded"
        except optpass.OptpassError as error:
            refusals[kind] = str(error)
    unchanged = max((a - b).abs().max().item() for a, b in zip(params(), before))

    torch.distributed.barrier()
    if rank == 0:
        for where in bad.values():
            shutil.rmtree(where, ignore_errors=True)
    torch.distributed.barrier()
    with torch.no_grad():
        for p, value in zip(model.parameters(), trained):
            p.copy_(value)
    shared = path + "-shared"                                         # a directory with a user's own file in it
    if rank == 0:
        os.makedirs(shared)
        open(os.path.join(shared, "train.log"), "w").close()
    torch.distributed.barrier()
    try:
        optpass.save_sharded_checkpoint(shared, opt, model=model)
        refusals["shared directory"] = "saved"
    except optpass.OptpassError as error:
        refusals["shared directory"] = str(error)
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(shared)
    torch.distributed.barrier()
    optpass.save_sharded_checkpoint(path, opt, model=model)          # finishes: replaces the first
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    optpass.load_sharded_checkpoint(path, opt, model=model)
    loaded_new = max((a - b).abs().max().item() for a, b in zip(params(), trained))
    return {"interrupted": interrupted, "left_after_interrupted": left, "loaded_previous": loaded_previous,
            "refusals": refusals, "unchanged_by_refusals": unchanged, "loaded_new": loaded_new,
            "left_at_end": sorted(os.listdir(os.path.dirname(path)))}
