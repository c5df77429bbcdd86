"""What each rank runs in tests/test_zero1_master_weights.py (importable by spawned processes).

data_parallel='zero1' with master_weights=torch.float32: every rank trains the
bf16/fp16 model of tests/zero1_workers.py (two param groups, a 1-element bias,
optionally an fp32 output gain) on its slice of each global batch, and compares
with Megatron's mixed-precision step over N data-parallel ranks written out in
one process (``DataParallelMegatron``): each rank's half-precision gradients of
its batch, cast to fp32, averaged over the ranks; torch.optim over fp32 master
copies; the masters rounded back into the model.
"""

from __future__ import annotations

import copy
import functools
import re
import time

import torch
import torch._inductor.config
import torch.distributed as dist
import torch.nn as nn

import optpass
import optpass.zero1
import zero1_workers as workers
from optpass.precision.masters import LOW_PRECISION
from optpass.passes.shard_optimizer import collectives_in
from test_master_weights import MegatronReference, ulps

STEPS = workers.STEPS
BUCKET_BYTES = 128          # fp32 reduce buffer: 32 elements, so the weights fill three buckets, the biases one

OPTIMIZERS = {              # tensor lrs: the update reads lr as an input, as the fused one does
    "AdamW": lambda groups: torch.optim.AdamW(groups, lr=torch.tensor(0.01)),
    "SGD": lambda groups: torch.optim.SGD(groups, lr=torch.tensor(0.05), momentum=0.9),
}


class Model(nn.Module):
    """zero1_workers' MLP in half precision (`linear`: only a Linear(6, 1)); with `gain`, an fp32
    output gain (its own master)."""

    def __init__(self, dtype: torch.dtype, gain: bool, linear: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.body = (nn.Sequential(nn.Linear(6, 1)) if linear else workers.make_model()).to(dtype)
        self.gain = nn.Parameter(torch.ones(1)) if gain else None

    def forward(self, x):
        out = self.body(x.to(self.body[0].weight.dtype)).float()
        return out if self.gain is None else out * self.gain


def make_optimizer(name: str, params: list) -> torch.optim.Optimizer:
    """Weights (weight decay 0.1) and biases + gain (no decay, their own lr): two param groups.
    `params` in model order (the masters of MegatronReference are)."""
    weights = [p for i, p in enumerate(params) if i < 6 and i % 2 == 0]
    others = [p for i, p in enumerate(params) if not (i < 6 and i % 2 == 0)]
    return OPTIMIZERS[name]([{"params": weights, "weight_decay": 0.1},
                             {"params": others, "weight_decay": 0.0, "lr": torch.tensor(0.02)}])


def batches(step: int, world: int) -> list:
    """Every rank's batch of global batch `step` (fp32 inputs: the model casts them)."""
    return [workers.local(workers.global_batch(step, world), r, world) for r in range(world)]


class DataParallelMegatron(MegatronReference):
    """Megatron's mixed-precision step over N data-parallel ranks, in one process: each rank's
    half-precision gradients of its batch are cast to fp32 and averaged over the ranks (Megatron
    with grad_reduce_in_fp32), [clip_grad_norm_ of those fp32 main gradients], torch.optim updates
    the fp32 masters, the model takes their rounding."""

    def __init__(self, model: nn.Module, make_optimizer, update: str = "eager", clip: float | None = None):
        super().__init__(model, make_optimizer, update)
        self.clip = clip

    def step(self, per_rank: list, loss_fn=workers.loss_fn):
        self.average_into_main_grads(per_rank, loss_fn, lambda loss: loss.backward())
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.masters, self.clip)
        self.update()
        self.opt.zero_grad()
        self.copy_masters_back()

    def average_into_main_grads(self, per_rank: list, loss_fn, backward) -> None:
        """Each rank's backward (``backward(loss)``) of its batch; the fp32 average of their
        gradients in the masters' ``.grad``; the model's gradients left None."""
        params = list(self.model.parameters())
        grads = []
        for x, y in per_rank:
            backward(loss_fn(self.model, x, y))
            grads.append([p.grad.float() for p in params])
            for p in params:
                p.grad = None
        for master, rank_grads in zip(self.masters, zip(*grads)):
            master.grad = sum(rank_grads[1:], rank_grads[0]) / len(per_rank)

    @torch.no_grad()
    def start_from(self, model: nn.Module, full: dict) -> None:
        """Take the parameters, masters and optimizer state of a zero1 run (gathered by `gather`)."""
        for index, (mine, theirs, master) in enumerate(zip(self.model.parameters(), model.parameters(),
                                                            self.masters)):
            mine.copy_(theirs)
            if master is not mine:
                master.copy_(full["masters"][index].view_as(master))
            self.opt.state[master] = {k: v.clone().view_as(master) if v.dim() else v.clone()
                                      for k, v in full["state"][index].items()}


