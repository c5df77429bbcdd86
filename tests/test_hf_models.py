"""Hugging Face models as users train them (tiny random configs, CPU), fused with optimizer-in-backward.

Every case trains a model twice from the same weights on the same batches: compiled with
optpass and every update fused into backward, and eagerly (a deepcopy, plain torch.optim).
Losses and parameters must agree, p.grad must be None after every step, and the step must be
one graph with the optimizer_in_backward pass applied (no forward-only graph, no update left
to torch.optim).

Numerics. The models are float64 and so is the default dtype while the tests run
(``float64_default``): torch.optim creates Adam's ``step`` counter in the default dtype, and
under torch.compile the bias corrections are tensor math on it, which in float32 drifts ~1e-6
from eager's Python floats per step (README, Numerics) and Adam's normalisation carries that
into every parameter (that, not the float32 loss, was the 1e-4 this file's GPT-2 test used to
allow). With a float64 counter the parameters agree to float64 rounding. The causal LMs' loss
is float32 all the same (transformers computes it on ``logits.float()``): it is compared to
float32 rounding (``F32_LOSS``), although it came out bit-identical here.

Hugging Face specifics seen here:

* GPT-2 with ``labels=`` logs with ``logger.warning_once`` inside its loss; optpass has Dynamo
  skip logging calls (docs/design.md §5), so the step stays one graph.
* The image classifiers' loss sets ``config.problem_type`` at the first call, which Dynamo
  guards on: a second compile at step 2, under any backend. The tests set it up front (as a
  fine-tuning script that knows its task does) to compile once.
* Dropout: optpass's eager lowering draws dropout masks from torch's generator in the
  forward's order, as eager PyTorch does, so with the same seed before each step the masks are
  eager's (BERT below). The Inductor lowering does too on CPU (``fallback_random``; checked by
  hand on this BERT, and in test_backend.py's random-ops test), but costs a C++ compile of
  ~1 min here: this file has no Inductor case (Inductor parity: test_optimizer_in_backward.py).
* Activation checkpointing works with eager and SDPA attention; around dropout it is refused
  with the op and the fix: torch cannot recompute random ops in a traced backward.
* Attention key biases get a gradient that is zero up to rounding (softmax does not see a
  per-query constant); Adam normalises that noise into updates that differ between the runs
  by ~4e-13 (GPT-2's c_attn.bias) on elements of about that size, so parameters are compared
  with an absolute tolerance (1e-10) beside the relative one.
"""

import concurrent.futures
import copy

import pytest
import torch

import optpass
from optpass.capture import GraphKind

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("float64_default")

STEPS = 5
VOCAB = 64
F32_LOSS = 1e-6          # relative: a float32 loss (causal LMs compute it on logits.float())


def hf_step(model, opt, autocast: bool = False):
    def train_step(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        loss.backward()
        out = loss.detach()
        opt.step()
        opt.zero_grad()
        return out
    return train_step


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05)


