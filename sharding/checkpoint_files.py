"""Reading engine checkpoints: the manifests and their checks, the rank files' slices of any parameter at
any tensor degree (`SavedCheckpoint`), and `read_on_every_rank`, which makes the ranks agree on a read
error or any other failure ([Note: agreed failures]). The format is described in checkpoint.py
([Note: reshaping], [Note: sliced checkpoints]), which saves and loads engines and re-exports these names.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError

# One reader of safetensors files for every checkpoint kind (errors that name the file, one hashing
# routine); the package `tnlg.modeling` is always imported before this one, by `tnlg` itself.
from tnlg.modeling.loading import CheckpointFileError, open_safetensors, sha256_of

from .collectives import Collectives
from .json_files import read_json
from .slice_runs import Cut, divides, local_shape, runs

MANIFEST = "manifest.json"
FORMAT_VERSION = 2
UNMANAGED_PREFIX = "module."  # rank 0's file: frozen parameters and buffers, as the module holds them

T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing or corrupt files, or one of another model."""


def rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank:05d}.safetensors"


def tnlg_version() -> str:
    try:
        return metadata.version("tnlg")
    except metadata.PackageNotFoundError:
        return "unknown"


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


# The manifest's fields every reader uses, and their JSON types: in every manifest, then in one of a
# checkpoint of whole parameters (or a sub-checkpoint), then in one of a sliced checkpoint's top.
MANIFEST_FIELDS = {
    "world_size": int,
    "stage": int,
    "global_steps": int,
    "loss_scaler": dict,
    "param_groups": list,
}
WHOLE_FIELDS = {"groups": list, "files": dict}
SLICED_FIELDS = {"layout": dict, "parts": list, "slices": dict}


def is_sliced(manifest: dict[str, Any]) -> bool:
    """Whether a manifest is a tensor-sliced checkpoint's top (see [Note: sliced checkpoints])."""
    return "parts" in manifest


