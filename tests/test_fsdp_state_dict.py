"""A model sharded by optpass.fully_shard speaks FSDP2's state-dict language (optpass/fsdp/state_dict.py):
torch's get_state_dict / set_state_dict and DCP save and resume it, 2 ranks to 2 and to 1, equal to
one process (float64). The programs: tests/fsdp_state_dict_workers.py."""

from __future__ import annotations

import pytest

import fsdp_state_dict_workers as workers
from distributed import run_ranks, values

PROGRAMS = ["save", "resume", "model_load_state_dict"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fsdp_state_dict"))


@pytest.fixture(scope="module")
def two(workdir):
    return values(run_ranks(2, workers.run_all, PROGRAMS, workdir, timeout_s=900, pg_timeout_s=120))


@pytest.fixture(scope="module")
def one(two, workdir):            # after two: it resumes two's checkpoint
    return values(run_ranks(1, workers.run_all, ["resume", "model_load_state_dict"], workdir,
                            timeout_s=900, pg_timeout_s=120))


def _ok(result):
    assert "error" not in result, result["error"][2] if "error" in result else result
    return result


def test_state_dicts_hold_dtensors_of_the_full_shape_with_this_ranks_rows(two):
    for rank, result in enumerate(two):
        got = _ok(result["save"])
        for name, shape in got["reference_shapes"].items():
            assert got["shapes"][name] == ("DTensor", shape), (name, got["shapes"])
        # rows split as torch.chunk does: 7 rows of a Linear(3, 7)... on 2 ranks, 4 and 3; no padding saved
        for name, rows in got["local_rows"].items():
            full = got["reference_shapes"][name][0]
            chunk = -(-full // 2)
            assert rows[0] == max(0, min(chunk, full - rank * chunk)), (name, rows)
        assert got["exp_avg"] == ("DTensor", tuple(got["reference_shapes"]["0.weight"]))


def test_a_full_state_dict_is_one_process_model_and_optimizer(two):
    for result in two:
        got = _ok(result["save"])
        assert got["full_vs_one_process"] <= 1e-12 and got["full_exp_avg_vs_one_process"] <= 1e-12, got
        assert got["full_step"] == workers.SAVED_AFTER


@pytest.mark.parametrize("world", [2, 1])
def test_dcp_save_then_a_fresh_meta_model_resumed_with_set_state_dict_trains_as_one_process(two, one, world):
    for result in (two if world == 2 else one):
        got = _ok(result["resume"])
        assert got["dcp"] <= 1e-12 and got["full"] <= 1e-12, got


@pytest.mark.parametrize("world", [2, 1])
def test_load_state_dict_takes_full_tensors_and_dtensors(two, one, world):
    for result in (two if world == 2 else one):
        got = _ok(result["model_load_state_dict"])
        assert got["from_full"] == 0.0 and got["from_dtensors"] == 0.0, got