def sgd_momentum(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train_fused_and_eager(model, make_optimizer, batches, *, autocast=False, seed_each_step=False):
    """Train `model` compiled (every update fused) and a deepcopy eagerly; return both losses
    per step and the trained copies. Asserts what every case needs: p.grad None after each
    step, one step graph with the optimizer_in_backward pass applied, no forward-only graph."""
    reference = copy.deepcopy(model)
    opt, ref_opt = make_optimizer(model), make_optimizer(reference)
    step = torch.compile(hf_step(model, opt, autocast), backend="optpass",
                         options={"lower": "eager", "optimizer": opt, "optimizer_in_backward": True})
    eager = hf_step(reference, ref_opt, autocast)
    optpass.report.clear_reports()
    losses = []
    for i, batch in enumerate(batches):
        if seed_each_step:
            torch.manual_seed(100 + i)
        fused_loss = step(batch)
        if seed_each_step:
            torch.manual_seed(100 + i)
        losses.append((fused_loss.item(), eager(batch).item()))
        assert all(p.grad is None for p in model.parameters()), f"step {i}: an update was not fused"
    reports = optpass.recent_reports()
    kinds = [r.kind for r in reports]
    assert GraphKind.FORWARD not in kinds            # no break before backward()
    assert GraphKind.UPDATE not in kinds             # torch.optim's step() found nothing to update
    steps = [r for r in reports if r.kind is GraphKind.STEP]
    assert steps and all(any(p.name == "optimizer_in_backward" and p.status == "applied" for p in r.passes)
                         for r in steps)
    return losses, model, reference


def assert_same_parameters(model, reference, rtol=1e-9, atol=1e-10):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def assert_same_losses(losses, rel=1e-12):
    for i, (fused, eager) in enumerate(losses):
        assert fused == pytest.approx(eager, rel=rel), (i, losses)


def token_batches(shapes, generator_seed=0, mask_every=None):
    g = torch.Generator().manual_seed(generator_seed)
    batches = []
    for b, t in shapes:
        ids = torch.randint(0, VOCAB, (b, t), generator=g)
        labels = ids.clone()
        if mask_every:
            labels[:, ::mask_every] = -100           # masked LM: only some positions count
        batches.append({"input_ids": ids, "labels": labels})
    return batches


def image_batches(n_labels, generator_seed=0):
    g = torch.Generator().manual_seed(generator_seed)
    return [{"pixel_values": torch.randn(2, 3, 32, 32, generator=g),
             "labels": torch.randint(0, n_labels, (2,), generator=g)} for _ in range(STEPS)]


def enable_checkpointing(model):
    """torch.utils.checkpoint(use_reentrant=False) around each decoder layer. transformers 5
    renamed gradient_checkpointing_enable (a deprecated alias until v6)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()


def decoder_config(config_class, **kwargs):
    return config_class(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, **kwargs)


# ------------------------------------------------------------------ models (module scope: built once)

@pytest.fixture(scope="module")
def llama():
    """Llama with transformers' default attention (scaled_dot_product_attention)."""
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(decoder_config(transformers.LlamaConfig)).double()


# ------------------------------------------------------------------ causal LMs

def test_gpt2_with_labels_is_fused_and_matches_eager():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    config.loss_type = None            # as in a fresh config: the path that logs warning_once
    model = transformers.GPT2LMHeadModel(config).double()
    losses, model, reference = train_fused_and_eager(model, adamw, token_batches([(2, 8)] * STEPS))
    assert_same_losses(losses, rel=F32_LOSS)
    assert_same_parameters(model, reference)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_llama_with_activation_checkpointing_matches_eager(attention):
    """Activation checkpointing (torch.utils.checkpoint, use_reentrant=False): the decoder
    layer's activations are recomputed inside the traced backward, the updates fused after them.
    SDPA too: torch tags its kernels random even with dropout_p=0, but without dropout they draw
    nothing, so optpass recomputes them (optpass/checkpointed_regions.py)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(decoder_config(transformers.LlamaConfig,
                                                         attn_implementation=attention)).double()
    enable_checkpointing(model)
    losses, model, reference = train_fused_and_eager(model, adamw, token_batches([(2, 8)] * STEPS))
    assert_same_losses(losses, rel=F32_LOSS)
    assert_same_parameters(model, reference)


def test_checkpointing_around_attention_dropout_is_refused_with_the_op_and_the_fix(llama):
    """torch cannot recompute random ops of a checkpointed region when backward() is traced into
    the graph (under any backend): attention dropout in a checkpointed layer is refused, naming the
    op, its line, and the fix."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(decoder_config(transformers.LlamaConfig, attention_dropout=0.1))
    enable_checkpointing(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = torch.compile(hf_step(model, opt), backend="optpass",
                         options={"lower": "eager", "optimizer": opt, "optimizer_in_backward": True})
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(optpass.OptpassError) as refused:
        step(token_batches([(2, 8)])[0])
    message = str(refused.value)
    assert "activation checkpointing would recompute ops that draw random numbers" in message
    # SDPA with dropout runs its math path on CPU: the dropout op, at the attention call
    assert "aten.native_dropout.default at " in message and "sdpa_attention.py" in message
    assert "keep dropout out of the checkpointed function" in message
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))     # nothing trained


