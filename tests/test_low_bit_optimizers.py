"""torchao's low-bit optimizers (8-bit, 4-bit, FP8 Adam moments) with the update in backward.

The reference is the same step compiled by ``backend="inductor"`` with the same torchao optimizer:
the forward and backward are lowered alike there, so the gradients are the same bits and any
difference is the fused update's. Against a fully eager model the gradients round differently, and a
moment near a quantization boundary takes the neighbouring code: that comparison is measured in
docs/low_bit_optimizers.md, not pinned here.
"""

from __future__ import annotations

import io

import pytest
import torch

import optpass

ao = pytest.importorskip("torchao.optim")

from low_bit_workers import make_step, training_step  # noqa: E402  (after torchao is known)


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    # the 2048 x 1024 weights' gradients (8 MiB) are made and updated in row chunks
    return torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 10))


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 1024, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(n)]


def max_difference(a, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamWFp8"])
def test_low_bit_update_in_backward_equals_inductors_compiled_step(name):
    model, reference = mlp(), mlp()
    cls = getattr(ao, name)
    opt = cls(model.parameters(), lr=1e-3, weight_decay=0.01)
    ref_opt = cls(reference.parameters(), lr=1e-3, weight_decay=0.01)
    step, ref_step = make_step(model, opt), make_step(reference, ref_opt, backend="inductor")
    optpass.report.clear_reports()
    for x, y in batches(10):
        assert torch.equal(step(x, y), ref_step(x, y))
    assert max_difference(model, reference) <= 1e-6
    fused = [o for r in optpass.recent_reports() if r.kind.value == "step" for o in r.passes
             if o.name == "optimizer_in_backward"]
    assert fused and all(o.status == "applied" for o in fused)
    # torchao's state, as torchao keeps it: moments of the large weights quantized
    state = opt.state[model[0].weight]
    assert type(state["exp_avg"]).__name__ == type(ref_opt.state[reference[0].weight]["exp_avg"]).__name__
    assert state["step"].item() == 10
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(state[key].dequantize(), ref_opt.state[reference[0].weight][key].dequantize())


def test_adamw4bit_update_in_backward_trains_like_eager_torchao():
    # Inductor's own compile of AdamW4bit's first step fails on parameters of several shapes (the
    # 4-bit state made while tracing, under shapes Dynamo made dynamic); the reference is the eager
    # model with torchao's compiled per-parameter step.
    model, reference = mlp(), mlp()
    opt = ao.AdamW4bit(model.parameters(), lr=1e-3)
    ref_opt = ao.AdamW4bit(reference.parameters(), lr=1e-3)
    step = make_step(model, opt)
    for x, y in batches(4):
        loss = step(x, y)
        ref_loss = torch.nn.functional.cross_entropy(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(loss.item() - ref_loss.item()) <= 1e-5
    # Gradients round apart from eager's, so a moment near a code boundary takes the neighbouring 4-bit
    # code (module docstring): a few parameters then move apart, each by less than lr a step (1.2e-6
    # of them by over 1e-4 on this project's machines, the largest 7.7e-4; the max was under 5e-4 on
    # the CPU where an earlier bound was set); the rest agree to 1e-6. A wrong update (bias
    # correction, decay, a chunk) would move most parameters apart.
    apart = torch.cat([(p - q).abs().flatten() for p, q in zip(model.parameters(), reference.parameters())])
    assert (apart > 1e-6).float().mean().item() <= 1e-4
    assert max_difference(model, reference) <= 4 * 1e-3     # 4 steps at lr 1e-3
    assert type(opt.state[model[0].weight]["exp_avg"]).__name__ == "OptimState4bit"


def test_low_bit_state_dict_resume_equals_an_uninterrupted_run():
    batch = batches(6)
    model = mlp()
    opt = ao.AdamW8bit(model.parameters(), lr=1e-3)
    step = make_step(model, opt)
    for x, y in batch[:3]:
        step(x, y)
    checkpoint = io.BytesIO()      # torchao's states cannot be deep-copied (no clone); saved as users save
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, checkpoint)
    for x, y in batch[3:]:
        step(x, y)

    checkpoint.seek(0)
    saved = torch.load(checkpoint)
    resumed = mlp()
    resumed.load_state_dict(saved["model"])
    resumed_opt = ao.AdamW8bit(resumed.parameters(), lr=1e-3)
    resumed_opt.load_state_dict(saved["opt"])
    assert type(resumed_opt.state[resumed[0].weight]["exp_avg"]).__name__ == "OptimState8bit"
    resumed_step = make_step(resumed, resumed_opt)
    for x, y in batch[3:]:
        resumed_step(x, y)
    assert max_difference(model, resumed) == 0


# optimizer: (what parameters and state hold per parameter, lowest and highest; a step's bound)
HELD_BYTES = {"AdamW8bit": (6.0, 6.1, 6.5),      # 4 + two 8-bit moments + an fp32 scale per 256 elements each
              "AdamW4bit": (5.0, 5.1, 6.25)}     # 4 + two 4-bit moments + an fp32 scale per 128 elements each


@pytest.mark.parametrize("name", list(HELD_BYTES))
def test_low_bit_steady_step_holds_about_six_bytes_per_parameter(name):
    low, high, bound = HELD_BYTES[name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)])
    opt = getattr(ao, name)(model.parameters(), lr=1e-3)
    step = make_step(model, opt)
    x, y = torch.randn(8, 2048), torch.randint(0, 2048, (8,))
    n = sum(p.numel() for p in model.parameters())
    with optpass.measure_tensor_peak() as whole:
        for _ in range(3):
            step(x, y)
        with optpass.measure_tensor_peak() as steady:
            step(x, y)
    # What the model and its optimizer hold (live_at_entry_bytes also counts whatever else of the
    # test process is alive): fp32 parameters 4 + two 8-bit moments 2 + a scale per 256 elements.
    held = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *_state_tensors(opt)])
    assert low <= held / n < high
    # a steady step adds one row chunk of one gradient and its update's temporaries (4-bit: 12.59
    # bytes per parameter before its packed codes were chunked)
    assert (held + steady.growth_bytes) / n <= bound, steady
    # the whole run, the state's creation included, from the parameters up
    parameter_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())
    assert (parameter_bytes + whole.growth_bytes) / n <= bound, whole


