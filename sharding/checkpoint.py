"""Sharded engine checkpoints that load at any world size and any stage.

Every writer puts an engine checkpoint in a directory named `engine` (`ENGINE_DIRECTORY`) inside its
own checkpoint directory (a run's `step-N/`, `ZeroAccelerator.save_state`'s directory, a ZeroTrainer
`checkpoint-N/`), laid out as:

    DIR/manifest.json          written last by rank 0: world size, stage, step, the loss scaler, the
                               optimizer's param-group hyperparameters, each group's flat layout
                               (parameter names, shapes, units, offsets), the sha256 and size of every
                               rank file, the tnlg version
    DIR/rank-00000.safetensors rank r's fp32 master shard and optimizer state, per param group
    DIR/config.json            the model's Transformers config, when it has one (for consolidation)

No pickles. [Note: reshaping] Rank r of a checkpoint holds piece r of every unit of every group
(see [Note: flat layout] in partition.py), so the manifest says where each element of each
parameter lives: element i of a parameter at offset o of a unit with pieces of p elements is in
rank (o + i) // p's file, at that unit's shard offset + (o + i) % p. Loading computes, for each
parameter range this rank owns in *its* layout, the saved segments that cover it and reads just
those with safetensors slicing: a checkpoint written by N ranks at stage S loads into M ranks at
stage T directly, optimizer state included. Parameters are matched by name, so the param groups
and bucket sizes may differ too; missing, unexpected or re-shaped parameters are errors that name them.

The engine is reached through `EngineState` (engine_state.py): this module does not import the engine,
which imports it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from safetensors.torch import save_file

# One reader of safetensors files for every checkpoint kind (errors that name the file, one hashing
# routine); the package `tnlg.modeling` is always imported before this one, by `tnlg` itself.
from tnlg.modeling.loading import CheckpointFileError, open_safetensors, sha256_of

from .collectives import Collectives
from .engine_state import EngineState
from .json_files import read_json, write_json_atomic

T = TypeVar("T")
ENGINE_DIRECTORY = "engine"  # the engine checkpoint's name inside every checkpoint directory
# ZeroTrainer's name for it before the layouts were made one: refused with the rename, never ignored.
OLD_TRAINER_DIRECTORY = "zero"
MANIFEST = "manifest.json"
FORMAT_VERSION = 2
UNMANAGED_PREFIX = "module."  # rank 0's file: frozen parameters and buffers, as the module holds them


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing or corrupt files, or one of another model."""


def rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank:05d}.safetensors"


def engine_directory(checkpoint: str | Path) -> Path:
    """The engine checkpoint's directory inside a checkpoint directory (`checkpoint/engine`). A
    ZeroTrainer checkpoint written before the layouts were one holds it in `zero/` instead: that is a
    `CheckpointError` saying to rename it (nothing is lost), not a checkpoint without engine state."""
    checkpoint = Path(checkpoint)
    found, old = checkpoint / ENGINE_DIRECTORY, checkpoint / OLD_TRAINER_DIRECTORY
    if not found.exists() and (old / MANIFEST).is_file():
        raise CheckpointError(
            f"{old} is an engine checkpoint in the old ZeroTrainer layout: rename {old} to {found} "
            f"(mv {old} {found}; its files are unchanged) and load again"
        )
    return found


def tnlg_version() -> str:
    try:
        return metadata.version("tnlg")
    except metadata.PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------------------------------------- saving
def group_manifest(engine: EngineState) -> list[dict[str, Any]]:
    groups = []
    for group in engine.groups:
        layout = group.layout
        groups.append(
            {
                "num_shards": layout.num_shards,
                "shard_numel": layout.shard_numel,
                "params": [
                    {"name": s.name, "shape": list(s.shape), "unit": s.unit, "offset": s.offset}
                    for s in layout.slots
                ],
                "units": [
                    {"numel": u.numel, "piece": u.piece, "shard_offset": u.shard_offset} for u in layout.units
                ],
            }
        )
    return groups


def _unmanaged_state(engine: EngineState) -> dict[str, torch.Tensor]:
    """Module state the engine does not shard (frozen parameters, buffers): needed to consolidate."""
    managed = {id(p) for group in engine.groups for p in group.params}
    return {
        name: tensor
        for name, tensor in engine.module.state_dict(keep_vars=True).items()
        if id(tensor) not in managed
    }


