"""Tensor parallelism (torch's parallelize_module) compiled with optpass, on 2 gloo ranks.

A Hugging Face Llama under torchtitan's plan (column- and row-parallel projections, the embedding's
rows and the head's columns sharded, sequence parallelism around the norms) trains equal to the same
program on the whole model in one process (float64), with the update after backward and in it, with
global-norm clipping summed over the tensor-parallel group, accumulation, loss parallelism and
state the update creates; what cannot be is refused naming it (tests/tensor_parallel_workers.py).
One process group runs every program.
"""

from __future__ import annotations

import pytest

import optpass
import tensor_parallel_workers as workers
from distributed import run_ranks, values

PROGRAMS = ["plain_step", "in_backward", "in_backward_clipped", "in_backward_accumulated",
            "in_backward_loss_parallel", "in_backward_sgd_momentum", "master_weights_bf16",
            "muon_on_a_sharded_matrix", "data_parallel_over_a_tensor_parallel_model", "context_parallel_sdpa"]


@pytest.fixture(scope="module")
def ranks():
    return values(run_ranks(2, workers.run_all, PROGRAMS, timeout_s=1200, pg_timeout_s=120))


def _trained(result) -> dict:
    assert "error" not in result, result["error"][2] if "error" in result else result
    return result


def _equal_to_one_process(result, tolerance=1e-9) -> None:
    result = _trained(result)
    assert result["relative"] <= tolerance, result
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-12), result
    assert result["grads_none"], result
    assert "DTensor" in result["state_types"], result      # the state is laid out as the parameters


def test_the_step_as_written_trains_as_one_process_with_clip_grad_norm_in_it(ranks):
    for result in ranks:
        _equal_to_one_process(result["plain_step"])


def test_the_update_in_backward_on_each_ranks_shard_trains_as_one_process(ranks):
    for result in ranks:
        _equal_to_one_process(result["in_backward"])


def test_clip_grad_norm_in_backward_sums_the_norm_over_the_tensor_parallel_group(ranks):
    """Each sharded gradient's squares are summed over the ranks holding its other shards, each
    replicated one (the norms' weights) counted once: the norm and the parameters are one process's."""
    for result in ranks:
        for lower, got in result["in_backward_clipped"].items():
            _equal_to_one_process(got)
            assert got["grad_norm"] == pytest.approx(got["reference_grad_norm"], rel=1e-12), (lower, got)
            assert got["grad_norm"] > 0.5, got                     # clipping was active


def test_accumulation_with_clipping_trains_as_one_process(ranks):
    for result in ranks:
        got = result["in_backward_accumulated"]
        _equal_to_one_process(got)
        assert got["grad_norm"] == pytest.approx(got["reference_grad_norm"], rel=1e-12), got


def test_loss_parallel_with_the_logits_sharded_along_the_vocabulary(ranks):
    for result in ranks:
        _equal_to_one_process(result["in_backward_loss_parallel"])


def test_state_the_update_creates_is_a_dtensor_laid_out_as_its_parameter(ranks):
    """SGD's first momentum buffer is made from the gradient inside the fused step."""
    for result in ranks:
        got = result["in_backward_sgd_momentum"]
        _equal_to_one_process(got)
        assert got["state_types"] == ["DTensor"], got


def test_master_weights_of_bf16_shards_train_as_megatrons_step_by_hand(ranks):
    """Against the same tensor-parallel model trained eagerly with fp32 masters by hand: within a
    few bf16 roundings (compiled Adam takes its bias corrections in fp32, eager in Python doubles)."""
    for result in ranks:
        got = _trained(result["master_weights_bf16"])
        assert got["dtypes"] == ["torch.bfloat16"], got
        assert got["relative"] <= 2e-2, got


def test_a_non_elementwise_optimizer_on_a_sharded_parameter_is_refused_naming_it(ranks):
    for result in ranks:
        kind, message, _ = result["muon_on_a_sharded_matrix"]["error"]
        assert kind == "OptpassError"
        assert "Muon's update is not elementwise" in message and "0.weight is sharded (Shard(dim=0))" in message
        assert "tensor parallelism" in message and "elementwise optimizer" in message