def model_index(sharded, model: nn.Module) -> dict[int, int]:
    """Optimizer-order parameter index (zero1's) -> position in model.parameters()."""
    position = {id(p): i for i, p in enumerate(model.parameters())}
    return {i: position[id(p)] for i, (_, p) in enumerate(sharded.params)}


def gather(opt, model: nn.Module) -> dict:
    """Every rank's pieces of the fp32 masters and of the optimizer state, assembled into full flat
    tensors on every rank, by model position (tests only: optpass never gathers them)."""
    sharded = optpass.zero1.sharded_state(opt)
    mine = []
    for bucket in sharded.layout.buckets:
        shard = sharded.shards.get(bucket.index)
        if shard is None:
            continue
        state = sharded.shard_optimizer.state.get(shard, {})
        for s in bucket.segments[sharded.rank]:
            pieces = {k: v if v.dim() == 0 else v[s.offset: s.offset + s.numel] for k, v in state.items()}
            master = shard[s.offset: s.offset + s.numel] if sharded.has_master(bucket) else None
            mine.append((s.param, s.start, s.stop, master, pieces))
    everyone: list = [None] * sharded.pg.world
    dist.all_gather_object(everyone, mine, group=sharded.pg.group)
    where = model_index(sharded, model)
    params = list(model.parameters())
    # an fp32 parameter is its own master
    full: dict = {"masters": {i: p.detach().reshape(-1).clone() for i, p in enumerate(params)
                              if p.dtype not in LOW_PRECISION}, "state": {}}
    for pieces in everyone:
        for param, start, stop, master, state in pieces:
            index = where[param]
            numel = params[index].numel()
            if master is not None:
                full["masters"].setdefault(index, torch.zeros(numel))[start:stop] = master
            for key, value in state.items():
                if value.dim() == 0:
                    full["state"].setdefault(index, {})[key] = value
                else:
                    full["state"].setdefault(index, {}).setdefault(key, torch.zeros(numel, dtype=value.dtype))[start:stop] = value
    return full


def master_rel_diff(full: dict, reference: MegatronReference) -> float:
    """max |master - reference master| / max |reference master|, over every parameter (an fp32
    parameter is its own master)."""
    return max(((full["masters"][i] - m.detach().reshape(-1)).abs().max() / m.abs().max()).item()
               for i, m in enumerate(reference.masters))


def param_ulps(model: nn.Module, reference: MegatronReference) -> int:
    """Largest distance of the half-precision parameters in representable values (0: bitwise)."""
    return max(ulps(p, q) for p, q in zip(model.parameters(), reference.model.parameters())
               if p.dtype in LOW_PRECISION)


def compile_step(model, opt, case: dict):
    return torch.compile(workers.make_step(model, opt), backend="optpass", options={
        "optimizer": opt, "data_parallel": "zero1", "master_weights": torch.float32,
        "lower": case.get("lower", "eager"), "partition": case["partition"],
        "optimizer_in_backward": case.get("in_backward", False), "bucket_bytes": BUCKET_BYTES,
        "collectives": case.get("plan", "auto"), "clip_grad_norm": case.get("clip")})


def start_model(case: dict) -> nn.Module:
    return Model(DTYPES[case["dtype"]], case.get("gain", False), case.get("linear", False))


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def run_all(rank: int, world: int, jobs: list[tuple]) -> list:
    """Several jobs ``(function name, *args)`` in one spawned group: the ranks start, import torch
    and rendezvous once (tests/test_zero1_master_weights.py keeps the whole file to two groups)."""
    return [globals()[name](rank, world, *args) for name, *args in jobs]