def test_llama_bf16_autocast_matches_eager(llama):
    """bf16 autocast around the forward of a float32 model (autocast leaves float64 alone).
    Losses equal eager's; parameters to float32 rounding: the fused update reads lr as a 0-d
    tensor, and Dynamo's tensor-lr SGD update (one fused multiply-add) rounds differently from
    eager's add_ (README, Numerics)."""
    model = copy.deepcopy(llama).float()
    losses, model, reference = train_fused_and_eager(model, sgd, token_batches([(2, 8)] * STEPS), autocast=True)
    assert_same_losses(losses, rel=F32_LOSS)
    assert_same_parameters(model, reference, rtol=1e-6, atol=1e-7)
    assert model.lm_head.weight.dtype == torch.float32


def test_qwen2_with_changing_sequence_lengths_and_a_smaller_last_batch():
    """T = 8, 12, 16, 16 and a last batch of 2 instead of 3, both dimensions marked dynamic
    (as a loader with ragged batches needs): one compile, whose fused step is compiled from the
    graph's symbolic inputs and serves every size (it used to be specialized to the first call's
    shapes and crash at the next length)."""
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(decoder_config(transformers.Qwen2Config)).double()
    batches = token_batches([(3, 8), (3, 12), (3, 16), (3, 16), (2, 16)])
    for batch in batches:
        for tensor in batch.values():
            torch._dynamo.mark_dynamic(tensor, 0)
            torch._dynamo.mark_dynamic(tensor, 1)
    losses, model, reference = train_fused_and_eager(model, sgd, batches)
    assert_same_losses(losses, rel=F32_LOSS)
    assert_same_parameters(model, reference)
    assert sum(r.kind is GraphKind.STEP for r in optpass.recent_reports()) == 1     # no recompile


def test_llama_bf16_master_weights_in_backward_with_changing_lengths_matches_megatron_way():
    """A bf16 Llama trained as people train large models: fp32 master weights
    (``master_weights=torch.float32``) with every master updated in backward, sequence lengths
    8, 12, 16 (marked dynamic), against the Megatron-way eager reference written in
    test_master_weights.py (fp32 masters, torch.optim over them, bf16 gradients cast, masters
    copied back; torch.optim's step as torch.compile computes it). Parameters within one bf16
    ulp, masters to 1e-5 relative, losses equal, one compile for every length."""
    from test_master_weights import MegatronReference, master_diff, param_ulps

    torch.manual_seed(0)
    start = transformers.LlamaForCausalLM(decoder_config(transformers.LlamaConfig)).to(torch.bfloat16)
    model = copy.deepcopy(start)
    make = lambda params: torch.optim.AdamW(params, lr=1e-3)      # noqa: E731
    opt = make(model.parameters())
    reference = MegatronReference(copy.deepcopy(start), make, update="compiled")
    step = torch.compile(hf_step(model, opt), backend="optpass", options={
        "lower": "eager", "optimizer": opt, "master_weights": torch.float32, "optimizer_in_backward": True})
    batches = token_batches([(2, 8), (2, 12), (2, 16), (2, 16), (2, 8)])
    for batch in batches:
        for tensor in batch.values():
            torch._dynamo.mark_dynamic(tensor, 1)
    optpass.report.clear_reports()
    for i, batch in enumerate(batches):
        loss = step(batch)
        expected = reference.step(batch, None, loss_fn=lambda m, b, _: m(**b).loss)
        assert loss.item() == pytest.approx(expected.item(), rel=F32_LOSS), i
        assert all(p.grad is None for p in model.parameters()), i
    assert param_ulps(model, reference) <= 1
    assert master_diff(opt, reference) <= 1e-5
    masters = optpass.master_weights(opt)
    assert all(m.dtype == torch.float32 for m in masters.values())
    assert any(not torch.equal(m.to(torch.bfloat16), s) for m, s in zip(masters.values(), start.parameters()))
    assert sum(r.kind is GraphKind.STEP for r in optpass.recent_reports()) == 1     # no recompile


