"""Run-level checkpoints: the engine's shards plus everything else a resumed run needs.

    ROOT/step-00000100/engine/          every rank's shard (tnlg.sharding.checkpoint)
    ROOT/step-00000100/rank-00000.json  this rank's step, data position and RNG states (tnlg.state_files)
    ROOT/step-00000100/scheduler.json   the learning-rate scheduler (tnlg.state_files)
    ROOT/step-00000100/config.json      the run config
    ROOT/step-00000100/loss_curve.json  the loss curve up to this step (a resumed run continues it)
    ROOT/latest                         the name of the newest complete checkpoint

A checkpoint is written into a hidden staging directory and renamed into place once every rank
has finished, then `latest` is replaced atomically: a crash mid-save leaves the previous
checkpoint complete and selected (a checkpoint replaced at the same step is renamed aside, not deleted,
until its successor is in place), and the next completed save tidies what it left (a partial staging
directory is removed, a checkpoint set aside and not replaced is renamed back). `keep_last`
checkpoints are kept: the one just written, then the newest of the steps before it; the steps after it, left by a run resumed from an earlier checkpoint,
belong to the abandoned timeline and go first. JSON and safetensors only.
The engine directory and the rank and scheduler files are laid out as in `ZeroAccelerator.save_state`
and `ZeroTrainer` checkpoints (tnlg.state_files).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from tnlg.run.metrics import LossCurve, flat_settings
from tnlg.sharding.checkpoint import (
    MANIFEST,
    CheckpointError,
    engine_directory,
    read_manifest,
    read_on_every_rank,
)
from tnlg.sharding.checkpoint_storage import write_on_every_rank
from tnlg.sharding.collectives import Collectives
from tnlg.sharding.deepspeed.zero_checkpoint import is_deepspeed_checkpoint
from tnlg.sharding.json_files import write_json, write_json_atomic
from tnlg.state_files import (
    rank_state_file,
    read_checkpoint_json,
    read_rank_state,
    read_scheduler_states,
    reseed_rng,
    restore_rng,
    write_rank_state,
    write_scheduler_states,
)

logger = logging.getLogger(__name__)
LATEST = "latest"
REPLACED = ".replaced"  # suffix of a checkpoint renamed aside while its successor at the same step moves in
STAGING = ".staging"  # suffix of the hidden directory a checkpoint is written into before it moves in
CURVE_FILE = "loss_curve.json"  # the run's curve up to the checkpoint's step


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `root/latest` names, or None when there is no pointer yet."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    pointed = read_checkpoint_json(pointer)
    name = pointed.get("checkpoint") if isinstance(pointed, dict) else None
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise CheckpointError(f'{pointer} does not name a checkpoint (expected {{"checkpoint": "step-N"}})')
    return _present_or_set_aside(root / name)


def _set_aside(checkpoint: Path) -> Path:
    return checkpoint.with_name(f".{checkpoint.name}{REPLACED}")


def _step_name(checkpoint: Path) -> str:
    """The step directory's name of `checkpoint`, also when it is the version set aside (`.step-N.replaced`)."""
    name = checkpoint.name
    return name[1 : -len(REPLACED)] if name.startswith(".") and name.endswith(REPLACED) else name


def _present_or_set_aside(checkpoint: Path) -> Path:
    """`checkpoint`, or its previous version set aside when a save at the same step stopped between the
    two renames of `RunCheckpointer._replace` (that version is complete; `latest` still names it)."""
    aside = _set_aside(checkpoint)
    if not checkpoint.exists() and aside.is_dir():
        logger.warning("%s is missing (a save stopped while replacing it): using %s", checkpoint, aside)
        return aside
    return checkpoint


def resolve_checkpoint(root: Path, which: str) -> Path:
    """`latest` (under `root`) or a checkpoint directory; there being none is an error naming where it
    looked."""
    if which == LATEST:
        path = latest_checkpoint(root)
        if path is None:
            raise CheckpointError(
                f"--resume latest: {root} holds no checkpoint ({root / LATEST} does not exist); "
                "start a new run without --resume"
            )
        return path
    path = Path(which)
    if not path.is_dir():
        raise CheckpointError(f"--resume {which}: no checkpoint directory at {path}")
    if not engine_directory(path).exists() and is_deepspeed_checkpoint(path):
        raise CheckpointError(
            f"--resume {which}: {path} is not a tnlg run checkpoint; it is a DeepSpeed checkpoint: --resume "
            "continues a tnlg run (its data position, RNG and loss curve with the engine's state); to start "
            "one from DeepSpeed's weights, convert them (scripts/convert_checkpoint.py --from deepspeed) and "
            "pass --model.init_from, or load it whole into an engine with engine.load_checkpoint "
            "(docs/checkpoints.md)"
        )
    return path