def parity(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Train each case 20 steps with zero1 + master_weights against two Megatron-way references:

    * ``compiled``: torch.optim's step as torch.compile computes it (what optpass harvests), over
      the whole 20-step trajectory;
    * ``eager``: eager torch.optim, each step started from the zero1 run's gathered parameters,
      masters and state. A 20-step trajectory would compound the ~1e-5 difference of Adam's fp32
      formulation under torch.compile into flipped roundings (tests/test_master_weights.py).

    The Inductor case rounds at every bf16/fp16 cast as eager does (emulate_precision_casts):
    by default Inductor keeps fused pointwise math in fp32, so its gradients are not eager's."""
    results = []
    for case in cases:
        began = time.monotonic()
        torch._dynamo.reset()
        with torch._inductor.config.patch(emulate_precision_casts=case.get("lower") == "inductor"), \
                optpass.keep_graphs():        # no FX-graph-cache hit: the reports show the passes
            result = _parity_case(rank, world, case)
        results.append({**case, **result, "seconds": time.monotonic() - began})
    return results


def _parity_case(rank: int, world: int, case: dict) -> dict:
    start = start_model(case)
    model = copy.deepcopy(start)
    opt = make_optimizer(case["optimizer"], list(model.parameters()))
    make = functools.partial(make_optimizer, case["optimizer"])
    compiled_ref = DataParallelMegatron(copy.deepcopy(start), make, update="compiled", clip=case.get("clip"))
    eager_ref = DataParallelMegatron(copy.deepcopy(start), make, clip=case.get("clip"))
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5)
                  for o in (opt, compiled_ref.opt, eager_ref.opt)] if case.get("scheduler") else []
    step = compile_step(model, opt, case)
    optpass.report.clear_reports()
    eager_ulps, eager_master = 0, 0.0
    for i in range(case.get("steps", STEPS)):
        per_rank = batches(i, world)
        if i:
            eager_ref.start_from(model, gather(opt, model))
        step(*per_rank[rank])
        assert all(p.grad is None for p in model.parameters())
        compiled_ref.step(per_rank)
        eager_ref.step(per_rank)
        full = gather(opt, model)
        eager_ulps = max(eager_ulps, param_ulps(model, eager_ref))
        eager_master = max(eager_master, master_rel_diff(full, eager_ref))
        for scheduler in schedulers:
            scheduler.step()
    sharded = optpass.zero1.sharded_state(opt)
    half_buckets = [b for b in sharded.layout.buckets if sharded.has_master(b)]
    fp32_buckets = [b for b in sharded.layout.buckets if not sharded.has_master(b)]
    master_weights_error = _error_of(optpass.master_weights, opt)
    # an eager opt.step() with gradients would update the bf16 parameters and bypass the masters
    workers.loss_fn(model, *batches(0, world)[rank]).backward()
    eager_step_error = _error_of(opt.step)
    steps = [r for r in optpass.recent_reports() if r.kind is optpass.GraphKind.STEP]
    state = [t for s in sharded.shard_optimizer.state.values() for t in s.values()]
    return {
        "ulps": param_ulps(model, compiled_ref), "master": master_rel_diff(full, compiled_ref),
        "eager_ulps": eager_ulps, "eager_master": eager_master,
        # what this rank holds, in bytes: fp32 masters, optimizer state (elementwise; 0-d step counters)
        "master_bytes": sharded.master_bytes(),
        "state_bytes": sum(t.numel() * t.element_size() for t in state if t.dim()),
        "full_master_bytes": 4 * sum(p.numel() for p in model.parameters() if p.dtype in LOW_PRECISION),
        "elements": sum(p.numel() for p in model.parameters()),
        "largest_chunk": max(b.chunk for b in sharded.layout.buckets),
        "dtypes": sorted({str(t.dtype) for t in list(sharded.shards.values()) + state}),
        "user_optimizer_state": len(opt.state),
        "single_process_masters": opt in optpass.precision.masters._STORES,
        "master_weights_error": master_weights_error, "eager_step_error": eager_step_error,
        "collectives": collectives_in(steps[-1].graph_after),
        # a half-precision bucket's gradients are sent as they are (all-to-all) and summed in fp32 by their
        # owner (the first and the last rank do not send themselves their own row); an fp32 bucket (the
        # gain) is reduced as it is; every bucket is gathered in its parameters' dtype; reduce_scatter
        # plan: chunks padded, all_reduce plan (gloo's auto): unpadded
        "expected_bytes": {
            "all_to_all": {"reduce_scatter": sum(2 * (world * b.chunk - _kept(b.chunk, rank, world))
                                                 for b in half_buckets),
                           "all_reduce": sum(2 * (_elements(b) - _kept(b.owned(rank), rank, world))
                                             for b in half_buckets)},
            "reduce_scatter": sum(4 * world * b.chunk for b in fp32_buckets),
            "all_gather": sum(_element_size(sharded, b) * world * b.chunk for b in sharded.layout.buckets),
            "all_reduce": sum(4 * _elements(b) for b in fp32_buckets),
            "broadcast": sum(_element_size(sharded, b) * _elements(b) for b in sharded.layout.buckets)},
        "step_compiles": len(steps),
        "every_step_sharded": all(any(p.name == "shard_optimizer" and p.status == "applied" for p in r.passes)
                                  for r in steps),
    }