def test_llama_fp16_grad_scaler_with_gradient_accumulation_and_changing_lengths_matches_gradscaler():
    """fp16 as Megatron trains it: fp32 masters, a GradScaler, and gradient accumulation (3 calls per
    update: two micro-steps without opt.step(), compiled with the step's options, then the step),
    sequence lengths 8, 12 and 16. Against torch.amp's GradScaler driving the Megatron-way reference
    (scaler.scale(loss).backward() per micro-step, fp16 gradients into fp32 masters, unscale_, step,
    update): SGD with momentum, every loss and the scale after every call equal, parameters bitwise,
    masters within 1e-6 (5.0e-8 measured; this file runs with float64 as the default dtype; the MLP
    accumulation tests of test_loss_scaling.py, at float32, are bitwise on the masters too)."""
    from test_master_weights import MegatronReference, master_diff, param_ulps

    torch.manual_seed(0)
    start = transformers.LlamaForCausalLM(decoder_config(transformers.LlamaConfig)).to(torch.float16)
    model = copy.deepcopy(start)
    make = lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9)      # noqa: E731
    opt = make(model.parameters())
    reference = MegatronReference(copy.deepcopy(start), make, update="compiled")
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 14, growth_interval=3)
    reference.opt.step = reference.update                 # what scaler.step(opt) calls
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 14, growth_interval=3)
    options = {"lower": "eager", "optimizer": opt, "master_weights": torch.float32, "grad_scaler": scaler}

    def micro_step(batch):
        loss = model(**batch).loss
        loss.backward()
        return loss.detach()

    micro = torch.compile(micro_step, backend="optpass", options=options)
    step = torch.compile(hf_step(model, opt), backend="optpass", options=options)
    for i, batch in enumerate(token_batches([(2, 8), (2, 12), (2, 16)] * 3)):
        expected = reference.model(**batch).loss
        ref_scaler.scale(expected).backward()
        if (i + 1) % 3:
            assert micro(batch).item() == expected.item(), i
        else:
            assert step(batch).item() == expected.item(), i
            for p, master in zip(reference.model.parameters(), reference.masters):
                master.grad, p.grad = p.grad.float(), None
            reference.finish_scaled_step(ref_scaler, None)
        assert scaler.get_scale() == ref_scaler.get_scale(), i
    assert all(p.grad is None for p in model.parameters())
    assert param_ulps(model, reference) == 0 and master_diff(opt, reference) <= 1e-6


# ------------------------------------------------------------------ encoders, vision

