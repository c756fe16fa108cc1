"""A run checkpointer over one process with a stand-in engine: what its saves and resumes leave on disk
and read back, without training a model (the engine's own files are tested in tests/sharding)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tnlg.run.checkpoint import RunCheckpointer
from tnlg.run.metrics import LossCurve
from tnlg.sharding.checkpoint import CheckpointError


class OneProcess:
    """The accelerator's part a checkpoint save and load use, for one process."""

    process_index = 0
    num_processes = 1
    is_main_process = True


class StandInEngine:
    """Writes a stand-in engine checkpoint holding the step it was saved at, and reads it back."""

    def __init__(self) -> None:
        self.step = 0

    def save_checkpoint(self, directory: Path) -> None:
        directory.mkdir(parents=True)
        manifest = {"step": self.step, "world_size": 1, "layout": {"tensor": 1, "pipeline": 1, "data": 1}}
        (directory / "manifest.json").write_text(json.dumps(manifest))

    def load_checkpoint(self, directory: Path) -> None:
        self.step = json.loads((directory / "manifest.json").read_text())["step"]


def scheduler() -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)], lr=1.0), lambda _: 1.0)


def save_steps(root: Path, keep_last: int, *steps: int) -> None:
    checkpointer, engine, schedule = (
        RunCheckpointer(root, keep_last, OneProcess()),
        StandInEngine(),
        scheduler(),
    )
    for step in steps:
        engine.step = step
        checkpointer.save(step, engine, schedule, {"batches": step}, {}, LossCurve())


def crash_between_the_renames(root: Path, monkeypatch, step: int) -> None:
    """Save `step` again and stop after the previous version is set aside, before its successor moves in."""
    real_rename = Path.rename

    def rename(self: Path, target: Path) -> Path:
        if self.name.endswith(".staging"):  # the process dies before the new checkpoint is in place
            raise OSError("killed")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(CheckpointError, match="could not write: OSError: killed"):
        save_steps(root, 2, step)
    monkeypatch.undo()
