"""ZeroAccelerator.save_state / load_state under Accelerate's automatic checkpoint naming and stateful data
loaders: checkpoint_<N> folders numbered by the iteration and pruned to total_limit once the new one is
whole, the newest loaded with the numbering continued, an existing folder or a named directory refused
before anything is written, and each rank's loader position kept so that a resumed loop reads on
without skip_first_batches (see tnlg.checkpoint_naming)."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import pytest

from tests.support.accelerate_cases import Unsaveable, WarningRecords, prepared, refusal, train_loop
from tnlg.tools.spawn import run_distributed

pytest.importorskip("torchdata", reason="Accelerate's stateful data loaders are torchdata's")


def _options(project: str) -> dict:
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    return {
        "project_config": ProjectConfiguration(
            project_dir=project, automatic_checkpoint_naming=True, total_limit=2
        ),
        "dataloader_config": DataLoaderConfiguration(use_stateful_dataloader=True),
    }


def _listing(directory: Path) -> list[tuple[str, int]]:
    return sorted((p.name, p.stat().st_size) for p in directory.iterdir())


def _named_run(rank: int, world_size: int, project: str) -> dict:
    whole = train_loop(*prepared(2, **_options(f"{project}/whole")))
    root = Path(project) / "checkpoints"
    accelerator, model, optimizer, loader, scheduler = prepared(2, **_options(project))
    if rank == 0:
        root.mkdir(parents=True)
        (root / "notes.txt").write_text("the user's, not a checkpoint")
    batches, half = iter(loader), len(loader) // 2
    for taken in (1, 1, half - 2):  # three saves: checkpoint_0, _1, _2; total_limit 2 keeps _1 and _2
        train_loop(accelerator, model, optimizer, itertools.islice(batches, taken), scheduler)
        accelerator.save_state()
    named = refusal(lambda: accelerator.save_state(f"{project}/elsewhere"))
    before = _listing(root / "checkpoint_2")
    accelerator.project_configuration.iteration = 2
    exists = refusal(accelerator.save_state)
    after = _listing(root / "checkpoint_2")
    # A save refused on every rank (a state_dict JSON cannot hold) leaves no checkpoint_3 behind.
    accelerator.project_configuration.iteration = 3
    accelerator.register_for_checkpointing(Unsaveable())
    unsaveable = refusal(accelerator.save_state)
    accelerator.wait_for_everyone()

    accelerator, model, optimizer, loader, scheduler = prepared(2, **_options(project))
    accelerator.load_state()
    iteration = accelerator.project_configuration.iteration
    rest = train_loop(accelerator, model, optimizer, loader, scheduler)  # no skip_first_batches

    # A checkpoint holding no state of the loader (an older tnlg's) loads, saying so.
    accelerator.wait_for_everyone()
    (root / "checkpoint_2" / f"dataloader-0-rank-{rank:05d}.json").unlink()
    warnings = WarningRecords()
    logging.getLogger("tnlg").addHandler(warnings)
    accelerator.load_state()
    logging.getLogger("tnlg").removeHandler(warnings)
    empty, *_ = prepared(2, **_options(f"{project}/empty"))
    return {
        "whole": whole, "rest": rest, "half": half, "iteration": iteration,
        "folders": sorted(p.name for p in root.iterdir()), "files": [name for name, _ in before],
        "named": named, "exists": exists, "unchanged": before == after,
        "elsewhere": Path(f"{project}/elsewhere").exists(), "old": warnings.messages,
        "nothing_saved": refusal(empty.load_state), "unsaveable": unsaveable,
    }  # fmt: skip


@pytest.mark.slow
def test_automatic_naming_and_stateful_loaders_resume_as_accelerate_users_expect(tmp_path):
    results = run_distributed(_named_run, 2, str(tmp_path), timeout=600, collective_timeout=60)
    for rank, result in enumerate(results):
        # the newest checkpoint, at the loader's saved position: the uninterrupted run's losses
        assert result["rest"] == pytest.approx(result["whole"][result["half"] :], rel=1e-6)
        assert result["iteration"] == 3  # the next save_state() writes checkpoint_3
        assert result["folders"] == ["checkpoint_1", "checkpoint_2", "notes.txt"]
        assert {f"dataloader-0-rank-{r:05d}.json" for r in range(2)} <= set(result["files"]), rank
        assert "automatic_checkpoint_naming on" in result["named"] and not result["elsewhere"]
        assert "checkpoint_2 already exists" in result["exists"] and result["unchanged"]
        assert any("holds no state of prepared data loader #0" in m for m in result["old"]), result["old"]
        assert "found no checkpoint_<N> folder" in result["nothing_saved"]
        assert "registered for checkpointing #0 (Unsaveable)" in result["unsaveable"]  # and no checkpoint_3
