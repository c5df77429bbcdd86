"""A sharded checkpoint is published whole or not at all (optpass/checkpoint_files.py): a save that dies
after writing its files leaves the previous checkpoint loadable, a checkpoint that is missing, has no
metadata or a cut one is refused with nothing of the model changed, and a save that finishes replaces
the previous one and leaves nothing else behind; a directory with other files in it is refused, not
replaced. zero1 on 2 gloo ranks; fsdp's save and load go
through the same two functions (test_fsdp's checkpoint tests)."""

from __future__ import annotations

import pytest

import bad_checkpoint_workers
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


@pytest.mark.parametrize("kind", ["zero1", "fsdp"])
def test_a_checkpoint_of_another_model_optimizer_or_program_or_with_cut_data_is_refused(kind, tmp_path):
    """Each refused on both ranks alike before anything is read (nothing of the model or the optimizer
    state changes), naming what differs; then the good checkpoint loads exactly. Under fsdp one rank
    holds none of the one-row head: such a checkpoint once failed to load at all (DCP dropped the
    rank's empty piece and read the param groups under their pre-2.4 keys)."""
    for result in values(run_ranks(2, bad_checkpoint_workers.bad_checkpoints, kind, str(tmp_path), timeout_s=300)):
        refusals = result["refusals"]
        assert "this model's 0.weight has size [16, 6], the checkpoint's [24, 6]: it was saved from another model" \
            in refusals["wider model"]
        assert "5.weight" in refusals["deeper model"] and "saved from another model" in refusals["deeper model"]
        assert "the optimizer's setting 'betas' (param group 0) is not in it: it was saved with another optimizer" \
            in refusals["other optimizer"]
        assert ("this model's 0.weight is not in it: it was saved from another model or by another program"
                in refusals["foreign"])
        assert "is cut short (" in refusals["cut data"] and "is not a complete checkpoint" in refusals["cut data"]
        assert "is missing" in refusals["lost data"]
        assert all("Nothing was loaded" in message for message in refusals.values()), refusals
        assert set(result["changed"].values()) == {0.0}, result["changed"]
        assert result["good loaded"] == 0.0
        assert result["other settings in code"] == 0.0
        assert "could not save" in result["unpicklable extra"] and "Nothing was published" in result["unpicklable extra"]
        assert result["good kept"]
