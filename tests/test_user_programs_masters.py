"""master_weights on a LoRA-style model: a frozen bf16 base, small trainable adapters, and
``AdamW(model.parameters())`` (the frozen parameters are in the optimizer, as users write it).

Eager torch.optim allocates nothing for a parameter that never gets a gradient; Megatron keeps
fp32 main copies of the parameters that require grad only. optpass keeps masters (and state)
only for the parameters a step updates, made when a step first updates them: a base unfrozen
mid-run gets its master then, from its value then. The reference is that, written eagerly.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import optpass
from optpass.precision.masters import STATE_DICT_KEY, master_state
from parity import make_step, mlp_data
from test_master_weights import ulps

LOW_PRECISION = (torch.bfloat16, torch.float16)


class LoRALinear(nn.Module):
    """A Linear plus a rank-r update x @ a.T @ b.T, computed in the adapters' dtype."""

    def __init__(self, d_in: int, d_out: int, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.a = nn.Parameter(torch.randn(rank, d_in) / d_in ** 0.5)
        self.b = nn.Parameter(torch.randn(d_out, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + (x.to(self.a.dtype) @ self.a.t() @ self.b.t()).to(x.dtype)


def lora_model(adapters: torch.dtype = torch.bfloat16) -> nn.Sequential:
    """A bf16 model whose Linear layers are frozen; the adapters in `adapters`' dtype."""
    torch.manual_seed(0)
    model = nn.Sequential(LoRALinear(16, 32), nn.ReLU(), LoRALinear(32, 4)).to(adapters)
    for layer in (model[0], model[2]):
        layer.base.to(torch.bfloat16).requires_grad_(False)
    return model


def lora_loss(model, x, y):
    return F.mse_loss(model(x), y)


def adamw(params):
    return torch.optim.AdamW(params, lr=torch.tensor(1e-3))


def compiled(model, opt, in_backward: bool):
    return torch.compile(make_step(model, opt, lora_loss), backend="optpass", options={
        "lower": "eager", "optimizer": opt, "master_weights": torch.float32, "optimizer_in_backward": in_backward})


class FrozenBaseReference:
    """Megatron's mixed-precision step, eagerly, for a model with frozen parameters: fp32 main copies
    of the parameters that require grad only (an fp32 parameter is its own), made when they first
    do, from their value then (a parameter unfrozen later joins the optimizer with add_param_group);
    each gradient cast to fp32, the optimizer steps the copies, which are rounded back.

    update="compiled": torch.optim's step through torch.compile with Inductor's decompositions, run
    eagerly (aot_eager_decomp_partition), i.e. as any compiled optimizer computes it: the fused step
    matches it bitwise (see test_master_weights.MegatronReference)."""

    def __init__(self, model: nn.Module, make_optimizer=adamw, update: str = "eager"):
        self.model, self.make_optimizer, self.kind = model, make_optimizer, update
        self.masters: dict[torch.Tensor, torch.Tensor] = {}
        self.opt = None

    def take_new_trainable_parameters(self) -> None:
        """Masters (and the optimizer's place) for the parameters that require grad and have none yet."""
        new = [p for p in self.model.parameters() if p.requires_grad and p not in self.masters]
        if not new:
            return
        made = [p.detach().float() if p.dtype in LOW_PRECISION else p for p in new]
        self.masters.update(zip(new, made))
        if self.opt is None:
            self.opt = self.make_optimizer(made)
            self.update = (self.opt.step if self.kind == "eager"
                           else torch.compile(self.opt.step, backend="aot_eager_decomp_partition"))
        else:
            self.opt.add_param_group({"params": made})

    def step(self, x, y):
        self.take_new_trainable_parameters()
        loss = lora_loss(self.model, x, y)
        loss.backward()
        for p, master in self.masters.items():
            if master is not p and p.grad is not None:
                master.grad = p.grad.float()
                p.grad = None
        self.update()
        self.opt.zero_grad()
        with torch.no_grad():
            for p, master in self.masters.items():
                if master is not p:
                    p.copy_(master)
        return loss.detach()

    @torch.no_grad()
    def start_from(self, model: nn.Module, opt) -> None:
        """Take the parameters, masters and optimizer state of an optpass run."""
        masters = optpass.master_weights(opt)
        state = master_state(opt, torch.float32).master_optimizer.state
        for mine, theirs in zip(self.model.parameters(), model.parameters()):
            mine.copy_(theirs)
            if mine in self.masters:
                if self.masters[mine] is not mine:
                    self.masters[mine].copy_(masters[theirs])
                self.opt.state[self.masters[mine]] = {k: v.clone() for k, v in state.get(masters[theirs], {}).items()}


def param_ulps(model, reference) -> int:
    return max(ulps(p, q) if p.dtype in LOW_PRECISION else int(not torch.equal(p, q))
               for p, q in zip(model.parameters(), reference.model.parameters()))


def master_diff(model, opt, reference) -> float:
    """max |master - reference master| / max |reference master|; both keep masters of the same parameters."""
    masters = optpass.master_weights(opt)
    pairs = [(masters.get(p), reference.masters[q]) for p, q in zip(model.parameters(), reference.model.parameters())
             if q in reference.masters]
    assert len(pairs) == len(masters) and all(m is not None for m, _ in pairs)
    return max(((m - n).abs().max() / n.abs().max()).item() for m, n in pairs)


def fp32_copy_bytes(opt) -> int:
    """Bytes of the fp32 masters optpass keeps (an fp32 parameter, its own master, costs none)."""
    return sum(m.numel() * m.element_size() for p, m in optpass.master_weights(opt).items() if m is not p)


def indices(opt, params) -> list[int]:
    """The state_dict indices of `params` in `opt`."""
    everything = [p for group in opt.param_groups for p in group["params"]]
    return sorted(i for i, p in enumerate(everything) if any(p is q for q in params))


def adapters(model) -> list[torch.Tensor]:
    return [p for layer in (model[0], model[2]) for p in (layer.a, layer.b)]


@pytest.mark.parametrize("in_backward", [True, False], ids=["in_backward", "after_backward"])
def test_a_frozen_bf16_base_gets_no_masters_and_an_unfrozen_one_gets_its_then(in_backward):
    """AdamW over every parameter of a LoRA model, 6 steps, against the Megatron way with masters of
    the trainable parameters only. Masters and state exist for the adapters only (the base's
    parameters are in the optimizer, never get a gradient); before step 3 the user halves the last
    layer's frozen base weight and unfreezes it: it gets its master then, from that value.

    * update as torch.compile computes torch.optim's step: parameters and masters bitwise;
    * update by eager torch.optim: every step starts from the fused run's parameters, masters and
      state, ends within one bf16 ulp and 1e-5 on the masters (the README's Numerics)."""
    start = lora_model()
    model = copy.deepcopy(start)
    opt = adamw(model.parameters())
    compiled_ref = FrozenBaseReference(copy.deepcopy(start), update="compiled")
    eager_ref = FrozenBaseReference(copy.deepcopy(start))
    step = compiled(model, opt, in_backward)
    trainable = adapters(model)
    for i in range(6):
        if i == 3:
            for m in (model, compiled_ref.model, eager_ref.model):
                with torch.no_grad():
                    m[2].base.weight.mul_(0.5)
                m[2].base.weight.requires_grad_(True)
            trainable.append(model[2].base.weight)
        x, y = mlp_data(i, torch.bfloat16)
        if i:
            eager_ref.start_from(model, opt)
        expected = compiled_ref.step(x, y).item()
        assert eager_ref.step(x, y).item() == expected, i
        assert step(x, y).item() == expected, i
        assert all(p.grad is None for p in model.parameters()), i
        assert param_ulps(model, eager_ref) <= 1 and master_diff(model, opt, eager_ref) <= 1e-5, i

        # masters and state: the trainable parameters' only
        assert [id(p) for p in optpass.master_weights(opt)] == [id(p) for p in model.parameters()
                                                                if any(p is q for q in trainable)], i
        assert fp32_copy_bytes(opt) == sum(4 * p.numel() for p in trainable), i
        saved = opt.state_dict()["state"]
        assert list(saved) == [STATE_DICT_KEY], i                  # nothing for the frozen parameters
        assert sorted(saved[STATE_DICT_KEY]["masters"]) == indices(opt, trainable), i
        assert sorted(saved[STATE_DICT_KEY]["state"]) == indices(opt, trainable), i
        assert not opt.state, i
    assert param_ulps(model, compiled_ref) == 0 and master_diff(model, opt, compiled_ref) == 0
    assert torch.equal(model[0].base.weight, start[0].base.weight)      # still frozen, untouched


@pytest.mark.parametrize("optimizer_holds", ["every_parameter", "the_adapters"])
def test_fp32_adapters_on_a_bf16_base_are_their_own_masters(optimizer_holds):
    """fp32 adapters on a frozen bf16 base (the mixed precision LoRA recipes keep): master_weights has
    no fp32 copy to make; the adapters are updated as they are, as eager torch.optim updates them.
    An optimizer over the adapters only (all fp32) is not refused: the model is bf16."""
    start = lora_model(adapters=torch.float32)
    model = copy.deepcopy(start)
    params = model.parameters() if optimizer_holds == "every_parameter" else adapters(model)
    opt = adamw(params)
    reference = FrozenBaseReference(copy.deepcopy(start), update="compiled")
    step = compiled(model, opt, in_backward=optimizer_holds == "the_adapters")
    for i in range(4):
        x, y = mlp_data(i, torch.bfloat16)
        assert step(x, y).item() == reference.step(x, y).item(), i
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.model.parameters()))
    masters = optpass.master_weights(opt)
    assert [id(p) for p in masters] == [id(p) for p in adapters(model)]
    assert all(m is p for p, m in masters.items()) and fp32_copy_bytes(opt) == 0
    assert opt.state_dict()["state"][STATE_DICT_KEY]["masters"] == {}
    # against eager torch.optim on the fp32 adapters, step by step
    eager = FrozenBaseReference(copy.deepcopy(model))
    eager.take_new_trainable_parameters()
    eager.start_from(model, opt)
    x, y = mlp_data(4, torch.bfloat16)
    assert eager.step(x, y).item() == step(x, y).item()
    assert max((p - q).abs().max().item() for p, q in zip(adapters(model), adapters(eager.model))) <= 1e-6


def test_an_fp32_model_with_master_weights_names_the_cause():
    """Nothing bf16 in the optimizer or the step: the model was not cast (or master_weights is not wanted)."""
    model = lora_model(adapters=torch.float32).float()
    opt = adamw(model.parameters())
    with pytest.raises(Exception) as info:
        compiled(model, opt, in_backward=True)(*mlp_data(0))
    message = str(info.value)
    assert "every parameter of the optimizer and of the step is torch.float32" in message, message
    assert "model.to(torch.bfloat16)) before compiling the step" in message and "drop master_weights" in message


def test_a_lora_checkpoint_holds_the_adapters_masters_and_resumes_exactly():
    """opt.state_dict() after 3 steps holds the adapters' masters and state only; a fresh model and
    optimizer (other initial weights) load it and continue bitwise as the uninterrupted run."""
    model = lora_model()
    opt = adamw(model.parameters())
    step = compiled(model, opt, in_backward=True)
    for i in range(3):
        step(*mlp_data(i, torch.bfloat16))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    for i in range(3, 6):
        step(*mlp_data(i, torch.bfloat16))

    buffer.seek(0)
    checkpoint = torch.load(buffer)
    saved = checkpoint["optimizer"]["state"]
    assert list(saved) == [STATE_DICT_KEY]
    assert sorted(saved[STATE_DICT_KEY]["masters"]) == indices(opt, adapters(model))
    assert sum(4 * t.numel() for t in saved[STATE_DICT_KEY]["masters"].values()) == \
        sum(4 * p.numel() for p in adapters(model))

    torch.manual_seed(1)
    resumed = nn.Sequential(LoRALinear(16, 32), nn.ReLU(), LoRALinear(32, 4)).to(torch.bfloat16)
    for layer in (resumed[0], resumed[2]):
        layer.base.requires_grad_(False)
    resumed_opt = adamw(resumed.parameters())
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    resumed_step = compiled(resumed, resumed_opt, in_backward=True)
    for i in range(3, 6):
        resumed_step(*mlp_data(i, torch.bfloat16))
    assert all(torch.equal(p, q) for p, q in zip(resumed.parameters(), model.parameters()))
    theirs, mine = optpass.master_weights(opt), optpass.master_weights(resumed_opt)
    assert len(theirs) == len(mine) == 4
    assert all(torch.equal(m, n) for m, n in zip(theirs.values(), mine.values()))


def zero1_lora(rank: int, world: int) -> dict:
    """A rank of data_parallel='zero1' with masters on the LoRA model: 2 steps, then the user unfreezes
    the last layer's base weight and steps again."""
    import torch._dynamo

    torch._dynamo.reset()
    model = lora_model()
    opt = adamw(model.parameters())
    step = torch.compile(make_step(model, opt, lora_loss), backend="optpass", options={
        "lower": "eager", "optimizer": opt, "master_weights": torch.float32, "data_parallel": "zero1",
        "optimizer_in_backward": True})
    for i in range(2):
        x, y = mlp_data(10 * i + rank, torch.bfloat16)
        step(x, y)
    sharded = optpass.zero1.sharded_state(opt)
    result = {"master_bytes": sharded.master_bytes(), "state_bytes": sharded.state_bytes(),
              "sharded": len(sharded.params)}
    model[2].base.weight.requires_grad_(True)
    try:
        step(*mlp_data(20 + rank, torch.bfloat16))
        result["unfrozen"] = "trained"
    except Exception as error:       # noqa: BLE001  (Dynamo wraps the backend's OptpassError)
        result["unfrozen"] = str(error)
    return result


def test_zero1_shards_the_adapters_masters_only_and_refuses_a_parameter_unfrozen_later():
    """ZeRO-1 buckets the parameters that require grad when it shards the optimizer: the frozen base
    has no master shard and no state. A parameter unfrozen after that cannot join the buckets: the
    step refuses it (its gradient was dropped, and the weight never trained, before)."""
    from distributed import run_ranks, values

    results = values(run_ranks(2, zero1_lora))
    model = lora_model()
    trainable = sum(p.numel() for p in adapters(model))
    assert [r["sharded"] for r in results] == [4, 4]
    assert sum(r["master_bytes"] for r in results) == 4 * trainable        # one fp32 copy of the adapters, split
    # AdamW: exp_avg and exp_avg_sq of the adapters' elements, split, and a step per bucket
    assert 8 * trainable <= sum(r["state_bytes"] for r in results) <= 8 * trainable + 64
    for r in results:
        assert "did not require grad when the optimizer was sharded" in r["unfrozen"], r["unfrozen"]
        assert "2.base.weight" in r["unfrozen"], r["unfrozen"]
