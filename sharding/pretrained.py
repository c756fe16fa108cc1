"""Transformers safetensors checkpoints loaded straight into the engine's shards.

    model = meta_from_pretrained(TNLGForCausalLM, "ckpt")      # shapes only, no storage
    engine = initialize(model, optimizer, ZeroConfig(stage=3))  # each rank reads its slices

[Note: pretrained shards]
`from_pretrained` followed by sharding holds the whole model on every rank first: a 530B model does
not fit. Here the model is built on the meta device and the engine reads the checkpoint itself.
For each trainable parameter a rank needs only the elements it owns in its flat layout, a
contiguous range of the flattened tensor (see `FlatLayout.owned_range`); safetensors slices a
tensor along its first dimension, so the rank reads the rows that cover that range (at most two
rows more than it keeps) and cuts them. A stage 3 rank therefore reads about 1/world of every
sharded tensor. Parameters a rank keeps whole (stages 0-2, stage 3's small persistent ones, frozen
ones) are read whole, one at a time. Files are opened one at a time and closed when done, so
the memory-mapped pages of the checkpoint never add up beyond one file's touched slices.

Names are matched as `from_pretrained` matches them: the module's own names, tied aliases (a
tied output layer is usually not saved), and the base model's prefix added or removed. Every
checkpoint tensor must be used and every parameter found, or the load fails naming them;
`strict=False` initialises the missing parameters with the engine's seeded initialization
instead and ignores unused tensors, as `from_pretrained(strict=False)` does.

Ranks read without communicating, then agree: a missing or damaged file raises the same
`CheckpointError` on every rank (no rank is left waiting in a collective).

Integrity: when the checkpoint has a `tnlg_checksums.json` (TNLG's writers record one, see
[Note: checksums] in tnlg/modeling/loading.py), every rank checks the recorded size of every file,
and each file's sha256 is computed by one rank (files striped over the ranks) before any tensor is
used; the ranks' agreement makes a mismatch fail all of them. Every rank reads a slice of every
file at every stage, so "each rank hashes the files it reads" would hash the whole checkpoint on
every rank; striping hashes it once in all, which is the same check on a shared filesystem.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tnlg.modeling.loading import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    STRICT,
    CheckpointFileError,
    open_safetensors,
    read_index,
    verify_checksums,
)

from .checkpoint import CheckpointError, read_on_every_rank
from .engine_state import ShardedModel

if TYPE_CHECKING:
    from tnlg.modeling.tensor_parallel import TensorSlice

logger = logging.getLogger(__name__)

INDEX_FILE = SAFE_WEIGHTS_INDEX_NAME
SINGLE_FILE = SAFE_WEIGHTS_NAME
SOURCE_ATTRIBUTE = "zero_pretrained_source"  # set on a meta model by meta_from_pretrained


@dataclass(frozen=True)
class PretrainedSource:
    """Where a meta model's weights come from, whether every tensor must match (`strict`), and
    whether the files are checked against their recorded sha256 (`verify_checksums`)."""

    path: str
    strict: bool = True
    verify_checksums: bool | str = True  # True, False or "strict" ([Note: checksums])


def meta_from_pretrained(
    model_class: type,
    path: str | Path,
    *,
    strict: bool = True,
    verify_checksums: bool | str = True,
    **config_overrides: Any,
):
    """`model_class` (a Transformers model class) built on the meta device from `path`'s config.json,
    remembering `path`: the ZeRO engine (`initialize`, `ZeroAccelerator.prepare`, `ZeroTrainer`) then
    fills each rank's shards from the checkpoint's safetensors, reading only its slices."""
    if Path(path).is_dir() and not (Path(path) / "config.json").is_file():
        # Transformers would build a default config, and the load then fail on every tensor's shape.
        raise FileNotFoundError(
            f"{path} has no config.json: a saved model directory needs the config next to its weights "
            "(save_pretrained writes both)"
        )
    config = model_class.config_class.from_pretrained(path, **config_overrides)
    with torch.device("meta"):
        model = model_class(config)
    return set_pretrained_source(model, path, strict=strict, verify_checksums=verify_checksums)


def set_pretrained_source(
    model: nn.Module, path: str | Path, *, strict: bool = True, verify_checksums: bool | str = True
) -> nn.Module:
    """Record on a meta-device `model` that its weights come from `path` (see `meta_from_pretrained`)."""
    if not any(p.is_meta for p in model.parameters()):
        raise ValueError(
            "set_pretrained_source takes a model built on the meta device; this one holds weights"
        )
    setattr(model, SOURCE_ATTRIBUTE, PretrainedSource(str(path), strict, verify_checksums))
    return model


class SafetensorsCheckpoint:
    """The tensors of a Transformers checkpoint (a directory with `model.safetensors` or shards and
    their index, or one `.safetensors` file), by name, read in slices. `bytes_read` counts what
    was asked for.

    Opening checks every file's header and, with `verify` and a checksum record in the directory,
    every file's size and the sha256 of this reader's `share` (rank, world) of the files: rank,
    rank + world, ... . A file that fails is a `CheckpointError` naming it."""

    def __init__(self, path: str | Path, *, verify: bool | str = True, share: tuple[int, int] = (0, 1)):
        self.path = Path(path)
        self.directory = self.path if self.path.is_dir() else self.path.parent
        index = self._index()  # None: one file holds every tensor
        self.files = sorted(set(index.values())) if index is not None else [self._single_file()]
        self.weight_map: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for file in self.files:  # one pass over the headers: names, shapes and dtypes together
            with self._open(file) as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if index is None or index.get(name) == file:
                        view = reader.get_slice(name)
                        self.weight_map[name] = file
                        self.shapes[name], self.dtypes[name] = tuple(view.get_shape()), view.get_dtype()
        absent = sorted(set(index or ()) - set(self.shapes))
        if absent:
            raise CheckpointError(f"{self.path}: the index lists tensors its files do not hold: {absent[:5]}")
        self.verified = False  # whether a checksum record was checked
        if verify:
            rank, world = share
            with _named_file_errors():
                self.verified = verify_checksums(
                    self.directory, self.files, self.files[rank::world], strict=verify == STRICT
                )
        self.bytes_read = 0
        self._current: tuple[str, Any] | None = None

    def _index(self) -> dict[str, str] | None:
        if self.path.is_file() or not (self.path / INDEX_FILE).is_file():
            return None
        with _named_file_errors():
            return read_index(self.path / INDEX_FILE)

    def _single_file(self) -> str:
        if self.path.is_file():
            return self.path.name
        if (self.path / SINGLE_FILE).is_file():
            return SINGLE_FILE
        if not self.path.exists():
            raise CheckpointError(f"no checkpoint at {self.path}")
        raise CheckpointError(
            f"{self.path} holds no {SINGLE_FILE} or {INDEX_FILE}: sharded loading reads safetensors only "
            "(convert .bin pickles with save_pretrained(safe_serialization=True) first)"
        )

    def _open(self, file: str):
        with _named_file_errors():
            return open_safetensors(self.directory / file)

    def _reader(self, name: str):
        file = self.weight_map[name]
        if self._current is None or self._current[0] != file:
            self.close()
            self._current = (file, self._open(file).__enter__())
        return self._current[1]

    def close(self) -> None:
        """Unmap the open file: its touched pages stop counting in this process's memory."""
        if self._current is not None:
            self._current[1].__exit__(None, None, None)
            self._current = None

    def read(self, name: str) -> torch.Tensor:
        tensor = self._reader(name).get_tensor(name)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def read_flat(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor, reading only the rows that cover them."""
        shape = self.shapes[name]
        if not shape:  # a scalar cannot be sliced
            return self.read(name).reshape(-1)[start:end]
        row = math.prod(shape[1:])
        first, last = start // row, -(-end // row)
        rows = self._reader(name).get_slice(name)[first:last]
        self.bytes_read += rows.numel() * rows.element_size()
        return rows.reshape(-1)[start - first * row : end - first * row]

    def read_slice_flat(
        self, name: str, cut: TensorSlice, local_shape: tuple[int, ...], start: int, end: int
    ):
        """Elements [start, end) of this tensor rank's slice `cut` (of shape `local_shape`) of the saved
        whole tensor, flattened, reading only the rows that cover them (and, for a cut across columns,
        only this rank's columns of those rows)."""
        row = math.prod(local_shape[1:])
        first, last = start // row, -(-end // row)
        view = self._reader(name).get_slice(name)
        if cut.dim == 1:  # row-parallel: the same rows, this rank's run of columns
            columns = local_shape[1]
            rows = view[first:last, cut.rank * columns : (cut.rank + 1) * columns]
        else:  # this rank's rows of each of the `parts` blocks ([q; k; v]), each block cut alike
            per_part = local_shape[0] // cut.parts
            pieces, index = [], first
            while index < last:
                part, within = divmod(index, per_part)
                stop = min(last, (part + 1) * per_part)
                saved = part * per_part * cut.degree + cut.rank * per_part + within
                pieces.append(view[saved : saved + stop - index])
                index = stop
            rows = torch.cat(pieces)
        self.bytes_read += rows.numel() * rows.element_size()
        return rows.reshape(-1)[start - first * row : end - first * row]


@contextlib.contextmanager
def _named_file_errors() -> Iterator[None]:
    """A file error as the engine's `CheckpointError`, the type its ranks agree on (`read_on_every_rank`)."""
    try:
        yield
    except CheckpointFileError as error:
        raise CheckpointError(str(error)) from error


# ---------------------------------------------------------------------------------------------- matching
@dataclass
class _Match:
    """Which checkpoint tensors hold each of the model's tensors, and what does not fit."""

    tensors: dict[str, torch.Tensor]  # the model's first name for each tensor -> the tensor
    keys: dict[str, list[str]]  # that name -> its checkpoint names (several: tied aliases all saved)
    missing: list[str]
    unexpected: list[str]
    mis_shaped: list[str]

    def problems(self, strict: bool) -> list[str]:
        found = [("different shape", self.mis_shaped)]
        if strict:
            found += [("missing", self.missing), ("unexpected", self.unexpected)]
        return [f"{label}: {_listed(names)}" for label, names in found if names]


def _listed(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")


def _candidates(name: str, prefix: str) -> list[str]:
    if not prefix:
        return [name]
    if name.startswith(prefix + "."):
        return [name, name[len(prefix) + 1 :]]  # a base-model checkpoint loaded into a model with a head
    return [name, f"{prefix}.{name}"]  # a checkpoint with a head loaded into the base model


def _match(module: nn.Module, checkpoint: SafetensorsCheckpoint, slices: Mapping[str, TensorSlice]) -> _Match:
    prefix = getattr(module, "base_model_prefix", "") or ""
    available = set(checkpoint.shapes)
    parameter_names = {id(p): name for name, p in module.named_parameters()}
    names: dict[int, list[str]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
        tensors.setdefault(names[id(tensor)][0], tensor)
    keys: dict[str, list[str]] = {}
    missing, mis_shaped, used = [], [], set()
    for aliases in names.values():
        first = aliases[0]
        found = list(dict.fromkeys(k for a in aliases for k in _candidates(a, prefix) if k in available))
        used.update(found)
        shape = tuple(tensors[first].shape)
        cut = slices.get(parameter_names.get(id(tensors[first]), ""))
        if cut is not None:  # saved whole: compare with the whole shape this rank holds a slice of
            shape = tuple(cut.full_shape(shape))
        bad = [k for k in found if checkpoint.shapes[k] != shape]
        mis_shaped += [f"{k}: saved {list(checkpoint.shapes[k])}, model {list(shape)}" for k in bad]
        if not found:
            missing.append(first)
        elif not bad:
            keys[first] = found
    unexpected = sorted(available - used)
    # A pipeline stage holds some layers only: the tensors of the modules other stages hold are theirs.
    elsewhere = [m.dropped_name + "." for m in module.modules() if getattr(m, "held_by_other_stage", False)]
    if elsewhere:
        unexpected = [
            k for k in unexpected if not any(c.startswith(tuple(elsewhere)) for c in _candidates(k, prefix))
        ]
    if prefix and not hasattr(module, prefix):
        # The base model loading a checkpoint of a model with a head: the head is not part of it.
        unexpected = [k for k in unexpected if k.startswith(prefix + ".")]
    return _Match(tensors, keys, sorted(missing), unexpected, sorted(mis_shaped))


# ---------------------------------------------------------------------------------------------- loading
@dataclass(frozen=True)
class PretrainedLoad:
    # ids of the tensors the checkpoint lacks: parameters (strict=False) and meta buffers (the
    # non-persistent ones are never saved); the engine's initialization gives them their values
    uninitialized: frozenset[int]
    bytes_read: int  # by this rank


def load_pretrained(
    engine: ShardedModel,
    source: PretrainedSource,
    device: torch.device,
    slices: Mapping[str, TensorSlice] | None = None,
) -> PretrainedLoad:
    """Fill a meta model's engine buffers from a safetensors checkpoint (see [Note: pretrained shards]).
    Under tensor slicing `slices` ({parameter name: TensorSlice}) says which slice of each saved whole
    tensor this rank holds: it reads the part of its slice it owns.

    Called by the engine after its groups are allocated and before `finish`; the parameters it
    reports uninitialized are the engine's to initialise. Collective only at the end, where the
    ranks agree that every read succeeded."""

    collectives = engine.collectives

    def read() -> tuple[SafetensorsCheckpoint, tuple[dict[int, str], dict[int, str]]]:
        share = (collectives.rank, collectives.world_size)
        checkpoint = SafetensorsCheckpoint(source.path, verify=source.verify_checksums, share=share)
        try:
            return checkpoint, _read_into(engine, checkpoint, source, device, slices or {})
        finally:
            checkpoint.close()

    checkpoint, (uninitialized, buffers) = read_on_every_rank(collectives, read)
    if uninitialized:
        logger.warning(
            "%s: %d parameters are not in the checkpoint and get the seeded initialization: %s",
            source.path, len(uninitialized), _listed(sorted(uninitialized.values())),
        )  # fmt: skip
    logger.info("%s: rank %d read %.1f MB", source.path, collectives.rank, checkpoint.bytes_read / 2**20)
    return PretrainedLoad(frozenset(uninitialized) | frozenset(buffers), checkpoint.bytes_read)


def _read_into(
    engine: ShardedModel,
    checkpoint: SafetensorsCheckpoint,
    source: PretrainedSource,
    device: torch.device,
    slices: Mapping[str, TensorSlice],
) -> tuple[dict[int, str], dict[int, str]]:
    """Read every matched tensor this rank needs; returns the parameters and the buffers left to
    initialise (each id -> name)."""
    match = _match(engine.module, checkpoint, slices)
    problems = match.problems(source.strict)
    if problems:
        raise CheckpointError(
            f"{source.path} does not fit the model; " + "; ".join(problems)
            + (" (strict=False initialises missing parameters and ignores unused tensors)" if source.strict else "")
        )  # fmt: skip
    if match.unexpected:
        logger.warning(
            "%s: tensors the model does not use are ignored: %s", source.path, _listed(match.unexpected)
        )
    slots = {id(p): (group, i) for group in engine.groups for i, p in enumerate(group.params)}
    uninitialized: dict[int, str] = {}
    order = sorted(  # file by file, so that each file is opened once
        match.tensors,
        key=lambda name: checkpoint.weight_map[match.keys[name][0]] if name in match.keys else "",
    )
    for name in order:
        tensor = match.tensors[name]
        if name not in match.keys:
            if isinstance(tensor, nn.Parameter) and tensor.is_meta:
                uninitialized[id(tensor)] = name
            continue
        key, *others = match.keys[name]
        _check_floating(checkpoint, key, tensor)
        if id(tensor) not in slots:  # a frozen parameter or a buffer: every rank keeps it whole
            _load_whole(checkpoint, name, key, others, tensor, device, slices.get(name))
            continue
        group, index = slots[id(tensor)]
        read = _flat_reader(checkpoint, slices.get(name), tuple(tensor.shape))
        start, end = 0, tensor.numel()  # kept whole: all of it (of this rank's slice)
        if not group.keeps_full(index):
            owned = group.layout.owned_range(group.layout.slots[index], group.shard_rank)
            if owned is None:
                continue
            start, end, _ = owned
        part = read(key, start, end)
        _check_aliases_agree(checkpoint, read, name, key, others, part, start)
        if group.keeps_full(index):
            group.load_slot(index, part.reshape(tensor.shape).to(device))
        else:
            group.load_owned(index, part.to(device))
    # Meta buffers the checkpoint does not hold: the non-persistent ones (state_dict, hence the
    # checkpoint, leaves them out, e.g. rotary inv_freq) and, with strict=False, missing ones.
    # from_pretrained moves them off meta and runs the model's initialization on them; so does the
    # engine (materialize, which refuses by name a buffer that no rule writes).
    buffers = {id(b): n for n, b in engine.module.named_buffers() if b.is_meta}
    return uninitialized, buffers


def _check_floating(checkpoint: SafetensorsCheckpoint, key: str, tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() and not checkpoint.dtypes[key].startswith(("F", "BF")):
        raise CheckpointError(
            f"{checkpoint.path}: {key} is saved as {checkpoint.dtypes[key]}, the model's is floating point"
        )


def _load_whole(
    checkpoint: SafetensorsCheckpoint,
    name: str,
    key: str,
    others: list[str],
    tensor: torch.Tensor,
    device: torch.device,
    cut: TensorSlice | None,
) -> None:
    """A frozen parameter or a buffer, which the engine does not shard: read whole into place (this
    rank's slice of it, if tensor slicing cut it)."""
    value = checkpoint.read(key).to(device=device, dtype=tensor.dtype)
    _check_aliases_agree(checkpoint, checkpoint.read_flat, name, key, others, value.reshape(-1))
    if cut is not None:
        value = cut.local(value)
    if isinstance(tensor, nn.Parameter):
        torch.utils.swap_tensors(tensor, nn.Parameter(value, requires_grad=tensor.requires_grad))
    elif tensor.is_meta:
        raise CheckpointError(f"{name} is a meta-device buffer: sharded loading cannot place it")
    else:
        with torch.no_grad():
            tensor.copy_(value)


def _flat_reader(checkpoint: SafetensorsCheckpoint, cut: TensorSlice | None, local_shape: tuple[int, ...]):
    """read(key, start, end): elements [start, end) of the flattened tensor this rank holds of `key`:
    the saved tensor itself, or its slice `cut` under tensor slicing."""
    if cut is None:
        return checkpoint.read_flat
    return lambda key, start, end: checkpoint.read_slice_flat(key, cut, local_shape, start, end)


def _check_aliases_agree(
    checkpoint: SafetensorsCheckpoint,
    read,
    name: str,
    key: str,
    others: list[str],
    part: torch.Tensor,
    start: int = 0,
) -> None:
    """A tied tensor saved under two names must hold the same values (else the checkpoint came
    from an untied model, and tying would silently change it). Each rank compares its own part,
    elements [start, start + len(part)) as `read` reads them."""
    for other in others:
        if not torch.equal(read(other, start, start + part.numel()).to(part.dtype), part.cpu()):
            raise CheckpointError(
                f"{checkpoint.path}: {other} differs from {key}, but the model ties {name} to both; load it "
                "into a model with tie_word_embeddings=False"
            )