def test_data_parallel_over_a_tensor_parallel_model_is_refused_with_what_works(ranks):
    for result in ranks:
        kind, message, _ = result["data_parallel_over_a_tensor_parallel_model"]["error"]
        assert kind == "OptpassError" and "data_parallel='zero1' over a tensor-parallel model" in message
        assert "data_parallel='fsdp' on a 2-D mesh" in message


def test_context_parallel_is_refused_on_every_rank_naming_it(ranks):
    for result in ranks:
        for name, got in result["context_parallel_sdpa"].items():
            kind, message, _ = got["error"]
            assert kind == "OptpassError", (name, got)
            assert "context_parallel" in message and "What works today" in message, (name, got)


# ---------------------------------------------------------------- 2-D: FSDP over dp x tensor parallel over tp

@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    """dp 2 x tp 2 on 4 ranks, then the checkpoint it saved resumed on dp 1 x tp 2."""
    path = str(tmp_path_factory.mktemp("two_dimensional") / "checkpoint")
    trained = values(run_ranks(4, workers.two_dimensional_programs, path, timeout_s=1500, pg_timeout_s=120))
    resumed = values(run_ranks(2, workers.two_dimensional_resumes, path, timeout_s=900, pg_timeout_s=120))
    return trained, resumed


def test_fsdp_over_dp_and_tensor_parallel_over_tp_train_as_one_process(two_by_two):
    """optpass.fully_shard(block, mesh=mesh["dp"]) over torchtitan's plan on mesh["tp"]: each shard
    gathered over dp just before use, DTensor's collectives over tp, each gradient reduced onto its
    dp shard and updated in backward, the norm summed over both: one process on the whole batch."""
    trained, _ = two_by_two
    for result in trained:
        for name in ("in_backward", "after_backward"):
            got = _trained(result[name])
            assert got["relative"] <= 1e-9, (name, got)
            assert got["grad_norm"] == pytest.approx(got["reference_grad_norm"], rel=1e-12), (name, got)
            assert got["shard_types"] == ["Parameter"], got          # plain shards, as 1-D fsdp's


def test_state_dicts_on_the_2d_mesh_are_dtensors_with_both_placements(two_by_two):
    trained, _ = two_by_two
    for result in trained:
        got = _trained(result["saves"])
        assert got["saved_vs_params"] == 0.0, got
        assert got["spread"] == {}, got          # every rank holds the same parameters (replicas agree)
        # a column-parallel weight: tp splits its rows first, dp each part's rows (FSDP2's strided shard)
        assert got["placements"] == ["(Shard(dim=0), Replicate())", "(Shard(dim=0), Shard(dim=1))",
                                     "(_StridedShard(dim=0, sf=2), Shard(dim=0))"], got


def test_a_dcp_checkpoint_of_dp2_tp2_resumes_on_dp1_tp2_exactly(two_by_two):
    _, resumed = two_by_two
    for result in resumed:
        assert result["loaded_vs_saved"] == 0.0, result
        assert result["relative"] <= 1e-9, result


def test_optpass_own_fsdp_checkpoint_of_a_2d_model_is_refused_with_torchs_way(two_by_two):
    trained, _ = two_by_two
    for result in trained:
        kind, message, _ = result["optpass_checkpoint"]["error"]
        assert kind == "OptpassError" and "2-D mesh" in message and "get_state_dict" in message


def test_the_llama_plan_refuses_a_head_tied_to_the_embedding():
    """parallelize_module gives the head and the embedding a DTensor each: a tied pair would train
    apart silently (0.58 from one process after 3 eager steps), so the plan refuses it, with the fix;
    nothing is planned (no mesh is needed to be told)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(optpass.OptpassError, match="tie_word_embeddings=False"):
        optpass.plans.hugging_face_llama(model, mesh=None)
    assert model.lm_head.weight is model.model.embed_tokens.weight
