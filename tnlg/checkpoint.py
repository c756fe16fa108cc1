"""Run-level checkpoints: the engine's shards plus everything else a resumed run needs.

    ROOT/step-00000100/engine/          every rank's shard (tnlg.sharding.checkpoint)
    ROOT/step-00000100/rank-00000.json  this rank's data position and RNG states
    ROOT/step-00000100/scheduler.json   the learning-rate scheduler
    ROOT/step-00000100/config.json      the run config
    ROOT/latest                         the name of the newest complete checkpoint

A checkpoint is written into a hidden staging directory and renamed into place once every rank
has finished, then `latest` is replaced atomically: a crash mid-save leaves the previous
checkpoint complete and selected. Only the newest `keep_last` are kept. JSON and safetensors only.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from tnlg.sharding.checkpoint import CheckpointError

logger = logging.getLogger(__name__)
LATEST = "latest"
ENGINE_LAYOUTS = ("", "engine", "zero")  # engine dir itself; run checkpoints and save_state; ZeroTrainer


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `root/latest` names, or None when there is no pointer yet."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    return root / json.loads(pointer.read_text())["checkpoint"]


def find_engine_checkpoint(path: str | Path) -> Path:
    """The engine checkpoint in what a user points at: an engine directory, a run checkpoint
    (`step-N/engine`), a run's checkpoint root (its `latest`), a `ZeroAccelerator.save_state`
    directory (`engine/`) or a `ZeroTrainer` checkpoint (`zero/`)."""
    path = latest_checkpoint(Path(path)) or Path(path)
    for layout in ENGINE_LAYOUTS:
        candidate = path / layout if layout else path
        if (candidate / "manifest.json").is_file():
            return candidate
    raise FileNotFoundError(
        f"{path} holds no engine checkpoint (a manifest.json here or in engine/ or zero/, or a {LATEST} pointer)"
    )


class RunCheckpointer:
    def __init__(self, root: str | Path, keep_last: int, accelerator):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root, self.keep_last, self.accelerator = Path(root), keep_last, accelerator

    def save(self, step: int, engine, scheduler, data_state: dict, config: dict) -> Path:
        """Collective: every rank writes its part; returns the checkpoint directory."""
        accelerator, rank = self.accelerator, self.accelerator.process_index
        name = f"step-{step:08d}"
        staging, final = self.root / f".{name}.staging", self.root / name
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        accelerator.wait_for_everyone()
        engine.save_checkpoint(staging / "engine")
        write_json(staging / f"rank-{rank:05d}.json", {"step": step, "data": data_state, "rng": rng_state()})
        if accelerator.is_main_process:
            write_json(staging / "scheduler.json", scheduler.state_dict())
            write_json(staging / "config.json", config)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(final, ignore_errors=True)
            staging.rename(final)
            write_json_atomic(self.root / LATEST, {"checkpoint": name})
            self._prune()
        accelerator.wait_for_everyone()
        return final

    def resolve(self, which: str) -> Path | None:
        """`latest` (None when there is no checkpoint yet) or a checkpoint directory."""
        if which == LATEST:
            return latest_checkpoint(self.root)
        path = Path(which)
        if not path.is_dir():
            raise FileNotFoundError(f"no checkpoint directory at {path}")
        return path

    def load(self, which: str, engine, scheduler, fallback: bool = False) -> dict[str, Any] | None:
        """Restore `which` (`latest` or a directory); with `fallback`, a damaged `latest` gives way to the
        newest older checkpoint that loads (each failure is logged with its reason)."""
        path = self.resolve(which)
        if path is None:
            return None
        candidates = [path]
        if fallback and which == LATEST:
            candidates += sorted(
                (p for p in self.root.glob("step-*") if p.is_dir() and p.name < path.name), reverse=True
            )
        for index, candidate in enumerate(candidates):
            try:
                return self._load(candidate, engine, scheduler)
            except CheckpointError as error:
                if index == len(candidates) - 1:
                    raise
                logger.warning("checkpoint %s cannot be loaded (%s); falling back to %s", candidate, error,
                               candidates[index + 1])  # fmt: skip
        return None

    def _load(self, path: Path, engine, scheduler) -> dict[str, Any]:
        """The engine reshapes itself to this world size (see tnlg.sharding.checkpoint). At the saved
        world size every rank takes back its own data position and RNG; at another, every rank gets
        rank 0's data position (a world-independent one, such as the pre-tokenized stream's, maps
        onto the new ranks; a per-rank one refuses) and fresh RNG seeded by step and rank."""
        engine.load_checkpoint(path / "engine")
        scheduler.load_state_dict(json.loads((path / "scheduler.json").read_text()))
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        saved_world = len(list(path.glob("rank-*.json")))
        if saved_world == world:
            state = json.loads((path / f"rank-{rank:05d}.json").read_text())
            restore_rng(state["rng"])
        else:
            state = json.loads((path / "rank-00000.json").read_text())
            reseed_rng(state["step"], rank)
            if rank == 0:
                logger.warning(
                    "%s was saved by %d processes and resumes on %d: the model and optimizer are resharded, "
                    "the data continues from the global position, and the RNG is seeded anew",
                    path, saved_world, world,
                )  # fmt: skip
        return {"step": state["step"], "data": state["data"], "path": path, "saved_world_size": saved_world}

    def _prune(self) -> None:
        checkpoints = sorted(p for p in self.root.glob("step-*") if p.is_dir())
        for old in checkpoints[: -self.keep_last]:
            shutil.rmtree(old)


def rng_state() -> dict[str, Any]:
    state = {"python": _jsonable(random.getstate()), "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


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


def write_json(path: Path, value: Any) -> None:
    with open(path, "w") as handle:
        json.dump(value, handle)
        handle.flush()
        os.fsync(handle.fileno())


def write_json_atomic(path: Path, value: Any) -> None:
    staging = path.with_name(path.name + ".tmp")
    write_json(staging, value)
    os.replace(staging, path)
