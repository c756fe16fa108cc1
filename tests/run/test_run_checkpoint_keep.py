"""Which run checkpoints survive a save: the one just written (which `latest` names) always, then the
newest steps before it, the steps of a timeline abandoned by a resume from an earlier checkpoint first
to go; and a checkpoint replaced at its own step is never missing where `latest` leads."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from tests.support.run_checkpoints import crash_between_the_renames, save_steps
from tnlg.run.checkpoint import LATEST, latest_checkpoint, resume_candidates


def _kept(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def _saved_step(checkpoint: Path) -> int:
    return json.loads((checkpoint / "engine" / "manifest.json").read_text())["step"]


@pytest.mark.parametrize(
    ("keep_last", "kept"),
    [(1, ["step-00000003"]), (2, ["step-00000002", "step-00000003"]), (3, ["step-00000002", "step-00000003", "step-00000004"])],
)  # fmt: skip
def test_a_run_resumed_from_an_earlier_step_keeps_what_it_wrote(tmp_path, keep_last, kept):
    save_steps(tmp_path, 2, 2, 4)  # the first run: steps 2 and 4
    save_steps(tmp_path, keep_last, 3)  # resumed from step 2, saving step 3
    assert _kept(tmp_path) == kept
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000003"
    assert _saved_step(latest_checkpoint(tmp_path)) == 3


def test_an_uninterrupted_run_keeps_its_newest_checkpoints(tmp_path):
    save_steps(tmp_path, 2, 1, 2, 3, 4)
    assert _kept(tmp_path) == ["step-00000003", "step-00000004"]


def test_a_crash_while_replacing_a_checkpoint_leaves_latest_leading_to_a_complete_one(tmp_path, monkeypatch):
    save_steps(tmp_path, 2, 2)
    crash_between_the_renames(tmp_path, monkeypatch, 2)  # a resumed run saving step 2 again
    assert json.loads((tmp_path / LATEST).read_text()) == {"checkpoint": "step-00000002"}
    previous = latest_checkpoint(tmp_path)
    assert _saved_step(previous) == 2 and (previous / "rank-00000.json").is_file()
    save_steps(tmp_path, 2, 2)  # the next save at that step completes the replacement
    assert _kept(tmp_path) == ["step-00000002"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000002"


def test_an_older_checkpoint_that_cannot_be_removed_is_named_and_the_run_goes_on(
    tmp_path, monkeypatch, caplog
):
    save_steps(tmp_path, 1, 1)
    real_rmtree = shutil.rmtree

    def rmtree(path, ignore_errors=False):  # the older checkpoint's directory refuses deletion
        if not ignore_errors and Path(path).name == "step-00000001":
            raise PermissionError(13, "Permission denied", str(path))
        return real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with caplog.at_level(logging.WARNING, logger="tnlg.run.checkpoint"):
        save_steps(tmp_path, 1, 2)  # housekeeping failing does not fail the save
    monkeypatch.undo()
    assert "step-00000002 is saved" in caplog.text
    assert (
        "train.keep_last 1 could not remove the older" in caplog.text and "Permission denied" in caplog.text
    )
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000002"
    assert _kept(tmp_path) == ["step-00000001", "step-00000002"]
    save_steps(tmp_path, 1, 3)  # once it can be, the next save removes it
    assert _kept(tmp_path) == ["step-00000003"]


def test_a_checkpoint_set_aside_by_a_stopped_save_returns_at_the_next_save(tmp_path, monkeypatch):
    """The version set aside is the only copy of its step: the run resumed from it saves a later step,
    and it takes its place among the kept checkpoints again instead of staying hidden for good."""
    save_steps(tmp_path, 2, 2)
    crash_between_the_renames(tmp_path, monkeypatch, 2)
    assert (tmp_path / ".step-00000002.replaced").is_dir() and not (tmp_path / "step-00000002").exists()
    save_steps(tmp_path, 2, 4)  # the run resumed from the set-aside step 2 goes on to step 4
    assert _kept(tmp_path) == ["step-00000002", "step-00000004"]
    assert _saved_step(tmp_path / "step-00000002") == 2
    save_steps(tmp_path, 2, 6)  # and keep_last prunes it in its turn
    assert _kept(tmp_path) == ["step-00000004", "step-00000006"]


def test_a_stopped_save_at_the_same_step_keeps_the_only_copy_until_its_successor_is_in(tmp_path, monkeypatch):
    """Saving again the step whose previous version a stopped save set aside: that version is what `latest`
    leads to, so it is not deleted before the new one is in place (a crash in between would leave `latest`
    leading nowhere)."""
    save_steps(tmp_path, 2, 2)
    crash_between_the_renames(tmp_path, monkeypatch, 2)
    crash_between_the_renames(tmp_path, monkeypatch, 2)  # the resumed run stops again at the same point
    previous = latest_checkpoint(tmp_path)
    assert previous == tmp_path / ".step-00000002.replaced" and _saved_step(previous) == 2
    save_steps(tmp_path, 2, 2)
    assert _kept(tmp_path) == ["step-00000002"]


def test_the_staging_directory_of_a_killed_save_is_removed_by_the_next_save(tmp_path, caplog):
    """A process killed while writing (no exception to clean up after) leaves its staging directory, a
    partial checkpoint as large as a whole one; the next completed save removes it, saying so."""
    save_steps(tmp_path, 2, 2)
    killed = tmp_path / ".step-00000003.staging"
    (killed / "engine").mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="tnlg.run.checkpoint"):
        save_steps(tmp_path, 2, 4)
    assert _kept(tmp_path) == ["step-00000002", "step-00000004"]
    assert f"removed {killed}" in caplog.text


def test_a_fallback_from_a_checkpoint_set_aside_tries_the_older_steps(tmp_path, monkeypatch):
    """`latest` leading to the version set aside (`.step-N.replaced`, which sorts before every step) still
    has the steps before N behind it with train.resume_fallback."""
    save_steps(tmp_path, 3, 1, 2)
    crash_between_the_renames(tmp_path, monkeypatch, 2)
    named = latest_checkpoint(tmp_path)
    assert named == tmp_path / ".step-00000002.replaced"
    assert resume_candidates(tmp_path, named, True) == [named, tmp_path / "step-00000001"]


def test_a_step_whose_aside_cannot_be_removed_is_kept_with_it(tmp_path, monkeypatch, caplog):
    """keep_last removes a step's aside (left by a save whose deletion of it failed) before the step: an
    aside left partial without its step would come back as that step at the next save."""
    save_steps(tmp_path, 1, 1)
    (tmp_path / ".step-00000001.replaced" / "engine").mkdir(parents=True)
    real_rmtree = shutil.rmtree

    def rmtree(path, ignore_errors=False):  # every aside refuses deletion
        if Path(path).name.endswith(".replaced"):
            if ignore_errors:
                return None
            raise PermissionError(13, "Permission denied", str(path))
        return real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with caplog.at_level(logging.WARNING, logger="tnlg.run.checkpoint"):
        save_steps(tmp_path, 1, 2)
    monkeypatch.undo()
    assert _kept(tmp_path) == [".step-00000001.replaced", "step-00000001", "step-00000002"]
    assert "could not remove the older" in caplog.text
    save_steps(tmp_path, 1, 3)  # once it can be, both go
    assert _kept(tmp_path) == ["step-00000003"]