def _check_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Refuse a manifest that parses but lacks what loading and consolidation read (written by hand, cut
    short and closed, or of another tool) with an error naming it, not a KeyError deep in a load."""
    fields = {**MANIFEST_FIELDS, **(SLICED_FIELDS if is_sliced(manifest) else WHOLE_FIELDS)}
    wrong = [
        f"{name} ({'absent' if name not in manifest else type(manifest[name]).__name__}, expected {kind.__name__})"
        for name, kind in fields.items()
        if not isinstance(manifest.get(name), kind) or isinstance(manifest.get(name), bool)
    ]
    if not wrong and manifest["world_size"] < 1:
        wrong.append(f"world_size ({manifest['world_size']}, expected >= 1)")
    if wrong:
        raise CheckpointError(f"{path} is incomplete or damaged: " + ", ".join(wrong))
    if is_sliced(manifest):
        _check_sliced_manifest(path, manifest)
        return
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


def _check_sliced_manifest(path: Path, manifest: dict[str, Any]) -> None:
    def integer(value: Any, low: int = 0) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= low

    layout, parts, slices = manifest["layout"], manifest["parts"], manifest["slices"]
    problems = []
    if not (integer(layout.get("tensor"), 1) and integer(layout.get("pipeline"), 1)):
        problems.append(f"layout {layout} (expected tensor and pipeline degrees >= 1)")
    else:
        tensor, pipeline = layout["tensor"], layout["pipeline"]
        found = sorted(
            (p.get("pipeline_stage"), p.get("tensor_rank"))
            for p in parts
            if isinstance(p, dict) and integer(p.get("pipeline_stage")) and integer(p.get("tensor_rank"))
        )
        if found != [(s, t) for s in range(pipeline) for t in range(tensor)]:
            stages = f" of each pipeline stage 0..{pipeline - 1}" if pipeline > 1 else ""
            problems.append(f"parts: expected one sub-checkpoint per tensor rank 0..{tensor - 1}{stages}")
    for part in parts:
        if not (
            isinstance(part, dict)
            and isinstance(part.get("directory"), str)
            and re.fullmatch(r"[A-Za-z0-9_-]+", part["directory"])  # a name inside the checkpoint only
            and integer(part.get("tensor_rank"))
            and integer(part.get("pipeline_stage"))
            and isinstance(part.get("sha256"), str)
        ):
            problems.append(f"part {part!r} (expected a directory name, tensor_rank, pipeline_stage, sha256)")
    for name, entry in slices.items():
        if not (
            isinstance(entry, dict)
            and integer(entry.get("dim"))
            and entry.get("parts") in (1, 3)
            and isinstance(entry.get("shape"), list)
            and all(integer(n) for n in entry["shape"])
            and entry["dim"] < len(entry["shape"])
        ):
            problems.append(f"slice of {name} {entry!r} (expected dim, parts 1 or 3, full shape)")
    if problems:
        raise CheckpointError(f"{path} is damaged: " + "; ".join(problems[:5]))


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


@dataclass(frozen=True)
class SavedPart:
    """One sub-checkpoint (the whole checkpoint, without tensor slicing or pipeline stages): its
    coordinates, manifest, files and parameters."""

    directory: Path
    manifest: dict[str, Any]
    reader: ShardReader
    params: dict[str, SavedParam]
    pipeline_stage: int = 0
    tensor_rank: int = 0


class SavedCheckpoint:
    """An engine checkpoint opened for reading, with tensor slicing and pipeline stages or without (one
    part of degree 1): each parameter's full shape, saved cut and the part holding it for each saved
    tensor rank, and reads of any slice of it at any tensor degree (see [Note: slice runs] in
    slice_runs.py). Manifests are read and checked here; files on first use."""

    def __init__(self, directory: str | Path, verify: bool = True):
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        if not is_sliced(self.manifest):
            self.degree, self.cuts = 1, {}
            self.parts = [self._part(self.directory, self.manifest, verify)]
            self.shapes = {name: saved.shape for name, saved in self.parts[0].params.items()}
            self.holders = {name: [0] for name in self.shapes}
            self.unmanaged_holders = {name: [0] for name in self.manifest.get("unmanaged", [])}
            return
        self.degree = self.manifest["layout"]["tensor"]
        slices = self.manifest["slices"]
        self.cuts = {name: Cut(entry["dim"], entry["parts"]) for name, entry in slices.items()}
        self.parts = [
            self._open_part(entry, verify)
            for entry in sorted(self.manifest["parts"], key=lambda p: (p["pipeline_stage"], p["tensor_rank"]))
        ]
        self.holders = self._holders({index: part.params for index, part in enumerate(self.parts)}, True)
        self.unmanaged_holders = self._holders(
            {index: part.manifest.get("unmanaged", []) for index, part in enumerate(self.parts)}, False
        )
        self.shapes = {
            name: tuple(slices[name]["shape"]) if name in slices else self.parts[held[0]].params[name].shape
            for name, held in self.holders.items()
        }
        for name, cut in self.cuts.items():
            if name in self.shapes and not divides(self.shapes[name], cut, self.degree):
                raise CheckpointError(
                    f"{self.directory / MANIFEST}: {name}'s slice {slices[name]} does not "
                    f"divide into {self.degree} tensor ranks"
                )
        for part in self.parts:
            found = {name: saved.shape for name, saved in part.params.items()}
            expected = {
                name: local_shape(self.shapes[name], self.cuts.get(name), self.degree) for name in found
            }
            wrong = sorted(
                f"{n}: {list(found[n])}, expected {list(expected[n])}"
                for n in found
                if found[n] != expected[n]
            )
            if wrong:
                raise CheckpointError(
                    f"{part.directory} does not hold the parameters its checkpoint's manifest describes: "
                    + ", ".join(wrong[:5])
                )

    def _open_part(self, entry: dict[str, Any], verify: bool) -> SavedPart:
        """One sub-checkpoint the top manifest lists, its manifest checked against the recorded sha256."""
        sub = self.directory / entry["directory"]
        stage = (
            f"pipeline stage {entry['pipeline_stage']}, " if self.manifest["layout"]["pipeline"] > 1 else ""
        )
        if not (sub / MANIFEST).is_file():
            raise CheckpointError(
                f"{sub / MANIFEST} is missing: the checkpoint lacks {stage}tensor rank "
                f"{entry['tensor_rank']}'s sub-checkpoint"
            )
        if sha256_of(sub / MANIFEST) != entry["sha256"]:
            raise CheckpointError(
                f"{sub / MANIFEST}: sha256 differs from the one {self.directory / MANIFEST} records: "
                "the sub-checkpoint was changed or belongs to another save"
            )
        manifest = read_manifest(sub)
        if is_sliced(manifest):
            raise CheckpointError(f"{sub / MANIFEST} is a sliced checkpoint's top, not a sub-checkpoint")
        return self._part(sub, manifest, verify, entry["pipeline_stage"], entry["tensor_rank"])

    def _holders(self, names: dict[int, Any], strict: bool) -> dict[str, list[int]]:
        """{name: the index of the part holding it, per saved tensor rank}, from {part index: its names}.
        Every tensor rank's stages together hold every parameter exactly once (the tied embedding is
        saved by the first stage only, see [Note: pipeline checkpoints] in checkpoint.py); `strict`
        False (module state): a name on several stages is taken from the first."""
        holders: dict[str, list[int | None]] = {}
        for index, held in names.items():
            part = self.parts[index]
            for name in held:
                column = holders.setdefault(name, [None] * self.degree)
                previous = column[part.tensor_rank]
                if previous is not None and strict:
                    raise CheckpointError(
                        f"{self.directory}: {name} is saved by two parts, {self.parts[previous].directory.name} "
                        f"and {part.directory.name}: each parameter must be saved once per tensor rank"
                    )
                if previous is None:
                    column[part.tensor_rank] = index
        lacking = sorted(
            f"{name} (tensor rank {rank})"
            for name, column in holders.items()
            for rank, index in enumerate(column)
            if index is None
        )
        if lacking:
            raise CheckpointError(
                f"{self.directory}: no sub-checkpoint holds "
                + ", ".join(lacking[:5])
                + (f", ... ({len(lacking)} in all)" if len(lacking) > 5 else "")
            )
        return holders  # type: ignore[return-value]

    @staticmethod
    def _part(
        directory: Path, manifest: dict[str, Any], verify: bool, pipeline_stage: int = 0, tensor_rank: int = 0
    ) -> SavedPart:
        return SavedPart(
            directory,
            manifest,
            ShardReader(directory, manifest, verify),
            saved_params(manifest),
            pipeline_stage,
            tensor_rank,
        )

    def holder(self, name: str, tensor_rank: int = 0) -> SavedPart:
        """The part holding saved tensor rank `tensor_rank`'s slice of parameter `name` (its whole
        value when it is not sliced)."""
        return self.parts[self.holders[name][tensor_rank]]

    @property
    def names(self) -> list[str]:
        return list(self.shapes)

    def numel(self, name: str) -> int:
        return int(torch.Size(self.shapes[name]).numel())

    def cut(self, name: str, live: Cut | None) -> Cut | None:
        """The cut of `name`, saved or live; a parameter cut differently on the two sides is an error."""
        saved = self.cuts.get(name)
        if saved is not None and live is not None and saved != live:
            raise CheckpointError(
                f"{self.directory}: {name} was saved cut along dimension {saved.dim} in {saved.parts} part(s); "
                f"this model cuts it along {live.dim} in {live.parts}"
            )
        return saved or live

    def read(
        self,
        name: str,
        key: str,
        start: int,
        end: int,
        live: Cut | None = None,
        degree: int = 1,
        rank: int = 0,
    ) -> torch.Tensor:
        """Elements [start, end) of tensor rank `rank`'s slice of `name` at tensor `degree` (`live` None
        with degree 1: of the whole parameter), flat, fp32. `key`: "master" or "state.<name>"."""
        flat = torch.empty(end - start, dtype=torch.float32)
        cut = self.cut(name, live)
        saved_degree = self.degree if name in self.cuts else 1
        live_degree, live_rank = (degree, rank) if live is not None else (1, 0)
        for part, at, position, length in runs(
            self.shapes[name], cut, live_degree, live_rank, saved_degree, start, end
        ):
            holder = self.holder(name, part)
            saved = holder.params[name]
            for file, shard_at, element, count in saved.segments(at, at + length):
                here = position + element - at
                flat[here : here + count] = holder.reader.read(
                    file, f"group{saved.group}.{key}", shard_at, count
                )
        return flat

    def full_param(self, name: str, key: str = "master") -> torch.Tensor:
        """The whole parameter `name` (master weights or an optimizer state), fp32, in its full shape."""
        return self.read(name, key, 0, self.numel(name)).view(self.shapes[name])

    @property
    def unmanaged(self) -> list[str]:
        """The frozen parameters and buffers every part holds, in stage order."""
        return list(self.unmanaged_holders)

    def unmanaged_slice(self, name: str, tensor_rank: int = 0):
        """The safetensors slice (shape, dtype; no data read) of saved tensor rank `tensor_rank`'s
        `name`, a frozen parameter or buffer, in rank 0's file of the part holding it."""
        part = self.parts[self.unmanaged_holders[name][tensor_rank]]
        return part.reader.file(0).get_slice(UNMANAGED_PREFIX + name)

    def _unmanaged_part(self, name: str, tensor_rank: int) -> torch.Tensor:
        part = self.parts[self.unmanaged_holders[name][tensor_rank]]
        return part.reader.tensor(0, UNMANAGED_PREFIX + name)

    def unmanaged_shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self.unmanaged_slice(name).get_shape())
        cut = self.cuts.get(name)
        if cut is not None:
            shape = tuple(n * self.degree if d == cut.dim else n for d, n in enumerate(shape))
        return shape

    def unmanaged_tensor(
        self, name: str, live: Cut | None = None, degree: int = 1, rank: int = 0
    ) -> torch.Tensor:
        """A frozen parameter or buffer (rank 0's file of the parts holding it): whole, or tensor rank
        `rank`'s slice."""
        saved_cut = self.cuts.get(name)
        if saved_cut is None and live is None:
            return self._unmanaged_part(name, 0)
        cut = self.cut(name, live)
        full = self.unmanaged_shape(name)
        pieces = {}
        live_degree, live_rank = (degree, rank) if live is not None else (1, 0)
        shape = local_shape(full, live, live_degree)
        numel = int(torch.Size(shape).numel())
        flat = None
        for part, at, position, length in runs(
            full, cut, live_degree, live_rank, self.degree if saved_cut else 1, 0, numel
        ):
            if part not in pieces:
                pieces[part] = self._unmanaged_part(name, part).flatten()
            if flat is None:
                flat = torch.empty(numel, dtype=pieces[part].dtype)
            flat[position : position + length] = pieces[part][at : at + length]
        return flat.view(shape)

    def files(self) -> list[tuple[int, int]]:
        """(part, rank) of every rank file of the checkpoint."""
        return [
            (index, rank)
            for index, part in enumerate(self.parts)
            for rank in range(part.manifest["world_size"])
        ]


