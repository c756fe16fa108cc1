"""Sharded engine checkpoints that load at any world size, stage, tensor-slicing degree and pipeline layout.

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

[Note: sliced checkpoints]
With tensor slicing every tensor rank holds different slices under the same parameter names, so each tensor rank's data group writes a complete checkpoint of its LOCAL
slices, in the layout above, into a sub-checkpoint of its own, and global rank 0 writes the top
manifest last (the commit point: it is removed when a save begins, so a crash leaves none):

    DIR/manifest.json          by global rank 0, last: world_size (global), stage, step, loss scaler,
                               param_groups as above; "layout" {"tensor": T, "pipeline": P, "data": D};
                               "parts" [{"directory", "pipeline_stage", "tensor_rank", "stages",
                               "sha256" of its manifest}], one per (pipeline rank, tensor rank);
                               "slices" {name: {"dim", "parts" (3 for a fused [q; k; v]), "shape" (the
                               full shape)}} for every sliced parameter; "unmanaged" (every part's frozen
                               parameters and buffers)
    DIR/config.json            the model's config (for consolidation)
    DIR/tensor-00/             tensor rank 0's sub-checkpoint: manifest.json (world_size = D) and
                               rank-0000d.safetensors, exactly the format of whole parameters
    DIR/tensor-01/ ...         (with pipeline stages: `pipeline-0p-tensor-0t/`, see below; readers
                               follow the directory the manifest names for each part)

A checkpoint without slicing keeps the format of whole parameters (no "parts"), and is read as one part
of tensor degree 1. Loading at any layout (`SavedCheckpoint.read`): each flat range of a parameter a
rank owns in its own slice maps to runs of the full tensor, then to (saved tensor rank, position in
its slice) (see [Note: slice runs] in slice_runs.py), then to that part's data-rank segments as
above: every rank reads only (about) what it holds. Replicated parameters come from tensor rank 0's
part; Adam's moments follow the master, its step comes from the part holding the param group's first
parameter. Every manifest is read and
checked (each part's sha256, its parameters' local shapes against the full shapes and slices) on
every rank before anything is restored, and the ranks of the whole world agree on any error.

[Note: pipeline checkpoints]
Under pipeline stages each pipeline rank holds its stages' parameters under the whole model's names
(see [Note: pipeline split] in tnlg/modeling/pipeline.py), so a part is one (pipeline rank, tensor
rank)'s data group's sub-checkpoint of what it holds, in `pipeline-0p-tensor-0t/` ("pipeline_stage" is
the pipeline rank, "stages" the model's stages it holds: several with interleaved schedules); the top
manifest is the one above with "layout" {"tensor": T, "pipeline": P, "data": D} and P x T parts. A
parameter several stages hold (the tied `model.embed_tokens.weight`, the first and the last stage's,
equal on both) is saved once, by the first stage holding it: the others leave its flat unit (a unit of
its own, `plan_sharding(own_units=)`) out of their rank files and manifests, closing up the other units'
shard offsets. A reader therefore finds each parameter, for each saved tensor rank, in exactly one part
(`SavedCheckpoint.holder`), whatever stage held it; a loading rank reads only the parameters its own
stages hold, by name, from wherever they were saved, and loads the tied embedding on every stage that
holds it. Layers move between stages when the layout changes, and a checkpoint saved with stages loads
without them (and the other way) with no conversion. The check of names runs against the whole model:
a saved parameter no live stage holds is "unexpected" (the stages' names are gathered first), one this
rank holds but no part saved is "missing". Without stages the format is unchanged (`tensor-0t/`, or no
parts at all without slicing).

The reading half (manifests and their checks, `ShardReader`, `SavedCheckpoint`) is checkpoint_files.py;
its names are re-exported here. The engine is reached through `EngineState` (engine_state.py): this module does not import the engine,
which imports it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import save_file

from tnlg.modeling.loading import sha256_of

from .checkpoint_files import (
    FORMAT_VERSION,
    MANIFEST,
    UNMANAGED_PREFIX,
    CheckpointError,
    RankFailedError,
    SavedCheckpoint,
    SavedParam,
    ShardReader,
    is_sliced,
    rank_file,
    read_manifest,
    read_on_every_rank,
    saved_params,
    tnlg_version,
)
from .checkpoint_storage import check_directory_shared, check_manifest_shared, write_on_every_rank
from .collectives import Collectives
from .engine_state import EngineState
from .json_files import write_json_atomic
from .partition import Unit
from .slice_runs import Cut

__all__ = [  # the checkpoint names callers import from here, wherever they are defined
    "ENGINE_DIRECTORY",
    "FORMAT_VERSION",
    "MANIFEST",
    "UNMANAGED_PREFIX",
    "CheckpointError",
    "RankFailedError",
    "SavedCheckpoint",
    "SavedParam",
    "ShardReader",
    "TensorLayout",
    "check_same_optimizer",
    "check_same_parameters",
    "engine_directory",
    "is_sliced",
    "load_engine",
    "rank_file",
    "read_manifest",
    "read_on_every_rank",
    "save_engine",
    "saved_hyperparameters",
    "saved_params",
    "scalar_state_device",
    "tensor_layout",
    "tnlg_version",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")
ENGINE_DIRECTORY = "engine"  # the engine checkpoint's name inside every checkpoint directory
# ZeroTrainer's name for it before the layouts were made one: refused with the rename, never ignored.
OLD_TRAINER_DIRECTORY = "zero"


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


# ---------------------------------------------------------------------------------------------- saving
def group_manifest(engine: EngineState, skip: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """Each param group's flat layout as saved: without the units of the parameters in `skip`, the
    others' shard offsets closed up to match `_kept_pieces`."""
    groups = []
    for group in engine.groups:
        layout = group.layout
        kept = _saved_units(layout, skip)
        units = layout.units if kept is None else kept
        number = {unit.index: position for position, unit in enumerate(units)}
        offsets = [sum(u.piece for u in units[:position]) for position in range(len(units))]
        groups.append(
            {
                "num_shards": layout.num_shards,
                "shard_numel": layout.shard_numel if kept is None else sum(u.piece for u in units),
                "params": [
                    {"name": s.name, "shape": list(s.shape), "unit": number[s.unit], "offset": s.offset}
                    for s in layout.slots
                    if s.unit in number
                ],
                "units": [
                    {
                        "numel": u.numel,
                        "piece": u.piece,
                        "shard_offset": u.shard_offset if kept is None else offsets[position],
                    }
                    for position, u in enumerate(units)
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


@dataclass(frozen=True)
class TensorLayout:
    """How a saving or loading engine is cut by tensor slicing and pipeline stages (see [Note: sliced
    checkpoints] and [Note: pipeline checkpoints]): its tensor degree and rank, the cut of every sliced
    parameter by name, its pipeline rank, degree and stages, the parameters it holds but another
    pipeline rank saves (the tied embedding on the last stage), and the collectives of the whole world
    (the engine's own are its data group's)."""

    degree: int
    rank: int
    cuts: dict[str, Cut]
    world: Collectives
    pipeline_stage: int = 0  # the pipeline rank: its coordinate in the mesh
    pipeline_degree: int = 1
    stages: tuple[int, ...] = (0,)  # the model's stages it holds (several with interleaved schedules)
    saved_elsewhere: frozenset[str] = frozenset()

    @property
    def part(self) -> str:
        """This rank's sub-checkpoint directory: `tensor-0t`, or `pipeline-0p-tensor-0t` with stages."""
        if self.pipeline_degree == 1:
            return f"tensor-{self.rank:02d}"
        return f"pipeline-{self.pipeline_stage:02d}-tensor-{self.rank:02d}"


def tensor_layout(parallel: Any, tensor_slices: dict[str, Any], pipeline: Any = None) -> TensorLayout | None:
    """The engine's `TensorLayout` from its `ParallelGroups`, {name: TensorSlice} and `PipelineRunner`
    (None without stages); None with neither slicing nor stages."""
    if parallel is None or not (tensor_slices or pipeline is not None):
        return None
    stages, saved_elsewhere = (0,), frozenset()
    if pipeline is not None:
        split = pipeline.split
        stages = tuple(split.stage_indices)
        # A parameter several stages hold is saved by the first of them (see [Note: pipeline checkpoints]).
        saved_elsewhere = frozenset(name for name, held in split.shared.items() if min(held) not in stages)
    return TensorLayout(
        degree=parallel.dims.tensor,
        rank=parallel.rank("tensor"),
        cuts={name: Cut(s.dim, s.parts) for name, s in tensor_slices.items()},
        world=Collectives(),
        pipeline_stage=parallel.rank("pipeline"),
        pipeline_degree=parallel.dims.pipeline,
        stages=stages,
        saved_elsewhere=saved_elsewhere,
    )


def agreeing_ranks(engine: EngineState, tensor: TensorLayout | None) -> Collectives:
    """The ranks that agree on a checkpoint's every write and read: the world with tensor slicing or
    stages (each part's data group writes only its part), else the engine's data group."""
    return tensor.world if tensor is not None else engine.collectives


def save_engine(engine: EngineState, directory: str | Path, tensor: TensorLayout | None = None) -> None:
    """Every rank writes its shard into `directory`; rank 0 writes the manifest last. Collective (over the
    world with `tensor` slicing or stages: each (pipeline rank, tensor rank)'s data group writes its
    sub-checkpoint)."""
    directory = Path(directory)
    if tensor is None:
        _save_part(engine, directory, top=True)
        return
    world = tensor.world
    _make_directory(world, directory, top=True, maker=world.rank == 0)
    sha256 = _save_part(engine, directory / tensor.part, top=False, skip=tensor.saved_elsewhere, agree=world)
    part = None
    if sha256 is not None:  # data rank 0 of each part: what the top manifest records of it
        part = {
            "directory": tensor.part,
            "pipeline_stage": tensor.pipeline_stage,
            "tensor_rank": tensor.rank,
            "stages": list(tensor.stages),
            "sha256": sha256,
            "slices": _full_slice_shapes(engine, tensor),
            "unmanaged": sorted(_unmanaged_state(engine)),
        }
    parts = world.all_gather_object(part)
    write_on_every_rank(world, directory, lambda: _write_top_manifest(engine, directory, tensor, parts))
    check_manifest_shared(world, directory / MANIFEST)


def _write_top_manifest(engine: EngineState, directory: Path, tensor: TensorLayout, parts: list) -> None:
    """World rank 0 writes the top manifest of a sliced or staged checkpoint (the others nothing)."""
    world = tensor.world
    if world.rank == 0:
        part_manifests = sorted(
            (p for p in parts if p is not None), key=lambda p: (p["pipeline_stage"], p["tensor_rank"])
        )
        shapes: dict[str, Any] = {}
        unmanaged: dict[str, None] = {}  # ordered: stage by stage
        for entry in part_manifests:
            shapes.update(entry.pop("slices"))
            unmanaged.update(dict.fromkeys(entry.pop("unmanaged")))
        _write_model_config(engine, directory)
        manifest = {
            **_manifest_head(engine, world.world_size),
            "layout": {
                "tensor": tensor.degree,
                "pipeline": tensor.pipeline_degree,
                "data": engine.collectives.world_size,
            },
            "parts": part_manifests,
            "slices": shapes,
            "unmanaged": list(unmanaged),
        }
        write_json_atomic(directory / MANIFEST, manifest, indent=2, default=str)


def _full_slice_shapes(engine: EngineState, tensor: TensorLayout) -> dict[str, dict[str, Any]]:
    """{name: {"dim", "parts", "shape" (the full shape)}} of every sliced parameter this rank holds."""
    local_shapes = {slot.name: slot.shape for group in engine.groups for slot in group.layout.slots}
    shapes = {}
    for name, cut in tensor.cuts.items():
        local = local_shapes.get(name)
        if local is None:  # a frozen sliced parameter: the module holds it
            local = tuple(engine.module.get_parameter(name).shape)
        full = list(local)
        full[cut.dim] *= tensor.degree
        shapes[name] = {"dim": cut.dim, "parts": cut.parts, "shape": full}
    return shapes


def _manifest_head(engine: EngineState, world_size: int) -> dict[str, Any]:
    """What every manifest starts with: versions, the world that wrote it, the engine's state (stage,
    mixed precision, global steps, loss scaler) and the optimizer's param-group hyperparameters."""
    optimizer = engine.base_optimizer
    return {
        "format_version": FORMAT_VERSION,
        "tnlg_version": tnlg_version(),
        "world_size": world_size,
        **engine.checkpoint_state(),
        "optimizer": type(optimizer).__name__,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
    }


def _write_model_config(engine: EngineState, directory: Path) -> None:
    """The model's Transformers config.json, for consolidation, when it has one."""
    config = getattr(engine.module, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        (directory / "config.json").write_text(config.to_json_string())


def _save_part(
    engine: EngineState,
    directory: Path,
    top: bool,
    skip: frozenset[str] = frozenset(),
    agree: Collectives | None = None,
) -> str | None:
    """The engine's data group writes a checkpoint of its shards in `directory`, its rank 0 the manifest
    last; `top` False: a sub-checkpoint (no config.json); `skip`: parameters another part saves, left
    out with their units (see [Note: pipeline checkpoints]). Returns, on data rank 0 of a
    sub-checkpoint, its manifest's sha256 (which the top manifest records). Every step is agreed over
    `agree` (the engine's data group by default; the world for a sub-checkpoint, whose save all parts
    share): see [Note: shared checkpoint storage] in checkpoint_storage.py."""
    collectives = engine.collectives
    agree = agree if agree is not None else collectives
    rank = collectives.rank
    _make_directory(agree, directory, top, maker=rank == 0)
    tensors: dict[str, torch.Tensor] = {}
    optimizer = engine.base_optimizer
    for index, group in enumerate(engine.groups):
        kept = _saved_units(group.layout, skip)
        tensors[f"group{index}.master"] = _kept_pieces(group.master, kept)
        for key, value in optimizer.state.get(group.master, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() == 0:  # per-group scalars: Adam's step
                tensors[f"group{index}.scalar.{key}"] = value.reshape(1)
            elif isinstance(value, torch.Tensor):  # per-element state, laid out like the master shard
                tensors[f"group{index}.state.{key}"] = _kept_pieces(value, kept)
    if rank == 0:
        for name, tensor in _unmanaged_state(engine).items():
            tensors[UNMANAGED_PREFIX + name] = tensor
    path = rank_file(directory, rank)

    def write_rank_file() -> dict[str, Any]:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, path)
        _fsync(path)
        return {path.name: {"sha256": sha256_of(path), "bytes": path.stat().st_size}}

    records = collectives.all_gather_object(write_on_every_rank(agree, directory, write_rank_file))

    def write_manifest() -> None:
        if rank != 0:
            return
        if top:
            _write_model_config(engine, directory)
        manifest = {
            **_manifest_head(engine, collectives.world_size),
            "groups": group_manifest(engine, skip),
            "unmanaged": sorted(_unmanaged_state(engine)),
            "files": {name: info for r in records for name, info in r.items()},
        }
        # The manifest appears only once every file is complete.
        write_json_atomic(directory / MANIFEST, manifest, indent=2, default=str)

    write_on_every_rank(agree, directory, write_manifest)
    if top:
        check_manifest_shared(agree, directory / MANIFEST)
        return None
    return sha256_of(directory / MANIFEST) if rank == 0 else None


def _make_directory(agree: Collectives, directory: Path, top: bool, maker: bool) -> None:
    """The rank that is `maker` makes `directory`, removing a top manifest there, and every
    rank of `agree` then sees it (see [Note: shared checkpoint storage]). Collective over `agree`."""

    def make() -> None:
        if not maker:
            return
        directory.mkdir(parents=True, exist_ok=True)
        if top:
            # The manifest is the commit point: an older one must not vouch for rank files being
            # rewritten (a crash mid-save then leaves no manifest, never a stale one). A sub-checkpoint's
            # is vouched for by the top manifest, which save_engine removed first.
            (directory / MANIFEST).unlink(missing_ok=True)

    write_on_every_rank(agree, directory, make)
    check_directory_shared(agree, directory)


def _saved_units(layout: Any, skip: frozenset[str]) -> list[Unit] | None:
    """The units of `layout` a part saves: all (None) unless some hold parameters in `skip`, which the
    layout gives units of their own (`plan_sharding(own_units=)`), so whole units are left out."""
    if not skip or not any(slot.name in skip for slot in layout.slots):
        return None
    kept = []
    for unit in layout.units:
        names = {layout.slots[i].name for i in unit.slots}
        if names & skip and names - skip:
            raise ValueError(
                f"{sorted(names & skip)} share a flat unit with {sorted(names - skip)}: a parameter another "
                "pipeline stage saves needs a unit of its own to be left out of this stage's checkpoint"
            )
        if not names & skip:
            kept.append(unit)
    return kept


def _kept_pieces(shard: torch.Tensor, kept: list[Unit] | None) -> torch.Tensor:
    """This rank's shard (master or a per-element state) holding the pieces of the `kept` units only,
    one after another (None: the whole shard)."""
    if kept is None:
        return shard
    if not kept:
        return shard.new_empty(0)
    return torch.cat([shard.narrow(0, unit.shard_offset, unit.piece) for unit in kept])


# ---------------------------------------------------------------------------------------------- loading
def load_engine(
    engine: EngineState, directory: str | Path, verify: bool = True, tensor: TensorLayout | None = None
) -> dict[str, Any]:
    """Restore this rank's shard (master weights, optimizer state), the step and the loss scale from a
    checkpoint saved at any world size, stage, tensor degree and pipeline layout (`tensor`: this
    engine's slicing and stages, None without). `verify` checks the sha256 of each file read.

    Every rank reads into new tensors first; only when all ranks (of the world, with slicing or stages)
    have read theirs without error is anything replaced, so a damaged checkpoint raises the same
    `CheckpointError` on every rank (no rank is left waiting in a collective) and leaves the engine as
    it was."""
    directory = Path(directory)
    agree = agreeing_ranks(engine, tensor)
    group_names = _model_group_names(engine, tensor)
    manifest, loaded, saved = read_on_every_rank(
        agree, lambda: _read_shard(engine, directory, verify, tensor, agree, group_names)
    )
    optimizer = engine.base_optimizer
    kept = []
    for group_index, (group, (master, state, hyperparameters)) in enumerate(
        zip(engine.groups, loaded, strict=True)
    ):
        group.master.copy_(master)
        # A checkpoint saved before the first step holds no state: the engine's own moments (and step
        # count) go too, or its next update would differ from a fresh engine's loading the same file.
        optimizer.state.pop(group.master, None)
        if state:
            optimizer.state[group.master] = state
        if hyperparameters is None:
            kept.append(group_index)
        else:
            optimizer.param_groups[group_index].update(hyperparameters)
        group.write_back()
    if kept and agree.rank == 0:
        logger.warning(
            "%s: param groups %s hold other parameters than any saved param group, so they keep their own "
            "hyperparameters (lr, weight_decay, ...) instead of the checkpoint's",
            directory,
            kept,
        )
    _load_unmanaged(engine, saved, tensor)
    engine.restore_checkpoint_state(manifest)
    return manifest


def _model_group_names(engine: EngineState, tensor: TensorLayout | None) -> list[set[str]]:
    """The trainable parameters of the whole model, per param group: this rank's, and under pipeline
    stages every stage's (gathered over the world, so that a checkpoint's parameters no stage holds are
    named, and a group is compared whole with a saved one). Collective with stages."""
    names = [{slot.name for slot in group.layout.slots} for group in engine.groups]
    if tensor is None or tensor.pipeline_degree == 1:
        return names
    stages = tensor.world.all_gather_object([sorted(group) for group in names])
    return [set().union(*(stage[index] for stage in stages)) for index in range(len(names))]


def _read_shard(
    engine: EngineState,
    directory: Path,
    verify: bool,
    tensor: TensorLayout | None,
    agree: Collectives,
    group_names: list[set[str]],
) -> tuple[dict[str, Any], list[tuple], SavedCheckpoint]:
    """This rank's (master, optimizer state, hyperparameters or None) per param group, read without
    communicating and without touching the engine."""
    # Opening checks sizes only: each file's sha256 is computed once, by one rank, below (every
    # rank hashing every file it reads from would hash rank 0's file on all of them).
    saved = SavedCheckpoint(directory, verify=False)
    manifest = saved.manifest
    check_same_optimizer(directory, manifest.get("optimizer"), engine.base_optimizer)
    model_names = set().union(*group_names)
    cuts = tensor.cuts if tensor is not None else {}
    degree, tensor_rank = (tensor.degree, tensor.rank) if tensor is not None else (1, 0)
    live = {slot.name: (group, slot) for group in engine.groups for slot in group.layout.slots}
    live_shapes = {}
    for name, (_, slot) in live.items():
        cut = cuts.get(name)
        live_shapes[name] = tuple(
            n * degree if cut is not None and d == cut.dim else n for d, n in enumerate(slot.shape)
        )
    check_same_parameters(directory, saved.shapes, live_shapes, model_names)
    for name in live:
        saved.cut(name, cuts.get(name))  # the same cut on both sides, where both cut it
    sources = _hyperparameter_sources(saved, group_names)
    loaded = [
        _read_group(engine, saved, index, group, cuts, degree, tensor_rank, sources[index])
        for index, group in enumerate(engine.groups)
    ]
    if verify:  # every saved file is hashed by one rank; read_on_every_rank makes any mismatch fail all
        files = saved.files()
        for part, rank in files[agree.rank :: agree.world_size]:
            saved.parts[part].reader.check_sha256(rank)
    return manifest, loaded, saved


def _read_group(
    engine: EngineState,
    saved: SavedCheckpoint,
    group_index: int,
    group: Any,
    cuts: dict[str, Cut],
    degree: int,
    tensor_rank: int,
    hyperparameter_source: int | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, Any] | None]:
    """One param group's (master, optimizer state, hyperparameters): this rank's shard of them, read
    from whichever saved parts hold its parameters; the hyperparameters of saved group
    `hyperparameter_source` (None: the live group keeps its own, see `_hyperparameter_sources`)."""
    optimizer = engine.base_optimizer
    live_group = optimizer.param_groups[group_index]
    param_groups = saved.manifest["param_groups"]
    hyperparameters = (
        saved_hyperparameters(param_groups[hyperparameter_source], live_group)
        if hyperparameter_source is not None
        else None
    )
    if not group.layout.slots:  # a param group empty on this pipeline stage: nothing to read
        return torch.zeros_like(group.master), {}, hyperparameters
    sources = {saved.holder(slot.name).params[slot.name].group for slot in group.layout.slots}
    if len(sources) != 1:
        raise CheckpointError(
            f"{saved.directory}: the parameters of param group {group_index} were in saved groups "
            f"{sorted(sources)}: the optimizer's param groups must hold the same parameters as when it was saved"
        )
    (source,) = sources
    # The optimizer's keys and scalars (Adam's step, the same on every part) from the part holding the
    # group's first parameter.
    first = saved.holder(group.layout.slots[0].name)
    prefix = f"group{source}."
    saved_keys = {k.removeprefix(prefix) for k in first.reader.keys(0) if k.startswith(prefix)}
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
        for key, target in targets.items():
            target[at : at + end - start].copy_(
                saved.read(slot.name, key, start, end, cuts.get(slot.name), degree, tensor_rank)
            )
    for key in sorted(k for k in saved_keys if k.startswith("scalar.")):
        name = key.removeprefix("scalar.")
        reference = optimizer.state.get(group.master, {}).get(name)
        device = reference.device if reference is not None else scalar_state_device(optimizer, group)
        state[name] = first.reader.tensor(0, prefix + key).reshape(()).to(device)
    return master, state, hyperparameters


def _hyperparameter_sources(saved: SavedCheckpoint, group_names: list[set[str]]) -> list[int | None]:
    """For each live param group, the saved param group holding exactly its parameters (over the whole
    model), whose hyperparameters it takes back; None where there is none (the groups were cut another
    way, e.g. weight decay split off): a saved group's lr or weight_decay would then overwrite a live
    group's set for other parameters, so the live group keeps its own."""
    saved_groups: list[set[str]] = [set() for _ in saved.manifest["param_groups"]]
    for name in saved.names:
        saved_groups[saved.holder(name).params[name].group].add(name)
    return [next((s for s, held in enumerate(saved_groups) if held == names), None) for names in group_names]


# Optimizers that keep the same state under the same keys (exp_avg, exp_avg_sq, step) and whose saved
# state therefore resumes in one another: torch's Adam and AdamW, the engine's CPUAdam, DeepSpeed's names.
ADAM_FAMILY = frozenset({"Adam", "AdamW", "CPUAdam", "FusedAdam", "DeepSpeedCPUAdam"})


def check_same_optimizer(directory: Path, saved: str | None, live: torch.optim.Optimizer) -> None:
    """Refuse a checkpoint whose optimizer keeps other state than `live` (an AdamW's moments in an SGD):
    its state would be loaded under keys the live step never reads, silently losing momentum."""
    name = type(live).__name__
    if saved is None or saved == name or {saved, name} <= ADAM_FAMILY:
        return
    raise CheckpointError(
        f"{directory} holds the optimizer state of {saved}, but the engine's optimizer is {name}: "
        f"build the engine with {saved} to resume, or start {name} from the weights alone "
        "(consolidate the checkpoint and load it with initialize(..., pretrained=PATH))"
    )


# Keys of a param group that say how torch's optimizer runs, not what it computes: the live engine's
# stand (a group saved with foreach on a GPU loads into an offloaded engine's optimizer); param_names
# are the user's parameters', which the engine's groups replaced by flat masters.
NOT_HYPERPARAMETERS = frozenset({"foreach", "fused", "capturable", "differentiable", "param_names"})


def saved_hyperparameters(saved: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """A saved param group's hyperparameters that the live group has (lr, betas, eps, weight_decay,
    amsgrad, maximize, momentum, ...: all of them, as torch's Optimizer.load_state_dict takes them
    back), each in the live group's type (JSON holds a tuple such as betas as a list)."""
    return {
        key: tuple(value) if isinstance(live[key], tuple) and isinstance(value, list) else value
        for key, value in saved.items()
        if key in live and key not in NOT_HYPERPARAMETERS
    }


def check_same_parameters(
    directory: Path,
    saved: dict[str, tuple[int, ...]],
    live: dict[str, tuple[int, ...]],
    model_names: set[str],
) -> None:
    """The same parameter names (`live`: this rank's, `model_names`: every pipeline stage's), and the
    same full shapes (whole tensors, whatever the slicing)."""
    missing = sorted(set(live) - set(saved))
    unexpected = sorted(set(saved) - set(live) - model_names)
    reshaped = sorted(
        f"{name}: saved {list(saved[name])}, model {list(shape)}"
        for name, shape in live.items()
        if name in saved and tuple(shape) != tuple(saved[name])
    )
    if missing or unexpected or reshaped:
        problems = []
        for label, names in (("missing", missing), ("unexpected", unexpected), ("different shape", reshaped)):
            if names:
                shown = ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")
                problems.append(f"{label}: {shown}")
        raise CheckpointError(f"{directory} holds a different model's parameters; " + "; ".join(problems))


def scalar_state_device(optimizer: torch.optim.Optimizer, group) -> torch.device:
    # torch keeps Adam's step on the CPU unless the optimizer is fused or capturable.
    fused = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    return group.master.device if fused else torch.device("cpu")


def _load_unmanaged(engine: EngineState, saved: SavedCheckpoint, tensor: TensorLayout | None) -> None:
    current = _unmanaged_state(engine)
    cuts = tensor.cuts if tensor is not None else {}
    degree, rank = (tensor.degree, tensor.rank) if tensor is not None else (1, 0)
    for name in saved.unmanaged:
        if name in current:
            with torch.no_grad():
                current[name].copy_(saved.unmanaged_tensor(name, cuts.get(name), degree, rank))


# ---------------------------------------------------------------------------------------------- helpers
def _fsync(path: Path) -> None:
    with open(path, "rb") as stream:
        os.fsync(stream.fileno())
