"""The learning-rate schedule's position in an engine checkpoint: `SCHEDULER_FILE`, which rank 0 writes
beside the rank files when the engine built the DeepSpeed JSON's scheduler (checkpoint.py holds the rest of
the layout). The position is the scheduler's own `state_dict()`, small JSON, read back before anything is
restored so that a checkpoint without it is refused whole."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch.optim.lr_scheduler import LRScheduler

from .checkpoint_files import CheckpointError
from .json_files import read_json, write_json_atomic

logger = logging.getLogger(__name__)

SCHEDULER_FILE = "lr_scheduler.json"  # in an engine checkpoint whose engine built the JSON's scheduler


def save_scheduler_state(scheduler: LRScheduler, directory: Path) -> None:
    """Rank 0 writes the schedule's position before the checkpoint's manifest (which appears last); a state
    JSON cannot hold is a CheckpointError naming the scheduler, as a run checkpoint's scheduler file is."""
    directory.mkdir(parents=True, exist_ok=True)
    try:
        write_json_atomic(directory / SCHEDULER_FILE, scheduler.state_dict())
    except (TypeError, ValueError) as error:  # raised by json before any file is written
        raise CheckpointError(
            f"the state of the {type(scheduler).__name__} learning-rate scheduler cannot be saved: {error}"
        ) from error


def read_scheduler_state(scheduler: LRScheduler | None, directory: Path) -> dict[str, Any] | None:
    """The saved schedule for `scheduler`, read before anything is restored; a missing one is an error
    (the schedule would restart at step 0), a saved one with no scheduler to take it a warning."""
    path = directory / SCHEDULER_FILE
    if scheduler is None:
        if path.is_file():
            logger.warning("%s: this engine has no DeepSpeed JSON scheduler to restore it into", path)
        return None
    if not path.is_file():
        raise CheckpointError(
            f"{directory} has no {SCHEDULER_FILE}: it was saved by an engine without the DeepSpeed JSON's "
            f"scheduler, and this engine's {type(scheduler).__name__} would restart at step 0"
        )
    return read_json(path, CheckpointError, "the DeepSpeed JSON scheduler's state")