# [Note: agreed failures]
# The ranks of a checkpoint step agree on its outcome, so that a failure on one is raised on all and none
# waits in the next collective until the group's timeout. What they raise depends on what failed:
# - the checkpoint or its storage (a CheckpointError, a file error: OSError, SafetensorError): a
#   CheckpointError on every rank, naming the rank, the original chained on its own. A load's fallback
#   catches it and every rank tries the next checkpoint together; a script reports it as bad input;
# - anything else (a bug: TypeError, KeyError, AttributeError; out of memory): the rank that raised it
#   raises it again, its type and traceback kept, and every other rank a RankFailedError naming it and
#   where it was raised. Not a CheckpointError (a ValueError): a bug is neither taken for a damaged
#   checkpoint, which the fallback would skip for an older one, nor reported as input to correct.
STORAGE_ERRORS = (CheckpointError, OSError, SafetensorError)


class RankFailedError(RuntimeError):
    """Another rank raised an error that is not the checkpoint's or its storage's while the ranks agreed
    on a checkpoint step (see [Note: agreed failures]); that rank raised the error itself."""


@dataclass(frozen=True)
class RankFailure:
    """What one rank raised during an agreed checkpoint step, as every rank receives it."""

    rank: int
    text: str
    storage: bool  # the checkpoint's or its storage's (see [Note: agreed failures])


