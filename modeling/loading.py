"""Checkpoint files: strict loading, checksum records, and errors that name the file.

Transformers' `from_pretrained` initialises missing tensors randomly and drops unexpected ones with
a warning; for a training run that silently corrupts a resumed or converted model. TNLG raises
`CheckpointMismatchError` listing every offending tensor instead (`strict=False` restores the
Transformers behaviour).

[Note: checksums]
safetensors files carry no checksum: a flipped bit inside a tensor loads without complaint. Every
writer of TNLG model files (`save_pretrained`, the engine's consolidation) records the sha256 and
size of each weight file in `tnlg_checksums.json` next to them, and every reader (`from_pretrained`,
the engine's sharded loader, `tnlg.tools.convert.load_tensors`) checks the files it reads against that
record when the directory has one. A file of its own keeps the weights and the index exactly as
plain Transformers writes and reads them; a directory without it (a plain Transformers save) loads
unverified.

Model directories are the user's: pruning, merging adapters, quantizing or a hub tool rewrite their
weight files and leave the record behind. So a weight file that still reads as safetensors but no
longer matches the record (another sha256 or size, or a file the record does not list) loads with a
warning naming it; `verify_checksums="strict"` refuses it instead. Real damage is refused whatever
the setting: a file the record or the index lists that is missing, one that does not read as
safetensors (a truncated shard), a record that is not valid. Engine checkpoints, which only tnlg
writes, are always checked strictly (tnlg/sharding/checkpoint_files.py).

A file that cannot be read (a truncated shard, an index that is not JSON, a pickle renamed to
.safetensors) is a `CheckpointFileError` naming the file and the problem, never a library's
traceback that names no file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

CHECKSUMS_FILE = "tnlg_checksums.json"
SAFE_WEIGHTS_NAME = "model.safetensors"  # Transformers' names for a model's weights
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")
STRICT = "strict"  # verify_checksums=STRICT: a file that no longer matches the record is refused
_CHANGED_ON_PURPOSE = " (changed on purpose? save the model again, or load without verify_checksums='strict')"
logger = logging.getLogger(__name__)


class CheckpointMismatchError(ValueError):
    """A checkpoint that does not fit the model: lists every missing, unexpected and mis-shaped tensor."""

    def __init__(
        self,
        missing: Iterable[str] = (),
        unexpected: Iterable[str] = (),
        mis_shaped: Iterable[tuple[str, tuple[int, ...], tuple[int, ...]]] = (),
        source: str = "checkpoint",
        way_out: str = "",
    ):
        self.missing, self.unexpected = sorted(missing), sorted(unexpected)
        self.mis_shaped = sorted(mis_shaped)
        lines = [f"{source} does not match the TNLG model:"]
        if self.missing:
            lines.append(f"  missing ({len(self.missing)}): {', '.join(self.missing)}")
        if self.unexpected:
            lines.append(f"  unexpected ({len(self.unexpected)}): {', '.join(self.unexpected)}")
        for name, got, want in self.mis_shaped:
            lines.append(f"  mis-shaped: {name} has shape {list(got)}, the model expects {list(want)}")
        if way_out:
            lines.append(f"  {way_out}")
        super().__init__("\n".join(lines))


class CheckpointFileError(ValueError):
    """A checkpoint file that cannot be used as it is: missing, truncated, corrupt, or not in the
    format its name says. The message is the file's path followed by the problem."""

    def __init__(self, path: str | Path, problem: str):
        self.path, self.problem = Path(path), problem
        super().__init__(f"{path} {problem}")

    def __reduce__(self):  # picklable (multiprocessing) although __init__ takes two arguments
        return type(self), (self.path, self.problem)


# ---------------------------------------------------------------------------------------------- reading files
def variant_name(name: str, variant: str | None) -> str:
    """Transformers' name for a variant's file: `model.safetensors` -> `model.fp16.safetensors`."""
    if not variant:
        return name
    stem, _, suffix = name.rpartition(".")
    return f"{stem}.{variant}.{suffix}"