def _element_size(sharded, bucket) -> int:
    return sharded.params[bucket.params[0]][1].element_size()


def _kept(row: int, rank: int, world: int) -> int:
    """Elements of its own row a rank does not send itself: its row is at an end of the bucket."""
    return row if world > 1 and rank in (0, world - 1) else 0


def _elements(bucket) -> int:
    return sum(bucket.owned(rank) for rank in range(len(bucket.segments)))


def _error_of(fn, *args) -> str | None:
    try:
        fn(*args)
    except optpass.OptpassError as error:
        return str(error)
    return None


def reduce_buffers_in_backward(rank: int, world: int, layers_per_bucket: int = 1) -> dict:
    """A bf16 MLP of 4 layers, ``layers_per_bucket`` layers per bucket, AdamW on fp32 masters,
    optimizer_in_backward, lowered by Inductor: how many reduce buffers (the bf16 buckets the
    all-to-alls send) its generated schedule keeps alive at once (each bucket's update frees its buffer before the next bucket's is
    allocated: one)."""
    from optpass.demo.models import MLP
    torch._dynamo.reset()
    torch.manual_seed(0)
    width = 32
    model = MLP((width,) * 5).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = torch.compile(workers.make_step(model, opt), backend="optpass", options={
        "optimizer": opt, "data_parallel": "zero1", "master_weights": torch.float32,
        "optimizer_in_backward": True, "bucket_bytes": (width * width + width) * 4 * layers_per_bucket})
    codes: list[str] = []
    with workers.inductor_code(codes):
        for i in range(2):
            step(torch.randn(8, width, dtype=torch.bfloat16), torch.randn(8, width, dtype=torch.bfloat16))
    code = next(c for c in codes if "_c10d_functional" in c)
    alive, buffers = workers.reduce_buffers_alive_at_once(code)
    return {"alive_at_once": alive, "reduce_buffers": buffers,
            "buckets": len(optpass.zero1.sharded_state(opt).layout.buckets),
            "receive_buffers_after_the_chunk": _receive_buffers_after_the_chunk(code),
            "all_to_alls": _all_to_alls(code)}


def _all_to_alls(code: str) -> list[tuple[bool, int, int]]:
    """For each all_to_all_single in Inductor's generated ``call``: (whether it sends a view of a buffer,
    no copy of its own; elements sent; elements received)."""
    found = []
    for m in re.finditer(r"_c10d_functional\.all_to_all_single\.default\((reinterpret_tensor\()?buf\d+"
                         r"[^\[]*\[([\d, ]+)\], \[([\d, ]+)\]", code):
        found.append((m[1] is not None, sum(map(int, m[3].split(","))), sum(map(int, m[2].split(",")))))
    return found