def failure_of(rank: int, error: Exception | None) -> RankFailure | None:
    """`error` as the other ranks are told of it (None: it did not fail)."""
    if error is None:
        return None
    if isinstance(error, CheckpointError):
        return RankFailure(rank, str(error), True)
    if isinstance(error, STORAGE_ERRORS):
        return RankFailure(rank, f"{type(error).__name__}: {error}", True)
    return RankFailure(rank, raised_where(error), False)


def raised_where(error: Exception) -> str:
    """`error` with where it was raised: the message of a bug may name no file (`KeyError: 'rng'`)."""
    frames = traceback.extract_tb(error.__traceback__)
    where = (
        f" (raised at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})"
        if frames
        else ""
    )
    return f"{type(error).__name__}: {error}{where}"


def raise_agreed(
    own: Exception | None, failures: list[RankFailure], describe: Callable[[RankFailure, int], str]
) -> None:
    """Raise on this rank what the ranks agreed on (see [Note: agreed failures]); nothing when `failures`,
    every rank's, is empty. `describe(cause, others)` words the failure of the rank named first: the
    first that is not the storage's when there is one, with `others` more ranks that failed."""
    if not failures:
        return
    bugs = [failure for failure in failures if not failure.storage]
    cause = (bugs or failures)[0]
    message = describe(cause, len(failures) - 1)
    if not bugs:
        raise CheckpointError(message) from own
    if own is not None and not isinstance(own, STORAGE_ERRORS):
        raise own
    raise RankFailedError(message) from own


def read_on_every_rank(collectives: Collectives, read: Callable[[], T]) -> T:
    """`read()` on this rank, then agree: if it raised on any rank, every rank raises (a CheckpointError
    naming the rank for a damaged or missing checkpoint, see [Note: agreed failures]), so none is left
    waiting in a later collective."""
    try:
        result, raised = read(), None
    except Exception as error:
        result, raised = None, error
    failures = [
        f for f in collectives.all_gather_object(failure_of(collectives.rank, raised)) if f is not None
    ]

    def describe(cause: RankFailure, others: int) -> str:
        text = f"rank {cause.rank}: {cause.text}" if collectives.world_size > 1 else cause.text
        return text + (f" (and {others} more ranks failed)" if others else "")

    raise_agreed(raised, failures, describe)
    return result  # type: ignore[return-value]