def save_engine(engine: EngineState, directory: str | Path) -> None:
    """Every rank writes its shard into `directory`; rank 0 writes the manifest last. Collective."""
    directory = Path(directory)
    collectives = engine.collectives
    rank = collectives.rank
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    _barrier(collectives)
    tensors: dict[str, torch.Tensor] = {}
    optimizer = engine.base_optimizer
    for index, group in enumerate(engine.groups):
        tensors[f"group{index}.master"] = group.master
        for key, value in optimizer.state.get(group.master, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() == 0:  # per-group scalars: Adam's step
                tensors[f"group{index}.scalar.{key}"] = value.reshape(1)
            elif isinstance(value, torch.Tensor):  # per-element state, laid out like the master shard
                tensors[f"group{index}.state.{key}"] = value
    if rank == 0:
        for name, tensor in _unmanaged_state(engine).items():
            tensors[UNMANAGED_PREFIX + name] = tensor
    path = rank_file(directory, rank)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, path)
    _fsync(path)
    record = {path.name: {"sha256": sha256_of(path), "bytes": path.stat().st_size}}
    records = collectives.all_gather_object(record)
    if rank == 0:
        config = getattr(engine.module, "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            (directory / "config.json").write_text(config.to_json_string())
        manifest = {
            "format_version": FORMAT_VERSION,
            "tnlg_version": tnlg_version(),
            "world_size": collectives.world_size,
            **engine.checkpoint_state(),  # stage, mixed precision, global steps, loss scaler
            "optimizer": type(optimizer).__name__,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            "groups": group_manifest(engine),
            "unmanaged": sorted(_unmanaged_state(engine)),
            "files": {name: info for r in records for name, info in r.items()},
        }
        # The manifest appears only once every file is complete.
        write_json_atomic(directory / MANIFEST, manifest, indent=2, default=str)
    _barrier(collectives)


# ---------------------------------------------------------------------------------------------- reading
def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    # Written last: a missing one is a checkpoint cut short, or a directory that is not one.
    manifest = read_json(path, CheckpointError, "the engine checkpoint's manifest")
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path} holds a JSON {type(manifest).__name__}, not an engine manifest")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format {version!r}, this tnlg ({tnlg_version()}) reads format {FORMAT_VERSION}"
        )
    _check_manifest(path, manifest)
    return manifest


# The manifest's fields every reader uses, and their JSON types.
MANIFEST_FIELDS = {
    "world_size": int,
    "stage": int,
    "global_steps": int,
    "loss_scaler": dict,
    "param_groups": list,
    "groups": list,
    "files": dict,
}