def find_engine_checkpoint(path: str | Path) -> Path:
    """The engine checkpoint in what a user points at: an engine directory, a directory holding one in
    `engine/` (a run's `step-N`, a `ZeroAccelerator.save_state` directory, a `ZeroTrainer`
    `checkpoint-N`), or a run's checkpoint root (its `latest`). A ZeroTrainer checkpoint of the old
    `zero/` layout is a CheckpointError saying to rename it (see `engine_directory`)."""
    path = Path(path)
    if is_deepspeed_checkpoint(path):  # before its `latest` (DeepSpeed's plain tag, not our JSON) is read
        raise FileNotFoundError(
            f"{path} holds no engine checkpoint; it is a DeepSpeed checkpoint: convert it with --from deepspeed"
        )
    path = latest_checkpoint(path) or path
    if (path / MANIFEST).is_file():
        return path
    engine = engine_directory(path)
    if (engine / MANIFEST).is_file():
        return engine
    raise FileNotFoundError(
        f"{path} holds no engine checkpoint (a {MANIFEST} here or in {engine.name}/, or a {LATEST} pointer)"
    )


# [Note: settings a resume may change]
# A checkpoint restores the model, the optimizer state with its param groups' hyperparameters
# (lr, betas, eps, weight decay, ...: sharding/checkpoint.py's saved_hyperparameters), the schedule and the data
# position; the new config gives everything else. So that no run is a silent mix of two configs, a
# resume refuses any setting that differs from the checkpoint's config.json, except the ones below:
# how the same computation is laid out and run (checkpoints load at any parallel layout, ZeRO stage,
# offload, world size, micro-batch split and precision), train.max_steps (extending a run is the usual
# reason to resume), and what is logged, evaluated and saved where.
RESUME_MAY_CHANGE = (
    "parallel.",
    "zero.",
    "train.micro_batch_size",
    "train.gradient_accumulation_steps",
    "train.mixed_precision",
    "train.max_steps",
    "train.eval_every",
    "train.eval_batches",
    "train.save_every",
    "train.keep_last",
    "train.output_dir",
    "train.peak_flops",
    "train.on_nonfinite_loss",
    "train.resume_fallback",
    "train.overwrite",
    "train.export_gpt2",
    "train.collective_timeout_minutes",
    "model.activation_checkpointing.",
    "model.compile.",
    "data.validation_sources",
    "data.validation_split",
    "data.validation_paths",
    "evaluation.",
    "logging.",
)
RESUME_MAY_NOT_CHANGE = ("zero.gradient_clipping",)  # an optimizer setting, though in the zero section


def _may_change(key: str) -> bool:
    if key.startswith(RESUME_MAY_NOT_CHANGE):
        return False
    return any(
        key == allowed or (allowed.endswith(".") and key.startswith(allowed)) for allowed in RESUME_MAY_CHANGE
    )


