"""A Transformers Trainer run under DeepSpeed (tests/assets/deepspeed/trainer_stage2_world2, written by
tests/support/deepspeed_trainer_fixture.py with DeepSpeed 0.19 and the Trainer's own optimizer and
schedule) resumed by a ZeroTrainer with the same JSON, at other world sizes and ZeRO stages: the steps
after the checkpoint must log the losses, gradient norms and learning rates the Trainer under DeepSpeed
logged when it resumed."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.support.deepspeed_trainer_fixture import (
    CHECKPOINT,
    DIRECTORY,
    SAVE_AT,
    STEPS,
    resume_in_zero_trainer,
)
from tnlg.sharding.deepspeed.zero_checkpoint import read_deepspeed_checkpoint
from tnlg.tools.spawn import RankFailed, run_distributed


@pytest.mark.slow
@pytest.mark.parametrize(("world", "stage"), [(1, 3), (2, 1)])
def test_a_zero_trainer_resumes_a_trainer_run_under_deepspeed(tmp_path, world, stage):
    record = json.loads((DIRECTORY / "record.json").read_text())
    result = run_distributed(
        resume_in_zero_trainer, world, stage, str(tmp_path), str(CHECKPOINT), timeout=600
    )[0]
    assert result["global_step"] == STEPS
    for key in ("losses", "norms", "lrs"):
        ours = {int(step): value for step, value in result[key].items()}
        theirs = {int(step): value for step, value in record["resumed"][key].items()}
        assert sorted(ours) == list(range(1, STEPS + 1))  # steps 1-3 from the checkpoint's trainer state
        for step in range(SAVE_AT + 1, STEPS + 1):
            assert ours[step] == pytest.approx(theirs[step], rel=1e-5), (key, ours, theirs)
    assert record["resumed"] == record["whole"]  # DeepSpeed's own resume is exact


def _copy_without(tmp_path, name: str) -> str:
    copy = tmp_path / CHECKPOINT.name
    shutil.copytree(CHECKPOINT, copy)
    (copy / name).unlink()
    return str(copy)


@pytest.mark.slow
def test_the_weights_come_from_deepspeeds_files_where_the_trainer_saved_none(tmp_path):
    """At ZeRO-3 the Trainer under DeepSpeed saves no model weights beside DeepSpeed's files (without
    stage3_gather_16bit_weights_on_model_save): the resume takes them from the engine's state ("Can't find
    a valid checkpoint" before). Then the best model, still the DeepSpeed run's checkpoint, loads the same way."""
    checkpoint = _copy_without(tmp_path, "model.safetensors")
    record = json.loads((DIRECTORY / "record.json").read_text())
    result = run_distributed(
        resume_in_zero_trainer, 1, 3, str(tmp_path / "out"), checkpoint, True, timeout=600
    )[0]
    for step in range(SAVE_AT + 1, STEPS + 1):
        assert result["losses"][step] == pytest.approx(record["resumed"]["losses"][str(step)], rel=1e-5)
    masters = read_deepspeed_checkpoint(checkpoint).masters
    for name, tensor in masters.items():
        assert torch.equal(result["best"][name], tensor), name


@pytest.mark.slow
def test_a_checkpoint_without_the_trainers_schedule_is_refused_by_name(tmp_path):
    checkpoint = _copy_without(tmp_path, "scheduler.pt")
    with pytest.raises(
        RankFailed, match=r"holds no state of the Trainer's learning-rate schedule \(no scheduler\.pt"
    ):
        run_distributed(resume_in_zero_trainer, 1, 2, str(tmp_path / "out"), checkpoint, timeout=600)