def _receive_buffers_after_the_chunk(code: str) -> list[bool]:
    """For each receive buffer of a gather (``optpass::empty_after``) in Inductor's generated ``call``:
    whether the chunk the update read (the last all-to-all's output) was deleted before it."""
    received, deleted, found = None, set(), []
    for line in code[code.index("def call("):].splitlines():
        if m := re.match(r"\s*(buf\d+) = torch\.ops\._c10d_functional\.all_to_all_single\.default\(", line):
            received = m[1]
        deleted.update(re.findall(r"\bdel (buf\d+)", line))
        if "torch.ops.optpass.empty_after.default(" in line:
            found.append(received in deleted)
    return found


def reduce_buffers_in_backward_llama(rank: int, world: int) -> dict:
    """A one-layer bf16 LlamaForCausalLM (hidden 64, vocabulary 512) in two buckets whose border falls
    between the layer's two RMSNorm weights (post-attention norm in the first, input norm in the second),
    AdamW on fp32 masters, optimizer_in_backward, lowered by Inductor: the reduce buffers its
    schedule keeps alive at once."""
    import torch.nn.functional as F
    import transformers
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=32,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train_step(x, y):
        logits = model(input_ids=x).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    # 82048 fp32 elements fit (head, final norm, MLP, post-attention norm), one more 64 x 64 does not
    step = torch.compile(train_step, backend="optpass", options={
        "optimizer": opt, "data_parallel": "zero1", "master_weights": torch.float32,
        "optimizer_in_backward": True, "bucket_bytes": 330_000})
    codes: list[str] = []
    with workers.inductor_code(codes):
        for _ in range(2):
            tokens = torch.randint(0, 512, (2, 17))
            step(tokens[:, :-1], tokens[:, 1:])
    code = next(c for c in codes if "_c10d_functional" in c)
    alive, buffers = workers.reduce_buffers_alive_at_once(code)
    layout = optpass.zero1.sharded_state(opt).layout
    return {"alive_at_once": alive, "reduce_buffers": buffers, "buckets": [len(b.params) for b in layout.buckets]}


def refused_without_half_precision(rank: int, world: int) -> str:
    """master_weights with zero1 over an fp32 model: the error, as the step raises it."""
    torch._dynamo.reset()
    model = workers.make_model()
    opt = make_optimizer("SGD", list(model.parameters()))
    step = torch.compile(workers.make_step(model, opt), backend="optpass", options={
        "optimizer": opt, "data_parallel": "zero1", "master_weights": torch.float32, "lower": "eager"})
    try:
        step(*batches(0, world)[rank])
    except optpass.OptpassError as error:
        return f"{type(error).__name__}: {error}"
    return "trained"


def checkpoint_phase(rank: int, world: int, phase: str, path: str, partition: str = "greedy") -> dict:
    """phase 'save' (2 ranks): 20 steps, a checkpoint after step 10. phase 'load' (any world size):
    a fresh model and optimizer load it and run steps 10..20, and the Megatron-way reference
    (compiled update) runs all 20 steps uninterrupted, averaging over 2 ranks up to step 10 and over
    `world` ranks after it. The global batch is the same whatever the world size (6 samples)."""
    torch._dynamo.reset()
    case = {"dtype": "bf16", "gain": True, "optimizer": "AdamW", "partition": partition}
    model = start_model(case)
    reference = DataParallelMegatron(copy.deepcopy(model), functools.partial(make_optimizer, "AdamW"),
                                     update="compiled")
    opt = make_optimizer("AdamW", list(model.parameters()))
    step = compile_step(model, opt, case)
    result: dict = {}
    start = 0
    if phase == "load":
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()                    # the checkpoint must bring the parameters back
        optpass.load_sharded_checkpoint(path, opt, model=model, partition=partition, bucket_bytes=BUCKET_BYTES,
                                        master_weights=torch.float32)
        result["loaded"] = _exact(gather(opt, model))
        start = STEPS // 2
        for i in range(start):
            reference.step(batches(i, 2))
    for i in range(start, STEPS):
        step(*batches(i, world)[rank])
        if phase == "load":
            reference.step(batches(i, world))
        if phase == "save" and i + 1 == STEPS // 2:
            optpass.save_sharded_checkpoint(path, opt, model=model)
            result["saved"] = _exact(gather(opt, model))
    result["final"] = _exact(gather(opt, model))
    result["params"] = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    if phase == "load":
        result.update(vs_reference_ulps=param_ulps(model, reference),
                      vs_reference_master=master_rel_diff(gather(opt, model), reference))
    return result


