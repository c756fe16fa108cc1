"""The state files next to an engine checkpoint, one format for every writer.

A run checkpoint (`tnlg.run.checkpoint.RunCheckpointer`), `ZeroAccelerator.save_state` and a
`ZeroTrainer` checkpoint each hold the engine's shards in `engine/` (`ENGINE_DIRECTORY`, see
tnlg.sharding.checkpoint) and, beside it, what the engine does not save:

    DIR/rank-0000r.json   rank r's RNG states ({"rng": ...}; a run adds its step and data position)
    DIR/scheduler.json    the first learning-rate scheduler's state_dict; the others, if any, in
                          scheduler-1.json, scheduler-2.json, ... (Accelerate's save_state numbers
                          its schedulers the same way)

(ZeroTrainer writes only the scheduler: the Trainer saves its own RNG states.) JSON only, no pickles;
every read error is a `CheckpointError` naming the file.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from tnlg.sharding.checkpoint import CheckpointError
from tnlg.sharding.json_files import read_json, write_json


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...


def read_checkpoint_json(path: Path) -> Any:
    """A JSON file of a checkpoint; missing or damaged is a `CheckpointError` naming it."""
    return read_json(path, CheckpointError, "a file of the checkpoint")


# ---------------------------------------------------------------------------------------------- per rank
def rank_state_file(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank:05d}.json"


def write_rank_state(directory: Path, rank: int, **extra: Any) -> None:
    """This process's RNG states (and the caller's `extra` fields) in `rank_state_file`."""
    write_json(rank_state_file(directory, rank), {**extra, "rng": rng_state()})


def read_rank_state(directory: Path, rank: int) -> dict[str, Any]:
    """What `write_rank_state` wrote for `rank`; restore its RNG with `restore_rng(state["rng"])`."""
    path = rank_state_file(directory, rank)
    legacy = directory / f"rng-rank-{rank:05d}.json"  # save_state before the one layout: the RNG alone
    if not path.exists() and legacy.is_file():
        return {"rng": read_checkpoint_json(legacy)}
    state = read_checkpoint_json(path)
    if not isinstance(state, dict) or not isinstance(state.get("rng"), dict):
        raise CheckpointError(f'{path} holds no RNG states (expected a JSON object with an "rng" object)')
    return state


def rng_state() -> dict[str, Any]:
    """This process's generators: Python's, torch's CPU one and, with CUDA, its current device's only
    (`"cuda"`, one state: a rank uses one device, and every rank writing every visible device's
    state would make its file grow with the GPUs per node and restore other ranks' devices)."""
    state = {"python": _jsonable(random.getstate()), "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """What `rng_state` returned, restored; the CUDA state goes to the current device. A file from
    before (`"cuda"` a list of every visible device's state) gives the current device's entry, if
    it has one."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        cuda = _current_device_state(state["cuda"])
        if cuda is not None:
            torch.cuda.set_rng_state(torch.tensor(cuda, dtype=torch.uint8))


def _current_device_state(saved: list) -> list[int] | None:
    """The current device's CUDA generator state out of what `rng_state` wrote (one state, a list of
    byte values) or what it wrote before (one such list per visible device)."""
    if not saved or not isinstance(saved[0], list):
        return saved or None
    device = torch.cuda.current_device()
    return saved[device] if device < len(saved) else None


def reseed_rng(step: int, rank: int) -> None:
    """RNG for a rank with no saved state of its own (a resume at another world size): distinct per
    rank, and the same on every relaunch."""
    seed = (step * 1_000_003 + rank) % 2**32
    random.seed(seed)
    torch.manual_seed(seed)


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------- schedulers
def scheduler_file(directory: Path, index: int = 0) -> Path:
    return directory / ("scheduler.json" if index == 0 else f"scheduler-{index}.json")


def write_scheduler_states(directory: Path, schedulers: Sequence[Stateful]) -> None:
    """Each scheduler's state_dict in its `scheduler_file` (the main process writes them)."""
    for index, scheduler in enumerate(schedulers):
        write_json(scheduler_file(directory, index), scheduler.state_dict())


def read_scheduler_states(directory: Path, count: int) -> list[dict[str, Any]]:
    """The state_dicts of the first `count` schedulers `write_scheduler_states` wrote."""
    return [read_checkpoint_json(_existing_scheduler_file(directory, index)) for index in range(count)]


def _existing_scheduler_file(directory: Path, index: int) -> Path:
    """`scheduler_file`, or the first scheduler's name before the one layout (`scheduler-0.json`, which
    save_state wrote), so that such a directory still loads."""
    path = scheduler_file(directory, index)
    legacy = directory / "scheduler-0.json"
    return legacy if index == 0 and not path.exists() and legacy.is_file() else path
