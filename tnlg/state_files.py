"""The state files next to an engine checkpoint, one format for every writer.

A run checkpoint (`tnlg.run.checkpoint.RunCheckpointer`), `ZeroAccelerator.save_state` and a
`ZeroTrainer` checkpoint each hold the engine's shards in `engine/` (`ENGINE_DIRECTORY`, see
tnlg.sharding.checkpoint) and, beside it, what the engine does not save:

    DIR/rank-0000r.json   rank r's RNG states ({"rng": ...}; a run adds its step and data position)
    DIR/scheduler.json    the first learning-rate scheduler's state_dict; the others, if any, in
                          scheduler-1.json, scheduler-2.json, ... (Accelerate's save_state numbers
                          its schedulers the same way)
    DIR/custom-i.json     (save_state) the i-th object registered with `register_for_checkpointing`:
                          its state_dict as JSON, each tensor in it replaced by {"__tensor__": key}
                          naming its entry in DIR/custom-i.safetensors (absent when it holds none),
                          tuples and non-string keys marked (tnlg.state_encoding)
    DIR/dataloader-i-rank-0000r.json   (save_state) rank r's state_dict of the i-th prepared data loader,
                          when it is stateful (Accelerate's `use_stateful_dataloader`), encoded alike
                          (and its .safetensors)

(ZeroTrainer writes only the scheduler: the Trainer saves its own RNG states.) JSON and safetensors,
no pickles. The files are encoded in memory first (`scheduler_state_files`, `custom_state_files`,
`dataloader_state_files`; a state_dict they cannot hold is a `CheckpointError` before anything is written)
and written through staging names (`write_state_files`), so no file is left half-written under its
own name. Every read error is a `CheckpointError` naming the file.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from tnlg.sharding.checkpoint import CheckpointError
from tnlg.sharding.json_files import read_json, write_json_atomic
from tnlg.state_encoding import decoded_state, encoded_state

logger = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...


def read_checkpoint_json(path: Path) -> Any:
    """A JSON file of a checkpoint; missing or damaged is a `CheckpointError` naming it."""
    return read_json(path, CheckpointError, "a file of the checkpoint")


# ---------------------------------------------------------------------------------------------- per rank
def rank_state_file(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank:05d}.json"


def write_rank_state(directory: Path, rank: int, **extra: Any) -> None:
    """This process's RNG states (and the caller's `extra` fields) in `rank_state_file`, through a staging
    name: a failed write leaves no half file under its name."""
    write_json_atomic(rank_state_file(directory, rank), {**extra, "rng": rng_state()})


def read_rank_state(directory: Path, rank: int) -> dict[str, Any]:
    """What `write_rank_state` wrote for `rank`; restore its RNG with `restore_rng(state["rng"])`."""
    path = rank_state_file(directory, rank)
    legacy = directory / f"rng-rank-{rank:05d}.json"  # save_state before the one layout: the RNG alone
    if not path.exists() and legacy.is_file():
        return {"rng": read_checkpoint_json(legacy)}
    state = read_checkpoint_json(path)
    if not isinstance(state, dict) or not isinstance(state.get("rng"), dict):
        raise CheckpointError(f'{path} holds no RNG states (expected a JSON object with an "rng" object)')
    missing = [name for name in ("python", "torch") if name not in state["rng"]]
    if missing:  # found here, while the ranks agree, rather than by one rank alone when it restores them
        raise CheckpointError(f'{path} lacks the {" and ".join(missing)} RNG state (its "rng" object)')
    return state


def rng_state() -> dict[str, Any]:
    """This process's generators: Python's, numpy's global one (Accelerate saves it too: data pipelines
    draw from it), torch's CPU one and, with CUDA, its current device's only (`"cuda"`, one state: a
    rank uses one device, and every rank writing every visible device's state would make its file grow
    with the GPUs per node and restore other ranks' devices)."""
    state = {
        "python": _jsonable(random.getstate()),
        "numpy": _jsonable(np.random.get_state(legacy=True)),
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """What `rng_state` returned, restored; the CUDA state goes to the current device. A file from
    before (`"cuda"` a list of every visible device's state) gives the current device's entry, if
    it has one."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    _restore_numpy(state.get("numpy"))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        cuda = _current_device_state(state["cuda"])
        if cuda is not None:
            torch.cuda.set_rng_state(torch.tensor(cuda, dtype=torch.uint8))


def _restore_numpy(saved: list | None) -> None:
    """numpy's global generator from what `rng_state` wrote; a file written before it saved numpy's
    state has none, and that is said rather than passed over."""
    if saved is None:
        logger.warning(
            "the saved RNG states hold no numpy state (written before tnlg saved it): numpy's global "
            "generator is left as it is, so numpy draws differ from an uninterrupted run"
        )
        return
    name, keys, position, has_gauss, cached = saved
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))


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
    np.random.seed(seed)
    torch.manual_seed(seed)


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


# ---------------------------------------------------------------------------------------------- writing
def write_state_files(directory: Path, files: Mapping[str, bytes]) -> None:
    """Each of `files` ({name: contents}) on disk in `directory` before this returns, through a staging
    name renamed over it: a failure midway leaves no file that looks whole."""
    for name, contents in files.items():
        path = directory / name
        staging = path.with_name(path.name + ".tmp")
        with open(staging, "wb") as handle:
            handle.write(contents)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, path)


def _json_bytes(value: Any, what: str) -> bytes:
    """`value` as the JSON `write_json` writes; a value JSON cannot hold is a `CheckpointError` naming `what`."""
    try:
        return json.dumps(value).encode("utf-8")
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{what} cannot be saved: {error}") from error


# ---------------------------------------------------------------------------------------------- schedulers
def scheduler_file(directory: Path, index: int = 0) -> Path:
    return directory / _scheduler_name(index)


def _scheduler_name(index: int) -> str:
    return "scheduler.json" if index == 0 else f"scheduler-{index}.json"


def scheduler_state_files(schedulers: Sequence[Stateful]) -> dict[str, bytes]:
    """Each scheduler's state_dict, encoded for its `scheduler_file` (see `write_state_files`)."""
    return {
        _scheduler_name(index): _json_bytes(
            scheduler.state_dict(), f"the state_dict of scheduler {index} ({type(scheduler).__name__})"
        )
        for index, scheduler in enumerate(schedulers)
    }


def write_scheduler_states(directory: Path, schedulers: Sequence[Stateful]) -> None:
    """Each scheduler's state_dict in its `scheduler_file` (the main process writes them)."""
    write_state_files(directory, scheduler_state_files(schedulers))


def read_scheduler_states(directory: Path, count: int) -> list[dict[str, Any]]:
    """The state_dicts of the first `count` schedulers `write_scheduler_states` wrote."""
    return [read_checkpoint_json(_existing_scheduler_file(directory, index)) for index in range(count)]


def _existing_scheduler_file(directory: Path, index: int) -> Path:
    """`scheduler_file`, or the first scheduler's name before the one layout (`scheduler-0.json`, which
    save_state wrote), so that such a directory still loads."""
    path = scheduler_file(directory, index)
    legacy = directory / "scheduler-0.json"
    return legacy if index == 0 and not path.exists() and legacy.is_file() else path


# ---------------------------------------------------------------------------------------------- custom objects
def custom_files(index: int) -> tuple[str, str]:
    """The JSON and safetensors file names of the `index`-th registered object."""
    return f"custom-{index}.json", f"custom-{index}.safetensors"


def custom_state_files(objects: Sequence[Stateful]) -> dict[str, bytes]:
    """The state_dict of each object registered with `register_for_checkpointing`, encoded by
    tnlg.state_encoding: its tensors (an EMA module's weights, say) in safetensors, the rest in JSON,
    tuples and integer keys kept (a registered optimizer's state is keyed by parameter index). A value
    neither holds is a `CheckpointError` naming the object, raised before anything is written."""
    files: dict[str, bytes] = {}
    for index, obj in enumerate(objects):
        what = f"the state_dict of the object registered for checkpointing #{index} ({type(obj).__name__})"
        files.update(_encoded_files(custom_files(index), obj.state_dict(), what))
    return files


def read_custom_states(directory: Path, count: int) -> list[Any]:
    """The state_dicts `custom_state_files` encoded for the first `count` objects (a directory written
    before tensors were kept apart holds the JSON alone, and reads the same)."""
    return [_decoded_files(directory, custom_files(index)) for index in range(count)]


# ---------------------------------------------------------------------------------------------- data loaders
def dataloader_files(index: int, rank: int) -> tuple[str, str]:
    """The JSON and safetensors file names of rank `rank`'s state of the `index`-th prepared data loader."""
    stem = f"dataloader-{index}-rank-{rank:05d}"
    return f"{stem}.json", f"{stem}.safetensors"


def dataloader_state_files(loaders: Mapping[int, Stateful], rank: int) -> dict[str, bytes]:
    """This rank's state_dict of each stateful data loader ({its index among the prepared loaders:
    loader}), encoded as the registered objects' are. Per rank: a loader over an iterable dataset
    holds each rank's own position (Accelerate writes one file that every rank overwrites)."""
    files: dict[str, bytes] = {}
    for index, loader in loaders.items():
        what = f"the state_dict of prepared data loader #{index} on rank {rank}"
        files.update(_encoded_files(dataloader_files(index, rank), loader.state_dict(), what))
    return files


def read_dataloader_states(directory: Path, indices: Sequence[int], rank: int) -> dict[int, Any]:
    """What `dataloader_state_files` wrote for the loaders at `indices`; a loader with no file (saved
    before it was stateful, or before tnlg saved loaders) is left out of the answer."""
    return {
        index: _decoded_files(directory, dataloader_files(index, rank))
        for index in indices
        if (directory / dataloader_files(index, rank)[0]).exists()
    }


def stateful_dataloaders(prepared: Sequence[Any]) -> dict[int, Any]:
    """{index among the `prepared` loaders: loader} of those Accelerate made stateful (torchdata's
    StatefulDataLoader underneath, `use_stateful_dataloader`), whose positions save_state keeps."""
    return {
        index: loader
        for index, loader in enumerate(prepared)
        if getattr(loader, "use_stateful_dataloader", False)
    }


def restore_dataloaders(loaders: Mapping[int, Any], states: Mapping[int, Any], directory: Path) -> None:
    """Each of `loaders` back at its position in `states` (`read_dataloader_states`); one without a
    saved state is said to start from its beginning, not passed over."""
    for index, loader in loaders.items():
        if index in states:
            loader.load_state_dict(states[index])
        else:
            logger.warning(
                "%s holds no state of prepared data loader #%d (saved before it was stateful, or by an "
                "older tnlg): the loader starts from its beginning",
                directory,
                index,
            )


def _encoded_files(names: tuple[str, str], state: Any, what: str) -> dict[str, bytes]:
    json_name, tensor_name = names
    text, tensors = encoded_state(state, what)
    return {json_name: text} if tensors is None else {json_name: text, tensor_name: tensors}


def _decoded_files(directory: Path, names: tuple[str, str]) -> Any:
    json_name, tensor_name = names
    return decoded_state(directory / json_name, directory / tensor_name)