def _exact(full: dict) -> dict:
    """Gathered masters and state as Python floats (exact for fp32), to cross the process queue."""
    return {"masters": {i: m.tolist() for i, m in full["masters"].items()},
            "state": {i: {k: v.reshape(-1).tolist() for k, v in s.items()} for i, s in full["state"].items()}}


def rewritten_graph_diff(rank: int, world: int, scaled: bool = False) -> str:
    """The shard_optimizer pass's graph diff with fp32 masters on rank 0 of 2: a bf16 Linear(3, 1)
    (4 elements: one bucket; rank 0's chunk is the bias and the weight's first element), SGD with
    momentum, updates after backward, lower='eager'. ``scaled``: fp16 with a GradScaler (the
    loss_scaling pass's rewrite too)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    dtype = torch.float16 if scaled else torch.bfloat16
    model = nn.Linear(3, 1).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1), momentum=0.9)
    step = torch.compile(workers.make_step(model, opt), backend="optpass", options={
        "optimizer": opt, "data_parallel": "zero1", "master_weights": torch.float32, "lower": "eager",
        "grad_scaler": torch.amp.GradScaler("cpu", **SCALER) if scaled else None})
    x, y = torch.randn(4, 3, dtype=dtype), torch.randn(4, 1, dtype=dtype)
    with optpass.keep_graphs():
        for _ in range(2):
            step(x, y)
    report = [r for r in optpass.recent_reports() if r.graph_after is not None][-1]
    return optpass.graph_diff(report.graph_before, report.graph_after, context=0)


# ------------------------------------------------------------------ with a grad_scaler (fp16)
#
# At INF_STEP only the last rank's batch holds an inf, so only that rank's own gradients are
# non-finite. The reference (``ScaledDataParallelMegatron``) is Megatron's fp16 step over N ranks
# driven by a real GradScaler: each rank's scaled fp16 gradients cast to fp32 and averaged,
# ``scaler.unscale_`` of the averaged fp32 main gradients, [clip], ``scaler.step`` (skipped when any
# rank's gradients held an inf/nan: the average does too), ``scaler.update()``, masters copied back.

INF_STEP = 7
SCALER = dict(init_scale=2.0 ** 14, growth_interval=3)


def batches_with_inf(step: int, world: int) -> list:
    """Every rank's batch of global batch `step`; at INF_STEP the last rank's holds an inf."""
    per_rank = batches(step, world)
    if step == INF_STEP:
        x, y = per_rank[-1]
        x = x.clone()
        x[0, 0] = float("inf")
        per_rank[-1] = (x, y)
    return per_rank


class ScaledDataParallelMegatron(DataParallelMegatron):
    """DataParallelMegatron driven by torch.amp.GradScaler: each rank's backward of scale * loss,
    its fp16 gradients cast to fp32 and averaged into the main gradients, scaler.unscale_ of those,
    [clip_grad_norm_ of the fp32 main gradients], scaler.step (skipped on inf/nan), scaler.update."""

    def __init__(self, model: nn.Module, make_optimizer, update: str = "eager", clip: float | None = None):
        super().__init__(model, make_optimizer, update, clip)
        self.scaler = torch.amp.GradScaler("cpu", **SCALER)
        self.opt.step = self.update                  # what scaler.step(opt) calls

    def step(self, per_rank: list, loss_fn=workers.loss_fn):
        self.average_into_main_grads(per_rank, loss_fn, lambda loss: self.scaler.scale(loss).backward())
        self.finish_scaled_step(self.scaler, self.clip)

    def start_from(self, model: nn.Module, full: dict, scaler=None) -> None:
        super().start_from(model, full)
        self.scaler.load_state_dict(scaler.state_dict())


def compile_scaled_step(model, opt, scaler, case: dict):
    return torch.compile(workers.make_step(model, opt), backend="optpass", options={
        "optimizer": opt, "data_parallel": "zero1", "master_weights": torch.float32, "grad_scaler": scaler,
        "lower": "eager", "partition": case["partition"], "optimizer_in_backward": case.get("in_backward", False),
        "bucket_bytes": BUCKET_BYTES, "collectives": case.get("plan", "auto"),
        "clip_grad_norm": case.get("clip")})


def scaled_parity(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Train each case STEPS steps with zero1 + master_weights + grad_scaler against two references:
    ``compiled`` (torch.optim's step as torch.compile computes it) over the whole run, and
    ``eager`` (eager torch.optim), each step started from the zero1 run's state."""
    results = []
    for case in cases:
        began = time.monotonic()
        torch._dynamo.reset()
        with optpass.keep_graphs():
            result = _scaled_parity_case(rank, world, case)
        results.append({**case, **result, "seconds": time.monotonic() - began})
    return results