def read_json(path: Path, what: str) -> Any:
    """The JSON in `path`; a missing file or one that is not JSON is a `CheckpointFileError`."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointFileError(path, "is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointFileError(
            path, f"is not valid JSON ({error}): {what} is truncated or damaged"
        ) from None


def config_model_type(path: Path) -> str | None:
    """The `model_type` a config.json names (None: it names none); a `CheckpointFileError` when the
    file is missing, not JSON or no JSON object, before Transformers reads it as something else."""
    config = read_json(path, "the model's config")
    if not isinstance(config, dict):
        raise CheckpointFileError(path, f"holds a JSON {type(config).__name__}, not a model config")
    return config.get("model_type")


# How a directory of one model type (found, wanted) becomes the other: named in the refusal.
_WAYS_IN = {
    ("gpt2", "tnlg"): "convert it first, with tnlg.tools.convert.from_gpt2 or "
    "`scripts/convert_checkpoint.py --from gpt2`",
}


def check_model_config(directory: Path, model_type: str) -> None:
    """`CheckpointFileError` naming `directory`'s config.json unless it is a readable config of
    `model_type`: for a damaged one Transformers raises an OSError that names no cause, and it reads
    another model's config as this one with a warning only. The message names the way in where one
    exists (a GPT-2 directory for a TNLG model: the converter)."""
    path = directory / "config.json"
    found = config_model_type(path)
    if found != model_type:
        way_in = _WAYS_IN.get((found, model_type))
        problem = f"is a {found!r} model's config, not a {model_type!r} one"
        raise CheckpointFileError(path, f"{problem}: {way_in}" if way_in else problem)


def read_index(path: Path) -> dict[str, str]:
    """The weight map (tensor name -> file name) of a safetensors index."""
    index = read_json(path, "the safetensors index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointFileError(
            path, 'is not a safetensors index: it needs a "weight_map" from tensor names to file names'
        )
    return weight_map


def weight_files(directory: Path, variant: str | None = None) -> list[str]:
    """The safetensors files `from_pretrained` reads in `directory`, in Transformers' order of
    preference: the single file, else the shards its index names; none for other formats."""
    if (directory / variant_name(SAFE_WEIGHTS_NAME, variant)).is_file():
        return [variant_name(SAFE_WEIGHTS_NAME, variant)]
    index = directory / variant_name(SAFE_WEIGHTS_INDEX_NAME, variant)
    return sorted(set(read_index(index).values())) if index.is_file() else []


def open_safetensors(path: Path):
    """`safe_open(path)`; a file that is missing or is not safetensors is a `CheckpointFileError`
    saying what it looks like instead."""
    if not path.is_file():
        raise CheckpointFileError(path, "is missing from the checkpoint")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as error:  # safetensors raises its own SafetensorError, and OSError
        raise CheckpointFileError(path, f"cannot be read as safetensors: {_diagnose(path, error)}") from error


def _diagnose(path: Path, error: Exception) -> str:
    with open(path, "rb") as stream:
        start = stream.read(8)
    if start.startswith(b"PK\x03\x04"):
        return (
            "it is a zip archive, the format of torch.save: a pickled checkpoint renamed .safetensors? "
            "Load it with torch.load(weights_only=True) and save it with safetensors"
        )
    if start[:1] == b"\x80":
        return "it is a pickle (legacy torch.save): a pickled checkpoint renamed .safetensors?"
    size = path.stat().st_size
    return f"{error} ({size} bytes: truncated or damaged?)"


def check_weight_files(directory: Path, files: Iterable[str], *, verify: bool | str = True) -> None:
    """Every file opens as safetensors and, when `verify`, is checked against the directory's checksum
    record (a changed file a warning, or with `verify="strict"` an error: see [Note: checksums])."""
    files = list(files)
    for name in files:
        with open_safetensors(directory / name):
            pass
    if verify:
        verify_checksums(directory, files, strict=verify == STRICT)


# ---------------------------------------------------------------------------------------------- checksums
def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def read_checksums(directory: Path) -> dict[str, dict[str, Any]] | None:
    """The checksum record of `directory` (file name -> sha256 and bytes), None when it has none."""
    path = directory / CHECKSUMS_FILE
    if not path.is_file():
        return None
    record = read_json(path, "the checksum record")
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(entry, dict)
        and isinstance(entry.get("sha256"), str)
        and _SHA256.fullmatch(entry["sha256"])
        and isinstance(entry.get("bytes"), int)
        for entry in files.values()
    ):
        raise CheckpointFileError(
            path,
            'is not a checksum record: it needs "files" mapping file names to their "sha256" and "bytes"',
        )
    return files


def write_checksums(directory: Path, files: Iterable[str]) -> Path:
    """Record the sha256 and size of `files` (names in `directory`) in its checksum record. Records
    of other files that still exist (another variant's weights) are kept; a damaged record is replaced."""
    try:
        previous = read_checksums(directory) or {}
    except CheckpointFileError:
        previous = {}
    records = {name: entry for name, entry in previous.items() if (directory / name).is_file()}
    for name in files:
        records[name] = {"sha256": sha256_of(directory / name), "bytes": (directory / name).stat().st_size}
    path = directory / CHECKSUMS_FILE
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(json.dumps({"algorithm": "sha256", "files": dict(sorted(records.items()))}, indent=2))
    os.replace(staging, path)  # a reader never sees half a record
    return path


def verify_checksums(
    directory: Path, files: Iterable[str], hashed: Iterable[str] | None = None, *, strict: bool = False
) -> bool:
    """Check `files` against `directory`'s checksum record: each must be recorded, with its size;
    those in `hashed` (default: all) are hashed too. A file that no longer matches the record is a
    warning naming it (see [Note: checksums]); with `strict`, a `CheckpointFileError`. A recorded file
    that is missing is always an error. True when every file matched; False when one did not, or the
    directory has no record."""
    records = read_checksums(directory)
    if records is None:
        return False
    files = list(files)
    hashed = set(files if hashed is None else hashed)
    changed: list[tuple[Path, str]] = []
    for name in files:
        path, entry = directory / name, records.get(name)
        if entry is None:
            changed.append(
                (
                    path,
                    f"has no entry in {directory / CHECKSUMS_FILE}: it was not written by the save that wrote the "
                    "record",
                )
            )
            continue
        if not path.is_file():
            raise CheckpointFileError(path, "is missing from the checkpoint")
        size = path.stat().st_size
        if size != entry["bytes"]:
            changed.append((path, f"is {size} bytes, {CHECKSUMS_FILE} records {entry['bytes']}: replaced"))
        elif name in hashed and sha256_of(path) != entry["sha256"]:
            changed.append(
                (path, f"does not match the sha256 recorded in {CHECKSUMS_FILE} when it was saved")
            )
    if changed and strict:
        path, why = changed[0]
        raise CheckpointFileError(path, why + _CHANGED_ON_PURPOSE)
    for path, why in changed:
        logger.warning(
            "%s %s: loading it as it is (changed by another tool? verify_checksums='strict' refuses it)",
            path,
            why,
        )
    return not changed


def _variant_weight_paths(directory: Path, variant: str | None) -> list[Path]:
    """A variant's weight files in `directory`: the single file, the index and the shards."""
    if not directory.is_dir():
        return []
    single = variant_name(SAFE_WEIGHTS_NAME, variant)
    index = variant_name(SAFE_WEIGHTS_INDEX_NAME, variant)
    shard = re.compile(re.escape(single.removesuffix(".safetensors")) + r"-\d{5}-of-\d{5}\.safetensors")
    return sorted(
        path
        for path in directory.iterdir()
        if path.is_file() and (path.name in (single, index) or shard.fullmatch(path.name))
    )


def remove_weight_files(directory: Path, variant: str | None = None) -> None:
    """Delete a variant's weights (the single file, the index, the shards) before a save replaces them.

    Transformers keeps a single `model.safetensors` when it then writes shards, and `from_pretrained`
    prefers that file: the directory would silently load the previous weights. Unlinking first also
    keeps tensors memory-mapped from the old files valid while the new ones are written."""
    for path in _variant_weight_paths(directory, variant):
        path.unlink()


# [Note: replacing a model's weights]
# A save over a model directory must leave exactly one model there: the new one when the save returns,
# the old one when it raises. Transformers checks some inputs (a GenerationConfig that does not
# validate, say) only after the caller has had its chance to clear the directory, and a write can fail
# halfway (a full disk). So the old weight files are renamed aside (hidden names in the same directory)
# rather than deleted: renaming, like unlinking, keeps their inodes, so tensors memory-mapped from them
# stay valid while the new files are written, and no stale single file or shard can outlive the save
# (from_pretrained prefers a single file to an index). They are deleted once the save has returned, or
# renamed back, over whatever the failed save wrote, when it raises.
_SET_ASIDE_PREFIX, _SET_ASIDE_SUFFIX = ".", ".tnlg-replaced"


@contextlib.contextmanager
def replacing_weight_files(directory: Path, variant: str | None = None) -> Iterator[None]:
    """Run a save of `variant`'s weights into `directory` so that the previous weights are gone when
    it returns and intact when it raises ([Note: replacing a model's weights])."""
    aside: dict[Path, Path] = {}
    for path in _variant_weight_paths(directory, variant):
        hidden = path.with_name(_SET_ASIDE_PREFIX + path.name + _SET_ASIDE_SUFFIX)
        os.replace(path, hidden)
        aside[path] = hidden
    try:
        yield
    except BaseException:
        for written in _variant_weight_paths(directory, variant):
            written.unlink()  # the failed save's files: the old weights come back whole, without them
        for path, hidden in aside.items():
            os.replace(hidden, path)
        raise
    for hidden in aside.values():
        hidden.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------- strictness
# The `from_pretrained` keywords that load a mismatched checkpoint anyway, each for its own kind of
# mismatch: with `strict=False` alone Transformers itself refuses mis-shaped tensors.
_WAYS_OUT = (
    "to load it anyway, as Transformers does: strict=False initialises missing tensors randomly and drops "
    "unexpected ones; ignore_mismatched_sizes=True initialises mis-shaped ones randomly"
)


def raise_on_mismatch(loading_info: dict, source: str, *, ignore_mismatched_sizes: bool = False) -> None:
    """Raise `CheckpointMismatchError` if Transformers' loading info reports any mismatch that
    `from_pretrained` was not asked to accept: with `ignore_mismatched_sizes` (the caller's explicit
    choice), mis-shaped tensors were re-initialised as Transformers does, and only missing or
    unexpected ones are refused."""
    missing = loading_info.get("missing_keys") or ()
    unexpected = loading_info.get("unexpected_keys") or ()
    mis_shaped = [
        (str(entry[0]), tuple(entry[1]), tuple(entry[2]))
        if isinstance(entry, tuple) and len(entry) == 3
        else (str(entry), (), ())
        for entry in loading_info.get("mismatched_keys") or ()
    ]
    if ignore_mismatched_sizes:
        mis_shaped = []
    if missing or unexpected or mis_shaped:
        raise CheckpointMismatchError(missing, unexpected, mis_shaped, source, _WAYS_OUT)


def saved_output_layer(directory: Path, variant: str | None = None) -> torch.Tensor | None:
    """The `lm_head.weight` saved in a local checkpoint, or None when it was not saved."""
    single = directory / variant_name(SAFE_WEIGHTS_NAME, variant)
    index = directory / variant_name(SAFE_WEIGHTS_INDEX_NAME, variant)
    if single.is_file():
        file = single
    elif index.is_file() and "lm_head.weight" in (weight_map := read_index(index)):
        file = directory / weight_map["lm_head.weight"]
    else:
        return None
    with open_safetensors(file) as reader:
        if "lm_head.weight" not in reader.keys():  # noqa: SIM118 (safe_open has no __contains__)
            return None
        return reader.get_tensor("lm_head.weight")


def tied_output_layer_error(
    model: torch.nn.Module, saved: torch.Tensor | None, source: str
) -> CheckpointMismatchError | None:
    """The error for a saved output layer that differs from the embedding the config ties it to.

    Transformers ties the weights after loading and silently drops the saved `lm_head.weight`;
    if that tensor differs, the checkpoint came from an untied model and loading it tied
    computes a different function."""
    if (
        saved is None
        or not getattr(model.config, "tie_word_embeddings", False)
        or not hasattr(model, "lm_head")
    ):
        return None
    embedding = model.get_input_embeddings().weight
    if saved.shape == embedding.shape and torch.equal(
        saved.to(embedding.dtype).cpu(), embedding.detach().cpu()
    ):
        return None
    return CheckpointMismatchError(
        source=f"{source} (its lm_head.weight differs from the token embedding, but the config ties "
        "them; load it with tie_word_embeddings=False)",
    )


# ---------------------------------------------------------------------------- pickled checkpoints
def inert_globals(path: str | Path, accept: Callable[[str], bool]) -> list[tuple[type, str]]:
    """Inert stand-ins, for `torch.serialization.safe_globals`, of the classes a pickled checkpoint at
    `path` names that `accept(qualified name)` lets through: other tools' enums, config records and
    loss-scaler objects (Megatron-LM's saved args, DeepSpeed's optimizer state). Each stub records
    what it is rebuilt with (`.args`, `.kwargs`, `.state`) and runs nothing: loading the file neither
    imports nor executes the tool. Globals not accepted stay refused by `weights_only=True`."""
    try:
        wanted = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception:  # not a zip checkpoint: torch.load's own error names the problem
        return []
    return [(_inert_class(name), name) for name in wanted if accept(name)]


def _inert_class(qualified_name: str) -> type:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        self.state = state

    name = qualified_name.rsplit(".", 1)[-1]
    namespace = {"__init__": __init__, "__setstate__": __setstate__, "__module__": "tnlg.inert"}
    return type(name, (), namespace)
