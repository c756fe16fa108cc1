"""A Transformers Trainer run under DeepSpeed (tests/assets/deepspeed/trainer_stage2_world2, written by
tests/support/deepspeed_trainer_fixture.py with DeepSpeed 0.19 and the Trainer's own optimizer and
schedule) resumed by a ZeroTrainer with the same JSON, at other world sizes and ZeRO stages: the steps
after the checkpoint must log the losses, gradient norms and learning rates the Trainer under DeepSpeed
logged when it resumed."""

from __future__ import annotations

import json

import pytest

from tests.support.deepspeed_trainer_fixture import (
    CHECKPOINT,
    DIRECTORY,
    SAVE_AT,
    STEPS,
    resume_in_zero_trainer,
)
from tnlg.tools.spawn import run_distributed


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
