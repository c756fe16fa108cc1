"""A run checkpoint's writes and reads agree over every rank, as the engine's own save does (see [Note: shared
checkpoint storage] in sharding/checkpoint_storage.py): a failure on one rank is raised on every rank,
naming it, and none is left waiting in a collective until the process group's timeout; a failed save
leaves `latest` naming the previous checkpoint. The failures: a full disk for one rank's file (its write
patched to raise ENOSPC), a `latest` that cannot be replaced (a directory in its place), a path that names
another disk on each node (each rank its own directory), a copy of the checkpoint one rank reads damaged."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tnlg.run.checkpoint as run_checkpoint
import tnlg.sharding.checkpoint_storage as checkpoint_storage
from tests.support.outcomes import raised_or
from tests.support.parallel_cases import tnlg_batches
from tests.support.parallel_checkpoint_cases import build, train_data_share
from tests.support.zero_models import batches, local, make_model, make_optimizer
from tnlg.run.checkpoint import LATEST, RunCheckpointer
from tnlg.run.metrics import LossCurve
from tnlg.sharding import ZeroConfig, initialize
from tnlg.tools.spawn import run_distributed

pytestmark = pytest.mark.slow  # every test here launches processes (see pyproject's markers)


class _Ranks:
    """The accelerator's part a run checkpoint uses, over the process group run_distributed made."""

    def __init__(self) -> None:
        self.process_index, self.num_processes = dist.get_rank(), dist.get_world_size()
        self.is_main_process = self.process_index == 0


def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _buggy(*args, **kwargs):
    raise AttributeError("'NoneType' object has no attribute 'state_dict'")  # a bug in the code that writes


def _read_with_a_bug(*args, **kwargs):
    raise KeyError("rng")  # a bug in the code that reads: a key the file has, looked up under another name


_DAMAGED_COPIES = (
    "no_latest",
    "engine_missing",
    "scheduler_damaged",
    "curve_damaged",
    "run_position_missing",
)


def _trained(rank: int, world_size: int, tensor: int = 1):
    """An engine after one step: the ZeRO test model, or with `tensor` > 1 the tiny TNLG model sliced
    `tensor` ways (data parallel over the rest)."""
    if tensor > 1:
        engine = build(tensor, stage=2)
        train_data_share(engine, *tnlg_batches(1)[0])
    else:
        model = make_model()
        engine = initialize(model, make_optimizer(model), ZeroConfig(stage=2, mixed_precision="no"))
        engine.backward(engine(*local(batches(1)[0], rank, world_size)))
        engine.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)], lr=1.0), lambda _: 1.0)
    return engine, scheduler


def _save(rank: int, world_size: int, root: str, case: str) -> str:
    checkpoint_storage.LATE_FILE_WAIT_S = 1.0  # a failing save waits out its window: short here
    engine, scheduler = _trained(rank, world_size)
    os.chdir(root)
    checkpointer = RunCheckpointer("shared", 2, _Ranks())  # relative: the same path on every rank
    checkpointer.save(1, engine, scheduler, {"batches": 1}, {}, LossCurve())  # a complete one first
    if case == "node_local":  # the same path names a disk of each node's own
        (Path(root) / f"node{rank}").mkdir()
        os.chdir(Path(root) / f"node{rank}")
    if case == "rank_file_full" and rank == 1:
        run_checkpoint.write_rank_state = _full_disk
    if case == "scheduler_full" and rank == 0:
        run_checkpoint.write_scheduler_states = _full_disk
    if case == "scheduler_bug" and rank == 0:  # not a file error: the others waited for rank 0
        run_checkpoint.write_scheduler_states = _buggy
    if case == "latest_unreplaceable" and rank == 0:
        (checkpointer.root / LATEST).unlink()
        (checkpointer.root / LATEST).mkdir()  # the pointer cannot be replaced by a file
    try:
        return raised_or(
            lambda: checkpointer.save(2, engine, scheduler, {"batches": 2}, {}, LossCurve()), "saved"
        )
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("case", "failed_rank", "says"),
    [
        ("rank_file_full", 1, "No space left on device"),
        ("scheduler_full", 0, "No space left on device"),
        ("latest_unreplaceable", 0, "could not write: IsADirectoryError"),
        ("node_local", 1, "does not see the directory"),
    ],
)
def test_a_save_failing_on_one_rank_fails_on_every_rank(tmp_path, case, failed_rank, says):
    results = run_distributed(_save, 2, str(tmp_path), case)
    for result in results:  # each rank raised, none was left waiting in a collective until a timeout
        assert result.startswith("CheckpointError: saving the checkpoint "), result
        if case != "node_local":  # that one is found by the engine's check, naming its own directory
            assert "step-00000002 failed: " in result, result  # named by the checkpoint, not its staging
        assert f"rank {failed_rank} (host " in result and says in result, result
    shared = tmp_path / "shared"
    assert not (shared / ".step-00000002.staging").exists()  # a failed save's pieces do not pile up
    # Nothing moved in (node_local: not to this disk), so `latest` leads to step 1; or it moved in unnamed.
    if case != "latest_unreplaceable":
        assert not (shared / "step-00000002").exists()
        assert json.loads((shared / LATEST).read_text()) == {"checkpoint": "step-00000001"}
    else:  # moved in whole, but unnamed; step 1 is kept
        assert (shared / "step-00000002" / "engine" / "manifest.json").is_file()
        assert (shared / "step-00000001" / "engine" / "manifest.json").is_file()


