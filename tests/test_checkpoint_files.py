"""A sharded checkpoint is published whole or not at all (optpass/checkpoint_files.py): a save that dies
after writing its files leaves the previous checkpoint loadable, a checkpoint that is missing, has no
metadata or a cut one is refused with nothing of the model changed, and a save that finishes replaces
the previous one and leaves nothing else behind; a directory with other files in it is refused, not
replaced. zero1 on 2 gloo ranks; fsdp's save and load go
through the same two functions (test_fsdp's checkpoint tests)."""

from __future__ import annotations

import zero1_workers as workers
from distributed import run_ranks, values


def test_an_interrupted_save_leaves_the_previous_checkpoint_and_bad_ones_are_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    for result in values(run_ranks(2, workers.save_interrupted_then_bad_checkpoints, path, timeout_s=300)):
        assert result["interrupted"] == "killed"
        assert result["left_after_interrupted"] == ["ckpt", "ckpt.incomplete"]   # the first kept, the second not published
        assert result["loaded_previous"] == 0.0
        refusals = result["refusals"]
        assert "there is no checkpoint directory there" in refusals["missing"]
        assert "it has no DCP metadata (.metadata): a save to it did not finish" in refusals["no metadata"]
        assert "its DCP metadata cannot be read" in refusals["cut"] and "cut short" in refusals["cut"]
        shared = refusals.pop("shared directory")
        assert "holds files that are not a checkpoint's (train.log)" in shared and "would delete them" in shared
        assert all("is not a complete checkpoint" in message and "Nothing was loaded" in message
                   for message in refusals.values())
        assert result["unchanged_by_refusals"] == 0.0
        assert result["loaded_new"] == 0.0
        assert result["left_at_end"] == ["ckpt"]           # the stale .incomplete removed, no .previous left