def test_bert_masked_lm_with_dropout_matches_eager_on_the_same_seed():
    """BERT's default dropout (0.1) stays on. optpass's eager lowering runs the aten graph in
    the forward's order, drawing each dropout mask from torch's generator as eager does: with
    the same seed before each step the masks, losses and parameters are eager's."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64)
    assert config.hidden_dropout_prob > 0 and config.attention_probs_dropout_prob > 0
    model = transformers.BertForMaskedLM(config).double()
    assert model.training
    losses, model, reference = train_fused_and_eager(model, sgd, token_batches([(2, 8)] * STEPS, mask_every=2),
                                                     seed_each_step=True)
    assert_same_losses(losses)
    assert_same_parameters(model, reference)


def test_vit_image_classification_matches_eager():
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=64, num_labels=5,
                                    problem_type="single_label_classification")
    model = transformers.ViTForImageClassification(config).double()
    losses, model, reference = train_fused_and_eager(model, sgd, image_batches(5))
    assert_same_losses(losses)
    assert_same_parameters(model, reference)
    assert sum(r.kind is GraphKind.STEP for r in optpass.recent_reports()) == 1


def test_resnet_batchnorm_running_stats_match_eager():
    """BatchNorm's running statistics are buffers the forward updates in place: they must end
    up as eager's too (the fused step writes them, torch.optim never sees them). SGD with
    momentum compiles twice (the first update creates the momentum buffers)."""
    torch.manual_seed(0)
    config = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8], depths=[1],
                                       layer_type="basic", num_labels=5, problem_type="single_label_classification")
    model = transformers.ResNetForImageClassification(config).double()
    losses, model, reference = train_fused_and_eager(model, sgd_momentum, image_batches(5))
    assert_same_losses(losses)
    assert_same_parameters(model, reference)
    buffers = dict(reference.named_buffers())
    assert any(name.endswith("running_var") for name in buffers)
    for name, buffer in model.named_buffers():
        torch.testing.assert_close(buffer, buffers[name], rtol=1e-12, atol=1e-14, msg=name)
    assert all(b.item() == STEPS for n, b in model.named_buffers() if n.endswith("num_batches_tracked"))
    assert sum(r.kind is GraphKind.STEP for r in optpass.recent_reports()) == 2


# ------------------------------------------------------------------ data parallel

ZERO1_TESTS = {"test_llama_zero1_on_two_ranks_matches_single_process_training",
               "test_llama_zero1_gradient_accumulation_with_sequence_lengths_that_change"}


@pytest.fixture(scope="module", autouse=True)
def zero1_ranks(request):
    """The zero1 case's 2 gloo ranks (tests/zero1_workers.py), started with the module's first
    test: they train while this process compiles the single-process cases, so on a 2-core
    machine the file takes the time of its longer half, not of both."""
    if not any(item.name in ZERO1_TESTS for item in request.session.items):
        yield None
        return
    import zero1_workers as workers
    from distributed import run_ranks

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        yield pool.submit(run_ranks, 2, workers.hf_causal_lm_runs,
                          [{"in_backward": True}, {"in_backward": False, "accumulate": True}], timeout_s=600)


def test_llama_zero1_on_two_ranks_matches_single_process_training(zero1_ranks):
    """data_parallel='zero1' with optimizer_in_backward on 2 gloo ranks: each rank trains on
    half of each global batch; parameters equal one process training on the whole batch. The
    losses are float32 (logits.float()): the ranks' mean differs from the global batch's mean
    in float32 rounding."""
    from distributed import values

    for in_backward, _ in values(zero1_ranks.result()):
        result = in_backward
        assert result["sharded"] and not {"forward", "update"} & set(result["kinds"]), result["kinds"]
        assert result["vs_single_process"] <= 1e-12, result
        for fused, eager in result["losses"]:
            assert fused == pytest.approx(eager, rel=1e-6), result["losses"]


def test_llama_zero1_gradient_accumulation_with_sequence_lengths_that_change(zero1_ranks):
    """zero1 after backward on 2 gloo ranks, each update 2 compiled micro-steps and the step, at 8, 12
    and 16 tokens in turn (each graph recompiles once with the length symbolic): every micro-step's
    and step's loss equals one process's on the whole batch (the float32 logits: 1.1e-7 relative
    measured), and the parameters equal one process accumulating the whole batches' gradients
    (float64: 1.8e-14 measured). The micro-steps keep their gradients (no sharded update in them)."""
    from distributed import values

    for _, result in values(zero1_ranks.result()):
        assert result["sharded"] and result["unsharded_compiles"] >= 1, result
        assert not {"forward", "update"} & set(result["kinds"]), result["kinds"]
        assert result["vs_single_process"] <= 1e-12, result
        assert len(result["losses"]) == 15
        for fused, eager in result["losses"]:
            assert fused == pytest.approx(eager, rel=1e-6), result["losses"]