def test_a_save_that_one_rank_fails_with_a_bug_raises_it_there_and_names_it_on_every_other_rank(tmp_path):
    """Not the checkpoint's nor the storage's error (see [Note: agreed failures]): rank 0 raises its own
    TypeError with its traceback, rank 1 a RankFailedError saying what and where, not a CheckpointError."""
    own, other = run_distributed(_save, 2, str(tmp_path), "scheduler_bug")
    assert own == "AttributeError: 'NoneType' object has no attribute 'state_dict'", own
    assert other.startswith("RankFailedError: saving the checkpoint "), other
    assert "step-00000002 failed: rank 0 (host " in other, other
    assert "raised AttributeError: 'NoneType' object has no attribute 'state_dict' (raised at " in other, (
        other
    )
    assert "in _buggy)" in other, other
    shared = tmp_path / "shared"
    assert not (shared / ".step-00000002.staging").exists() and not (shared / "step-00000002").exists()
    assert json.loads((shared / LATEST).read_text()) == {"checkpoint": "step-00000001"}


def _save_and_load(rank: int, world_size: int, root: str, case: str, tensor: int = 1) -> str:
    checkpoint_storage.LATE_FILE_WAIT_S = 1.0
    engine, scheduler = _trained(rank, world_size, tensor)
    os.chdir(root)
    RunCheckpointer("shared", 2, _Ranks()).save(1, engine, scheduler, {"batches": 1}, {}, LossCurve())
    # The resume, at the same relative path on every rank: the last rank's names a disk of its own that
    # holds nothing (no `latest`), or a checkpoint without its engine manifest, or a copy whose scheduler
    # file is damaged, or whose loss curve or own run position is valid JSON of the wrong shape; or it
    # reads the shared checkpoint with code that has a bug (raising another error than a CheckpointError).
    if rank == world_size - 1 and case in _DAMAGED_COPIES:
        node = Path(root) / f"node{rank}"
        node.mkdir()
        if case == "engine_missing":
            (node / "shared" / "step-00000001").mkdir(parents=True)
            (node / "shared" / LATEST).write_text(json.dumps({"checkpoint": "step-00000001"}))
        if case in ("scheduler_damaged", "curve_damaged", "run_position_missing"):
            shutil.copytree(Path(root) / "shared", node / "shared")
        copy = node / "shared" / "step-00000001"
        if case == "scheduler_damaged":
            (copy / "scheduler.json").write_text("{")
        if case == "curve_damaged":
            (copy / "loss_curve.json").write_text(json.dumps({"steps": 5, "losses": []}))
        if case == "run_position_missing":
            own = json.loads((copy / f"rank-{rank:05d}.json").read_text())
            del own["step"]
            (copy / f"rank-{rank:05d}.json").write_text(json.dumps(own))
        os.chdir(node)
    if rank == world_size - 1 and case == "rank_state_bug":  # not a CheckpointError: the others waited
        run_checkpoint.read_rank_state = _read_with_a_bug
    try:
        return raised_or(
            lambda: RunCheckpointer("shared", 2, _Ranks()).load(LATEST, engine, scheduler), "loaded"
        )
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("case", "tensor", "says"),
    [
        ("no_latest", 1, "holds no checkpoint"),
        ("engine_missing", 1, "manifest"),
        ("scheduler_damaged", 1, "scheduler.json"),
        # the world, not the engine's data group: the other tensor rank's group must not wait in the load
        ("scheduler_damaged", 2, "scheduler.json"),
        ("curve_damaged", 1, "loss_curve.json: the loss curve's 'steps' is not a list of numbers"),
        ("run_position_missing", 1, 'rank-00001.json holds no run position (expected a "step" >= 0'),
    ],
)
def test_a_resume_that_one_rank_cannot_read_fails_on_every_rank(tmp_path, case, tensor, says):
    world_size = 2 * tensor
    results = run_distributed(_save_and_load, world_size, str(tmp_path), case, tensor, timeout=400)
    for result in results:
        assert result.startswith(f"CheckpointError: rank {world_size - 1}: "), result
        assert says in result, result


