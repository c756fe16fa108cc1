"""Sharded engine checkpoints: every rank writes and reads only its own shard, as safetensors + JSON.

    DIR/manifest.json          world size, stage, step, the loss scaler, the flat layouts (names,
                               shapes, units), the optimizer's class and param-group hyperparameters
    DIR/rank-00000.safetensors this rank's fp32 master shard and optimizer state, per param group

No pickles. Loading checks that the checkpoint was written by the same world size, stage and
layout, and names what differs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:
    from .engine import ZeroEngine

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank:05d}.safetensors"


def layout_summary(engine: ZeroEngine) -> list[dict[str, Any]]:
    return [
        {
            "names": [slot.name for slot in group.layout.slots],
            "shapes": [list(slot.shape) for slot in group.layout.slots],
            "units": [list(unit.slots) for unit in group.layout.units],
            "shard_numel": group.layout.shard_numel,
        }
        for group in engine.groups
    ]


def save_engine(engine: ZeroEngine, directory: str | Path) -> None:
    """Every rank writes its shard into `directory`; rank 0 writes the manifest. Collective."""
    directory = Path(directory)
    rank = engine.collectives.rank
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    _barrier(engine)
    tensors: dict[str, torch.Tensor] = {}
    optimizer = engine.optimizer.optimizer
    for index, group in enumerate(engine.groups):
        tensors[f"group{index}.master"] = group.master
        for key, value in optimizer.state.get(group.master, {}).items():
            if isinstance(value, torch.Tensor):
                tensors[f"group{index}.state.{key}"] = value.reshape(-1) if value.dim() == 0 else value
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, rank_file(directory, rank))
    if rank == 0:
        manifest = {
            "format_version": FORMAT_VERSION,
            "world_size": engine.world_size,
            "stage": engine.config.stage,
            "mixed_precision": engine.config.mixed_precision,
            "global_steps": engine.global_steps,
            "loss_scaler": engine.loss_scaler.state_dict(),
            "optimizer": type(optimizer).__name__,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            "layouts": layout_summary(engine),
        }
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
    _barrier(engine)


def load_engine(engine: ZeroEngine, directory: str | Path) -> dict[str, Any]:
    """Restore this rank's shard (master weights, optimizer state), the step and the loss scale."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{directory} is not an engine checkpoint: {MANIFEST} is missing")
    manifest = json.loads(manifest_path.read_text())
    expected = {
        "world_size": engine.world_size,
        "stage": engine.config.stage,
        "layouts": layout_summary(engine),
    }
    for key, value in expected.items():
        if manifest.get(key) != value:
            what = "the parameter layout" if key == "layouts" else f"{key} {manifest.get(key)!r}"
            raise ValueError(
                f"{directory} was saved with {what}, which differs from this run's"
                + ("" if key == "layouts" else f" ({value!r})")
            )
    path = rank_file(directory, engine.collectives.rank)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the checkpoint")
    tensors = load_file(path)
    optimizer = engine.optimizer.optimizer
    for index, group in enumerate(engine.groups):
        group.master.copy_(tensors[f"group{index}.master"])
        prefix = f"group{index}.state."
        state = {
            key[len(prefix) :]: value.to(group.master.device)
            for key, value in tensors.items()
            if key.startswith(prefix)
        }
        for key, value in state.items():
            reference = optimizer.state.get(group.master, {}).get(key)
            if (reference is not None and reference.dim() == 0) or (key == "step" and value.numel() == 1):
                state[key] = value.reshape(())
        if state:
            optimizer.state[group.master] = state
        for saved, live in zip(manifest["param_groups"], optimizer.param_groups, strict=True):
            for key, value in saved.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key in live:
                    live[key] = value
        group.write_back()
    engine.loss_scaler.load_state_dict(manifest["loss_scaler"])
    engine.global_steps = int(manifest["global_steps"])
    return manifest


def _barrier(engine: ZeroEngine) -> None:
    if engine.collectives.active:
        dist.barrier(group=engine.collectives.group)
