"""Fully sharded data parallel (optpass.fully_shard + data_parallel="fsdp") on 2 and 3 gloo ranks.

Each program (tests/fsdp_workers.py) trains beside one process on the whole batch (float64, eager
torch.optim), torch's FSDP2, or is refused; one process group per world size runs them all. The
checkpoint saved on 2 ranks is resumed on 3.
"""

from __future__ import annotations

import pytest
from expecttest import assert_expected_inline

from optpass.passes.reshard_after_forward import unit_of

import fsdp_workers as workers
from distributed import run_ranks, values

TWO = ["meta_device_recipes", "hf_load_safetensors", "equivalence", "tied_weights", "frozen_and_dynamic", "accumulation", "master_weights_bf16",
       "against_fsdp2", "evaluation", "elementwise_transform_in_the_step", "checkpoint_save",
       "not_fully_sharded", "optimizer_before_fully_shard", "fully_sharded_without_the_option",
       "clip_grad_norm_in_the_step", "options_differ", "non_elementwise_optimizer", "explain_an_fsdp_step",
       "hf_llama", "hf_gpt2_tied", "clip_grad_norm_option", "fp16_scaler_with_an_inf_on_one_rank",
       "groups_by_dim", "batchnorm_as_ddp", "reshard_graph_diff", "reshard_graph_diff_off_gloo",
       "gloo_collectives_run_on_one_thread", "coalesced_units", "fsdp2_style_blocks_then_root",
       "fsdp2_style_blocks_only", "hf_llama_per_block", "lookups_materialized", "ranks_seeded_differently",
       "first_reader_hoisted", "head_kept_from_forward", "reshard_graph_diff_head", "meta_model_mistakes"]
