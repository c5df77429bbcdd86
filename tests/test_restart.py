"""A job under ``torchrun --max-restarts 1`` whose rank 1 is killed (SIGKILL) in step 7 resumes from its last
complete checkpoint and ends equal, bit for bit, to the same job not interrupted (tests/restart_job.py):
zero1 and fsdp, the update in and after backward, AdamW and torchao's AdamW8bit, an LR scheduler and the
step saved in the checkpoint (``extra=``). 2 gloo ranks, float64."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = ["zero1:in:adamw", "zero1:after:adamw", "zero1:in:adamw8bit",
        "fsdp:in:adamw:inductor", "fsdp:after:adamw", "fsdp:in:adamw8bit"]


def _job(out: str, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", "--monitor-interval", "0.5", os.path.join(HERE, "restart_job.py"),
               "--out", out, "--steps", "9", "--save-every", "3", "--runs", *RUNS, *extra]
    # torchrun keeps its store across restarts unless told not to; gloo then dials the dead attempt's
    # addresses (pytorch#135712; docs/fsdp.md "When a rank fails")
    env = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    pytest.importorskip("torchao")
    killed, whole = str(tmp_path_factory.mktemp("killed")), str(tmp_path_factory.mktemp("whole"))
    return _job(killed, "--kill-at", "7"), killed, _job(whole), whole


def test_a_killed_job_restarts_from_its_last_checkpoint_and_ends_as_if_never_interrupted(jobs):
    killed_job, killed, whole_job, whole = jobs
    assert whole_job.returncode == 0, whole_job.stderr[-4000:]
    assert killed_job.returncode == 0, killed_job.stderr[-4000:]
    output = killed_job.stdout + killed_job.stderr
    assert "attempt 0: resumed at steps [0, 0, 0, 0, 0, 0]" in output
    assert "attempt 1: resumed at steps [6, 6, 6, 6, 6, 6]" in output, output[-4000:]
    assert "failed (exitcode: -9) local_rank: 1" in output          # torchrun saw rank 1 killed
    for run in RUNS:
        name = run.replace(":", "-")
        for rank in range(2):
            resumed = torch.load(os.path.join(killed, f"{name}-rank{rank}.pt"))
            uninterrupted = torch.load(os.path.join(whole, f"{name}-rank{rank}.pt"))
            assert len(resumed) == len(uninterrupted) > 0
            for a, b in zip(resumed, uninterrupted):
                assert torch.equal(a, b), (run, rank, (a.double() - b.double()).abs().max())
