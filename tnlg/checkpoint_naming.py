"""Accelerate's automatic checkpoint naming, for `ZeroAccelerator.save_state` / `load_state`.

With `ProjectConfiguration(project_dir=P, automatic_checkpoint_naming=True, total_limit=K)`,
`save_state()` writes P/checkpoints/checkpoint_<iteration> (`project_configuration.iteration`,
advanced by every save_state), refuses a folder of that name that already exists, and keeps the
newest K; `load_state()` loads the newest. ZeroAccelerator does the same, except where Accelerate
loses or ignores something:

- the old checkpoints beyond K are removed once the new one is whole (Accelerate removes them first,
  so a save that fails leaves one checkpoint fewer than before, and none at K = 1);
- only folders named checkpoint_<N> are counted and removed (Accelerate counts every entry of
  P/checkpoints and removes by the last number in its name: a notes file there is removed, one
  without a number fails the save);
- an `output_dir` given beside automatic naming is refused (Accelerate ignores it and saves by the
  naming rule, so the directory the caller named is never written);
- `load_state()` sets the iteration after the checkpoint it loaded, so that the next `save_state()`
  continues the numbering (Accelerate leaves the iteration where it was: after a relaunch at 0, whose
  folder exists, so the next save is refused until the caller sets it by hand); `load_state(dir)` of a
  directory named by the caller leaves the iteration as it is, as Accelerate does;
- a save that fails removes the checkpoint_<N> folder it made (Accelerate leaves it, and the next save
  is refused as existing).

As in Accelerate, "newest" is the highest N, not the latest written: an iteration set below the
existing numbers writes a checkpoint that total_limit may keep while load_state() loads a higher one.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

from tnlg.sharding.checkpoint import CheckpointError

logger = logging.getLogger(__name__)

_NUMBERED = re.compile(r"checkpoint_(\d+)")


def checkpoints_root(project_dir: str | Path | None) -> Path:
    """P/checkpoints, where automatic naming keeps the checkpoints."""
    if project_dir is None:
        raise ValueError(
            "automatic_checkpoint_naming needs a project_dir: give ProjectConfiguration(project_dir=...) "
            "(or Accelerator(project_dir=...)), or pass save_state / load_state a directory with naming off"
        )
    return Path(project_dir) / "checkpoints"


def numbered_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """The checkpoint_<N> folders in `root`, oldest (lowest N) first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _NUMBERED.fullmatch(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def next_checkpoint(root: Path, iteration: int) -> Path:
    """Where save_state writes at `iteration`; refused when it exists (nothing of it is replaced)."""
    path = root / f"checkpoint_{iteration}"
    if path.exists():
        raise CheckpointError(
            f"{path} already exists (automatic checkpoint naming at iteration {iteration}): set "
            "accelerator.project_configuration.iteration past the newest checkpoint, or load_state() it first"
        )
    return path


def newest_checkpoint(root: Path) -> tuple[int, Path]:
    """The highest-numbered checkpoint_<N> in `root` and its N."""
    found = numbered_checkpoints(root)
    if not found:
        raise CheckpointError(
            f"load_state() with automatic checkpoint naming found no checkpoint_<N> folder in {root}: "
            "nothing has been saved there yet, or give load_state the directory to load"
        )
    return found[-1]


def remove_beyond_limit(root: Path, total_limit: int | None, written: Path) -> None:
    """The oldest checkpoint_<N> folders removed until `total_limit` remain, never `written` (the one
    just saved). A folder that cannot be removed is said and left: the save itself succeeded."""
    if total_limit is None:
        return
    older = [path for _, path in numbered_checkpoints(root) if path != written]
    surplus = len(older) + 1 - max(total_limit, 1)
    for path in older[: max(surplus, 0)]:
        logger.info("removing %s: total_limit %d checkpoints are kept", path, total_limit)
        try:
            shutil.rmtree(path)
        except OSError as error:
            logger.warning("could not remove %s beyond total_limit %d: %s", path, total_limit, error)