def _check_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Refuse a manifest that parses but lacks what loading and consolidation read (written by hand, cut
    short and closed, or of another tool) with an error naming it, not a KeyError deep in a load."""
    wrong = [
        f"{name} ({'absent' if name not in manifest else type(manifest[name]).__name__}, expected {kind.__name__})"
        for name, kind in MANIFEST_FIELDS.items()
        if not isinstance(manifest.get(name), kind) or isinstance(manifest.get(name), bool)
    ]
    if not wrong and manifest["world_size"] < 1:
        wrong.append(f"world_size ({manifest['world_size']}, expected >= 1)")
    if wrong:
        raise CheckpointError(f"{path} is incomplete or damaged: " + ", ".join(wrong))
    files = manifest["files"]
    bad_files = [
        name
        for name, entry in files.items()
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("sha256"), str)
            and isinstance(entry.get("bytes"), int)
        )
    ]
    if bad_files:
        raise CheckpointError(
            f"{path} is damaged: the entries of {bad_files[:5]} need a sha256 and a size in bytes"
        )
    try:
        saved_params(manifest)
    except (KeyError, TypeError, IndexError, ValueError) as error:
        raise CheckpointError(
            f"{path} is damaged: its parameter layout cannot be read ({error!r})"
        ) from error


@dataclass(frozen=True)
class SavedParam:
    """Where a saved parameter's elements are (see [Note: reshaping])."""

    group: int
    shape: tuple[int, ...]
    offset: int  # in its unit
    piece: int  # elements per rank piece of its unit
    shard_offset: int  # the unit's start in every rank's shard

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    def segments(self, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
        """(saved rank, position in its shard, position in the flattened parameter, length) covering
        elements [start, end) of the parameter."""
        position = self.offset + start
        while position < self.offset + end:
            rank = position // self.piece
            stop = min(self.offset + end, (rank + 1) * self.piece)
            yield (
                rank,
                self.shard_offset + position - rank * self.piece,
                position - self.offset,
                stop - position,
            )
            position = stop


def saved_params(manifest: dict[str, Any]) -> dict[str, SavedParam]:
    found = {}
    for index, group in enumerate(manifest["groups"]):
        for param in group["params"]:
            unit = group["units"][param["unit"]]
            found[param["name"]] = SavedParam(
                index, tuple(param["shape"]), param["offset"], unit["piece"], unit["shard_offset"]
            )
    return found


class ShardReader:
    """Slices of a checkpoint's rank files, each file opened (and checksummed) once, on first use."""

    def __init__(self, directory: str | Path, manifest: dict[str, Any], verify: bool = True):
        self.directory = Path(directory)
        self.manifest = manifest
        self.verify = verify
        self._open: dict[int, Any] = {}

    def file(self, rank: int):
        if rank not in self._open:
            path = rank_file(self.directory, rank)
            expected = self.manifest["files"].get(path.name)
            if expected is None:
                raise CheckpointError(f"{path.name} is not listed in {self.directory / MANIFEST}")
            if not path.is_file():
                raise CheckpointError(f"{path} is missing from the checkpoint")
            size = path.stat().st_size
            if size != expected["bytes"]:
                raise CheckpointError(
                    f"{path} is {size} bytes, the manifest says {expected['bytes']}: truncated?"
                )
            if self.verify:
                self.check_sha256(rank)
            try:
                self._open[rank] = open_safetensors(path)
            except CheckpointFileError as error:  # the engine's ranks agree on CheckpointError
                raise CheckpointError(str(error)) from error
        return self._open[rank]

    def check_sha256(self, rank: int) -> None:
        path = rank_file(self.directory, rank)
        expected = self.manifest["files"].get(path.name)
        if expected is None or not path.is_file():
            self.file(rank)  # raises, naming what is missing
        if sha256_of(path) != expected["sha256"]:
            raise CheckpointError(f"{path}: sha256 differs from the manifest's: the file is corrupt")

    def keys(self, rank: int) -> set[str]:
        return set(self.file(rank).keys())

    def read(self, rank: int, key: str, start: int, length: int) -> torch.Tensor:
        return self.file(rank).get_slice(key)[start : start + length]

    def tensor(self, rank: int, key: str) -> torch.Tensor:
        return self.file(rank).get_tensor(key)

    def full_param(self, name: str, saved: SavedParam, key: str = "master") -> torch.Tensor:
        """A whole parameter (`key` "master" or an optimizer state such as "state.exp_avg"), fp32."""
        flat = torch.empty(saved.numel, dtype=torch.float32)
        for rank, at, position, length in saved.segments(0, saved.numel):
            flat[position : position + length] = self.read(rank, f"group{saved.group}.{key}", at, length)
        return flat.view(saved.shape)


# ---------------------------------------------------------------------------------------------- loading
def load_engine(engine: EngineState, directory: str | Path, verify: bool = True) -> dict[str, Any]:
    """Restore this rank's shard (master weights, optimizer state), the step and the loss scale from a
    checkpoint saved at any world size and stage. `verify` checks the sha256 of each file read.

    Every rank reads into new tensors first; only when all ranks have read theirs without error is
    anything replaced, so a damaged checkpoint raises the same `CheckpointError` on every rank (no
    rank is left waiting in a collective) and leaves the engine as it was."""
    directory = Path(directory)
    manifest, loaded, reader = read_on_every_rank(
        engine.collectives, lambda: _read_shard(engine, directory, verify)
    )
    optimizer = engine.base_optimizer
    for group_index, (group, (master, state, hyperparameters)) in enumerate(
        zip(engine.groups, loaded, strict=True)
    ):
        group.master.copy_(master)
        if state:
            optimizer.state[group.master] = state
        optimizer.param_groups[group_index].update(hyperparameters)
        group.write_back()
    _load_unmanaged(engine, reader, manifest)
    engine.restore_checkpoint_state(manifest)
    return manifest


def _read_shard(
    engine: EngineState, directory: Path, verify: bool
) -> tuple[dict[str, Any], list[tuple], ShardReader]:
    """This rank's (master, optimizer state, hyperparameters) per param group, read without
    communicating and without touching the engine."""
    manifest = read_manifest(directory)
    saved = saved_params(manifest)
    live = {slot.name: (group, slot) for group in engine.groups for slot in group.layout.slots}
    _check_same_parameters(directory, saved, live)
    # Opening checks sizes only: each file's sha256 is computed once, by one rank, below (every
    # rank hashing every file it reads from would hash rank 0's file on all of them).
    reader = ShardReader(directory, manifest, verify=False)
    optimizer = engine.base_optimizer
    rank0_keys = reader.keys(0)
    loaded = []
    for group_index, group in enumerate(engine.groups):
        sources = {saved[slot.name].group for slot in group.layout.slots}
        if len(sources) != 1:
            raise CheckpointError(
                f"{directory}: the parameters of param group {group_index} were in saved groups {sorted(sources)}: "
                "the optimizer's param groups must hold the same parameters as when it was saved"
            )
        (source,) = sources
        saved_keys = {
            k.removeprefix(f"group{source}.") for k in rank0_keys if k.startswith(f"group{source}.")
        }
        master = torch.zeros_like(group.master)  # padding stays zero, as in a fresh engine
        targets = {"master": master}
        state: dict[str, torch.Tensor] = {}
        for key in sorted(k for k in saved_keys if k.startswith("state.")):
            state[key.removeprefix("state.")] = targets[key] = torch.zeros_like(group.master)
        for slot in group.layout.slots:
            owned = group.layout.owned_range(slot, group.shard_rank)
            if owned is None:
                continue
            start, end, at = owned
            for rank, saved_at, position, length in saved[slot.name].segments(start, end):
                here = at + position - start
                for key, target in targets.items():
                    target[here : here + length].copy_(
                        reader.read(rank, f"group{source}.{key}", saved_at, length)
                    )
        for key in sorted(k for k in saved_keys if k.startswith("scalar.")):
            name = key.removeprefix("scalar.")
            reference = optimizer.state.get(group.master, {}).get(name)
            device = reference.device if reference is not None else _scalar_state_device(optimizer, group)
            state[name] = reader.tensor(0, f"group{source}.{key}").reshape(()).to(device)
        live_group = optimizer.param_groups[group_index]
        hyperparameters = {
            key: value
            for key, value in manifest["param_groups"][source].items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key in live_group
        }
        loaded.append((master, state, hyperparameters))
    if verify:  # every saved file is hashed by one rank; read_on_every_rank makes any mismatch fail all
        collectives = engine.collectives
        for rank in range(collectives.rank, manifest["world_size"], collectives.world_size):
            reader.check_sha256(rank)
    return manifest, loaded, reader


def _check_same_parameters(directory: Path, saved: dict[str, SavedParam], live: dict[str, Any]) -> None:
    missing = sorted(set(live) - set(saved))
    unexpected = sorted(set(saved) - set(live))
    reshaped = sorted(
        f"{name}: saved {list(saved[name].shape)}, model {list(slot.shape)}"
        for name, (_, slot) in live.items()
        if name in saved and tuple(slot.shape) != saved[name].shape
    )
    if missing or unexpected or reshaped:
        problems = []
        for label, names in (("missing", missing), ("unexpected", unexpected), ("different shape", reshaped)):
            if names:
                shown = ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")
                problems.append(f"{label}: {shown}")
        raise CheckpointError(f"{directory} holds a different model's parameters; " + "; ".join(problems))


def _scalar_state_device(optimizer: torch.optim.Optimizer, group) -> torch.device:
    # torch keeps Adam's step on the CPU unless the optimizer is fused or capturable.
    fused = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    return group.master.device if fused else torch.device("cpu")


def _load_unmanaged(engine: EngineState, reader: ShardReader, manifest: dict[str, Any]) -> None:
    current = _unmanaged_state(engine)
    for name in manifest.get("unmanaged", []):
        if name in current:
            with torch.no_grad():
                current[name].copy_(reader.tensor(0, UNMANAGED_PREFIX + name))


# ---------------------------------------------------------------------------------------------- helpers
def read_on_every_rank(collectives: Collectives, read: Callable[[], T]) -> T:
    """`read()` on this rank, then agree: if it raised `CheckpointError` on any rank, every rank
    raises that error (naming the rank), so none is left waiting in a later collective."""
    try:
        result, failure = read(), None
    except CheckpointError as error:
        result = None
        failure = f"rank {collectives.rank}: {error}" if collectives.world_size > 1 else str(error)
    failures = [f for f in collectives.all_gather_object(failure) if f is not None]
    if failures:
        raise CheckpointError(
            failures[0] + (f" (and {len(failures) - 1} more ranks failed)" if len(failures) > 1 else "")
        )
    return result


def _fsync(path: Path) -> None:
    with open(path, "rb") as stream:
        os.fsync(stream.fileno())


def _barrier(collectives: Collectives) -> None:
    if collectives.active:
        dist.barrier(group=collectives.group)
