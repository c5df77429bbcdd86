"""Every rank starts from rank 0's model, as under DDP, and ranks that disagree fail alike (2 gloo ranks).

The ranks run tests/ranks_start_alike_workers.py: one process group runs the programs that keep it
usable, another the disagreements, the last of which ends with rank 0's exit.
"""

from __future__ import annotations

import pytest

import ranks_start_alike_workers as workers
from distributed import run_ranks, values

PROGRAMS = ["meta_model_materialized", "zero1_buffers", "fsdp_buffers"]
RUNS = 4
UNWRITTEN_BUFFERS = ["eval_scale", "unread"]          # the step does not read them
RANDOM_BUFFERS = UNWRITTEN_BUFFERS + ["body.1.running_mean"]


@pytest.fixture(scope="module")
def ranks():
    return values(run_ranks(2, workers.run_all, PROGRAMS, timeout_s=600, pg_timeout_s=60))


def _ok(result):
    assert "error" not in result, result["error"][2] if "error" in result else result
    return result


@pytest.mark.parametrize("program", ["zero1_buffers", "fsdp_buffers"])
def test_every_buffer_read_by_the_step_or_not_is_rank_zeros_as_under_ddp(ranks, program):
    """Seeded per rank, the buffers differ across ranks before; after two steps the ones the step
    does not read (one read only in evaluation, one read by nothing) are rank 0's, every buffer
    equals DDP's on that rank (BatchNorm's running statistics: rank 0's, then this rank's batch), and
    so does evaluation (it reads the eval-only buffer and frozen layer)."""
    for result in ranks:
        _ok(result[program])
    assert all(ranks[1][program]["before"][name] > 0 for name in RANDOM_BUFFERS), ranks[1][program]
    for result in ranks:
        assert all(result[program]["after"][name] == 0.0 for name in UNWRITTEN_BUFFERS), result[program]
        assert all(d <= 1e-6 for d in result[program]["vs_ddp"].values()), result[program]
        assert result[program]["eval_vs_ddp"] <= 1e-6, result[program]


def test_a_meta_model_materialized_before_fully_shard_trains_as_one_process(ranks):
    """to_empty and init on every rank (seeded per rank), then fully_shard: rank 0's values, as DDP."""
    for result in ranks:
        assert _ok(result["meta_model_materialized"])["vs_one_process"] <= 1e-6, result


@pytest.fixture(scope="module")
def disagreeing():
    """Its own process group: its last program's rank 0 exits on its error, and the store with it."""
    return values(run_ranks(2, workers.disagree, RUNS, timeout_s=300, pg_timeout_s=60))


def test_ranks_that_disagree_fail_alike_while_rank_zero_drops_the_store_at_once(disagreeing):
    """Each run: rank 1 posts first and reads slowly, rank 0 reads everything first and drops the
    store it hosts as soon as it raised. Every rank of every run gets the same RanksDisagree."""
    for run in range(RUNS):
        errors = {disagreeing[rank]["runs"][run] for rank in range(2)}
        assert len(errors) == 1, (run, disagreeing)
        kind, message = errors.pop()
        assert kind == "RanksDisagree" and "param group 0 'lr' is '0.05' on rank 0 but '0.1' on rank 1" in message


def test_a_rank_zero_that_exits_on_the_disagreement_leaves_rank_one_the_same_error(disagreeing):
    errors = [result["exit"] for result in disagreeing]
    assert errors[0] == errors[1], errors
    assert errors[0][0] == "RanksDisagree" and "param group 0 'lr' is" in errors[0][1], errors
