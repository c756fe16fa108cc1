"""A run's output directory: what a run writes there, and the refusal to mix two runs in one."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

# What a run writes into train.output_dir (trackers write logs/): a directory holding any of these
# holds a run that a new one would overwrite.
RUN_FILES = (
    "checkpoints",
    "model",
    "model-gpt2",
    "logs",
    "loss_curve.json",
    "loss_curve.png",
    "run_config.json",
    "evaluation.json",
)


def check_output_directory(output: Path, resume: str | None, overwrite: bool) -> list[str]:
    """The previous run's files in `output` that this run replaces (train.overwrite), or [] when there is
    none or the run resumes it; a new run into a used directory without train.overwrite is refused."""
    if resume is not None:
        return []
    found = sorted(name for name in RUN_FILES if (output / name).exists())
    if found and not overwrite:
        raise FileExistsError(
            f"train.output_dir {output} already holds a run ({', '.join(found)}): continue it with "
            f"--resume latest, pass --train.overwrite true to replace it, or choose another "
            f"--train.output_dir"
        )
    return found


def remove_run_files(output: Path, names: list[str]) -> None:
    logger.warning("train.overwrite: removing the previous run's %s from %s", ", ".join(names), output)
    for name in names:
        path = output / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