def _scaled_parity_case(rank: int, world: int, case: dict) -> dict:
    start = Model(torch.float16, case.get("gain", False))
    model = copy.deepcopy(start)
    opt = make_optimizer(case["optimizer"], list(model.parameters()))
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    make = functools.partial(make_optimizer, case["optimizer"])
    compiled_ref = ScaledDataParallelMegatron(copy.deepcopy(start), make, update="compiled", clip=case.get("clip"))
    eager_ref = ScaledDataParallelMegatron(copy.deepcopy(start), make, clip=case.get("clip"))
    step = compile_scaled_step(model, opt, scaler, case)
    optpass.report.clear_reports()
    eager_ulps, eager_master, scales_equal, inf_step_unchanged = 0, 0.0, True, None
    for i in range(STEPS):
        per_rank = batches_with_inf(i, world)
        if i:
            eager_ref.start_from(model, gather(opt, model), scaler)
        before = gather(opt, model) if i == INF_STEP else None
        params_before = [p.detach().clone() for p in model.parameters()] if i == INF_STEP else None
        step(*per_rank[rank])
        assert all(p.grad is None for p in model.parameters())
        compiled_ref.step(per_rank)
        eager_ref.step(per_rank)
        full = gather(opt, model)
        if before is not None:          # the skipped step changed no parameter, master or state tensor
            inf_step_unchanged = (all(torch.equal(a, b) for a, b in zip(params_before, model.parameters()))
                                  and _same_full(before, full))
        scales_equal &= (scaler.get_scale(), scaler._get_growth_tracker()) == \
            (compiled_ref.scaler.get_scale(), compiled_ref.scaler._get_growth_tracker())
        eager_ulps = max(eager_ulps, param_ulps(model, eager_ref))
        eager_master = max(eager_master, master_rel_diff(full, eager_ref))
    steps = [r for r in optpass.recent_reports() if r.kind is optpass.GraphKind.STEP]
    return {
        "dtype": "fp16", "ulps": param_ulps(model, compiled_ref),
        "master": master_rel_diff(gather(opt, model), compiled_ref),
        "eager_ulps": eager_ulps, "eager_master": eager_master,
        "scales_equal": scales_equal, "inf_step_unchanged": inf_step_unchanged,
        "skipped": optpass.skipped_steps(scaler), "reference_scale": compiled_ref.scaler.get_scale(),
        "collectives": collectives_in(steps[-1].graph_after),
        "every_step_sharded": all(any(p.name == "shard_optimizer" and p.status == "applied" for p in r.passes)
                                  for r in steps),
    }


def _same_full(a: dict, b: dict) -> bool:
    return (all(torch.equal(a["masters"][i], b["masters"][i]) for i in a["masters"])
            and all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i]))


