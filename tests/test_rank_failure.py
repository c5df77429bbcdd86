"""A rank killed mid-training (SIGKILL) makes the other rank raise at once, naming it; the failed step's
half-updated state cannot be saved; the checkpoint saved before is whole (optpass/rank_failure.py).
2 gloo ranks, zero1 and fsdp with the update in backward."""

from __future__ import annotations

import signal

import pytest

import rank_failure_workers as workers
from distributed import RankKilled, run_ranks


@pytest.mark.parametrize("kind,lower,killed", [("zero1", "eager", 1), ("fsdp", "inductor", 1), ("fsdp", "eager", 0)],
                         ids=["zero1", "fsdp", "fsdp-store-host-killed"])
def test_a_killed_rank_is_named_by_the_others_within_seconds(kind, lower, killed, tmp_path):
    results = run_ranks(2, workers.killed_mid_training, kind, lower, killed, str(tmp_path),
                        timeout_s=300, pg_timeout_s=600, may_be_killed=(killed,))
    assert results[killed] == RankKilled(signal.SIGKILL)
    survivor = results[1 - killed]
    assert survivor["type"] == "OptpassError", survivor
    message = survivor["message"]
    assert (f"data_parallel='{kind}': the step failed on rank {1 - killed} of 2: Rank {killed} is lost: its process"
            in message)
    assert "no longer runs: it was killed or exited" in message
    assert "restart every rank from the last complete checkpoint" in message
    # the process group's timeout is 10 minutes here: the error came from the broken connection
    assert survivor["seconds_to_raise"] < 60, survivor
    assert "save_sharded_checkpoint: a training step failed part-way" in survivor["save_after"]
    assert "Nothing was saved" in survivor["save_after"]
    assert survivor["left"] == ["killed-at", "step-3"]           # no "after-failure", nothing incomplete
    assert ".metadata" in survivor["checkpoint"]