def changed_settings(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The settings a resume may not change that differ between `saved` and `current`, each as
    `key: saved -> current` (see [Note: settings a resume may change])."""
    # as config.json holds them (tuples as lists), so that only values compare
    old, new = flat_settings(saved), flat_settings(json.loads(json.dumps(current)))
    return [
        f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        for key in sorted(old.keys() | new.keys())
        if _compared(key, old, new) and old.get(key) != new.get(key) and not _may_change(key)
    ]


def _compared(key: str, old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether `key` is a setting both configs can hold: not one this release no longer has, nor one added
    since the checkpoint was written (its default is what the older run did), unless the older config
    held the mapping it belongs to, then empty (`model.overrides: {}`, now with a key)."""
    if key not in new:
        return False
    if key in old:
        return True
    parts = key.split(".")
    return any(".".join(parts[:end]) in old for end in range(1, len(parts)))


def resume_candidates(root: Path, named: Path, fallback: bool) -> list[Path]:
    """The checkpoints a resume may load, in the order it tries them: `named`, then with
    train.resume_fallback the older step directories under `root`, newest first."""
    if not fallback:
        return [named]
    step = _step_name(named)
    older = (path for path in root.glob("step-*") if path.is_dir() and path.name < step)
    return [named, *sorted(older, reverse=True)]


def check_resume_candidates(candidates: list[Path], config: dict[str, Any]) -> None:
    """Refuse to resume under a `config` that changes a setting the checkpoints fixed (see [Note: settings
    a resume may change]), for every one of `candidates` that is there, before anything is built: whichever
    the load ends on, the run is not a mix of two configs. A checkpoint without its run config is resumed
    with a warning. With several (a fallback), one whose config.json is damaged is left to the load,
    which skips it as it skips any damaged checkpoint."""
    for candidate in candidates:
        if not candidate.is_dir():
            continue
        try:
            _refuse_changed_settings(candidate, config)
        except CheckpointError as error:
            if len(candidates) == 1:
                raise
            logger.warning("%s (the fallback skips this checkpoint)", error)
    logger.info(
        "resuming: model, data and optimizer settings are the checkpoint's (unchanged); layout, batch split, "
        "precision, max_steps, logging, evaluation and saving follow this run's config"
    )


def _refuse_changed_settings(checkpoint: Path, config: dict[str, Any]) -> None:
    recorded = checkpoint / "config.json"
    if not recorded.is_file():
        logger.warning("%s records no run config: the resumed settings cannot be checked", checkpoint)
        return
    changed = changed_settings(read_checkpoint_json(recorded), config)
    if changed:
        raise ValueError(
            f"--resume {checkpoint}: the checkpoint was trained with other settings ({'; '.join(changed)}): "
            "resume with the checkpoint's values, or start a new run (a resume may change only the layout, "
            "ZeRO, batch split, precision, train.max_steps, and logging, evaluation and saving)"
        )


def _run_position(checkpoint: Path, rank: int) -> dict[str, Any]:
    """`rank`'s file of `checkpoint` (its RNG states checked by read_rank_state), with the step and data
    position a resume takes from it: checked while the ranks agree, not found by one rank alone later."""
    state = read_rank_state(checkpoint, rank)
    step = state.get("step")
    if (
        not isinstance(step, int)
        or isinstance(step, bool)
        or step < 0
        or not isinstance(state.get("data"), dict)
    ):
        raise CheckpointError(
            f'{rank_state_file(checkpoint, rank)} holds no run position (expected a "step" >= 0 and a "data" '
            "object): it was not written by a run checkpoint, or is damaged"
        )
    return state


class RunCheckpointer:
    def __init__(self, root: str | Path, keep_last: int, accelerator):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root, self.keep_last, self.accelerator = Path(root), keep_last, accelerator

    def save(self, step: int, engine, scheduler, data_state: dict, config: dict, curve: LossCurve) -> Path:
        """Collective: every rank writes its part; returns the checkpoint directory. Each step is agreed
        over the world, as the engine's own save is ([Note: shared checkpoint storage]): a write that fails
        on one rank (disk full, a directory it cannot see) raises a CheckpointError on every rank, naming
        it, rather than leaving the others waiting in the next collective. `latest` then still leads to
        the previous checkpoint: a failure before the rename leaves the new one out of place (its staging
        directory removed), one while `latest` is replaced leaves it in place, complete, and unnamed."""
        main = self.accelerator.is_main_process
        world = Collectives()
        name = f"step-{step:08d}"
        staging, final = self.root / f".{name}{STAGING}", self.root / name

        def make_staging() -> None:
            if main:
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)

        def write_run_state() -> None:
            write_rank_state(staging, self.accelerator.process_index, step=step, data=data_state)
            if main:
                write_scheduler_states(staging, [scheduler])
                write_json(staging / "config.json", config)
                write_json(staging / CURVE_FILE, curve.state_dict())  # a resumed run's curve starts with it

        try:
            write_on_every_rank(world, final, make_staging)
            engine.save_checkpoint(engine_directory(staging))  # collective; checks that every rank shares it
            write_on_every_rank(world, final, write_run_state)
            write_on_every_rank(world, final, lambda: self._replace(final, staging) if main else None)
        except Exception:  # every rank raises, agreed (see [Note: agreed failures])
            if main:  # a failed save's pieces would pile up beside the checkpoints on a disk that may be full
                shutil.rmtree(staging, ignore_errors=True)
            raise
        if main:
            self._tidy_stopped_saves()
            self._prune(final)
        return final

    def _replace(self, final: Path, staging: Path) -> None:
        """Move the complete `staging` into place as `final` and point `latest` at it. A previous `final`
        (a resumed run saving a step again) is renamed aside first and deleted last, so that a crash at
        any point leaves a complete checkpoint where `latest` leads (see `_present_or_set_aside`)."""
        aside = _set_aside(final)
        if final.exists():  # then an aside left by an earlier save that stopped is superseded by `final`
            shutil.rmtree(aside, ignore_errors=True)
            final.rename(aside)
        # else an aside left by a save that stopped between the renames is the copy `latest` leads to: it
        # stays until its successor is in place
        staging.rename(final)
        write_json_atomic(self.root / LATEST, {"checkpoint": final.name})
        shutil.rmtree(aside, ignore_errors=True)

    def resolve(self, which: str) -> Path:
        """`latest` or a checkpoint directory; there being none is an error naming where it looked."""
        return resolve_checkpoint(self.root, which)

    def load(self, which: str, engine, scheduler, fallback: bool = False) -> dict[str, Any]:
        """Restore `which` (`latest` or a directory); with `fallback`, a damaged `latest` gives way to the
        newest older checkpoint that loads (each failure is logged with its reason)."""
        agree = Collectives()

        def choose() -> list[Path]:
            return resume_candidates(self.root, self.resolve(which), fallback and which == LATEST)

        # A rank that finds none fails every rank; then every rank tries rank 0's list, in its order (a
        # rank listing the directory otherwise, a stale cache, would leave the fallback out of step).
        candidates = agree.all_gather_object(read_on_every_rank(agree, choose))[0]
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
        # Everything is read (and every rank of the world agrees it could be) before anything is restored:
        # a damaged file leaves the engine, the scheduler and the RNG untouched, and no rank waiting for
        # another (the world: under tensor slicing or stages the engine's data group is only part of it).
        agree = Collectives()
        saved_world, layout = read_on_every_rank(agree, lambda: self._saved_layout(path))
        own_rank, by_replica = self._data_state_rank(saved_world, layout)

        def read_run_state() -> tuple[dict, dict, LossCurve]:
            curve_file = path / CURVE_FILE
            if curve_file.exists():
                saved_curve = read_checkpoint_json(curve_file)
                try:
                    curve = LossCurve.from_state_dict(saved_curve)
                except ValueError as error:
                    raise CheckpointError(f"{curve_file}: {error}") from error
            else:  # saved before checkpoints carried the curve
                logger.warning("%s has no %s: the loss curve starts at the resumed step", path, CURVE_FILE)
                curve = LossCurve()
            (scheduler_state,) = read_scheduler_states(path, 1)
            if (path / "config.json").exists():  # what the resume's settings were checked against
                read_checkpoint_json(path / "config.json")
            return scheduler_state, _run_position(path, own_rank), curve

        scheduler_state, state, curve = read_on_every_rank(agree, read_run_state)
        engine.load_checkpoint(engine_directory(path))
        scheduler.load_state_dict(scheduler_state)
        if own_rank == rank and saved_world == world:
            restore_rng(state["rng"])
        else:
            reseed_rng(state["step"], rank)
            if rank == 0:
                data = "each data replica's position" if by_replica else "the global position"
                logger.warning(
                    "%s was saved by %d processes and resumes on %d: the model and optimizer are resharded, "
                    "the data continues from %s, and the RNG is seeded anew",
                    path, saved_world, world, data,
                )  # fmt: skip
        return {
            "step": state["step"],
            "data": state["data"],
            "path": path,
            "saved_world_size": saved_world,
            "curve": curve,
        }

    def _data_state_rank(self, saved_world: int, layout: dict[str, int]) -> tuple[int, bool]:
        """The saved rank whose data position (and, at the same layout, RNG) this rank takes back: its own
        at the saved layout; at another layout with as many data replicas, the saved rank of tensor rank 0
        and pipeline rank 0 in this data replica (the saved mesh is (pipeline, data, tensor), tensor
        innermost: data rank x the saved tensor degree), whose position is this replica's; else rank 0,
        which holds the global data position. Also whether the position is this data replica's own (not
        the global one)."""
        accelerator = self.accelerator
        dims = getattr(accelerator, "parallel_dims", None)
        data_rank = getattr(accelerator, "data_parallel_rank", accelerator.process_index)
        data_size = getattr(accelerator, "data_parallel_size", accelerator.num_processes)
        model_cut = (dims.tensor, dims.pipeline) if dims else (1, 1)
        if saved_world == accelerator.num_processes and (layout["tensor"], layout["pipeline"]) == model_cut:
            return accelerator.process_index, True
        if layout["data"] == data_size:
            return data_rank * layout["tensor"], True
        return 0, False

    @staticmethod
    def _saved_layout(path: Path) -> tuple[int, dict[str, int]]:
        """How many processes saved `path` and in what (tensor, pipeline, data) layout (the engine
        manifest's; data parallelism alone before tensor slicing); every one of them must have left its
        rank file, or a missing one would read as a smaller world (resuming every rank from rank 0's data
        position) or fail later with a message about the wrong file."""
        manifest = read_manifest(engine_directory(path))
        world = manifest["world_size"]
        layout = manifest.get("layout", {"tensor": 1, "pipeline": 1, "data": world})
        files = [rank_state_file(path, saved_rank) for saved_rank in range(world)]
        missing = [file.name for file in files if not file.is_file()]
        if missing:
            raise CheckpointError(
                f"{path / missing[0]} is missing: the checkpoint was saved by {world} processes and lacks "
                f"{', '.join(missing)}; it is incomplete"
            )
        return world, layout

    def _tidy_stopped_saves(self) -> None:
        """What saves stopped without an exception to clean up after (a killed process) left hidden beside
        the checkpoints, once `latest` names a new one: a staging directory, a partial checkpoint as large
        as a whole one, is removed; a checkpoint set aside between `_replace`'s renames is renamed back when
        nothing took its place (it is complete and the only copy of its step: keep_last then counts it)
        and removed when its successor did. Housekeeping: a failure is logged and the run goes on."""
        for staging in self.root.glob(f".step-*{STAGING}"):
            self._remove_left_over(staging, "a save that stopped while writing it")
        for aside in self.root.glob(f".step-*{REPLACED}"):
            original = self.root / _step_name(aside)
            if original.exists():
                self._remove_left_over(
                    aside, f"a save that stopped before deleting it ({original.name} replaced it)"
                )
                continue
            try:
                aside.rename(original)
            except OSError as error:
                logger.warning("could not rename %s back to %s (%s: %s)", aside, original, type(error).__name__,
                               error)  # fmt: skip
            else:
                logger.info("%s, set aside by a save that stopped, is back as %s", aside.name, original)

    @staticmethod
    def _remove_left_over(path: Path, why: str) -> None:
        try:
            shutil.rmtree(path)
        except OSError as error:
            logger.warning("could not remove %s, left by %s (%s: %s)", path, why, type(error).__name__, error)
        else:
            logger.warning("removed %s, left by %s", path, why)

    def _prune(self, written: Path) -> None:
        """Keep `keep_last` checkpoints: `written` (which `latest` names), then the newest steps before
        it. Steps after it were left by the timeline a resume from an earlier checkpoint abandoned: they
        are no continuation of `written`, so they are the first to go (sorting by name alone could
        delete `written` and keep them)."""
        others = [p for p in self.root.glob("step-*") if p.is_dir() and p != written]
        earlier = sorted((p for p in others if p.name < written.name), reverse=True)
        abandoned = sorted(p for p in others if p.name > written.name)
        for old in (earlier + abandoned)[self.keep_last - 1 :]:
            try:
                # its aside first: one left partial, without `old`, would come back as this step
                if _set_aside(old).exists():
                    shutil.rmtree(_set_aside(old))
                shutil.rmtree(old)
            except OSError as error:  # housekeeping: the run goes on, saying that keep_last is not applied
                logger.warning(
                    "%s is saved and %s names it, but train.keep_last %d could not remove the older %s "
                    "(%s: %s): it stays until a later save can remove it",
                    written, self.root / LATEST, self.keep_last, old, type(error).__name__, error,
                )  # fmt: skip