# ------------------------------------------------------------------ gradient accumulation
#
# MICRO_BATCHES - 1 compiled micro-steps (backward, no opt.step()) and the compiled step, the same
# options: each rank's half-precision .grad sums its micro-batches as autograd does, the step
# reduces the sums in fp32 (DDP's no_sync() on the micro-steps). The reference does the same per
# rank in one process: the sums cast to fp32 and averaged, then Megatron's step. With a GradScaler
# every backward is of scale * loss, and the last rank's first micro-batch of INF_STEP holds an inf.

MICRO_BATCHES = 3
ACCUMULATION_STEPS = 10


def micro_batches(step: int, world: int, inf: bool) -> list[list]:
    """[micro-batch][rank] batches of update `step`; with `inf`, an inf at INF_STEP (last rank, first one)."""
    micro = [batches(1000 * (step + 1) + k, world) for k in range(MICRO_BATCHES)]
    if inf and step == INF_STEP:
        x, y = micro[0][-1]
        x = x.clone()
        x[0, 0] = float("inf")
        micro[0][-1] = (x, y)
    return micro


class AccumulatingMegatron(ScaledDataParallelMegatron):
    """DataParallelMegatron with gradient accumulation, optionally driven by a GradScaler."""

    def __init__(self, model, make_optimizer, scaled: bool):
        super().__init__(model, make_optimizer, update="compiled")
        self.scaled = scaled

    def accumulating_step(self, micro: list[list]) -> None:
        backward = (lambda loss: self.scaler.scale(loss).backward()) if self.scaled else (lambda loss: loss.backward())
        params = list(self.model.parameters())
        sums = []
        for rank in range(len(micro[0])):
            for batch in micro:
                backward(workers.loss_fn(self.model, *batch[rank]))   # .grad adds up in half precision
            sums.append([p.grad.float() for p in params])
            for p in params:
                p.grad = None
        for master, rank_sums in zip(self.masters, zip(*sums)):
            master.grad = sum(rank_sums[1:], rank_sums[0]) / len(rank_sums)
        if self.scaled:
            self.finish_scaled_step(self.scaler, None)
        else:
            self.update()
            self.opt.zero_grad()
            self.copy_masters_back()


def accumulation_parity(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """zero1 + master_weights (+ grad_scaler) with gradient accumulation against AccumulatingMegatron."""
    results = []
    for case in cases:
        torch._dynamo.reset()
        scaled = case.get("scaled", False)
        start = Model(DTYPES[case["dtype"]], case.get("gain", False))
        model = copy.deepcopy(start)
        opt = make_optimizer(case["optimizer"], list(model.parameters()))
        scaler = torch.amp.GradScaler("cpu", **SCALER) if scaled else None
        reference = AccumulatingMegatron(copy.deepcopy(start), functools.partial(make_optimizer, case["optimizer"]),
                                         scaled)
        options = {"optimizer": opt, "data_parallel": "zero1", "master_weights": torch.float32,
                   "grad_scaler": scaler, "lower": case.get("lower", "eager"), "bucket_bytes": BUCKET_BYTES}

        def micro_step(x, y):
            loss = workers.loss_fn(model, x, y)
            loss.backward()
            return loss.detach()

        micro = torch.compile(micro_step, backend="optpass", options=options)
        step = torch.compile(workers.make_step(model, opt), backend="optpass", options=options)
        ulps_worst, master_worst, scales_equal, grads_kept = 0, 0.0, True, True
        for i in range(ACCUMULATION_STEPS):
            batches_of = micro_batches(i, world, inf=scaled)
            for batch in batches_of[:-1]:
                micro(*batch[rank])
                grads_kept &= all(p.grad is not None for p in model.parameters())
            step(*batches_of[-1][rank])
            assert all(p.grad is None for p in model.parameters())
            reference.accumulating_step(batches_of)
            ulps_worst = max(ulps_worst, param_ulps(model, reference))
            master_worst = max(master_worst, master_rel_diff(gather(opt, model), reference))
            if scaled:
                scales_equal &= scaler.get_scale() == reference.scaler.get_scale()
        results.append({**case, "ulps": ulps_worst, "master": master_worst, "scales_equal": scales_equal,
                        "grads_kept": grads_kept,
                        "skipped": optpass.skipped_steps(scaler) if scaled else None})
    return results
