"""An engine save agrees on every rank that it reached storage all ranks share and that every write
succeeded (see [Note: shared checkpoint storage] in sharding/checkpoint_storage.py). Node-local disks are
simulated on one machine: each rank works in a directory of its own and saves to the same relative path."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch.distributed as dist

import tnlg.sharding.checkpoint_storage as checkpoint_storage
import tnlg.sharding.engine as engine_module
from tests.support.outcomes import raised_or
from tests.support.parallel_cases import tnlg_batches
from tests.support.parallel_checkpoint_cases import build, train_data_share
from tests.support.zero_deepspeed_cases import engine_with_schedule, micro_steps
from tests.support.zero_models import batches, local, make_model, make_optimizer
from tnlg.sharding import ZeroConfig, initialize
from tnlg.tools.spawn import run_distributed

pytestmark = pytest.mark.slow  # every test here launches processes (see pyproject's markers)


def _save(rank: int, world_size: int, root: str, case: str) -> str:
    checkpoint_storage.LATE_FILE_WAIT_S = 1.0  # a failing save waits out its window: short here
    disk = Path(root) / (f"node{rank}" if case in ("node_local", "node_local_made") else "shared")
    disk.mkdir(parents=True, exist_ok=True)
    os.chdir(disk)
    if case == "node_local_made":  # as save_state and the Trainer make it: on every rank
        Path("ckpt").mkdir(exist_ok=True)
    if case == "unwritable" and rank == 1:  # rank 1's shard cannot be written where it belongs
        Path("ckpt/rank-00001.safetensors").mkdir(parents=True, exist_ok=True)
    model = make_model()
    engine = initialize(model, make_optimizer(model), ZeroConfig(stage=1, mixed_precision="no"))
    loss = engine(*local(batches(1)[0], rank, world_size))
    engine.backward(loss)
    engine.step()
    return raised_or(lambda: engine.save_checkpoint("ckpt"), "saved")


@pytest.mark.parametrize("case", ["node_local", "node_local_made", "unwritable"])
def test_a_save_that_not_every_rank_shares_fails_on_every_rank(tmp_path, case):
    results = run_distributed(_save, 2, str(tmp_path), case)
    for result in results:  # each rank raised, none was left waiting in a collective until a timeout
        assert result.startswith("CheckpointError: saving the checkpoint ckpt failed: "), result
        assert "rank 1 (host " in result
    if case == "node_local":
        assert "does not see the directory" in results[0]
    if case == "node_local_made":
        assert "sees no manifest.json" in results[0]
    if case == "unwritable":
        assert "could not write" in results[0]
    # Nothing vouches for the pieces: no manifest where rank 0 saved.
    first = tmp_path / ("shared" if case == "unwritable" else "node0") / "ckpt"
    assert not (first / "manifest.json").exists()


def test_a_shared_save_passes_its_checks(tmp_path):
    assert run_distributed(_save, 2, str(tmp_path), "shared") == ["saved", "saved"]
    assert (tmp_path / "shared" / "ckpt" / "manifest.json").is_file()


def _save_sliced(rank: int, world_size: int, root: str, tensor: int, pipeline: int, unwritable: str) -> str:
    """One step of the tiny TNLG model at tensor x pipeline x data, then a save in which global rank 3's
    file of its part cannot be written (a directory stands where it goes)."""
    engine = build(tensor, stage=2, pipeline=pipeline, layers=4)
    train_data_share(engine, *tnlg_batches(1)[0])
    if rank == 3:
        (Path(root) / "ckpt" / unwritable).mkdir(parents=True)
    dist.barrier()  # the obstacle stands before any rank saves
    try:
        return raised_or(lambda: engine.save_checkpoint(Path(root) / "ckpt"), "saved")
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("tensor", "pipeline", "unwritable"),
    [(2, 1, "tensor-01/rank-00001.safetensors"), (1, 2, "pipeline-01-tensor-00/rank-00001.safetensors")],
    ids=["tensor2-data2", "pipeline2-data2"],
)  # global rank 3 is data rank 1 of the second part: the mesh is (pipeline, data, tensor), tensor innermost
def test_a_part_failing_on_one_rank_fails_the_save_on_every_rank_of_every_part(
    tmp_path, tensor, pipeline, unwritable
):
    results = run_distributed(_save_sliced, 4, str(tmp_path), tensor, pipeline, unwritable, timeout=400)
    for result in results:  # the other part's ranks too: none waits for the top manifest until a timeout
        assert result.startswith("CheckpointError: saving the checkpoint "), result
        assert "rank 3 (host " in result and "could not write" in result, result
    assert not (tmp_path / "ckpt" / "manifest.json").exists()


def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _buggy(*args, **kwargs):
    raise AttributeError("'NoneType' object has no attribute 'state_dict'")  # a bug in the code that writes


_SCHEDULE_FAILURES = {"full_disk": _full_disk, "bug": _buggy}


def _save_with_schedule(rank: int, world_size: int, root: str, failure: str) -> str:
    """A save of an engine with the DeepSpeed JSON's scheduler, rank 0's schedule file failing: a full disk,
    or a bug in the code that writes it (not a file error)."""
    engine = engine_with_schedule()
    micro_steps(engine, 0, 2)  # one boundary: a checkpoint may be taken
    if rank == 0:
        engine_module.save_scheduler_state = _SCHEDULE_FAILURES[failure]
    try:
        return raised_or(lambda: engine.save_checkpoint(Path(root) / "ckpt"), "saved")
    finally:
        engine.close()


def test_the_schedule_file_failing_on_rank_0_fails_the_save_on_every_rank(tmp_path):
    for result in run_distributed(_save_with_schedule, 2, str(tmp_path), "full_disk"):
        assert result.startswith("CheckpointError: saving the checkpoint "), result
        assert "rank 0 (host " in result and "could not write: OSError: [Errno 28] No space left" in result, (
            result
        )
    assert not (tmp_path / "ckpt" / "manifest.json").exists()


def test_a_bug_writing_the_schedule_on_rank_0_is_raised_there_and_named_on_rank_1(tmp_path):
    """Not a file error (see [Note: agreed failures]): rank 0 raises its AttributeError, rank 1 a
    RankFailedError naming it, rather than waiting in the save's next collective."""
    own, other = run_distributed(_save_with_schedule, 2, str(tmp_path), "bug")
    assert own == "AttributeError: 'NoneType' object has no attribute 'state_dict'", own
    assert other.startswith("RankFailedError: saving the checkpoint "), other
    assert "rank 0 (host " in other and "raised AttributeError: 'NoneType' object" in other, other
    assert not (tmp_path / "ckpt" / "manifest.json").exists()
