"""examples/torchtitan_train.py, the loop a torchtitan + FSDP2 user brings, run as they would run it:
torchrun on 2 ranks for 6 steps (meta build, per-layer activation checkpointing, per-layer
fully_shard with FSDP2's bf16 MixedPrecisionPolicy, AdamW with warmup + cosine, clip 1.0, the update
in backward, DCP checkpoints every 3 steps), then its step-3 checkpoint resumed on 3 ranks; and with --tp 2 --float8 on a 2-D mesh of 4 ranks, resumed on 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "torchtitan_train.py")
ARGS = ["--steps", "6", "--checkpoint-every", "3", "--warmup", "2", "--lr", "1e-2"]


def _torchrun(ranks: int, out: str, args=ARGS) -> list[dict]:
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc-per-node={ranks}", EXAMPLE, "--out", out, *args],
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    runs = []
    for name in sorted(os.listdir(out)):
        if name.startswith("losses-from-"):
            with open(os.path.join(out, name)) as f:
                runs.append({"file": name, **json.load(f), "stdout": result.stdout})
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    uninterrupted = str(tmp_path_factory.mktemp("titan_2_ranks"))
    two = _torchrun(2, uninterrupted)
    resumed = str(tmp_path_factory.mktemp("titan_resumed_on_3"))
    shutil.copytree(os.path.join(uninterrupted, "step-3"), os.path.join(resumed, "step-3"))
    three = _torchrun(3, resumed)
    return uninterrupted, two, three


def test_the_loop_trains_and_logs(runs):
    _, two, _ = runs
    assert [r["world"] for r in two] == [2, 2] and all(r["start"] == 0 for r in two)
    losses = {int(k): v for k, v in two[0]["losses"].items()}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert losses[6] < losses[1] - 0.3, losses                 # the pattern is learned
    assert two[0]["losses"] == two[1]["losses"]                 # every rank logs the mean over ranks
    assert "step    6  loss" in two[0]["stdout"] and "grad_norm" in two[0]["stdout"]


def test_checkpoints_hold_full_shapes(runs):
    """DCP stores each parameter at its full shape (DTensors), so any number of ranks can read it."""
    import torch.distributed.checkpoint as dcp

    uninterrupted, _, _ = runs
    metadata = dcp.FileSystemReader(os.path.join(uninterrupted, "step-3")).read_metadata()
    shapes = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")}
    assert shapes["model.model.embed_tokens.weight"] == (256, 64), shapes
    assert shapes["model.lm_head.weight"] == (256, 64), shapes
    assert shapes["optim.state.model.embed_tokens.weight.exp_avg"] == (256, 64), shapes


def test_resumed_on_three_ranks_continues_the_run(runs):
    """Steps 4-6 resumed on 3 ranks from the step-3 checkpoint: the same learning rates, and losses
    within bf16 rounding of the uninterrupted 2-rank run (started from scratch, 2 and 3 ranks differ
    by 1e-3 of the loss at step 6; a fresh model's loss at step 4 would be 8% off)."""
    _, two, three = runs
    assert [r["world"] for r in three] == [3, 3, 3] and all(r["start"] == 3 for r in three)
    expected = {int(k): v for k, v in two[0]["losses"].items()}
    got = {int(k): v for k, v in three[0]["losses"].items()}
    assert sorted(got) == [4, 5, 6]
    assert three[0]["lrs"] == {k: v for k, v in two[0]["lrs"].items() if int(k) > 3}
    for step, loss in got.items():
        assert abs(loss - expected[step]) <= 5e-3 * expected[step], (step, got, expected)


# ---------------------------------------------------------------- --tp 2 --float8: FSDP + TP on a 2-D mesh

TWO_D_ARGS = ["--tp", "2", "--float8", "--steps", "4", "--checkpoint-every", "2", "--warmup", "1", "--lr", "1e-2"]


@pytest.fixture(scope="module")
def two_dimensional_runs(tmp_path_factory):
    """4 ranks (dp 2 x tp 2, Float8 Linears, bf16 gathers, activation checkpointing, clip 1.0, the update
    in backward), then its step-2 checkpoint resumed on 2 ranks (dp 1 x tp 2)."""
    uninterrupted = str(tmp_path_factory.mktemp("titan_dp2_tp2"))
    four = _torchrun(4, uninterrupted, TWO_D_ARGS)
    resumed = str(tmp_path_factory.mktemp("titan_dp1_tp2"))
    shutil.copytree(os.path.join(uninterrupted, "step-2"), os.path.join(resumed, "step-2"))
    two = _torchrun(2, resumed, TWO_D_ARGS)
    return four, two


def test_the_2d_float8_loop_trains_and_resumes_on_fewer_data_parallel_ranks(two_dimensional_runs):
    four, two = two_dimensional_runs
    assert [(r["world"], r["tp"]) for r in four] == [(4, 2)] * 4 and [(r["world"], r["tp"]) for r in two] == [(2, 2)] * 2
    expected = {int(k): v for k, v in four[0]["losses"].items()}
    assert expected[4] < expected[1] - 0.2, expected                  # it learns
    assert all(r["losses"] == four[0]["losses"] for r in four)        # the mean over ranks, on every rank
    got = {int(k): v for k, v in two[0]["losses"].items()}
    assert sorted(got) == [3, 4]
    for step, loss in got.items():                                   # dp 2 -> 1: bf16 sums in another order
        assert abs(loss - expected[step]) <= 5e-3 * expected[step], (step, got, expected)
