"""Run-level checkpoints: the engine's shards plus everything else a resumed run needs.

    ROOT/step-00000100/engine/          every rank's shard (tnlg.sharding.checkpoint)
    ROOT/step-00000100/rank-00000.json  this rank's data position and RNG states
    ROOT/step-00000100/scheduler.json   the learning-rate scheduler
    ROOT/step-00000100/config.json      the run config
    ROOT/step-00000100/loss_curve.json  the loss curve up to this step (a resumed run continues it)
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

from tnlg.run.metrics import LossCurve
from tnlg.sharding.checkpoint import CheckpointError, read_manifest, read_on_every_rank

logger = logging.getLogger(__name__)
LATEST = "latest"
CURVE_FILE = "loss_curve.json"  # the run's curve up to the checkpoint's step
ENGINE_LAYOUTS = ("", "engine", "zero")  # engine dir itself; run checkpoints and save_state; ZeroTrainer


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `root/latest` names, or None when there is no pointer yet."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    pointed = read_json(pointer)
    name = pointed.get("checkpoint") if isinstance(pointed, dict) else None
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise CheckpointError(f'{pointer} does not name a checkpoint (expected {{"checkpoint": "step-N"}})')
    return root / name


def read_json(path: Path) -> Any:
    """A checkpoint's JSON file; a missing, truncated or non-JSON file is a CheckpointError naming it."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON (truncated or damaged?): {error}") from None


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

    def save(self, step: int, engine, scheduler, data_state: dict, config: dict, curve: LossCurve) -> Path:
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
            write_json(staging / CURVE_FILE, curve.state_dict())  # a resumed run's curve starts with it
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(final, ignore_errors=True)
            staging.rename(final)
            write_json_atomic(self.root / LATEST, {"checkpoint": name})
            self._prune()
        accelerator.wait_for_everyone()
        return final

    def resolve(self, which: str) -> Path:
        """`latest` or a checkpoint directory; there being none is an error naming where it looked."""
        if which == LATEST:
            path = latest_checkpoint(self.root)
            if path is None:
                raise CheckpointError(
                    f"--resume latest: {self.root} holds no checkpoint ({self.root / LATEST} does not exist); "
                    "start a new run without --resume"
                )
            return path
        path = Path(which)
        if not path.is_dir():
            raise CheckpointError(f"--resume {which}: no checkpoint directory at {path}")
        return path

    def load(self, which: str, engine, scheduler, fallback: bool = False) -> dict[str, Any]:
        """Restore `which` (`latest` or a directory); with `fallback`, a damaged `latest` gives way to the
        newest older checkpoint that loads (each failure is logged with its reason)."""
        path = self.resolve(which)
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
        raise AssertionError("unreachable: the last candidate's failure is raised")

    def _load(self, path: Path, engine, scheduler) -> dict[str, Any]:
        """The engine reshapes itself to this world size (see tnlg.sharding.checkpoint). At the saved
        world size every rank takes back its own data position and RNG; at another, every rank gets
        rank 0's data position (a world-independent one, such as the pre-tokenized stream's, maps
        onto the new ranks; a per-rank one refuses) and fresh RNG seeded by step and rank."""
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        saved_world = self._saved_world_size(path)
        own_state = f"rank-{rank:05d}.json" if saved_world == world else "rank-00000.json"

        def read_run_state() -> tuple[dict, dict, LossCurve]:
            curve_file = path / CURVE_FILE
            if curve_file.exists():
                curve = LossCurve.from_state_dict(read_json(curve_file))
            else:  # saved before checkpoints carried the curve
                logger.warning("%s has no %s: the loss curve starts at the resumed step", path, CURVE_FILE)
                curve = LossCurve()
            return read_json(path / "scheduler.json"), read_json(path / own_state), curve

        # Everything is read (and every rank agrees it could be) before anything is restored: a damaged
        # file leaves the engine, the scheduler and the RNG untouched, and no rank waiting for another.
        scheduler_state, state, curve = read_on_every_rank(engine, read_run_state)
        engine.load_checkpoint(path / "engine")
        scheduler.load_state_dict(scheduler_state)
        if saved_world == world:
            restore_rng(state["rng"])
        else:
            reseed_rng(state["step"], rank)
            if rank == 0:
                logger.warning(
                    "%s was saved by %d processes and resumes on %d: the model and optimizer are resharded, "
                    "the data continues from the global position, and the RNG is seeded anew",
                    path, saved_world, world,
                )  # fmt: skip
        return {
            "step": state["step"],
            "data": state["data"],
            "path": path,
            "saved_world_size": saved_world,
            "curve": curve,
        }

    @staticmethod
    def _saved_world_size(path: Path) -> int:
        """How many processes saved `path` (the engine manifest's world size); every one of them must have
        left its rank file, or a missing one would read as a smaller world (resuming every rank from rank
        0's data position) or fail later with a message about the wrong file."""
        world = read_manifest(path / "engine")["world_size"]
        missing = [f"rank-{r:05d}.json" for r in range(world) if not (path / f"rank-{r:05d}.json").is_file()]
        if missing:
            raise CheckpointError(
                f"{path / missing[0]} is missing: the checkpoint was saved by {world} processes and lacks "
                f"{', '.join(missing)}; it is incomplete"
            )
        return world

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