THREE = ["meta_device_recipes", "hf_load_safetensors", "fsdp2_style_blocks_then_root", "hf_llama_per_block", "equivalence_two_configs", "tied_weights", "against_fsdp2", "checkpoint_resume", "different_models",
         "coalesced_units_inductor"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fsdp"))


# A rank killed by a signal fails the tests with its output (no rerun): the shards' collectives run
# on gloo through a twin group with one worker thread, which gloo's heap corruption needs two of
# (docs/design.md §45).
@pytest.fixture(scope="module")
def two(workdir):
    return values(run_ranks(2, workers.run_all, TWO, workdir, timeout_s=1500, pg_timeout_s=120))


@pytest.fixture(scope="module")
def three(two, workdir):          # after two: it resumes two's checkpoint
    return values(run_ranks(3, workers.run_all, THREE, workdir, timeout_s=1500, pg_timeout_s=120))


def _ok(result):
    assert "error" not in result, result["error"][2] if "error" in result else result
    return result


def _error(result) -> tuple[str, str]:
    assert "error" in result, result
    return result["error"][:2]


@pytest.mark.parametrize("world", [2, 3])
def test_a_model_built_on_the_meta_device_is_sharded_then_initialized_by_its_own_code(two, three, world):
    for result in (two if world == 2 else three):
        got = _ok(result["meta_device_recipes"])
        for way in ("reset_parameters", "apply", "hf_init_weights", "hf_gpt2_tied"):
            assert got[way] == 0.0, (way, got)        # the rows of the unsharded model's initialization
        assert got["gpt2_tied_again"], got
        assert "written directly during their initialization" in got["written_directly"], got
        assert got["gathered_at_once"] <= 2, got       # never more than two full parameters at once
        assert got["live_beyond_shards"] == 0, got     # no gathered parameter stays alive
        assert got["trained_vs_one_process"] <= 1e-12, got
        assert "were not initialized after to_empty" in got["uninitialized"], got["uninitialized"]
        assert got["hf_meta_load_logits"] <= 1e-12, got


@pytest.mark.parametrize("world", [2, 3])
def test_a_hugging_face_checkpoint_loads_each_ranks_rows_from_safetensors(two, three, world):
    for result in (two if world == 2 else three):
        _check_safetensors_load(_ok(result["hf_load_safetensors"]), world)


def _check_safetensors_load(results: dict, world: int) -> None:
    for kind in ("llama", "gpt2"):
        assert results[f"{kind}/sharded"]["files"] > 1 and results[f"{kind}/one_file"]["files"] == 1
        for layout in ("one_file", "sharded"):
            loaded = results[f"{kind}/{layout}"]
            assert loaded["vs_from_pretrained"] == 0.0, (kind, layout, loaded)
            assert loaded["logits"] <= 1e-5, (kind, layout, loaded)
            # no full copy of a parameter: each read asks for this rank's rows only (safetensors
            # maps the file and copies the slice asked for)
            assert loaded["reads"] > 0 and loaded["rows_beyond_a_shard"] <= 0, (kind, layout, loaded)
    assert "intermediate_size" not in results["wrong_shape"]
    assert "mlp.gate_proj.weight has shape (64, 32) in the checkpoint, the model's is (48, 32)" in \
        results["wrong_shape"], results["wrong_shape"]


@pytest.mark.parametrize("world", [2, 3])
def test_twenty_steps_equal_one_process_on_the_whole_batch_in_both_lowerings(two, three, world):
    ranks, name = (two, "equivalence") if world == 2 else (three, "equivalence_two_configs")
    for result in ranks:
        for config, got in _ok(result[name]).items():
            if config == "warnings":
                continue
            assert got["vs_one_process"] <= 1e-12, (config, got)
            assert got["loss"] <= 1e-12, (config, got)
            # each rank holds ceil(numel / N) of every parameter, and AdamW state for that only
            assert got["resident"] <= 1.1 * got["full"] / world + 2 * 8, got
            assert got["state"] == 2 * got["resident"], got
            # gloo: one all-gather per parameter (what the last step ran, cached compile or not)
            assert got["gathers"].get("all_gather_into_tensor", 0) >= 6, got["gathers"]
            assert "all_gather_into_tensor_coalesced" not in got["gathers"], got["gathers"]


@pytest.mark.parametrize("world", [2, 3])
def test_tied_weights_are_one_shard_gathered_for_each_use_with_one_gradient(two, three, world):
    for result in (two if world == 2 else three):
        got = _ok(result["tied_weights"])
        assert got["tied"] and got["shards"] == got["reference_params"] == 3, got
        assert got["vs_one_process"] <= 1e-12, got


def test_frozen_parameters_and_changing_batch_sizes(two):
    for result in two:
        got = _ok(result["frozen_and_dynamic"])
        assert got["vs_one_process"] <= 1e-12 and got["loss"] <= 1e-12, got


def test_gradient_accumulation_after_backward_and_in_backward(two):
    for result in two:
        got = _ok(result["accumulation"])
        assert not got["warnings"], got
        assert got[False] <= 1e-12 and got[True] <= 1e-12, got


def test_bf16_parameters_with_fp32_master_shards(two):
    for result in two:
        got = _ok(result["master_weights_bf16"])
        assert got["masters_fp32"] and got["masters"] == got["params"], got     # masters of the shards only
        assert got["vs_fp32"] <= 2e-2, got           # bf16's rounding of fp32 training


@pytest.mark.parametrize("world", [2, 3])
def test_matches_torch_fsdp2_in_fp32(two, three, world):
    for result in (two if world == 2 else three):
        assert _ok(result["against_fsdp2"])["vs_fsdp2"] <= 1e-5, result["against_fsdp2"]


def test_evaluation_outside_the_step_gathers_what_it_needs(two):
    for result in two:
        got = _ok(result["evaluation"])
        assert got["eager_eval"] <= 1e-12 and got["compiled_eval"] <= 1e-12, got


def test_an_elementwise_gradient_transform_in_the_step_trains_as_one_process(two):
    for result in two:
        assert _ok(result["elementwise_transform_in_the_step"])["vs_one_process"] <= 1e-12


def test_a_checkpoint_saved_on_two_ranks_resumes_on_three(two, three):
    for result in two:
        assert _ok(result["checkpoint_save"])["saved"]
    for result in three:
        got = _ok(result["checkpoint_resume"])
        assert got["vs_one_process"] <= 1e-12 and got["meta_vs_one_process"] <= 1e-12, got


@pytest.mark.parametrize("program, kind, what", [
    ("not_fully_sharded", "OptpassError", "on a model that was not passed to optpass.fully_shard"),
    ("optimizer_before_fully_shard", "OptpassError", "(0.weight, 0.bias, 2.weight and 5 more): it was built before fully_shard"),
    ("fully_sharded_without_the_option", "OptpassError", "'data_parallel': 'fsdp'"),
    ("clip_grad_norm_in_the_step", "OptpassError", "fsdp_workers.py"),
    ("options_differ", "RanksDisagree", "option optimizer_in_backward is True on rank 0 but False on rank 1"),
    ("non_elementwise_optimizer", "OptpassError", "Adafactor's update is not elementwise"),
    ("fsdp2_style_blocks_only", "OptpassError", "block and then fully_shard(model) on the whole model"),
])
def test_refusals_name_the_fix_on_every_rank(two, program, kind, what):
    messages = set()
    for result in two:
        got_kind, message = _error(result[program])
        assert got_kind == kind and what in message, message
        messages.add(message)
    assert len(messages) == 1


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2s_calls_per_block_then_root_train_as_one_process_with_the_blocks_as_units(two, three, world):
    for result in (two if world == 2 else three):
        got = _ok(result["fsdp2_style_blocks_then_root"])
        for lower in ("eager", "inductor"):
            assert got[lower]["vs_one_process"] <= 1e-12 and got[lower]["loss"] <= 1e-12, (lower, got[lower])
        # units 0, 2 and the root's other parameters (the name rule gives 0, 2, 3, 5): 3 coalesced
        # gathers in forward (the last step ran 4 coalesced in all, and 2.weight alone in backward)
        assert "one per unit: 0, 2, (root)" in got["explain"], got["explain"]
        assert "FSDP2's order" in got["root_then_block"] and "sharded already" in got["twice"], got
        llama = _ok(result["hf_llama_per_block"])
        assert llama["vs_root_only"] == 0.0, llama              # the same training as fully_shard(model) alone
        if world == 2:   # on 3 ranks the model's own float32 paths differ from one process (see _hf_train)
            assert llama["vs_one_process"] <= 1e-12 and llama["loss"] <= 1e-12, llama


def test_ranks_holding_different_models_fail_alike_before_any_collective(three):
    messages = {_error(result["different_models"]) for result in three}
    assert len(messages) == 1
    kind, message = messages.pop()
    assert kind == "RanksDisagree" and "(13, 7)" in message and "(14, 7)" in message, message


@pytest.mark.parametrize("world", [2, 3])
def test_a_units_gathers_coalesced_into_one_all_gather_equal_one_process(two, three, world):
    ranks, name = (two, "coalesced_units") if world == 2 else (three, "coalesced_units_inductor")
    for result in ranks:
        got = _ok(result[name])
        for config, values in got.items():
            if config in ("warnings", "explain"):
                continue
            assert values["vs_one_process"] <= 1e-12 and values["loss"] <= 1e-12, (config, values)
            # what the last step ran: the four units' coalesced gathers in forward at least (a compiled
            # graph cached under other settings would run per-parameter gathers: the cache key has them)
            assert values["gathers"].get("all_gather_into_tensor_coalesced", 0) >= 4, (config, values)
        # layers 0, 2, 3 and 5, a weight and a bias each: one all-gather per unit in forward
        assert "4 collective(s) for 8 parameters (one per unit: 0, 2, 3, 5)" in got["explain"], got["explain"]


def test_explain_says_what_is_gathered_and_when(two):
    text = _ok(two[0]["explain_an_fsdp_step"])["text"]
    assert "reshard_after_forward: applied" in text, text
    assert "all-gathered again in backward just before backward reads them" in text, text
    again = next(line for line in text.splitlines() if "all-gathered again in backward" in line)
    assert "2.weight" in again and "0.weight" not in again, again   # layer 0: no input grad
    # the last layer: backward reads it right after forward's last read, forward's copy serves it
    kept = next(line for line in text.splitlines() if "kept from forward into backward" in line)
    assert "5.weight" in kept and "5.weight" not in again, (kept, again)
    assert "8 reduce-scatter(s)" in text, text
    # on gloo one all-gather per parameter (a unit's coalesced gather copies out of a flat buffer there)
    assert "8 collective(s) for 8 parameters (one per parameter" in text, text
    assert "shard_optimizer: skipped (data_parallel is 'fsdp'" in text, text


@pytest.mark.parametrize("program", ["hf_llama", "hf_gpt2_tied"])
def test_hugging_face_llama_and_gpt2_with_tied_embeddings_equal_one_process(two, program):
    for result in two:
        got = _ok(result[program])
        assert got["shards"] == got["reference_params"], got         # GPT-2's wte / lm_head: one shard
        assert got["vs_one_process"] <= 1e-12, got
        assert got["loss"] <= 1e-6, got           # transformers computes the loss in float32


@pytest.mark.parametrize("placement", ["in_backward", "after_backward"])
def test_the_clip_grad_norm_option_clips_by_the_global_norm_of_the_shards(two, placement):
    for result in two:
        got = _ok(result["clip_grad_norm_option"])[placement]
        assert got["clipped"], got          # every step clipped: the norm is not one rank's part
        assert got["vs_one_process"] <= 1e-12, got
        assert got["norm_vs_one_process"] <= 1e-12, got      # optpass.grad_norm(opt): clip_grad_norm_'s
        assert got["grads_left"] == 0, got   # the update ran in the step graph: no .grad for opt.step()


def test_an_inf_on_one_rank_skips_every_ranks_step_under_a_grad_scaler(two):
    scales = set()
    for result in two:
        got = _ok(result["fp16_scaler_with_an_inf_on_one_rank"])
        assert got["skipped"] == 1 and got["unchanged"] == 0.0 and got["moved"] > 0, got
        scales.add(got["scale"])
    assert scales == {2.0 ** 7}        # backed off once, alike on every rank


def test_a_shard_keeps_its_parameters_dimensions_so_groups_by_dim_are_right(two):
    for result in two:
        got = _ok(result["groups_by_dim"])
        assert got["groups"] == got["reference_groups"] == [3, 6], got   # a 0-d parameter included
        assert got["vs_one_process"] <= 1e-12, got


def test_batchnorm_running_statistics_are_rank_zeros_as_under_ddp(two):
    for result in two:
        got = _ok(result["batchnorm_as_ddp"])
        assert got[False] <= 1e-12 and got[True] <= 1e-12, got


def test_reshard_after_forward_graph_diff(two):
    """On gloo, one all-gather per parameter: the second Linear's weight is gathered again just
    before backward reads it (the first's is not read by backward: no input gradient); each gather
    starts before the previous one's wait (prefetch), all on the group's twin with one worker thread
    ('0/optpass-one-thread': gloo, docs/design.md §45); each reduce-scatter is waited for (and its
    result divided) just before the next one starts, not right after its own start."""
    assert_expected_inline(_ok(two[0]["reshard_graph_diff"])["diff"], """\
--- before
+++ after
@@ -7,2 +7,3 @@
 all_gather_into_tensor_0 = _c10d_functional.all_gather_into_tensor(in0, 2, '0/optpass-one-thread')
+all_gather_into_tensor_1 = _c10d_functional.all_gather_into_tensor(in1, 2, '0/optpass-one-thread')
 wait_tensor_0 = _c10d_functional.wait_tensor(all_gather_into_tensor_0)
@@ -10,3 +11,3 @@
 view_0 = aten.view(slice_0, [3, 4])
-all_gather_into_tensor_1 = _c10d_functional.all_gather_into_tensor(in1, 2, '0/optpass-one-thread')
+all_gather_into_tensor_2 = _c10d_functional.all_gather_into_tensor(in3, 2, '0/optpass-one-thread')
 wait_tensor_1 = _c10d_functional.wait_tensor(all_gather_into_tensor_1)
@@ -18,3 +19,3 @@
 detach_0 = aten.detach(tanh_0)
-all_gather_into_tensor_2 = _c10d_functional.all_gather_into_tensor(in3, 2, '0/optpass-one-thread')
+all_gather_into_tensor_3 = _c10d_functional.all_gather_into_tensor(in4, 2, '0/optpass-one-thread')
 wait_tensor_2 = _c10d_functional.wait_tensor(all_gather_into_tensor_2)
@@ -22,3 +23,2 @@
 view_2 = aten.view(slice_2, [2, 3])
-all_gather_into_tensor_3 = _c10d_functional.all_gather_into_tensor(in4, 2, '0/optpass-one-thread')
 wait_tensor_3 = _c10d_functional.wait_tensor(all_gather_into_tensor_3)
@@ -41,8 +41,6 @@
 reduce_scatter_tensor_0 = _c10d_functional.reduce_scatter_tensor(view_5, 'sum', 2, '0/optpass-one-thread')
+view_6 = aten.view(t_5, [2, 3])
 wait_tensor_4 = _c10d_functional.wait_tensor(reduce_scatter_tensor_0)
 div_0 = aten.div.Tensor(wait_tensor_4, 2)
-view_6 = aten.view(t_5, [2, 3])
 reduce_scatter_tensor_1 = _c10d_functional.reduce_scatter_tensor(view_6, 'sum', 2, '0/optpass-one-thread')
-wait_tensor_5 = _c10d_functional.wait_tensor(reduce_scatter_tensor_1)
-div_1 = aten.div.Tensor(wait_tensor_5, 2)
 detach_1 = aten.detach(detach_0)
@@ -58,5 +56,5 @@
 cat_0 = aten.cat([view_8, new_zeros_0])
+wait_tensor_5 = _c10d_functional.wait_tensor(reduce_scatter_tensor_1)
+div_1 = aten.div.Tensor(wait_tensor_5, 2)
 reduce_scatter_tensor_2 = _c10d_functional.reduce_scatter_tensor(cat_0, 'sum', 2, '0/optpass-one-thread')
-wait_tensor_6 = _c10d_functional.wait_tensor(reduce_scatter_tensor_2)
-div_2 = aten.div.Tensor(wait_tensor_6, 2)
 view_9 = aten.view(t_8, [3, 4])
@@ -64,2 +62,4 @@
 cat_1 = aten.cat([view_9, new_zeros_1])
+wait_tensor_6 = _c10d_functional.wait_tensor(reduce_scatter_tensor_2)
+div_2 = aten.div.Tensor(wait_tensor_6, 2)
 reduce_scatter_tensor_3 = _c10d_functional.reduce_scatter_tensor(cat_1, 'sum', 2, '0/optpass-one-thread')""")


def test_reshard_after_forward_graph_diff_off_gloo(two):
    """Off gloo (COALESCE_UNITS; from explain, nothing runs): each Linear's weight and bias
    are one coalesced all-gather (a unit), the second unit's started before the first unit's first
    wait; the second Linear's weight is gathered again just before backward reads it (the first's
    is not read by backward)."""
    assert_expected_inline(_ok(two[0]["reshard_graph_diff_off_gloo"])["diff"], """\
--- before
+++ after
@@ -6,8 +6,12 @@
 in5 = placeholder
-all_gather_into_tensor_0 = _c10d_functional.all_gather_into_tensor(in0, 2, '0/optpass-one-thread')
-wait_tensor_0 = _c10d_functional.wait_tensor(all_gather_into_tensor_0)
+all_gather_into_tensor_coalesced_0 = _c10d_functional.all_gather_into_tensor_coalesced([in0, in1], 2, '0/optpass-one-thread')
+getitem_0 = getitem(all_gather_into_tensor_coalesced_0, 0)
+getitem_1 = getitem(all_gather_into_tensor_coalesced_0, 1)
+all_gather_into_tensor_coalesced_1 = _c10d_functional.all_gather_into_tensor_coalesced([in3, in4], 2, '0/optpass-one-thread')
+getitem_2 = getitem(all_gather_into_tensor_coalesced_1, 0)
+getitem_3 = getitem(all_gather_into_tensor_coalesced_1, 1)
+wait_tensor_0 = _c10d_functional.wait_tensor(getitem_0)
 slice_0 = aten.slice.Tensor(wait_tensor_0, 0, 0, 3)
 view_0 = aten.view(slice_0, [3, 4])
-all_gather_into_tensor_1 = _c10d_functional.all_gather_into_tensor(in1, 2, '0/optpass-one-thread')
-wait_tensor_1 = _c10d_functional.wait_tensor(all_gather_into_tensor_1)
+wait_tensor_1 = _c10d_functional.wait_tensor(getitem_1)
 slice_1 = aten.slice.Tensor(wait_tensor_1, 0, 0, 3)
@@ -18,8 +22,6 @@
 detach_0 = aten.detach(tanh_0)
-all_gather_into_tensor_2 = _c10d_functional.all_gather_into_tensor(in3, 2, '0/optpass-one-thread')
-wait_tensor_2 = _c10d_functional.wait_tensor(all_gather_into_tensor_2)
+wait_tensor_2 = _c10d_functional.wait_tensor(getitem_2)
 slice_2 = aten.slice.Tensor(wait_tensor_2, 0, 0, 2)
 view_2 = aten.view(slice_2, [2, 3])
-all_gather_into_tensor_3 = _c10d_functional.all_gather_into_tensor(in4, 2, '0/optpass-one-thread')
-wait_tensor_3 = _c10d_functional.wait_tensor(all_gather_into_tensor_3)
+wait_tensor_3 = _c10d_functional.wait_tensor(getitem_3)
 slice_3 = aten.slice.Tensor(wait_tensor_3, 0, 0, 2)
@@ -41,8 +43,6 @@
 reduce_scatter_tensor_0 = _c10d_functional.reduce_scatter_tensor(view_5, 'sum', 2, '0/optpass-one-thread')
+view_6 = aten.view(t_5, [2, 3])
 wait_tensor_4 = _c10d_functional.wait_tensor(reduce_scatter_tensor_0)
 div_0 = aten.div.Tensor(wait_tensor_4, 2)
-view_6 = aten.view(t_5, [2, 3])
 reduce_scatter_tensor_1 = _c10d_functional.reduce_scatter_tensor(view_6, 'sum', 2, '0/optpass-one-thread')
-wait_tensor_5 = _c10d_functional.wait_tensor(reduce_scatter_tensor_1)
-div_1 = aten.div.Tensor(wait_tensor_5, 2)
 detach_1 = aten.detach(detach_0)
@@ -58,5 +58,5 @@
 cat_0 = aten.cat([view_8, new_zeros_0])
+wait_tensor_5 = _c10d_functional.wait_tensor(reduce_scatter_tensor_1)
+div_1 = aten.div.Tensor(wait_tensor_5, 2)
 reduce_scatter_tensor_2 = _c10d_functional.reduce_scatter_tensor(cat_0, 'sum', 2, '0/optpass-one-thread')
-wait_tensor_6 = _c10d_functional.wait_tensor(reduce_scatter_tensor_2)
-div_2 = aten.div.Tensor(wait_tensor_6, 2)
 view_9 = aten.view(t_8, [3, 4])
@@ -64,2 +64,4 @@
 cat_1 = aten.cat([view_9, new_zeros_1])
+wait_tensor_6 = _c10d_functional.wait_tensor(reduce_scatter_tensor_2)
+div_2 = aten.div.Tensor(wait_tensor_6, 2)
 reduce_scatter_tensor_3 = _c10d_functional.reduce_scatter_tensor(cat_1, 'sum', 2, '0/optpass-one-thread')""")



def test_on_gloo_every_collective_runs_on_a_group_with_one_worker_thread(two):
    """gloo's two worker threads corrupt the heap when they run two functional collectives at once
    (docs/design.md §45): every collective of every fsdp step graph on gloo names the twin group with
    one worker thread, never the user's group (two threads); and prefetch is on (collectives in flight
    at once), which the twin makes safe."""
    found = {key: graph for key, graph in _ok(two[0]["gloo_collectives_run_on_one_thread"]).items()
             if key != "warnings"}
    assert len(found) == 12, found
    for key, graph in found.items():
        assert graph["groups"] and all(threads == 1 for threads in graph["groups"].values()), (key, graph)
        assert all(name.endswith("/optpass-one-thread") for name in graph["groups"]), (key, graph)
        assert graph["in_flight"] > 0, (key, graph)


def test_on_gloo_the_twin_has_one_worker_thread_and_outlives_a_new_init(workdir):
    """The twin optpass runs a sharded model's collectives on (gloo): one worker thread (the user's
    group has two), made once per group; all-gathers in flight at once on it, 200 rounds; after
    destroy_process_group and a new init_process_group a new twin (the old one shut down), and
    every rank exits cleanly (a rank killed by a signal at exit fails the run)."""
    for result in values(run_ranks(2, workers.one_thread_twin_lifecycle, workdir, timeout_s=300, pg_timeout_s=60)):
        assert result["name"] == "0/optpass-one-thread" and result["same_again"], result
        assert (result["threads"], result["user_threads"]) == (1, 2), result
        assert result["gathered"] == [[0, 0, 1, 1], [0, 1], [0, 0, 0, 1, 1, 1]], result
        assert result["again"] == "0/optpass-one-thread.1" and result["again_threads"] == 1, result
        assert result["again_gathered"] == [[0.0] * 3, [1.0] * 3], result


def test_a_unit_is_a_block_of_a_module_list_or_else_a_parameters_module():
    assert unit_of("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"
    assert unit_of("transformer.h.0.ln_1.bias") == "transformer.h.0"
    assert unit_of("0.weight") == "0"
    assert unit_of("model.embed_tokens.weight") == "model.embed_tokens"
    assert unit_of("lm_head.weight") == "lm_head"
    assert unit_of("scale") == ""


@pytest.mark.parametrize("scenario, parameter", [("lookups_materialized", "embed.weight"),
                                                 ("first_reader_hoisted", "head.weight"),
                                                 ("head_kept_from_forward", "head.weight")])
def test_a_placement_switched_on_or_off_trains_as_one_process_under_inductor(two, scenario, parameter):
    """An embedding's lookup made a buffer of its own or left to Inductor; a bias-free head's input
    gradient read before its weight gradient is made or not; the head (forward's last unit, backward's
    first) kept from forward into backward or gathered again: each way trains equal to one process,
    and the pass names the parameter it placed only when the switch is on."""
    for result in two:
        got = _ok(result[scenario])
        for on in (True, False):
            assert got[on]["vs_one_process"] <= 1e-12 and got[on]["loss"] <= 1e-12, got
        assert got[True]["notes"] and parameter in got[True]["notes"][0], got[True]["notes"]
        assert not got[False]["notes"], got[False]["notes"]


def test_reshard_after_forward_graph_diff_of_a_bias_free_head(two):
    """A language model's bias-free head: backward made the head's weight gradient (mm_1 before)
    before its input gradient (mm_2 before). After: the head is gathered again (all_gather 4), its
    input gradient is made from it first (mm_1 after, the views of the head just before it), then
    the weight gradient (mm_2 after), so the gathered head and the whole weight gradient are never
    alive together; the next gather (all_gather 5) starts once that gradient is sent, not beside it
    (the head is done; the gradient is the graph's peak). The embedding's lookup is a buffer of its own (clone_after: Inductor's lowering)."""
    assert_expected_inline(_ok(two[0]["reshard_graph_diff_head"])["diff"], """\
--- before
+++ after
@@ -8,2 +8,3 @@
 all_gather_into_tensor_0 = _c10d_functional.all_gather_into_tensor(in1, 2, '0/optpass-one-thread')
+all_gather_into_tensor_1 = _c10d_functional.all_gather_into_tensor(in2, 2, '0/optpass-one-thread')
 wait_tensor_0 = _c10d_functional.wait_tensor(all_gather_into_tensor_0)
@@ -12,3 +13,4 @@
 embedding_0 = aten.embedding(view_0, remainder_0)
-all_gather_into_tensor_1 = _c10d_functional.all_gather_into_tensor(in2, 2, '0/optpass-one-thread')
+clone_after_0 = optpass.clone_after(embedding_0, [])
+all_gather_into_tensor_2 = _c10d_functional.all_gather_into_tensor(in3, 2, '0/optpass-one-thread')
 wait_tensor_1 = _c10d_functional.wait_tensor(all_gather_into_tensor_1)
@@ -16,3 +18,3 @@
 view_1 = aten.view(slice_1, [64, 64])
-all_gather_into_tensor_2 = _c10d_functional.all_gather_into_tensor(in3, 2, '0/optpass-one-thread')
+all_gather_into_tensor_3 = _c10d_functional.all_gather_into_tensor(in4, 2, '0/optpass-one-thread')
 wait_tensor_2 = _c10d_functional.wait_tensor(all_gather_into_tensor_2)
@@ -20,3 +22,3 @@
 view_2 = aten.view(slice_2, [64])
-view_3 = aten.view(embedding_0, [8, 64])
+view_3 = aten.view(clone_after_0, [8, 64])
 t_0 = aten.t(view_1)
@@ -26,3 +28,2 @@
 detach_0 = aten.detach(tanh_0)
-all_gather_into_tensor_3 = _c10d_functional.all_gather_into_tensor(in4, 2, '0/optpass-one-thread')
 wait_tensor_3 = _c10d_functional.wait_tensor(all_gather_into_tensor_3)
@@ -48,38 +49,48 @@
 view_9 = aten.view(view_8, [8, 4096])
-t_2 = aten.t(view_9)
-mm_1 = aten.mm(t_2, view_6)
-t_3 = aten.t(mm_1)
-t_4 = aten.t(t_1)
-mm_2 = aten.mm(view_9, t_4)
-view_10 = aten.view(mm_2, [2, 4, 64])
-t_5 = aten.t(t_3)
-view_11 = aten.view(t_5, [4096, 64])
-reduce_scatter_tensor_0 = _c10d_functional.reduce_scatter_tensor(view_11, 'sum', 2, '0/optpass-one-thread')
-wait_tensor_4 = _c10d_functional.wait_tensor(reduce_scatter_tensor_0)
-div_0 = aten.div.Tensor(wait_tensor_4, 2)
+all_gather_into_tensor_4 = _c10d_functional.all_gather_into_tensor(in4, 2, '0/optpass-one-thread')
+wait_tensor_4 = _c10d_functional.wait_tensor(all_gather_into_tensor_4)
+slice_4 = aten.slice.Tensor(wait_tensor_4, 0, 0, 4096)
+view_10 = aten.view(slice_4, [4096, 64])
+t_2 = aten.t(view_10)
+t_3 = aten.t(t_2)
+mm_1 = aten.mm(view_9, t_3)
+t_4 = aten.t(view_9)
+mm_2 = aten.mm(t_4, view_6)
+t_5 = aten.t(mm_2)
+view_11 = aten.view(mm_1, [2, 4, 64])
+t_6 = aten.t(t_5)
+view_12 = aten.view(t_6, [4096, 64])
+reduce_scatter_tensor_0 = _c10d_functional.reduce_scatter_tensor(view_12, 'sum', 2, '0/optpass-one-thread')
+wait_tensor_5 = _c10d_functional.wait_tensor(reduce_scatter_tensor_0)
+all_gather_into_tensor_5 = _c10d_functional.all_gather_into_tensor(in2, 2, '0/optpass-one-thread')
 detach_3 = aten.detach(detach_0)
-tanh_backward_0 = aten.tanh_backward(view_10, detach_3)
-view_12 = aten.view(tanh_backward_0, [8, 64])
-t_6 = aten.t(t_0)
-mm_3 = aten.mm(view_12, t_6)
-t_7 = aten.t(view_12)
-mm_4 = aten.mm(t_7, view_3)
-t_8 = aten.t(mm_4)
-sum_0 = aten.sum.dim_IntList(view_12, [0], True)
-view_13 = aten.view(sum_0, [64])
-t_9 = aten.t(t_8)
-view_14 = aten.view(mm_3, [2, 4, 64])
-view_15 = aten.view(view_13, [64])
-reduce_scatter_tensor_1 = _c10d_functional.reduce_scatter_tensor(view_15, 'sum', 2, '0/optpass-one-thread')
-wait_tensor_5 = _c10d_functional.wait_tensor(reduce_scatter_tensor_1)
-div_1 = aten.div.Tensor(wait_tensor_5, 2)
-view_16 = aten.view(t_9, [64, 64])
-reduce_scatter_tensor_2 = _c10d_functional.reduce_scatter_tensor(view_16, 'sum', 2, '0/optpass-one-thread')
-wait_tensor_6 = _c10d_functional.wait_tensor(reduce_scatter_tensor_2)
-div_2 = aten.div.Tensor(wait_tensor_6, 2)
-embedding_dense_backward_0 = aten.embedding_dense_backward(view_14, remainder_0, 64, -1, False)
-view_17 = aten.view(embedding_dense_backward_0, [64, 64])
-reduce_scatter_tensor_3 = _c10d_functional.reduce_scatter_tensor(view_17, 'sum', 2, '0/optpass-one-thread')
-wait_tensor_7 = _c10d_functional.wait_tensor(reduce_scatter_tensor_3)
-div_3 = aten.div.Tensor(wait_tensor_7, 2)
+tanh_backward_0 = aten.tanh_backward(view_11, detach_3)
+view_13 = aten.view(tanh_backward_0, [8, 64])
+wait_tensor_6 = _c10d_functional.wait_tensor(all_gather_into_tensor_5)
+slice_5 = aten.slice.Tensor(wait_tensor_6, 0, 0, 64)
+view_14 = aten.view(slice_5, [64, 64])
+t_7 = aten.t(view_14)
+t_8 = aten.t(t_7)
+mm_3 = aten.mm(view_13, t_8)
+t_9 = aten.t(view_13)
+mm_4 = aten.mm(t_9, view_3)
+t_10 = aten.t(mm_4)
+sum_0 = aten.sum.dim_IntList(view_13, [0], True)
+view_15 = aten.view(sum_0, [64])
+t_11 = aten.t(t_10)
+view_16 = aten.view(mm_3, [2, 4, 64])
+view_17 = aten.view(view_15, [64])
+div_0 = aten.div.Tensor(wait_tensor_5, 2)
+reduce_scatter_tensor_1 = _c10d_functional.reduce_scatter_tensor(view_17, 'sum', 2, '0/optpass-one-thread')
+view_18 = aten.view(t_11, [64, 64])
+wait_tensor_7 = _c10d_functional.wait_tensor(reduce_scatter_tensor_1)
+div_1 = aten.div.Tensor(wait_tensor_7, 2)
+reduce_scatter_tensor_2 = _c10d_functional.reduce_scatter_tensor(view_18, 'sum', 2, '0/optpass-one-thread')
+embedding_dense_backward_0 = aten.embedding_dense_backward(view_16, remainder_0, 64, -1, False)
+view_19 = aten.view(embedding_dense_backward_0, [64, 64])
+wait_tensor_8 = _c10d_functional.wait_tensor(reduce_scatter_tensor_2)
+div_2 = aten.div.Tensor(wait_tensor_8, 2)
+reduce_scatter_tensor_3 = _c10d_functional.reduce_scatter_tensor(view_19, 'sum', 2, '0/optpass-one-thread')
+wait_tensor_9 = _c10d_functional.wait_tensor(reduce_scatter_tensor_3)
+div_3 = aten.div.Tensor(wait_tensor_9, 2)
 empty_like_0 = aten.empty_like(in1, pin_memory=False)""")


def test_a_meta_model_not_materialized_and_a_replaced_shard_are_refused_naming_the_fix(two):
    for result in two:
        got = _ok(result["meta_model_mistakes"])
        for where in ("full_state_dict", "step"):
            message = got[f"no_to_empty_{where}"]
            assert message.startswith("OptpassError") and "model.to_empty(device='cpu')" in message, got
        assert got["replaced"].startswith("OptpassError") and "replaced after fully_shard" in got["replaced"], got


def test_ranks_that_draw_a_meta_models_init_from_different_seeds_are_warned(two):
    for result in two:
        got = _ok(result["ranks_seeded_differently"])
        assert got["alike"] == [] and got["constants"] == [], got
        [message] = got["differently"]
        assert "torch.manual_seed(seed) on every rank" in message, message
