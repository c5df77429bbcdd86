"""Float8 training (torchao's ``convert_to_float8_training``) with the update in backward, one device.

Float8 rounds each GEMM's operands to float8 with a scale computed from the tensor: compare with the
same program compiled by ``backend="inductor"`` (which rounds alike), not with eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

pytest.importorskip("torchao")
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402

STEPS = 4


def float8_mlp(config: Float8LinearConfig | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 64))
    convert_to_float8_training(model, config=config)
    return model


def train(backend: str, options: dict, config: Float8LinearConfig | None = None):
    torch._dynamo.reset()
    model = float8_mlp(config)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2))

    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out

    kwargs = {"options": dict(options, optimizer=opt)} if options else {}
    compiled = torch.compile(step, backend=backend, **kwargs)
    generator = torch.Generator().manual_seed(1)
    losses = [float(compiled(torch.randn(32, 64, generator=generator), torch.randn(32, 64, generator=generator)))
              for _ in range(STEPS)]
    return model, losses


@pytest.mark.parametrize("lower", ["inductor", "eager"])
def test_float8_with_the_update_in_backward_equals_inductor(lower):
    reference, reference_losses = train("inductor", {})
    model, losses = train("optpass", {"optimizer_in_backward": True, "lower": lower})
    assert type(model[0]).__name__ == "Float8Linear"
    assert losses == pytest.approx(reference_losses, rel=1e-6)
    worst = max(((p - q).abs().max() / q.abs().max()).item()
                for p, q in zip(model.parameters(), reference.parameters()))
    assert worst <= 1e-6, worst
    assert all(p.grad is None for p in model.parameters())


def test_float8_with_clipping_in_backward_equals_inductor_with_clip_grad_norm_in_the_step():
    torch._dynamo.reset()

    def clipped(backend, options):
        model = float8_mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2))

        def step(x, y):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if not options:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            out = loss.detach()
            opt.step()
            opt.zero_grad()
            return out
        kwargs = {"options": dict(options, optimizer=opt)} if options else {}
        compiled = torch.compile(step, backend=backend, **kwargs)
        generator = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            compiled(torch.randn(32, 64, generator=generator), torch.randn(32, 64, generator=generator))
        torch._dynamo.reset()
        return model

    reference = clipped("inductor", {})
    model = clipped("optpass", {"optimizer_in_backward": True, "clip_grad_norm": 0.1})
    worst = max(((p - q).abs().max() / q.abs().max()).item()
                for p, q in zip(model.parameters(), reference.parameters()))
    assert worst <= 1e-5, worst


def test_the_float8_all_gather_config_with_the_update_in_backward_equals_inductor_on_one_device():
    """enable_fsdp_float8_all_gather=True makes each weight torchao's WeightWithDynamicFloat8CastTensor:
    its values are one inner tensor, which the update reads and writes."""
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    reference, reference_losses = train("inductor", {}, config)
    model, losses = train("optpass", {"optimizer_in_backward": True}, config)
    assert type(model[0].weight).__name__ == "WeightWithDynamicFloat8CastTensor"
    assert losses == pytest.approx(reference_losses, rel=1e-6)
    worst = max(((p - q).abs().max() / q.abs().max()).item()
                for p, q in zip(model.parameters(), reference.parameters()))
    assert worst <= 1e-6, worst


# ---------------------------------------------------------------- on 2 gloo ranks (tests/float8_workers.py)

@pytest.fixture(scope="module")
def ranks():
    import float8_workers
    from distributed import run_ranks, values

    return values(run_ranks(2, float8_workers.run_all, ["fsdp_in_backward", "zero1_in_backward", "fsdp_float8_all_gather",
                                                         "fsdp_float8_all_gather_graph"],
                            timeout_s=900, pg_timeout_s=120))


@pytest.mark.parametrize("program", ["fsdp_in_backward", "zero1_in_backward"])
def test_float8_under_fsdp_and_zero1_equals_one_process_with_each_ranks_scales(ranks, program):
    """Each rank's activations are scaled by their own amax, each gathered weight by the whole
    weight's: one process computing each rank's loss on its rows and averaging them rounds alike."""
    for result in ranks:
        got = result[program]
        assert "error" not in got, got["error"][2] if "error" in got else got
        assert got["relative"] <= 1e-6, got


def test_fsdps_float8_all_gather_trains_as_one_process_with_torchaos_precompute_harmless(ranks):
    """Float8LinearConfig(enable_fsdp_float8_all_gather=True) under optpass.fully_shard: each weight's
    scale comes from the ranks' shard amaxes (one all-reduce of a scalar), each rank casts its shard
    to float8 and the float8 bytes are gathered; equal, bit for bit here, to casting the gathered
    weight as the Float8Linear does, against one process under backend='inductor'.
    torchao's precompute_float8_dynamic_scale_for_fsdp after each step changes nothing."""
    for result in ranks:
        got = result["fsdp_float8_all_gather"]
        assert "error" not in got, got["error"][2] if "error" in got else got
        assert got["relative"] <= 1e-6, got


def test_the_float8_all_gather_sends_float8_bytes_and_regathers_them_for_backward(ranks):
    """Each Float8Linear weight crosses the wire as one byte an element (a quarter of fp32's), in
    forward and again where backward reads it (resharded after forward); biases stay fp32; every
    scale's amax is one max all-reduce."""
    for result in ranks:
        got = result["fsdp_float8_all_gather_graph"]
        assert "error" not in got, got["error"][2] if "error" in got else got
        # 3 in forward, 1 in backward: the first layer's input gradient is not made, and the last
        # layer's forward copy serves backward, which reads it next (reshard_after_forward, design §68)
        assert got["sent"].count("torch.uint8") == 4, got["sent"]
        assert set(got["sent"]) == {"torch.uint8", "torch.float32"}, got["sent"]
        assert got["all_reduce_ops"] and set(got["all_reduce_ops"]) == {"max"}, got["all_reduce_ops"]