def test_a_resume_that_one_rank_fails_with_a_bug_raises_it_there_and_names_it_on_every_other_rank(tmp_path):
    own, other = reversed(run_distributed(_save_and_load, 2, str(tmp_path), "rank_state_bug"))
    assert own == "KeyError: 'rng'", own
    assert other.startswith("RankFailedError: rank 1: KeyError: 'rng' (raised at "), other
    assert "in _read_with_a_bug)" in other, other


def _fallback_past_a_bug(rank: int, world_size: int, root: str) -> str:
    """A resume with train.resume_fallback, steps 1 and 2 saved, rank 1's read of step 2 (only) failing with
    a bug: no rank takes it for a damaged checkpoint and falls back to step 1, which would load."""
    engine, scheduler = _trained(rank, world_size)
    os.chdir(root)
    checkpointer = RunCheckpointer("shared", 2, _Ranks())
    for step in (1, 2):
        checkpointer.save(step, engine, scheduler, {"batches": step}, {}, LossCurve())
    read = run_checkpoint.read_rank_state
    if rank == 1:
        run_checkpoint.read_rank_state = lambda path, saved_rank: (
            _read_with_a_bug() if path.name == "step-00000002" else read(path, saved_rank)
        )
    try:
        return raised_or(
            lambda: checkpointer.load(LATEST, engine, scheduler, fallback=True)["step"], "loaded"
        )
    finally:
        engine.close()


def test_a_bug_is_not_skipped_by_the_fallback(tmp_path):
    other, own = run_distributed(_fallback_past_a_bug, 2, str(tmp_path))
    assert own == "KeyError: 'rng'", own
    assert other.startswith("RankFailedError: rank 1: KeyError: 'rng' (raised at "), other


def test_a_shared_save_and_resume_pass_their_checks(tmp_path):
    assert run_distributed(_save, 2, str(tmp_path), "shared") == ["saved", "saved"]
    assert json.loads((tmp_path / "shared" / LATEST).read_text()) == {"checkpoint": "step-00000002"}
    (tmp_path / "again").mkdir()
    assert run_distributed(_save_and_load, 2, str(tmp_path / "again"), "shared") == ["loaded", "loaded"]


def _fallback_where_listings_differ(rank: int, world_size: int, root: str) -> str:
    """A resume with train.resume_fallback whose `latest` is damaged on every rank, where rank 1 lists an
    older checkpoint that rank 0 does not (its copy of the directory is stale): every rank tries rank 0's
    candidates, in its order, so all fail together rather than rank 1 loading alone."""
    checkpoint_storage.LATE_FILE_WAIT_S = 1.0
    engine, scheduler = _trained(rank, world_size)
    os.chdir(root)
    checkpointer = RunCheckpointer("shared", 1, _Ranks())
    checkpointer.save(1, engine, scheduler, {"batches": 1}, {}, LossCurve())
    node = Path(root) / "node1"
    if rank == 1:
        shutil.copytree("shared", node / "shared")  # step 1, which the shared directory is about to prune
    dist.barrier()
    checkpointer.save(2, engine, scheduler, {"batches": 2}, {}, LossCurve())  # keep_last 1: step 1 goes
    if rank == 1:
        shutil.copytree("shared/step-00000002", node / "shared" / "step-00000002")
        shutil.copy("shared/latest", node / "shared" / "latest")
    dist.barrier()
    for disk in (Path(root), node) if rank == 0 else ():
        (disk / "shared" / "step-00000002" / "scheduler.json").write_text("{")
    dist.barrier()
    if rank == 1:
        os.chdir(node)
    try:
        return raised_or(lambda: checkpointer.load(LATEST, engine, scheduler, fallback=True), "loaded")
    finally:
        engine.close()


def test_a_fallback_tries_the_same_checkpoints_on_every_rank(tmp_path):
    results = run_distributed(_fallback_where_listings_differ, 2, str(tmp_path))
    for result in results:
        assert result.startswith("CheckpointError: rank "), result
        assert "step-00000002/scheduler.json" in result, result
