"""A run's output directory: what a run writes there, and the refusal to mix two runs in one."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
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


def check_output_directory(
    output: Path, resumed: Path | None, overwrite: bool, inputs: Mapping[str, str | Path | None]
) -> list[str]:
    """The previous run's files in `output` that this run replaces (train.overwrite), or [] when there is
    none or the run continues it (`resumed`, the checkpoint it resumes, is one of `output`'s checkpoints).

    Refused before anything is built: an `output` that is not a directory; a new run into a used
    directory without train.overwrite, a resume of another directory's checkpoint included (it would
    replace this directory's checkpoints and model with another run's); train.overwrite with a resume of
    this run (which of the two was meant?); and with train.overwrite, one of the run's `inputs`
    ({setting: path}) inside a file it would remove."""
    if output.exists() and not output.is_dir():
        raise NotADirectoryError(f"train.output_dir {output} is a file, not a directory: choose another")
    # a checkpoint of this run's own (the step directory itself may be a link to other storage)
    if resumed is not None and _inside(resumed.parent, output / "checkpoints"):
        if overwrite:
            raise ValueError(
                f"--resume {resumed} continues the run in train.output_dir {output}, which train.overwrite "
                "true would replace: drop one of them"
            )
        return []
    found = sorted(name for name in RUN_FILES if (output / name).exists())
    if found and not overwrite:
        other = (
            f" (--resume names a checkpoint of another directory, {resumed})" if resumed is not None else ""
        )
        raise FileExistsError(
            f"train.output_dir {output} already holds a run ({', '.join(found)}){other}: continue it with "
            f"--resume latest, pass --train.overwrite true to replace it, or choose another "
            f"--train.output_dir"
        )
    for setting, path in inputs.items():
        removed = next(
            (name for name in found if path is not None and _inside(Path(path), output / name)), None
        )
        if removed is not None:
            raise ValueError(
                f"{setting} {path} lies in the previous run's {removed} in train.output_dir {output}, which "
                "train.overwrite would remove: copy it elsewhere first, or choose another --train.output_dir"
            )
    return found


def _inside(path: Path, directory: Path) -> bool:
    """Whether `path` is `directory` or lies in it, links resolved."""
    return path.resolve().is_relative_to(directory.resolve())


def remove_run_files(output: Path, names: list[str]) -> None:
    logger.warning("train.overwrite: removing the previous run's %s from %s", ", ".join(names), output)
    for name in names:
        path = output / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