def test_adamw4bit_update_in_row_chunks_equals_the_whole_update(monkeypatch):
    """The 4-bit update unpacks two codes a byte (shifts, a cat of the two halves, strided slices to
    pack them again): made and applied in row chunks, it writes the same codes, scales and
    parameters, bit for bit, as the same fused update made whole."""
    from optpass.passes import _row_chunks

    runs = []
    for chunk_bytes in (_row_chunks.ROW_CHUNK_BYTES, 2 ** 40):    # the 8 MiB gradients: chunked, whole
        monkeypatch.setattr(_row_chunks, "ROW_CHUNK_BYTES", chunk_bytes)
        model = mlp()
        opt = ao.AdamW4bit(model.parameters(), lr=1e-3)
        step = make_step(model, opt)
        with optpass.keep_graphs():
            for x, y in batches(4):
                step(x, y)
        graph = [r for r in optpass.recent_reports() if r.kind.value == "step"][-1].graph_after
        runs.append((model, opt, sum(n.target is torch.ops.aten.slice.Tensor for n in graph.nodes)))
    (chunked, chunked_opt, chunked_slices), (whole, whole_opt, whole_slices) = runs
    assert chunked_slices > whole_slices + 32                      # the chunks' row slices
    assert max_difference(chunked, whole) == 0
    for p, q in zip(chunked.parameters(), whole.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = chunked_opt.state[p][key], whole_opt.state[q][key]
            inner = a.__tensor_flatten__()[0] if hasattr(a, "__tensor_flatten__") else []   # a bias's: fp32
            assert type(a) is type(b) and (all(torch.equal(getattr(a, n), getattr(b, n)) for n in inner)
                                           if inner else torch.equal(a, b))


def _state_tensors(opt) -> list[torch.Tensor]:
    tensors = []
    for state in opt.state.values():
        for value in state.values():
            if hasattr(value, "__tensor_flatten__"):
                names, _ = value.__tensor_flatten__()
                tensors += [getattr(value, name) for name in names]
            elif isinstance(value, torch.Tensor):
                tensors.append(value)
    return tensors


def test_zero1_with_adamw8bit_quantizes_each_parameters_own_blocks_and_trains_like_one_process():
    """Two ranks under ZeRO-1, each updating its chunk of each bucket with torchao's AdamW8bit. The
    layout puts whole blocks of 256 on each rank and the unquantized biases in buckets of their own,
    so every scale a rank keeps is the scale one process keeps for the same 256 elements (a chunk
    quantized by its own offsets would hold other blocks' amax), and the state is 1/2 of one
    process's. Gradients are averaged in another order, so parameters are close, not equal."""
    import low_bit_workers as workers
    from distributed import run_ranks, values

    ranks = values(run_ranks(2, workers.zero1_low_bit, timeout_s=900, pg_timeout_s=120))
    for rank in ranks:
        assert rank["kinds"] == [("OptimState8bit", 256), ("Tensor", None)], rank["kinds"]
        assert 33 * 256 in rank["chunks"], rank["chunks"]          # 65 blocks: 33 and 32, not 32.5 each
        assert rank["scale_relative_error"] < 1e-3, rank["scale_relative_error"]
        assert rank["moment_error"] < 1e-4, rank["moment_error"]
        assert rank["vs_one_process"] < 3e-3, rank["vs_one_process"]
        assert rank["state_bytes"] < 0.55 * rank["reference_state_bytes"], rank
    assert ranks[0]["digest"] == ranks[1]["digest"]                # the ranks hold one model


def test_zero1_with_adamw8bit_resumes_from_a_sharded_checkpoint_exactly(tmp_path):
    """optpass.save_sharded_checkpoint stores each quantized moment's codes and block scales
    (requantizing dequantized signed moments would not give the codes back); a run that loads it
    before its first step continues bit for bit as the run that saved it."""
    import low_bit_workers as workers
    from distributed import run_ranks, values

    ranks = values(run_ranks(2, workers.zero1_low_bit_resume, str(tmp_path / "checkpoint"),
                             timeout_s=900, pg_timeout_s=120))
    for rank in ranks:
        assert "OptimState8bit" in rank["kinds"], rank["kinds"]
        assert rank["parameters_equal"] and rank["moments_equal"], rank


def test_zero1_takes_each_ranks_rows_of_the_low_bit_state_a_run_already_holds():
    """State from steps before zero1 (or a torchao state_dict loaded then) is moved into the shards
    when the optimizer is sharded: each rank's codes and scales are the rows of the one-process ones."""
    import low_bit_workers as workers
    from distributed import run_ranks, values

    for rank in values(run_ranks(2, workers.zero1_low_bit_adopts_state, timeout_s=600, pg_timeout_s=120)):
        assert rank["equal"] and rank["quantized_pieces"] > 0 and rank["user_state_left"] == 0, rank


def test_zero1_with_a_low_bit_optimizer_and_master_weights_is_refused():
    """torchao keeps bf16 parameters without fp32 masters: zero1's masters would step another optimizer."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = mlp().to(torch.bfloat16)
        opt = ao.AdamW8bit(model.parameters(), lr=1e-3)
        step = make_step(model, opt, data_parallel="zero1", master_weights=torch.float32)
        x, y = batches(1)[0]
        with pytest.raises(optpass.OptpassError, match=r"torchao's AdamW8bit and master_weights: not supported"):
            step(x.to(torch.bfloat16), y)
    finally:
        dist.destroy_process_group()


def test_fsdp_with_adamw8bit_keeps_each_ranks_quantized_moments_and_trains_like_one_process():
    """Two ranks, each updating its row shards in backward with torchao's AdamW8bit (its moments
    quantized over the shard, as FSDP2 with torchao keeps them), beside one process on the whole
    batch. The ranks' gradients are sums in another order, so codes near a boundary round apart
    (docs/low_bit_optimizers.md): close, not equal."""
    import low_bit_workers as workers
    from distributed import run_ranks, values

    ranks = values(run_ranks(2, workers.fsdp_adamw8bit, timeout_s=900, pg_timeout_s=120))
    for rank in ranks:
        assert rank["moment"] == "OptimState8bit" and rank["steps"] == workers.STEPS
        assert rank["moment_shape"] == rank["shard_shape"] == (512, 1024)
        assert rank["scales"] == 512 * 1024 // 256                 # its own blocks, on its rows
        assert rank["vs_one_process"] < 3e-3, rank["vs_one_process"]
    assert ranks[0]["digest"] == ranks[1]["digest"]                # the ranks hold one model


def test_explain_with_a_low_bit_optimizer_shows_the_fused_update():
    """Under explain's trace torchao's moments came with symbolic sizes, passed as inputs of their own
    (found by a fresh user: explain refused every torchao optimizer); they are the moments' fixed sizes."""
    torch.manual_seed(0)
    # moments of three quantized shapes: explain's harvest made symbols in the step's shape env, and
    # Dynamo failed creating the step's guards ("IndexError: list index out of range": a fresh user)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512), torch.nn.Tanh(),
                                torch.nn.Linear(512, 16))
    opt = ao.AdamW8bit(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    text = str(optpass.explain(training_step(model, opt), torch.randn(4, 64), torch.randint(0, 16, (4,)),
                               options={"optimizer": opt, "optimizer_in_backward": True}))
    assert "pass optimizer_in_backward: applied" in text, text
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_fsdp_with_adamw8bit_resumes_from_a_sharded_checkpoint_on_as_many_ranks_exactly_and_on_more(tmp_path):
    """optpass.save_sharded_checkpoint of a fully sharded model stores each quantized moment's codes and
    block scales (each shard's blocks are the parameter's own), so a run that loads it on as many ranks
    continues bit for bit. On 3 ranks the [1024, 256] weight's shards are quantized again (codes and
    scales read in place); the [256, 64] weight's shards are not whole blocks there and the head's are
    under torchao's 4096 elements: their moments are dequantized from the saved codes. Either way every
    moment starts where the saving run left it."""
    import low_bit_workers as workers
    from distributed import run_ranks, values

    directory = str(tmp_path / "checkpoint")
    saved = values(run_ranks(2, workers.fsdp_low_bit_checkpoint, directory, "save", timeout_s=900, pg_timeout_s=120))
    quantized = [f"{layer}.weight.{key}.quantized" for layer in (0, 2, 4) for key in ("exp_avg", "exp_avg_sq")]
    on_three = ["2.weight.exp_avg.quantized", "2.weight.exp_avg_sq.quantized"]
    assert saved[0]["quantized"] == quantized
    for rank in values(run_ranks(2, workers.fsdp_low_bit_checkpoint, directory, "resume",
                                 timeout_s=900, pg_timeout_s=120)):
        assert rank["quantized"] == quantized and rank["steps"] == workers.STEPS
        assert all(error == 0.0 for error in rank["moment_error"].values()), rank["moment_error"]
        assert rank["vs_saving_run"] == 0.0, rank
    for rank in values(run_ranks(3, workers.fsdp_low_bit_checkpoint, directory, "resume",
                                 timeout_s=900, pg_timeout_s=120)):
        assert rank["quantized"] == on_three, rank["quantized"]                  # the others' shards: fp32
        assert all(error == 0.0 for error in rank["moment_error"].values()), rank["moment_error"]
        assert rank["vs_saving_run"] < 1e-3, rank                                 # gradients summed otherwise


def test_fsdp_with_adamw8bit_quantizes_moments_saved_fp32_when_loaded_on_fewer_ranks(tmp_path):
    """Saved on 3 ranks (the [256, 64] weight's and the head's moments fp32 there), loaded on 2, where
    torchao quantizes their shards: their moments are quantized from the saved values (within a code
    step of the block's largest), the [1024, 256] weight's codes and scales read in place."""
    import low_bit_workers as workers
    from distributed import RankError, run_ranks, values

    directory = str(tmp_path / "checkpoint")
    run_ranks(3, workers.fsdp_low_bit_checkpoint, directory, "save", timeout_s=900, pg_timeout_s=120)
    for rank in values(run_ranks(2, workers.fsdp_low_bit_checkpoint, directory, "resume",
                                 timeout_s=900, pg_timeout_s=120)):
        assert rank["saved_quantized"] == ["2.weight.exp_avg.quantized", "2.weight.exp_avg_sq.quantized"]
        assert "4.weight.exp_avg.quantized" in rank["quantized"] and "0.weight.exp_avg.quantized" in rank["quantized"]
        errors = rank["moment_error"]
        requantized = [f"{layer}.weight.{key}" for layer in (0, 4) for key in ("exp_avg", "exp_avg_sq")]
        assert all(errors[k] == 0.0 for k in errors if k not in requantized), errors
        assert all(0.0 < errors[k] < 0.02 for k in requantized), errors
        assert rank["vs_saving_run"] < 1e-3, rank
    # another quantization (4-bit codes, blocks of 128) cannot read these codes: refused, not misread
    for rank in run_ranks(2, workers.fsdp_low_bit_checkpoint, directory, "resume", "AdamW4bit",
                          timeout_s=900, pg_timeout_s=120):
        assert isinstance(rank, RankError) and rank.type == "OptpassError", rank
        assert "saved with another quantization" in rank.message and "AdamW4bit" in rank.message, rank.message
    # and torch.optim's AdamW would have been handed codes as its state
    for rank in run_ranks(2, workers.fsdp_low_bit_checkpoint, directory, "resume", "AdamW",
                          timeout_s=900, pg_timeout_s=120):
        assert isinstance(rank, RankError) and rank.type == "OptpassError", rank
        assert "is a quantized moment's" in rank.message and "not AdamW" in rank.message, rank.message


def test_fsdp_with_adamw8bit_resumed_through_torchs_state_dict_api_keeps_quantized_moments(tmp_path):
    """torch's get_state_dict / set_state_dict with DCP (torchtitan's checkpoint): the optimizer's
    state_dict() gives each moment's values, and the load quantizes them again where torchao quantizes
    the shard (it gave fp32 moments before: four times the state, silently). Requantizing moves a
    signed moment's codes a little; optpass.save_sharded_checkpoint keeps them exactly (above)."""
    import low_bit_workers as workers
    from distributed import run_ranks, values

    directory = str(tmp_path / "checkpoint")
    values(run_ranks(2, workers.fsdp_low_bit_checkpoint, directory, "save", "AdamW8bit", "torch",
                     timeout_s=900, pg_timeout_s=120))
    for rank in values(run_ranks(2, workers.fsdp_low_bit_checkpoint, directory, "resume", "AdamW8bit", "torch",
                                 timeout_s=900, pg_timeout_s=120)):
        assert rank["quantized"] == rank["saved_quantized"] == [
            f"{layer}.weight.{key}.quantized" for layer in (0, 2, 4) for key in ("exp_avg", "exp_avg_sq")], rank
        assert max(rank["moment_error"].values()) < 2e-2, rank["moment_error"]
        assert rank["vs_saving_run"] < 2e-3, rank
    # on 3 ranks (DCP cut the pickled 8-bit moments of 512 rows at 342 and torchao refused: a fresh user)
    for rank in values(run_ranks(3, workers.fsdp_low_bit_checkpoint, directory, "resume", "AdamW8bit", "torch",
                                 timeout_s=900, pg_timeout_s=120)):
        assert rank["quantized"] == ["2.weight.exp_avg.quantized", "2.weight.exp_avg_sq.quantized"], rank
        assert max(rank["moment_error"].values()) < 2e-2, rank["moment_error"]
        assert rank["vs_saving_run"] < 2e-3, rank
